"""LoRA adapters: the merged weights (what engines and `model/` get) are the live adapted model's,
for each model kind, without touching the live model; the adapters off give the base back."""
import pytest
import torch

from rlhf_core.models.lora import add_lora, merged_state_dict, save_merged

pytestmark = pytest.mark.unit


def tiny(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, LlamaForTokenClassification

    cfg = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                      head_dim=32, num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    return {"causal_lm": LlamaForCausalLM, "reward": LlamaForSequenceClassification, "value": LlamaForTokenClassification}[kind](cfg).eval()


@pytest.mark.parametrize("kind", ["causal_lm", "reward", "value"])
def test_merged_weights_are_the_adapted_model(kind, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification

    model = tiny(kind)
    ids = torch.randint(1, 32, (3, 6))
    base_out = model(input_ids=ids).logits
    peft_model = add_lora(model, kind, rank=4, alpha=8, dropout=0.0, target_modules="all-linear")
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or "score" in n for n in trainable)  # the base is frozen; a new head trains in full
    for name, p in peft_model.named_parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.2)  # B starts at 0: give the adapters something to merge
    live = peft_model(input_ids=ids).logits
    assert not torch.allclose(live, base_out, atol=1e-4)
    before = {k: v.clone() for k, v in peft_model.state_dict().items()}
    save_merged(peft_model, str(tmp_path))
    assert all(torch.equal(v, before[k]) for k, v in peft_model.state_dict().items())  # the live model is untouched
    auto = {"causal_lm": AutoModelForCausalLM, "reward": AutoModelForSequenceClassification, "value": AutoModelForTokenClassification}[kind]
    heads = {} if kind == "causal_lm" else {"num_labels": 1}
    reloaded = auto.from_pretrained(tmp_path, **heads).eval()
    assert torch.allclose(reloaded(input_ids=ids).logits, live, atol=1e-5)
    assert set(merged_state_dict(peft_model)) == set(reloaded.state_dict())  # plain HF names, as an engine expects
    assert (tmp_path / "adapter" / "adapter_config.json").exists() and (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    if kind == "causal_lm":
        with peft_model.disable_adapter():  # rl's reference: the base, no second copy
            assert torch.allclose(peft_model(input_ids=ids).logits, base_out, atol=1e-6)


def test_lora_config_checks():
    from rlhf_core.training.config import TrainConfig

    with pytest.raises(ValueError, match="zero_stage=3 is not supported"):
        TrainConfig(lora_rank=8, zero_stage=3)
    with pytest.raises(ValueError, match="load_in_4bit .* needs lora_rank > 0 and GPUs"):
        TrainConfig(lora_rank=8, load_in_4bit=True)
    with pytest.raises(ValueError, match="lora_rank must be >= 0"):
        TrainConfig(lora_rank=-1)
