"""Masked reductions and the one place where per-token losses become a scalar.

Every loss in `algos` produces a per-token matrix `(B, T)` and hands it to `aggregate`.
The denominators (`num_tokens`, `num_seqs`) are *global* counts: when a batch is sharded
across data-parallel ranks, each rank passes the count over all ranks, so the per-rank
losses *sum* to the loss of the unsharded batch.  Data-parallel engines (DeepSpeed) average
gradients over ranks, so a trainer multiplies the rank loss by `world_size` before backward
(see `aggregate`'s docstring); with one rank nothing changes.
"""
from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x` where `mask` is 1.  x, mask: same shape; returns a scalar or the reduced tensor."""
    x = torch.where(mask.bool(), x, torch.zeros_like(x))  # where, not x*mask: a NaN outside the mask stays out
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over positions where `mask` is 1 (0 where the mask is empty)."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def pool_response(scores: Tensor, response_mask: Tensor, mode: str) -> Tensor:
    """A token-level reward model's sequence score: per-token scores `(B, T)` summed
    (`response_sum`) or averaged (`response_mean`) over the response tokens (`response_mask`
    `(B, T)`, 1 on response tokens at their own positions).  Returns `(B,)`.

    e.g. scores [[1, 2, 3]], mask [[0, 1, 1]]: sum 5, mean 2.5."""
    if mode == "response_sum":
        return masked_sum(scores, response_mask, dim=-1)
    if mode == "response_mean":
        return masked_mean(scores, response_mask, dim=-1)
    raise ValueError(f"unknown pooling {mode!r}: response_sum | response_mean")


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the masked entries of `x` (scalar); Bessel-corrected when `unbiased`."""
    mean = masked_mean(x, mask)
    n = mask.sum()
    var = masked_sum((x - mean) ** 2, mask) / n.clamp(min=1)
    if unbiased:
        var = var * n / (n - 1).clamp(min=1)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries; masked-out entries become 0.

    Used for REINFORCE++ global advantage normalisation (Hu 2025, §3).  Unbiased variance,
    as in OpenRLHF's `masked_normalize`.  With `shift_mean=False` the mean is added back.
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


# --- loss aggregation modes -------------------------------------------------------------
# Each takes the per-token loss (B, T), the mask (B, T) and the global counts; returns a scalar.


def token_mean(loss_mat: Tensor, mask: Tensor, num_tokens: Tensor | float, num_seqs, norm_len) -> Tensor:
    """sum_{i,t} m_it * l_it / N_tokens  (every token weighs the same; PPO/DAPO default)."""
    return masked_sum(loss_mat, mask) / num_tokens


def token_sum(loss_mat: Tensor, mask: Tensor, num_tokens, num_seqs, norm_len) -> Tensor:
    """sum_{i,t} m_it * l_it  (no normalisation: the scale grows with batch and length; verl `token-sum`)."""
    return masked_sum(loss_mat, mask)


def seq_mean_token_mean(loss_mat: Tensor, mask: Tensor, num_tokens, num_seqs: Tensor | float, norm_len) -> Tensor:
    """(1/N_seqs) sum_i [ sum_t m_it l_it / sum_t m_it ]  (original GRPO)."""
    per_seq = masked_sum(loss_mat, mask, dim=-1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / num_seqs


def seq_mean_token_sum(loss_mat: Tensor, mask: Tensor, num_tokens, num_seqs: Tensor | float, norm_len) -> Tensor:
    """(1/N_seqs) sum_i sum_t m_it l_it  (long sequences weigh more)."""
    return masked_sum(loss_mat, mask) / num_seqs


def seq_mean_token_sum_norm(loss_mat: Tensor, mask: Tensor, num_tokens, num_seqs: Tensor | float, norm_len: float) -> Tensor:
    """(1/(N_seqs * L)) sum_i sum_t m_it l_it with a constant L (Dr.GRPO, Liu et al. 2025, eq. 3).

    L is the generation budget (max response tokens), a constant so that no per-sequence
    length normalisation biases the gradient.
    """
    return masked_sum(loss_mat, mask) / (num_seqs * norm_len)


AGGREGATIONS = {
    "token-mean": token_mean,
    "token-sum": token_sum,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}


def aggregate(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    num_tokens: Tensor | float | None = None,
    num_seqs: Tensor | float | None = None,
    norm_len: float | None = None,
) -> Tensor:
    """Reduce a per-token loss `(B, T)` to a scalar with one of `AGGREGATIONS`.

    num_tokens / num_seqs: global counts over all data-parallel ranks and micro-batches of the
      optimizer step; default to this batch's own counts (single rank, single micro-batch).
      A sequence counts when it has at least one unmasked token.
    norm_len: the constant L of `seq-mean-token-sum-norm`; defaults to T.
    Summing the results of the shards of a batch equals the result on the whole batch.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid: {sorted(AGGREGATIONS)}")
    mask = mask.to(loss_mat.dtype)
    if num_tokens is None:
        num_tokens = mask.sum().clamp(min=1)
    if num_seqs is None:
        num_seqs = (mask.sum(-1) > 0).sum().clamp(min=1)
    if norm_len is None:
        norm_len = loss_mat.shape[-1]
    return AGGREGATIONS[mode](loss_mat, mask, num_tokens, num_seqs, norm_len)
