"""How much of a pipeline run is training steps, and how much is everything else (issue 20).

    make run                                   # time it: `time make run` (or `rlhf pipeline run`)
    .venv/bin/python bench/overhead.py --wall SECONDS [--project DIR]

Reads each stage's `train_history.jsonl` in DIR (default: this checkout) and sums `time/step_s`,
the wall time of the stage's optimizer steps (rl: rollout, reward, forwards, update and weight sync
of each step).  Everything else in the given wall time is overhead: installing .venv/ (if the
timed command did), Prefect and DVC, the Ray head and job submission, actors, DeepSpeed and vLLM
start, the evaluations before, during and after training, checkpoints, model saves, the promotion
gate.  Prints per stage its steps' sum and the share of the whole outside the steps."""
from __future__ import annotations

import argparse
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def step_seconds(out: Path) -> tuple[int, float]:
    from flows.report import history

    rows = history(out)
    return len(rows), sum(r.get("time/step_s", 0.0) for r in rows)


def main() -> None:
    from rlhf_core import registry

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--project", default=str(ROOT))
    ap.add_argument("--wall", type=float, required=True, help="the timed command's wall seconds")
    args = ap.parse_args()
    project = Path(args.project)
    params = yaml.safe_load((project / "params.yaml").read_text()) or {}
    total = 0.0
    print(f"{'stage':10} {'steps':>6} {'in steps s':>11}")
    for stage in registry.dag(params):
        n, secs = step_seconds(project / "artifacts" / stage)
        if n:
            print(f"{stage:10} {n:6d} {secs:11.1f}")
            total += secs
    print(f"steps {total:.1f} s of {args.wall:.1f} s: {100 * total / args.wall:.1f}% training steps, "
          f"{100 * (1 - total / args.wall):.1f}% outside them (goal: < 15% outside)")


if __name__ == "__main__":
    main()
