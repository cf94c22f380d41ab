"""The supervised training loop shared by sft, rm and dpo (the stage supplies data and maths).

Driver side of a Ray job: places `num_workers` TrainWorker actors in a placement group, feeds
them deterministic global batches, checkpoints atomically, resumes exactly, evaluates, and
writes the final model.  Exactness of resume rests on: a data order that is a pure function of
(seed, epoch) and the consumed-sample counter; engine + RNG state in every checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from rlhf_core.runtime import faults, stage_lock
from rlhf_core.training import checkpoint as ckpt
from rlhf_core.training.config import TrainConfig

log = logging.getLogger("rlhf.train")


class ResumeError(RuntimeError):
    """A resume that would skip, replay or train nothing."""


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def take(n: int, seed: int, consumed: int, k: int) -> list[int]:
    """Indices of samples consumed..consumed+k-1 in the endless sequence of seeded epochs."""
    out = []
    while len(out) < k:
        epoch, offset = divmod(consumed + len(out), n)
        out.extend(epoch_order(n, seed, epoch)[offset : offset + k - len(out)])
    return out


@dataclass
class StageSpec:
    """What a stage hands to the loop."""
    name: str
    model_path: str
    model_kind: str  # "causal_lm" | "reward"
    examples: list[dict]
    collate: Callable[[list[dict]], dict]
    loss_fn: Callable
    counts: Callable[[list[dict]], dict]
    evaluate: Callable[["WorkerGroup"], dict]
    data_fingerprint: str
    pad_token_id: int | None = None
    extra_state: dict = field(default_factory=dict)
    before_train: Callable[["WorkerGroup"], None] | None = None
    """Runs once the workers hold the *starting* weights, before any checkpoint is loaded
    (DPO computes its reference log-probs here)."""
    upstream: tuple[str, ...] = ()
    """Further inputs the training depends on besides `cfg.model_path` and the training data (rl:
    the reward model, reward file, agent file): a checkpoint built from others is not resumed."""


STARTUP_TIMEOUT = 600.0
"""Seconds a worker group may take to start (load the model, initialise DeepSpeed)."""


class WorkerGroup:
    """N TrainWorker actors in one placement group (PACK: one bundle per worker).

    `share` < 1 lets other roles use the rest of each bundle (the RL colocated layout passes the
    policy group's `pg` to its critic and to the rollout/reference/reward actors).  `timeout`
    bounds every call and training step, in seconds (rl: `rl.rollout_timeout`): a wedged worker
    becomes a `TimeoutError` naming the call, never a hung job."""

    def __init__(self, spec: StageSpec, cfg: TrainConfig, share: float = 1.0, pg=None, model_kind: str | None = None,
                 timeout: float = 3600.0, name: str = "training", timeout_setting: str = ""):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlhf_core.runtime.cluster import free_port
        from rlhf_core.runtime.worker import TrainWorker

        bundle = {"CPU": cfg.cpus_per_worker, **({"GPU": cfg.gpus_per_worker} if cfg.gpus_per_worker else {})}
        self.pg = pg or placement_group([bundle] * cfg.num_workers, strategy="PACK")
        ray.get(self.pg.ready(), timeout=300)
        port = free_port()
        actor = ray.remote(TrainWorker)
        self.workers = [
            actor.options(num_cpus=cfg.cpus_per_worker * share, num_gpus=cfg.gpus_per_worker * share,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r)).remote(
                r, cfg.num_workers, port, spec.model_path, model_kind or spec.model_kind, cfg, spec.pad_token_id)
            for r in range(cfg.num_workers)
        ]
        self.timeout, self.name, self.timeout_setting = timeout, name, timeout_setting
        # surfaces construction errors now, not mid-step; start-up (model load, DeepSpeed init) on a
        # busy machine may take longer than a step's calls are allowed
        self._get([w.state_fingerprint.remote() for w in self.workers], "start-up", timeout=max(timeout, STARTUP_TIMEOUT))
        self.zero3 = cfg.zero_stage == 3

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

        n = len(self.workers)
        refs = [w.train_step.remote(collate(examples[r::n]), loss_fn, counts) for r, w in enumerate(self.workers)]
        faults.kill_worker_during(step, self.workers[0])
        try:
            return self._get(refs, f"train step {step}")
        except ray.exceptions.RayActorError as e:  # OOM kill, node loss, a crashed DeepSpeed rank
            raise RuntimeError(f"a training worker died during step {step}: the stage stops; its checkpoints are complete ones "
                               f"and a rerun resumes from the newest ({type(e).__name__}: {str(e).splitlines()[0]})") from e


# settings that may change between a run and its resume; anything else makes it a new run
RESUMABLE_CHANGES = {"max_steps": 1, "save_steps": 1, "eval_steps": 0, "log_steps": 1, "resume": True, "keep_checkpoints": 1}


def upstream_digest(path: str) -> str:
    """sha256 of what `path` is now: an artifact of this pipeline by its manifest's hash (which
    changes whenever its stage reran), other files/dirs by their content, a hub id by its name."""
    from rlhf_core.artifacts.manifest import input_record

    record = {"hub_id": path} if not Path(path).exists() else {k: v for k, v in input_record(path).items() if k != "path"}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def resume_inputs(cfg: TrainConfig, spec: StageSpec) -> dict:
    """Everything a checkpoint was built from, stored in it: the config (less the settings a
    resume may change), the training data (`data_fingerprint`) and every upstream artifact
    (`model_path` and `spec.upstream`, by content).  A checkpoint resumes only when all match."""
    from dataclasses import replace

    from rlhf_core.config import config_hash

    paths = [p for p in (cfg.model_path, *spec.upstream) if p]
    return {"config": config_hash(replace(cfg, **RESUMABLE_CHANGES)), "data": spec.data_fingerprint,
            "upstream": {p: upstream_digest(p) for p in paths}}


def resume_key(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def changed_inputs(old: dict | None, new: dict) -> list[str]:
    """Why a checkpoint built from `old` inputs is not a continuation of a run on `new` ones."""
    if not old:
        return ["it predates input tracking (no resume_inputs in its state)"]
    why = []
    if old.get("config") != new["config"]:
        why.append("the config changed (only max_steps, save/eval/log steps, keep_checkpoints may change for a resume)")
    if old.get("data") != new["data"]:
        why.append("the training data changed")
    before, now = old.get("upstream", {}), new["upstream"]
    for p in sorted(set(before) | set(now)):
        if p not in now:
            why.append(f"{p} is no longer an input")
        elif p not in before:
            why.append(f"{p} is a new input")
        elif before[p] != now[p]:
            why.append(f"upstream {p} changed (its stage reran, or it was replaced)")
    return why or ["its inputs differ"]


def save_checkpoint(groups: list[tuple[WorkerGroup, str]], ckpt_dir: Path, step: int, state: dict, keep: int) -> None:
    """One atomic checkpoint holding every (group, subdir) -- rl keeps policy/ and critic/ in it."""
    for group, sub in groups:
        if not all(group.call("params_finite")):
            raise FloatingPointError(f"non-finite weights{' in ' + sub if sub else ''} at step {step}: refusing to checkpoint them")
    tmp = ckpt.begin(ckpt_dir, step)
    for group, sub in groups:
        group.call("save_checkpoint", str(tmp / sub) if sub else str(tmp))
    ckpt.commit(ckpt_dir, tmp, step, state, keep)
    log.info("checkpoint %s", ckpt.step_name(step))


def trim_history(path: Path, step: int) -> None:
    """On resume: drop the rows a killed run logged after its last checkpoint."""
    if path.exists():
        rows = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in rows))


def resume_point(ckpt_dir: Path, cfg: TrainConfig, spec: StageSpec, inputs: dict) -> tuple[Path, dict] | None:
    """The checkpoint to resume from, or None for a fresh start.  A checkpoint resumes only when
    config, training data and upstream artifacts (`resume_inputs`) are those it was built from;
    otherwise the run starts over, saying why (a nightly run after new data or a retrained
    upstream stage, an interrupted run whose parent changed since).  ResumeError if it is this
    run's and there is nothing left to train.  Nothing is read before this process holds the
    output directory's lock (`stage_main` took it already; a direct caller takes it here)."""
    stage_lock.acquire(ckpt_dir.parent, spec.name)
    if not cfg.resume:
        ckpt.reset(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt.clean_stale(ckpt_dir)
    found = ckpt.find_resumable(ckpt_dir)
    if found and found[1].get("resume_key") != resume_key(inputs):
        log.warning("not resuming from %s: %s; starting over (its checkpoints are removed)", found[0].name,
                    "; ".join(changed_inputs(found[1].get("resume_inputs"), inputs)))
        ckpt.reset(ckpt_dir)
        return None
    if found and found[1]["step"] >= cfg.max_steps:
        raise ResumeError(f"{found[0]} is at step {found[1]['step']} >= max_steps={cfg.max_steps}: nothing to train. "
                          f"Raise {spec.name}.max_steps, or --set {spec.name}.resume=false to start over.")
    return found


def load_resumable(ckpt_dir: Path, found: tuple[Path, dict], spec: StageSpec, key: str, load: Callable[[Path], None]) -> tuple[Path, dict]:
    """Load `found` (from `resume_point`) with `load(path)`.  A checkpoint that verifies but fails
    to load is reported, naming it and why, and the next older complete one of the same run is
    tried, as for a hash mismatch; if none loads, the error lists each one and why."""
    def candidates():
        yield found
        yield from (c for c in ckpt.iter_resumable(ckpt_dir) if c[0] != found[0])  # only read after a failure

    failures = []
    for path, state in candidates():
        if state.get("resume_key") != key:
            continue
        try:
            load(path)
            return path, state
        except Exception as e:  # a RayTaskError carries the worker's CheckpointLoadError as its cause
            cause = getattr(e, "cause", None) or e
            why = str(cause) if isinstance(cause, ckpt.CheckpointLoadError) else ckpt.explain(cause)
            log.warning("checkpoint %s could not be loaded, trying the previous complete one: %s", path.name, why)
            failures.append(f"{path.name}: {why}")
    raise ResumeError(f"no checkpoint in {ckpt_dir} could be loaded ({'; '.join(failures)}). Fix the cause, or "
                      f"--set {spec.name}.resume=false to start over.")


def train(spec: StageSpec, cfg: TrainConfig, out_dir: Path) -> tuple[WorkerGroup, dict]:
    """Run (or resume) training to `cfg.max_steps`; returns the worker group and metrics."""
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

    # workers run in another cwd: every path they see must be absolute
    out_dir = out_dir.resolve()
    if Path(spec.model_path).exists():
        spec.model_path = str(Path(spec.model_path).resolve())
    ckpt_dir = out_dir / "checkpoints"
    inputs = resume_inputs(cfg, spec)
    key = resume_key(inputs)
    found = resume_point(ckpt_dir, cfg, spec, inputs)

    group = WorkerGroup(spec, cfg)
    if spec.before_train:
        spec.before_train(group)
    if found:
        found = load_resumable(ckpt_dir, found, spec, key, lambda p: group.call("load_checkpoint", str(p)))
        path, state = found
        log.info("resumed from %s (step %d, %d samples consumed)", path.name, state["step"], state["consumed"])
    else:
        state = {"step": 0, "consumed": 0, "nan_skipped": 0, "data_fingerprint": spec.data_fingerprint, "resume_key": key,
                 "resume_inputs": inputs, "init_metrics": {}, **spec.extra_state}
        state["init_metrics"] = {k + "_init": v for k, v in spec.evaluate(group).items()}
        log.info("before training: %s", state["init_metrics"])

    history_path = out_dir / "train_history.jsonl"
    if not found:
        history_path.unlink(missing_ok=True)
        shutil.rmtree(out_dir / "tensorboard", ignore_errors=True)
    else:
        trim_history(history_path, state["step"])
    writer = SummaryWriter(str(out_dir / "tensorboard"))
    n, streak, t0, tokens = len(spec.examples), 0, time.time(), 0
    bar = tqdm(total=cfg.max_steps, initial=state["step"], desc=spec.name, unit="step", dynamic_ncols=True, mininterval=2)
    while state["step"] < cfg.max_steps:
        idx = take(n, cfg.seed, state["consumed"], cfg.global_batch_size)
        batch = [spec.examples[i] for i in idx]
        results = group.train_step(batch, spec.collate, spec.loss_fn, spec.counts(batch), step=state["step"] + 1)
        state["step"] += 1
        state["consumed"] += len(batch)
        step = state["step"]
        if any(r["skipped"] for r in results):
            streak += 1
            state["nan_skipped"] += 1
            log.warning("step %d: non-finite loss, update skipped (%d in a row, %d total)", step, streak, state["nan_skipped"])
            if streak >= cfg.max_nan_steps:
                raise FloatingPointError(f"{streak} consecutive steps with a non-finite loss (max_nan_steps={cfg.max_nan_steps}); "
                                         f"aborting without checkpointing. Lower {spec.name}.lr or check the data.")
        else:
            streak = 0
        tokens += sum(e.get("num_tokens") or len(e["input_ids"]) for e in batch)
        # a rank's "loss" is its share of the global loss (normalised by global counts): sum them;
        # every other stat is a per-rank mean: average them
        row = {"step": step, **{k: sum(r[k] for r in results) / (1 if k == "loss" else len(results)) for k in results[0]}}
        for k, v in row.items():
            if k != "step":
                writer.add_scalar(f"train/{k}", v, step)
        with open(history_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        bar.update(1)
        if step % cfg.log_steps == 0 or step == cfg.max_steps:
            elapsed = time.time() - t0
            log.info("step %d/%d loss %.4f lr %.2e | %.0f tok/s | ETA %.0fs", step, cfg.max_steps, row["loss"], row["lr"] if "lr" in row else 0,
                     tokens / max(elapsed, 1e-9), elapsed / max(1, step - (bar.initial or 0)) * (cfg.max_steps - step))
        if cfg.eval_steps and step % cfg.eval_steps == 0 and step < cfg.max_steps:
            for k, v in spec.evaluate(group).items():
                writer.add_scalar(k, v, step)
        if step % cfg.save_steps == 0 or step == cfg.max_steps:
            save_checkpoint([(group, "")], ckpt_dir, step, state, cfg.keep_checkpoints)
        faults.sigkill_after(step)
    bar.close()
    metrics = spec.evaluate(group)
    for k, v in metrics.items():
        writer.add_scalar(k, v, state["step"])
    writer.close()
    metrics.update(state["init_metrics"])
    metrics.update({"train/steps": state["step"], "train/nan_skipped": state["nan_skipped"], "train/wall_s": round(time.time() - t0, 1)})
    last = json.loads(history_path.read_text().splitlines()[-1]) if history_path.exists() else {}
    if "loss" in last:
        metrics["train/loss"] = last["loss"]
    return group, metrics


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
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    return final
