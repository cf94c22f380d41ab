"""The one place a model or tokenizer is loaded, from a local path or a hub id: the training
workers, the rollout engines (HF), the reference, the reward model and the reward server all come
through here, so a kind gets the same head and a dtype the same meaning everywhere, and a missing
local path is the same clear error."""
from __future__ import annotations

from pathlib import Path

KINDS = ("causal_lm", "reward", "value")
"""causal_lm: the LM head (a vision-language model's: `AutoModelForImageTextToText`); reward: a
sequence-classification head with one label (a score per sequence); value: a token-classification
head with one label (a critic's V(s_t) at every position)."""


def check_model_path(path: str) -> None:
    """A local path that does not exist is a clear error (not a confusing hub lookup)."""
    if path.startswith((".", "/", "artifacts")) and not Path(path).exists():
        raise FileNotFoundError(f"model_path {path!r} does not exist (run the upstream stage first, or set --set STAGE.model_path=...)")


def is_vision_model(path: str, trust_remote_code: bool = False) -> bool:
    """Whether `path` is a vision-language model (its config has a vision tower)."""
    import json

    from transformers import AutoConfig

    check_model_path(path)
    if Path(path).is_dir():  # a local model: its config.json (a tokenizer-only directory has none: not a VLM)
        config = Path(path) / "config.json"
        return config.is_file() and "vision_config" in json.loads(config.read_text())
    return hasattr(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code), "vision_config")


def load_processor(path: str, trust_remote_code: bool = False):
    """A vision-language model's processor (its image processor turns images into `pixel_values`)."""
    from transformers import AutoProcessor

    check_model_path(path)
    return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)


def load_model(path: str, kind: str = "causal_lm", dtype: str | None = "float32", trust_remote_code: bool = False, load_in_4bit: bool = False):
    """`kind` (one of KINDS) from `path`.  `dtype`: a torch dtype name ("float32", "bfloat16"), or
    None for transformers' default (the reward model keeps the dtype it was saved in).
    `load_in_4bit`: NF4 weights with bf16 compute (QLoRA's base; bitsandbytes on CUDA)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSequenceClassification, AutoModelForTokenClassification

    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}; valid: {KINDS}")
    check_model_path(path)
    cls = {"causal_lm": AutoModelForCausalLM, "reward": AutoModelForSequenceClassification, "value": AutoModelForTokenClassification}[kind]
    if kind == "causal_lm" and is_vision_model(path, trust_remote_code):
        cls = AutoModelForImageTextToText
    heads = {} if kind == "causal_lm" else {"num_labels": 1}
    dtypes = {} if dtype is None else {"dtype": getattr(torch, dtype)}
    if load_in_4bit:
        if not torch.cuda.is_available():
            raise RuntimeError("load_in_4bit needs a CUDA GPU (bitsandbytes' 4-bit kernels); this worker has none")
        from transformers import BitsAndBytesConfig

        dtypes["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                                           bnb_4bit_compute_dtype=torch.bfloat16)
    return cls.from_pretrained(path, trust_remote_code=trust_remote_code, **heads, **dtypes)


def actor_device():
    """The device an actor computes on: its GPU where Ray gave it one (Ray sets each actor's
    CUDA_VISIBLE_DEVICES to its own GPUs, so that is cuda:0 inside it), else the CPU."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The tokenizer of `path`; one without a pad token pads with EOS (common for hub models;
    padding is masked everywhere)."""
    from transformers import AutoTokenizer

    check_model_path(path)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
