"""Reward shaping: KL-as-reward, the adaptive KL controller, DAPO length penalties and the
dynamic-sampling group filter."""
from __future__ import annotations

import math

import torch
from torch import Tensor


def last_token_index(response_mask: Tensor) -> Tensor:
    """Index of the last unmasked position of each row, `(B, T)` -> `(B,)` (0 for empty rows)."""
    T = response_mask.shape[-1]
    positions = torch.arange(T, device=response_mask.device).expand_as(response_mask)
    return torch.where(response_mask.bool(), positions, torch.zeros_like(positions)).amax(-1)


def kl_shaped_rewards(scores: Tensor, kl: Tensor, response_mask: Tensor, kl_coef: float, reward_clip: float | None = 10.0) -> Tensor:
    """Token rewards r_t = -kl_coef * kl_t on every action token, plus clip(score, -c, c) on
    the last action token (Ziegler et al. 2019; Ouyang et al. 2022, eq. 2).

    scores `(B,)`, kl `(B, T)` (detached estimate, `kl.KL_ESTIMATORS`), response_mask `(B, T)`.
    Returns `(B, T)`, zero where masked.  Example: scores [1], kl [[.1, .2]], coef .5 ->
    [[-.05, 1 - .1]] = [[-0.05, 0.9]].
    """
    mask = response_mask.bool()
    if reward_clip is not None:
        scores = scores.clamp(-reward_clip, reward_clip)
    rewards = torch.where(mask, -kl_coef * kl.detach(), torch.zeros_like(kl))
    last = last_token_index(response_mask)
    has_tokens = mask.any(-1)
    bonus = torch.where(has_tokens, scores.to(rewards.dtype), torch.zeros_like(scores, dtype=rewards.dtype))
    return rewards.scatter_add(1, last.unsqueeze(-1), bonus.unsqueeze(-1))


class FixedKLController:
    """kl_coef that never changes.  `state_dict` exists so checkpoints treat both alike."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Adaptive KL coefficient (Ziegler et al. 2019, §2.2):
    e = clip(KL / target - 1, -0.2, 0.2);  beta <- beta * (1 + e * n_steps / horizon).
    `current_kl` is a float the trainer has already reduced (the controller stays sync-free).
    Example: beta .1, target 6, KL 12, n 100, horizon 10000 -> e = .2, beta = .1 * 1.002.
    """

    def __init__(self, kl_coef: float, target: float, horizon: float):
        super().__init__(kl_coef)
        self.target, self.horizon = float(target), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        if not math.isfinite(current_kl):
            return  # a NaN KL must not poison the coefficient; the step itself is rejected elsewhere
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int, penalty: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), added to the score:
      0                                   if L <= max_len - cache_len
      (max_len - cache_len - L) / cache_len * penalty   if max_len - cache_len < L <= max_len
      -penalty                            if L > max_len
    lengths `(B,)` -> `(B,)`.  Example: max 20, cache 4, L = 18 -> -0.5.
    """
    lengths = lengths.float()
    start = max_len - cache_len
    ramp = (start - lengths) / max(cache_len, 1) * penalty
    out = torch.where(lengths <= start, torch.zeros_like(lengths), ramp)
    return torch.where(lengths > max_len, torch.full_like(lengths, -penalty), out)


def truncation_penalty(truncated: Tensor, penalty: float) -> Tensor:
    """-penalty for samples cut at the generation budget (no EOS), else 0.  `(B,)` bool -> `(B,)`."""
    zeros = torch.zeros(truncated.shape, device=truncated.device)
    return torch.where(truncated.bool(), zeros - float(penalty), zeros)


def dynamic_sampling_filter(scores: Tensor, group_ids: Tensor, tol: float = 0.0) -> Tensor:
    """DAPO dynamic sampling (Yu et al. 2025, eq. 11): keep a group only if its scores are not
    all equal (max - min > tol), since a zero-variance group has zero group advantage and adds
    no gradient.  scores, group_ids `(B,)` -> keep mask `(B,)` bool.
    """
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    g_max = torch.full((uniq.numel(),), -math.inf, dtype=scores.dtype, device=scores.device).scatter_reduce(0, inv, scores, "amax")
    g_min = torch.full((uniq.numel(),), math.inf, dtype=scores.dtype, device=scores.device).scatter_reduce(0, inv, scores, "amin")
    return (g_max - g_min > tol)[inv]
