"""Optimizer parameter groups: decay reaches matrices only."""
import pytest
import torch

from rlhf_core.training.engine import param_groups

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
