import math

import pytest
import torch
import torch.nn.functional as F

from rlhf_core.algos.losses import (
    DPO_LOSSES,
    IS_CORRECTIONS,
    batch_normalise_is,
    dpo_loss,
    entropy_bonus,
    entropy_from_logits,
    gspo_policy_loss,
    kto_loss,
    ppo_policy_loss,
    rm_centering_loss,
    rm_logexp_loss,
    rm_sigmoid_loss,
    sft_loss,
    token_logprobs,
    value_loss,
)

pytestmark = pytest.mark.unit


def test_token_logprobs_and_entropy():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0]]])
    assert token_logprobs(logits, torch.tensor([[2]])).item() == pytest.approx(math.log(0.25))
    assert entropy_from_logits(logits).item() == pytest.approx(math.log(4))


def test_token_logprobs_at_a_temperature():
    """logits [0, 2 ln 2] at temperature 2 are [0, ln 2]: probabilities [1/3, 2/3]."""
    logits = torch.tensor([[[0.0, 2 * math.log(2)]]])
    assert token_logprobs(logits, torch.tensor([[1]]), temperature=2.0).item() == pytest.approx(math.log(2 / 3))
    assert token_logprobs(logits, torch.tensor([[0]]), temperature=2.0).item() == pytest.approx(math.log(1 / 3))
    assert token_logprobs(logits, torch.tensor([[1]])).item() == pytest.approx(math.log(4 / 5))  # T = 1: [1, 4] / 5


def test_ppo_clip_hand_values():
    # ratio 1.5 with A=+1 clips at 1+0.2 -> loss -1.2; ratio 0.5 with A=-1 clips at 0.8 -> loss 0.8
    lp = torch.log(torch.tensor([[1.5, 0.5]]))
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -1.0]])
    m = torch.ones(1, 2)
    loss, stats = ppo_policy_loss(lp, old, adv, m)
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert stats["clipfrac"].item() == pytest.approx(1.0)
    # clip-higher: upper bound 1.28 -> -1.28 for the first token
    loss, _ = ppo_policy_loss(lp, old, adv, m, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx((-1.28 + 0.8) / 2)


def test_dual_clip_caps_negative_advantage_and_gradient():
    # ratio 10, A = -1: standard PPO loss = max(10, 1.2) = 10; dual clip c=3 caps it at 3
    lp = torch.log(torch.tensor([[10.0]])).requires_grad_()
    adv = torch.tensor([[-1.0]])
    loss, stats = ppo_policy_loss(lp, torch.zeros(1, 1), adv, torch.ones(1, 1), dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0)
    assert stats["dual_clipfrac"].item() == 1.0
    loss.backward()
    assert lp.grad.item() == 0.0  # capped branch is constant: no gradient pushes the ratio further
    lp2 = torch.log(torch.tensor([[10.0]])).requires_grad_()
    loss2, _ = ppo_policy_loss(lp2, torch.zeros(1, 1), adv, torch.ones(1, 1))
    loss2.backward()
    assert lp2.grad.item() == pytest.approx(10.0)


def test_ppo_on_policy_gradient_is_reinforce():
    """At ratio 1 the PPO gradient equals -A * grad logprob (token-mean)."""
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([[2.0, -1.0, 0.5]])
    loss, _ = ppo_policy_loss(lp, lp.detach(), adv, torch.ones(1, 3))
    loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx((-adv / 3).tolist()[0])


def test_extreme_log_ratios_stay_finite():
    lp = torch.tensor([[100.0, -100.0]], requires_grad=True)
    loss, stats = ppo_policy_loss(lp, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), dual_clip=3.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all() and torch.isfinite(stats["approx_kl"])


def test_gspo_sequence_ratio():
    # per-token log ratios [0.2, -0.2] -> sequence ratio 1 -> loss = -A, gradient = -A/T per token
    old = torch.zeros(1, 2)
    lp = torch.tensor([[0.2, -0.2]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0]])
    loss, stats = gspo_policy_loss(lp, old, adv, torch.ones(1, 2))
    assert loss.item() == pytest.approx(-1.0)
    loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([-0.5, -0.5])


def test_is_weights_have_no_gradient_and_hand_values():
    old = torch.log(torch.tensor([[0.5, 0.9, 0.2]])).requires_grad_()
    eng = torch.log(torch.tensor([[0.5, 0.3, 0.4]]))  # ratios 1, 3, 0.5
    m = torch.ones(1, 3)
    w, _ = IS_CORRECTIONS["tis"](old, eng, m, high=2.0)
    assert w.tolist()[0] == pytest.approx([1.0, 2.0, 0.5])
    assert not w.requires_grad
    w, s = IS_CORRECTIONS["icepop"](old, eng, m, low=0.6, high=2.0)
    assert w.tolist()[0] == pytest.approx([1.0, 0.0, 0.0])
    assert s["is_masked_frac"].item() == pytest.approx(2 / 3)
    # geometric mean ratio = (1*3*0.5)^(1/3) = 1.1447 -> kept with [0.5, 2]; dropped with high=1.1
    w, _ = IS_CORRECTIONS["seq_mask_tis"](old, eng, m, low=0.5, high=2.0)
    assert w.tolist()[0] == pytest.approx([1.0, 2.0, 0.5])
    w, _ = IS_CORRECTIONS["seq_mask_tis"](old, eng, m, low=0.5, high=1.1)
    assert w.tolist()[0] == [0.0, 0.0, 0.0]
    # weights scale the policy loss but never carry gradient into the old log-probs
    lp = torch.zeros(1, 3, requires_grad=True)
    w, _ = IS_CORRECTIONS["tis"](old, eng, m, high=2.0)
    loss, _ = ppo_policy_loss(lp, torch.zeros(1, 3), torch.ones(1, 3), m, is_weights=w)
    loss.backward()
    assert old.grad is None
    assert lp.grad.tolist()[0] == pytest.approx([-1 / 3, -2 / 3, -0.5 / 3])


def test_sequence_level_is_rejection_and_batch_normalisation_by_hand():
    # two sequences: ratios (1, 3, 0.5) and (1.1, 1.1, pad); a padded position carries ratio 7
    old = torch.log(torch.tensor([[0.5, 0.9, 0.2], [0.55, 0.55, 0.7]]))
    eng = torch.log(torch.tensor([[0.5, 0.3, 0.4], [0.5, 0.5, 0.1]]))
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # seq_tis: products 1.5 and 1.21 (the pad excluded), truncated at 1.3 -> 1.3 and 1.21; 0 on padding
    w, s = IS_CORRECTIONS["seq_tis"](old, eng, m, high=1.3)
    assert w.tolist() == [pytest.approx([1.3] * 3), pytest.approx([1.21, 1.21, 0.0])]
    assert s["is_truncated_frac"].item() == 0.5
    # every correction is zero at padding, whatever the ratio there
    for name, fn in IS_CORRECTIONS.items():
        assert fn(old, eng, m)[0][1, 2].item() == 0.0, name
    # token_rs in [0.6, 2]: tokens with ratio 3 and 0.5 leave the loss, weight 1 (not the ratio) elsewhere
    w, s = IS_CORRECTIONS["token_rs"](old, eng, m, low=0.6, high=2.0)
    assert w.tolist() == [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]] and s["rs_masked_frac"].item() == pytest.approx(2 / 5)
    # seq_rs on the product in [0.8, 1.25]: 1.5 rejected, 1.21 kept
    w, _ = IS_CORRECTIONS["seq_rs"](old, eng, m, low=0.8, high=1.25)
    assert w.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    # geo_rs on the geometric mean in [0.9, 1.12]: 1.5^(1/3) = 1.145 rejected, 1.1 kept
    w, _ = IS_CORRECTIONS["geo_rs"](old, eng, m, low=0.9, high=1.12)
    assert w.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    # batch normalisation: per token, the valid weights' mean becomes 1; per sequence, the sequences' mean
    w = torch.tensor([[2.0, 1.0, 0.0], [0.5, 0.5, 0.0]])
    n = batch_normalise_is(w, m, per_sequence=False)  # mean over 5 valid tokens = 4/5 = 0.8
    assert n.tolist() == [pytest.approx([2.5, 1.25, 0.0]), pytest.approx([0.625, 0.625, 0.0])]
    w = torch.tensor([[1.3, 1.3, 1.3], [0.7, 0.7, 0.0]])
    n = batch_normalise_is(w, m, per_sequence=True)  # mean of (1.3, 0.7) = 1
    assert n.tolist() == [pytest.approx([1.3] * 3), pytest.approx([0.7, 0.7, 0.0])]


def test_reward_centring_term_and_the_rm_stage_loss():
    assert rm_centering_loss(torch.tensor([1.0, 2.0]), torch.tensor([-1.0, 1.0])).item() == pytest.approx((0 + 9) / 2)
    from types import SimpleNamespace

    from stages import rm

    # the rm workers' loss with a sequence head: rewards chosen (1, 2), rejected (-1, 1)
    model = lambda input_ids, attention_mask: SimpleNamespace(logits=torch.tensor([[1.0], [2.0], [-1.0], [1.0]]))  # noqa: E731
    b = {"input_ids": torch.zeros(4, 2, dtype=torch.long), "attention_mask": torch.ones(4, 2)}
    plain, _ = rm.loss_fn(model, b, {"num_pairs": 2}, loss="sigmoid", margin=0.0, pooling="last")
    centred, stats = rm.loss_fn(model, b, {"num_pairs": 2}, loss="sigmoid", margin=0.0, pooling="last", center_rewards_coef=0.01)
    assert (centred - plain).item() == pytest.approx(0.01 * 4.5) and stats["centring"].item() == pytest.approx(4.5)


def test_value_loss_clipping():
    v = torch.tensor([[2.0]])
    old_v = torch.tensor([[1.0]])
    ret = torch.tensor([[1.0]])
    # unclipped (2-1)^2 = 1, clipped V = 1.2 -> 0.04; max = 1 -> 0.5
    loss, _ = value_loss(v, old_v, ret, torch.ones(1, 1), clip=0.2)
    assert loss.item() == pytest.approx(0.5)
    ret = torch.tensor([[3.0]])  # unclipped 1, clipped (1.2-3)^2 = 3.24 -> 1.62
    loss, _ = value_loss(v, old_v, ret, torch.ones(1, 1), clip=0.2)
    assert loss.item() == pytest.approx(1.62)


def test_entropy_bonus_sign():
    logits = torch.zeros(1, 2, 4)
    loss, stats = entropy_bonus(logits, torch.ones(1, 2), coef=0.01)
    assert loss.item() == pytest.approx(-0.01 * math.log(4))


def test_sft_loss_masks_prompt():
    lp = torch.tensor([[-5.0, -1.0, -3.0]])
    mask = torch.tensor([[0, 1, 1]])
    loss, _ = sft_loss(lp, mask)
    assert loss.item() == pytest.approx(2.0)


def test_rm_losses():
    c, r = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    l1, s = rm_sigmoid_loss(c, r)
    l2, _ = rm_logexp_loss(c, r)
    expected = (math.log(1 + math.exp(-1)) + math.log(1 + math.exp(1))) / 2
    assert l1.item() == pytest.approx(expected) and l2.item() == pytest.approx(expected)
    assert s["accuracy"].item() == 0.5
    l3, _ = rm_sigmoid_loss(c, r, margin=1.0)
    assert l3.item() == pytest.approx((math.log(2) + math.log(1 + math.exp(2))) / 2)


def test_dpo_family():
    z = torch.zeros(2)
    loss, stats = dpo_loss(z, z, z, z, beta=0.1)
    assert loss.item() == pytest.approx(math.log(2))
    pc, pr = torch.tensor([-1.0]), torch.tensor([-3.0])
    rc, rr = torch.tensor([-2.0]), torch.tensor([-2.0])  # h = 1 - (-1) = 2
    loss, stats = dpo_loss(pc, pr, rc, rr, beta=0.5)
    assert loss.item() == pytest.approx(-F.logsigmoid(torch.tensor(1.0)).item())
    assert stats["rewards/chosen"].item() == pytest.approx(0.5)
    assert stats["rewards/rejected"].item() == pytest.approx(-0.5)
    assert stats["rewards/accuracy"].item() == 1.0
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="ipo")
    assert loss.item() == pytest.approx((2 - 1) ** 2)
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="cdpo", label_smoothing=0.1)
    expected = -0.9 * F.logsigmoid(torch.tensor(1.0)) - 0.1 * F.logsigmoid(torch.tensor(-1.0))
    assert loss.item() == pytest.approx(expected.item())
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, chosen_nll=torch.tensor([2.0]), nll_coef=0.5)
    assert loss.item() == pytest.approx(-F.logsigmoid(torch.tensor(1.0)).item() + 1.0)
    with pytest.raises(ValueError, match="ipo"):
        dpo_loss(pc, pr, rc, rr, loss_type="kto")


def test_dpo_robust_hinge_and_length_normalised_by_hand():
    pc, pr = torch.tensor([-1.0]), torch.tensor([-3.0])
    rc, rr = torch.tensor([-2.0]), torch.tensor([-2.0])  # chosen ratio +1, rejected ratio -1: h = 2, beta h = 1
    # robust, eps 0.1: (-(0.9) log s(1) + 0.1 log s(-1)) / 0.8 = (0.9 * 0.31326 - 0.1 * 1.31326) / 0.8 = 0.18827
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="robust", label_smoothing=0.1)
    assert loss.item() == pytest.approx((0.9 * 0.3132617 - 0.1 * 1.3132617) / 0.8, abs=1e-6)
    # robust with eps 0 is plain DPO; eps >= 0.5 has no unbiased estimator
    plain, _ = dpo_loss(pc, pr, rc, rr, beta=0.5)
    assert dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="robust")[0].item() == pytest.approx(plain.item())
    with pytest.raises(ValueError, match="label_smoothing < 0.5"):
        dpo_loss(pc, pr, rc, rr, loss_type="robust", label_smoothing=0.5)
    # hinge: relu(1 - beta h): beta 0.25 -> 0.5; beta 0.5 -> exactly on the margin, 0
    assert dpo_loss(pc, pr, rc, rr, beta=0.25, loss_type="hinge")[0].item() == pytest.approx(0.5)
    assert dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="hinge")[0].item() == 0.0
    # length-normalised: chosen 2 tokens, rejected 4 tokens -> h = 1/2 - (-1)/4 = 0.75
    lc, lr = torch.tensor([2.0]), torch.tensor([4.0])
    loss, stats = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="ipo_norm", chosen_lengths=lc, rejected_lengths=lr)
    assert loss.item() == pytest.approx((0.75 - 1.0) ** 2)
    assert stats["rewards/chosen"].item() == pytest.approx(0.5)  # implicit rewards stay on summed ratios
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=2.0, loss_type="sigmoid_norm", chosen_lengths=lc, rejected_lengths=lr)
    assert loss.item() == pytest.approx(-F.logsigmoid(torch.tensor(1.5)).item())
    with pytest.raises(ValueError, match="lengths"):
        dpo_loss(pc, pr, rc, rr, loss_type="sigmoid_norm")
    # kto_pair: ratios chosen (1, 3), rejected (-1, 1): z_c = mean(1, 3) = 2, z_r = max(0, mean(-1, 1)) = 0;
    # pair 1: 0.5 [(1 - s(0.5 (1 - 0))) + (1 - s(0.5 (2 + 1)))], pair 2: 0.5 [(1 - s(1.5)) + (1 - s(0.5))]
    s_ = torch.sigmoid
    pc2, pr2 = torch.tensor([-1.0, 1.0]), torch.tensor([-3.0, -1.0])
    rc2, rr2 = torch.tensor([-2.0, -2.0]), torch.tensor([-2.0, -2.0])
    loss, _ = dpo_loss(pc2, pr2, rc2, rr2, beta=0.5, loss_type="kto_pair")
    pair1 = 0.5 * ((1 - s_(torch.tensor(0.5))) + (1 - s_(torch.tensor(1.5))))
    pair2 = 0.5 * ((1 - s_(torch.tensor(1.5))) + (1 - s_(torch.tensor(0.5))))
    assert loss.item() == pytest.approx(((pair1 + pair2) / 2).item())
    z = torch.zeros(3)
    assert dpo_loss(z, z, z, z, loss_type="kto_pair")[0].item() == pytest.approx(0.5)
    # the reference points carry no gradient: a chosen answer's gradient comes from its own term only
    p = torch.tensor([-1.0, 1.0], requires_grad=True)
    dpo_loss(p, pr2, rc2, rr2, beta=0.5, loss_type="kto_pair")[0].backward()
    expected = -0.5 * 0.5 * s_(torch.tensor([0.5, 1.5])) * (1 - s_(torch.tensor([0.5, 1.5]))) / 2
    assert p.grad.tolist() == pytest.approx(expected.tolist())
    # gradients: hinge is flat beyond the margin, sigmoid is not
    p = torch.tensor([-1.0], requires_grad=True)
    dpo_loss(p, pr, rc, rr, beta=0.5, loss_type="hinge")[0].backward()
    assert p.grad.item() == 0.0


def test_dpo_stage_config_offers_every_loss_and_checks_robust_flip_rate():
    from pathlib import Path
    from typing import get_args, get_type_hints

    from rlhf_core.config import ConfigError, load_config
    from stages import dpo

    assert set(get_args(get_type_hints(dpo.Config)["loss_type"])) == set(DPO_LOSSES) | {"kto"}  # kto: unpaired rows, kto_loss
    assert load_config(dpo.Config, "dpo", Path("none.yaml"), ["dpo.loss_type=hinge"]).loss_type == "hinge"
    with pytest.raises(ConfigError, match="label_smoothing < 0.5"):
        load_config(dpo.Config, "dpo", Path("none.yaml"), ["dpo.loss_type=robust", "dpo.label_smoothing=0.5"])


def test_ppo_kl_and_value_clipfrac_statistics():
    # old - new = (0.1, -0.3) on the valid tokens, a third token masked out: ppo_kl = -0.1
    new = torch.tensor([[0.0, 0.0, 5.0]])
    old = torch.tensor([[0.1, -0.3, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    _, stats = ppo_policy_loss(new, old, torch.ones(1, 3), mask)
    assert stats["ppo_kl"].item() == pytest.approx(-0.1)
    r = torch.tensor([math.exp(-0.1), math.exp(0.3)])
    assert stats["approx_kl"].item() == pytest.approx(((r - 1) - torch.tensor([-0.1, 0.3])).mean().item(), abs=1e-6)
    # value clip 0.2: token 1 moves 0.5 (beyond the range: (1.2 - 2)^2 = 0.64 > (1.5 - 2)^2 = 0.25, clipped),
    # token 2 moves 0.1 (within it: both terms equal, not clipped), token 3 masked
    values, old_v = torch.tensor([[1.5, 0.1, 9.0]]), torch.tensor([[1.0, 0.0, 0.0]])
    returns = torch.tensor([[2.0, 0.5, 0.0]])
    _, vstats = value_loss(values, old_v, returns, mask, clip=0.2)
    assert vstats["vf_clipfrac"].item() == pytest.approx(0.5)
    _, vstats = value_loss(values, old_v, returns, mask, clip=None)
    assert vstats["vf_clipfrac"].item() == 0.0


def test_kto_on_unpaired_completions_by_hand():
    # ratios r = (1, -1, 2); mismatched ratios (0.5, 1.5, -0.5) -> z = mean 0.5 (>= 0), detached
    pol, ref = torch.tensor([0.0, -2.0, 1.0], requires_grad=True), torch.tensor([-1.0, -1.0, -1.0])
    kl_pol, kl_ref = torch.tensor([0.5, 1.5, -0.5]), torch.zeros(3)
    desirable = torch.tensor([1.0, 0.0, 1.0])
    loss, stats = kto_loss(pol, ref, kl_pol, kl_ref, desirable, beta=2.0, desirable_weight=1.0, undesirable_weight=3.0)
    s_ = torch.sigmoid
    terms = [1 - s_(torch.tensor(2.0 * (1 - 0.5))), 3.0 * (1 - s_(torch.tensor(2.0 * (0.5 + 1)))), 1 - s_(torch.tensor(2.0 * (2 - 0.5)))]
    assert loss.item() == pytest.approx(sum(t.item() for t in terms) / 3)
    assert stats["kto/kl"].item() == pytest.approx(0.5)
    assert stats["rewards/chosen"].item() == pytest.approx(2.0 * 1.5) and stats["rewards/rejected"].item() == pytest.approx(-2.0)
    # a negative mismatched mean clamps z at 0
    _, stats = kto_loss(pol, ref, -kl_pol, kl_ref, desirable)
    assert stats["kto/kl"].item() == 0.0
    # desirable completions are pushed up, undesirable ones down
    loss.backward()
    assert pol.grad[0] < 0 and pol.grad[2] < 0 and pol.grad[1] > 0
