"""Shared-prompt forwards: the samples of one prompt computed with the prompt once.

GRPO-style steps sample n responses per prompt, and every trainer forward (reference and old
log-probs, critic values, the update) used to run the prompt n times, padded to the batch's
longest sample.  On the default task the prompt is ~2/3 of a sample, so most of those FLOPs
computed the same hidden states n times.

A causal LM's prompt states do not depend on what follows, so a group of samples with the same
prompt `P` and responses `r_1..r_k` packs into one row

    P[:-1] | P[-1] r_1 | P[-1] r_2 | ... | P[-1] r_k | pad

with a mask that lets each segment see the shared part and itself (causally) only, and position
ids that restart every segment at `len(P) - 1`.  Each segment repeats the prompt's last token
because its logits predict the response's first token.  The logits of every response position
are then those of the unpacked sample (up to float summation order), and so are the gradients:
the shared prompt states receive the sum of the k samples' gradients, as k copies would.

`pack_rows` builds the packed row(s) and an index that scatters the packed logits back into the
usual `(B, T-1)` layout (`rlhf_core/rl/collate.py`'s module doc), so every loss and statistic downstream is
unchanged: only the forward is packed.  A group longer than `max_len` goes into several rows
(each with its own copy of the prompt).  No Ray, no I/O.
"""
from __future__ import annotations

import torch

# a packed row's longest length (tokens): a prompt's samples beyond it go into another row, so the
# (rows, 1, L, L) attention mask stays small when responses are long
PACK_MAX_LEN = 4096


def pack_rows(token_ids: list[list[int]], prompt_len: list[int], pad_id: int, max_len: int) -> dict | None:
    """The packed forward inputs of samples `token_ids` (prompt + response, `prompt_len[i]` prompt
    tokens each), or None when packing saves no tokens (no two samples share a prompt).

    Returns `pack_input_ids`, `pack_position_ids` (R, L) long, `pack_mask` (R, 1, L, L) bool
    (True: may attend), and `pack_index` (N,) / `pack_target` (N, 2): packed flat position
    `pack_index[j]` holds the logits of sample `pack_target[j, 0]`'s position `pack_target[j, 1]`
    in the unpacked `(B, T-1)` layout, for every response position of every sample."""
    groups: dict[tuple, list[int]] = {}
    for i, (tokens, p) in enumerate(zip(token_ids, prompt_len)):
        groups.setdefault(tuple(tokens[:p]), []).append(i)
    rows: list[tuple[tuple, list[int]]] = []  # (prompt, samples of one packed row)
    for prompt, members in groups.items():
        length, current = len(prompt) - 1, []
        for i in members:
            seg = len(token_ids[i]) - len(prompt) + 1
            if current and length + seg > max_len:
                rows.append((prompt, current))
                length, current = len(prompt) - 1, []
            current.append(i)
            length += seg
        rows.append((prompt, current))
    lengths = [len(prompt) - 1 + sum(len(token_ids[i]) - len(prompt) + 1 for i in members) for prompt, members in rows]
    L = max(lengths)
    if len(rows) * L >= len(token_ids) * max(len(t) for t in token_ids):
        return None
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    pos = torch.zeros(len(rows), L, dtype=torch.long)
    seg_of = torch.full((len(rows), L), -1, dtype=torch.long)  # 0: the shared prompt, k: segment k, -1: padding
    index, target = [], []
    for r, (prompt, members) in enumerate(rows):
        shared = len(prompt) - 1
        ids[r, :shared] = torch.tensor(prompt[:-1], dtype=torch.long)
        pos[r, :shared] = torch.arange(shared)
        seg_of[r, :shared] = 0
        start = shared
        for k, i in enumerate(members, start=1):
            seg = token_ids[i][shared:]  # P[-1] then the response
            end = start + len(seg)
            ids[r, start:end] = torch.tensor(seg, dtype=torch.long)
            pos[r, start:end] = torch.arange(shared, shared + len(seg))
            seg_of[r, start:end] = k
            # logits at packed start + j predict response token j: the unpacked position prompt_len - 1 + j
            for j in range(len(seg) - 1):
                index.append(r * L + start + j)
                target.append((i, shared + j))
            start = end
    return {"pack_input_ids": ids, "pack_position_ids": pos, "pack_mask": segment_mask(seg_of),
            "pack_index": torch.tensor(index, dtype=torch.long), "pack_target": torch.tensor(target, dtype=torch.long).view(-1, 2)}


def segment_mask(seg_of: torch.Tensor) -> torch.Tensor:
    """(R, L) segment ids (0 shared, k >= 1 a segment, -1 padding) -> (R, 1, L, L) bool mask:
    causal, and a query sees the shared part and its own segment.  Padding sees itself only, so
    no softmax row is empty (an all-masked row would be NaN, and NaN * 0 is not 0)."""
    L = seg_of.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    q, k = seg_of[:, :, None], seg_of[:, None, :]
    visible = (k == 0) | (k == q)
    mask = causal & visible & (q != -1)
    mask |= torch.eye(L, dtype=torch.bool)
    return mask[:, None]


def attention_mask(model, allowed: torch.Tensor) -> torch.Tensor:
    """The custom 4D mask in the form `model`'s attention takes it, as transformers builds its own:
    bool for sdpa / flash / flex (whatever the query dtype, so bf16 autocast works), an additive
    float mask in the weights' dtype for eager attention (which adds it to the scores)."""
    hf = getattr(model, "module", model)  # a DeepSpeed engine wraps the HF model
    if getattr(getattr(hf, "config", None), "_attn_implementation", "eager") != "eager":
        return allowed
    dtype = next(p.dtype for p in hf.parameters() if p.is_floating_point())
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def unpack_logits(packed: torch.Tensor, batch: dict) -> torch.Tensor:
    """Packed (R, L, V) logits -> the unpacked `(B, T-1, V)` layout: response positions carry
    their sample's logits, every other position zeros (masked out downstream; finite)."""
    B, T = batch["input_ids"].shape
    out = packed.new_zeros(B, T - 1, packed.shape[-1])
    target = batch["pack_target"]
    return out.index_put((target[:, 0], target[:, 1]), packed.reshape(-1, packed.shape[-1])[batch["pack_index"]])


def model_logits(model, batch: dict, inputs: dict) -> torch.Tensor:
    """`model`'s `(B, T-1, ...)` output logits for a collated batch: through the packed rows when
    the collate packed it (`pack_rows`), else the plain padded forward (`inputs`)."""
    if "pack_index" not in batch:
        return model(**inputs).logits[:, :-1]
    packed = model(input_ids=batch["pack_input_ids"], attention_mask=attention_mask(model, batch["pack_mask"]),
                   position_ids=batch["pack_position_ids"]).logits
    return unpack_logits(packed, batch)
