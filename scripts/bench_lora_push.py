"""How a LoRA run's engines should get the policy: merged weights (titanrl's push) or vLLM's own LoRA adapters.

    python scripts/bench_lora_push.py            # -> benchmarks/lora_push.{json,md}

Issue 45 asks for whichever of the two is faster. One process per model and way, 1 thread (one rank's share of the
2-core machine), an in-process vLLM engine as a colocated rank has it, model dtype float32 (the CPU default), LoRA
rank 16 (alpha 32) on every decoder-layer projection (``benchmarks/lora.md``'s setting). Each of ``--pushes`` timed
steps (after one warm-up) gives every adapter's B a new value (a training step's change) and then:

- ``merged`` (titanrl's push, ``titanrl.rl.weight_sync.hf_state``): the whole model with the adapters folded in
  (``W + alpha/r B A``), handed by reference to vLLM's layer-wise reload, then the caches reset (as
  ``VLLMEngine.update_weights``); the engine generates without LoRA;
- ``merged-adapted``: the same, but only the adapted layers' merged weights are sent (what changed);
- ``vllm-lora``: the adapters written as a PEFT folder into /dev/shm (``titanrl.rl.weight_sync.write_adapters``, the
  export's writer) and loaded by vLLM (``add_lora``, a new adapter id per step, the last one removed); the engine,
  built with ``enable_lora``, generates with the adapter (vLLM's LoRA layers beside the base weights).

Then the same rollout: ``--prompts`` text prompts of ``--prompt-tokens`` random ids, ``n = 8`` samples of exactly
``--new-tokens`` tokens each (``ignore_eos``), seeded per prompt. The report gives the push's seconds, the
generation's seconds and their sum per step (medians), and checks that the ways sample the same tokens with the same
log-probs in the first timed step (the adapters are really applied). Text prompts only: the adapters are on the
language model, the vision tower's cost is the same in every way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_common import provenance, provenance_text  # noqa: E402

WAYS = ("merged", "merged-adapted", "vllm-lora")
RANK, ALPHA = 16, 32.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def worker(opts) -> None:
    import numpy as np
    import torch

    from titanrl.config.job_config import LoRAConfig
    from titanrl.models.lora import lora_layers
    from titanrl.assets import tiny_checkpoint
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs
    from titanrl.parallel.parallelize import build_parallel_model
    from titanrl.rl.weight_sync import hf_state, write_adapters
    from titanrl.rollout.vllm_engine import _reload_tensors, set_vllm_env

    torch.set_num_threads(1)
    ckpt = tiny_checkpoint("~/.cache/titanrl", opts.flavor, 0)  # the trainer's cache
    args = Qwen2_5_VLArgs.from_pretrained(ckpt)
    lora = LoRAConfig(rank=RANK, alpha=ALPHA)
    model = build_parallel_model(args, ckpt, device=torch.device("cpu"), dp_mesh=None, lora=lora, seed=0)
    layers = dict(lora_layers(model))

    def new_adapters(step: int) -> None:  # a training step's change, the same in every way
        gen = torch.Generator().manual_seed(1000 + step)
        with torch.no_grad():
            for _, layer in sorted(layers.items()):
                w = layer.lora_b.weight
                w.copy_(torch.randn(w.shape, generator=gen) * 0.05)

    set_vllm_env()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    kwargs = dict(model=str(ckpt), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=256 << 20,
                  max_model_len=2048, enable_chunked_prefill=False, enable_prefix_caching=True, seed=0,
                  disable_log_stats=True, limit_mm_per_prompt={"image": 1, "video": 1}, mm_processor_cache_gb=0)
    if opts.way == "vllm-lora":
        kwargs.update(enable_lora=True, max_lora_rank=RANK, max_loras=1, max_cpu_loras=1)
    llm = LLM(**kwargs)
    rng = np.random.default_rng(0)
    vocab = args.text.vocab_size - 16  # below the special and vision ids
    prompts = [TokensPrompt(prompt_token_ids=rng.integers(0, vocab, opts.prompt_tokens).tolist())
               for _ in range(opts.prompts)]
    params = [SamplingParams(n=8, temperature=1.0, top_p=1.0, top_k=0, max_tokens=opts.new_tokens, ignore_eos=True,
                             logprobs=0, seed=17 + i) for i in range(opts.prompts)]
    adapted = tuple(f".{t}." for t in TARGETS)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    folder = Path(tempfile.mkdtemp(prefix="titanrl-bench-lora-", dir=shm))
    steps, first, base = [], None, None

    def samples(outs) -> list:
        return [[[list(c.token_ids), [float(s[t].logprob) for t, s in zip(c.token_ids, c.logprobs)]]
                 for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]

    try:
        if opts.way == "merged":  # the check's control: the base model's samples (no adapter), before any push
            base = samples(llm.generate(prompts, params, use_tqdm=False))
        for step in range(opts.pushes + 1):
            new_adapters(step)
            request = None
            t0 = time.perf_counter()
            if opts.way.startswith("merged"):
                stream = hf_state(model, args, None)
                if opts.way == "merged-adapted":
                    stream = ((n, t) for n, t in stream if any(a in n for a in adapted))
                llm.collective_rpc(_reload_tensors, args=(stream,))
                llm.llm_engine.reset_encoder_cache()
                llm.reset_prefix_cache()
                llm.reset_mm_cache()
            else:
                out = folder / f"step-{step}"
                write_adapters(model, out, writer_rank=True, rank=RANK, alpha=ALPHA, dropout=0.0, base=str(ckpt))
                request = LoRARequest(f"step-{step}", step + 1, str(out))
                llm.llm_engine.add_lora(request)
                if step:
                    llm.llm_engine.remove_lora(step)
                llm.reset_prefix_cache()
            push_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=request)
            gen_s = time.perf_counter() - t0
            if step:
                steps.append({"push_s": push_s, "generate_s": gen_s})
            if step == 1:
                first = samples(outs)
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    Path(opts.out).write_text(json.dumps({"steps": steps, "first": first, "base": base}))
    os._exit(0)  # vLLM's shutdown of an in-process engine is slow and prints; the numbers are written


def compare(a: list, b: list) -> dict:
    """Same sampled tokens, and the largest log-prob difference where they are."""
    same = total = 0
    diff = 0.0
    for pa, pb in zip(a, b):
        for (ta, la), (tb, lb) in zip(pa, pb):
            total += 1
            if ta == tb:
                same += 1
                diff = max(diff, max(abs(x - y) for x, y in zip(la, lb)))
    return {"same_samples": same, "samples": total, "max_logprob_diff": diff}


def run(flavor: str, way: str, opts) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, __file__, "--worker", "--flavor", flavor, "--way", way, "--out", str(out),
               "--pushes", str(opts.pushes), "--prompts", str(opts.prompts), "--prompt-tokens",
               str(opts.prompt_tokens), "--new-tokens", str(opts.new_tokens)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode or not out.is_file():
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        data = json.loads(out.read_text())
    med = {k: statistics.median(s[k] for s in data["steps"]) for k in ("push_s", "generate_s")}
    med["total_s"] = statistics.median(s["push_s"] + s["generate_s"] for s in data["steps"])
    return {"flavor": flavor, "way": way, **med, "steps": data["steps"], "first": data["first"], "base": data["base"]}


def report(data: dict) -> str:
    o = data["options"]
    lines = [
        "# LoRA: merged weights or vLLM's adapters in the engine",
        "",
        f"Generated by `scripts/bench_lora_push.py` from `benchmarks/lora_push.json` (do not edit); "
        f"{provenance_text(data['provenance'])}. One process x 1 thread per model and way (one rank's share), an "
        "in-process vLLM engine, float32, LoRA rank 16 (alpha 32) on every decoder-layer projection. Each step gives "
        f"every adapter a new B, pushes it, and generates {o['prompts']} text prompts of {o['prompt_tokens']} tokens "
        f"x 8 samples of {o['new_tokens']} tokens; medians of {o['pushes']} steps after one warm-up. CPU only: not "
        "yet run on a GPU.",
        "",
        "| model | way | push s | generate s | push + generate s | vs merged |",
        "|---|---|---|---|---|---|",
    ]
    for flavor in o["flavors"]:
        rows = {r["way"]: r for r in data["runs"] if r["flavor"] == flavor}
        base = rows["merged"]["total_s"]
        for way in WAYS:
            r = rows[way]
            ratio = "-" if way == "merged" else f"{r['total_s'] / base:.2f}x"
            lines.append(f"| {flavor} | {way} | {r['push_s']:.3f} | {r['generate_s']:.3f} | {r['total_s']:.3f} | "
                         f"{ratio} |")
    lines += ["", "Same samples in the first timed step (the ways sample alike when their logits agree):", ""]
    for c in data["checks"]:
        lines.append(f"- {c['flavor']}, {c['way']} against merged: {c['same_samples']} of {c['samples']} samples "
                     "the same tokens" + (f"; their log-probs differ by at most {c['max_logprob_diff']:.2e}."
                                          if c["same_samples"] else "."))
    lines += ["", "What it shows and does not:", ""]
    for flavor in o["flavors"]:
        rows = {r["way"]: r for r in data["runs"] if r["flavor"] == flavor}
        m, a, v = rows["merged"], rows["merged-adapted"], rows["vllm-lora"]
        faster = "merged weights" if m["total_s"] <= v["total_s"] else "vLLM's adapters"
        lines.append(
            f"- {flavor}: {faster} win. vLLM's adapters push in {v['push_s']:.3f} s against {m['push_s']:.3f} s "
            f"({a['push_s']:.3f} s for the adapted layers alone) but generate in {v['generate_s']:.3f} s against "
            f"{m['generate_s']:.3f} s: vLLM's LoRA layers run the adapter's two GEMMs (punica's CPU path) beside "
            "each base GEMM on every token, which costs far more than the reload saves.")
    lines += [
        "- Not measured: a GPU, where vLLM's LoRA kernels (punica) cost a different share of a decode step and the "
        "merged push moves device memory over NVLink (`benchmarks/weight_sync.md` projects ~0.1 s for 7B); several "
        "engines over ranks; images.",
        "",
        "Reproduce: `python scripts/bench_lora_push.py`.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--flavor", default="small")
    p.add_argument("--way", choices=WAYS, default="merged")
    p.add_argument("--out", default="")
    p.add_argument("--flavors", nargs="+", default=["small", "tiny"])
    p.add_argument("--pushes", type=int, default=6)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--dest", default=str(ROOT / "benchmarks" / "lora_push"))
    opts = p.parse_args()
    if opts.worker:
        return worker(opts)
    runs, checks = [], []
    for flavor in opts.flavors:
        for way in WAYS:
            runs.append(run(flavor, way, opts))
            print(f"{flavor} {way}: push {runs[-1]['push_s']:.3f} s, generate {runs[-1]['generate_s']:.3f} s",
                  flush=True)
        base = next(r for r in runs if r["flavor"] == flavor and r["way"] == "merged")
        checks.append({"flavor": flavor, "way": "the base model (no adapter; the check's control)",
                       **compare(base["first"], base["base"])})
        for r in runs:
            if r["flavor"] == flavor and r["way"] != "merged":
                checks.append({"flavor": flavor, "way": r["way"], **compare(base["first"], r["first"])})
    for r in runs:
        r.pop("first")
        r.pop("base")
    data = {"provenance": provenance(), "options": {k: getattr(opts, k) for k in
            ("flavors", "pushes", "prompts", "prompt_tokens", "new_tokens")}, "runs": runs, "checks": checks}
    dest = Path(opts.dest)
    dest.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    dest.with_suffix(".md").write_text(report(data))
    print(dest.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
