"""Advantages: group baselines on scalar scores, then token-level estimators.

An RL algorithm is a `Recipe` of two steps (`ALGO_RECIPES`):

  1. a *score baseline* turns each sample's scalar score into a centred score, using the other
     samples of its prompt group (`SCORE_BASELINES`, shape `(B,)` -> `(B,)`);
  2. after KL shaping has spread the score over tokens (`shaping.kl_shaped_rewards`), a
     *token estimator* turns token rewards `(B, T)` into advantages and returns
     (`ESTIMATORS`, `(B, T)` -> `(B, T), (B, T)`).

Groups are given by `group_ids (B,)` (any integer ids; groups need not be contiguous nor of
equal size) so filtered batches work unchanged.

Formula choices (implementations differ here):
  * GRPO std is the unbiased (Bessel) sample std, eps = 1e-6 added to the std (verl, OpenRLHF).
    A zero-variance group (all scores equal) gives advantage 0, not NaN.
  * A group of one sample has no baseline: GRPO/Dr.GRPO/group-mean give 0; RLOO gives 0.
    verl instead takes mean 0 and std 1 for such a group, so its advantage is the raw score:
    `keep_singleton_scores` (`rl.objective.singleton_group=score`).  Singletons arise with
    `rl.rollout.n_samples=1` or when dropped invalid samples leave one of a group.
  * Masked-out tokens (prompt, padding, environment feedback in multi-turn) are *transparent*
    for GAE and returns: the recursion skips them, so the last action token before an
    environment turn bootstraps from the next action token's value.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .aggregation import masked_whiten

# --- 1. score baselines over prompt groups -------------------------------------------------


def _group_stats(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (group mean, group unbiased std, group size), each `(B,)`."""
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    zeros = scores.new_zeros(uniq.numel())
    count = zeros.index_add(0, inv, torch.ones_like(scores))
    mean = zeros.index_add(0, inv, scores) / count
    sq = zeros.index_add(0, inv, (scores - mean[inv]).square())
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    return mean[inv], std[inv], count[inv]


def no_baseline(scores: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """Identity: PPO (critic is the baseline) and REINFORCE++ (global whitening later)."""
    return scores


def grpo_baseline(scores: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps)  (Shao et al. 2024, DeepSeekMath eq. 4).

    Example: group scores [1, 0, 0, 1] -> mean 0.5, unbiased std 0.57735 ->
    [0.86603, -0.86603, -0.86603, 0.86603] (up to eps).
    """
    mean, std, _ = _group_stats(scores, group_ids)
    return (scores - mean) / (std + eps)


def dr_grpo_baseline(scores: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """A_i = r_i - mean_g: GRPO without the std division (Liu et al. 2025, "Dr. GRPO")."""
    mean, _, _ = _group_stats(scores, group_ids)
    return scores - mean


def rloo_baseline(scores: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """A_i = r_i - mean_{j != i} r_j = n/(n-1) (r_i - mean_g)  (Ahmadian et al. 2024, eq. 7).

    Example: group [1, 0, 0] -> [1 - 0, 0 - 0.5, 0 - 0.5] = [1, -0.5, -0.5].
    """
    mean, _, count = _group_stats(scores, group_ids)
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    return (scores - mean) * scale


def keep_singleton_scores(centred: Tensor, scores: Tensor, group_ids: Tensor) -> Tensor:
    """verl's convention for groups of one sample: their centred score is the raw score (mean 0,
    std 1) instead of the baseline's 0.  Example: groups [a, a, b], scores [1, 0, 0.7], GRPO ->
    [0.707, -0.707, 0] becomes [0.707, -0.707, 0.7]."""
    _, _, count = _group_stats(scores, group_ids)
    return torch.where(count == 1, scores, centred)


SCORE_BASELINES = {
    "none": no_baseline,
    "grpo": grpo_baseline,
    "dr_grpo": dr_grpo_baseline,
    "rloo": rloo_baseline,
    "group_mean": dr_grpo_baseline,  # REINFORCE++-baseline subtracts the group mean (Hu 2025)
}


# --- 2. token-level estimators --------------------------------------------------------------


def gae(token_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float = 1.0, lam: float = 0.95):
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16) over action tokens.

    delta_t = r_t + gamma * V_{t'} - V_t,   A_t = delta_t + gamma * lam * A_{t'}
    where t' is the next *unmasked* position (masked positions are skipped), V and A are 0
    past the end.  Returns R_t = A_t + V_t (the value target).
    token_rewards, values, response_mask: `(B, T)`.  Returns (advantages, returns), `(B, T)`,
    zero where the mask is 0.
    Example (gamma = lam = 1, one sequence): r = [0, 0, 1], V = [.5, .5, .5] ->
    A = [.5, .5, .5], R = [1, 1, 1].
    """
    mask = response_mask.bool()
    values = torch.where(mask, values, torch.zeros_like(values))
    B, T = token_rewards.shape
    advantages = torch.zeros_like(token_rewards)
    last_gae = token_rewards.new_zeros(B)
    next_value = token_rewards.new_zeros(B)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        a_t = delta + gamma * lam * last_gae
        advantages[:, t] = torch.where(m, a_t, torch.zeros_like(a_t))
        last_gae = torch.where(m, a_t, last_gae)
        next_value = torch.where(m, values[:, t], next_value)
    returns = torch.where(mask, advantages + values, torch.zeros_like(values))
    return advantages, returns


def discounted_returns(token_rewards: Tensor, values: Tensor | None, response_mask: Tensor, gamma: float = 1.0, lam: float = 1.0):
    """REINFORCE: A_t = R_t = sum_{k >= t} gamma^(k-t) r_k over unmasked positions.

    With gamma = 1 and the score on the last action token only, every token's advantage is the
    (baselined) score: this is how GRPO / Dr.GRPO / RLOO broadcast a sequence advantage.
    Returns (advantages, returns), both `(B, T)`, zero where masked.  `values`, `lam` unused.
    """
    mask = response_mask.bool()
    returns = torch.zeros_like(token_rewards)
    running = token_rewards.new_zeros(token_rewards.shape[0])
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t]
        running = torch.where(m, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(m, running, torch.zeros_like(running))
    return returns, returns


def whitened_returns(token_rewards: Tensor, values: Tensor | None, response_mask: Tensor, gamma: float = 1.0, lam: float = 1.0):
    """REINFORCE++ (Hu 2025): discounted returns, then advantages whitened over all masked
    tokens of the global batch (mean 0, unbiased std 1).  Returns (advantages, returns)."""
    _, returns = discounted_returns(token_rewards, None, response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


ESTIMATORS = {"gae": gae, "returns": discounted_returns, "whitened_returns": whitened_returns}

@dataclass(frozen=True)
class Recipe:
    """An RL algorithm: a score baseline (`SCORE_BASELINES`) then a token estimator (`ESTIMATORS`).
    What the driver needs to know about an algorithm is derived from these two, never from its name."""
    baseline: str
    estimator: str

    @property
    def uses_groups(self) -> bool:
        """Baselines each sample against the other samples of its prompt (needs n_samples >= 2)."""
        return self.baseline != "none"

    @property
    def needs_critic(self) -> bool:
        """Bootstraps from a learned value function: the driver trains a critic beside the policy."""
        return self.estimator == "gae"


# algo name -> recipe.  Adding an algorithm is one line here (and its name in rl's `algo` Literal,
# which tests/algos/test_advantages.py ties to this table).
ALGO_RECIPES = {
    "ppo": Recipe("none", "gae"),
    "grpo": Recipe("grpo", "returns"),
    "dr_grpo": Recipe("dr_grpo", "returns"),
    "rloo": Recipe("rloo", "returns"),
    "reinforce_pp": Recipe("none", "whitened_returns"),
    "reinforce_pp_baseline": Recipe("group_mean", "whitened_returns"),
}
