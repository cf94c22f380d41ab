"""Fault injection for the reliability suite (docs/reliability.md).  Inert unless RLHF_FAULT is set.

RLHF_FAULT holds one fault:
  sigkill_after_step:K   the stage driver SIGKILLs itself right after step K (and its checkpoint, if due)
  kill_worker_at_step:K  the driver kills training worker 0 (`ray.kill`) while step K runs
  nan_loss               every training step's loss becomes NaN (inside the workers)
  hang:POINT             the actor call at POINT never returns: `reward` (RewardWorker.score),
                         `rollout` (RolloutWorker.rollout), `sync` (RolloutWorker.update_weights) or
                         `train_step` (TrainWorker.train_step)
  sigkill_at:POINT       the process SIGKILLs itself at POINT (`promotion`: between copying the new
                         champion and switching to it)
  slow_steps:S           every optimizer step of a training worker takes S seconds longer (sft, rm, dpo,
                         rl): a test can act mid-training although the tiny model trains 8 steps in a second
  slow_pieces:S          each generate call of a rollout (each piece of a partial rollout) takes S seconds
                         longer, holding the engine: weight syncs then land mid-round
RLHF_FAULT_ONCE=PATH makes the fault fire at most once: firing creates PATH, and a fault whose PATH
exists stays quiet, so a retried stage runs clean (the Prefect-retry test relies on this).
"""
from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger("rlhf.faults")


def armed(name: str) -> str | None:
    """The argument of fault `name` ('' when it has none) if it is set and not yet spent, else None."""
    fault = os.environ.get("RLHF_FAULT", "")
    kind, _, arg = fault.partition(":")
    if kind != name:
        return None
    once = os.environ.get("RLHF_FAULT_ONCE")
    if once and Path(once).exists():
        return None
    return arg


def at_step(name: str, step: int) -> bool:
    """True (and the fault marked spent) if fault `name:K` is armed for this step."""
    arg = armed(name)
    if arg is None or not arg or int(arg) != step:
        return False
    once = os.environ.get("RLHF_FAULT_ONCE")
    if once:
        Path(once).touch()
    log.warning("RLHF_FAULT: %s at step %d", name, step)
    return True


def sigkill_after(step: int) -> None:
    """`sigkill_after_step:K`: the driver dies as abruptly as an OOM kill, right after step K."""
    if at_step("sigkill_after_step", step):
        os.kill(os.getpid(), signal.SIGKILL)


def sigkill_at(point: str) -> None:
    """`sigkill_at:POINT`: die abruptly at a named point (a crash between two writes)."""
    if armed("sigkill_at") == point:
        log.warning("RLHF_FAULT: sigkill at %s", point)
        os.kill(os.getpid(), signal.SIGKILL)


def slow_step() -> None:
    """`slow_steps:S`: the training worker sleeps S seconds in each optimizer step."""
    arg = armed("slow_steps")
    if arg:
        time.sleep(float(arg))


def slow_piece() -> None:
    """`slow_pieces:S`: each rollout generate call takes S seconds longer."""
    arg = armed("slow_pieces")
    if arg:
        time.sleep(float(arg))


def kill_worker_during(step: int, worker) -> None:
    """`kill_worker_at_step:K`: called after step K was submitted to the workers; kills worker 0."""
    if at_step("kill_worker_at_step", step):
        import ray

        ray.kill(worker, no_restart=True)


def hang(point: str) -> None:
    """`hang:POINT`: block this actor call for good, as a wedged engine or reward service would;
    the driver's `rl.rollout.timeout` must turn it into an error (the actor dies with the job)."""
    if armed("hang") == point:
        log.warning("RLHF_FAULT: hang at %s", point)
        while True:
            time.sleep(60)
