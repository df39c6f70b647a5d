"""Variable-length (packed) attention: many sequences in one token stream, no padding.

Two backends behind one module, ``VarlenAttention`` (the model's ``inner_attention`` seam), so the
model never branches on the device:
- ``"sdpa"`` (CPU and GPU): PyTorch SDPA. Short packs use one call with a block-diagonal
  mask; long packs batch the sequences of equal length into one call each (a token permutation
  computed once per forward puts them side by side), so memory stays O(sum of L_i^2), not
  O((sum L_i)^2), a vision tower's hundreds of equal windows cost a few calls, and backward stays
  O(N) (slicing one tensor per sequence would make each slice's backward write a full-size grad).
  Runs forward and backward on CPU (FlexAttention's backward does not, there).
- ``"flash"`` (CUDA): PyTorch's FlashAttention varlen kernel on the same cu_seqlens.

Shared prefixes (``segments``): a packed sequence may be a prompt followed by several responses
that share it (GRPO's group). Each response attends to the prompt and, causally, to itself, never
to a sibling; the prompt is computed once. Both backends run this as varlen attention with
separate query and key boundaries: every response is a query segment whose keys are the prompt's
rows followed by its own (``VarlenMeta.key_index`` gathers them from the stream), causal aligned at
the bottom right (query ``i`` of ``Lq`` sees keys up to ``i + Lk - Lq``: the whole prompt and its own
earlier tokens). Short packs on ``sdpa`` use one call with the equivalent mask instead.

Tensors are ``[tokens, heads, head_dim]``; K/V may have fewer heads than Q (GQA).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

AttnBackend = Literal["sdpa", "flash"]

# Up to this many (tokens x tokens) mask entries the sdpa backend runs a packed stream as one masked
# call; above it, one batched call per run of equal-length segments. A masked call pays the whole
# N x N product on the math kernel, so it only wins where per-call overhead dominates: on CPU
# (benchmarks/varlen_attention.md) it is faster below ~100 packed tokens, ~2x slower at 200-300 and
# 6-13x slower at 1-4k tokens.
_MASKED_CALL_MAX_ELEMENTS = 128 * 128


@dataclass
class VarlenMeta:
    """Segment boundaries of one packed stream, prepared once per forward and shared by every layer
    (building the mask per layer would repeat O(N^2) work L times).

    Query segments are ``cu_seqlens``; key segment ``s`` is the same rows, or, when ``key_index`` is
    set (shared prefixes), rows ``key_index[cu_seqlens_k[s]:cu_seqlens_k[s + 1]]`` of the stream."""

    cu_seqlens: torch.Tensor  # [S + 1] int
    max_seqlen: int
    causal: bool
    bounds: list[int] = field(default_factory=list)  # cu_seqlens as Python ints
    mask: torch.Tensor | None = None  # [N, N] mask over the stream, when one masked call is used
    # sdpa without a mask: query rows permuted so segments of equal (query, key) lengths sit
    # together, the K/V rows in the same order, and (query length, key length, count) of each run
    perm: torch.Tensor | None = None
    inverse: torch.Tensor | None = None
    key_perm: torch.Tensor | None = None
    length_groups: list[tuple[int, int, int]] = field(default_factory=list)
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_k: int = 0
    key_index: torch.Tensor | None = None


def make_varlen_meta(cu_seqlens: torch.Tensor, *, causal: bool, backend: "AttnBackend" = "sdpa",
                     segments: Sequence[Sequence[int]] | None = None) -> VarlenMeta:
    """``segments``: per sequence of ``cu_seqlens``, the lengths of a shared prefix and of the branches
    sharing it (module docstring); a sequence of one length, or a prefix with a single branch, is
    plain causal attention. None: every sequence is plain."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if segments is not None and any(len(s) > 2 for s in segments):
        if not causal:
            raise ValueError("shared-prefix segments need causal attention")
        return _prefix_meta(bounds, segments, backend, cu_seqlens.device)
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    max_seqlen = max(lengths) if lengths else 0
    meta = VarlenMeta(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, causal=causal, bounds=bounds)
    total = bounds[-1] if bounds else 0
    if backend == "sdpa" and len(lengths) > 1:
        if total * total <= _MASKED_CALL_MAX_ELEMENTS:
            meta.mask = block_diagonal_mask(cu_seqlens, causal, cu_seqlens.device)
        else:
            ranges = [(s, e) for s, e in zip(bounds[:-1], bounds[1:])]
            _group_by_length(meta, ranges, [[r] for r in ranges], cu_seqlens.device)
    return meta


def _group_by_length(meta: VarlenMeta, queries: list[tuple[int, int]], keys: list[list[tuple[int, int]]],
                     device: torch.device) -> None:
    """Order segments by (query length, key length) so each run is one batched SDPA call."""
    lq = [e - s for s, e in queries]
    lk = [sum(e - s for s, e in ranges) for ranges in keys]
    order = sorted(range(len(queries)), key=lambda i: (lq[i], lk[i], i))
    for i in order:
        if meta.length_groups and meta.length_groups[-1][:2] == (lq[i], lk[i]):
            meta.length_groups[-1] = (lq[i], lk[i], meta.length_groups[-1][2] + 1)
        else:
            meta.length_groups.append((lq[i], lk[i], 1))
    key_rows = torch.cat([torch.arange(s, e) for i in order for s, e in keys[i]]).to(device)
    if order != sorted(order):
        perm = torch.cat([torch.arange(*queries[i]) for i in order]).to(device)
        meta.perm, meta.inverse = perm, torch.argsort(perm)
    if meta.perm is not None or not torch.equal(key_rows.cpu(), torch.arange(key_rows.numel())):
        meta.key_perm = key_rows


def _prefix_meta(bounds: list[int], segments: Sequence[Sequence[int]], backend: "AttnBackend",
                 device: torch.device) -> VarlenMeta:
    if len(segments) != len(bounds) - 1:
        raise ValueError(f"{len(segments)} segment lists for {len(bounds) - 1} sequences")
    queries: list[tuple[int, int]] = []  # query segments, in stream order
    keys: list[list[tuple[int, int]]] = []  # their key rows, as ranges of the stream
    for start, end, segs in zip(bounds[:-1], bounds[1:], segments):
        if sum(segs) != end - start:
            raise ValueError(f"segments {tuple(segs)} do not add up to the sequence's {end - start} tokens")
        if len(segs) <= 2:
            queries.append((start, end))
            keys.append([(start, end)])
            continue
        prefix = (start, start + segs[0])
        queries.append(prefix)
        keys.append([prefix])
        offset = prefix[1]
        for length in segs[1:]:
            if length:
                queries.append((offset, offset + length))
                keys.append([prefix, (offset, offset + length)])
            offset += length
    q_lens = [e - s for s, e in queries]
    k_lens = [sum(e - s for s, e in ranges) for ranges in keys]
    meta = VarlenMeta(
        cu_seqlens=torch.tensor([0, *q_lens], dtype=torch.int64).cumsum(0).to(device), max_seqlen=max(q_lens),
        causal=True, bounds=[0, *np.cumsum(q_lens).tolist()],
        cu_seqlens_k=torch.tensor([0, *k_lens], dtype=torch.int64).cumsum(0).to(device), max_seqlen_k=max(k_lens),
        key_index=torch.cat([torch.arange(s, e) for ranges in keys for s, e in ranges]).to(device),
    )
    total = bounds[-1]
    if backend == "sdpa":
        if total * total <= _MASKED_CALL_MAX_ELEMENTS:
            meta.mask = prefix_mask(bounds, segments, device)
        else:
            _group_by_length(meta, queries, keys, device)
    return meta


def block_diagonal_mask(cu_seqlens: torch.Tensor, causal: bool, device: torch.device) -> torch.Tensor:
    """Boolean [N, N] mask: token i may attend to j iff both lie in the same sequence (and j <= i)."""
    total = int(cu_seqlens[-1])
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device)
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    mask = segment[:, None] == segment[None, :]
    if causal:
        mask &= torch.ones(total, total, dtype=torch.bool, device=device).tril()
    return mask


def prefix_mask(bounds: Sequence[int], segments: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """Boolean [N, N] causal mask of a stream of shared-prefix sequences: token i sees j <= i of its
    own sequence when j is in the shared prefix or in i's own segment."""
    seq, seg, shared = [], [], []
    k = 0
    for s, segs in enumerate(segments):
        parts = [sum(segs)] if len(segs) <= 2 else list(segs)
        for j, length in enumerate(parts):
            seq.append(torch.full((length,), s))
            seg.append(torch.full((length,), k))
            shared.append(torch.full((length,), len(parts) > 1 and j == 0))
            k += 1
    seq_t, seg_t, shared_t = (torch.cat(x).to(device) for x in (seq, seg, shared))
    total = int(bounds[-1])
    mask = (seq_t[:, None] == seq_t[None, :]) & (shared_t[None, :] | (seg_t[:, None] == seg_t[None, :]))
    return mask & torch.ones(total, total, dtype=torch.bool, device=device).tril()


@torch.compiler.disable  # its loop over the batch's length groups would make every new packing a recompile
def sdpa_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: VarlenMeta, *, scale: float) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    if meta.mask is not None or (len(meta.bounds) <= 2 and meta.key_index is None):
        # SDPA wants [batch, heads, tokens, dim]
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if meta.mask is None:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=meta.causal, scale=scale, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=meta.mask, scale=scale, enable_gqa=gqa)
        # contiguous here, where the caller's reshape would copy anyway: a view's base differs from the other
        # paths' outputs, and torch.compile's guards on it recompiled the caller when a microbatch changed path
        return out.squeeze(0).transpose(0, 1).contiguous()
    if meta.perm is not None:
        q = q.index_select(0, meta.perm)
    if meta.key_perm is not None:
        k, v = k.index_select(0, meta.key_perm), v.index_select(0, meta.key_perm)
    q_sizes = [lq * count for lq, _, count in meta.length_groups]
    k_sizes = [lk * count for _, lk, count in meta.length_groups]
    # each group's output written into one fresh tensor (one copy per group, no concatenation; and never a view,
    # whose base torch.compile would guard in the caller: see the path above)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    start = 0
    for (lq, lk, count), qg, kg, vg in zip(meta.length_groups, q.split(q_sizes), k.split(k_sizes), v.split(k_sizes)):
        qb = qg.reshape(count, lq, qg.shape[1], qg.shape[2]).transpose(1, 2)
        kb, vb = (t.reshape(count, lk, t.shape[1], t.shape[2]).transpose(1, 2) for t in (kg, vg))
        if lq == lk or not meta.causal:
            ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=meta.causal, scale=scale, enable_gqa=gqa)
        else:  # causal aligned at the bottom right: query i sees keys up to i + lk - lq
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start:start + count * lq].view(count, lq, ob.shape[1], ob.shape[3]).copy_(ob.transpose(1, 2))
        start += count * lq
    return out.index_select(0, meta.inverse) if meta.inverse is not None else out


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: VarlenMeta, *, scale: float) -> torch.Tensor:
    """PyTorch's own FlashAttention varlen kernel (``torch.nn.attention.varlen``, what torchtitan
    uses): no extra package; bf16/fp16 on CUDA. K/V may have fewer heads (GQA)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    kwargs = {}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in inspect.signature(varlen_attn).parameters:
            kwargs["enable_gqa"] = True
        else:  # torch < 2.13 has no GQA flag: repeat K/V heads for their query groups
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    cu_q = meta.cu_seqlens.to(device=q.device, dtype=torch.int32)
    cu_k, max_k = cu_q, meta.max_seqlen
    if meta.key_index is not None:  # shared prefixes: each response's keys = prompt rows + its own
        k, v = k.index_select(0, meta.key_index), v.index_select(0, meta.key_index)
        cu_k, max_k = meta.cu_seqlens_k.to(device=q.device, dtype=torch.int32), meta.max_seqlen_k
    # FlashAttention aligns causal masks of unequal query/key lengths at the bottom right, as
    # shared prefixes need (the sdpa backend builds that mask explicitly)
    return varlen_attn(q, k, v, cu_q, cu_k, meta.max_seqlen, max_k, scale=scale,
                       window_size=(-1, 0) if meta.causal else (-1, -1), **kwargs)


AttentionFn = Callable[..., torch.Tensor]


def get_attention(backend: AttnBackend) -> AttentionFn:
    if backend == "sdpa":
        return sdpa_varlen
    if backend == "flash":
        if not torch.cuda.is_available():
            raise RuntimeError("attn_backend='flash' needs CUDA; use 'sdpa' on CPU")
        return flash_varlen
    raise ValueError(f"unknown attention backend {backend!r}; expected 'sdpa' or 'flash'")


class VarlenAttention(nn.Module):
    """The attention seam of a model: ``(q, k, v, meta, scale) -> out`` over a packed stream.

    A module (not a bare function) so parallelism can replace it from the outside, as
    torchtitan's ``inner_attention`` (``titanrl.parallel.ulysses`` wraps it for sequence
    parallelism). ``meta`` is whatever the model was given for its attention: a ``VarlenMeta``
    here; a wrapper may accept its own layout type and pass ``VarlenMeta``s down."""

    def __init__(self, backend: AttnBackend = "sdpa") -> None:
        super().__init__()
        self.set_backend(backend)

    def set_backend(self, backend: AttnBackend) -> None:
        self.backend = backend
        self.fn = get_attention(backend)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: VarlenMeta, *,
                scale: float) -> torch.Tensor:
        return self.fn(q, k, v, meta, scale=scale)

    def extra_repr(self) -> str:
        return f"backend={self.backend}"
