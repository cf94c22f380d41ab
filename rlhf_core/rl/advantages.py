"""Advantages of one RL step: a recipe of `rlhf_core.algos.advantages.ALGO_RECIPES` (score
baseline + token estimator) applied to a `RolloutBatch`, with KL shaping (no Ray, no I/O)."""
from __future__ import annotations

import torch

from rlhf_core.algos.advantages import ALGO_RECIPES, ESTIMATORS, SCORE_BASELINES, keep_singleton_scores
from rlhf_core.algos.aggregation import masked_mean, masked_whiten
from rlhf_core.algos.kl import kl_penalty
from rlhf_core.algos.shaping import kl_shaped_rewards
from rlhf_core.rollout.batch import RolloutBatch


def compute_advantages(batch: RolloutBatch, algo: str, *, kl_coef: float, kl_in_reward: bool, kl_estimator: str, gamma: float,
                       lam: float, whiten_gae: bool, reward_clip: float | None, kl_clamp: float | None = None,
                       singleton_group: str = "zero") -> tuple[RolloutBatch, dict]:
    """The batch with `advantages`, `returns`, `kl` (per token) and `centred_score`, and the batch's
    stats.  Scores must be finite (invalid samples are removed before this)."""
    recipe = ALGO_RECIPES[algo]
    mask, ref = batch.action_mask, batch.ref_logprobs
    # the behaviour policy's log-probs: the trainer's where the step computed them, else the
    # engine's (the same policy, synced before the rollout; equal in fp32 to ~1e-6)
    old = batch.old_logprobs if batch.old_logprobs is not None else batch.engine_logprobs
    values = batch.old_values if recipe.needs_critic else None
    scores = torch.tensor(batch.score, dtype=torch.float32)
    centred = SCORE_BASELINES[recipe.baseline](scores, torch.tensor(batch.group))
    if singleton_group == "score" and recipe.baseline != "none":
        centred = keep_singleton_scores(centred, scores, torch.tensor(batch.group))
    kl = kl_penalty(old, ref, kl_estimator, kl_clamp) * mask
    token_rewards = kl_shaped_rewards(centred, kl, mask, kl_coef if kl_in_reward else 0.0, reward_clip)
    adv, ret = ESTIMATORS[recipe.estimator](token_rewards, values, mask, gamma, lam)
    if recipe.estimator == "gae" and whiten_gae:
        adv = masked_whiten(adv, mask)
    stats = {"kl": float((kl * mask).sum(-1).mean()), "kl_token": float(masked_mean(kl, mask)),
             "advantage_abs": float(masked_mean(adv.abs(), mask))}
    return batch.with_columns(advantages=adv, returns=ret, kl=kl, centred_score=centred.tolist()), stats
