"""Losses: policy gradient (PPO family, GSPO), importance-sampling correction, value, entropy,
SFT, reward model and DPO family.  Tensors in, `(loss, stats)` out; stats are detached tensors.

Shapes: B sequences, T tokens, V vocabulary.  `logprobs`, `old_logprobs`, `engine_logprobs`,
`advantages`, `response_mask`: `(B, T)` aligned on the *predicted* token (position t holds
log pi(y_t | y_<t)).  Averaging goes through `aggregation.aggregate` with global counts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .aggregation import aggregate, masked_mean, masked_sum

# exp() of a log-ratio above this is inf in fp32; clamping keeps extreme tokens finite
# (they are clipped by the PPO objective anyway).
MAX_LOG_RATIO = 20.0


def token_logprobs(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature)[labels]: logits `(B, T, V)`, labels `(B, T)` -> `(B, T)` (fp32).

    With `temperature` the log-prob under the distribution an engine samples from at that
    temperature (the behaviour policy of an RL step): the trainer's log-probs, the engine's and
    the PPO ratio between them all refer to one distribution.  Example: logits [0, 2 ln 2] at
    temperature 2 are [0, ln 2] -> probabilities [1/3, 2/3]: token 1 has log-prob ln(2/3)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.gather(logits.log_softmax(-1), -1, labels.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H = logsumexp(z) - sum softmax(z) z per position: `(B, T, V)` -> `(B, T)`."""
    logits = logits.float()
    p = logits.softmax(-1)
    return torch.logsumexp(logits, -1) - (p * logits).sum(-1)


# --- policy losses ------------------------------------------------------------------------


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    is_weights: Tensor | None = None,
    agg_mode: str = "token-mean",
    num_tokens=None,
    num_seqs=None,
    norm_len=None,
):
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7) with decoupled clip range
    (DAPO "clip-higher": ratio in [1 - clip_low, 1 + clip_high]) and optional dual-clip
    (Ye et al. 2020, eq. 5: for A < 0 the loss is capped at -dual_clip * A, dual_clip > 1).

    l_t = max(-A r, -A clip(r, 1-lo, 1+hi));  with dual-clip, for A < 0: min(l_t, -c A).
    r = exp(logprobs - old_logprobs).  `is_weights (B, T)` (detached, from `IS_CORRECTIONS`)
    multiply the per-token loss (truncated importance sampling between engine and trainer).
    Returns (loss, stats) with stats clipfrac, dual_clipfrac, approx_kl (k3 of old vs new),
    ppo_kl (k1: mean of old - new log-prob over valid tokens, verl's `ppo_kl`), ratio_mean.
    """
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    clipped = (loss_clipped > loss_unclipped).float()
    dual_clipped = torch.zeros_like(loss_mat)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        cap = -advantages * dual_clip
        capped = torch.minimum(loss_mat, cap)
        dual_clipped = ((advantages < 0) & (cap < loss_mat)).float()
        loss_mat = torch.where(advantages < 0, capped, loss_mat)
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()
    loss = aggregate(loss_mat, response_mask, agg_mode, num_tokens, num_seqs, norm_len)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean(clipped, response_mask),
            "dual_clipfrac": masked_mean(dual_clipped, response_mask),
            "approx_kl": masked_mean(ratio - 1 - log_ratio, response_mask),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
            "ratio_mean": masked_mean(ratio, response_mask),
        }
    return loss, stats


def gspo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    is_weights: Tensor | None = None,
    agg_mode: str = "seq-mean-token-mean",
    num_tokens=None,
    num_seqs=None,
    norm_len=None,
):
    """GSPO (Zheng et al. 2025, eq. 7-10): a *sequence*-level ratio
    s_i = exp(mean_t (logprobs - old_logprobs)) clipped to [1 - lo, 1 + hi], applied per token as
    s_it = sg(s_i) * exp(logprobs_t - sg(logprobs_t)) so the gradient is the token-level one
    scaled by s_i.  Paper defaults: lo = 3e-4, hi = 4e-4, seq-mean-token-mean aggregation.
    """
    mask = response_mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    seq_log_ratio = seq_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach()
    ratio = token_log_ratio.exp()
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()
    loss = aggregate(loss_mat, response_mask, agg_mode, num_tokens, num_seqs, norm_len)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), response_mask),
            "ratio_mean": masked_mean(ratio, response_mask),
        }
    return loss, stats


POLICY_LOSSES = {"ppo": ppo_policy_loss, "gspo": gspo_policy_loss}

# Each policy loss's own defaults (its paper's): what a trainer uses for a setting the user left
# unset.  PPO's ±0.2 token-ratio clip would clip nothing of GSPO's sequence ratio, whose paper
# clips to [1 - 3e-4, 1 + 4e-4] and averages per sequence.
POLICY_LOSS_DEFAULTS = {
    "ppo": {"clip_low": 0.2, "clip_high": 0.2, "agg_mode": "token-mean"},
    "gspo": {"clip_low": 3e-4, "clip_high": 4e-4, "agg_mode": "seq-mean-token-mean"},
}


# --- importance sampling between rollout engine and trainer ------------------------------
# The engine (vLLM) samples with slightly different numerics than the trainer.  The weight
# w_t = pi_trainer_old(y_t) / pi_engine(y_t) corrects the off-policy gap.  All return
# (weights (B, T) without gradient, stats).


def _is_ratio(old_logprobs: Tensor, engine_logprobs: Tensor) -> Tensor:
    return (old_logprobs - engine_logprobs).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()


def tis_weights(old_logprobs, engine_logprobs, response_mask, low: float = 0.0, high: float = 2.0):
    """Truncated IS (Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training"): w_t = min(ratio_t, high).  `low` unused."""
    ratio = _is_ratio(old_logprobs, engine_logprobs)
    weights = ratio.clamp(max=high) * response_mask
    return weights, {"is_truncated_frac": masked_mean((ratio > high).float(), response_mask)}


def icepop_weights(old_logprobs, engine_logprobs, response_mask, low: float = 0.5, high: float = 2.0):
    """IcePop (Ling team 2025): w_t = ratio_t if low <= ratio_t <= high else 0 (token masked)."""
    ratio = _is_ratio(old_logprobs, engine_logprobs)
    keep = (ratio >= low) & (ratio <= high)
    weights = torch.where(keep, ratio, torch.zeros_like(ratio)) * response_mask
    return weights, {"is_masked_frac": masked_mean((~keep).float(), response_mask)}


def _seq_log_ratio(old_logprobs, engine_logprobs, response_mask, mean: bool) -> Tensor:
    """Per sequence `(B,)`: sum (or mean) over valid tokens of log(pi_old / pi_engine), bounded."""
    log_ratio = (old_logprobs - engine_logprobs).detach()
    agg = masked_mean(log_ratio, response_mask, dim=-1) if mean else masked_sum(log_ratio, response_mask, dim=-1)
    return agg.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def seq_mask_tis_weights(old_logprobs, engine_logprobs, response_mask, low: float = 0.5, high: float = 2.0):
    """Sequence-mask TIS: token weights min(ratio_t, high), and whole sequences whose
    geometric-mean ratio exp(mean_t log ratio_t) lies outside [low, high] get weight 0.
    (Geometric mean, not the product, so the threshold does not depend on length.)"""
    ratio = _is_ratio(old_logprobs, engine_logprobs)
    seq_ratio = _seq_log_ratio(old_logprobs, engine_logprobs, response_mask, mean=True).exp()
    keep_seq = (seq_ratio >= low) & (seq_ratio <= high)
    weights = ratio.clamp(max=high) * keep_seq.unsqueeze(-1).to(ratio.dtype) * response_mask
    return weights, {"is_seq_masked_frac": (~keep_seq).float().mean()}


def seq_tis_weights(old_logprobs, engine_logprobs, response_mask, low: float = 0.0, high: float = 2.0):
    """Sequence-level truncated IS (verl `rollout_is=sequence`): one weight per sequence,
    w_i = min(prod_t ratio_it, high), on each of its tokens.  `low` unused."""
    seq_ratio = _seq_log_ratio(old_logprobs, engine_logprobs, response_mask, mean=False).exp()
    weights = seq_ratio.clamp(max=high).unsqueeze(-1) * response_mask
    return weights, {"is_truncated_frac": (seq_ratio > high).float().mean()}


def _rejection(keep: Tensor, response_mask: Tensor, per_sequence: bool):
    """Weights 1 where kept, 0 where rejected (no reweighting), zero on padding."""
    keep = keep.unsqueeze(-1) if per_sequence else keep
    weights = keep.float() * response_mask
    return weights, {"rs_masked_frac": 1.0 - masked_mean(weights, response_mask)}


def token_rs_weights(old_logprobs, engine_logprobs, response_mask, low: float = 0.5, high: float = 2.0):
    """Token rejection (verl `rollout_rs=token`): tokens with ratio_t outside [low, high] leave the loss."""
    ratio = _is_ratio(old_logprobs, engine_logprobs)
    return _rejection((ratio >= low) & (ratio <= high), response_mask, per_sequence=False)


def seq_rs_weights(old_logprobs, engine_logprobs, response_mask, low: float = 0.5, high: float = 2.0):
    """Sequence rejection (verl `rollout_rs=sequence`): sequences whose product of ratios is outside
    [low, high] leave the loss."""
    seq_ratio = _seq_log_ratio(old_logprobs, engine_logprobs, response_mask, mean=False).exp()
    return _rejection((seq_ratio >= low) & (seq_ratio <= high), response_mask, per_sequence=True)


def geo_rs_weights(old_logprobs, engine_logprobs, response_mask, low: float = 0.999, high: float = 1.001):
    """Geometric rejection (verl `rollout_rs=geometric`): sequences whose geometric-mean ratio is
    outside [low, high] leave the loss (thresholds near 1: it is an average per-token deviation)."""
    seq_ratio = _seq_log_ratio(old_logprobs, engine_logprobs, response_mask, mean=True).exp()
    return _rejection((seq_ratio >= low) & (seq_ratio <= high), response_mask, per_sequence=True)


def batch_normalise_is(weights: Tensor, response_mask: Tensor, per_sequence: bool) -> Tensor:
    """IS weights divided by their batch mean (verl `rollout_is_batch_normalize`), applied after
    truncation: over valid tokens, or over sequences (one weight each) for sequence-level weights.
    Example: token weights [2, 0.5, 0.5] -> mean 1 -> unchanged; [2, 2] -> [1, 1]."""
    if per_sequence:
        seq_w = masked_mean(weights, response_mask, dim=-1)
        valid = response_mask.sum(-1) > 0
        mean = seq_w[valid].mean() if valid.any() else weights.new_tensor(1.0)
    else:
        mean = masked_mean(weights, response_mask)
    return weights / mean.clamp(min=1e-8)


IS_CORRECTIONS = {"tis": tis_weights, "icepop": icepop_weights, "seq_mask_tis": seq_mask_tis_weights, "seq_tis": seq_tis_weights,
                  "token_rs": token_rs_weights, "seq_rs": seq_rs_weights, "geo_rs": geo_rs_weights}
SEQUENCE_LEVEL_IS = {"seq_tis", "seq_rs", "geo_rs", "seq_mask_tis"}
"""Corrections with one weight per sequence (batch normalisation averages over sequences)."""


# --- value, entropy ------------------------------------------------------------------------


def value_loss(values, old_values, returns, response_mask, clip: float | None = 0.2, agg_mode="token-mean", num_tokens=None, num_seqs=None,
               norm_len=None):
    """Clipped value loss (PPO2 baselines): l_t = 0.5 * max((V - R)^2, (V_clip - R)^2),
    V_clip = old_V + clip(V - old_V, -clip, clip).  `clip=None` gives plain 0.5 (V - R)^2.
    Stats: value_mean, value_error, and vf_clipfrac (share of valid tokens where the clipped term
    is the larger one, verl's `vf_clipfrac`; 0 without clip)."""
    loss_mat = (values - returns).square()
    vf_clipped = torch.zeros_like(loss_mat)
    if clip is not None:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        clipped_mat = (v_clip - returns).square()
        vf_clipped = (clipped_mat > loss_mat).float()
        loss_mat = torch.maximum(loss_mat, clipped_mat)
    loss = 0.5 * aggregate(loss_mat, response_mask, agg_mode, num_tokens, num_seqs, norm_len)
    with torch.no_grad():
        stats = {"value_mean": masked_mean(values, response_mask), "value_error": masked_mean((values - returns).square(), response_mask),
                 "vf_clipfrac": masked_mean(vf_clipped, response_mask)}
    return loss, stats


def entropy_bonus(logits: Tensor, response_mask: Tensor, coef: float, agg_mode="token-mean", num_tokens=None, num_seqs=None, norm_len=None):
    """Loss term -coef * aggregate(H) (maximising entropy).  logits `(B, T, V)`."""
    entropy = entropy_from_logits(logits)
    mean_entropy = aggregate(entropy, response_mask, agg_mode, num_tokens, num_seqs, norm_len)
    return -coef * mean_entropy, {"entropy": mean_entropy.detach()}


# --- supervised ----------------------------------------------------------------------------


def sft_loss(logprobs: Tensor, loss_mask: Tensor, agg_mode="token-mean", num_tokens=None, num_seqs=None, norm_len=None):
    """Prompt-masked NLL: aggregate(-log p(y_t)) over response tokens (loss_mask = 0 on the
    prompt and padding).  logprobs, loss_mask `(B, T)`."""
    loss = aggregate(-logprobs, loss_mask, agg_mode, num_tokens, num_seqs, norm_len)
    return loss, {}


def rm_sigmoid_loss(chosen_rewards: Tensor, rejected_rewards: Tensor, margin: Tensor | float = 0.0):
    """Bradley-Terry pairwise loss -log sigmoid(r_c - r_r - margin) (Ouyang et al. 2022, eq. 1;
    margin as in Llama 2).  Inputs `(B,)`; returns (mean loss, stats)."""
    diff = chosen_rewards - rejected_rewards
    loss = -F.logsigmoid(diff - margin).mean()
    return loss, _rm_stats(diff, chosen_rewards, rejected_rewards)


def rm_logexp_loss(chosen_rewards: Tensor, rejected_rewards: Tensor, margin: Tensor | float = 0.0):
    """log(1 + exp(r_r - r_c)) (OpenRLHF's LogExpLoss); equals the sigmoid loss at margin 0,
    computed with softplus for stability.  `margin` is ignored."""
    diff = chosen_rewards - rejected_rewards
    loss = F.softplus(-diff).mean()
    return loss, _rm_stats(diff, chosen_rewards, rejected_rewards)


def rm_centering_loss(chosen_rewards: Tensor, rejected_rewards: Tensor) -> Tensor:
    """Reward centring term mean((r_c + r_r)^2) (Eisenstein et al. 2023; TRL's
    `center_rewards_coefficient`): the pairwise loss only sees differences, so without it the
    rewards drift freely; weighted by `rm.center_rewards_coef`.  Example: r_c = 1, r_r = -1 -> 0."""
    return (chosen_rewards + rejected_rewards).square().mean()


def _rm_stats(diff, chosen, rejected):
    with torch.no_grad():
        return {"accuracy": (diff > 0).float().mean(), "margin": diff.mean(), "chosen_reward": chosen.mean(), "rejected_reward": rejected.mean()}


RM_LOSSES = {"sigmoid": rm_sigmoid_loss, "logexp": rm_logexp_loss}


def _dpo_sigmoid(h: Tensor, beta: float, label_smoothing: float) -> Tensor:
    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


def _dpo_robust(h: Tensor, beta: float, label_smoothing: float) -> Tensor:
    return (-(1 - label_smoothing) * F.logsigmoid(beta * h) + label_smoothing * F.logsigmoid(-beta * h)) / (1 - 2 * label_smoothing)


def _dpo_hinge(h: Tensor, beta: float, label_smoothing: float) -> Tensor:
    return torch.relu(1 - beta * h)


def _dpo_ipo(h: Tensor, beta: float, label_smoothing: float) -> Tensor:
    return (h - 1.0 / (2.0 * beta)).square()


def kto_pair_losses(chosen_ratio: Tensor, rejected_ratio: Tensor, beta: float) -> Tensor:
    """KTO on paired data (Ethayarajh et al. 2024, eq. 8; the HALOs code's and TRL's former
    `kto_pair`), per pair `(B,)`: chosen answers are desirable, rejected ones undesirable, and each
    half's reference point z is the batch-mean log-ratio of the *other* half, clamped at 0 and
    detached (the paper's KL estimate, not differentiated):
      0.5 * [(1 - sigmoid(beta (r_c - z_r))) + (1 - sigmoid(beta (z_c - r_r)))]
    (the mean over the 2B responses, as TRL averages them).  Example: all ratios 0 -> 0.5."""
    z_chosen = chosen_ratio.detach().mean().clamp(min=0)
    z_rejected = rejected_ratio.detach().mean().clamp(min=0)
    return 0.5 * ((1 - torch.sigmoid(beta * (chosen_ratio - z_rejected))) + (1 - torch.sigmoid(beta * (z_chosen - rejected_ratio))))


DPO_LOSSES = {"sigmoid": _dpo_sigmoid, "cdpo": _dpo_sigmoid, "robust": _dpo_robust, "hinge": _dpo_hinge, "ipo": _dpo_ipo,
              "ipo_norm": _dpo_ipo, "sigmoid_norm": _dpo_sigmoid, "kto_pair": None}
"""h -> per-pair loss; `kto_pair` needs both halves' log-ratios (`kto_pair_losses`)."""
LENGTH_NORMALISED = {"ipo_norm", "sigmoid_norm"}
"""Loss types whose h is built from per-token mean log-ratios (each response's summed log-ratio
divided by its length) instead of sums."""


def kto_loss(policy_logps: Tensor, ref_logps: Tensor, kl_policy_logps: Tensor, kl_ref_logps: Tensor, desirable: Tensor,
             beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0):
    """KTO (Ethayarajh et al. 2024, eq. 8) on unpaired completions, all `(B,)` summed log-probs.

    r = log pi(y|x) - log ref(y|x); the reference point z is the mean log-ratio of *mismatched*
    completions (prompt x_i with another row's completion), clamped at 0 and detached (TRL's KL
    estimate; here over the micro-batch):
      desirable:    w_D (1 - sigmoid(beta (r - z)))
      undesirable:  w_U (1 - sigmoid(beta (z - r)))
    averaged over the batch.  Returns (loss, stats) with the implicit rewards beta r of each side
    and z.  Example: r = z = 0 -> every term 0.5.
    """
    ratio = policy_logps - ref_logps
    z = (kl_policy_logps - kl_ref_logps).detach().mean().clamp(min=0)
    good = desirable.bool()
    losses = torch.where(good, desirable_weight * (1 - torch.sigmoid(beta * (ratio - z))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (z - ratio))))
    with torch.no_grad():
        rewards = beta * ratio
        zero = rewards.new_tensor(0.0)
        stats = {"rewards/chosen": rewards[good].mean() if good.any() else zero,
                 "rewards/rejected": rewards[~good].mean() if (~good).any() else zero,
                 "kto/kl": z, "kto/desirable_frac": good.float().mean()}
    return losses.mean(), stats


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_nll: Tensor | None = None,
    nll_coef: float = 0.0,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
):
    """DPO family from *summed* sequence log-probs, all `(B,)`.

    h = (pi_c - ref_c) - (pi_r - ref_r)
      sigmoid (Rafailov et al. 2023, eq. 7):  -log sigmoid(beta h)
      cdpo    (label smoothing eps, Mitchell 2023): -(1-eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
              (`sigmoid` with label_smoothing > 0 is the same)
      robust  (Chowdhury et al. 2024, unbiased under a flip rate eps < 0.5; TRL `robust`):
              (-(1-eps) log sigmoid(beta h) + eps log sigmoid(-beta h)) / (1 - 2 eps)
      hinge   (SLiC-HF, Zhao et al. 2023; TRL/OpenRLHF `hinge`):  relu(1 - beta h)
      ipo     (Azar et al. 2023, eq. 17, on summed log-probs as OpenRLHF):  (h - 1/(2 beta))^2
    Length-normalised (h from per-token means: (pi_c - ref_c)/|y_c| - (pi_r - ref_r)/|y_r|, needs
    `chosen_lengths`/`rejected_lengths`):
      ipo_norm      IPO as TRL computes it (mean log-probs)
      sigmoid_norm  DPO on mean log-ratios (TRL `sigmoid_norm`, SimPO's length normalisation
                    with the reference kept); label smoothing applies as for sigmoid
    kto_pair (Ethayarajh et al. 2024, KTO on paired data): see `kto_pair_losses`
    Optional NLL term (RPO, Pang et al. 2024): + nll_coef * chosen_nll, chosen_nll `(B,)` the
    per-token mean NLL of the chosen response.  Returns (mean loss, stats) with implicit
    rewards beta (pi - ref) for chosen/rejected (batch means; summed log-ratios for every type),
    margins and preference accuracy.
    Example: h = 0, beta = 0.1, sigmoid -> loss = log 2 = 0.6931.
    """
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"unknown dpo loss_type {loss_type!r}; valid: {sorted(DPO_LOSSES)}")
    if loss_type == "robust" and not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"dpo loss_type robust needs 0 <= label_smoothing < 0.5 (the label flip rate), got {label_smoothing}")
    chosen_ratio = policy_chosen_logps - ref_chosen_logps
    rejected_ratio = policy_rejected_logps - ref_rejected_logps
    if loss_type in LENGTH_NORMALISED:
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(f"dpo loss_type {loss_type} needs chosen_lengths and rejected_lengths")
        h = chosen_ratio / chosen_lengths.clamp(min=1) - rejected_ratio / rejected_lengths.clamp(min=1)
    else:
        h = chosen_ratio - rejected_ratio
    losses = kto_pair_losses(chosen_ratio, rejected_ratio, beta) if loss_type == "kto_pair" else DPO_LOSSES[loss_type](h, beta, label_smoothing)
    if chosen_nll is not None and nll_coef:
        losses = losses + nll_coef * chosen_nll
    with torch.no_grad():
        chosen_r = beta * chosen_ratio
        rejected_r = beta * rejected_ratio
        stats = {
            "rewards/chosen": chosen_r.mean(),
            "rewards/rejected": rejected_r.mean(),
            "rewards/margins": (chosen_r - rejected_r).mean(),
            "rewards/accuracy": (chosen_r > rejected_r).float().mean(),
        }
    return losses.mean(), stats
