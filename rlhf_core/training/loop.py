"""The supervised training loop shared by pretrain, sft, rm and dpo (the stage supplies data and
maths; the run's skeleton -- resume, step log, NaN guard, cadence -- is `chassis.py`, shared with rl).

Driver side of a Ray job: places `num_workers` TrainWorker actors in a placement group, feeds
them deterministic global batches, checkpoints atomically, resumes exactly, evaluates, and
writes the final model.  Exactness of resume rests on: a data order that is a pure function of
(seed, epoch) and the consumed-sample counter; engine + RNG state in every checkpoint.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from rlhf_core.training.chassis import Driver, NanGuard, Start, StepLog, final_metrics, reduce_ranks, run_steps, start_or_resume
from rlhf_core.training.config import TrainConfig
from rlhf_core.training.worker_group import WorkerGroup

log = logging.getLogger("rlhf.train")


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
    before_train: Callable[["WorkerGroup"], None] | None = None
    """Runs once the workers hold the *starting* weights, before any checkpoint is loaded
    (DPO computes its reference log-probs here)."""
    upstream: tuple[str, ...] = ()
    """Further inputs the training depends on besides `cfg.model_path` and the training data: a
    checkpoint built from others is not resumed (`chassis.resume_inputs`)."""
    lineage: list[dict] = field(default_factory=list)
    """Lineage records besides the model and data files (`training/inputs.py::image_records`: the pictures)."""


def train(spec: StageSpec, cfg: TrainConfig, out_dir: Path) -> tuple[WorkerGroup, dict]:
    """Run (or resume) training to `cfg.max_steps`; returns the worker group and metrics."""
    # workers run in another cwd: every path they see must be absolute
    out_dir = out_dir.resolve()
    if Path(spec.model_path).exists():
        spec.model_path = str(Path(spec.model_path).resolve())
    start = Start.plan(cfg, spec.name, out_dir, spec.data_fingerprint, spec.upstream)
    group = WorkerGroup(cfg, spec.model_path, spec.model_kind, pad_token_id=spec.pad_token_id)
    if spec.before_train:
        spec.before_train(group)
    state, resumed = start_or_resume(start, lambda p: group.call("load_checkpoint", str(p)))
    if not resumed:
        state.init_metrics = {k + "_init": v for k, v in spec.evaluate(group).items()}
        log.info("before training: %s", state.init_metrics)

    steplog = StepLog(out_dir, spec.name, cfg.max_steps, state.step, prefix="train", cfg=cfg, run_id=state.resume_key)
    nan_guard = NanGuard(cfg.max_nan_steps, "steps", f"Lower {spec.name}.lr or check the data.")
    tokens = 0

    def step() -> dict:
        nonlocal tokens
        batch = [spec.examples[i] for i in take(len(spec.examples), cfg.seed, state.consumed, cfg.global_batch_size)]
        results = group.train_step(batch, spec.collate, spec.loss_fn, spec.counts(batch), step=state.step + 1)
        state.step, state.consumed = state.step + 1, state.consumed + len(batch)
        nan_guard.update(any(r["skipped"] for r in results), state, state.step)
        tokens += sum(e.get("num_tokens") or len(e["input_ids"]) for e in batch)
        return {"step": state.step, **reduce_ranks(results)}  # history: train/loss, train/lr, ...

    line = lambda row: f"loss {row['loss']:.4f} lr {row.get('lr', 0):.2e} | {tokens / max(steplog.elapsed(), 1e-9):.0f} tok/s"  # noqa: E731
    run_steps(Driver(step=step, line=line, evaluate=lambda at: steplog.scalars(spec.evaluate(group), at), trainers=[(group, "")]),
              cfg, state, steplog, start.ckpt_dir)
    metrics = spec.evaluate(group)
    steplog.scalars(metrics, state.step)
    steplog.close()
    metrics.update(final_metrics(state, steplog))
    if "train/loss" in steplog.last():
        metrics["train/loss"] = steplog.last()["train/loss"]
    return group, metrics


