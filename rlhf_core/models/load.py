"""The one place a model or tokenizer is loaded, from a local path or a hub id: the training
workers, the rollout engines (HF; vLLM takes its name from `resolve_model_ref`), the reference,
the reward model and the reward server all come through here, so a kind gets the same head and a
dtype the same meaning everywhere, and a missing local path is the same clear error.

A model reference is local unless it says otherwise: `hf://ORG/NAME` (or `hf://ORG/NAME@REVISION`,
a branch, tag or commit) is a Hugging Face hub model; anything else is a local path, and one that
does not exist is a FileNotFoundError -- never a hub download of whatever repo a typo names."""
from __future__ import annotations

import json
import re
from pathlib import Path

HUB_PREFIX = "hf://"
"""How a setting asks for the hub: `hf://ORG/NAME[@REVISION]` (models), `hf://NAME[@REVISION][:SPLIT]` (data)."""
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", re.ASCII)
_REVISION = re.compile(r"[\w./-]+", re.ASCII)

KINDS = ("causal_lm", "reward", "value")
"""causal_lm: the LM head (a vision-language model's: `AutoModelForImageTextToText`); reward: a
sequence-classification head with one label (a score per sequence); value: a token-classification
head with one label (a critic's V(s_t) at every position)."""


def resolve_model_ref(path: str | Path) -> tuple[str, str | None, bool]:
    """(name to hand transformers / vLLM, revision or None, whether it is a hub id) of a model
    reference -- the one rule (module doc).  `hf://ORG/NAME@REV` -> ("ORG/NAME", "REV", True); a
    local path -> (path, None, False), FileNotFoundError if it does not exist; a malformed hub id,
    or one that is also a local path (transformers would load the local one), is a ValueError."""
    path = str(path)
    if not path.startswith(HUB_PREFIX):
        if not Path(path).exists():
            raise FileNotFoundError(
                f"model_path {path!r} does not exist locally (run the upstream stage first, or set --set STAGE.model_path=...); "
                f"a Hugging Face hub model is written {HUB_PREFIX}ORG/NAME (or {HUB_PREFIX}ORG/NAME@REVISION)")
        return path, None, False
    name, at, revision = path[len(HUB_PREFIX):].partition("@")
    if not _HUB_ID.fullmatch(name) or ".." in name or (at and not (_REVISION.fullmatch(revision) and ".." not in revision)):
        raise ValueError(f"model_path {path!r} is not a hub id: write {HUB_PREFIX}ORG/NAME or {HUB_PREFIX}ORG/NAME@REVISION")
    if Path(name).exists():
        raise ValueError(f"model_path {path!r} asks for the hub model {name!r}, but {name!r} is also a local path, which transformers "
                         f"would load instead; rename or move it, or give the local path without {HUB_PREFIX}")
    return name, revision or None, True


def _hub_kwargs(revision: str | None) -> dict:
    return {} if revision is None else {"revision": revision}


def is_vision_model(path: str, trust_remote_code: bool = False) -> bool:
    """Whether `path` is a vision-language model (its config has a vision tower)."""
    from transformers import AutoConfig

    name, revision, hub = resolve_model_ref(path)
    if not hub and Path(name).is_dir():  # a local model: its config.json (a tokenizer-only directory has none: not a VLM)
        config = Path(name) / "config.json"
        return config.is_file() and "vision_config" in json.loads(config.read_text())
    return hasattr(AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code, **_hub_kwargs(revision)), "vision_config")


def load_processor(path: str, trust_remote_code: bool = False):
    """A vision-language model's processor (its image processor turns images into `pixel_values`)."""
    from transformers import AutoProcessor

    name, revision, _ = resolve_model_ref(path)
    return AutoProcessor.from_pretrained(name, trust_remote_code=trust_remote_code, **_hub_kwargs(revision))


def load_model(path: str, kind: str = "causal_lm", dtype: str | None = "float32", trust_remote_code: bool = False, load_in_4bit: bool = False):
    """`kind` (one of KINDS) from `path`.  `dtype`: a torch dtype name ("float32", "bfloat16"), or
    None for transformers' default (the reward model keeps the dtype it was saved in).
    `load_in_4bit`: NF4 weights with bf16 compute (QLoRA's base; bitsandbytes on CUDA)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSequenceClassification, AutoModelForTokenClassification

    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}; valid: {KINDS}")
    name, revision, _ = resolve_model_ref(path)
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
    return cls.from_pretrained(name, trust_remote_code=trust_remote_code, **heads, **dtypes, **_hub_kwargs(revision))


def actor_device():
    """The device an actor computes on: its GPU where Ray gave it one (Ray sets each actor's
    CUDA_VISIBLE_DEVICES to its own GPUs, so that is cuda:0 inside it), else the CPU."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The tokenizer of `path`; one without a pad token pads with EOS (common for hub models;
    padding is masked everywhere)."""
    from transformers import AutoTokenizer

    name, revision, _ = resolve_model_ref(path)
    tok = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code, **_hub_kwargs(revision))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
