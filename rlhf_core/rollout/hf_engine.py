"""HF `generate` as a rollout engine: batched, left-padded, token ids in and out."""
from __future__ import annotations

import torch


@torch.no_grad()
def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int, pad_token_id: int, eos_token_id: int,
                    batch_size: int = 64, pixels: list | None = None) -> list[list[int]]:
    """Greedy continuation of each prompt (ids without the prompt, cut after the first EOS).
    `pixels`: per prompt the pixel values of its images (a VLM), None where it has none."""
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, width - len(p) :] = torch.tensor(p)
            attn[i, width - len(p) :] = 1
        device = next(model.parameters()).device
        extra = {}
        chunk_pixels = [p for p in (pixels or [])[start : start + batch_size] if p is not None]
        if chunk_pixels:  # the images of the chunk in prompt order: the model fills the image tokens in that order
            extra["pixel_values"] = torch.cat(chunk_pixels).to(device)
        image_id = getattr(model.config, "image_token_index", None)
        if image_id is not None:  # a VLM's image placeholder is a prompt token only (as in the rollout engine)
            extra["suppress_tokens"] = [image_id]
        gen = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad_token_id, eos_token_id=eos_token_id, **extra)
        for row in gen[:, width:].cpu().tolist():
            out.append(row[: row.index(eos_token_id) + 1] if eos_token_id in row else row)
    return out
