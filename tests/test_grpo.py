"""GRPO advantages, PPO-clip loss, KL estimators and rewards against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from titanrl.data.manifest import SampleRecord
from titanrl.rl.grpo import aggregate, count_uniform_groups, group_advantages, kl_penalty, ppo_clip_loss
from titanrl.rl.rewards import exact_match, exact_match_with_format, load_reward, math_answer


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = group_advantages(rewards, groups, std_normalize=True, eps=0.0)
    # group 0: mean 0.25, unbiased std sqrt(0.75/3) = 0.5 -> (0.75/0.5, -0.25/0.5 x3)
    assert torch.allclose(adv[:4], torch.tensor([1.5, -0.5, -0.5, -0.5]))
    # group 1: all equal -> no preference, advantage 0, no NaN
    assert torch.equal(adv[4:], torch.zeros(2))
    centred = group_advantages(rewards, groups, std_normalize=False)
    assert torch.allclose(centred, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0]))


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert torch.allclose(kl_penalty(logp, ref, "k1"), torch.tensor([0.5, -1.0]))
    x = ref - logp
    assert torch.allclose(kl_penalty(logp, ref, "k3"), torch.exp(x) - x - 1)
    assert (kl_penalty(logp, ref, "k3") >= 0).all()


def test_aggregation_modes_hand_computed():
    values = torch.tensor([1.0, 2.0, 3.0, 10.0])  # seq 0 has 3 tokens, seq 1 has 1
    seq_index, lengths = torch.tensor([0, 0, 0, 1]), torch.tensor([3, 1])
    kw = dict(seq_index=seq_index, seq_lengths=lengths, global_tokens=4.0, global_seqs=2.0)
    assert aggregate(values, mode="token-mean", **kw).item() == pytest.approx(16 / 4)
    assert aggregate(values, mode="seq-mean-token-sum", **kw).item() == pytest.approx((6 + 10) / 2)
    assert aggregate(values, mode="seq-mean-token-mean", **kw).item() == pytest.approx((2 + 10) / 2)


def test_split_contributions_sum_to_the_whole():
    """Two ranks with uneven shares, normalised globally, add up to the single-place loss."""
    torch.manual_seed(0)
    logp, old = torch.randn(10) * 0.1 - 1, torch.randn(10) * 0.1 - 1
    adv = torch.randn(10)
    seq_index, lengths = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3]), torch.tensor([3, 2, 4, 1])
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        kw = dict(clip_low=0.2, clip_high=0.28, mode=mode, global_tokens=10.0, global_seqs=4.0)
        whole = ppo_clip_loss(logp, old, adv, seq_index, lengths, **kw).loss
        a = ppo_clip_loss(logp[:3], old[:3], adv[:3], seq_index[:3], lengths[:1], **kw).loss
        b = ppo_clip_loss(logp[3:], old[3:], adv[3:], seq_index[3:] - 1, lengths[1:], **kw).loss
        assert (a + b).item() == pytest.approx(whole.item(), rel=1e-6)


def test_ppo_clip_hand_computed_and_masked_tokens():
    # ratio e^{0.5} = 1.6487 clipped to 1.2 for A > 0 (min of gains), unclipped e^{-0.5} for A > 0
    logp = torch.tensor([-0.5, -1.5, -1.0])
    old = torch.tensor([-1.0, -1.0, -1.0])
    adv = torch.tensor([1.0, 1.0, -2.0])
    out = ppo_clip_loss(logp, old, adv, torch.tensor([0, 0, 1]), torch.tensor([2, 1]), clip_low=0.2,
                        clip_high=0.2, mode="token-mean", global_tokens=3.0, global_seqs=2.0)
    expected = (-1.2 + -math.exp(-0.5) + 2.0 * 1.0) / 3
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert out.clip_fraction.item() == pytest.approx(1 / 3)
    # A masked token is one that is not passed at all: response tokens only, no prompt tokens.
    # Gradient flows only through the unclipped token 1 and token 2.
    logp_req = logp.clone().requires_grad_(True)
    ppo_clip_loss(logp_req, old, adv, torch.tensor([0, 0, 1]), torch.tensor([2, 1]), clip_low=0.2, clip_high=0.2,
                  mode="token-mean", global_tokens=3.0, global_seqs=2.0).loss.backward()
    assert logp_req.grad[0].item() == 0.0
    assert logp_req.grad[1].item() == pytest.approx(-math.exp(-0.5) / 3, rel=1e-6)


def test_degenerate_group_gives_zero_policy_gradient():
    rewards, groups = torch.ones(4), torch.zeros(4, dtype=torch.long)
    adv = group_advantages(rewards, groups)
    logp = torch.full((4,), -1.0, requires_grad=True)
    ppo_clip_loss(logp, logp.detach(), adv, torch.arange(4), torch.ones(4), clip_low=0.2, clip_high=0.2,
                  mode="token-mean", global_tokens=4.0, global_seqs=4.0).loss.backward()
    assert torch.equal(logp.grad, torch.zeros(4))


def test_kl_term_in_loss():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    out = ppo_clip_loss(logp, logp, torch.zeros(1), torch.tensor([0]), torch.tensor([1]), clip_low=0.2,
                        clip_high=0.2, mode="token-mean", global_tokens=1.0, global_seqs=1.0, ref_logp=ref,
                        kl_coef=0.5, kl_estimator="k1")
    assert out.loss.item() == pytest.approx(0.5 * 1.0)


RECORD = SampleRecord(id="s", source="geo3k", prompt="<image>q", media=[], answer="red",
                      answer_choices=["red", "green", "blue", "yellow"])


@pytest.mark.parametrize("response,score", [("red", 1.0), ("Red.", 1.0), (" red green", 1.0), ("green", 0.0),
                                            ("", 0.0), ("reddish", 0.0)])
def test_exact_match(response, score):
    assert exact_match(response, RECORD) == score


def test_exact_match_with_format():
    assert exact_match_with_format("red", RECORD) == {"score": pytest.approx(1.0), "correct": 1.0, "format": 1.0}
    assert exact_match_with_format("blue", RECORD) == {"score": pytest.approx(0.1), "correct": 0.0, "format": 1.0}
    assert exact_match_with_format("dog", RECORD) == {"score": 0.0, "correct": 0.0, "format": 0.0}


@pytest.mark.parametrize("response,answer,score", [
    (r"so \boxed{0.5}", "1/2", 1.0), (r"\boxed{\frac{1}{2}}", "0.5", 1.0), ("the area is 12", "12", 1.0),
    (r"\boxed{13}", "12", 0.0), (r"\boxed{x+1}", "x + 1", 1.0),
])
def test_math_answer(response, answer, score):
    rec = SampleRecord(id="m", source="geo3k", prompt="<image>q", media=[], answer=answer, answer_choices=[answer])
    assert math_answer(response, rec) == score


def test_a_reward_can_be_a_function_in_a_file(tmp_path):
    (tmp_path / "my_reward.py").write_text("def score(response, record):\n    return float(len(response))\n")
    fn = load_reward(f"{tmp_path / 'my_reward.py'}:score")
    assert fn("abc", None) == 3.0
    with pytest.raises(ValueError, match="no file"):
        load_reward(f"{tmp_path / 'missing.py'}:score")
    with pytest.raises(ValueError, match="has no 'nope'"):
        load_reward(f"{tmp_path / 'my_reward.py'}:nope")


def test_load_reward_errors_name_the_spec():
    assert load_reward("titanrl.rl.rewards:exact_match") is exact_match
    with pytest.raises(ValueError, match="no_such"):
        load_reward("titanrl.rl.rewards:no_such")
    with pytest.raises(ValueError, match="cannot import"):
        load_reward("titanrl.nope:f")


def test_compiled_policy_loss_equals_eager():
    """compile.components = ["loss"] compiles build_policy_loss's result: same loss and gradient."""
    from titanrl.config import JobConfig
    from titanrl.rl.grpo import build_policy_loss

    torch.manual_seed(0)
    loss_fn = build_policy_loss(JobConfig().rl)
    compiled = torch.compile(loss_fn, backend="aot_eager", dynamic=True)
    for n in (7, 11):  # a second length: dynamic shapes, no failure on a new size
        logp = (torch.randn(n) * 0.1 - 1).requires_grad_(True)
        args = (torch.randn(n) * 0.1 - 1, torch.randn(n), torch.tensor([0] * (n - 3) + [1, 1, 2]), torch.tensor([n - 3, 2, 1]))
        kw = dict(global_tokens=float(n), global_seqs=3.0, ref_logp=torch.randn(n) * 0.1 - 1, entropy=torch.rand(n))
        eager = loss_fn(logp, *args, **kw).loss
        (g_eager,) = torch.autograd.grad(eager, logp)
        out = compiled(logp, *args, **kw).loss
        (g_comp,) = torch.autograd.grad(out, logp)
        assert torch.allclose(out, eager, atol=1e-6) and torch.allclose(g_comp, g_eager, atol=1e-6)


def test_uniform_groups_are_the_ones_with_no_gradient():
    rewards = [1.0, 1.0, 0.0, 0.5, 0.0, 0.0, 0.0, 2.0]
    groups = [3, 3, 7, 7, 9, 9, 9, 11]  # group 3 all 1.0, group 9 all 0.0, group 11 a single response
    assert count_uniform_groups(rewards, groups) == (3, 4)
    adv = group_advantages(torch.tensor(rewards), torch.tensor([0, 0, 1, 1, 2, 2, 2, 3]))
    assert adv[[0, 1, 4, 5, 6, 7]].abs().max() == 0 and adv[[2, 3]].abs().min() > 0
    assert count_uniform_groups([], []) == (0, 0)


def _gae_loop(rewards, values, gamma, lam):
    """GAE as a per-token loop (the reference the scan must equal)."""
    adv = torch.zeros_like(values)
    last = 0.0
    for t in range(values.numel() - 1, -1, -1):
        next_value = values[t + 1] if t + 1 < values.numel() else 0.0
        last = rewards[t] + gamma * next_value - values[t] + gamma * lam * last
        adv[t] = last
    return adv


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 1.0), (0.9, 0.0), (1.0, 1.0)])
def test_gae_scan_equals_the_loop(gamma, lam):
    """The vectorised reverse scan over a padded batch equals the per-token loop of each response within 1e-12
    (float64), for lengths 0, 1, powers of two and between, with rewards on every token and at the last only."""
    from titanrl.rl.nodes import gae

    gen = torch.Generator().manual_seed(0)
    lengths = [0, 1, 2, 3, 7, 8, 9, 64, 257]
    width = max(lengths)
    values = torch.zeros(len(lengths), width, dtype=torch.float64)
    rewards = torch.zeros_like(values)
    for i, n in enumerate(lengths):
        values[i, :n] = torch.randn(n, generator=gen, dtype=torch.float64)
        rewards[i, :n] = torch.randn(n, generator=gen, dtype=torch.float64) if i % 2 else 0.0
        if n and not i % 2:
            rewards[i, n - 1] = 1.0
    batched = gae(rewards, values, gamma, lam)
    for i, n in enumerate(lengths):
        want = _gae_loop(rewards[i, :n], values[i, :n], gamma, lam)
        assert torch.allclose(batched[i, :n], want, rtol=0, atol=1e-12), (n, (batched[i, :n] - want).abs().max())
        assert torch.allclose(gae(rewards[i, :n], values[i, :n], gamma, lam), want, rtol=0, atol=1e-12)
        assert torch.count_nonzero(batched[i, n:]) == 0


def test_rloo_advantages_hand_computed():
    """RLOO (Ahmadian et al. 2024, eq. 6): each reward less the mean of its group's other rewards."""
    from titanrl.rl.grpo import rloo_advantages

    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 3.0, 7.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])  # group 2: one response
    expected = [1 - 0.25, 0 - 0.75, 0.5 - 0.5, 2 - 3, 3 - 2, 0.0]
    assert rloo_advantages(rewards, groups).tolist() == pytest.approx(expected)


def _two_responses():
    """Two responses (3 and 2 tokens) with log-probs of the new and old policy and advantages per token."""
    logp = torch.tensor([-1.0, -0.5, -2.0, -0.3, -1.2], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-1.1, -0.4, -2.5, -0.3, -0.9], dtype=torch.float64)
    adv = torch.tensor([0.5, 0.5, 0.5, -1.0, -1.0], dtype=torch.float64)
    return logp, old, adv, torch.tensor([0, 0, 0, 1, 1]), torch.tensor([3, 2])


def test_gspo_hand_computed():
    """GSPO (Zheng et al. 2025, eq. 5-7): s_i = exp(mean of the response's log-ratios), per response
    max(-A s, -A clip(s)), averaged over responses; the gradient of a clipped response is zero."""
    from titanrl.rl.grpo import gspo_loss

    logp, old, adv, seq, lengths = _two_responses()
    s0 = math.exp((0.1 - 0.1 + 0.5) / 3)  # 1.181: clipped at 1.1 for A > 0
    s1 = math.exp((0.0 - 0.3) / 2)  # 0.861: within [0.8, 1.1]
    expected = (max(-0.5 * s0, -0.5 * min(s0, 1.1)) + max(1.0 * s1, 1.0 * s1)) / 2
    out = gspo_loss(logp, old, adv, seq, lengths, clip_low=0.2, clip_high=0.1, mode="token-mean", global_tokens=5,
                    global_seqs=2)
    assert out.loss.item() == pytest.approx(expected) and out.clip_fraction.item() == pytest.approx(0.5)
    out.loss.backward()
    # response 0 clipped: no gradient; response 1: d/dlogp_t (A s / 2)... = -(-1) s1 / (2 * 2) per token
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, 0.0, s1 / 4, s1 / 4])
    with pytest.raises(RuntimeError, match="every token of each response"):
        gspo_loss(logp[:4], old[:4], adv[:4], seq[:4], lengths, clip_low=0.2, clip_high=0.1, mode="token-mean",
                  global_tokens=5, global_seqs=2)


def test_cispo_hand_computed():
    """CISPO (MiniMax-M1, eq. 4): per token -sg(clip(r)) A log pi, token-mean: every token keeps a gradient,
    weighted by its clipped ratio."""
    from titanrl.rl.grpo import cispo_loss

    logp, old, adv, seq, lengths = _two_responses()
    ratios = [math.exp(x) for x in (0.1, -0.1, 0.5, 0.0, -0.3)]
    weights = [min(max(r, 0.8), 1.1) for r in ratios]  # 1.105 -> 1.1, 1.649 -> 1.1, 0.741 -> 0.8
    a = adv.tolist()
    expected = sum(-w * ai * lp for w, ai, lp in zip(weights, a, logp.tolist())) / 5
    out = cispo_loss(logp, old, adv, seq, lengths, clip_low=0.2, clip_high=0.1, mode="token-mean", global_tokens=5,
                     global_seqs=2)
    assert out.loss.item() == pytest.approx(expected) and out.clip_fraction.item() == pytest.approx(3 / 5)
    out.loss.backward()
    assert logp.grad.tolist() == pytest.approx([-w * ai / 5 for w, ai in zip(weights, a)])


def test_sapo_hand_computed():
    """SAPO (Gao et al. 2025): per token -A (4 / tau) sigmoid(tau (r - 1)), tau by the advantage's sign, token-mean;
    its gradient is -A 4 s (1 - s) r per token: the plain policy gradient at r = 1, fading as r leaves it."""
    from titanrl.rl.grpo import sapo_loss

    logp, old, adv, seq, lengths = _two_responses()
    ratios = [math.exp(x) for x in (0.1, -0.1, 0.5, 0.0, -0.3)]
    a = adv.tolist()
    taus = [1.0 if ai > 0 else 3.0 for ai in a]
    gates = [1 / (1 + math.exp(-t * (r - 1))) for t, r in zip(taus, ratios)]
    out = sapo_loss(logp, old, adv, seq, lengths, tau_pos=1.0, tau_neg=3.0, mode="token-mean", global_tokens=5,
                    global_seqs=2)
    assert out.loss.item() == pytest.approx(sum(-ai * 4 / t * g for ai, t, g in zip(a, taus, gates)) / 5)
    out.loss.backward()
    assert logp.grad.tolist() == pytest.approx([-ai * 4 * g * (1 - g) * r / 5
                                                for ai, g, r in zip(a, gates, ratios)])
    assert out.clip_fraction.item() == 0.0  # every gate weight 4 s (1 - s) is above 1/2 this close to r = 1
    # on-policy (r = 1 everywhere) the gradient is exactly the policy gradient -A / 5 per token
    logp2 = old.clone().requires_grad_(True)
    sapo_loss(logp2, old, adv, seq, lengths, tau_pos=1.0, tau_neg=3.0, mode="token-mean", global_tokens=5,
              global_seqs=2).loss.backward()
    assert logp2.grad.tolist() == pytest.approx([-ai / 5 for ai in a])


def test_decoupled_cispo_and_gspo_hand_computed():
    """The decoupled forms (rl.behaviour_weight): CISPO weights each token's term by min(pi_old / pi_behaviour, cap);
    GSPO weights each response's term by min(exp(mean of its tokens' log(pi_old / pi_behaviour)), cap); no gradient
    through either weight; with the behaviour policy equal to the proximal one both are the plain objectives."""
    from titanrl.rl.grpo import cispo_loss, gspo_loss

    kw = dict(clip_low=0.2, clip_high=0.1, mode="token-mean", global_tokens=5, global_seqs=2)
    for loss in (cispo_loss, gspo_loss):
        logp, old, adv, seq, lengths = _two_responses()
        plain = loss(logp, old, adv, seq, lengths, **kw)
        same = loss(logp, old, adv, seq, lengths, behaviour_logp=old.clone(), behaviour_cap=2.0, **kw)
        assert same.loss.item() == pytest.approx(plain.loss.item()) and same.behaviour_weight.item() == 1.0
        assert plain.behaviour_weight is None
    # behaviour log-probs below the proximal ones by 0, 0.5, 1 (response 0) and 0.2, 0.2 (response 1)
    shift = torch.tensor([0.0, 0.5, 1.0, 0.2, 0.2], dtype=torch.float64)
    logp, old, adv, seq, lengths = _two_responses()
    out = cispo_loss(logp, old, adv, seq, lengths, behaviour_logp=old - shift, behaviour_cap=2.0, **kw)
    ratios = [math.exp(x) for x in (0.1, -0.1, 0.5, 0.0, -0.3)]
    clipped = [min(max(r, 0.8), 1.1) for r in ratios]
    w = [min(math.exp(x), 2.0) for x in shift.tolist()]  # e^1 = 2.72 -> 2
    a = adv.tolist()
    assert out.loss.item() == pytest.approx(sum(-wi * c * ai * lp for wi, c, ai, lp in
                                                zip(w, clipped, a, logp.tolist())) / 5)
    assert out.behaviour_weight.item() == pytest.approx(sum(w) / 5) and out.behaviour_truncated.item() == 0.2
    out.loss.backward()
    assert logp.grad.tolist() == pytest.approx([-wi * c * ai / 5 for wi, c, ai in zip(w, clipped, a)])

    logp, old, adv, seq, lengths = _two_responses()
    out = gspo_loss(logp, old, adv, seq, lengths, behaviour_logp=old - shift, behaviour_cap=1.4, **kw)
    s0, s1 = math.exp(0.5 / 3), math.exp(-0.3 / 2)  # response 0 clipped at 1.1 (A > 0), response 1 not
    w0, w1 = min(math.exp(1.5 / 3), 1.4), min(math.exp(0.2), 1.4)  # 1.649 -> 1.4, 1.221
    assert out.loss.item() == pytest.approx((w0 * -0.5 * min(s0, 1.1) + w1 * 1.0 * s1) / 2)
    assert out.behaviour_weight.item() == pytest.approx((w0 + w1) / 2) and out.behaviour_truncated.item() == 0.5
    out.loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, 0.0, w1 * s1 / 4, w1 * s1 / 4])


@pytest.mark.parametrize("clip", [(0.2, 0.1), (0.5, 0.5)], ids=["one_clipped", "none_clipped"])
def test_gspo_over_split_responses_equals_whole_responses(clip):
    """GSPO with responses split between two ranks (Ulysses slices): each rank holds some tokens of each response
    and its call sums the response's parts with the other's (two threads here, exchanging what each rank's
    all-reduce would). The two ranks' losses, clip fractions and behaviour weights add up to the whole responses'
    in one call, and their gradients are the whole call's on the tokens each holds."""
    import threading

    from titanrl.rl.grpo import gspo_loss

    kw = dict(clip_low=clip[0], clip_high=clip[1], mode="seq-mean-token-mean", global_tokens=5, global_seqs=2,
              behaviour_cap=1.4, kl_coef=0.1)
    shift = torch.tensor([0.0, 0.5, 1.0, 0.2, 0.2], dtype=torch.float64)
    logp, old, adv, seq, lengths = _two_responses()
    ref = old - 0.3
    whole = gspo_loss(logp, old, adv, seq, lengths, behaviour_logp=old - shift, ref_logp=ref, **kw)
    whole.loss.backward()
    assert logp.grad.abs().max() > 0.05  # a learning signal in both variants

    holds = ([0, 1, 3], [2, 4])  # response 0's tokens 0, 1 and response 1's token 3 on the first rank
    meeting, posted, out = threading.Barrier(2), {}, {}

    def rank(r):
        idx = torch.tensor(holds[r])
        mine = logp.detach()[idx].clone().requires_grad_(True)

        def response_sums(values):  # the other rank's parts, as the group's all-reduce adds them
            posted[r] = values.clone()
            meeting.wait()
            return values + posted[1 - r]

        res = gspo_loss(mine, old[idx], adv[idx], seq[idx], lengths, behaviour_logp=(old - shift)[idx],
                        ref_logp=ref[idx], response_sums=response_sums, **kw)
        res.loss.backward()
        out[r] = (res, mine.grad)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for field in ("loss", "pg_loss", "kl", "clip_fraction", "behaviour_weight", "behaviour_truncated"):
        total = sum(float(getattr(out[r][0], field).detach()) for r in (0, 1))
        assert total == pytest.approx(float(getattr(whole, field).detach()), rel=1e-12, abs=1e-15), field
    grad = torch.zeros(5, dtype=torch.float64)
    for r in (0, 1):
        grad[torch.tensor(holds[r])] = out[r][1]
    assert torch.allclose(grad, logp.grad, rtol=1e-12, atol=1e-15)
    with pytest.raises(RuntimeError, match="parts were not summed"):
        gspo_loss(logp[:4], old[:4], adv[:4], seq[:4], lengths, response_sums=lambda v: v, **kw)


def test_objective_choices_are_checked_against_the_rest_of_the_config():
    from titanrl.config import JobConfig

    def problems(**rl):
        cfg = JobConfig()
        for k, v in rl.items():
            setattr(cfg.rl, k, v)
        return " ".join(cfg.problems())

    assert "needs the critic" in problems(advantage="gae")
    assert "would not use it" in problems(algorithm="ppo", advantage="rloo")
    assert "per token" in problems(algorithm="ppo", policy_loss="gspo")
    cfg = JobConfig()
    cfg.rl.policy_loss, cfg.parallelism.ulysses = "gspo", "flex"
    assert not cfg.problems()  # responses split by Ulysses have their parts summed (one all-reduce per group)
    assert not problems(advantage="rloo", policy_loss="cispo") and not problems(policy_loss="gspo")
    assert "rl.behaviour_weight_cap >= 1" in problems(behaviour_weight="always", behaviour_weight_cap=0.0)
    cfg = JobConfig()
    cfg.rl.policy_loss, cfg.workflow.mode, cfg.workflow.placement = "cispo", "async", "disaggregated"
    cfg.workflow.rollout_ranks = 1
    assert not cfg.problems()  # the decoupled objectives (rl.behaviour_weight) exist for every policy loss


# the decoupled objective in synchronous runs (rl.behaviour_weight = always), against a nucleus the trainer does not
# truncate to (rollout.top_p < 1): each token's weight pi_old / pi_engine is the nucleus's mass, ~0.90 on every token
# of the near-uniform tiny model. So these runs show the engine's log-probs reaching the loss on every rank (the
# weight's mean equal to 1 process's); the weighting of unequal weights is the hand computations'.
_WEIGHTED = ("--rl.behaviour_weight=always", "--rollout.top_p=0.9")


@pytest.mark.slow
@pytest.mark.parametrize("objective", [("--rl.advantage=rloo", "--rl.policy_loss=gspo", "--rl.clip_low=3e-4",
                                        "--rl.clip_high=4e-4", "--rollout.max_new_tokens=8", "--rl.minibatches=1",
                                        "--rl.ppo_epochs=2",
                                        *_WEIGHTED),
                                       ("--rl.policy_loss=cispo", "--rl.clip_high=0.3", "--model.freeze_vision_tower",
                                        *_WEIGHTED),
                                       ("--rl.advantage=reinforce++", "--rl.kl_coef=0.05", "--rl.policy_loss=sapo")],
                         ids=["rloo_gspo", "cispo_frozen_tower", "reinforce_pp_sapo"])
def test_objectives_on_two_ranks_equal_one(objective, tmp_path, run_cache):
    """RLOO advantages with GSPO (the paper's clip range), CISPO, and REINFORCE++ (the KL in each token's reward)
    with SAPO's soft gate:
    several ranks equal 1 rank on per-token log-probs (and REINFORCE++'s per-token advantages) and parameter
    updates, with a learning signal. GSPO and CISPO run decoupled (rl.behaviour_weight = always, top_p 0.9): each response's
    (GSPO) or token's (CISPO) term weighted by its behaviour weight, the engine's log-probs routed with the
    trajectories. GSPO runs on 4 ranks with FlexUlysses and vision balancing (responses of 8 tokens, one minibatch
    trained twice, the second time with ratios off 1), so some responses' tokens lie on several ranks and their
    ratios come from the parts' sums. CISPO's runs also freeze the vision tower (model.freeze_vision_tower), on 4
    ranks with FlexUlysses and vision balancing (the tower's rows routed between ranks, no gradient back): the tower
    keeps the checkpoint's weights bit for bit while the language model trains."""
    from titanrl.rl.dump import load_dumps
    from train_runs import assert_same_computation, train_tiny

    frozen = "--model.freeze_vision_tower" in objective
    parallel = ("--parallelism.ulysses=flex", "--parallelism.vision_balance=true") if frozen else ()
    gspo = "--rl.policy_loss=gspo" in objective
    if gspo:
        parallel = ("--parallelism.ulysses=flex", "--parallelism.vision_balance=true")
    one_dir, one = train_tiny(tmp_path, run_cache, "one", 1, *objective)
    two_dir, two = train_tiny(tmp_path, run_cache, "two", 4 if frozen or gspo else 2, *objective, *parallel)
    seen = assert_same_computation(one_dir, two_dir)
    assert {"old_logprobs", "update/policy"} <= set(seen), seen
    assert all(r["clip_fraction"] >= 0 for r in two)
    if gspo:  # the update's plan is the step's (one minibatch)
        assert all(r["parallel/split_responses"] > 0 for r in two), [r["parallel/split_responses"] for r in two]
    if "--rl.behaviour_weight=always" in objective:
        weights = [(a["rl/behaviour_weight_mean"], b["rl/behaviour_weight_mean"]) for a, b in zip(one, two)]
        assert len(weights) == 2 and all(0.5 < a < 0.97 and abs(a - b) <= 1e-5 for a, b in weights), weights
    else:
        assert not any("rl/behaviour_weight_mean" in r for r in one + two)
    if frozen:
        dumps = load_dumps(two_dir)
        first, last = dumps[1]["params"]["policy"], dumps[max(dumps)]["params"]["policy"]
        tower = [k for k in first if k.startswith("vision.")]
        assert tower and all(torch.equal(first[k], last[k]) for k in tower)
        assert max(float((last[k] - first[k]).abs().max()) for k in first if k not in tower) > 1e-4
        # after the first push only the language model's units go to the engines; they then equal the trainer
        pushed = [r["sync/bytes"] for r in two if "sync/bytes" in r]
        assert len(pushed) == 2 and pushed[1] < 0.8 * pushed[0], pushed
        assert max(r["probe/logprob_max_diff"] for r in two if "probe/logprob_max_diff" in r) <= 1e-4
        assert max(r["parallel/sharded_sequences"] for r in two if "parallel/sharded_sequences" in r) > 0


def test_reinforce_pp_advantages_hand_computed():
    """REINFORCE++ (Hu 2025, eq. 2-4): per token, the reward at the last token less kl_coef x KL_t (old less
    reference log-prob), summed from the token to the end, then normalised over the step's tokens; the loss then
    carries no KL term of its own, and the graph computes the log-probs before the advantages."""
    from types import SimpleNamespace

    from titanrl.config import JobConfig
    from titanrl.rl.grpo import build_policy_loss
    from titanrl.rl.nodes import old_from_first_forward, reinforce_pp_advantages
    from titanrl.workflow.graph import resolve

    cfg = JobConfig()
    cfg.rl.advantage, cfg.rl.kl_coef = "reinforce++", 0.5
    trajs = [SimpleNamespace(old_logprobs=torch.tensor([-1.0, -2.0]), ref_logprobs=torch.tensor([-1.5, -1.0]),
                             reward=1.0),
             SimpleNamespace(old_logprobs=torch.tensor([-0.5]), ref_logprobs=torch.tensor([-0.5]), reward=0.0)]
    batch = SimpleNamespace(trajectories=trajs, group=None, metrics={})
    reinforce_pp_advantages(batch, SimpleNamespace(cfg=cfg))
    # KL = [0.5, -1.0] and [0.0]; token rewards [-0.25, 0.5 + 1] and [0]; returns [1.25, 1.5] and [0]
    raw = [1.25, 1.5, 0.0]
    mean = sum(raw) / 3
    std = (sum((x - mean) ** 2 for x in raw) / 2) ** 0.5
    got = trajs[0].advantages.tolist() + trajs[1].advantages.tolist()
    assert got == pytest.approx([(x - mean) / std for x in raw], rel=1e-6)
    assert build_policy_loss(cfg.rl).keywords["kl_coef"] == 0.0 and not old_from_first_forward(cfg)
    order = [n.id for n in resolve(cfg).nodes]
    assert order.index("advantage") > max(order.index("old_logprob"), order.index("ref_logprob"))




def test_auto_old_logprobs_take_the_first_forward_only_where_it_is_the_old_policy():
    """rl.old_logprobs = auto reuses the first minibatch's update forward as the old policy's, which it is not with
    LoRA dropout (the update drops adapter inputs, the log-prob stages do not) nor over several PPO epochs."""
    from titanrl.config import JobConfig
    from titanrl.rl.nodes import old_from_first_forward

    cfg = JobConfig()
    assert old_from_first_forward(cfg)
    cfg.lora.rank = 8
    assert old_from_first_forward(cfg)
    cfg.lora.dropout = 0.1
    assert not old_from_first_forward(cfg)
    cfg = JobConfig()
    cfg.rl.ppo_epochs = 2
    assert not old_from_first_forward(cfg)
def test_overlong_penalty_hand_computed():
    """DAPO's soft overlong punishment (eq. 13) with L_max = 10, L_cache = 4: 0 up to 6 tokens, then -penalty x
    (L - 6) / 4, the whole penalty at 10 tokens."""
    from titanrl.rl.rewards import overlong_penalty

    got = [overlong_penalty(n, 10, 4, 0.5) for n in (1, 6, 7, 9, 10, 12)]
    assert got == pytest.approx([0.0, 0.0, -0.125, -0.375, -0.5, -0.5])
    assert overlong_penalty(10, 10, 0, 1.0) == 0.0


def test_a_multi_turn_trajectory_is_punished_as_its_longest_turn():
    """Multi-turn (rollout.max_turns > 1): rollout.max_new_tokens bounds each turn, so DAPO's punishment takes the
    trajectory's longest turn (a run of generated tokens between observations); single-turn: the response."""
    import numpy as np

    from titanrl.rl.batch import Trajectory

    def traj(generated, length=None):
        mask = None if generated is None else np.asarray(generated, dtype=bool)
        return Trajectory(prompt=None, group=0, response_ids=np.arange(length or len(mask)), generated=mask)

    turns = [1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0, 1, 1]  # turns of 3, 5 and 2 generated tokens between observations
    assert traj(turns).longest_turn == 5 and traj(turns).num_generated_tokens == 10
    assert traj(None, 13).longest_turn == 13 and traj([0, 0]).longest_turn == 0 and traj([1, 1]).longest_turn == 2
    from titanrl.rl.rewards import overlong_penalty

    assert overlong_penalty(traj(turns).longest_turn, 6, 2, 1.0) == pytest.approx(-0.5)  # not 10 of 6: the limit


def test_overlong_settings_are_checked():
    from titanrl.config import JobConfig

    cfg = JobConfig()
    cfg.rollout.max_new_tokens, cfg.rl.overlong_buffer = 4, 4
    assert any("must be below rollout.max_new_tokens = 4" in p for p in cfg.problems())
    cfg.rl.overlong_buffer, cfg.rollout.max_turns, cfg.rl.env = 2, 3, "titanrl.envs.zoom:ZoomEnv"
    assert not cfg.problems()  # multi-turn: each turn ends at max_new_tokens, the longest one is punished
    cfg.rl.overlong_buffer, cfg.rl.mask_truncated = 0, True
    assert not cfg.problems()
    cfg.rl.overlong_buffer, cfg.rl.overlong_penalty = -1, -0.5
    assert {"rl.overlong_buffer must be >= 0 (0 = off), got -1", "rl.overlong_penalty must be >= 0, got -0.5"} <= \
        set(cfg.problems())


@pytest.fixture(scope="module")
def stop_ckpt(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint whose generation config also ends a response at any of 100 of its 1024 tokens: its random
    policy ends about half of 6-token responses by itself and the engine cuts the rest, so finished and truncated
    responses mix in every group."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("stop_ckpt") / "qwen2_5_vl_tiny_stop"
    shutil.copytree(tiny_ckpt, out)
    config = json.loads((out / "generation_config.json").read_text())
    config["eos_token_id"] = config["eos_token_id"] + list(range(300, 400))
    (out / "generation_config.json").write_text(json.dumps(config))
    return out


@pytest.mark.slow
def test_overlong_masking_on_two_ranks_equals_dropping_the_responses_in_the_graph(stop_ckpt, tmp_path, run_cache):
    """DAPO's overlong handling: rl.overlong_buffer's reward term, and rl.mask_truncated leaving the responses the
    engine cut out of the policy update (lb_mini, 2 ranks) equals one process whose workflow drops them after their
    group's advantages (a user node, the graph's own way): per-token log-probs of the trained responses and parameter
    updates, with a learning signal; the penalty each response got is eq. 13 of its length."""
    from titanrl.rl.dump import load_dumps
    from titanrl.rl.rewards import overlong_penalty
    from train_runs import ROOT, assert_same_computation, train_tiny

    overlong = (f"--model.path={stop_ckpt}", "--rollout.max_new_tokens=6", "--rl.overlong_buffer=3")
    toml = tmp_path / "drop_truncated.toml"
    toml.write_text(f'''[[workflow.nodes]]
id = "drop_truncated"
function = "{ROOT / 'tests' / 'drop_truncated.py'}:drop_truncated"
inputs = ["advantage"]

[[workflow.nodes]]
id = "old_logprob"
inputs = ["drop_truncated"]

[[workflow.nodes]]
id = "ref_logprob"
inputs = ["drop_truncated"]
''')
    dropped_dir, dropped = train_tiny(tmp_path, run_cache, "dropped", 1, *overlong, config=str(toml))
    masked_dir, masked = train_tiny(tmp_path, run_cache, "masked", 2, *overlong, "--rl.mask_truncated",
                                    "--balance.strategy=lb_mini")
    seen = assert_same_computation(masked_dir, dropped_dir, b_subset=True)
    assert {"old_logprobs", "update/policy"} <= set(seen), seen
    dumps = load_dumps(masked_dir)
    for rec in masked:
        trajs = dumps[rec["step"]]["trajectories"].values()
        cut = [t for t in trajs if len(t["response_ids"]) == 6]  # (with those the model ended at the 6th token)
        assert 0 < rec["train/masked_truncated"] <= len(cut) < len(trajs), rec
        assert rec["response/truncated_fraction"] == rec["train/masked_truncated"] / len(trajs)
        penalties = [overlong_penalty(len(t["response_ids"]), 6, 3, 1.0) for t in trajs]
        assert rec["reward/overlong_penalty"] == pytest.approx(sum(penalties) / len(trajs))
        assert len(set(penalties)) > 1
    assert [r["train/tokens_represented"] for r in masked] == [r["train/tokens_represented"] for r in dropped]
