"""Synchronous vs asynchronous RL on the default task, side by side in one run (issue 18).

    .venv/bin/python bench/async.py [--project build/bench-async] [--steps 20]

The project gets the default task, the pretrained base and the sft model from our own stages once
(reused by later runs).  Then grpo (the default rl recipe) from that sft model, for the same
number of steps (equal samples), as:

  sync colocated   the default: every role takes turns on the trainer's 2 threads
  sync separate    trainer 1 thread, rollout engine 1 thread of its own: the phases still alternate
  async k=1, k=2   separate layout, the engine generates the next k steps' rounds while the trainer
                   updates (rl.rollout.mode=async, rl.rollout.max_staleness=k; the default correction, tis)

Per run: median step wall time, samples/s, trainer idle fraction (time the step waited for its
round / step time), rollout idle fraction (1 - engine busy time / wall time), gold eval accuracy
at the end.  And the overlap model: with the sync-separate phase times, an async step costs
max(rollout, rest) instead of their sum -- what the measured async speed-up is compared with, and
what a machine with more cores (or GPUs) per role would see.  Writes bench/results/async.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import RLHF, ROOT, ensure_project, history, sh  # noqa: E402  (the same project set-up and runner)

SEPARATE = {"rollout.layout": "separate", "cpus_per_worker": 1, "rollout.cpus": 0.5}
RUNS = {
    "sync colocated": {},
    "sync separate": {**SEPARATE},
    "async k=1": {**SEPARATE, "rollout.mode": "async", "rollout.max_staleness": 1},
    "async k=2": {**SEPARATE, "rollout.mode": "async", "rollout.max_staleness": 2},
}


def run(project: Path, name: str, sets: dict, steps: int) -> dict:
    out = f"artifacts/rl_{name.replace(' ', '_').replace('=', '')}"
    sets = {"max_steps": steps, "save_steps": steps, "eval_steps": 0, "output_dir": out, "resume": "false", **sets}
    wall = sh([*RLHF, "stage", "run", "rl", *sum((["--set", f"rl.{k}={v}"] for k, v in sets.items()), [])], project,
              project / "bench" / f"{Path(out).name}.log")
    rows, metrics = history(project / out), json.loads((project / out / "metrics.json").read_text())
    step_s = [r["time/step_s"] for r in rows]
    total = sum(step_s)
    samples = sum(r["rl/kept"] + r["rl/invalid"] for r in rows) / len(rows)
    phase = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    return {"median_step_s": statistics.median(step_s), "samples_per_s": samples / statistics.median(step_s),
            "trainer_idle": sum(r["rl/rollout_s"] for r in rows) / total, "rollout_idle": 1 - sum(r["rl/rollout_busy_s"] for r in rows) / total,
            "rollout_busy_s": phase("rl/rollout_busy_s"), "rest_s": statistics.median(r["time/step_s"] - r["rl/rollout_s"] for r in rows),
            "staleness": sum(r["rl/staleness"] for r in rows) / len(rows), "stale_dropped": sum(r["rl/stale"] for r in rows),
            "accuracy_init": metrics["eval/accuracy_init"], "accuracy": metrics["eval/accuracy"], "command_wall_s": round(wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--project", default=str(ROOT / "build" / "bench-async"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--runs", default=",".join(RUNS))
    args = ap.parse_args()
    project = Path(args.project).resolve()
    ensure_project(project)
    if not (project / "artifacts" / "sft" / "model" / "model.safetensors").exists():
        print("sft once (reused by later runs) ...", flush=True)
        sh([*RLHF, "stage", "run", "sft"], project, project / "bench" / "sft.log")
    results = {}
    for name in args.runs.split(","):
        results[name] = run(project, name, RUNS[name], args.steps)
        print(name, json.dumps({k: round(v, 3) for k, v in results[name].items()}), flush=True)

    print(f"\n{'run':<16}{'step s':>8}{'samples/s':>10}{'x sync sep':>11}{'trainer idle':>13}{'rollout idle':>13}{'staleness':>10}{'acc':>7}")
    base = results.get("sync separate")
    for name, r in results.items():
        ratio = r["samples_per_s"] / base["samples_per_s"] if base else float("nan")
        print(f"{name:<16}{r['median_step_s']:>8.2f}{r['samples_per_s']:>10.1f}{ratio:>11.2f}{r['trainer_idle']:>13.2f}{r['rollout_idle']:>13.2f}"
              f"{r['staleness']:>10.2f}{r['accuracy']:>7.3f}")
    if base:
        roll, rest = base["rollout_busy_s"], base["median_step_s"] - base["rollout_busy_s"]
        print(f"\noverlap model from sync separate: rollout {roll:.2f} s + the rest {rest:.2f} s per step; async at best "
              f"max(...) = {max(roll, rest):.2f} s: x{(roll + rest) / max(roll, rest):.2f} (both phases on cores of their own)")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "async.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
