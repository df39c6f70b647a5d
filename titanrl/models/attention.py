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

Tensors are ``[tokens, heads, head_dim]``; K/V may have fewer heads than Q (GQA).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

AttnBackend = Literal["sdpa", "flash"]

# Above this many (tokens x tokens) mask entries the sdpa backend loops per sequence instead.
_MASKED_CALL_MAX_ELEMENTS = 4096 * 4096


@dataclass
class VarlenMeta:
    """Sequence boundaries of one packed stream, prepared once per forward and shared by
    every layer (building the mask per layer would repeat O(N^2) work L times)."""

    cu_seqlens: torch.Tensor  # [S + 1] int
    max_seqlen: int
    causal: bool
    bounds: list[int] = field(default_factory=list)  # cu_seqlens as Python ints
    mask: torch.Tensor | None = None  # block-diagonal mask, when one masked call is used
    # sdpa without a mask: tokens permuted so sequences of equal length sit together, and
    # (length, count) of each run of equal lengths in that order
    perm: torch.Tensor | None = None
    inverse: torch.Tensor | None = None
    length_groups: list[tuple[int, int]] = field(default_factory=list)


def make_varlen_meta(cu_seqlens: torch.Tensor, *, causal: bool, backend: "AttnBackend" = "sdpa") -> VarlenMeta:
    bounds = [int(b) for b in cu_seqlens.tolist()]
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    max_seqlen = max(lengths) if lengths else 0
    meta = VarlenMeta(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, causal=causal, bounds=bounds)
    total = bounds[-1] if bounds else 0
    if backend == "sdpa" and len(lengths) > 1:
        if total * total <= _MASKED_CALL_MAX_ELEMENTS:
            meta.mask = block_diagonal_mask(cu_seqlens, causal, cu_seqlens.device)
        else:
            order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
            for i in order:
                if meta.length_groups and meta.length_groups[-1][0] == lengths[i]:
                    meta.length_groups[-1] = (lengths[i], meta.length_groups[-1][1] + 1)
                else:
                    meta.length_groups.append((lengths[i], 1))
            if order != sorted(order):
                perm = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in order]).to(cu_seqlens.device)
                meta.perm, meta.inverse = perm, torch.argsort(perm)
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


def sdpa_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: VarlenMeta, *, scale: float) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    if len(meta.bounds) <= 2 or meta.mask is not None:
        # SDPA wants [batch, heads, tokens, dim]
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if meta.mask is None:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=meta.causal, scale=scale, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=meta.mask, scale=scale, enable_gqa=gqa)
        return out.squeeze(0).transpose(0, 1)
    if meta.perm is not None:
        q, k, v = (t.index_select(0, meta.perm) for t in (q, k, v))
    sizes = [length * count for length, count in meta.length_groups]
    outs = []
    for (length, count), qg, kg, vg in zip(meta.length_groups, q.split(sizes), k.split(sizes), v.split(sizes)):
        qb, kb, vb = (t.reshape(count, length, t.shape[1], t.shape[2]).transpose(1, 2) for t in (qg, kg, vg))
        ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=meta.causal, scale=scale, enable_gqa=gqa)
        outs.append(ob.transpose(1, 2).reshape(count * length, ob.shape[1], ob.shape[3]))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
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
    cu = meta.cu_seqlens.to(device=q.device, dtype=torch.int32)
    return varlen_attn(q, k, v, cu, cu, meta.max_seqlen, meta.max_seqlen, scale=scale,
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
