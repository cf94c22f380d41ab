"""Examples -> padded tensor batches for the training workers: supervised rows (`Collate`),
preference pairs (`CollatePairs`, chosen then rejected), and the helpers around them."""
from __future__ import annotations

import logging

import torch

from rlhf_core.data.images import VisionInputs
from rlhf_core.data.tokenize import pad_batch
from rlhf_core.models.shared_prefix import PACK_MAX_LEN, pack_rows

log = logging.getLogger("rlhf.stage")


class Collate:
    """Padded batches; with `vision`, also the `pixel_values` of the examples' images in order."""

    def __init__(self, pad_id: int, keys=("input_ids", "loss_mask"), vision: VisionInputs | None = None):
        self.pad_id, self.keys, self.vision = pad_id, keys, vision

    def __call__(self, examples: list[dict]) -> dict:
        batch = pad_batch(examples, self.pad_id, self.keys)
        if self.vision is not None:
            batch["pixel_values"] = self.vision.pixel_values([ref for e in examples for ref in e.get("images", ())])
        return batch


class CollatePairs:
    """Pairs -> one padded batch: the B chosen sequences, then the B rejected ones.  Extra
    per-pair float fields (e.g. reference log-probs) become `(B,)` tensors; with `vision`, the
    pairs' pictures as `pixel_values` in the same layout (a pair's picture twice).  With
    `shared_prefix` (text models), also the packed forward inputs in which a pair's two sequences
    share one copy of their prompt (`shared_prefix.pack_rows`; the forward reads them through
    `shared_prefix.model_logits`)."""

    def __init__(self, pad_id: int, extra: tuple[str, ...] = (), vision: VisionInputs | None = None, shared_prefix: bool = False):
        self.pad_id, self.extra, self.vision = pad_id, extra, vision
        self.shared_prefix = shared_prefix and vision is None

    def __call__(self, pairs: list[dict]) -> dict:
        sequences = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
        batch = pad_batch(sequences, self.pad_id)
        if self.shared_prefix:  # the prompt: the tokens before the loss mask's first 1
            prompt_len = [e["loss_mask"].index(1) if 1 in e["loss_mask"] else len(e["loss_mask"]) for e in sequences]
            batch.update(pack_rows([e["input_ids"] for e in sequences], prompt_len, self.pad_id, PACK_MAX_LEN) or {})
        if self.vision is not None:
            refs = [ref for p in pairs for ref in p.get("images", ())]
            batch["pixel_values"] = self.vision.pixel_values(refs + refs)
        for key in self.extra:
            batch[key] = torch.tensor([p[key] for p in pairs], dtype=torch.float32)
        return batch


def count_pairs(batch: list[dict]) -> dict:
    return {"num_pairs": len(batch)}


def split_pairs(values) -> list[tuple[float, float]]:
    """A `(2B,)` tensor laid out chosen-then-rejected -> B (chosen, rejected) tuples."""
    b = values.shape[0] // 2
    return list(zip(values[:b].tolist(), values[b:].tolist()))


def batches(collate, examples: list[dict], size: int) -> list[dict]:
    return [collate(examples[i:i + size]) for i in range(0, len(examples), size)]
