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


def tiny_vlm_dir(tmp_path, rows):
    tok = build_tokenizer([r["prompt"] + " " + r["label"] for r in rows] * 5 + [" wrong, count again"] * 5, vocab_size=300)
    model, processor = build_vlm(TinyVLMConfig(), TinyModelConfig(), tok, seed=0)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    return str(tmp_path)


def test_hf_engine_feeds_the_pixels_and_reports_the_trainers_logprobs(tmp_path):
    """The rollout engine on a VLM: its sampled tokens' log-probs are the trainer's teacher-forced
    ones given the same picture, another picture changes them, and the image placeholder is never
    sampled (it would have no picture behind it) -- on either side of the log-probs."""
    from rlhf_core.algos.losses import token_logprobs
    from rlhf_core.data.images import VisionInputs
    from rlhf_core.models.load import load_processor
    from rlhf_core.rl.collate import policy_logits
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


def test_multi_turn_image_feedback_flows_token_in_token_out(tmp_path):
    """RetryCounting: a wrong count gets the picture back with the objects outlined.  The feedback
    picture's 16 image tokens enter the context as environment tokens (action_mask 0), the second
    turn is sampled seeing both pictures, and the trainer's collate hands both to the model in order."""
    from rlhf_core.algos.losses import token_logprobs
    from rlhf_core.data.images import VisionInputs
    from rlhf_core.data.shapes import mark_objects
    from rlhf_core.models.load import load_processor, load_tokenizer
    from rlhf_core.rl.collate import RLCollate, policy_logits
    from rlhf_core.rollout.agents import LocalEnvironments, RetryCounting, run_episodes
    from rlhf_core.rollout.batch import RolloutBatch
    from rlhf_core.rollout.engines import HFEngine

    rows = generate_shapes(ShapesConfig(num_train=8, num_eval=1), seed=0)["train"]
    path = tmp_path / "scene.png"
    path.write_bytes(rows[0]["image"])
    model_dir = tiny_vlm_dir(tmp_path / "vlm", rows)
    engine, tok, vision = HFEngine(model_dir, max_model_len=96, seed=0), load_tokenizer(model_dir), VisionInputs(load_processor(model_dir))
    forward = engine.model.forward  # an untrained model rarely ends a turn: make EOS likely (the trainer sees the same model)

    def eos_likely(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits[..., tok.eos_token_id] += 5.0
        return out
    engine.model.forward = eos_likely
    # label 9: never right, so every episode gets the image feedback and a second turn
    eps = run_episodes(engine, tok, LocalEnvironments(RetryCounting), [rows[0]["prompt"]] * 2, ["9"] * 2, [1, 2], max_new_tokens=3,
                       temperature=1.0, max_len=96, images=[[str(path)]] * 2, vision=vision)
    marked = mark_objects(rows[0]["image"])
    image_id = vision.image_token_id
    for ep in eps:
        assert ep.turns == 2 and ep.env_reward == 0.0 and ep.images == [str(path), marked]
        response = ep.token_ids[ep.prompt_len:]
        assert ep.token_ids[:ep.prompt_len].count(image_id) == 16 and response.count(image_id) == 16
        assert all(m == 0 for t, m in zip(response, ep.action_mask) if t == image_id)  # feedback pictures are never trained on
    ep = eps[0]
    batch = RolloutBatch.from_episodes([{**vars(e), "response": "", "policy_version": 0} for e in eps],
                                       [{"row": {"prompt": rows[0]["prompt"], "label": "9"}, "group": 0, "sample_index": i} for i in range(2)])
    collated = RLCollate(tok.pad_token_id, keys=("action_mask",), vision=vision)(batch)
    assert collated["pixel_values"].shape == (4, 3, 56, 56)  # two pictures per episode, in order
    ids = torch.tensor([ep.token_ids])
    with torch.no_grad():
        logits = policy_logits(engine.model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "suppressed_ids": collated["suppressed_ids"],
                                              "pixel_values": collated["pixel_values"][:2]})
    lp = token_logprobs(logits, ids[:, 1:])[0, ep.prompt_len - 1:]
    sampled = [lp[k] for k, m in enumerate(ep.action_mask) if m]
    # the engine's log-probs of both turns are the trainer's, given both pictures
    assert torch.allclose(torch.tensor([x for x, m in zip(ep.engine_logprobs, ep.action_mask) if m]), torch.stack(sampled), atol=1e-4)


def test_mark_objects_outlines_the_occupied_cells():
    import io

    from PIL import Image

    from rlhf_core.data.shapes import mark_objects

    row = generate_shapes(ShapesConfig(num_train=1, num_eval=1), seed=5)["train"][0]
    marked = Image.open(io.BytesIO(mark_objects(row["image"]))).convert("RGB")
    occupied = {t.cell for t in row["scene"]}
    for r in range(4):
        for c in range(4):
            assert (marked.getpixel((c * 14, r * 14)) == (0, 0, 0)) == ((r, c) in occupied)
