import pytest
import torch

from rlhf_core.algos.advantages import (
    ALGO_RECIPES,
    ESTIMATORS,
    SCORE_BASELINES,
    Recipe,
    discounted_returns,
    dr_grpo_baseline,
    gae,
    grpo_baseline,
    rloo_baseline,
    whitened_returns,
)

pytestmark = pytest.mark.unit


def _loop_baselines(scores, gids):
    """Reference: plain Python over groups."""
    out = {"grpo": [], "dr_grpo": [], "rloo": []}
    for i, (s, g) in enumerate(zip(scores.tolist(), gids.tolist())):
        group = [x for x, h in zip(scores.tolist(), gids.tolist()) if h == g]
        n = len(group)
        mean = sum(group) / n
        std = (sum((x - mean) ** 2 for x in group) / max(n - 1, 1)) ** 0.5
        out["grpo"].append((s - mean) / (std + 1e-6))
        out["dr_grpo"].append(s - mean)
        others = [x for j, (x, h) in enumerate(zip(scores.tolist(), gids.tolist())) if h == g and j != i]
        out["rloo"].append(s - sum(others) / len(others) if others else 0.0)
    return out


def test_hand_values():
    s = torch.tensor([1.0, 0.0, 0.0, 1.0])
    g = torch.zeros(4, dtype=torch.long)
    assert grpo_baseline(s, g).tolist() == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-5)
    assert dr_grpo_baseline(s, g).tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5])
    s3 = torch.tensor([1.0, 0.0, 0.0])
    assert rloo_baseline(s3, torch.zeros(3, dtype=torch.long)).tolist() == pytest.approx([1.0, -0.5, -0.5])


def test_loop_vs_vectorised_uneven_noncontiguous_groups():
    torch.manual_seed(1)
    scores = torch.randn(11)
    gids = torch.tensor([7, 3, 7, 3, 3, 9, 7, 9, 3, 5, 7])  # group 5 has one sample
    ref = _loop_baselines(scores, gids)
    for name in ("grpo", "dr_grpo", "rloo"):
        assert SCORE_BASELINES[name](scores, gids).tolist() == pytest.approx(ref[name], abs=1e-5)


def test_zero_variance_groups_give_zero_not_nan():
    s = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])
    g = torch.tensor([0, 0, 0, 1, 1])
    for name in ("grpo", "dr_grpo", "rloo", "group_mean"):
        out = SCORE_BASELINES[name](s, g)
        assert torch.isfinite(out).all() and (out == 0).all(), name


def _gae_reference(r, v, m, gamma, lam):
    """Scalar loop over action tokens only (masked tokens removed first)."""
    adv = [0.0] * len(r)
    idx = [t for t in range(len(r)) if m[t]]
    last, next_v = 0.0, 0.0
    for t in reversed(idx):
        delta = r[t] + gamma * next_v - v[t]
        last = delta + gamma * lam * last
        adv[t] = last
        next_v = v[t]
    return adv


def test_gae_hand_and_reference():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.5, 0.5]])
    m = torch.ones(1, 3)
    adv, ret = gae(r, v, m, gamma=1.0, lam=1.0)
    assert adv.tolist()[0] == pytest.approx([0.5, 0.5, 0.5])
    assert ret.tolist()[0] == pytest.approx([1.0, 1.0, 1.0])
    torch.manual_seed(2)
    r, v = torch.randn(4, 9), torch.randn(4, 9)
    m = (torch.rand(4, 9) > 0.3).float()  # holes = environment tokens in a multi-turn episode
    adv, ret = gae(r, v, m, gamma=0.9, lam=0.8)
    for b in range(4):
        ref = _gae_reference(r[b].tolist(), v[b].tolist(), m[b].tolist(), 0.9, 0.8)
        assert adv[b].tolist() == pytest.approx(ref, abs=1e-5)
    assert (adv[m == 0] == 0).all() and (ret[m == 0] == 0).all()
    assert torch.allclose(ret[m == 1], (adv + v)[m == 1])


def test_returns_broadcast_score_with_gamma_one():
    r = torch.tensor([[0.0, 0.0, 2.0, 0.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    adv, ret = discounted_returns(r, None, m, gamma=1.0)
    assert adv.tolist()[0] == [2.0, 2.0, 2.0, 0.0]
    adv, _ = discounted_returns(r, None, m, gamma=0.5)
    assert adv.tolist()[0] == [0.5, 1.0, 2.0, 0.0]


def test_whitened_returns_are_white_over_mask():
    torch.manual_seed(3)
    r = torch.randn(5, 6)
    m = (torch.rand(5, 6) > 0.2).float()
    adv, _ = whitened_returns(r, None, m)
    sel = adv[m == 1]
    assert sel.mean().item() == pytest.approx(0.0, abs=1e-5)
    assert sel.std().item() == pytest.approx(1.0, abs=1e-4)
    assert (adv[m == 0] == 0).all()


def test_recipes_refer_to_known_parts():
    for algo, recipe in ALGO_RECIPES.items():
        assert recipe.baseline in SCORE_BASELINES and recipe.estimator in ESTIMATORS, algo
    assert set(ALGO_RECIPES) == {"ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"}


def test_recipe_derives_groups_and_critic():
    """The driver asks the recipe: a GAE algorithm gets a critic whatever its name."""
    assert ALGO_RECIPES["ppo"].needs_critic and not ALGO_RECIPES["ppo"].uses_groups
    assert {a for a, r in ALGO_RECIPES.items() if r.uses_groups} == {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"}
    assert {a for a, r in ALGO_RECIPES.items() if r.needs_critic} == {"ppo"}
    assert Recipe("group_mean", "gae").needs_critic and Recipe("group_mean", "gae").uses_groups


def test_rl_config_algos_are_the_registry():
    """rl's `algo` Literal and ALGO_RECIPES name the same algorithms (a new recipe must be selectable)."""
    import typing

    from stages.rl import Config

    assert set(typing.get_args(typing.get_type_hints(Config)["algo"])) == set(ALGO_RECIPES)


def test_singleton_group_convention_ours_and_verls():
    from rlhf_core.algos.advantages import keep_singleton_scores

    scores, groups = torch.tensor([1.0, 0.0, 0.7]), torch.tensor([3, 3, 8])
    for name in ("grpo", "dr_grpo", "rloo"):
        centred = SCORE_BASELINES[name](scores, groups)
        assert centred[2].item() == 0.0, name  # ours: a group of one has no baseline
        kept = keep_singleton_scores(centred, scores, groups)
        assert kept[2].item() == pytest.approx(0.7) and torch.equal(kept[:2], centred[:2]), name  # verl: the raw score
    # an all-equal group stays 0 under both conventions (it is not a singleton)
    same = torch.tensor([0.5, 0.5])
    assert keep_singleton_scores(SCORE_BASELINES["grpo"](same, torch.tensor([1, 1])), same, torch.tensor([1, 1])).tolist() == [0.0, 0.0]
