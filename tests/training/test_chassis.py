"""The driver skeleton both the supervised loop and rl use: state round trip, start or resume (and
what each clears), the step log, the NaN guard, the cadence.  Real files, no Ray."""
import json
import logging
import time
from pathlib import Path

import pytest

from rlhf_core.runtime import stage_lock
from rlhf_core.training import checkpoint as ckpt
from rlhf_core.training.chassis import (
    Cadence,
    Driver,
    NanGuard,
    RunState,
    Start,
    StepLog,
    final_metrics,
    reduce_ranks,
    run_steps,
    start_or_resume,
)
from rlhf_core.training.config import TrainConfig

pytestmark = pytest.mark.unit
CFG = TrainConfig(model_path="org/model", max_steps=6, save_steps=2, eval_steps=3, log_steps=1)


@pytest.fixture
def out(tmp_path):
    out = tmp_path / "artifacts" / "stage"
    out.mkdir(parents=True)
    yield out
    stage_lock.release(out)


def test_run_state_round_trips_through_a_checkpoint_dict():
    state = RunState(step=3, consumed=96, nan_skipped=1, init_metrics={"eval/accuracy_init": 0.5}, resume_key="k",
                     extra={"kl_controller": {"value": 0.01}, "invalid": 2})
    d = state.to_dict()
    assert d["step"] == 3 and d["kl_controller"] == {"value": 0.01} and "extra" not in d
    assert RunState.from_dict(json.loads(json.dumps(d))) == state
    # a checkpoint written before a counter existed resumes with the counter at its default
    assert RunState.from_dict({"step": 2, "consumed": 8, "resume_key": "k"}).nan_skipped == 0


def _history(out, steps):
    (out / "train_history.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in steps))


def test_fresh_start_clears_an_earlier_run_and_resume_trims_its_history(out, caplog):
    _history(out, [1, 2, 3])
    for sub in ("tensorboard", "rollouts", "keep"):
        (out / sub).mkdir()
    start = Start.plan(CFG, "stage", out, "data-1")
    state, resumed = start_or_resume(start, load=lambda p: pytest.fail("nothing to load"), clear=("rollouts",))
    assert not resumed and state.step == 0 and state.resume_key == start.key and state.resume_inputs["data"] == "data-1"
    assert not (out / "train_history.jsonl").exists() and not (out / "tensorboard").exists() and not (out / "rollouts").exists()
    assert (out / "keep").exists()

    # a run that checkpointed step 2 and logged step 3 before it was killed
    state.step, state.consumed = 2, 64
    tmp = ckpt.begin(start.ckpt_dir, 2)
    (tmp / "w.bin").write_bytes(b"w")
    ckpt.commit(start.ckpt_dir, tmp, 2, state.to_dict(), keep=2)
    _history(out, [1, 2, 3])
    loaded = []
    with caplog.at_level(logging.INFO):
        again, resumed = start_or_resume(Start.plan(CFG, "stage", out, "data-1"), load=loaded.append)
    assert resumed and again == state and [p.name for p in loaded] == ["step_000002"]
    assert [json.loads(x)["step"] for x in (out / "train_history.jsonl").read_text().splitlines()] == [1, 2]
    assert "resumed from step_000002 (step 2, 64 samples consumed)" in caplog.text


def test_step_log_writes_history_and_reports_eta(out):
    log = StepLog(out, "stage", max_steps=4, step=0, prefix="train")
    log.write({"step": 1, "loss": 2.0, "critic/loss": 1.0})
    time.sleep(0.05)
    log.write({"step": 2, "loss": 1.0})
    # one namespace: a bare key goes under the prefix in the history as in TensorBoard
    last = log.last()
    assert {k: v for k, v in last.items() if k != "time/step_s"} == {"step": 2, "train/loss": 1.0}
    assert 0.05 <= last["time/step_s"] < 5  # each row's wall time since the row before
    assert log.eta(2) == pytest.approx(log.elapsed(), rel=0.5, abs=0.05)  # two steps done, two to go
    metrics = final_metrics(RunState(step=2, nan_skipped=1, init_metrics={"eval/accuracy_init": 0.1}), log)
    log.close()
    assert metrics["train/steps"] == 2 and metrics["train/nan_skipped"] == 1 and metrics["eval/accuracy_init"] == 0.1
    assert [json.loads(x)["step"] for x in (out / "train_history.jsonl").read_text().splitlines()] == [1, 2]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(str(out / "tensorboard")).Reload().Tags()["scalars"]
    first = json.loads((out / "train_history.jsonl").read_text().splitlines()[0])
    assert set(first) - {"step"} == {"train/loss", "critic/loss", "time/step_s"} <= set(tags)


def test_step_log_to_wandb_offline(out, monkeypatch):
    """report_to=wandb (W&B offline: nothing leaves the machine): the run lives in out/wandb/ and
    holds the same keys as the history, and the config with its credentials redacted."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = TrainConfig(report_to="wandb", wandb_project="tests", model_path="https://u:hunter2@models.example/m")
    log = StepLog(out, "stage", max_steps=2, step=0, prefix="train", cfg=cfg, run_id="abc123")
    log.write({"step": 1, "loss": 2.0})
    log.write({"step": 2, "loss": 1.5})
    log.scalars({"eval/accuracy": 0.5}, 2)
    log.close()
    assert not (out / "tensorboard").exists()  # only where report_to asks
    runs = list((out / "wandb").glob("offline-run-*-abc123"))
    assert len(runs) == 1, list((out / "wandb").iterdir())
    data = b"".join(p.read_bytes() for p in runs[0].rglob("*") if p.is_file())
    assert b"train/loss" in data and b"eval/accuracy" in data and b"models.example" in data and b"hunter2" not in data
    with pytest.raises(ValueError, match="report_to: unknown"):
        TrainConfig(report_to="tensorboard,mlflow")


def test_reduce_ranks_sums_loss_shares_and_averages_the_rest():
    # two ranks, each loss already divided by the global token count: the global loss is the sum
    row = reduce_ranks([{"loss": 0.25, "lr": 1e-3, "grad_norm": 2.0}, {"loss": 0.5, "lr": 1e-3, "grad_norm": 4.0}])
    assert row == pytest.approx({"loss": 0.75, "lr": 1e-3, "grad_norm": 3.0})


def test_nan_guard_counts_skips_and_aborts_after_the_limit():
    guard, state = NanGuard(2, "steps", "Lower sft.lr."), RunState()
    guard.update(True, state, 1)
    guard.update(False, state, 2)  # a good step resets the streak, not the total
    guard.update(True, state, 3)
    assert state.nan_skipped == 2
    with pytest.raises(FloatingPointError, match=r"2 consecutive steps with a non-finite loss \(max_nan_steps=2\).*Lower sft.lr"):
        guard.update(True, state, 4)


def test_cadence_logs_evaluates_and_saves_on_schedule_and_at_the_end():
    c = Cadence.of(TrainConfig(max_steps=7, log_steps=2, eval_steps=3, save_steps=5))
    steps = range(1, 8)
    assert [s for s in steps if c.log(s)] == [2, 4, 6, 7]
    assert [s for s in steps if c.eval(s)] == [3, 6]  # the final evaluation follows the loop
    assert [s for s in steps if c.save(s)] == [5, 7]
    assert not any(Cadence.of(TrainConfig(max_steps=7, eval_steps=0)).eval(s) for s in steps)


def test_run_steps_is_every_stages_loop_on_its_cadence(out):
    """The one loop: each step's row in the history, eval and checkpoint on the cadence (CFG: eval
    every 3 but not at the end, save every 2 and at the end), the checkpoint holding the trainers'
    subdirs and what `extra` writes; a resumed state continues from its step."""
    calls = []

    class Group:  # a worker group's interface: every rank saves into the checkpoint dir
        def call(self, method, *args):
            if method == "save_checkpoint":
                Path(args[0]).mkdir(parents=True, exist_ok=True)
                (Path(args[0]) / "weights").write_text("w")
            return [True]

    start = Start.plan(CFG, "stage", out, "data", ())
    state, _ = start_or_resume(start, lambda p: None)
    steplog = StepLog(out, "stage", CFG.max_steps, state.step, prefix="train")

    def step():
        state.step += 1
        calls.append(("step", state.step))
        return {"step": state.step, "loss": 1.0 / state.step}

    extra = lambda: (lambda path: (path / "buffer").write_text("b"))  # noqa: E731
    run_steps(Driver(step=step, line=lambda row: f"loss {row['loss']}", evaluate=lambda at: calls.append(("eval", at)),
                     trainers=[(Group(), "policy")], extra=extra), CFG, state, steplog, start.ckpt_dir)
    steplog.close()
    assert [c for c in calls if c[0] == "eval"] == [("eval", 3)]  # not at 6: the final eval follows the loop
    assert [json.loads(line)["step"] for line in (out / "train_history.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    kept = sorted(p.name for p in start.ckpt_dir.iterdir() if p.is_dir())
    assert kept and all((start.ckpt_dir / k / "policy" / "weights").exists() and (start.ckpt_dir / k / "buffer").exists() for k in kept)
    assert (start.ckpt_dir / "latest").read_text() == ckpt.step_name(6)
    assert json.loads((start.ckpt_dir / ckpt.step_name(6) / "state.json").read_text())["step"] == 6
