"""Rollout engines: sample responses (with log-probs) for prompts, take weight updates in place.

    engine = build_rollout_engine(cfg, model_dir, rank)           # vLLM (default) or HF generate
    groups = engine.generate(requests, n=4, temperature=1.0, top_p=1.0, max_new_tokens=32, seed=s)
    WeightPusher(...).push(model, engine)                         # after each update, in memory (titanrl.rl.weight_sync)
    probe_logprobs(engine, requests[0], groups[0][0].token_ids)   # compare with the trainer's

Heavy imports (vllm, transformers) happen inside the engine constructors only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from titanrl.rollout.types import (
    PromptMismatchError,
    RolloutEngine,
    RolloutRequest,
    RolloutSample,
    WeightsMismatchError,
    probe_logprobs,
    request_seed,
)

if TYPE_CHECKING:
    from titanrl.rollout.hf_engine import HFGenerateEngine
    from titanrl.rollout.vllm_engine import VLLMEngine

from titanrl.rollout.build import build_rollout_engine, mm_limits_for  # noqa: E402

__all__ = [
    "HFGenerateEngine",
    "PromptMismatchError",
    "RolloutEngine",
    "RolloutRequest",
    "RolloutSample",
    "VLLMEngine",
    "WeightsMismatchError",
    "build_rollout_engine",
    "mm_limits_for",
    "probe_logprobs",
    "request_seed",
]


def __getattr__(name: str):
    if name == "VLLMEngine":
        from titanrl.rollout.vllm_engine import VLLMEngine

        return VLLMEngine
    if name == "HFGenerateEngine":
        from titanrl.rollout.hf_engine import HFGenerateEngine

        return HFGenerateEngine
    raise AttributeError(name)
