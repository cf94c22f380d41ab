"""What every training driver shares -- the supervised loop (`loop.train`: pretrain, sft, rm, dpo)
and rl (`stages/rl.py`): start or resume a run, log each step, guard against non-finite losses,
keep the log/eval/save cadence, checkpoint, report.  A driver is then its own step and nothing else.

Resume rule: a checkpoint resumes only when its *inputs* -- the config less the settings a resume
may change, the training data, every upstream artifact -- are this run's (`resume_inputs`);
otherwise the run starts over and says why (a nightly run after new data or a retrained parent).
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable

from rlhf_core import atomic
from rlhf_core.artifacts.manifest import input_record
from rlhf_core.config import config_hash, redact
from rlhf_core.runtime import faults, stage_lock
from rlhf_core.training import checkpoint as ckpt
from rlhf_core.training.config import TrainConfig

log = logging.getLogger("rlhf.train")


HISTORY = "train_history.jsonl"


class ResumeError(RuntimeError):
    """A resume that would skip, replay or train nothing."""


# --- the run's state --------------------------------------------------------------------------


@dataclass
class RunState:
    """The counters a checkpoint holds (its `state.json`); `extra` is the driver's own (rl: the KL
    controller, the best model so far, invalid rewards, the rollouts' run id)."""
    step: int = 0
    consumed: int = 0
    """Training samples (rl: prompts) drawn so far: the data order is a pure function of (seed, consumed)."""
    nan_skipped: int = 0
    init_metrics: dict = field(default_factory=dict)
    resume_key: str = ""
    resume_inputs: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {**self.extra, **{f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}}

    @classmethod
    def from_dict(cls, d: dict) -> "RunState":
        own = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in d.items() if k in own}, extra={k: v for k, v in d.items() if k not in own})


# --- resume or start ------------------------------------------------------------------------

# settings that may change between a run and its resume; anything else makes it a new run
RESUMABLE_CHANGES = {"max_steps": 1, "save_steps": 1, "eval_steps": 0, "log_steps": 1, "resume": True, "keep_checkpoints": 1}


def upstream_digest(path: str) -> str:
    """sha256 of what `path` is now: an artifact of this pipeline by its manifest's hash (which
    changes whenever its stage reran), other files/dirs by their content, a hub id by its name."""
    record = {"hub_id": path} if not Path(path).exists() else {k: v for k, v in input_record(path).items() if k != "path"}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def resume_inputs(cfg: TrainConfig, data_fingerprint: str, upstream: tuple[str, ...] = ()) -> dict:
    """Everything a checkpoint is built from, stored in it: the config (less RESUMABLE_CHANGES),
    the training data's fingerprint and every upstream artifact (`cfg.model_path` and `upstream`,
    e.g. rl's reward model and reward file, by content)."""
    paths = [p for p in (cfg.model_path, *upstream) if p]
    return {"config": config_hash(replace(cfg, **RESUMABLE_CHANGES)), "data": data_fingerprint,
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


def resume_point(ckpt_dir: Path, cfg: TrainConfig, name: str, inputs: dict) -> tuple[Path, dict] | None:
    """The checkpoint to resume from, or None for a fresh start (removing checkpoints built from
    other inputs, saying why).  ResumeError if it is this run's and there is nothing left to
    train.  Nothing is read before this process holds the output directory's lock (`stage_main`
    took it already; a direct caller takes it here)."""
    stage_lock.acquire(ckpt_dir.parent, name)
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
                          f"Raise {name}.max_steps, or --set {name}.resume=false to start over.")
    return found


def load_resumable(ckpt_dir: Path, found: tuple[Path, dict], name: str, key: str, load: Callable[[Path], None]) -> tuple[Path, dict]:
    """Load `found` (from `resume_point`) with `load(path)`.  A checkpoint that verifies but fails
    to load is reported, naming it and why, and the next older complete one of the same run is
    tried; if none loads, the error lists each one and why."""
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
                      f"--set {name}.resume=false to start over.")


@dataclass
class Start:
    """Where a run starts.  `plan` decides before any worker exists (and takes the output
    directory's lock); `start_or_resume` acts once the workers hold the starting weights."""
    name: str
    ckpt_dir: Path
    inputs: dict
    key: str
    found: tuple[Path, dict] | None

    @classmethod
    def plan(cls, cfg: TrainConfig, name: str, out_dir: Path, data_fingerprint: str, upstream: tuple[str, ...] = ()) -> "Start":
        ckpt_dir = out_dir / "checkpoints"
        inputs = resume_inputs(cfg, data_fingerprint, upstream)
        return cls(name, ckpt_dir, inputs, resume_key(inputs), resume_point(ckpt_dir, cfg, name, inputs))


def start_or_resume(start: Start, load: Callable[[Path], None], clear: tuple[str, ...] = ()) -> tuple[RunState, bool]:
    """(state, resumed).  Resume: `load(path)` restores the workers from the newest loadable
    checkpoint, whose state is returned, and the step history loses the rows a killed run logged
    after it.  Fresh start: state at step 0 recording what the run is built from; an earlier run's
    history, TensorBoard logs and the driver's `clear` outputs (rl: rollouts, best_model) go."""
    out_dir = start.ckpt_dir.parent
    if start.found:
        path, state = load_resumable(start.ckpt_dir, start.found, start.name, start.key, load)
        log.info("resumed from %s (step %d, %d samples consumed)", path.name, state["step"], state.get("consumed", 0))
        trim_history(out_dir / HISTORY, state["step"])
        return RunState.from_dict(state), True
    (out_dir / HISTORY).unlink(missing_ok=True)
    for sub in ("tensorboard", *clear):
        shutil.rmtree(out_dir / sub, ignore_errors=True)
    return RunState(resume_key=start.key, resume_inputs=start.inputs), False


def save_checkpoint(groups: list[tuple[object, str]], ckpt_dir: Path, state: RunState, keep: int,
                    extra: Callable[[Path], None] | None = None) -> None:
    """One atomic checkpoint of every (worker group, subdir) -- rl keeps policy/ and critic/ in it
    -- and whatever `extra(dir)` writes into it (rl's async rollout buffer)."""
    for group, sub in groups:
        if not all(group.call("params_finite")):
            raise FloatingPointError(f"non-finite weights{' in ' + sub if sub else ''} at step {state.step}: refusing to checkpoint them")
    tmp = ckpt.begin(ckpt_dir, state.step)
    for group, sub in groups:
        group.call("save_checkpoint", str(tmp / sub) if sub else str(tmp))
    if extra:
        extra(tmp)
    ckpt.commit(ckpt_dir, tmp, state.step, state.to_dict(), keep)
    log.info("checkpoint %s", ckpt.step_name(state.step))


# --- each step ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cadence:
    """When a step logs, evaluates (the final evaluation follows the loop) and checkpoints."""
    max_steps: int
    log_steps: int
    eval_steps: int
    save_steps: int

    @classmethod
    def of(cls, cfg: TrainConfig) -> "Cadence":
        return cls(cfg.max_steps, cfg.log_steps, cfg.eval_steps, cfg.save_steps)

    def log(self, step: int) -> bool:
        return step % self.log_steps == 0 or step == self.max_steps

    def eval(self, step: int) -> bool:
        return bool(self.eval_steps) and step % self.eval_steps == 0 and step < self.max_steps

    def save(self, step: int) -> bool:
        return step % self.save_steps == 0 or step == self.max_steps


@dataclass
class Driver:
    """What a stage's run plugs into `run_steps`, the one loop every stage has: `step()` makes one
    optimizer step, advances `state` and returns the history row; `line(row)` is the log line;
    `evaluate(step)` runs and records the mid-run eval; `trainers` are the (worker group, subdir)
    pairs a checkpoint holds; `extra()` what a checkpoint adds besides them (rl async: its
    rollout buffer), if anything."""
    step: Callable[[], dict]
    line: Callable[[dict], str]
    evaluate: Callable[[int], None]
    trainers: list[tuple[object, str]]
    extra: Callable[[], Callable[[Path], None] | None] = lambda: None


def run_steps(driver: Driver, cfg: TrainConfig, state: RunState, steplog: "StepLog", ckpt_dir: Path) -> None:
    """Steps to `cfg.max_steps` from `state`: each step's row to the history, then on its cadence a
    log line, an eval and a checkpoint, then the injected fault if one is asked for (tests)."""
    cadence = Cadence.of(cfg)
    while state.step < cfg.max_steps:
        row = driver.step()
        step = state.step
        steplog.write(row)
        if cadence.log(step):
            log.info("step %d/%d %s | ETA %.0fs", step, cfg.max_steps, driver.line(row), steplog.eta(step))
        if cadence.eval(step):
            driver.evaluate(step)
        if cadence.save(step):
            save_checkpoint(driver.trainers, ckpt_dir, state, cfg.keep_checkpoints, extra=driver.extra())
        faults.sigkill_after(step)


class NanGuard:
    """A step whose update every rank skipped (non-finite loss) is counted; `limit` in a row abort
    the run before anything is checkpointed."""

    def __init__(self, limit: int, what: str, hint: str):
        self.limit, self.what, self.hint, self.streak = limit, what, hint, 0

    def update(self, skipped: bool, state: RunState, step: int) -> None:
        if not skipped:
            self.streak = 0
            return
        self.streak += 1
        state.nan_skipped += 1
        log.warning("step %d: non-finite loss, update skipped (%d in a row, %d total)", step, self.streak, state.nan_skipped)
        if self.streak >= self.limit:
            raise FloatingPointError(f"{self.streak} consecutive {self.what} with a non-finite loss (max_nan_steps={self.limit}); "
                                     f"aborting without checkpointing. {self.hint}")


class StepLog:
    """train_history.jsonl (what `dvc plots` reads), TensorBoard scalars and/or a W&B run
    (`cfg.report_to`) and a progress bar with ETA, from `step` on (`start_or_resume` emptied or
    trimmed the history).  One namespace for all: a key without a `/` goes under `prefix/` (sft's
    `loss` -> `train/loss`, rl's `kl` -> `rl/kl`), so a history key is the TensorBoard tag and the
    W&B key, and the same statistic has one name in every stage."""

    def __init__(self, out_dir: Path, name: str, max_steps: int, step: int, prefix: str, cfg: TrainConfig | None = None,
                 run_id: str = ""):
        from tqdm import tqdm

        self.path, self.prefix, self.max_steps, self.start_step, self.t0 = out_dir / HISTORY, prefix, max_steps, step, time.time()
        self.t_last = self.t0
        report_to = (cfg.report_to if cfg else "tensorboard").split(",")
        self.writer, self.wandb = None, None
        if "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(out_dir / "tensorboard"))
        if "wandb" in report_to:
            self.wandb = wandb_run(out_dir, name, cfg, run_id)
        self.bar = tqdm(total=max_steps, initial=step, desc=name, unit="step", dynamic_ncols=True, mininterval=2)

    def write(self, row: dict) -> None:
        """One step's row; `time/step_s` is the wall time since the previous row (an eval or a
        checkpoint between two steps counts in the next one: the median is the step's cost)."""
        now = time.time()
        tagged = {k if k == "step" or "/" in k else f"{self.prefix}/{k}": v for k, v in row.items()}
        tagged.setdefault("time/step_s", round(now - self.t_last, 4))
        self.t_last = now
        self.scalars({k: v for k, v in tagged.items() if k != "step"}, row["step"])
        with open(self.path, "a") as f:
            f.write(json.dumps(tagged) + "\n")
        self.bar.update(1)

    def scalars(self, metrics: dict, step: int) -> None:
        if self.writer:
            for k, v in metrics.items():
                self.writer.add_scalar(k, v, step)
        if self.wandb:
            self.wandb.log(metrics, step=step)

    def elapsed(self) -> float:
        return time.time() - self.t0

    def eta(self, step: int) -> float:
        return self.elapsed() / max(1, step - self.start_step) * (self.max_steps - step)

    def last(self) -> dict:
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        return json.loads(lines[-1]) if lines else {}

    def close(self) -> None:
        self.bar.close()
        if self.writer:
            self.writer.close()
        if self.wandb:
            self.wandb.finish()


def wandb_run(out_dir: Path, name: str, cfg: TrainConfig, run_id: str):
    """A W&B run for the stage, under out_dir/wandb/, with the resolved config (credentials
    redacted).  `run_id` (the run's resume key) makes a resumed stage continue the same run."""
    try:
        import wandb
    except ImportError:
        raise RuntimeError("report_to includes wandb but the wandb package is not installed: pip install -e '.[wandb]'") from None
    (out_dir / "wandb").mkdir(parents=True, exist_ok=True)
    return wandb.init(project=cfg.wandb_project, name=f"{name}-{out_dir.name}", dir=str(out_dir), config=redact(asdict(cfg)),
                      id=run_id[:32] or None, resume="allow" if run_id else None)


def reduce_ranks(results: list[dict]) -> dict:
    """One row from the data-parallel ranks' train-step stats: a rank's `loss` is its share of the
    global loss (normalised by global counts), so the shares sum; every other stat is a per-rank
    mean, so they average."""
    return {k: sum(r[k] for r in results) / (1 if k == "loss" else len(results)) for k in results[0]}


def trim_history(path: Path, step: int) -> None:
    """On resume: drop the rows a killed run logged after its last checkpoint."""
    if path.exists():
        rows = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
        atomic.write_text(path, "".join(line + "\n" for line in rows))  # a kill here keeps the old file, never half of it


def final_metrics(state: RunState, steplog: StepLog) -> dict:
    """What every stage reports beside its own evaluation: counters, wall time, the initial eval."""
    return {**state.init_metrics, "train/steps": state.step, "train/nan_skipped": state.nan_skipped,
            "train/wall_s": round(steplog.elapsed(), 1)}
