"""Per-token KL(pi || pi_ref) estimators from sampled-token log-probs (Schulman, "Approximating
KL divergence", 2020).  With log_ratio r = logprobs - ref_logprobs of a token sampled from pi:

  k1 = r                      unbiased, high variance, can be negative
  k2 = r^2 / 2                biased, low variance; its gradient is the true KL gradient in expectation
  k3 = exp(-r) - 1 + r        unbiased, always >= 0 (GRPO's estimator)
  abs = |r|                   verl's `abs`: >= 0, gradient sign(r) (a KL-like distance, not an estimator)

All take `(B, T)` tensors and return `(B, T)`; masking and averaging are the caller's job
(`aggregation.aggregate`).  Used detached as a reward penalty (`shaping.kl_shaped_rewards`)
or with gradient as a loss term.

Clamp choice (as in verl's `low_var_kl`): for k3 the log-ratio is clamped to [-20, 20] before
`exp` and the result to [-10, 10], so one extreme token cannot produce inf/NaN.  `kl_penalty`'s
`clamp` bounds any estimator's value to [-clamp, clamp]: OpenRLHF clamps every estimator at 10
(`rl.objective.kl_clamp=10` reproduces it); k1, k2 and abs are unclamped otherwise, as in verl and TRL.
"""
from __future__ import annotations

from torch import Tensor

K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = log pi - log pi_ref.  Shapes `(B, T)` -> `(B, T)`."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = (log pi - log pi_ref)^2 / 2.  Shapes `(B, T)` -> `(B, T)`."""
    return 0.5 * (logprobs - ref_logprobs).square()


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1, clamped (see module doc).

    Example: logprobs = log 0.5, ref = log 0.25 -> ratio pi_ref/pi = 0.5,
    k3 = 0.5 - log(0.5) - 1 = 0.19315.
    """
    neg_log_ratio = (ref_logprobs - logprobs).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return (neg_log_ratio.exp() - neg_log_ratio - 1).clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP)


def kl_abs(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """abs = |log pi - log pi_ref|.  Shapes `(B, T)` -> `(B, T)`."""
    return (logprobs - ref_logprobs).abs()


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3, "abs": kl_abs}


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1", clamp: float | None = None) -> Tensor:
    """Per-token KL estimate `(B, T)` with one of `KL_ESTIMATORS`, bounded to [-clamp, clamp] if
    `clamp` is set (OpenRLHF: 10).  Example: r = 12, k1 with clamp 10 -> 10 (zero gradient there)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: {sorted(KL_ESTIMATORS)}")
    kl = KL_ESTIMATORS[estimator](logprobs, ref_logprobs)
    return kl if clamp is None else kl.clamp(-clamp, clamp)
