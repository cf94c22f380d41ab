"""A `RolloutBatch` as the trainers see it (`RLCollate`) and what their forwards send back
(log-probs, values), plus the loss counts (no Ray, no I/O).

Layout of a sample (a finished episode): `token_ids` = prompt + response, where the response may
interleave model actions with environment feedback; every per-token column of the batch is aligned
with the *response* tokens (`len(token_ids) - prompt_len`) and `action_mask` marks model tokens.

Collated batches place those lists at the positions where a causal LM predicts the token:
response token at absolute position p  <->  logits row p - 1.  So every `(B, T-1)` tensor here
(mask, logprobs, advantages, ...) lines up with `token_logprobs(logits[:, :-1], ids[:, 1:])`.
"""
from __future__ import annotations

import torch

from rlhf_core.algos.losses import token_logprobs
from rlhf_core.data.tokenize import forward_inputs
from rlhf_core.models.shared_prefix import PACK_MAX_LEN, model_logits, pack_rows
from rlhf_core.rollout.batch import RolloutBatch

# the per-token columns the trainers read
TRAIN_COLUMNS = ("action_mask", "engine_logprobs", "old_logprobs", "ref_logprobs", "old_values", "advantages", "returns")


class RLCollate:
    """A RolloutBatch -> padded tensors for the workers (see the module doc for the alignment);
    with `vision` (a VLM), also the `pixel_values` of the samples' images.  With `shared_prefix`
    (`rl.shared_prefix`, text models) the batch also carries the packed forward inputs in which a
    prompt's samples share one copy of it (`shared_prefix.pack_rows`), when that saves tokens."""

    def __init__(self, pad_id: int, keys: tuple[str, ...] = TRAIN_COLUMNS, vision=None, shared_prefix: bool = False):
        self.pad_id, self.keys, self.vision = pad_id, keys, vision
        self.shared_prefix = shared_prefix and vision is None  # a VLM's pixels follow the unpacked ids

    def __call__(self, batch: RolloutBatch) -> dict:
        T = max(len(t) for t in batch.token_ids)
        B = len(batch)
        ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        attn = torch.zeros(B, T, dtype=torch.long)
        out = {k: torch.zeros(B, T - 1) for k in self.keys if getattr(batch, k) is not None}
        for i, (tokens, p) in enumerate(zip(batch.token_ids, batch.prompt_len)):
            n = len(tokens)
            ids[i, :n] = torch.tensor(tokens)
            attn[i, :n] = 1
            for k in out:
                out[k][i, p - 1 : n - 1] = getattr(batch, k)[i, : n - p]
        out.update(input_ids=ids, attention_mask=attn, prompt_len=torch.tensor(batch.prompt_len),
                   length=torch.tensor([len(t) for t in batch.token_ids]))
        if self.shared_prefix:
            out.update(pack_rows(batch.token_ids, batch.prompt_len, self.pad_id, PACK_MAX_LEN) or {})
        if self.vision is not None and batch.images:
            out["pixel_values"] = self.vision.pixel_values([ref for refs in batch.images for ref in refs])
        if self.vision is not None:  # the engines never sample it; the trainers' distribution must not have it either
            out["suppressed_ids"] = torch.tensor([self.vision.image_token_id])
        return out


def policy_logits(model, batch) -> torch.Tensor:
    """`(B, T-1, V)` float32 logits of the next token at every position, with the ids the engines
    never sample (a VLM's image placeholder: `suppressed_ids`) pushed to -1e9, so the trainers'
    log-probs are of the very distribution the engine sampled from."""
    logits = model_logits(model, batch, forward_inputs(batch)).float()
    if batch.get("suppressed_ids") is not None:
        logits = logits.index_fill(-1, batch["suppressed_ids"], -1e9)  # finite: 0 * log p stays 0 in the entropy
    return logits


def _slices(t: torch.Tensor, batch: dict) -> list[list[float]]:
    """`(B, T-1)` -> each sample's response-aligned values (float32's, exactly, as Python floats):
    what crosses back to the driver.  Lists, not one small tensor per sample: Ray serialises a
    list of 512 tensors in ~70 ms and of 512 float lists in ~2 ms (measured, docs/benchmarks.md)."""
    t = t.float().cpu()
    return [t[i, p - 1 : n - 1].tolist() for i, (p, n) in enumerate(zip(batch["prompt_len"].tolist(), batch["length"].tolist()))]


# --- run inside the workers (pickled by reference) -----------------------------------------


def logprobs_fn(model, batch, temperature: float = 1.0) -> list[list[float]]:
    """Each sample's response-token log-probs under `model` at the sampling `temperature` (old /
    reference log-probs): the distribution the engine sampled from, whose log-probs it reports."""
    logits = policy_logits(model, batch)
    return _slices(token_logprobs(logits, batch["input_ids"][:, 1:], temperature), batch)


def values_fn(model, batch) -> list[list[float]]:
    """Critic values V(s_t) before each response token (token-classification head, 1 label)."""
    values = model_logits(model, batch, forward_inputs(batch))[..., 0].float()
    return _slices(values, batch)


def token_counts(batch: RolloutBatch) -> dict:
    """Global counts for loss aggregation over one mini-batch (all ranks)."""
    per_sample = batch.action_mask.sum(-1)
    return {"num_tokens": max(1, int(per_sample.sum())), "num_seqs": max(1, int((per_sample > 0).sum()))}
