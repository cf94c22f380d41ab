"""Optimizer parameter groups: decay reaches matrices only."""
import pytest
import torch

from rlhf_core.training.deepspeed_engine import param_groups

pytestmark = pytest.mark.unit


def test_weight_decay_skips_norm_gains_and_biases():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=1, num_key_value_heads=1, head_dim=64))
    decay, plain = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all("norm" in names[id(p)] for p in plain["params"]) and len(plain["params"]) == 3
    assert {names[id(p)] for p in decay["params"]} >= {"model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight"}
    assert len(decay["params"]) + len(plain["params"]) == len(list(model.parameters()))

    # one AdamW step with zero gradients: only the decayed matrices shrink
    opt = torch.optim.AdamW(param_groups(model, 0.5), lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    after = dict(model.named_parameters())
    assert torch.equal(after["model.norm.weight"], before["model.norm.weight"])
    assert torch.allclose(after["model.layers.0.mlp.up_proj.weight"], before["model.layers.0.mlp.up_proj.weight"] * 0.95)


def test_micro_batches_same_count_on_every_rank_and_none_empty():
    from rlhf_core.training.worker_group import micro_batches

    sizes = lambda shard, size, total, ranks: [len(m) for m in micro_batches(shard, size, total, ranks)]  # noqa: E731
    assert sizes(list(range(8)), 4, 16, 2) == [4, 4]
    assert sizes(list(range(8)), 2, 16, 2) == [2, 2, 2, 2]
    # 17 over 2 ranks: shards of 9 and 8 both get 3 micro-batches (the larger one needs them)
    assert sizes(list(range(9)), 4, 17, 2) == [3, 3, 3] and sizes(list(range(8)), 4, 17, 2) == [2, 3, 3]
    # a micro size of 1 on shards of 4 and 3: capped at 3 micro-batches, none empty
    assert sizes(list(range(4)), 1, 7, 2) == [1, 1, 2] and sizes(list(range(3)), 1, 7, 2) == [1, 1, 1]
    assert micro_batches(list(range(6)), 100, 12, 2) == [list(range(6))]
    assert [x for m in micro_batches(list(range(9)), 4, 17, 2) for x in m] == list(range(9))  # order kept


def test_ds_config_accumulation_and_offload():
    from rlhf_core.training.config import TrainConfig
    from rlhf_core.training.deepspeed_engine import ds_config

    plain = ds_config(TrainConfig(global_batch_size=16, num_workers=2))
    assert plain["train_micro_batch_size_per_gpu"] == 8 and plain["gradient_accumulation_steps"] == 1
    assert "offload_optimizer" not in plain["zero_optimization"] and plain["managed_gradient_accumulation"] is False
    acc = ds_config(TrainConfig(global_batch_size=16, num_workers=2, micro_batch_size=2, zero_stage=3, offload="all"))
    assert acc["train_micro_batch_size_per_gpu"] == 2 and acc["gradient_accumulation_steps"] == 4
    assert acc["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert acc["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    with pytest.raises(ValueError, match="offload=all needs zero_stage=3"):
        TrainConfig(zero_stage=2, offload="all")
    with pytest.raises(ValueError, match="offload=optimizer needs zero_stage >= 1"):
        TrainConfig(offload="optimizer")
    with pytest.raises(ValueError, match="micro_batch_size must be >= 0"):
        TrainConfig(micro_batch_size=-1)


def test_weight_layout_flatten_unflatten_round_trip():
    from rlhf_core.runtime.weight_sync import Layout, empty_buffers, flatten, unflatten

    named = [("a", torch.arange(6.0).view(2, 3)), ("b", torch.ones(4, dtype=torch.bfloat16)), ("c", torch.tensor([7.0]))]
    layout = Layout.of(named)
    assert [dtype for dtype, _ in layout.groups] == ["bfloat16", "float32"]  # one buffer per dtype
    flats = flatten(named, layout)
    assert [f.numel() for f in flats] == [4, 7] and [b.numel() for b in empty_buffers(layout, torch.device("cpu"))] == [4, 7]
    back = dict(unflatten(flats, layout))
    assert set(back) == {"a", "b", "c"} and all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in named)
