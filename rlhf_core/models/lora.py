"""LoRA adapters (peft) on a model of `models.load`: the base weights stay frozen, rank-`r` updates
train.  What the rest of the pipeline sees is always a plain HF model: the weights a rollout engine
receives and `model/` on disk are the *merged* ones (base + scale * B @ A), computed without
touching the live model; the adapter alone is saved beside them (`model/adapter/`) with the base it
belongs to.  The reference policy is the base with the adapters switched off -- no second copy.
"""
from __future__ import annotations

from pathlib import Path

import torch

TASK_TYPES = {"causal_lm": "CAUSAL_LM", "reward": "SEQ_CLS", "value": "TOKEN_CLS"}
"""peft's task type per model kind: SEQ_CLS / TOKEN_CLS also train the new head (`score`) in full."""


def add_lora(model, kind: str, rank: int, alpha: int, dropout: float, target_modules: str):
    """`model` wrapped in rank-`rank` LoRA adapters on `target_modules` (comma-separated module
    names, or `all-linear`: every linear layer but the LM head)."""
    from peft import LoraConfig, TaskType, get_peft_model

    targets = target_modules if target_modules == "all-linear" else [t.strip() for t in target_modules.split(",") if t.strip()]
    # a head the task type trains in full gets no adapter (peft refuses both on one module)
    heads = {} if kind == "causal_lm" else {"exclude_modules": ["score", "classifier"]}
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type=getattr(TaskType, TASK_TYPES[kind]),
                        **heads)
    return get_peft_model(model, config)


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


@torch.no_grad()
def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """The base model's state dict under its own (HF) names with every adapter merged in -- what
    `merge_and_unload()` would give, but the live model keeps its adapters (merging and unmerging
    in place would drift the base weights by rounding at every weight sync).  A 4-bit base
    (QLoRA) is dequantised: engines and `model/` get plain weights."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.integrations import dequantize_module_weight

    base = model.get_base_model()
    adapted = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer) and m.active_adapters}
    out = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key or ".original_module." in key or any(key.startswith(f"{name}.base_layer.") for name in adapted):
            continue  # adapters, a trained head's frozen original, an adapted layer's (possibly quantised) base
        out[key.replace(".modules_to_save.default.", ".")] = value
    for name, module in adapted.items():
        layer = module.get_base_layer()
        weight = dequantize_module_weight(layer)
        out[f"{name}.weight"] = weight + module.get_delta_weight(module.active_adapters[0]).to(weight.dtype)
        if getattr(layer, "bias", None) is not None:
            out[f"{name}.bias"] = layer.bias
    return out


def save_merged(model, out_dir: str) -> None:
    """`out_dir`: the merged model in HF format (any engine loads it), and `out_dir/adapter/`: the
    adapter alone, whose adapter_config.json names the base model it belongs to."""
    model.get_base_model().save_pretrained(out_dir, state_dict=merged_state_dict(model), safe_serialization=True)
    model.save_pretrained(str(Path(out_dir) / "adapter"))
