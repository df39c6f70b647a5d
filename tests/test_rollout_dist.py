"""vLLM engines inside torchrun ranks, as the trainer builds them: each rank's engine through vLLM's external
launcher on its own device (here the CPU: the same launcher code), one engine over T ranks with T = 2, the trainer's
in-memory weight push from FSDP2 shards (no file anywhere), and the trainer's process group intact afterwards. Run as
a script under torchrun by the tests (two ranks)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from train_runs import failure_report


def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _uneven_gather(info) -> float:
    """The bucketed gather on shards of uneven and empty rows (3 rows and 1 row over 2 ranks, a bias, a scalar
    replicated), in float32 and cast to bfloat16: max difference to the full tensors."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from titanrl.distributed import build_dp_mesh
    from titanrl.rl.weight_sync import gather_full_state

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 1), torch.nn.Linear(1, 7))
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fully_shard(model, mesh=build_dp_mesh(info))
    worst = 0.0
    for dtype, buckets in ((None, 1 << 30), (torch.bfloat16, 16)):  # one bucket; a bucket per tensor or two
        got = dict(gather_full_state(model, dtype, bucket_bytes=buckets))
        assert list(got) == list(full)
        for k, v in full.items():
            want = v if dtype is None else v.to(dtype)
            assert got[k].dtype == want.dtype and got[k].shape == want.shape, k
            worst = max(worst, (got[k].float() - want.float()).abs().max().item())
    return worst


def rank_main(ckpt: str, out_dir: str, manifest: str) -> None:
    """One launch, both layouts in turn: T = 1 (an engine per rank), closed, then T = 2 (one engine over both ranks)
    built in the same processes, so the second also shows that a closed engine leaves nothing behind that a new one
    trips on."""
    import torch.distributed as dist

    from titanrl.distributed import init_distributed

    info = init_distributed(timeout_s=120)
    assert dist.is_initialized() and info.world_size == 2
    for tp in (1, 2):
        result = _engine_case(ckpt, manifest, tp, info)
        Path(out_dir, f"rank{info.rank}_tp{tp}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _engine_case(ckpt: str, manifest: str, tp: int, info) -> dict:
    import numpy as np
    import torch
    import torch.distributed as dist

    from titanrl.config import JobConfig
    from titanrl.data.manifest import read_manifest
    from titanrl.data.preprocess import MediaSettings, prepare_sample
    from titanrl.data.prompt import PromptEncoder
    from titanrl.distributed import all_reduce_sum, block_group, build_dp_mesh
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs
    from titanrl.parallel.parallelize import build_parallel_model
    from titanrl.rl.batch import Trajectory, pack_trajectories
    from titanrl.rl.weight_sync import WeightPusher
    from titanrl.rollout import RolloutRequest, build_rollout_engine
    from titanrl.rollout.launch import engine_launch

    shm_before = _shm_entries()
    cfg = JobConfig()
    cfg.rollout.kv_cache_bytes = 32 << 20
    cfg.data.max_pixels = 28 * 28 * 8  # overrides the checkpoint's limit on both sides
    env_before = {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "LD_PRELOAD", "RANK", "WORLD_SIZE")}
    launch = engine_launch(info.rank, info.local_rank, info.world_size, tp, "cpu", process_group=True)
    engine = build_rollout_engine(cfg, Path(ckpt), info.rank, launch=launch,
                                  tp_group=block_group(info.rank, info.world_size, tp, 120))
    env_after = {k: os.environ.get(k) for k in env_before}

    encoder = PromptEncoder.from_pretrained(ckpt)
    prompt = f"Rank {info.rank} asks: what colour is the sky?"
    request = RolloutRequest(encoder.render(prompt), encoder.encode(prompt, []))
    settings = MediaSettings.from_checkpoint(ckpt, fps=cfg.data.fps, max_frames=cfg.data.max_frames,
                                             min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels)
    (record,) = read_manifest(manifest)
    prepared = prepare_sample(record, Path(manifest).parent, encoder, settings)
    image = RolloutRequest.from_prepared(prepared, encoder, key=f"image{info.rank}")
    assert image.grids[0].num_patches * 14 * 14 <= cfg.data.max_pixels
    # Rank 1 asks for nothing the first time: an engine over both ranks still runs rank 0's prompts.
    mine = [request, image] if info.rank == 0 or tp == 1 else []
    out = engine.generate(mine, n=2, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=7)
    assert len(out) == len(mine)
    out = engine.generate([request, image], n=2, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=7)
    # The trainer's group still works (vLLM made its own groups from it, collectively).
    total = all_reduce_sum(torch.tensor([float(len(out[0][0].token_ids))]))

    # the trainer's model: FSDP2 over both ranks, a real update's worth of change, pushed in memory
    args = Qwen2_5_VLArgs.from_pretrained(ckpt)
    model = build_parallel_model(args, ckpt, device=info.device, dp_mesh=build_dp_mesh(info))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0 + 0.2 * torch.randn_like(p))  # each rank its own shards
    pusher = WeightPusher(args, info, torch.float32, timeout_s=120)
    timings = pusher.push(model, engine)
    after = engine.score_many([(image, out[1][0].token_ids)])[0]
    t = Trajectory(prompt=prepared, group=0, response_index=0,
                   response_ids=np.asarray(out[1][0].token_ids, dtype=np.int64))
    pack = pack_trajectories([t], args, info.device, torch.float32, temperature=1.0)
    with torch.no_grad():
        ours = model(pack.batch, pack.targets).logprobs.float().cpu().numpy()
    uneven = _uneven_gather(info)
    engine.close()
    dist.barrier()  # closing the engine left the trainer's process group alone
    result = {
        "rank": info.rank,
        "layout": engine.layout,
        "tokens": [s.token_ids for s in out[0]],
        "total_tokens_over_ranks": total.item(),
        "env_unchanged": env_before == env_after,
        "sync_s": timings["sync/gather_s"] + timings["sync/load_s"],
        "probe": float(np.abs(np.array(after) - ours).max()),
        "logprob_change": float(np.abs(np.array(after) - np.array(out[1][0].logprobs)).max()),
        "uneven_gather": uneven,
        "new_shm": sorted(_shm_entries() - shm_before),
        "engine_start_s": engine.start_s,
    }
    return result




def _own_shm(cmd: list[str]) -> list[str]:
    """``cmd`` in a mount namespace of its own with an empty /dev/shm: what appears there is this run's alone, so the
    test may run beside others (root and util-linux's ``unshare``, as CI has; else the test is skipped, naming why)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and `unshare` for a /dev/shm of the run's own")
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount -t tmpfs -o size=512m tmpfs /dev/shm && exec "$@"', "sh", *cmd]


@pytest.mark.slow
def test_engines_in_torchrun_ranks_take_an_in_memory_push(tiny_ckpt, tmp_path):
    """Each rank hands vLLM its own rank and device (external launcher); with T = 2 one engine spans both ranks
    (tensor-parallel group [0, 1]) and runs both ranks' prompts in one schedule, rank 1 calling with none at first.
    After a push from FSDP2 shards the engine's log-probs equal the trainer's model (<= 1e-4, float32) and moved,
    and no weights went to /dev/shm. One launch: T = 1, closed, then T = 2 in the same ranks."""
    from titanrl.data.synth import generate_dataset

    manifest = generate_dataset(tmp_path / "data", "image-heavy", 1, seed=0)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parent))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           __file__, str(tiny_ckpt), str(tmp_path), str(manifest)]
    proc = subprocess.run(_own_shm(cmd), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, failure_report(proc)
    for tp in (1, 2):
        _check_case([json.loads((tmp_path / f"rank{r}_tp{tp}.json").read_text()) for r in range(2)], tp)


def _check_case(results: list[dict], tp: int) -> None:
    for r in results:
        print(f"T={tp} rank {r['rank']}: engine start {r['engine_start_s']:.1f} s, push {r['sync_s']:.3f} s, "
              f"probe {r['probe']:.2e}, layout {r['layout']}")
        (layout,) = r["layout"]
        assert layout["backend"] == "external_launcher" and layout["device"] == "cpu" and layout["in_place"]
        assert (layout["rank"], layout["local_rank"]) == (r["rank"], r["rank"])
        assert layout["tp_ranks"] == ([0, 1] if tp == 2 else [r["rank"]]) and layout["world_ranks"] == [0, 1]
        assert r["env_unchanged"]
        assert r["probe"] < 1e-4  # the engine holds exactly the trainer's weights
        assert r["logprob_change"] > 1e-2  # ... which moved
        assert r["uneven_gather"] == 0.0
        # the push wrote nothing to shared memory, and closing the engine removed what vLLM made there (T = 2: its
        # CPU all-reduce buffers, which its C++ manager never unlinks)
        assert r["new_shm"] == []
        assert len(r["tokens"]) == 2
    assert results[0]["total_tokens_over_ranks"] == sum(len(r["tokens"][0]) for r in results)


if __name__ == "__main__":
    rank_main(sys.argv[1], sys.argv[2], sys.argv[3])
