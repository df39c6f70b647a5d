"""Shared-prefix packing (a prompt computed once for the responses that share it) against the
unshared computation: every response packed whole, after its own copy of the prompt."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from titanrl.models import attention
from titanrl.models.attention import make_varlen_meta, sdpa_varlen


def _unshared(q, k, v, groups, scale):
    """Reference: each response as prompt + response, plain causal SDPA, one call per sequence."""
    outs = []
    offset = 0
    for segs in groups:
        p = segs[0]
        prompt = slice(offset, offset + p)
        first = None
        r_off = offset + p
        for r in segs[1:] or (0,):
            idx = torch.cat([torch.arange(prompt.start, prompt.stop), torch.arange(r_off, r_off + r)])
            qh, kh, vh = (t[idx].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                                                 enable_gqa=q.shape[1] != k.shape[1])
            o = o.squeeze(0).transpose(0, 1)
            if first is None:
                first = o[:p]
                outs.append(first)
            else:  # the prompt's rows are the same in every copy
                torch.testing.assert_close(o[:p], first, atol=1e-6, rtol=0)
            outs.append(o[p:])
            r_off += r
        offset += sum(segs)
    return torch.cat(outs)


@pytest.mark.parametrize("masked", [True, False])
def test_prefix_attention_equals_every_response_after_its_own_prompt(monkeypatch, masked):
    if not masked:  # force the batched path (segments grouped by query and key lengths)
        monkeypatch.setattr(attention, "_MASKED_CALL_MAX_ELEMENTS", 0)
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    # plain sequences, a prefix with one branch (plain too), groups of 2..16 unequal responses
    groups = [(7,), (5, 3), (9, 1, 4, 4, 2), (3, *rng.integers(1, 6, 16).tolist()), (11, 2, 2)]
    n = sum(sum(g) for g in groups)
    q = torch.randn(n, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(n, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(n, 2, 8, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, *np.cumsum([sum(g) for g in groups])])
    meta = make_varlen_meta(cu, causal=True, segments=groups)
    assert (meta.mask is not None) == masked
    out = sdpa_varlen(q, k, v, meta, scale=0.3)
    ref = _unshared(q, k, v, [g if len(g) > 1 else (g[0], 0) for g in groups], 0.3)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, atol=1e-10, rtol=0)


def test_segments_must_add_up():
    with pytest.raises(ValueError, match="do not add up"):
        make_varlen_meta(torch.tensor([0, 10]), causal=True, segments=[(4, 3, 2)])
