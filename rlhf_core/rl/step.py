"""One RL step on a `RolloutBatch` (docs/architecture.md, "One RL step"): sample -> forwards ->
advantages -> policy (+ critic) updates -> weight sync -> the step's history row and rollout rows."""
from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import replace
from functools import partial

from rlhf_core.rl.advantages import compute_advantages
from rlhf_core.rl.collate import logprobs_fn, token_counts, values_fn
from rlhf_core.rl.config import Config
from rlhf_core.rl.objective import Objective, recompute_old
from rlhf_core.rl.roles import Roles
from rlhf_core.rl.sampling import sample_batch
from rlhf_core.rollout import parquet as rollout_io
from rlhf_core.rollout.batch import RolloutBatch
from rlhf_core.rollout.producer import RolloutProducer
from rlhf_core.training import batching
from rlhf_core.training.chassis import NanGuard, RunState, reduce_ranks
from rlhf_core.training.worker_group import WorkerGroup

log = logging.getLogger("rlhf.rl")


def forward_stats(roles: Roles, cfg: Config, kept: RolloutBatch, collate) -> RolloutBatch:
    """The kept samples with reference log-probs, old log-probs (policy; only if `recompute_old`)
    and values (critic)."""
    batches = batching.batches(collate, kept, cfg.eval_batch_size)
    logprobs = partial(logprobs_fn, temperature=cfg.rollout.temperature)  # the distribution the engine sampled from
    if roles.reference is None:  # LoRA: the policy's base, adapters off
        ref = roles.policy.call_rank0("evaluate_base", batches, logprobs)
    else:
        ref = roles.reference.evaluate.remote(batches, logprobs)
    colocated = cfg.rollout.layout == "colocated"
    if colocated and roles.reference is not None:
        # the roles share the bundle's cores: one forward at a time (two at once oversubscribe them)
        ref = roles.get(ref, "reference forward")
    old = roles.policy.call_rank0("evaluate", batches, logprobs) if recompute_old(cfg) else None
    values = roles.critic.call_rank0("evaluate", batches, values_fn) if roles.critic else None
    ref = ref if colocated or roles.reference is None else roles.get(ref, "reference forward")
    return kept.with_columns(old_logprobs=old, ref_logprobs=ref, old_values=values)


def update(group: WorkerGroup, cfg: Config, batch: RolloutBatch, collate, loss_fn, step: int) -> list[dict]:
    """`ppo_epochs` passes over the samples in mini-batches of global_batch_size (rescaled when
    filtering removed samples); deterministic shuffles."""
    rows, n = [], len(group.workers)
    n_mb = max(1, min(round(cfg.rollout.prompts_per_step * cfg.rollout.n_samples / cfg.global_batch_size), len(batch) // n))
    for epoch in range(cfg.ppo_epochs):
        order = list(range(len(batch)))
        random.Random(cfg.seed * 7919 + step * 31 + epoch).shuffle(order)
        size = math.ceil(len(order) / n_mb)
        for start in range(0, len(order), size):
            mb = batch.select(order[start:start + size])  # >= n samples: every rank gets one
            results = group.train_step(mb, collate, loss_fn, token_counts(mb), step=step)
            rows.append(reduce_ranks(results))
    return rows


def train_on(roles: Roles, cfg: Config, obj: Objective, kept: RolloutBatch, step: int, times: dict) -> tuple[RolloutBatch, dict, bool]:
    """forward -> advantages -> update (policy, then critic) on the kept samples.  Returns (the
    kept samples with their forward and advantage columns, the step's training stats, whether
    every rank skipped the policy update)."""
    tic = time.time()
    kept = forward_stats(roles, cfg, kept, obj.collate)
    o = cfg.objective
    kept, adv_stats = compute_advantages(kept, cfg.algo, kl_coef=obj.kl.value, kl_in_reward=o.kl_mode == "reward", kl_estimator=o.kl_estimator,
                                         gamma=o.gamma, lam=o.lam, whiten_gae=o.whiten_gae, reward_clip=o.reward_clip, kl_clamp=o.kl_clamp,
                                         singleton_group=o.singleton_group)
    times["forward_s"], tic = time.time() - tic, time.time()
    if cfg.rollout.engine_sleep:
        roles.sleep_engines()
    kl_loss_coef = obj.kl.value if o.kl_mode == "loss" else 0.0
    stats = update(roles.policy, cfg, kept, obj.collate, replace(obj.policy_loss, kl_loss_coef=kl_loss_coef), step)
    row = {}
    if roles.critic:
        cstats = update(roles.critic, cfg, kept, obj.collate, obj.critic_loss, step)
        row.update({f"critic/{k}": sum(r[k] for r in cstats) / len(cstats) for k in ("loss", "value_error") if cstats and k in cstats[0]})
    times["update_s"] = time.time() - tic
    row.update({f"train/{k}": sum(r[k] for r in stats) / len(stats) for k in stats[0] if k != "skipped"} if stats else {})
    return kept, {**row, **adv_stats}, any(r.get("skipped") for r in stats)


def sample_stats(batch: RolloutBatch) -> dict:
    """Reward (the one trained on, and the gold one beside it), length and truncation of every
    sample drawn this step."""
    ok = [i for i, why in enumerate(batch.invalid) if not why]
    valid = [batch.reward[i] for i in ok]
    gold = [batch.components[i]["gold"] for i in ok if "gold" in batch.components[i]]
    row = {"train/reward_proxy": sum(valid) / max(1, len(valid)), "train/reward_gold": sum(gold) / len(gold)} if gold else {}
    return {**row, "reward_mean": sum(valid) / max(1, len(valid)), "response_length": float(batch.action_mask.sum()) / len(batch),
            "truncated": sum(f == "length" for f in batch.finish_reason) / len(batch)}


def rl_step_once(roles: Roles, cfg: Config, obj: Objective, producer: RolloutProducer, state: RunState,
                 nan_guard: NanGuard) -> tuple[dict, list[dict]]:
    """One RL step: rollout -> score -> filter (sample_batch) -> forward -> advantages -> update
    (train_on) -> weight sync -> record.  Advances `state`; returns the history row and the
    step's rollout records (every sample drawn, kept or filtered, with its columns)."""
    step = state.step + 1
    times = {"rollout_s": 0.0, "rollout_busy_s": 0.0, "reward_s": 0.0}
    if cfg.offload_trainer:
        roles.offload_trainers(True)  # the engines generate in the memory the trainers held
    samples, invalid, drawn, rounds = sample_batch(roles, cfg, producer, state.step, times)
    if cfg.offload_trainer:
        roles.offload_trainers(False)
    kept_idx = [i for i, f in enumerate(samples.filter) if f == "kept"]
    trained, trained_idx = None, []
    row, kl = {"step": step}, 0.0
    if len(kept_idx) >= len(roles.policy.workers):
        trained, stats, skipped = train_on(roles, cfg, obj, samples.select(kept_idx), step, times)
        trained_idx = kept_idx
        row.update(stats)
        kl = stats["kl"]
        nan_guard.update(skipped, state, step)
    else:
        log.warning("step %d: no sample left after filtering (%d invalid); no update", step, invalid)
    times["sync_s"] = roles.sync_weights(step, producer if cfg.rollout.mode == "async" else None)
    obj.kl.update(kl, len(kept_idx))
    records = step_records(samples, trained_idx, trained, state.extra["run_id"], step)
    state.step, state.consumed = step, state.consumed + drawn
    state.extra["invalid"] += invalid
    state.extra["kl_controller"] = obj.kl.state_dict()
    row.update(sample_stats(samples))
    row.update({"invalid": invalid, "kept": len(kept_idx), "stale": sum(f == "stale" for f in samples.filter),
                "staleness": sum(step - 1 - v for v in samples.policy_version) / len(samples), "prompts_drawn": drawn,
                "sampling_rounds": rounds, "kl_coef": obj.kl.value, "policy_version": step, **times})
    return row, records


def step_records(samples: RolloutBatch, trained_idx: list[int], trained: RolloutBatch | None, run_id: str, step: int) -> list[dict]:
    """The step's rollout rows in drawn order, each built once: the samples at `trained_idx` from
    `trained` (the batch that was trained on them holds their advantages and log-probs), the rest
    from the drawn batch."""
    done = set(trained_idx)
    rest = [i for i in range(len(samples)) if i not in done]
    records: list[dict] = [None] * len(samples)
    for idx, batch in ((trained_idx, trained), (rest, samples.select(rest))):
        if idx:
            for i, record in zip(idx, rollout_io.records(batch, run_id, step)):
                records[i] = record
    return records
