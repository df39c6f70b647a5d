"""The data coordinator (DistFlow sec. 6): trajectories move between rank groups of different sizes rank to rank.

When a node reads the output of a node placed on a disjoint group (under the disaggregated placement: the
training stages reading what the rollout ranks generated and scored), ``redistribute`` moves it: every rank
learns the prompt groups' sizes (one all-gather of a few numbers per group), every rank computes the same
assignment of whole groups to the receiving ranks (Karmarkar-Karp on their token counts: the receiving side is
balanced, whatever the generating side held), and each sending rank sends each receiving rank one message with
its groups (pickled trajectories: prompt, response, reward; point-to-point, never through one process).
A prompt's responses stay together (GRPO's group is computed on one rank).

With slice-aware loading (``pixels=False``) no pixels travel: the receiving ranks fetch the frames they encode
from the media preprocessors, so a prompt goes without its decoded media and patch rows - except, on a step the
weight-sync probe runs (``probe``), the first group each receiver gets (the probe runs the trainer's forward on
it and hands the engine its media).
"""

from __future__ import annotations

import pickle
from dataclasses import replace
from typing import Sequence

import torch
import torch.distributed as dist

from titanrl.distributed import all_gather_objects
from titanrl.parallel.balance import balance_ranks
from titanrl.workflow.executor import StepBatch


def group_cost(trajs: Sequence) -> float:
    """Tokens a prompt group puts through the model stages (its prompt once, as shared-prefix packing runs it,
    plus every response)."""
    return float(len(trajs[0].prompt.prompt_ids) + sum(t.num_response_tokens for t in trajs))


def assign_groups(units: Sequence[tuple[int, int, float]], receivers: Sequence[int],
                  speeds: Sequence[float] | None = None) -> dict[int, int]:
    """``units``: (group, sending rank, cost) of every prompt group of the step; returns each group's
    receiving rank (balanced by cost, in proportion to the receivers' ``speeds`` when given; the same on
    every rank)."""
    units = sorted(units)
    parts = balance_ranks([u[2] for u in units], len(receivers), speeds=speeds)
    return {units[i][0]: receivers[d] for d, part in enumerate(parts) for i in part}


def _without_pixels(trajs: Sequence) -> list:
    prompt = replace(trajs[0].prompt, pixel_values=None, media=[])
    return [replace(t, prompt=prompt) for t in trajs]


def redistribute(batch: StepBatch | None, senders: frozenset[int], receivers: frozenset[int], *, rank: int,
                 step: int, media=None, device: torch.device = torch.device("cpu"), pixels: bool = True,
                 probe: bool = True, speeds: Sequence[float] | None = None,
                 carried_from: int | None = None) -> tuple[StepBatch | None, int]:
    """Collective over every rank (messages on ``device``: NCCL moves device tensors only). ``batch``: this rank's
    output of the producing node (None where it did not run it). Returns (the batch this rank receives - None
    outside ``receivers`` -, bytes this rank sent). Two small all-gathers: the groups' costs (where each goes), then
    their pickled sizes (which depend on where they go: pixels ride with a receiver's first group only).
    ``speeds``: every rank's relative speed (None: equal). ``pixels`` False (slice-aware loading: the receivers
    fetch the frames they encode): the prompts' patch rows stay home, except for the probe's group and the groups
    from ``carried_from`` on (carried from earlier steps by partial rollouts: not in this step's loader)."""
    senders_, receivers_ = sorted(senders), sorted(receivers)
    groups = batch.groups() if rank in senders and batch is not None else {}
    costs = {g: group_cost(ts) for g, ts in groups.items()}
    # where every group goes is known before anything is pickled: one gather of the costs
    units = [u for part in all_gather_objects([(g, rank, c) for g, c in sorted(costs.items())]) for u in part]
    dest = assign_groups(units, receivers_, [speeds[r] for r in receivers_] if speeds else None)
    first = {min(g for g, d in dest.items() if d == r) for r in set(dest.values())} if probe else set()
    carried = (lambda g: g >= carried_from) if carried_from is not None else (lambda g: False)
    payload = {g: pickle.dumps(trajs if pixels or g in first or carried(g) else _without_pixels(trajs),
                               protocol=pickle.HIGHEST_PROTOCOL) for g, trajs in sorted(groups.items())}
    sizes = {g: n for part in all_gather_objects({g: len(b) for g, b in payload.items()}) for g, n in part.items()}
    sent, requests, keep = 0, [], []
    if rank in senders:
        for d in receivers_:
            blob = b"".join(payload[g] for g in sorted(payload) if dest[g] == d)
            if blob:
                t = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device)
                keep.append(t)
                requests.append(dist.isend(t, dst=d))
                sent += len(blob)
    out = None
    if rank in receivers:
        trajs = []
        for s in senders_:
            mine = sorted((g, sizes[g]) for g, home, _ in units if home == s and dest[g] == rank)
            if not mine:
                continue
            buf = torch.empty(sum(n for _, n in mine), dtype=torch.uint8, device=device)
            dist.recv(buf, src=s)
            data, offset = buf.cpu().numpy().tobytes(), 0
            for _, n in mine:
                trajs += pickle.loads(data[offset:offset + n])
                offset += n
        trajs.sort(key=lambda t: (int(t.group), t.response_index))
        out = StepBatch(step, [], trajs, media)
    for r in requests:
        r.wait()
    del keep
    return out, sent



