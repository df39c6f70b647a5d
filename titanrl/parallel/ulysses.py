"""Ulysses sequence parallelism at the attention seam, executing FlexUlysses plans (FlexRL sec. 3,
Algorithm 1).

A rank's packed stream under a plan holds, in order: its token slice of every *sharded* sequence
group it belongs to (global highest-sharding-first order), then its whole (``p = 1``) sequences.
:class:`UlyssesLayout` describes that stream; the trainer builds one per forward and hands it to
the model in ``PackedBatch.attention_layout``, which the decoder passes to every
``inner_attention`` unread. :class:`UlyssesAttention` (installed by :func:`apply_ulysses`, the
model file knows nothing of it) runs, per decoder layer:

1. the first sharded group's all-to-all tokens -> heads is issued; the ``p = 1`` region's varlen
   attention runs while it is in flight;
2. for each sharded group in order: the *next* group's first all-to-all is issued, then this
   group's received Q/K/V (all of the group's tokens, ``1/p`` of the heads) are put in sequence
   order, varlen attention runs over the group's whole sequences, and the output goes back
   heads -> tokens with the second all-to-all;
3. the outputs are put back in the stream's order.

Collectives are functional (``all_to_all_single_autograd``): issued on call, waited on first use,
differentiable. Autograd runs backward nodes in decreasing creation order, so every rank issues
the mirrored collectives in exactly the reverse of its forward order; reverse HSF is as
deadlock-free as HSF (``titanrl.parallel.flex_ulysses.schedule`` simulates both), and activation
checkpointing recomputes a layer in its forward order. On CUDA, NCCL runs them on its own stream.

GQA and head counts that ``p`` does not divide (Qwen2.5-VL-7B: 28 query / 4 K/V heads, ``p = 8``): member ``m``
takes a contiguous block of query heads, the blocks differing by at most one head (:func:`split_heads`), and only
the K/V heads its block reads, each sent once; where its block reads them unevenly (a block straddling two K/V
groups) the member repeats them locally, after the all-to-all, one per query head. Even splits are the familiar
case: K/V split ``p`` ways when ``p`` divides their count, else one K/V head per member.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.distributed._functional_collectives import all_to_all_single_autograd

from titanrl.models.attention import AttnBackend, VarlenAttention, VarlenMeta, make_varlen_meta
from titanrl.models.qwen2_5_vl.model import Attention, Qwen2_5_VLModel


@dataclass(frozen=True)
class UlyssesSetup:
    """What ``parallelism.ulysses*`` resolves to on this model and world size."""

    method: str  # "none" | "fixed" | "flex" (a titanrl.parallel.stage_plan method)
    degree: int = 1  # fixed
    p_max: int = 1  # flex: the largest degree actually allowed
    degrees: tuple[int, ...] = ()  # degrees > 1 that need process groups
    message: str = ""  # what a user should know (a lowered p_max)


def resolve_ulysses(par, text, world: int) -> UlyssesSetup:
    """Check ``parallelism.ulysses`` / ``ulysses_degree`` / ``p_max`` (a ``ParallelismConfig``)
    against the model's head counts (``TextArgs``) and the world size. A fixed degree the model
    cannot split is a ``ConfigError``; a flex ``p_max`` above what the heads allow is lowered with
    a message naming the head counts and the degrees left."""
    from titanrl.config.errors import ConfigError

    hq, hkv = text.num_attention_heads, text.num_key_value_heads
    heads = f"the model has {hq} query / {hkv} key-value heads"
    if par.ulysses == "none":
        return UlyssesSetup("none")
    if par.ulysses == "fixed":
        d = par.ulysses_degree
        allowed = admissible_degrees(hq, hkv, world)
        if d not in allowed or world % d:
            raise ConfigError(
                f"parallelism.ulysses_degree={d} cannot run: {heads} and there are {world} ranks; powers of two "
                f"with a query head per member that divide the ranks: "
                f"{', '.join(str(x) for x in allowed if world % x == 0)}"
            )
        return UlyssesSetup("fixed", degree=d, degrees=(d,) if d > 1 else ())
    if par.ulysses != "flex":
        raise ConfigError(f"parallelism.ulysses must be 'none', 'fixed' or 'flex', got {par.ulysses!r}")
    p_max = par.p_max if par.p_max is not None else default_p_max(world)
    allowed = tuple(p for p in admissible_degrees(hq, hkv, p_max) if world % p == 0)
    top = max(allowed)
    message = ""
    if top < p_max:
        message = (f"parallelism.p_max={p_max} lowered to {top}: {heads} and there are {world} ranks "
                   f"(degrees left: {', '.join(str(x) for x in allowed)})")
    return UlyssesSetup("flex", p_max=top, degrees=tuple(p for p in allowed if p > 1), message=message)


def default_p_max(world: int) -> int:
    """``parallelism.p_max`` when unset: the largest power of two <= min(4, world)."""
    p = 1
    while 2 * p <= min(4, world):
        p *= 2
    return p


def admissible_degrees(n_heads: int, n_kv_heads: int, p_max: int) -> tuple[int, ...]:
    """Powers of two ``p <= p_max`` with at least one query head per member (:func:`split_heads`)."""
    out = []
    p = 1
    while p <= min(p_max, n_heads):
        out.append(p)
        p *= 2
    return tuple(out)


@dataclass(frozen=True)
class MemberHeads:
    """The heads one member of a ``p``-way group attends over."""

    q: tuple[int, int]  # [start, end) of its query heads
    kv: tuple[int, int]  # [start, end) of the K/V heads they read (sent once each)
    expand: tuple[int, ...] | None  # per query head its K/V head among ``kv``; None: GQA as is (equal groups)

    @property
    def width(self) -> int:
        """Heads per token it receives: its query heads and its K and V heads."""
        return self.q[1] - self.q[0] + 2 * (self.kv[1] - self.kv[0])


def split_heads(n_heads: int, n_kv_heads: int, p: int) -> tuple[MemberHeads, ...]:
    """Query heads in ``p`` contiguous blocks, the first ``n_heads % p`` one head larger; each with the K/V heads its
    query heads read (query head ``h`` reads K/V head ``h // (n_heads / n_kv_heads)``)."""
    if p < 1 or p > n_heads or n_heads % n_kv_heads:
        raise ValueError(f"cannot split {n_heads} query / {n_kv_heads} K/V heads {p} ways")
    base, extra = divmod(n_heads, p)
    group = n_heads // n_kv_heads
    out, start = [], 0
    for m in range(p):
        end = start + base + (m < extra)
        kv_of = [h // group for h in range(start, end)]
        kv = (kv_of[0], kv_of[-1] + 1)
        per_kv = {kv_of.count(x) for x in range(*kv)}
        expand = None if len(per_kv) == 1 else tuple(x - kv[0] for x in kv_of)
        out.append(MemberHeads((start, end), kv, expand))
        start = end
    return tuple(out)


class CommCounter:
    """Bytes this rank sent to other ranks in attention all-to-alls (forward and backward)."""

    def __init__(self) -> None:
        self.forward_bytes = 0
        self.backward_bytes = 0

    @property
    def total(self) -> int:
        return self.forward_bytes + self.backward_bytes


@dataclass
class ShardedGroup:
    """One sequence group this rank runs together with the other ``degree - 1`` members."""

    group: ProcessGroup
    degree: int
    position: int  # this rank's index among the members
    start: int  # this rank's tokens of the group: [start, end) of the local stream
    end: int
    counts: list[int]  # tokens each member holds, in member order
    to_sequence_order: torch.Tensor  # member-major received rows -> whole sequences, in order
    to_member_order: torch.Tensor  # the inverse permutation
    meta: VarlenMeta  # the group's whole sequences


class UlyssesLayout:
    """Attention layout of one rank's packed stream (see the module docstring).

    A plain class, not a dataclass, on purpose: FSDP2 rebuilds dataclass arguments field by field
    at every wrapped module (to cast their tensors), which would copy the layout per layer and
    lose its byte counts; a plain object is passed through as is."""

    def __init__(self, sharded: list[ShardedGroup], local_start: int, num_tokens: int,
                 local_meta: VarlenMeta | None, overlap: bool = True) -> None:
        self.sharded = sharded
        self.local_start = local_start  # the p = 1 region is [local_start, num_tokens)
        self.num_tokens = num_tokens
        self.local_meta = local_meta
        self.overlap = overlap
        self.comm = CommCounter()


def member_order_permutation(slices: Sequence[Sequence[tuple[int, int]]]) -> np.ndarray:
    """``slices[s][m]`` is member ``m``'s token range of sequence ``s``. Received rows come member by
    member, each member's slices in sequence order; return, for every position of the whole
    sequences laid end to end, the received row that holds it."""
    num_members = len(slices[0]) if slices else 0
    offsets = {}
    row = 0
    for m in range(num_members):
        for s, per_member in enumerate(slices):
            a, b = per_member[m]
            offsets[(s, m)] = row
            row += b - a
    order = []
    for s, per_member in enumerate(slices):
        for m, (a, b) in enumerate(per_member):
            order.append(np.arange(offsets[(s, m)], offsets[(s, m)] + (b - a)))
    return np.concatenate(order).astype(np.int64) if order else np.zeros(0, dtype=np.int64)


def build_layout(
    sharded: Sequence[tuple[ProcessGroup, tuple[int, ...], Sequence[Sequence[tuple[int, int]]]]],
    local_lengths: Sequence[int],
    *,
    rank: int,
    backend: AttnBackend,
    device: torch.device,
    overlap: bool = True,
    sharded_segments: Sequence[Sequence[Sequence[int]]] | None = None,
    local_segments: Sequence[Sequence[int]] | None = None,
) -> UlyssesLayout:
    """The layout of a stream made of this rank's slices of ``sharded`` groups, in that order, then
    the whole sequences ``local_lengths``.

    ``sharded``: per group ``(process group, member ranks, slices)`` with ``slices[s][m]`` the
    ``[start, end)`` range of sequence ``s`` held by member ``m`` (ranges of one sequence are
    contiguous and cover it in member order). ``sharded_segments`` (per group, per sequence) and
    ``local_segments`` (per local sequence): shared-prefix segments
    (``titanrl.models.attention.make_varlen_meta``); None = plain sequences. Attention runs on whole
    sequences after the first all-to-all, so a shared prefix shards like any sequence."""
    groups: list[ShardedGroup] = []
    offset = 0
    for i, (pg, ranks, slices) in enumerate(sharded):
        position = ranks.index(rank)
        counts = [sum(per_member[m][1] - per_member[m][0] for per_member in slices) for m in range(len(ranks))]
        lengths = [per_member[-1][1] - per_member[0][0] for per_member in slices]
        perm = torch.from_numpy(member_order_permutation(slices)).to(device)
        cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(device)
        groups.append(ShardedGroup(
            group=pg, degree=len(ranks), position=position, start=offset, end=offset + counts[position],
            counts=counts, to_sequence_order=perm, to_member_order=torch.argsort(perm),
            meta=make_varlen_meta(cu, causal=True, backend=backend,
                                  segments=None if sharded_segments is None else sharded_segments[i]),
        ))
        offset += counts[position]
    local_meta = None
    if local_lengths:
        cu = torch.tensor([0, *local_lengths], dtype=torch.int64).cumsum(0).to(device)
        local_meta = make_varlen_meta(cu, causal=True, backend=backend, segments=local_segments)
    return UlyssesLayout(sharded=groups, local_start=offset, num_tokens=offset + sum(local_lengths),
                         local_meta=local_meta, overlap=overlap)


def sum_over_members(values: torch.Tensor, spans: Sequence[tuple[ProcessGroup, int, int]]) -> torch.Tensor:
    """``values`` [responses, k] (this rank's per-response sums of a wave) with the rows of each sharded group's
    responses (``spans``: its process group and row range, ``WaveInputs.sharded_responses``) summed over the group's
    members: each response's sums over all of its tokens. One all-reduce per group, in the stream's order (the
    order of the groups' attention all-to-alls, deadlock-free for the same reason)."""
    out = values.detach().clone()
    for group, lo, hi in spans:
        if hi > lo:
            torch.distributed.all_reduce(out[lo:hi], group=group)
    return out


def _bytes(t: torch.Tensor, rows: int) -> int:
    return rows * (t.numel() // max(t.shape[0], 1)) * t.element_size()


class UlyssesAttention(nn.Module):
    """Wraps a model's ``inner_attention``: a :class:`UlyssesLayout` runs Algorithm 1 (module
    docstring), anything else (an unsharded ``VarlenMeta``) goes straight to the inner module."""

    def __init__(self, inner: VarlenAttention, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.inner = inner
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self._splits: dict[int, tuple[MemberHeads, ...]] = {}

    # The collectives stay out of compiled graphs: a compiled decoder block breaks its graph here.
    @torch.compiler.disable
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: object, *,
                scale: float) -> torch.Tensor:
        if not isinstance(meta, UlyssesLayout):
            return self.inner(q, k, v, meta, scale=scale)
        return self._sharded(q, k, v, meta, scale)

    # -- the two all-to-alls

    def _heads(self, p: int) -> tuple[MemberHeads, ...]:
        if p not in self._splits:
            self._splits[p] = split_heads(self.n_heads, self.n_kv_heads, p)
        return self._splits[p]

    def _to_heads(self, q, k, v, g: ShardedGroup, layout: UlyssesLayout):
        """This rank's tokens of ``g``, all heads -> all of ``g``'s tokens, this member's heads: ``[rows, width, d]``
        (member-major rows; per token its query heads, then K, then V), and this member's :class:`MemberHeads`."""
        split = self._heads(g.degree)
        n, d = g.end - g.start, q.shape[-1]
        q, k, v = q[g.start:g.end], k[g.start:g.end], v[g.start:g.end]
        send = torch.cat([torch.cat([q[:, m.q[0]:m.q[1]], k[:, m.kv[0]:m.kv[1]], v[:, m.kv[0]:m.kv[1]]], dim=1)
                          .reshape(-1) for m in split])
        me = split[g.position]
        recv = all_to_all_single_autograd(send, [c * me.width * d for c in g.counts], [n * m.width * d for m in split],
                                          g.group)
        es = q.element_size()
        layout.comm.forward_bytes += es * d * n * sum(m.width for i, m in enumerate(split) if i != g.position)
        if recv.requires_grad:  # its gradient goes back the same way: rows of every other member
            self._count_backward(recv, layout, es * d * me.width * (sum(g.counts) - g.counts[g.position]))
        return recv.reshape(sum(g.counts), me.width, d), me

    def _to_tokens(self, out: torch.Tensor, g: ShardedGroup, layout: UlyssesLayout) -> torch.Tensor:
        """``out`` (member-major rows of ``g``, this member's query heads) -> this rank's tokens, all heads."""
        split = self._heads(g.degree)
        n, d = g.end - g.start, out.shape[-1]
        me = split[g.position]
        q_heads = [m.q[1] - m.q[0] for m in split]
        back = all_to_all_single_autograd(out.reshape(-1), [n * h * d for h in q_heads],
                                          [c * q_heads[g.position] * d for c in g.counts], g.group)
        es = out.element_size()
        layout.comm.forward_bytes += es * d * (me.q[1] - me.q[0]) * (sum(g.counts) - g.counts[g.position])
        if back.requires_grad:
            self._count_backward(back, layout, es * d * n * (self.n_heads - q_heads[g.position]))
        parts = back.split([n * h * d for h in q_heads])
        return torch.cat([part.reshape(n, h, d) for part, h in zip(parts, q_heads)], dim=1)

    @staticmethod
    def _count_backward(t: torch.Tensor, layout: UlyssesLayout, nbytes: int) -> None:
        """Count ``nbytes`` when the mirrored collective of ``t`` runs in backward (it runs when
        ``t``'s gradient is computed; with activation checkpointing, per recomputation)."""

        def hook(_grad):
            layout.comm.backward_bytes += nbytes

        t.register_hook(hook)

    # -- Algorithm 1

    def _sharded(self, q, k, v, layout: UlyssesLayout, scale: float) -> torch.Tensor:
        groups = layout.sharded
        pending = self._to_heads(q, k, v, groups[0], layout) if groups else None
        local = None
        if layout.local_meta is not None:  # runs while the first all-to-all is in flight
            s = layout.local_start
            local = self.inner(q[s:], k[s:], v[s:], layout.local_meta, scale=scale)
        outs = []
        for i, g in enumerate(groups):
            recv, heads = pending if layout.overlap or i == 0 else self._to_heads(q, k, v, g, layout)
            if layout.overlap and i + 1 < len(groups):
                pending = self._to_heads(q, k, v, groups[i + 1], layout)
            rows = recv.index_select(0, g.to_sequence_order)
            kv_heads = heads.kv[1] - heads.kv[0]
            qg, kg, vg = rows.split([heads.q[1] - heads.q[0], kv_heads, kv_heads], dim=1)
            if heads.expand is not None:  # a block straddling K/V groups: one K/V head per query head
                index = torch.tensor(heads.expand, device=kg.device)
                kg, vg = kg.index_select(1, index), vg.index_select(1, index)
            out = self.inner(qg, kg, vg, g.meta, scale=scale).index_select(0, g.to_member_order)
            outs.append(self._to_tokens(out, g, layout))
        pieces = outs
        if local is not None:
            pieces.append(local)
        # Always a real copy: with one head per member the reshape above is a *view* of the
        # collective's AsyncCollectiveTensor, and an un-waited tensor subclass flowing into a
        # compiled block loses its gradient (measured: wrong grads at p = 4 with compile on).
        return torch.cat(pieces)


def apply_ulysses(model: Qwen2_5_VLModel) -> None:
    """Wrap every decoder attention's ``inner_attention`` (the vision tower is not sharded)."""
    for module in model.modules():
        if isinstance(module, Attention) and not isinstance(module.inner_attention, UlyssesAttention):
            module.inner_attention = UlyssesAttention(module.inner_attention, module.n_heads, module.n_kv_heads)


def layout_builder(groups: dict, *, rank: int, lengths: Sequence[int], backend: AttnBackend,
                   device: torch.device, overlap: bool = True, segments: Sequence[Sequence[int]] | None = None):
    """A function from this rank's share of a wave (``RankWave``) to its ``UlyssesLayout``, or None
    when the share holds only whole sequences (plain varlen attention, no collective).
    ``segments[s]``: stage sequence ``s``'s shared-prefix segments (None: plain sequences)."""

    def build(rank_wave) -> UlyssesLayout | None:
        if not rank_wave.sharded:
            return None
        sharded = [(groups[step.ranks], step.ranks, step.slices) for step in rank_wave.sharded]
        seg = None
        if segments is not None:
            seg = dict(sharded_segments=[[segments[s] for s in step.seqs] for step in rank_wave.sharded],
                       local_segments=[segments[s] for s in rank_wave.local])
        return build_layout(sharded, [lengths[s] for s in rank_wave.local], rank=rank, backend=backend,
                            device=device, overlap=overlap, **(seg or {}))

    return build
