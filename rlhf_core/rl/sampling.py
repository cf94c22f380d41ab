"""A step's samples: rounds from the rollout producer, scored by the reward worker (invalid ones
marked, never 0.0), DAPO's dynamic sampling and overlong penalty, async staleness."""
from __future__ import annotations

import logging
import time

import torch

from rlhf_core.algos.shaping import dynamic_sampling_filter, overlong_penalty
from rlhf_core.rl.config import Config
from rlhf_core.rl.roles import Roles
from rlhf_core.rollout.batch import RolloutBatch
from rlhf_core.rollout.producer import RolloutProducer

log = logging.getLogger("rlhf.rl")


def score(roles: Roles, cfg: Config, batch: RolloutBatch) -> tuple[RolloutBatch, int]:
    return apply_rewards(cfg, batch, roles.get(roles.reward.score.remote(batch.reward_inputs()), "reward"))


def apply_rewards(cfg: Config, batch: RolloutBatch, scored: list[dict]) -> tuple[RolloutBatch, int]:
    """The batch with rewards, penalties and the invalid ones marked (`filter = invalid`, never
    scored 0), and the number of invalid samples.  Raises above `rl.reward.max_invalid_ratio`."""
    rw = cfg.reward
    reasons = [r["invalid"] for r in scored]
    lengths = batch.action_mask.sum(-1)
    components, scores = [dict(r["components"]) for r in scored], []
    for i, r in enumerate(scored):
        penalty = 0.0
        if rw.overlong_buffer and not r["invalid"]:
            penalty = float(overlong_penalty(lengths[i:i + 1], cfg.rollout.max_new_tokens * batch.turns[i], rw.overlong_buffer,
                                             rw.overlong_penalty)[0])
            components[i]["overlong_penalty"] = penalty
        scores.append(r["score"] + penalty)
    invalid = sum(1 for x in reasons if x)
    if invalid:
        log.warning("%d of %d samples have an invalid reward (dropped): %s", invalid, len(batch), sorted({x for x in reasons if x})[:3])
    batch = batch.with_columns(reward=[r["score"] for r in scored], components=components, invalid=reasons, score=scores,
                               filter=["invalid" if x else f for x, f in zip(reasons, batch.filter)])
    if invalid / len(batch) > rw.max_invalid_ratio:
        raise RuntimeError(f"{invalid} of {len(batch)} samples have an invalid reward, above rl.reward.max_invalid_ratio={rw.max_invalid_ratio}: "
                           f"{sorted({x for x in reasons if x})[:3]}")
    return batch, invalid


def apply_dynamic_sampling(batch: RolloutBatch) -> RolloutBatch:
    """Kept groups whose scores are all equal become `zero_variance_group` (DAPO)."""
    kept = [i for i, f in enumerate(batch.filter) if f == "kept"]
    if not kept:
        return batch
    keep = dynamic_sampling_filter(torch.tensor([batch.score[i] for i in kept]), torch.tensor([batch.group[i] for i in kept]))
    filters = list(batch.filter)
    for i, k in zip(kept, keep.tolist()):
        if not k:
            filters[i] = "zero_variance_group"
    return batch.with_columns(filter=filters)


def sample_batch(roles: Roles, cfg: Config, producer: RolloutProducer, version: int, times: dict) -> tuple[RolloutBatch, int, int, int]:
    """One step's samples: rounds of `prompts_per_step` prompts (the next in the seeded data order)
    x `n_samples` from the producer, scored.  In async mode a sample generated more than
    `max_staleness` versions before `version` (the trainer's) is dropped unscored (`stale`).  With
    DAPO dynamic sampling (Yu et al. 2025, §3.2) groups whose scores are all equal are filtered out
    (`zero_variance_group`) and further rounds are taken until `prompts_per_step` groups are kept,
    for at most `dynamic_sampling_rounds` rounds; kept groups beyond the batch are marked `surplus`
    (DAPO trims to the batch size).  Every drawn prompt counts as consumed, so a resume replays the
    same rounds.  Returns (samples of every round, invalid count, prompts drawn, rounds)."""
    ro, dynamic = cfg.rollout, cfg.objective.dynamic_sampling
    rounds_out, invalid, drawn, rounds = [], 0, 0, 0
    while rounds < (cfg.objective.dynamic_sampling_rounds if dynamic else 1):
        rounds += 1
        rnd, waited = producer.take()
        batch = mark_stale(rnd.batch, version, ro.max_staleness) if ro.mode == "async" else rnd.batch
        drawn += ro.prompts_per_step
        times["rollout_s"] += waited
        times["rollout_busy_s"] += rnd.busy_s
        tic = time.time()
        batch, bad = score(roles, cfg, batch)
        invalid += bad
        times["reward_s"] += time.time() - tic
        if not dynamic:
            rounds_out.append(batch)
            break
        rounds_out.append(apply_dynamic_sampling(batch))
        if len({g for b in rounds_out for g, f in zip(b.group, b.filter) if f == "kept"}) >= ro.prompts_per_step:
            break
    samples = RolloutBatch.concat(rounds_out)
    if dynamic:
        groups = sorted({g for g, f in zip(samples.group, samples.filter) if f == "kept"})
        batch_groups = set(groups[:ro.prompts_per_step])
        samples = samples.with_columns(filter=["surplus" if f == "kept" and g not in batch_groups else f
                                               for g, f in zip(samples.group, samples.filter)])
        if len(groups) < ro.prompts_per_step:
            log.warning("dynamic sampling: %d of %d groups kept after %d rounds (rl.objective.dynamic_sampling_rounds); training on them",
                        len(groups), ro.prompts_per_step, rounds)
    return samples, invalid, drawn, rounds


def mark_stale(batch: RolloutBatch, version: int, max_staleness: int) -> RolloutBatch:
    """Samples generated more than `max_staleness` policy versions before `version` become `stale`
    (dropped and counted, never trained on)."""
    return batch.with_columns(filter=["stale" if version - v > max_staleness else f for v, f in zip(batch.policy_version, batch.filter)])
