"""The tiny VLM: built here, saved with its processor, reloaded by the Auto classes like a hub VLM,
and its forward sees the image -- a different picture changes the answer's logits."""
import io

import pytest
import torch

from rlhf_core.data.shapes import ShapesConfig, generate_shapes
from rlhf_core.models.tiny import TinyModelConfig, build_tokenizer
from rlhf_core.models.tiny_vlm import TinyVLMConfig, build_vlm

pytestmark = pytest.mark.unit


def test_tiny_vlm_round_trip_and_forward(tmp_path):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    rows = generate_shapes(ShapesConfig(num_train=8, num_eval=1), seed=0)["train"]
    tok = build_tokenizer([r["prompt"] + " " + r["label"] for r in rows] * 5, vocab_size=300)
    model, processor = build_vlm(TinyVLMConfig(), TinyModelConfig(), tok, seed=0)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    model, processor = AutoModelForImageTextToText.from_pretrained(tmp_path).eval(), AutoProcessor.from_pretrained(tmp_path)
    assert sum(p.numel() for p in model.parameters()) < 5e6
    images = [Image.open(io.BytesIO(r["image"])).convert("RGB") for r in rows[:2]]
    batch = processor(text=[rows[0]["prompt"]] * 2, images=images, return_tensors="pt")
    image_id = model.config.image_token_index
    assert (batch["input_ids"][0] == image_id).sum().item() == TinyVLMConfig().image_tokens  # <image> expanded to 16 patches
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape[:2] == batch["input_ids"].shape and torch.isfinite(logits).all()
    assert not torch.allclose(logits[0, -1], logits[1, -1])  # the same question, another picture: the image is seen


def test_hf_engine_feeds_the_pixels_and_reports_the_trainers_logprobs(tmp_path):
    """The rollout engine on a VLM: its sampled tokens' log-probs are the trainer's teacher-forced
    ones given the same picture, another picture changes them, and the image placeholder is never
    sampled (it would have no picture behind it) -- on either side of the log-probs."""
    from rlhf_core.algos.losses import token_logprobs
    from rlhf_core.training.rl_step import policy_logits
    from rlhf_core.data.images import VisionInputs
    from rlhf_core.models.load import load_processor
    from rlhf_core.rollout.engines import HFEngine

    rows = generate_shapes(ShapesConfig(num_train=8, num_eval=1), seed=0)["train"]
    tok = build_tokenizer([r["prompt"] + " " + r["label"] for r in rows] * 5, vocab_size=300)
    model, processor = build_vlm(TinyVLMConfig(), TinyModelConfig(), tok, seed=0)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    engine, vision = HFEngine(str(tmp_path), max_model_len=64, seed=0), VisionInputs(load_processor(str(tmp_path)))
    refs = [[r["image"]] for r in rows[:2]]  # image bytes work like paths
    prompt = vision.prompt_ids(rows[0]["prompt"], refs[0])
    pixels = [vision.pixel_values(r) for r in refs]
    outs = engine.generate([prompt, prompt], [4, 4], 1.0, [7, 7], pixels=pixels)
    suppressed = torch.tensor([vision.image_token_id])
    for out, pix in zip(outs, pixels):
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits = policy_logits(engine.model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pix,
                                                  "suppressed_ids": suppressed})
        expected = token_logprobs(logits, ids[:, 1:])[0, len(prompt) - 1:]
        assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)
    same = engine.generate([prompt], [4], 1.0, [7], pixels=pixels[:1])[0]
    assert same.token_ids == outs[0].token_ids  # seeded: a pure function of (weights, prompt, picture, seed)
    other = engine.generate([prompt], [len(same.token_ids)], 1.0, [7], pixels=pixels[1:])[0]
    assert other.logprobs != same.logprobs  # the picture reaches the model

    forward = engine.model.forward  # a model that would rather emit the image placeholder than anything

    def biased(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits[..., vision.image_token_id] += 100.0
        return out
    engine.model.forward = biased
    sampled = engine.generate([prompt] * 4, [4] * 4, 1.0, [1, 2, 3, 4], pixels=pixels[:1] * 4)
    assert all(vision.image_token_id not in s.token_ids for s in sampled)
