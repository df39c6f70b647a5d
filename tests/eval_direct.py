"""An evaluation computed without the trainer, for ``test_eval``: the held-out prompts of a run's manifest, prepared
and generated on one vLLM engine in this process (run as a script, in a child of the test), scored by the reward
function called directly; writes every response as JSON.

    python tests/eval_direct.py RUN_DIR MANIFEST OUT_JSON
"""

from __future__ import annotations

import json
import os
import sys
import tomllib
from pathlib import Path


def main(run_dir: Path, manifest: Path, out: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from titanrl.data.manifest import read_manifest
    from titanrl.data.preprocess import MediaSettings, prepare_sample
    from titanrl.data.prompt import PromptEncoder
    from titanrl.rl.evaluation import _EVAL_STREAM
    from titanrl.rl.reward_runner import normalize_output
    from titanrl.rl.rewards import load_reward
    from titanrl.rollout.types import RolloutRequest
    from titanrl.rollout.vllm_engine import VLLMEngine

    cfg = tomllib.loads((run_dir / "config.toml").read_text())
    model_dir = Path(cfg["model"]["cache_dir"]) / "models" / "qwen2_5_vl_tiny_seed0"
    encoder = PromptEncoder.from_pretrained(model_dir)
    settings = MediaSettings.from_checkpoint(model_dir, fps=cfg["data"]["fps"], max_frames=cfg["data"]["max_frames"])
    records = read_manifest(manifest)[:cfg["eval"]["max_prompts"] or None]
    prepared = [prepare_sample(r, manifest.parent, encoder, settings) for r in records]
    requests = [RolloutRequest.from_prepared(p, encoder, key=f"eval:{r.id}") for r, p in zip(records, prepared)]
    engine = VLLMEngine(model_dir, max_model_len=cfg["model"]["max_seq_len"],
                        kv_cache_bytes=cfg["rollout"]["kv_cache_bytes"], seed=cfg["job"]["seed"])
    results = engine.generate(requests, n=cfg["eval"]["n"], temperature=cfg["eval"]["temperature"], top_p=1.0,
                              max_new_tokens=cfg["rollout"]["max_new_tokens"],
                              seed=cfg["job"]["seed"] * 1_000_003 + _EVAL_STREAM)
    reward = load_reward(cfg["rl"]["reward"])
    rows = []
    for record, samples in zip(records, results):
        for k, sample in enumerate(samples):
            text = encoder.tokenizer.decode(list(sample.token_ids), skip_special_tokens=True)
            result = normalize_output(reward(text, record))
            rows.append({"id": record.id, "source": record.source, "response_index": k, "response": text,
                         "tokens": len(sample.token_ids), "reward": result.score, "correct": result.correct})
    out.write_text(json.dumps(rows))
    os._exit(0)  # the engine's threads and vLLM's exit hooks: nothing to keep


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
