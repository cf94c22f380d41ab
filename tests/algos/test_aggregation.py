import pytest
import torch

from rlhf_core.algos.aggregation import AGGREGATIONS, aggregate, masked_mean, masked_var, masked_whiten

pytestmark = pytest.mark.unit


def _batch():
    loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 0.0, 0.0], [6.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]])
    return loss, mask


def test_hand_values():
    loss, mask = _batch()
    # token-mean: (1+2+3+4+5+6)/6 = 3.5
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(3.5)
    # seq-mean-token-mean: (2 + 4.5 + 6)/3 = 4.1667
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx(12.5 / 3)
    # seq-mean-token-sum: (6 + 9 + 6)/3 = 7
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx(7.0)
    # seq-mean-token-sum-norm with L = T = 4: 21 / (3*4) = 1.75
    assert aggregate(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(1.75)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", norm_len=7).item() == pytest.approx(1.0)
    # token-sum: 21, unnormalised
    assert aggregate(loss, mask, "token-sum").item() == pytest.approx(21.0)


def test_nan_outside_mask_is_ignored():
    loss, mask = _batch()
    loss[0, 3] = float("nan")
    assert torch.isfinite(aggregate(loss, mask, "token-mean"))


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
def test_sharded_equals_global(mode):
    """Two data-parallel shards, each normalised by the *global* counts, sum to the global loss."""
    torch.manual_seed(0)
    loss = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).long()
    mask[:, 0] = 1
    full = aggregate(loss, mask, mode)
    n_tok, n_seq = mask.sum(), (mask.sum(-1) > 0).sum()
    shards = [aggregate(loss[s], mask[s], mode, num_tokens=n_tok, num_seqs=n_seq, norm_len=5) for s in (slice(0, 2), slice(2, 6))]
    assert (shards[0] + shards[1]).item() == pytest.approx(full.item(), rel=1e-6)


def test_unknown_mode():
    loss, mask = _batch()
    with pytest.raises(ValueError, match="valid"):
        aggregate(loss, mask, "mean")


def test_masked_stats():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    m = torch.tensor([1, 1, 1, 0])
    assert masked_mean(x, m).item() == pytest.approx(2.0)
    assert masked_var(x, m).item() == pytest.approx(1.0)  # unbiased: ((1)+(0)+(1))/2
    w = masked_whiten(x, m)
    assert w[:3].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-6)
    assert w[3].item() == 0.0


@pytest.mark.unit
def test_pool_response_hand_values_and_nan_outside_the_mask():
    from rlhf_core.algos.aggregation import pool_response

    scores = torch.tensor([[1.0, 2.0, 3.0], [float("nan"), 4.0, 0.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    assert pool_response(scores, mask, "response_sum").tolist() == [5.0, 4.0]  # the prompt's NaN stays out
    assert pool_response(scores, mask, "response_mean").tolist() == [2.5, 4.0]
    with pytest.raises(ValueError):
        pool_response(scores, mask, "last")
