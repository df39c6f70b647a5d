"""Shared-prefix packing (a prompt computed once for the responses that share it) against the
unshared computation: every response packed whole, after its own copy of the prompt."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from titanrl.models import attention
from titanrl.models.attention import make_varlen_meta, sdpa_varlen
from titanrl.rl.units import split_responses
from titanrl.rl.stages import StageRunner

sys.path.insert(0, str(Path(__file__).parent / "dist"))


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


# ---------------------------------------------------------------- units


def test_split_responses_keeps_each_sub_group_within_the_budget():
    rng = np.random.default_rng(1)
    for _ in range(300):
        prompt = int(rng.integers(1, 60))
        lens = rng.integers(1, 40, int(rng.integers(1, 17))).tolist()
        cap = int(rng.integers(prompt + 1, prompt + 200))
        chunks = split_responses(prompt, lens, cap)
        assert [i for c in chunks for i in c] == list(range(len(lens)))  # every response once, in order
        assert all(c for c in chunks)
        for c in chunks:
            assert prompt + sum(lens[i] for i in c) <= cap or len(c) == 1
    assert split_responses(10, [5, 5, 5], None) == [[0, 1, 2]]
    assert split_responses(10, [5, 5, 5, 5], 20) == [[0, 1], [2, 3]]  # even halves, not 2 + 1 + 1


def test_scored_log_probs_of_a_shared_prefix_unit():
    from titanrl.rl.units import _scored

    # prompt of 4 tokens (0..3), responses of 3 (4..6) and 2 (7..8)
    sc = _scored(4, (3, 2), 0, 9)
    assert sc.positions.tolist() == [3, 4, 5, 3, 7]  # position 3 predicts both first tokens
    assert sc.targets.tolist() == [4, 5, 6, 7, 8]
    assert sc.response.tolist() == [0, 0, 0, 1, 1] and sc.token.tolist() == [0, 1, 2, 0, 1]
    tail = _scored(4, (3, 2), 4, 9)  # a slice without the prompt's last token
    assert tail.positions.tolist() == [4, 5, 7]


def test_prefix_cost_is_the_unshared_cost_of_one_response_and_less_for_more():
    from titanrl.parallel.cost_model import CostModel

    cm = CostModel()
    assert cm.prefix_compute(100, [20]) == pytest.approx(float(cm.compute(120)))
    shared = cm.prefix_compute(100, [20] * 8)
    assert float(cm.compute(260)) > shared > cm.prefix_compute(100, [20] * 4)
    assert shared < 8 * float(cm.compute(120)) / 3


# ---------------------------------------------------------------- the training stages


def _trajectories():
    from ulysses_step import make_trajectories

    kinds = [[], [("image", (1, 8, 8))], [("video", (4, 4, 6))], [("image", (1, 4, 4)), ("image", (1, 6, 4))],
             [("video", (6, 8, 8))], []]
    return make_trajectories(kinds, [16, 5, 1, 3, 8, 2], min_response=1, max_response=12)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("max_tokens", [4096, 150])
def test_stages_with_shared_prefixes_equal_the_unshared_computation(mode, max_tokens):
    """Text, image, multi-image and video prompts with 1-16 responses of unequal lengths, through the
    trainer's StageRunner: log-probs, entropy, loss and every gradient (vision tower included) equal
    the trajectories packed whole. A budget of 150 tokens splits the large groups into sub-groups over
    several microbatches."""
    from fsdp_step import ARGS

    from titanrl.models.qwen2_5_vl import Qwen2_5_VLModel
    from titanrl.parallel.cost_model import CostModel
    from titanrl.rl.batch import pack_trajectories
    from titanrl.rl.grpo import ppo_clip_loss

    torch.manual_seed(0)
    model = Qwen2_5_VLModel(ARGS)
    model.init_weights()
    trajs = _trajectories()
    loss_kw = dict(clip_low=0.2, clip_high=0.28, mode=mode, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)

    # reference: every trajectory whole, one pack
    pack = pack_trajectories(trajs, ARGS, torch.device("cpu"), torch.float32, return_entropy=True)
    out = model(pack.batch, pack.targets)
    cat = lambda attr: torch.cat([getattr(t, attr) for t in trajs])  # noqa: E731
    adv = torch.cat([torch.full((t.num_response_tokens,), t.advantage) for t in trajs])
    ref = ppo_clip_loss(out.logprobs, cat("old_logprobs"), adv, pack.seq_index, pack.seq_lengths,
                        global_tokens=float(sum(t.num_response_tokens for t in trajs)),
                        global_seqs=float(len(trajs)), ref_logp=cat("ref_logprobs"), entropy=out.entropy, **loss_kw)
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    ref_logp = torch.split(out.logprobs.detach(), [t.num_response_tokens for t in trajs])
    model.zero_grad()

    runner = StageRunner(args=ARGS, rank=0, world=1, device=torch.device("cpu"), dtype=torch.float32, method="none",
                         strategy="lb_micro", max_tokens=max_tokens, cost_model=CostModel(), shared_prefix=True)
    runner.begin_step(trajs)
    units, plan = runner.plan(runner.all_ids())
    assert len(units) < len(trajs)
    if max_tokens == 150:
        assert len(units) > 6 and len(plan.waves) > 1  # sub-groups, several microbatches
    with torch.no_grad():
        runner.logprobs(model, "new_logprobs", temperature=1.0)
    for t, r in zip(trajs, ref_logp):
        torch.testing.assert_close(t.new_logprobs, r, atol=1e-5, rtol=0)

    def loss_fn(o, inputs, global_tokens, global_seqs):
        return ppo_clip_loss(o.logprobs, inputs.fields["old_logprobs"], inputs.advantages, inputs.seq_index,
                             inputs.seq_lengths, global_tokens=global_tokens, global_seqs=global_seqs,
                             ref_logp=inputs.fields["ref_logprobs"], entropy=o.entropy, **loss_kw)

    results = runner.train_minibatch(model, runner.all_ids(), ("old_logprobs", "ref_logprobs"), loss_fn,
                                     temperature=1.0)
    assert sum(r.loss.item() for r in results) == pytest.approx(ref.loss.item(), abs=1e-6)
    assert sum(r.entropy.item() for r in results) == pytest.approx(ref.entropy.item(), abs=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], atol=1e-5, rtol=0, msg=n)
    m = runner.metrics()
    assert m["train/tokens_represented"] == sum(t.num_tokens for t in trajs)
    assert m["train/tokens_computed"] == sum(u.num_tokens for u in units) < m["train/tokens_represented"]
