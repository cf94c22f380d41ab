"""Rows -> token ids, and padded batches.  Prompts are tokenized alone (with BOS) and responses
without special tokens plus EOS, so training sees exactly the ids generation will produce."""
from __future__ import annotations

import torch


class TooLong(ValueError):
    pass


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template, with the generation prompt.
    A plain list whatever the transformers version: since 5.x `apply_chat_template(tokenize=True)`
    returns a BatchEncoding by default, and `prompt + response` on one raised TypeError."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("rows use chat 'messages' but the tokenizer has no chat template; give prompt,response rows or a tokenizer with one")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if hasattr(out, "keys"):  # a version that ignores return_dict=False
        out = out["input_ids"]
    return [int(t) for t in out]


def prompt_ids(tokenizer, row: dict) -> list[int]:
    """Prompt token ids; chat rows (`messages`) go through the tokenizer's chat template."""
    if "messages" in row and "prompt" not in row:
        return chat_ids(tokenizer, row["messages"][:-1])
    return tokenizer(row["prompt"]).input_ids


def response_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]


def prompt_response(tokenizer, prompt: list[int], response_text: str, max_len: int) -> dict:
    """{input_ids, loss_mask}: loss on the response tokens (and EOS) only."""
    resp = response_ids(tokenizer, response_text)
    if len(prompt) + len(resp) > max_len:
        raise TooLong(f"{len(prompt) + len(resp)} tokens, over max_len={max_len}")
    return {"input_ids": prompt + resp, "loss_mask": [0] * len(prompt) + [1] * len(resp)}


def pad_batch(examples: list[dict], pad_id: int, keys=("input_ids", "loss_mask")) -> dict[str, torch.Tensor]:
    """Right-pad lists of ids to the longest example; adds `attention_mask`."""
    width = max(len(e["input_ids"]) for e in examples)
    out = {}
    for key in keys:
        fill = pad_id if key == "input_ids" else 0
        out[key] = torch.tensor([e[key] + [fill] * (width - len(e[key])) for e in examples], dtype=torch.long)
    out["attention_mask"] = torch.tensor([[1] * len(e["input_ids"]) + [0] * (width - len(e["input_ids"])) for e in examples], dtype=torch.long)
    return out


def forward_inputs(batch: dict) -> dict:
    """The model's inputs in a collated batch: ids and mask, and a VLM's `pixel_values` when the
    batch has images (one row per image, in the order of the ids' image tokens)."""
    out = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if batch.get("pixel_values") is not None:
        out["pixel_values"] = batch["pixel_values"]
    return out


def tokenize_rows(rows: list[dict], fn, max_len: int) -> tuple[list[dict], list[dict]]:
    """Apply `fn(row) -> example`; rows over max_len become rejects with a reason (never dropped silently)."""
    examples, rejects = [], []
    for i, row in enumerate(rows):
        try:
            examples.append({**fn(row), "row_index": i})
        except TooLong as e:
            rejects.append({"row_index": i, "id": row.get("id"), "reason": str(e)})
    return examples, rejects


def pack_documents(docs: list[list[int]], seq_len: int, seed: int) -> tuple[list[dict], int]:
    """Causal-LM packing: documents (token ids, BOS/EOS included) in a seeded order, concatenated
    and cut into `seq_len` windows `{input_ids, loss_mask}` (loss on every token; a window may
    span documents, as in GPT-style pretraining).  Returns (windows, tokens dropped at the end)."""
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    stream = [t for i in order for t in docs[i]]
    n = len(stream) // seq_len
    windows = [{"input_ids": stream[k * seq_len:(k + 1) * seq_len], "loss_mask": [1] * seq_len} for k in range(n)]
    return windows, len(stream) - n * seq_len
