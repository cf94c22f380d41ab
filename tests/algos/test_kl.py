import math

import pytest
import torch

from rlhf_core.algos.kl import KL_ESTIMATORS, kl_abs, kl_k1, kl_k2, kl_k3, kl_penalty

pytestmark = pytest.mark.unit


def test_hand_values():
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert kl_k1(lp, ref).item() == pytest.approx(math.log(2))
    assert kl_k2(lp, ref).item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_k3(lp, ref).item() == pytest.approx(0.5 - math.log(0.5) - 1)


def test_estimators_agree_in_expectation():
    """Sampling y ~ p, mean k1 and k3 estimate KL(p||q) without bias; k2 is close for near p,q."""
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.4, 0.4, 0.2])
    true_kl = (p * (p / q).log()).sum().item()
    y = torch.multinomial(p, 400_000, replacement=True)
    lp, lq = p.log()[y], q.log()[y]
    assert kl_k1(lp, lq).mean().item() == pytest.approx(true_kl, abs=2e-3)
    assert kl_k3(lp, lq).mean().item() == pytest.approx(true_kl, abs=2e-3)
    assert kl_k2(lp, lq).mean().item() == pytest.approx(true_kl, abs=5e-3)


def test_k3_extreme_is_finite_and_nonnegative():
    lp = torch.tensor([0.0, -100.0, -1e4])
    ref = torch.tensor([-1e4, 0.0, 0.0])
    k3 = kl_k3(lp, ref)
    assert torch.isfinite(k3).all() and (k3 >= 0).all() and (k3 <= 10).all()


def test_unknown():
    with pytest.raises(ValueError, match="k1"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def test_abs_and_the_openrlhf_clamp():
    lp, ref = torch.tensor([-3.0, -1.0, 0.0]), torch.tensor([-1.0, -13.0, -0.5])  # r = -2, 12, 0.5
    assert kl_abs(lp, ref).tolist() == [2.0, 12.0, 0.5]
    assert kl_penalty(lp, ref, "k1").tolist() == [-2.0, 12.0, 0.5]  # unclamped by default
    assert kl_penalty(lp, ref, "k1", clamp=10.0).tolist() == [-2.0, 10.0, 0.5]
    assert kl_penalty(lp, ref, "k2", clamp=10.0).tolist() == [2.0, 10.0, 0.125]  # k2(12) = 72 -> 10
    assert kl_penalty(lp, ref, "abs", clamp=1.0).tolist() == [1.0, 1.0, 0.5]
    # a clamped token passes no gradient: the penalty cannot push an extreme token further
    x = torch.tensor([12.0], requires_grad=True)
    kl_penalty(x, torch.zeros(1), "k1", clamp=10.0).sum().backward()
    assert x.grad.item() == 0.0
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3", "abs"}
