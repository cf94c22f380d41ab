"""Shared-prompt packing (rl.shared_prefix): the layout, and that a packed forward gives the
unpacked log-probs, values, loss and gradients on a real (tiny) Qwen3."""
import dataclasses

import pytest
import torch
from conftest import make_batch

from rlhf_core.models.shared_prefix import pack_rows, segment_mask
from rlhf_core.rl.collate import RLCollate, logprobs_fn, values_fn
from rlhf_core.rl.objective import CriticObjective, PolicyObjective

pytestmark = pytest.mark.unit


def test_pack_rows_layout():
    # two samples of prompt [5, 6, 7], one of prompt [5, 8]
    ids = [[5, 6, 7, 1, 2], [5, 6, 7, 3], [5, 8, 4, 4]]
    out = pack_rows(ids, [3, 3, 2], pad_id=0, max_len=64)
    assert out["pack_input_ids"].tolist() == [[5, 6, 7, 1, 2, 7, 3], [5, 8, 4, 4, 0, 0, 0]]
    assert out["pack_position_ids"].tolist() == [[0, 1, 2, 3, 4, 2, 3], [0, 1, 2, 3, 0, 0, 0]]
    # (sample, unpacked logits position) <- packed flat position: row 0 at 2, 3 (sample 0), 5 (sample 1); row 1 at 1, 2
    assert out["pack_target"].tolist() == [[0, 2], [0, 3], [1, 2], [2, 1], [2, 2]]
    assert out["pack_index"].tolist() == [2, 3, 5, 7 + 1, 7 + 2]
    mask = out["pack_mask"][0, 0].int().tolist()
    assert mask[5] == [1, 1, 0, 0, 0, 1, 0]  # sample 1's P[-1] copy sees the shared prompt and itself, not sample 0
    assert mask[4] == [1, 1, 1, 1, 1, 0, 0]
    assert out["pack_mask"][1, 0, 5].int().tolist() == [0, 0, 0, 0, 0, 1, 0]  # padding sees itself only


def test_pack_rows_none_without_a_shared_prompt_and_split_beyond_max_len():
    assert pack_rows([[1, 2, 3], [1, 4, 3]], [2, 2], pad_id=0, max_len=64) is None
    ids = [[1, 2, 3, 4]] * 4  # shared 1 token + 3 per segment
    out = pack_rows(ids, [2] * 4, pad_id=0, max_len=7)
    assert out["pack_input_ids"].tolist() == [[1, 2, 3, 4, 2, 3, 4]] * 2
    assert segment_mask(torch.tensor([[0, 1, 1, -1]]))[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]]


def tiny(cls_name: str = "Qwen3ForCausalLM", attn: str = "sdpa"):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=32, num_labels=1, pad_token_id=0)
    cfg._attn_implementation = attn
    return getattr(transformers, cls_name)(cfg).eval()


def rl_batch(packed: bool):
    prompts = [[1, 5, 6, 7, 9], [1, 8, 9]]
    samples = []
    for g, prompt in enumerate(prompts):
        for k, response in enumerate([[10, 11, 2], [12, 2], [13, 14, 15, 16, 2]]):
            n = len(response)
            mask = [1] * n if k != 2 else [1, 0, 0, 1, 1]  # a multi-turn sample: environment tokens inside the response
            samples.append({"token_ids": prompt + response, "prompt_len": len(prompt), "action_mask": mask, "group": g,
                            "score": float(k == 0), "advantages": [0.5 - k * 0.4] * n, "ref_logprobs": [-3.0] * n,
                            "engine_logprobs": [-3.0] * n, "old_values": [0.0] * n, "returns": [1.0] * n})
    batch = RLCollate(0, keys=("action_mask", "advantages", "ref_logprobs", "engine_logprobs", "old_values", "returns"),
                              shared_prefix=packed)(make_batch(samples))
    assert ("pack_index" in batch) == packed
    return batch


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_forward_equals_unpacked_logprobs_loss_and_gradients(attn):
    model = tiny(attn=attn)
    plain, packed = rl_batch(False), rl_batch(True)
    assert packed["pack_input_ids"].numel() < plain["input_ids"].numel()
    for a, b in zip(logprobs_fn(model, plain, 0.7), logprobs_fn(model, packed, 0.7)):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)
    loss_fn = dataclasses.replace(PolicyObjective("ppo", 0.2, 0.2, None, "token-mean", 1, temperature=0.7, entropy_coef=0.01),
                                  kl_loss_coef=0.1)
    counts = {"num_tokens": 20, "num_seqs": 6}
    grads = []
    for batch in (plain, packed):
        model.zero_grad()
        loss, stats = loss_fn(model, batch, counts)
        loss.backward()
        grads.append(([p.grad.clone() for p in model.parameters()], float(loss), float(stats["entropy"])))
    for a, b in zip(grads[0][0], grads[1][0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert grads[0][1] == pytest.approx(grads[1][1], abs=1e-6) and grads[0][2] == pytest.approx(grads[1][2], abs=1e-6)


def test_packed_critic_values_and_loss_equal_unpacked():
    critic = tiny("Qwen3ForTokenClassification")
    plain, packed = rl_batch(False), rl_batch(True)
    for a, b in zip(values_fn(critic, plain), values_fn(critic, packed)):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)
    loss_fn = CriticObjective(0.2, "token-mean", 1)
    counts = {"num_tokens": 20, "num_seqs": 6}
    a, b = loss_fn(critic, plain, counts)[0], loss_fn(critic, packed, counts)[0]
    assert float(a) == pytest.approx(float(b), abs=1e-6)


def test_packed_dpo_pairs_equal_unpacked_logps_and_gradients():
    from rlhf_core.training.batching import CollatePairs
    from stages import dpo

    seq = lambda prompt, resp: {"input_ids": prompt + resp, "loss_mask": [0] * len(prompt) + [1] * len(resp)}  # noqa: E731
    pairs = [{"chosen": seq([1, 5, 6], [7, 2]), "rejected": seq([1, 5, 6], [8, 9, 2]), "ref_chosen": -2.0, "ref_rejected": -3.0},
             {"chosen": seq([1, 9, 9, 9], [4, 2]), "rejected": seq([1, 9, 9, 9], [3, 2]), "ref_chosen": -1.0, "ref_rejected": -1.5}]
    model = tiny()
    grads = []
    for shared in (False, True):
        batch = CollatePairs(0, extra=("ref_chosen", "ref_rejected"), shared_prefix=shared)(pairs)
        assert ("pack_index" in batch) == shared
        model.zero_grad()
        loss, _ = dpo.loss_fn(model, batch, {"num_pairs": 2}, beta=0.1, loss_type="sigmoid", label_smoothing=0.0, nll_coef=1.0)
        loss.backward()
        grads.append((float(loss), dpo.ref_logps_fn(model, batch), [p.grad.clone() for p in model.parameters()]))
    assert grads[0][0] == pytest.approx(grads[1][0], abs=1e-6)
    assert grads[0][1] == pytest.approx(grads[1][1], abs=1e-5)
    for a, b in zip(grads[0][2], grads[1][2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_packed_rm_logprob_rewards_equal_unpacked(tmp_path):
    """rm (pooling=logprob): the pair rewards and the loss's gradients; the rl reward model's
    scores of a step's samples (rollout/rewards.py ModelReward)."""
    import json

    from rlhf_core.rollout.rewards import ModelReward
    from rlhf_core.training.batching import CollatePairs
    from stages import rm

    seq = lambda prompt, resp: {"input_ids": prompt + resp, "loss_mask": [0] * len(prompt) + [1] * len(resp)}  # noqa: E731
    pairs = [{"chosen": seq([1, 5, 6], [7, 2]), "rejected": seq([1, 5, 6], [8, 9, 2])},
             {"chosen": seq([1, 9, 9, 9], [4, 2]), "rejected": seq([1, 9, 9, 9], [3, 2])}]
    model = tiny()
    out = []
    for shared in (False, True):
        batch = CollatePairs(0, shared_prefix=shared)(pairs)
        model.zero_grad()
        loss, _ = rm.loss_fn(model, batch, {"num_pairs": 2}, loss="sigmoid", margin=0.0, pooling="logprob")
        loss.backward()
        out.append((rm.pair_rewards_fn(model, batch, "logprob"), [p.grad.clone() for p in model.parameters()]))
    assert out[0][0] == pytest.approx(out[1][0], abs=1e-5)
    for a, b in zip(out[0][1], out[1][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)

    model.save_pretrained(tmp_path)
    (tmp_path / "reward_stats.json").write_text(json.dumps({"pooling": "logprob"}))
    scorer = ModelReward(str(tmp_path), pad_token_id=0, normalize=False)
    samples = [{"token_ids": [1, 5, 6, 7, 2], "prompt_len": 3}, {"token_ids": [1, 5, 6, 8, 9, 2], "prompt_len": 3},
               {"token_ids": [1, 9, 4, 2], "prompt_len": 2}, {"token_ids": [1, 9, 3, 3, 2], "prompt_len": 2}]
    assert pack_rows([s["token_ids"] for s in samples], [s["prompt_len"] for s in samples], 0, 64) is not None  # packed
    scores = scorer(samples)[0]
    with torch.no_grad():
        for s, score in zip(samples, scores):
            ids = torch.tensor([s["token_ids"]])
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
            assert score == pytest.approx(float(lp[s["prompt_len"] - 1:].sum()), abs=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_forward_under_bf16_autocast(attn):
    """`mixed_precision=bf16` runs the loss under autocast: the packed mask must suit bf16 queries."""
    model = tiny(attn=attn)
    plain, packed = rl_batch(False), rl_batch(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = logprobs_fn(model, plain), logprobs_fn(model, packed)
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=0.1, rtol=0.05)
