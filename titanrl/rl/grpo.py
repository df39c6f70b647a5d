"""The GRPO family as plain tensor functions: group advantages (GRPO, RLOO) and the policy objectives (PPO-clip,
GSPO, CISPO).

Losses are returned as *contributions to a global mean*: each is a sum over the local tokens
divided by the global normaliser of the minibatch (tokens or sequences, all-reduced by the
caller), so summing contributions over microbatches and ranks gives exactly the loss of the
whole minibatch computed in one place, however unevenly it was split.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch

LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
KLEstimator = Literal["k1", "k3"]


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """A_i = (r_i - mean(group)) [/ (std(group) + eps)], one scalar per response.

    A group whose rewards are all equal carries no preference and gets advantage 0 (not a
    division by zero). std is the unbiased sample std, as in the GRPO paper and verl."""
    rewards = rewards.double()
    num_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    counts = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_ids, torch.ones_like(rewards))
    sums = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_ids, rewards)
    mean = sums / counts.clamp(min=1)
    centred = rewards - mean[group_ids]
    if not std_normalize:
        return centred.float()
    sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_ids, centred**2)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    std = std[group_ids]
    safe = torch.where(std > 0, std + eps, torch.ones_like(std))
    return torch.where(std > 0, centred / safe, torch.zeros_like(centred)).float()


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, "Back to Basics", eq. 6): A_i = r_i - 1/(k-1) sum_{j != i} r_j
    over the k responses of i's prompt, i.e. k/(k-1) (r_i - mean). A response alone in its group gets 0."""
    rewards = rewards.double()
    num_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    counts = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_ids, torch.ones_like(rewards))
    sums = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_ids, rewards)
    k = counts[group_ids]
    others = (sums[group_ids] - rewards) / (k - 1).clamp(min=1)
    return torch.where(k > 1, rewards - others, torch.zeros_like(rewards)).float()


def count_uniform_groups(rewards: Sequence[float], group_ids: Sequence[int]) -> tuple[int, int]:
    """(groups whose rewards are all equal, groups): the first carry no GRPO gradient at all (their
    advantages are 0), so their share is how much of a step's batch teaches nothing - the signature
    of a policy collapsed onto one answer, or of a task already solved."""
    values: dict[int, set[float]] = {}
    for r, g in zip(rewards, group_ids):
        values.setdefault(int(g), set()).add(float(r))
    return sum(len(v) == 1 for v in values.values()), len(values)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1 / k3)."""
    log_ratio = ref_logp - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k3":
        # exp(x) - x - 1 >= 0; clamp keeps a wild token from overflowing exp.
        log_ratio = log_ratio.clamp(-20.0, 20.0)
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}")


def aggregate(
    token_values: torch.Tensor,
    seq_index: torch.Tensor,
    seq_lengths: torch.Tensor,
    *,
    mode: LossAgg,
    global_tokens: float,
    global_seqs: float,
) -> torch.Tensor:
    """Contribution of these tokens to the minibatch mean under ``mode``.

    token_values [T]; seq_index [T] local sequence of each token; seq_lengths [S] the *whole*
    response length of each local sequence. Every mode is a sum of per-token terms, so a sequence
    split across calls or ranks (Ulysses slices) contributes exactly its share."""
    if mode == "token-mean":
        return token_values.sum() / global_tokens
    per_seq = torch.zeros(seq_lengths.numel(), dtype=token_values.dtype, device=token_values.device)
    per_seq = per_seq.index_add(0, seq_index, token_values)
    if mode == "seq-mean-token-sum":
        return per_seq.sum() / global_seqs
    if mode == "seq-mean-token-mean":
        return (per_seq / seq_lengths.clamp(min=1).to(per_seq.dtype)).sum() / global_seqs
    raise ValueError(f"unknown loss aggregation {mode!r}")


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor  # contribution to the minibatch loss (differentiable)
    pg_loss: torch.Tensor
    kl: torch.Tensor  # contribution to the mean KL (detached)
    clip_fraction: torch.Tensor  # contribution to the mean fraction of clipped tokens (detached)
    entropy: torch.Tensor  # contribution to the mean entropy (detached)
    behaviour_weight: torch.Tensor | None = None  # contribution to the mean importance weight (detached)
    behaviour_truncated: torch.Tensor | None = None  # contribution to the share of tokens at the cap (detached)


@dataclass
class ValueLossOutput:
    loss: torch.Tensor  # contribution to the minibatch's value loss (differentiable)
    value_loss: torch.Tensor  # the same, detached
    clip_fraction: torch.Tensor  # contribution to the share of tokens whose clipped error was the larger


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    seq_index: torch.Tensor,
    seq_lengths: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    mode: LossAgg,
    global_tokens: float,
    global_seqs: float,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    behaviour_logp: torch.Tensor | None = None,
    behaviour_cap: float = 0.0,
) -> PolicyLossOutput:
    """Clipped surrogate: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) per token, with
    r = pi / pi_old, plus ``kl_coef`` x KL to the reference policy, minus ``entropy_coef`` x entropy.
    ``advantages`` is per token (a sequence's advantage repeated over its tokens).

    Off-policy (``behaviour_logp``: the log-probs of the policy that sampled the tokens, older than ``old_logp``,
    the proximal policy): the decoupled objective (AReaL; Hilton et al., "Batch size-invariance for policy
    optimization"): each token's clipped term is multiplied by w = min(pi_old / pi_behaviour, behaviour_cap)
    (truncated importance sampling; no gradient through w), so the clip keeps the update near the proximal policy
    while w corrects for the distribution the tokens came from. When the behaviour policy is the proximal one
    (no lag), w = 1 and this is the on-policy objective."""
    agg = dict(seq_index=seq_index, seq_lengths=seq_lengths, mode=mode, global_tokens=global_tokens,
               global_seqs=global_seqs)
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return _token_objective(torch.maximum(unclipped, clipped), clipped > unclipped, logp, old_logp, agg,
                            behaviour_logp=behaviour_logp, behaviour_cap=behaviour_cap, ref_logp=ref_logp,
                            kl_coef=kl_coef, kl_estimator=kl_estimator, entropy=entropy, entropy_coef=entropy_coef)


def _truncated_weight(log_ratio: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The importance weight exp(``log_ratio``) (pi_old / pi_behaviour) and its truncation at ``cap``."""
    raw = torch.exp(log_ratio.clamp(-20.0, 20.0))
    return raw, raw.clamp(max=cap)


def _token_objective(pg_tokens: torch.Tensor, clipped: torch.Tensor, logp: torch.Tensor, old_logp: torch.Tensor,
                     agg: dict, *, behaviour_logp: torch.Tensor | None, behaviour_cap: float, **regularisers
                     ) -> PolicyLossOutput:
    """A per-token objective's output: its terms (``pg_tokens``; decoupled: times the truncated importance weight
    w = min(pi_old / pi_behaviour, ``behaviour_cap``), no gradient through w, with w's aggregate and the share of
    tokens at the cap) aggregated under ``agg``, the KL and entropy terms (``_regularised``), and the share of
    ``clipped`` tokens."""
    weight_mean = truncated = None
    if behaviour_logp is not None and behaviour_cap > 0:
        raw, weight = _truncated_weight(old_logp.detach() - behaviour_logp, behaviour_cap)
        pg_tokens = pg_tokens * weight
        weight_mean = aggregate(weight, **agg).detach()
        truncated = aggregate((raw > behaviour_cap).to(pg_tokens.dtype), **agg).detach()
    pg_loss = aggregate(pg_tokens, **agg)
    loss, kl_value, ent_value = _regularised(pg_loss, logp, agg, **regularisers)
    clip_frac = aggregate(clipped.to(logp.dtype), **agg).detach()
    return PolicyLossOutput(loss=loss, pg_loss=pg_loss.detach(), kl=kl_value, clip_fraction=clip_frac,
                            entropy=ent_value, behaviour_weight=weight_mean, behaviour_truncated=truncated)


def _regularised(pg_loss: torch.Tensor, logp, agg: dict, *, ref_logp, kl_coef, kl_estimator, entropy,
                 entropy_coef) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The policy-gradient term plus ``kl_coef`` x KL to the reference, minus ``entropy_coef`` x entropy (each a
    token aggregate under ``rl.loss_agg``); returns (loss, KL, entropy), the last two detached."""
    loss = pg_loss
    kl_value = torch.zeros((), device=logp.device)
    if ref_logp is not None:
        kl_term = aggregate(kl_penalty(logp, ref_logp, kl_estimator), **agg)
        if kl_coef:
            loss = loss + kl_coef * kl_term
        kl_value = kl_term.detach()
    ent_value = torch.zeros((), device=logp.device)
    if entropy is not None:
        ent_term = aggregate(entropy, **agg)
        if entropy_coef:
            loss = loss - entropy_coef * ent_term
        ent_value = ent_term.detach()
    return loss, kl_value, ent_value


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    seq_index: torch.Tensor,
    seq_lengths: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    mode: LossAgg,
    global_tokens: float,
    global_seqs: float,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    behaviour_logp: torch.Tensor | None = None,
    behaviour_cap: float = 0.0,
    response_sums: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> PolicyLossOutput:
    """Group Sequence Policy Optimization (Zheng et al. 2025, eq. 5-7): one importance ratio per response,
    s_i = (pi(y_i) / pi_old(y_i)) ^ (1 / |y_i|) = exp(mean_t log(pi / pi_old)), and per response
    max(-A_i s_i, -A_i clip(s_i, 1 - clip_low, 1 + clip_high)), averaged over the minibatch's responses
    (``global_seqs``); KL and entropy stay per-token terms under ``mode``.

    A response split over ranks (Ulysses slices): ``response_sums`` takes this call's per-response sums [S, k] and
    returns them summed over every rank holding a part of each response (``WaveInputs.response_sums``: one
    all-reduce per sharded group). The ratio's value is then the whole response's, its gradient flows into this
    rank's tokens only (the others' sum is a constant here, as this rank's is on theirs), and each response's
    terms count here in the share of its tokens this rank holds, so the ranks' losses add up to the whole
    response's once. Without it every token of each response must be in this call.

    Decoupled (``behaviour_logp``, ``behaviour_cap`` > 0): s_i is taken against the proximal policy (``old_logp``)
    and each response's term is weighted by w_i = min(exp(mean_t log(pi_old / pi_behaviour)), cap), the same
    length-normalised ratio from the behaviour policy to the proximal one (no gradient through w_i); its mean and
    share at the cap are over responses."""
    agg = dict(seq_index=seq_index, seq_lengths=seq_lengths, mode=mode, global_tokens=global_tokens,
               global_seqs=global_seqs)
    num = seq_lengths.numel()
    weighted = behaviour_logp is not None and behaviour_cap > 0
    zeros = torch.zeros(num, dtype=logp.dtype, device=logp.device)
    counts = torch.zeros(num, dtype=torch.float64, device=logp.device).index_add_(
        0, seq_index, torch.ones_like(logp, dtype=torch.float64))
    log_ratio = zeros.index_add(0, seq_index, logp - old_logp)  # summed here, then over the response
    adv = zeros.index_add(0, seq_index, advantages.to(logp.dtype))  # each of its tokens carries the response's
    behaviour = zeros.index_add(0, seq_index, old_logp.detach() - behaviour_logp) if weighted else None
    share = None
    if response_sums is not None:
        parts = [counts, log_ratio.detach().double(), adv.double()] + ([behaviour.double()] if weighted else [])
        whole = response_sums(torch.stack(parts, 1))
        share = (counts / whole[:, 0].clamp(min=1)).to(logp.dtype)
        counts = whole[:, 0]
        log_ratio = log_ratio + (whole[:, 1].to(logp.dtype) - log_ratio).detach()
        adv = whole[:, 2].to(logp.dtype)
        if weighted:
            behaviour = whole[:, 3].to(logp.dtype)
    if not torch.equal(counts, seq_lengths.to(counts)):
        raise RuntimeError("gspo needs every token of each response in one call, or the ranks holding its parts "
                           "(response_sums: a response was split and its parts were not summed)")
    length = seq_lengths.clamp(min=1).to(logp.dtype)
    ratio = torch.exp((log_ratio / length).clamp(-20.0, 20.0))
    adv = adv / length
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_response = _own_share(torch.maximum(unclipped, clipped), share)
    weight_mean = truncated = None
    if weighted:
        raw, weight = _truncated_weight(behaviour / length, behaviour_cap)
        per_response = per_response * weight
        weight_mean = (_own_share(weight, share).sum() / global_seqs).detach()
        truncated = (_own_share((raw > behaviour_cap).to(logp.dtype), share).sum() / global_seqs).detach()
    pg_loss = per_response.sum() / global_seqs
    loss, kl_value, ent_value = _regularised(pg_loss, logp, agg, ref_logp=ref_logp, kl_coef=kl_coef,
                                             kl_estimator=kl_estimator, entropy=entropy, entropy_coef=entropy_coef)
    # share of responses clipped
    clip_frac = (_own_share((clipped > unclipped).to(logp.dtype), share).sum() / global_seqs).detach()
    return PolicyLossOutput(loss=loss, pg_loss=pg_loss.detach(), kl=kl_value, clip_fraction=clip_frac,
                            entropy=ent_value, behaviour_weight=weight_mean, behaviour_truncated=truncated)


def _own_share(per_response: torch.Tensor, share: torch.Tensor | None) -> torch.Tensor:
    """Per-response terms counted in this rank's ``share`` of each response's tokens (their gradient unchanged:
    it reaches only this rank's tokens already); ``share`` None: every response is whole here."""
    if share is None:
        return per_response
    return per_response.detach() * share + (per_response - per_response.detach())


def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    seq_index: torch.Tensor,
    seq_lengths: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    mode: LossAgg,
    global_tokens: float,
    global_seqs: float,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    behaviour_logp: torch.Tensor | None = None,
    behaviour_cap: float = 0.0,
) -> PolicyLossOutput:
    """CISPO (MiniMax-M1, Chen et al. 2025, eq. 4): per token -sg(clip(r, 1 - clip_low, 1 + clip_high)) A log pi,
    r = pi / pi_old: the clipped ratio is a detached weight, so every token keeps a gradient (PPO-clip drops the
    clipped ones), aggregated under ``mode`` (the paper: token-mean). Decoupled (``behaviour_logp``): r is taken
    against the proximal policy (``old_logp``) and each token's term is weighted by min(pi_old / pi_behaviour,
    ``behaviour_cap``), as in ``ppo_clip_loss``."""
    agg = dict(seq_index=seq_index, seq_lengths=seq_lengths, mode=mode, global_tokens=global_tokens,
               global_seqs=global_seqs)
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0)).detach()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return _token_objective(-weight * advantages * logp, weight != ratio, logp, old_logp, agg,
                            behaviour_logp=behaviour_logp, behaviour_cap=behaviour_cap, ref_logp=ref_logp,
                            kl_coef=kl_coef, kl_estimator=kl_estimator, entropy=entropy, entropy_coef=entropy_coef)


def sapo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    seq_index: torch.Tensor,
    seq_lengths: torch.Tensor,
    *,
    tau_pos: float,
    tau_neg: float,
    mode: LossAgg,
    global_tokens: float,
    global_seqs: float,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    behaviour_logp: torch.Tensor | None = None,
    behaviour_cap: float = 0.0,
) -> PolicyLossOutput:
    """SAPO (Soft Adaptive Policy Optimization, Gao et al. 2025, arXiv:2511.20347): per token
    -A (4 / tau) sigmoid(tau (r - 1)), r = pi / pi_old, tau = ``tau_pos`` where A > 0 else ``tau_neg``: a smooth gate
    in place of the clip, whose gradient 4 s (1 - s) r A d log pi (s the sigmoid) is the plain policy gradient at
    r = 1 and fades as r leaves it, faster for negative advantages (tau_neg > tau_pos). Aggregated under ``mode``;
    ``clip_fraction`` is the share of tokens whose gate weight 4 s (1 - s) is below 1/2. Decoupled
    (``behaviour_logp``): as in ``ppo_clip_loss``."""
    agg = dict(seq_index=seq_index, seq_lengths=seq_lengths, mode=mode, global_tokens=global_tokens,
               global_seqs=global_seqs)
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    return _token_objective(-advantages * (4.0 / tau) * gate, 4.0 * gate * (1.0 - gate) < 0.5, logp, old_logp, agg,
                            behaviour_logp=behaviour_logp, behaviour_cap=behaviour_cap, ref_logp=ref_logp,
                            kl_coef=kl_coef, kl_estimator=kl_estimator, entropy=entropy, entropy_coef=entropy_coef)


POLICY_LOSSES = {"ppo_clip": ppo_clip_loss, "gspo": gspo_loss, "cispo": cispo_loss, "sapo": sapo_loss}


def behaviour_weighted(cfg) -> bool:
    """Whether the update weights its tokens by the behaviour policy's (the engine's) log-probs: rl.behaviour_weight
    (asynchronous runs and partial rollouts, or every run) with rl.behaviour_weight_cap > 0."""
    off_policy = cfg.workflow.mode == "async" or cfg.rollout.tokens_per_update > 0
    return cfg.rl.behaviour_weight_cap > 0 and (off_policy or cfg.rl.behaviour_weight == "always")


def build_policy_loss(rl, *, weighted: bool = False) -> Callable[..., PolicyLossOutput]:
    """``rl.policy_loss``'s objective with the run's settings (an ``RLConfig``) bound; the caller gives
    the per-token tensors and the minibatch's global normalisers (and, ``weighted`` (``behaviour_weighted``):
    ``behaviour_logp``, weighted with ``rl.behaviour_weight_cap``)."""
    shape = (dict(tau_pos=rl.sapo_tau_pos, tau_neg=rl.sapo_tau_neg) if rl.policy_loss == "sapo"
             else dict(clip_low=rl.clip_low, clip_high=rl.clip_high))
    return functools.partial(
        POLICY_LOSSES[rl.policy_loss], **shape, mode=rl.loss_agg,
        # REINFORCE++ puts the KL to the reference in the reward (its advantages), not in the loss
        kl_coef=0.0 if rl.advantage == "reinforce++" else rl.kl_coef, kl_estimator=rl.kl_estimator,
        entropy_coef=rl.entropy_coef,
        behaviour_cap=rl.behaviour_weight_cap if weighted else 0.0,
    )
