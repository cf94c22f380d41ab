"""The embedded base model: a tokenizer trained locally and a tiny Qwen3 (or Llama) built from a config.

Nothing is downloaded: the tokenizer is a byte-level BPE trained with `tokenizers` on the
task corpus (digits are always single tokens, so arithmetic is learnable), and the model is
`Qwen3ForCausalLM` with random weights (the `pretrain` stage then trains it).  Both save in HF
format and reload with `AutoTokenizer` / `AutoModelForCausalLM.from_pretrained(path)`, so vLLM
serves them too.

Why Qwen3 by default: its RMSNorm on queries and keys (QK-norm) bounds the attention logits.
Without it (the Llama layout) the tiny model's attention saturated during training -- 45-50% of
heads put weight > 0.999 on one position -- and a reward model fine-tuned from it stayed at
chance, because a saturated softmax passes no gradient to the positions it ignores
(docs/benchmarks.md, "the learning chain").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
# Used when rows come as chat `messages`; a real model brings its own template.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass(frozen=True, kw_only=True)
class TinyModelConfig:
    arch: Literal["qwen3", "llama"] = "qwen3"
    """qwen3: Llama plus QK-norm (the healthy default); llama: the layout without it."""
    vocab_size: int = 320
    """Target BPE vocabulary (256 bytes + specials + merges)."""
    hidden_size: int = 256
    """Model width; hidden_size / num_heads must be 64 (vLLM's CPU attention rejects head_dim 16)."""
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 768
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads != 64:
            raise ValueError(f"hidden_size / num_heads must be 64, got {self.hidden_size}/{self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")


def build_tokenizer(corpus: Iterable[str], vocab_size: int):
    """Train a byte-level BPE on `corpus`; returns a `PreTrainedTokenizerFast` with BOS prepended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(cfg: TinyModelConfig, tokenizer, seed: int):
    """A randomly initialised `Qwen3ForCausalLM` / `LlamaForCausalLM` (fp32) sized by `cfg`, seeded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if cfg.arch == "qwen3" else (LlamaConfig, LlamaForCausalLM)
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model
