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

GQA: Q heads are split ``p`` ways. K/V heads are split when ``p`` divides their count and are
repeated ``p / n_kv`` times only when ``p`` exceeds it (each rank then needs exactly one), never
to the full query-head count. :func:`admissible_degrees` names the degrees a model allows.
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
                f"parallelism.ulysses_degree={d} cannot run: {heads} and there are {world} ranks; degrees that "
                f"split the heads evenly and divide the ranks: {', '.join(str(x) for x in allowed if world % x == 0)}"
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
    """Powers of two ``p <= p_max`` that split the heads evenly: ``p`` divides the query heads and
    either divides the K/V heads or is a multiple of them (then K/V are repeated ``p / n_kv``)."""
    out = []
    p = 1
    while p <= p_max:
        if n_heads % p == 0 and (n_kv_heads % p == 0 or p % n_kv_heads == 0):
            out.append(p)
        else:
            break  # nested powers of two: if p fails, 2p fails too
        p *= 2
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

    # The collectives stay out of compiled graphs: a compiled decoder block breaks its graph here.
    @torch.compiler.disable
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: object, *,
                scale: float) -> torch.Tensor:
        if not isinstance(meta, UlyssesLayout):
            return self.inner(q, k, v, meta, scale=scale)
        return self._sharded(q, k, v, meta, scale)

    # -- the two all-to-alls

    def _split_heads(self, q, k, v, p: int) -> tuple[torch.Tensor, int]:
        """[n, H, d] x3 -> [p * n, hc, d]: member m's rows are its heads of every local token."""
        n, _, d = q.shape
        if p > self.n_kv_heads:  # one K/V head per member, repeated only as often as needed
            k = k.repeat_interleave(p // self.n_kv_heads, dim=1)
            v = v.repeat_interleave(p // self.n_kv_heads, dim=1)
        parts = [t.reshape(n, p, t.shape[1] // p, d) for t in (q, k, v)]
        send = torch.cat(parts, dim=2).transpose(0, 1).contiguous()
        return send.reshape(p * n, send.shape[2], d), parts[0].shape[2]

    def _to_heads(self, q, k, v, g: ShardedGroup, layout: UlyssesLayout) -> tuple[torch.Tensor, int]:
        send, q_heads = self._split_heads(q[g.start:g.end], k[g.start:g.end], v[g.start:g.end], g.degree)
        n = g.end - g.start
        recv = all_to_all_single_autograd(send, g.counts, [n] * g.degree, g.group)
        layout.comm.forward_bytes += _bytes(send, n * (g.degree - 1))
        if recv.requires_grad:  # its gradient goes back the same way: rows of every other member
            self._count_backward(recv, layout, _bytes(send, sum(g.counts) - g.counts[g.position]))
        return recv, q_heads

    def _to_tokens(self, out: torch.Tensor, g: ShardedGroup, layout: UlyssesLayout) -> torch.Tensor:
        n = g.end - g.start
        back = all_to_all_single_autograd(out.contiguous(), [n] * g.degree, g.counts, g.group)
        layout.comm.forward_bytes += _bytes(out, sum(g.counts) - g.counts[g.position])
        if back.requires_grad:
            self._count_backward(back, layout, _bytes(out, n * (g.degree - 1)))
        return back

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
            recv, q_heads = pending if layout.overlap or i == 0 else self._to_heads(q, k, v, g, layout)
            if layout.overlap and i + 1 < len(groups):
                pending = self._to_heads(q, k, v, groups[i + 1], layout)
            rows = recv.index_select(0, g.to_sequence_order)
            kv_heads = (rows.shape[1] - q_heads) // 2
            qg, kg, vg = rows.split([q_heads, kv_heads, kv_heads], dim=1)
            out = self.inner(qg, kg, vg, g.meta, scale=scale).index_select(0, g.to_member_order)
            outs.append((self._to_tokens(out, g, layout), g))
        pieces = []
        for back, g in outs:
            n = g.end - g.start
            pieces.append(back.reshape(g.degree, n, *back.shape[1:]).transpose(0, 1).reshape(n, -1, back.shape[-1]))
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
