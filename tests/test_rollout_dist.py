"""vLLM engines inside torchrun ranks (the trainer's layout): each rank builds its own in-process
engine from the job config after the trainer's gloo process group exists, samples its own share
of prompts, takes a weight push, and closes -- and the trainer's process group survives all of
it. Run as a script under torchrun by the test (two ranks, one engine each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from train_runs import failure_report


def rank_main(ckpt: str, out_dir: str, manifest: str) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from titanrl.config import JobConfig
    from titanrl.data.manifest import read_manifest
    from titanrl.data.preprocess import MediaSettings, prepare_sample
    from titanrl.data.prompt import PromptEncoder
    from titanrl.distributed import all_reduce_sum, init_distributed
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs, Qwen2_5_VLModel, load_hf_weights
    from titanrl.rl.weight_sync import WeightPusher
    from titanrl.rollout import RolloutRequest, build_rollout_engine

    info = init_distributed(timeout_s=120)
    assert dist.is_initialized() and info.world_size == 2
    cfg = JobConfig()
    cfg.rollout.kv_cache_bytes = 32 << 20
    cfg.data.max_pixels = 28 * 28 * 8  # overrides the checkpoint's limit on both sides
    env_before = {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "LD_PRELOAD", "RANK", "WORLD_SIZE")}
    engine = build_rollout_engine(cfg, Path(ckpt), info.rank)
    env_after = {k: os.environ.get(k) for k in env_before}

    encoder = PromptEncoder.from_pretrained(ckpt)
    prompt = f"Rank {info.rank} asks: what colour is the sky?"
    request = RolloutRequest(encoder.render(prompt), encoder.encode(prompt, []))
    settings = MediaSettings.from_checkpoint(ckpt, fps=cfg.data.fps, max_frames=cfg.data.max_frames,
                                             min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels)
    (record,) = read_manifest(manifest)
    image = RolloutRequest.from_prepared(prepare_sample(record, Path(manifest).parent, encoder, settings), encoder)
    assert image.grids[0].num_patches * 14 * 14 <= cfg.data.max_pixels
    # The engine's prompt-id check passes only if vLLM applied the same pixel limit.
    out = engine.generate([request, image], n=2, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=7)
    # The trainer's group still works (vLLM made its own groups from it, collectively).
    total = all_reduce_sum(torch.tensor([float(len(out[0][0].token_ids))]))

    args = Qwen2_5_VLArgs.from_pretrained(ckpt)
    model = Qwen2_5_VLModel(args)
    load_hf_weights(model, ckpt)
    with torch.no_grad():
        model.output.weight.mul_(1.5)
    pusher = WeightPusher("test_rollout_dist", args, Path(ckpt), info, torch.float32)  # the trainer's push
    timings = pusher.push(model, engine)
    after = engine.score(request, out[0][0].token_ids)
    pusher.close()
    engine.close()
    dist.barrier()  # closing the engine left the trainer's process group alone
    result = {
        "rank": info.rank,
        "tokens": [s.token_ids for s in out[0]],
        "total_tokens_over_ranks": total.item(),
        "env_unchanged": env_before == env_after,
        "sync_s": timings["sync/export_s"] + timings["sync/load_s"],
        "logprob_change": float(np.abs(np.array(after) - np.array(out[0][0].logprobs)).max()),
        "engine_start_s": engine.start_s,
    }
    Path(out_dir, f"rank{info.rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.slow
def test_one_engine_per_torchrun_rank(tiny_ckpt, tmp_path):
    from titanrl.data.synth import generate_dataset

    manifest = generate_dataset(tmp_path / "data", "image-heavy", 1, seed=0)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parent))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           __file__, str(tiny_ckpt), str(tmp_path), str(manifest)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, failure_report(proc)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        print(f"rank {r['rank']}: engine start {r['engine_start_s']:.1f} s, weight push {r['sync_s']:.2f} s")
        assert r["env_unchanged"]
        assert r["logprob_change"] > 1e-3  # the push reached the engine
        assert len(r["tokens"]) == 2
    assert results[0]["total_tokens_over_ranks"] == sum(len(r["tokens"][0]) for r in results)


if __name__ == "__main__":
    rank_main(sys.argv[1], sys.argv[2], sys.argv[3])
