"""The maths of one RL step on a `RolloutBatch`, glued from `rlhf_core.algos` (no Ray, no I/O).

Layout of a sample (a finished episode): `token_ids` = prompt + response, where the response may
interleave model actions with environment feedback; every per-token column of the batch is aligned
with the *response* tokens (`len(token_ids) - prompt_len`) and `action_mask` marks model tokens.

Collated batches place those lists at the positions where a causal LM predicts the token:
response token at absolute position p  <->  logits row p - 1.  So every `(B, T-1)` tensor here
(mask, logprobs, advantages, ...) lines up with `token_logprobs(logits[:, :-1], ids[:, 1:])`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_core.algos.advantages import ALGO_RECIPES, ESTIMATORS, SCORE_BASELINES, keep_singleton_scores
from rlhf_core.algos.aggregation import aggregate, masked_mean, masked_whiten
from rlhf_core.algos.kl import kl_penalty
from rlhf_core.algos.losses import (
    IS_CORRECTIONS,
    POLICY_LOSSES,
    SEQUENCE_LEVEL_IS,
    batch_normalise_is,
    entropy_bonus,
    entropy_from_logits,
    token_logprobs,
    value_loss,
)
from rlhf_core.algos.shaping import kl_shaped_rewards
from rlhf_core.data.tokenize import forward_inputs
from rlhf_core.models.shared_prefix import PACK_MAX_LEN, model_logits, pack_rows
from rlhf_core.rollout.batch import RolloutBatch

# the per-token columns the trainers read
TRAIN_COLUMNS = ("action_mask", "engine_logprobs", "old_logprobs", "ref_logprobs", "old_values", "advantages", "returns")

def compute_advantages(batch: RolloutBatch, algo: str, *, kl_coef: float, kl_in_reward: bool, kl_estimator: str, gamma: float,
                       lam: float, whiten_gae: bool, reward_clip: float | None, kl_clamp: float | None = None,
                       singleton_group: str = "zero") -> tuple[RolloutBatch, dict]:
    """The batch with `advantages`, `returns`, `kl` (per token) and `centred_score`, and the batch's
    stats.  Scores must be finite (invalid samples are removed before this)."""
    recipe = ALGO_RECIPES[algo]
    mask, ref = batch.action_mask, batch.ref_logprobs
    # the behaviour policy's log-probs: the trainer's where the step computed them, else the
    # engine's (the same policy, synced before the rollout; equal in fp32 to ~1e-6)
    old = batch.old_logprobs if batch.old_logprobs is not None else batch.engine_logprobs
    values = batch.old_values if recipe.needs_critic else None
    scores = torch.tensor(batch.score, dtype=torch.float32)
    centred = SCORE_BASELINES[recipe.baseline](scores, torch.tensor(batch.group))
    if singleton_group == "score" and recipe.baseline != "none":
        centred = keep_singleton_scores(centred, scores, torch.tensor(batch.group))
    kl = kl_penalty(old, ref, kl_estimator, kl_clamp) * mask
    token_rewards = kl_shaped_rewards(centred, kl, mask, kl_coef if kl_in_reward else 0.0, reward_clip)
    adv, ret = ESTIMATORS[recipe.estimator](token_rewards, values, mask, gamma, lam)
    if recipe.estimator == "gae" and whiten_gae:
        adv = masked_whiten(adv, mask)
    stats = {"kl": float((kl * mask).sum(-1).mean()), "kl_token": float(masked_mean(kl, mask)),
             "advantage_abs": float(masked_mean(adv.abs(), mask))}
    return batch.with_columns(advantages=adv, returns=ret, kl=kl, centred_score=centred.tolist()), stats


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


@dataclass(frozen=True)
class PolicyObjective:
    """The policy loss of a run, built once from its config (`stages.rl.make_losses`) and shipped
    to the policy workers, which call it as `loss_fn(model, batch, counts)`: the surrogate
    (`POLICY_LOSSES[loss_type]`: ppo / gspo) + optional KL-to-reference term + entropy bonus, all
    on the policy at the sampling `temperature` (logits / T: the distribution the rollouts came
    from, so the ratio to the old and engine log-probs is on-policy at step start).  Aggregated
    with the *global* token/sequence counts of the mini-batch, so the ranks' losses sum to the
    single-process loss.  Each term gets only its own settings, by keyword."""
    loss_type: str
    clip_low: float
    clip_high: float
    dual_clip: float | None
    agg_mode: str
    norm_len: int
    temperature: float = 1.0
    kl_loss_coef: float = 0.0
    """Set per step (the KL controller's value when kl_mode=loss): `dataclasses.replace`."""
    kl_estimator: str = "k3"
    kl_clamp: float | None = None
    entropy_coef: float = 0.0
    is_correction: str | None = None
    is_low: float = 0.5
    is_high: float = 2.0
    is_batch_normalize: bool = False

    def __call__(self, model, batch, counts):
        logits = policy_logits(model, batch)
        if self.temperature != 1.0:
            logits = logits / self.temperature  # once, for the log-probs and the entropy alike
        lp = token_logprobs(logits, batch["input_ids"][:, 1:])
        mask = batch["action_mask"]
        agg = dict(agg_mode=self.agg_mode, num_tokens=counts["num_tokens"], num_seqs=counts["num_seqs"], norm_len=self.norm_len)
        # no old log-probs in the batch: this is the step's only update (on-policy, rl.recompute_old_logprobs),
        # so the policy's own log-probs are the old ones (the ratio is 1, its gradient the policy gradient)
        old = batch["old_logprobs"] if "old_logprobs" in batch else lp.detach()
        is_weights, stats = None, {}
        if self.is_correction:
            is_weights, stats = IS_CORRECTIONS[self.is_correction](old, batch["engine_logprobs"], mask,
                                                                   low=self.is_low, high=self.is_high)
            if self.is_batch_normalize:
                is_weights = batch_normalise_is(is_weights, mask, per_sequence=self.is_correction in SEQUENCE_LEVEL_IS)
        # dual_clip only where set: the config allows it with ppo alone, and gspo has no such knob
        own = {"dual_clip": self.dual_clip} if self.dual_clip is not None else {}
        loss, pstats = POLICY_LOSSES[self.loss_type](lp, old, batch["advantages"], mask, clip_low=self.clip_low,
                                                     clip_high=self.clip_high, is_weights=is_weights, **own, **agg)
        stats.update(pstats)
        if self.kl_loss_coef:
            kl = kl_penalty(lp, batch["ref_logprobs"], self.kl_estimator, self.kl_clamp)
            loss = loss + self.kl_loss_coef * aggregate(kl, mask, self.agg_mode, counts["num_tokens"], counts["num_seqs"], self.norm_len)
            stats["kl_loss"] = masked_mean(kl.detach(), mask)
        if self.entropy_coef:
            ent_loss, estats = entropy_bonus(logits, mask, self.entropy_coef, **agg)
            loss = loss + ent_loss
            stats.update(estats)
        else:
            with torch.no_grad():
                stats["entropy"] = masked_mean(entropy_from_logits(logits), mask)
        return loss, stats


@dataclass(frozen=True)
class CriticObjective:
    """The critic's (clipped) value loss, called by the critic workers as `loss_fn(model, batch, counts)`."""
    value_clip: float | None
    agg_mode: str
    norm_len: int

    def __call__(self, model, batch, counts):
        values = model_logits(model, batch, forward_inputs(batch))[..., 0].float()
        return value_loss(values, batch["old_values"], batch["returns"], batch["action_mask"], clip=self.value_clip, agg_mode=self.agg_mode,
                          num_tokens=counts["num_tokens"], num_seqs=counts["num_seqs"], norm_len=self.norm_len)


def token_counts(batch: RolloutBatch) -> dict:
    """Global counts for loss aggregation over one mini-batch (all ranks)."""
    per_sample = batch.action_mask.sum(-1)
    return {"num_tokens": max(1, int(per_sample.sum())), "num_seqs": max(1, int((per_sample > 0).sum()))}
