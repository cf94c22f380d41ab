import pytest
import torch

from rlhf_core.algos.shaping import (
    AdaptiveKLController,
    FixedKLController,
    dynamic_sampling_filter,
    kl_shaped_rewards,
    last_token_index,
    overlong_penalty,
    truncation_penalty,
)

pytestmark = pytest.mark.unit


def test_kl_shaped_rewards_hand_values():
    r = kl_shaped_rewards(torch.tensor([1.0]), torch.tensor([[0.1, 0.2]]), torch.ones(1, 2), kl_coef=0.5)
    assert r.tolist()[0] == pytest.approx([-0.05, 0.9])
    # multi-turn: score lands on the last *action* token; env tokens (mask 0) get nothing; clip at 2
    mask = torch.tensor([[1, 1, 0, 0, 1, 0]])
    r = kl_shaped_rewards(torch.tensor([5.0]), torch.zeros(1, 6), mask, kl_coef=0.1, reward_clip=2.0)
    assert r.tolist()[0] == [0.0, 0.0, 0.0, 0.0, 2.0, 0.0]
    assert last_token_index(mask).tolist() == [4]


def test_adaptive_kl_controller():
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    c.update(12.0, n_steps=100)  # error clipped to 0.2
    assert c.value == pytest.approx(0.1 * 1.002)
    c.update(3.0, n_steps=100)  # error -0.5 -> -0.2
    assert c.value == pytest.approx(0.1 * 1.002 * 0.998)
    c.update(float("nan"), n_steps=100)
    assert c.value == pytest.approx(0.1 * 1.002 * 0.998)
    d = AdaptiveKLController(1.0, 1.0, 1.0)
    d.load_state_dict(c.state_dict())
    assert d.value == c.value
    f = FixedKLController(0.3)
    f.update(100.0, 10)
    assert f.value == 0.3


def test_overlong_and_truncation():
    pen = overlong_penalty(torch.tensor([10, 16, 18, 20, 25]), max_len=20, cache_len=4)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    assert truncation_penalty(torch.tensor([True, False]), 0.5).tolist() == [-0.5, 0.0]


def test_dynamic_sampling_filter_loop_vs_vectorised():
    torch.manual_seed(0)
    scores = torch.randint(0, 2, (40,)).float()
    gids = torch.arange(40) % 7
    keep = dynamic_sampling_filter(scores, gids)
    for i in range(40):
        group = scores[gids == gids[i]]
        assert keep[i].item() == bool(group.max() > group.min())
