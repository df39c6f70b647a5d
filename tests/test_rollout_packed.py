"""An engine whose linear weights vLLM-CPU dropped after packing its kernels (vLLM's own behaviour, without titanrl's
plugin; on CUDA nothing packs): a push goes through vLLM's layer-wise reload and gives what titanrl computes. Its own
module: vLLM's parallel state is the process's, so this engine may not live beside test_rollout's."""

from __future__ import annotations

import pytest
import torch
from test_rollout import (  # noqa: F401  (dataset, encoder, requests_: fixtures)
    SAMPLING,
    TOL,
    dataset,
    encoder,
    engine_parameters,
    every_tensor_perturbed,
    requests_,
    titanrl_logprobs,
)


def engine_logprobs_error(engine, model, reqs, seed: int) -> float:
    """The largest gap between the engine's log-probs of its samples and titanrl's ``model``'s."""
    out = engine.generate(reqs, seed=seed, **SAMPLING)
    items = [(r, s.token_ids) for r, g in zip(reqs, out) for s in g]
    ours = titanrl_logprobs(model, items, sampled=SAMPLING)
    return max((a - b).abs().max().item() for a, b in zip(ours, [torch.tensor(s.logprobs) for g in out for s in g]))


@pytest.mark.slow
def test_an_engine_whose_weights_vllm_packed_takes_the_push_through_its_reload(tiny_ckpt, requests_, monkeypatch):
    """Every tensor pushed, then some whole modules back to the checkpoint's values and again to the pushed ones (a
    partial push each time): the engine's log-probs are titanrl's model's after each full state, and the partial
    push of the old values changed them in between."""
    from safetensors.torch import load_file
    from vllm.model_executor.layers import utils

    from titanrl.rollout.vllm_engine import VLLMEngine
    from titanrl.rollout import vllm_plugin
    from titanrl.rollout.vllm_plugin import KEEP_WEIGHTS_ENV
    from titanrl.rollout.weights import tensors_layout

    # the process as titanrl's engines leave it (vLLM loads its plugins once per process), then vLLM-CPU as it is
    # for this engine: the plugin off, its GEMM dispatch unwrapped (both put back after the test)
    monkeypatch.setenv(KEEP_WEIGHTS_ENV, "1")
    vllm_plugin.register()
    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", utils.dispatch_cpu_unquantized_gemm.__wrapped__)
    monkeypatch.setenv(KEEP_WEIGHTS_ENV, "0")
    engine = VLLMEngine(tiny_ckpt, dtype="float32", max_model_len=1024, kv_cache_bytes=64 << 20, seed=0)
    try:
        assert not engine.in_place
        assert any(p.numel() == 0 for p in engine_parameters(engine).values())  # the weights dropped
        reqs = list(requests_.values())
        model, tensors = every_tensor_perturbed(tiny_ckpt)
        engine.update_weights(tensors_layout(tensors.items()), iter(tensors.items()))
        assert engine_logprobs_error(engine, model, reqs, seed=31) < TOL
        original = load_file(str(tiny_ckpt / "model.safetensors"))
        modules = ("lm_head.", "model.layers.0.self_attn.")  # whole engine modules (q/k/v fused)
        back = {k: v for k, v in original.items() if k.startswith(modules)}
        engine.update_weights(tensors_layout(back.items()), iter(back.items()))
        assert engine_logprobs_error(engine, model, reqs, seed=31) > 100 * TOL
        again = {k: v for k, v in tensors.items() if k.startswith(modules)}
        engine.update_weights(tensors_layout(again.items()), iter(again.items()))
        assert engine_logprobs_error(engine, model, reqs, seed=31) < TOL
    finally:
        engine.close()
