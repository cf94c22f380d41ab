"""The training workers of a stage: N `TrainWorker` actors (one DeepSpeed rank each) in one
placement group, called together with a timeout (`WorkerGroup`), and the final model written
atomically from them (`save_final_model`)."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

from rlhf_core import atomic
from rlhf_core.runtime import faults
from rlhf_core.runtime.actor import rendezvous_at
from rlhf_core.training.config import TrainConfig

log = logging.getLogger("rlhf.train")


def micro_batches(shard, size: int, total: int, ranks: int) -> list:
    """One rank's `shard` of `total` samples dealt over `ranks`, in contiguous micro-batches of at
    most about `size`.  The count is the same on every rank (ZeRO-2/3 reduce in each backward):
    enough for the largest shard, at most the smallest shard's size so none is empty."""
    largest, smallest = -(-total // ranks), total // ranks
    count = max(1, min(-(-largest // size), smallest))
    cuts = [len(shard) * i // count for i in range(count + 1)]
    return [shard[a:b] for a, b in zip(cuts, cuts[1:])]


STARTUP_TIMEOUT = 600.0
"""Seconds a worker group may take to start (load the model, initialise DeepSpeed)."""


class WorkerGroup:
    """N TrainWorker actors in one placement group (PACK: one bundle per worker).

    `share` < 1 lets other roles use the rest of each bundle (the RL colocated layout passes the
    policy group's `pg` to its critic and to the rollout/reference/reward actors).  `timeout`
    bounds every call and training step, in seconds (rl: `rl.rollout.timeout`): a wedged worker
    becomes a `TimeoutError` naming the call, never a hung job."""

    def __init__(self, cfg: TrainConfig, model_path: str, model_kind: str, *, pad_token_id: int | None = None, share: float = 1.0, pg=None,
                 timeout: float = 3600.0, name: str = "training", timeout_setting: str = "", wait: bool = True):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlhf_core.training.worker import TrainWorker  # heavy: torch; only the Ray actors need it, not this module's other users

        bundle = {"CPU": cfg.cpus_per_worker, **({"GPU": cfg.gpus_per_worker} if cfg.gpus_per_worker else {})}
        self.pg = pg or placement_group([bundle] * cfg.num_workers, strategy=cfg.placement_strategy)
        try:
            ray.get(self.pg.ready(), timeout=300)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"{name}: no room for {cfg.num_workers} bundle(s) of {bundle} placed {cfg.placement_strategy} within 300 s "
                               f"(cluster resources: {ray.cluster_resources()})") from None
        in_bundle = lambda r: PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r)  # noqa: E731
        master = rendezvous_at(self.pg)
        actor = ray.remote(TrainWorker)
        self.workers = [
            actor.options(num_cpus=cfg.cpus_per_worker * share, num_gpus=cfg.gpus_per_worker * share, scheduling_strategy=in_bundle(r)).remote(
                r, cfg.num_workers, master, model_path, model_kind, cfg, pad_token_id)
            for r in range(cfg.num_workers)
        ]
        self.timeout, self.name, self.timeout_setting = timeout, name, timeout_setting
        self.zero3, self.micro = cfg.zero_stage == 3, cfg.micro_batch_size
        self._starting = [w.state_fingerprint.remote() for w in self.workers]
        if wait:
            self.ready()

    def ready(self) -> "WorkerGroup":
        """Wait for start-up (model load, DeepSpeed init): construction errors surface here, not
        mid-step.  `wait=False` lets a caller start other actors meanwhile (rl: the engine's import
        and start overlap the trainers').  A busy machine may take longer than a step's calls."""
        if self._starting is not None:
            self._get(self._starting, "start-up", timeout=max(self.timeout, STARTUP_TIMEOUT))
            self._starting = None
            nodes = self.call("node")
            log.info("%s: %d rank(s) on %d node(s): %s", self.name, len(nodes), len(set(nodes)),
                     ", ".join(f"rank {r} on {n}" for r, n in enumerate(nodes)))
        return self

    def _get(self, refs, what: str, timeout: float | None = None):
        import ray

        timeout = timeout or self.timeout
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            setting = f"{self.timeout_setting}={timeout:g}s" if self.timeout_setting and timeout == self.timeout else f"{timeout:g}s"
            raise TimeoutError(f"{self.name} {what} took longer than {setting}") from None

    def call(self, method: str, *args) -> list:
        return self._get([getattr(w, method).remote(*args) for w in self.workers], method)

    def call_rank0(self, method: str, *args):
        """Rank 0's result; under ZeRO-3 every rank must take part in the forward."""
        if self.zero3:
            return self.call(method, *args)[0]
        return self._get(getattr(self.workers[0], method).remote(*args), method)

    def train_step(self, examples: list[dict], collate, loss_fn, counts: dict, step: int = 0) -> list[dict]:
        import ray

        n, micro = len(self.workers), self.micro or len(examples)  # 0: each rank's whole shard in one pass
        refs = [w.train_step.remote([collate(m) for m in micro_batches(examples[r::n], micro, len(examples), n)], loss_fn, counts)
                for r, w in enumerate(self.workers)]
        faults.kill_worker_during(step, self.workers[0])
        try:
            return self._get(refs, f"train step {step}")
        except ray.exceptions.RayActorError as e:  # OOM kill, node loss, a crashed DeepSpeed rank
            raise RuntimeError(f"a training worker died during step {step}: the stage stops; its checkpoints are complete ones "
                               f"and a rerun resumes from the newest ({type(e).__name__}: {str(e).splitlines()[0]})") from e


def save_final_model(group: WorkerGroup, out_dir: Path, tokenizer, card: str, name: str = "model", extra: dict[str, str] | None = None) -> Path:
    """out_dir/name (default model/) written to a temp dir (HF format + tokenizer + card + `extra`
    files), then renamed into place: a reader never sees half a model."""
    out_dir = out_dir.resolve()
    final, tmp = out_dir / name, out_dir / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    group.call("save_model", str(tmp))
    tokenizer.save_pretrained(tmp)
    (tmp / "README.md").write_text(card)
    for fname, text in (extra or {}).items():
        (tmp / fname).write_text(text)
    return atomic.replace_dir(tmp, final)
