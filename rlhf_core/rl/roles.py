"""The RL run's actors: policy (+ critic) trainers, reference, rollout engines and the reward
worker, placed per `rl.rollout.layout`; weight sync from the policy into the engines."""
from __future__ import annotations

import logging
import os
import resource
import time
from dataclasses import replace
from pathlib import Path

from rlhf_core.algos.advantages import ALGO_RECIPES
from rlhf_core.rl.config import Config
from rlhf_core.rollout.producer import RolloutProducer
from rlhf_core.rollout.rewards import selected_sources, source_weights
from rlhf_core.rollout.workers import ForwardWorker, RewardWorker, RolloutWorker
from rlhf_core.runtime.actor import rendezvous_at
from rlhf_core.runtime.weight_sync import backend_for
from rlhf_core.training.worker_group import WorkerGroup

log = logging.getLogger("rlhf.rl")


def check_separate_resources(cfg: Config, with_critic: bool) -> None:
    """layout=separate: the cluster must have the CPUs every role asks for."""
    import ray

    ro = cfg.rollout
    need = cfg.num_workers * cfg.cpus_per_worker * (1 + with_critic) + ro.workers * ro.cpus + 0.5
    resources = ray.cluster_resources()
    have = resources.get("CPU", 0)
    if ro.resource and resources.get(ro.resource, 0) < ro.workers:
        raise RuntimeError(f"rl.rollout.resource={ro.resource}: the cluster has {resources.get(ro.resource, 0):g} "
                           f"of it, the {ro.workers} rollout engine(s) need one each (start nodes with "
                           f"`ray start --resources='{{\"{ro.resource}\": N}}'`)")
    if need > have:
        critic = " x2 with the critic" if with_critic else ""
        raise RuntimeError(f"rl.rollout.layout=separate needs {need:g} CPUs (trainers {cfg.num_workers}x{cfg.cpus_per_worker:g}{critic}, "
                           f"rollout {ro.workers}x{ro.cpus:g}, reference + reward 0.5) but the cluster has {have:g}; "
                           f"lower rl.rollout.cpus / rl.cpus_per_worker or use rl.rollout.layout=colocated")


def reward_actor(cfg: Config, placement: dict, pad_id: int, threads: int):
    """The reward actor with every configured source (`rollout.rewards.REWARD_SOURCES`; the
    built-in exact match when none is)."""
    import ray

    return ray.remote(RewardWorker).options(**placement).remote(sources=selected_sources(cfg, pad_id), weights=source_weights(cfg),
                                                                threads=threads)


class Roles:
    """Policy (+ critic) trainers, reference, rollout and reward actors, placed per `layout`."""

    def __init__(self, cfg: Config, model_path: str, pad_id: int):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        with_critic = ALGO_RECIPES[cfg.algo].needs_critic
        ro = cfg.rollout
        colocated = ro.layout == "colocated"
        n_roles = 4 + with_critic  # policy, (critic), reference, rollout, reward share a bundle when colocated
        share = 1.0 / n_roles if colocated else 1.0
        bounded = dict(timeout=ro.timeout, timeout_setting="rl.rollout.timeout")  # every call and train step
        # every role starts at once, waited for together below: the trainers' start (DeepSpeed) and
        # the engine's (vLLM's import and init) overlap instead of running one after the other
        self.policy = WorkerGroup(cfg, model_path, "causal_lm", pad_token_id=pad_id, share=share, name="policy", wait=False, **bounded)
        self.critic = WorkerGroup(replace(cfg, lr=cfg.objective.critic_lr), model_path, "value", pad_token_id=pad_id, share=share,
                                  pg=self.policy.pg if colocated else None, name="critic", wait=False, **bounded) if with_critic else None

        if not colocated:
            check_separate_resources(cfg, with_critic)

        def place(i: int, cpus: float, gpus: float, resources: dict | None = None) -> dict:
            if colocated:
                b = i % cfg.num_workers
                return dict(num_cpus=cfg.cpus_per_worker * share, num_gpus=cfg.gpus_per_worker * share,
                            scheduling_strategy=PlacementGroupSchedulingStrategy(self.policy.pg, placement_group_bundle_index=b))
            return dict(num_cpus=cpus, num_gpus=gpus, resources=resources or {})

        env = {"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}}
        # torch threads per role: colocated roles take turns on the bundle's CPUs (a step's phases
        # run one after the other), so each uses all of them; separate ones use their own share
        threads = max(1, int(cfg.cpus_per_worker)) if colocated else max(1, int(ro.cpus))
        # LoRA: the reference is the policy's base with its adapters off (`evaluate_base`), no copy
        self.reference = None if cfg.lora_rank else ray.remote(ForwardWorker).options(**place(0, 0.25, ro.gpus)).remote(
            model_path, cfg.dtype, cfg.trust_remote_code, threads if colocated else 1)
        # partial rollouts: weight syncs in a thread of their own, beside the round being generated
        self.sync_group = RolloutWorker.SYNC_GROUP if ro.partial_rollout_tokens > 0 else None
        actor = ray.remote(concurrency_groups={self.sync_group: 1})(RolloutWorker) if self.sync_group else ray.remote(RolloutWorker)
        self.rollout = [
            actor.options(**place(i, ro.cpus, ro.gpus, {ro.resource: 1} if ro.resource else None), runtime_env=env).remote(
                engine=ro.engine, model_path=model_path, max_len=cfg.max_len, seed=cfg.seed + i, agent=ro.agent,
                agent_file=ro.agent_file and str(Path(ro.agent_file).resolve()), env_timeout=ro.env_timeout, max_turns=ro.max_turns,
                dtype=cfg.dtype, gpu_memory_utilization=ro.gpu_memory_utilization, sleep=ro.engine_sleep and ro.engine_sleep_level,
                trust_remote_code=cfg.trust_remote_code, threads=threads, segment=ro.partial_rollout_tokens, tensor_parallel=ro.tensor_parallel)
            for i in range(ro.workers)
        ]
        # a reward model computes on a GPU where the engines have them; a reward file or URL needs none
        self.reward = reward_actor(cfg, place(0, 0.25, ro.gpus if cfg.reward.model else 0.0), pad_id, threads if colocated else 1)
        self.timeout, self.collective = ro.timeout, False
        # surface construction errors (bad model path, missing reward file, engine start-up) now
        others = [self.reward] + ([self.reference] if self.reference else [])
        self.get([w.ready.remote() for w in self.rollout + others], "starting the rollout/reward/reference actors")
        log.info("rollout engines on %s", ", ".join(self.get([w.node.remote() for w in self.rollout], "placement")))
        for group, _ in self.trainers():
            group.ready()
        if ro.weight_sync == "collective":
            self.join_weight_group(cfg)

    def join_weight_group(self, cfg: Config) -> None:
        """Trainer rank 0 and every engine form the weight-sync group (rl.rollout.weight_sync=collective),
        its address on rank 0's node; the engines learn the weights' layout once."""
        host, port = rendezvous_at(self.policy.pg)
        layout = self.policy.call("weight_layout")[0]
        world = 1 + len(self.rollout)
        backend = backend_for(self.get([a.device_id.remote() for a in [self.policy.workers[0], *self.rollout]], "device ids"))
        self.get([self.policy.workers[0].join_weight_group.remote(host, port, world, self.timeout, backend)]
                 + [w.join_weight_group.remote(host, port, i + 1, world, self.timeout, backend, layout) for i, w in enumerate(self.rollout)],
                 "joining the weight-sync group")
        self.collective = True
        log.info("weight sync: trainer rank 0 broadcasts to %d engine(s) over %s (%s:%d)", len(self.rollout), backend, host, port)

    def get(self, refs, what: str):
        import ray

        try:
            return ray.get(refs, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"{what} took longer than rl.rollout.timeout={self.timeout}s") from None

    def trainers(self) -> list[tuple[WorkerGroup, str]]:
        """The trained groups, each with its subdirectory in a checkpoint."""
        return [(self.policy, "policy")] + ([(self.critic, "critic")] if self.critic else [])

    def load_checkpoint(self, path: Path) -> None:
        for group, sub in self.trainers():
            group.call("load_checkpoint", str(path / sub))

    def peak_memory(self) -> dict:
        """Peak resident memory (MiB) of each role's processes, and of this driver."""
        groups = {"policy": self.policy.workers, "critic": self.critic.workers if self.critic else [],
                  "reference": [self.reference] if self.reference else [],
                  "rollout": self.rollout, "reward": [self.reward]}
        out = {f"mem/peak_mb_{role}": max(self.get([a.peak_rss_mb.remote() for a in actors], "memory report"))
               for role, actors in groups.items() if actors}
        out["mem/peak_mb_driver"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return out

    def offload_trainers(self, offload: bool) -> None:
        """rl.offload_trainer: the trainers' states to CPU memory (True) or back (False)."""
        for group, _ in self.trainers():
            group.call("offload_states" if offload else "reload_states")

    def sleep_engines(self) -> None:
        """Colocated layout: let the engines free their memory while the trainers update."""
        self.get([w.sleep.remote() for w in self.rollout], "engine sleep")

    def sync_weights(self, version: int, producer: RolloutProducer | None = None) -> float:
        """Policy weights -> every engine, in place.  Returns seconds.  With a `producer` (async
        mode) the engines' calls are queued behind the rounds they are generating and not waited
        for: the trainer goes on (the producer checks them later)."""
        import ray

        if self.collective:
            return self.broadcast_weights(version)
        t0 = time.time()
        weights = self.get([w.named_weights.remote() for w in self.policy.workers], "reading policy weights")[0]
        ref = ray.put(weights)
        if producer is not None:
            calls = [w.update_weights.options(concurrency_group=self.sync_group) if self.sync_group else w.update_weights for w in self.rollout]
            producer.synced([call.remote(ref, version) for call in calls])
            return time.time() - t0
        self.get([w.wake_up.remote() for w in self.rollout], "engine wake-up")
        self.get([w.update_weights.remote(ref, version) for w in self.rollout], "weight sync")
        return time.time() - t0

    def broadcast_weights(self, version: int) -> float:
        """rl.rollout.weight_sync=collective: trainer rank 0 broadcasts, every engine receives and loads."""
        t0 = time.time()
        self.get([w.wake_up.remote() for w in self.rollout], "engine wake-up")
        receiving = [w.receive_weights.remote(version) for w in self.rollout]
        self.get([w.broadcast_weights.remote() for w in self.policy.workers] + receiving, "weight sync (broadcast)")
        return time.time() - t0
