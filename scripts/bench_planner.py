"""Benchmark the FlexUlysses planner, its baselines and the ODC partitioners against the papers.

    python scripts/bench_planner.py [--seeds 5] [--out benchmarks] [--milp SECONDS] [--report-only]

Writes ``benchmarks/planner.md`` (tables + the targets, met or not), ``benchmarks/planner.json``
(every number) and ``benchmarks/planner.png``. CPU only; ~2-4 minutes on 2 cores (plus the
optional MILP reference, which needs scipy).

Workloads (``titanrl/parallel/flex_ulysses/workloads.py`` documents the generators):

- FlexRL: image-heavy / video-heavy / only-video mixtures of Geo3K-, NExTQA- and LongVILA-like
  samples at paper scale (Qwen2.5-VL token counts, 2 fps, <= 256 frames, responses <= 1024) on
  32 / 64 / 128 devices with global batches 64 / 128 / 256 (the paper's settings, p_max 8). The
  main table plans one sequence per prompt -- two sequences per device, which is what one
  micro-batch of the paper's runs holds; a second table plans the whole GRPO group of 8 responses
  per prompt.
- ODC: AIME-like GRPO lengths (8 devices, minibatch 2-16 per device, 8 minibatches per step) and
  LongAlign-like SFT lengths (8 devices, minibatch 1-8), microbatches capped at the dataset's
  maximum length (ODC's packing ratio 1). Bubble rates as in ODC appendix G.

Metrics per plan: attention balance ratio (max / mean of ``sum h^2/p``, FlexRL Fig. 7), its lower
bound (``max(mean, max_i h_i^2 / p_max)`` / mean: no plan does better), the balance of the
method's own objective (verl's ``24576 s + s^2`` for the baselines, ``h^2`` for ``flex``, 7B
attention + linear FLOPs for ``flex_full``), memory ratio (max / mean
tokens) and whether the 1.1x cap holds, all-to-all volume (``sum h (p-1)/p`` as a fraction of the
batch's tokens: the share of tokens every all-to-all moves), planning time (best of 5 after a
warm-up, ``time.perf_counter``), and the balance of the full VLM cost: 7B-shaped attention +
linear FLOPs of the shard plan plus the vision tower where each method runs it -- bucketing on the
rank holding the sample, fixed SP on *every* rank of the SP group (verl does not split the ViT),
FlexUlysses where ``plan_vision`` puts it. ``full max/ideal`` divides the busiest device's full cost
by the useful work per device, so the redundant ViT of fixed SP shows up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from titanrl.parallel.balance import STRATEGIES, batch_bubble_rate, partition_batch
from titanrl.parallel.cost_model import CostModel
from titanrl.parallel.flex_ulysses import plan_bucketing, plan_fixed_sp, plan_shards, plan_vision
from titanrl.parallel.flex_ulysses.plan import ShardPlan
from titanrl.parallel.flex_ulysses.workloads import (
    AIME_PROMPT_MAX,
    AIME_RESPONSE_MAX,
    FLEXRL_MIXTURES,
    LONGALIGN_MAX,
    VLMBatch,
    aime_rl_lengths,
    longalign_sft_lengths,
    vlm_batch,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import provenance  # noqa: E402

SETTINGS = ((32, 64), (64, 128), (128, 256))  # (devices, global batch)
METHODS = ("bucketing", "sp2", "sp4", "sp8", "flex", "flex_full")
PAPER = {"bucketing": 6.70, "sp": 1.12, "flex": 1.00}  # FlexRL Fig. 7, image-heavy, 32 GPUs
ODC_RL_7B = {2: (40.15, 20.79, 16.85), 4: (32.41, 7.48, 0.53), 8: (23.40, 3.93, 0.06), 16: (13.45, 1.90, 0.01)}
ODC_SFT_7B = {1: (63.85, 63.85), 2: (48.31, 42.71), 4: (30.31, 7.19), 8: (17.77, 0.03)}  # LB-Micro coll., LB-Mini ODC


def best_time(fn: Callable[[], object], repeats: int = 5, clock: Callable[[], float] = time.perf_counter) -> float:
    """Best of ``repeats`` runs after a warm-up. The machine is shared (2 cores, other jobs), so
    wall time (``perf_counter``) can include waiting for a core; ``process_time`` counts only this
    process's CPU time."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times)


@dataclass
class Row:
    method: str
    balance: float
    objective: float
    bound: float
    memory: float
    memory_ok: bool
    a2a: float
    full_balance: float
    full_max_over_ideal: float
    ms: float


def full_cost(plan: ShardPlan, batch: VLMBatch, method: str, model: CostModel) -> tuple[float, float, float]:
    """(full-cost balance, max / ideal, planning ms of plan_vision) for one plan."""
    llm = model.attention_coef * np.asarray(plan.device_attention_cost) + model.linear_coef * np.asarray(
        plan.device_tokens, dtype=np.float64
    )
    sample_vision = np.array([float(np.sum(model.vision(np.asarray(p, dtype=np.float64)))) for p in batch.patches])
    vision = np.zeros(plan.num_devices)
    ms = 0.0
    if method == "bucketing":
        for i, g in enumerate(plan.groups):
            vision[g[0]] += sample_vision[i]
    elif method.startswith("sp"):
        for i, g in enumerate(plan.groups):
            vision[list(g)] += sample_vision[i]  # verl: every SP rank runs the whole ViT
    else:
        def run():
            return plan_vision(batch.images_per_sample, batch.frames_per_sample, batch.patches, plan.num_devices,
                               shard_plan=plan, token_offsets=batch.vision_token_offsets, cost_model=model)
        vp = run()
        ms = best_time(run, repeats=2) * 1e3
        vision = np.asarray(vp.device_cost)
    total = llm + vision
    ideal = (float(llm.sum()) + float(sample_vision.sum())) / plan.num_devices
    return float(total.max() / total.mean()), float(total.max() / ideal), ms


def run_flexrl(seeds: int, responses: int, with_vision: bool = True) -> dict:
    model = CostModel()
    results: dict = {}
    for mixture in FLEXRL_MIXTURES:
        for devices, gbs in SETTINGS:
            rows: dict[str, list[Row]] = {m: [] for m in METHODS}
            vision_ms = []
            for seed in range(seeds):
                batch = vlm_batch(mixture, gbs, seed=seed, responses_per_prompt=responses)
                h = batch.lengths
                makers = {
                    "bucketing": lambda: plan_bucketing(h, devices),
                    "sp2": lambda: plan_fixed_sp(h, devices, 2),
                    "sp4": lambda: plan_fixed_sp(h, devices, 4),
                    "sp8": lambda: plan_fixed_sp(h, devices, 8),
                    "flex": lambda: plan_shards(h, devices),
                    "flex_full": lambda: plan_shards(h, devices, cost_model=model),
                }
                for method, make in makers.items():
                    plan = make()
                    ms = best_time(make, clock=time.process_time) * 1e3 if method.startswith("flex") else float("nan")
                    fb, fmax, vms = full_cost(plan, batch, method, model) if with_vision else (np.nan, np.nan, 0.0)
                    if vms:
                        vision_ms.append(vms)
                    rows[method].append(Row(method, plan.balance_ratio, plan.cost_balance_ratio, plan.attention_bound_ratio,
                                            plan.memory_ratio,
                                            plan.memory_ok, plan.alltoall_volume / float(h.sum()), fb, fmax, ms))
            results[f"{mixture}|{devices}|{gbs}"] = {
                "mixture": mixture, "devices": devices, "gbs": gbs, "sequences": int(gbs * responses),
                "rows": {m: [r.__dict__ for r in rs] for m, rs in rows.items()},
                "vision_ms": vision_ms,
            }
            print(f"  {mixture:12s} {devices:4d} GPUs: flex {np.mean([r.balance for r in rows['flex']]):.3f} "
                  f"(bound {np.mean([r.bound for r in rows['flex']]):.3f}), "
                  f"bucketing {np.mean([r.balance for r in rows['bucketing']]):.2f}", flush=True)
    return results


def run_odc(seeds: int) -> dict:
    model = CostModel()
    out: dict = {"aime": {}, "longalign": {}}
    cases = (
        ("aime", aime_rl_lengths, AIME_PROMPT_MAX + AIME_RESPONSE_MAX, (2, 4, 8, 16)),
        ("longalign", longalign_sft_lengths, LONGALIGN_MAX, (1, 2, 4, 8)),
    )
    for name, gen, cap, minibatches in cases:
        for mb in minibatches:
            rates: dict[str, list[float]] = {}
            for seed in range(seeds):
                lengths = gen(8 * mb * 8, seed=seed)  # 8 devices, 8 minibatches per step
                costs = np.asarray(model.compute(lengths.astype(np.float64)))
                for strategy in STRATEGIES:
                    plans = partition_batch(lengths, 8, mb, strategy=strategy, max_tokens_per_microbatch=cap, seed=seed)
                    # LB-Mini's unequal microbatch counts cannot run with per-layer collectives
                    for sync in ("minibatch",) if strategy == "lb_mini" else ("layer", "minibatch"):
                        rates.setdefault(f"{strategy}/{sync}", []).append(100 * batch_bubble_rate(plans, costs, sync))
            out[name][mb] = {k: float(np.mean(v)) for k, v in rates.items()}
            print(f"  {name:9s} minibatch {mb:2d}: " + ", ".join(f"{k} {v:.2f}%" for k, v in out[name][mb].items()),
                  flush=True)
    return out


def run_timing() -> dict:
    out = {}
    for mixture in FLEXRL_MIXTURES:
        for responses in (1, 8):
            batch = vlm_batch(mixture, 256, seed=0, responses_per_prompt=responses)
            attention = lambda: plan_shards(batch.lengths, 128)  # noqa: E731
            full = lambda: plan_shards(batch.lengths, 128, cost_model=CostModel())  # noqa: E731
            out[f"{mixture}|{len(batch.lengths)}"] = {
                "attention": best_time(attention, 7) * 1e3,
                "full_cost": best_time(full, 7) * 1e3,
                "attention_cpu": best_time(attention, 7, time.process_time) * 1e3,
                "full_cost_cpu": best_time(full, 7, time.process_time) * 1e3,
            }
    return out


def run_pmax16(seeds: int) -> dict:
    """The image-heavy 32-GPU case again with p_max 16: how much of the gap is the degree cap."""
    rows = []
    for seed in range(seeds):
        h = vlm_batch("image-heavy", 64, seed=seed).lengths
        p8, p16 = plan_shards(h, 32), plan_shards(h, 32, p_max=16)
        rows.append({"seed": seed, "p8": p8.balance_ratio, "p8_bound": p8.attention_bound_ratio,
                     "p16": p16.balance_ratio, "p16_bound": p16.attention_bound_ratio,
                     "p8_a2a": p8.alltoall_volume / float(h.sum()), "p16_a2a": p16.alltoall_volume / float(h.sum())})
    return {"rows": rows}


def run_milp(seeds: int, seconds: float) -> dict:
    """Optional: HiGHS MILP optimum of max attention load under the memory cap (32 GPUs, p_max 8)."""
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import lil_matrix
    except ImportError:
        return {}
    out = {}
    for mixture in FLEXRL_MIXTURES:
        for seed in range(seeds):
            h = vlm_batch(mixture, 64, seed=seed).lengths.astype(np.float64)
            devices, n = 32, len(h)
            w = h * h / (h * h).sum() * devices
            cap = 1.1 * h.sum() / devices
            options = [(i, p, b) for i in range(n) for p in (1, 2, 4, 8) if p <= h[i] for b in range(devices // p)]
            a = lil_matrix((n + 2 * devices, len(options) + 1))
            for k, (i, p, b) in enumerate(options):
                a[i, k] = 1
                for d in range(b * p, (b + 1) * p):
                    a[n + d, k] = w[i] / p
                    a[n + devices + d, k] = np.ceil(h[i] / p)
            for d in range(devices):
                a[n + d, len(options)] = -1
            lo = [1] * n + [-np.inf] * (2 * devices)
            hi = [1] * n + [0] * devices + [cap] * devices
            c = np.zeros(len(options) + 1)
            c[-1] = 1
            integrality = np.ones(len(options) + 1)
            integrality[-1] = 0
            res = milp(c, constraints=LinearConstraint(a.tocsr(), lo, hi), integrality=integrality,
                       bounds=Bounds(0, [1] * len(options) + [np.inf]), options={"time_limit": seconds})
            if res.x is not None:
                out[f"{mixture}|{seed}"] = {"best": float(res.fun), "bound": float(res.mip_dual_bound)}
                print(f"  MILP {mixture} seed {seed}: best {res.fun:.4f}, bound {res.mip_dual_bound:.4f}", flush=True)
    return out


# ------------------------------------------------------------------------------ report


def _mean(rows: list[dict], key: str) -> float:
    return float(np.mean([r[key] for r in rows]))


def _max(rows: list[dict], key: str) -> float:
    return float(np.max([r[key] for r in rows]))


def flexrl_table(results: dict) -> list[str]:
    lines = [
        "| mixture | GPUs | seqs | method | attn balance | bound | own objective | memory ratio | cap held | a2a volume | full-cost balance | full max/ideal | plan ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, res in results.items():
        for method in METHODS:
            rows = res["rows"][method]
            ms = _mean(rows, "ms")
            ok = sum(r["memory_ok"] for r in rows)
            lines.append(
                f"| {res['mixture']} | {res['devices']} | {res['sequences']} | {method} | "
                f"{_mean(rows, 'balance'):.3f} (max {_max(rows, 'balance'):.3f}) | {_mean(rows, 'bound'):.3f} | "
                f"{_mean(rows, 'objective'):.3f} | "
                f"{_mean(rows, 'memory'):.2f} | {ok}/{len(rows)} | {_mean(rows, 'a2a'):.2f} | "
                f"{_mean(rows, 'full_balance'):.3f} | {_mean(rows, 'full_max_over_ideal'):.2f} | "
                f"{'' if np.isnan(ms) else f'{ms:.1f}'} |"
            )
    return lines


def targets(main: dict, timing: dict, odc: dict, milp: dict) -> list[str]:
    ih = main["image-heavy|32|64"]["rows"]
    flex = ih["flex"]
    bal = _mean(flex, "balance")
    bound = _mean(flex, "bound")
    # a batch can reach 1.02 only if its attention bound allows it and (when the MILP ran) its
    # proven optimum under the memory cap does too
    feasible = [s for s, r in enumerate(flex)
                if r["bound"] <= 1.02 and milp.get(f"image-heavy|{s}", {"bound": 1.0})["bound"] <= 1.02]
    # (a MILP that stopped at its time limit may leave the bound at 1.0: then the batch counts)
    feasible_met = sum(flex[s]["balance"] <= 1.02 for s in feasible)
    # the best lower bound known per batch: the MILP's dual bound or the attention bound
    near_opt = [flex[s]["balance"] / max(milp[f"image-heavy|{s}"]["bound"], flex[s]["bound"])
                for s in range(len(flex)) if f"image-heavy|{s}" in milp]
    near = f"; within {100 * (max(near_opt) - 1):.1f}% of the best lower bound (MILP or attention) on every batch" if near_opt else ""
    comm_ok = comm_total = 0
    for key, res in main.items():
        for s, f in enumerate(res["rows"]["flex"]):
            for sp in ("sp2", "sp4", "sp8"):
                r = res["rows"][sp][s]
                if r["balance"] <= f["balance"] + 1e-9:
                    comm_total += 1
                    comm_ok += f["a2a"] < r["a2a"]
    t256 = max(v["attention"] for k, v in timing.items() if k.endswith("|256"))
    t256_full = max(v["full_cost"] for k, v in timing.items() if k.endswith("|256"))
    cpu256 = max(max(v["attention_cpu"], v["full_cost_cpu"]) for k, v in timing.items() if k.endswith("|256"))
    full = [(_mean(res["rows"]["flex_full"], "full_balance"), key) for key, res in main.items()]
    worst_full = max(full)
    ih_full = _mean(ih["flex_full"], "full_balance")
    aime4 = odc["aime"][4]
    lines = [
        "| target (paper) | measured | status |",
        "|---|---|---|",
        f"| image-heavy, 32 GPUs: attention balance <= 1.02 (paper: bucketing 6.70, SP 1.12, FlexUlysses 1.00) | "
        f"flex {bal:.3f} mean over {len(flex)} batches (attention bound {bound:.3f}){near}; bucketing "
        f"{_mean(ih['bucketing'], 'balance'):.2f}, SP8 {_mean(ih['sp8'], 'balance'):.3f}; "
        f"{feasible_met}/{len(feasible)} of the batches where <= 1.02 is achievable reach it | "
        f"{'met' if bal <= 1.02 else 'not met on average: with 2 sequences per GPU the longest video / 8 alone exceeds 1.02 x mean on most batches (met with p_max 16 or a GRPO group of 8, below)'} |",
        f"| less all-to-all volume than any fixed SP degree that balances as well | "
        f"{comm_ok}/{comm_total} (batch, SP degree) pairs where that SP balances at least as well | "
        f"{'met' if comm_ok == comm_total else 'not met everywhere'} |",
        f"| plan 256 sequences on 128 devices < 20 ms | {t256:.1f} ms wall, worst mixture (attention objective), "
        f"{t256_full:.1f} ms (full cost model); {cpu256:.1f} ms CPU | {'met' if max(t256, t256_full) < 20 else 'not met'} |",
        f"| full VLM cost (attention + linear + vision) balance <= 1.05 | image-heavy 32 GPUs {ih_full:.3f}; "
        f"worst setting {worst_full[0]:.3f} ({worst_full[1]}) | {'met' if worst_full[0] <= 1.05 else 'not met everywhere'} |",
        f"| ODC table 4 (7B, 8 dev., minibatch 4): native ~32%, LB-Micro ~7.5%, LB-Mini ~0.5% | "
        f"native {aime4['native/layer']:.1f}%, LB-Micro {aime4['lb_micro/layer']:.1f}%, "
        f"LB-Mini {aime4['lb_mini/minibatch']:.2f}% | "
        f"{'met (ordering and order of magnitude)' if aime4['native/layer'] > aime4['lb_micro/layer'] > aime4['lb_mini/minibatch'] else 'not met'} |",
    ]
    return lines


UNRECORDED_MILP = " --milp S` (S, the seconds per MILP solve, not recorded)"


def write_report(out: Path, data: dict) -> None:
    main, group, odc, timing, p16, milp = (data[k] for k in ("flexrl", "flexrl_group8", "odc", "timing", "pmax16", "milp"))
    lines = [
        "# Planner benchmark (issue 4)",
        "",
        f"Generated by `python scripts/bench_planner.py --seeds {data['seeds']}"
        f"{' --milp ' + format(data['milp_seconds'], 'g') if data.get('milp_seconds') else ''}"
        f"{UNRECORDED_MILP if data.get('milp') and not data.get('milp_seconds') else '`'}"
        f" on {data['machine']} at commit "
        f"{data.get('commit', 'not recorded')}. "
        "Definitions and generators: `scripts/bench_planner.py`, `titanrl/parallel/flex_ulysses/workloads.py`, "
        "`docs/planner.md`. Means over seeds; plan ms is CPU time (`process_time`), best of 5 runs after a "
        f"warm-up (the box is shared: load average {data.get('load', '?')} when the run started).",
        "",
        "## Targets",
        "",
        *targets(main, timing, odc, milp),
        "",
        "## FlexRL settings, one sequence per prompt (2 sequences per GPU)",
        "",
        *flexrl_table(main),
        "",
        "## FlexRL settings, a GRPO group of 8 responses per prompt",
        "",
        *flexrl_table(group),
        "",
        "## Image-heavy, 32 GPUs: p_max 8 vs 16",
        "",
        "| seed | p_max 8 balance | bound | a2a | p_max 16 balance | bound | a2a |",
        "|---|---|---|---|---|---|---|",
        *[f"| {r['seed']} | {r['p8']:.3f} | {r['p8_bound']:.3f} | {r['p8_a2a']:.2f} | {r['p16']:.3f} | "
          f"{r['p16_bound']:.3f} | {r['p16_a2a']:.2f} |" for r in p16["rows"]],
        "",
    ]
    if milp:
        lines += [
            "## Exact reference (HiGHS MILP, 32 GPUs, 64 sequences, memory cap 1.1, time-limited)",
            "",
            "| mixture | seed | FlexUlysses | MILP best found | MILP lower bound | attention bound |",
            "|---|---|---|---|---|---|",
        ]
        for key, v in milp.items():
            mixture, seed = key.split("|")
            row = main[f"{mixture}|32|64"]["rows"]["flex"][int(seed)]
            lines.append(f"| {mixture} | {seed} | {row['balance']:.4f} | {v['best']:.4f} | {v['bound']:.4f} | "
                         f"{row['bound']:.4f} |")
        lines.append("")
    lines += [
        "## Planning time, 128 devices (best of 7, ms: wall `perf_counter` / CPU `process_time`)",
        "",
        "| mixture | sequences | attention objective | full cost model |",
        "|---|---|---|---|",
        *[f"| {k.split('|')[0]} | {k.split('|')[1]} | {v['attention']:.1f} / {v['attention_cpu']:.1f} | "
          f"{v['full_cost']:.1f} / {v['full_cost_cpu']:.1f} |" for k, v in timing.items()],
        "",
        "## ODC bubble rates (%), 8 devices",
        "",
        "AIME-like GRPO (ODC table 4, 7B row in brackets: Collective Native / Collective LB-Micro / ODC LB-Mini):",
        "",
        "| minibatch/device | native, layer sync | LB-Micro, layer sync | LB-Micro, minibatch sync | LB-Mini, minibatch sync |",
        "|---|---|---|---|---|",
        *[f"| {mb} | {v['native/layer']:.2f} [{ODC_RL_7B[mb][0]}] | {v['lb_micro/layer']:.2f} [{ODC_RL_7B[mb][1]}] | "
          f"{v['lb_micro/minibatch']:.2f} | {v['lb_mini/minibatch']:.2f} [{ODC_RL_7B[mb][2]}] |"
          for mb, v in odc["aime"].items()],
        "",
        "LongAlign-like SFT (ODC table 6, 7B row in brackets: Collective LB-Micro / ODC LB-Mini):",
        "",
        "| minibatch/device | native, layer sync | LB-Micro, layer sync | LB-Micro, minibatch sync | LB-Mini, minibatch sync |",
        "|---|---|---|---|---|",
        *[f"| {mb} | {v['native/layer']:.2f} | {v['lb_micro/layer']:.2f} [{ODC_SFT_7B[mb][0]}] | "
          f"{v['lb_micro/minibatch']:.2f} | {v['lb_mini/minibatch']:.2f} [{ODC_SFT_7B[mb][1]}] |"
          for mb, v in odc["longalign"].items()],
        "",
        "![planner benchmark](planner.png)",
        "",
    ]
    (out / "planner.md").write_text("\n".join(lines))


def plot(out: Path, data: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main, odc = data["flexrl"], data["odc"]
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    keys = [k for k in main if k.endswith("|32|64")]
    x = np.arange(len(keys))
    width = 0.13
    for j, method in enumerate(METHODS):
        bal = [_mean(main[k]["rows"][method], "balance") for k in keys]
        a2a = [_mean(main[k]["rows"][method], "a2a") for k in keys]
        full = [_mean(main[k]["rows"][method], "full_max_over_ideal") for k in keys]
        axes[0, 0].bar(x + (j - 2.5) * width, bal, width, label=method)
        axes[0, 1].bar(x + (j - 2.5) * width, a2a, width, label=method)
        axes[1, 0].bar(x + (j - 2.5) * width, full, width, label=method)
    bound = [_mean(main[k]["rows"]["flex"], "bound") for k in keys]
    axes[0, 0].scatter(x + 1.5 * width, bound, marker="_", s=400, color="k", zorder=3, label="lower bound (p_max 8)")
    for ax, title in ((axes[0, 0], "attention balance ratio (max/mean), 32 GPUs, 64 seqs"),
                      (axes[0, 1], "all-to-all volume / tokens"),
                      (axes[1, 0], "busiest device's full VLM cost / ideal (attn + linear + ViT)")):
        ax.set_xticks(x, [k.split("|")[0] for k in keys])
        ax.set_title(title)
    axes[0, 0].set_yscale("log")
    axes[0, 0].axhline(1.02, color="grey", ls=":", lw=1)
    axes[1, 0].set_yscale("log")
    axes[0, 0].legend(fontsize=7, ncol=2)
    ax = axes[1, 1]
    for name, style in (("aime", "-"), ("longalign", "--")):
        mbs = list(odc[name])
        for key, colour in (("native/layer", "C3"), ("lb_micro/layer", "C1"), ("lb_mini/minibatch", "C2")):
            ax.plot(mbs, [odc[name][m].get(key, np.nan) for m in mbs], style, color=colour, marker="o",
                    label=f"{name} {key}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("minibatch per device")
    ax.set_ylabel("bubble rate (%)")
    ax.set_title("ODC bubble rates, 8 devices")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "planner.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks"))
    parser.add_argument("--milp", type=float, default=0.0, help="seconds per MILP reference solve (0: skip)")
    parser.add_argument("--report-only", action="store_true", help="rewrite planner.md/png from planner.json")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        data = json.loads((args.out / "planner.json").read_text())
        for section in ("odc",):
            for name in data[section]:
                data[section][name] = {int(k): v for k, v in data[section][name].items()}
        write_report(args.out, data)
        plot(args.out, data)
        print((args.out / "planner.md").read_text())
        return
    data: dict = {"seeds": args.seeds, "milp_seconds": args.milp, **provenance(),
                  "load": " / ".join(f"{x:.1f}" for x in os.getloadavg())}
    print("FlexRL settings, 1 response per prompt", flush=True)
    data["flexrl"] = run_flexrl(args.seeds, 1)
    print("FlexRL settings, 8 responses per prompt", flush=True)
    data["flexrl_group8"] = run_flexrl(max(2, args.seeds // 2), 8, with_vision=False)
    print("ODC", flush=True)
    data["odc"] = run_odc(args.seeds)
    print("timing", flush=True)
    data["timing"] = run_timing()
    data["pmax16"] = run_pmax16(args.seeds)
    data["milp"] = run_milp(args.seeds, args.milp) if args.milp > 0 else {}
    (args.out / "planner.json").write_text(json.dumps(data, indent=1, default=float))
    write_report(args.out, data)
    plot(args.out, data)
    print((args.out / "planner.md").read_text())


if __name__ == "__main__":
    main()
