"""Every RL algorithm on the default task, side by side in one run (same machine, same minutes).

    .venv/bin/python bench/rl_algos.py [--algos grpo,ppo,...] [--steps 40] [--engine vllm]

Starts from artifacts/sft/model (run `make run` or `rlhf stage run sft` first).  One embedded Ray
head for all runs; each algorithm runs as the real stage job with its defaults.  Prints a table of
eval/accuracy before and after, best accuracy, final reward and wall time, and writes
bench/results/rl_algos.json.  Figures go into docs/benchmarks.md by hand (they are noisy).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ALGOS = ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--algos", default=",".join(ALGOS))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--engine", default="vllm")
    ap.add_argument("--extra", action="append", default=[], help="extra --set for every run, e.g. rl.rollout.agent=retry_arithmetic")
    args = ap.parse_args()
    from rlhf_core.runtime.cluster import LocalRayHead

    results = {}
    with LocalRayHead() as head:
        for algo in args.algos.split(","):
            out = f"bench/results/rl_{algo}"
            sets = [f"rl.algo={algo}", f"rl.max_steps={args.steps}", f"rl.rollout.engine={args.engine}", f"rl.output_dir={out}", "rl.resume=false",
                    *args.extra]
            cmd = [sys.executable, "-m", "rlhf_core.cli", "stage", "run", "rl", *[x for s in sets for x in ("--set", s)]]
            t0 = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "RAY_ADDRESS": head.job_address})
            wall = time.time() - t0
            if proc.returncode:
                print(f"{algo}: FAILED\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
                results[algo] = {"failed": True}
                continue
            m = json.loads(Path(out, "metrics.json").read_text())
            results[algo] = {"accuracy_init": m["eval/accuracy_init"], "accuracy": m["eval/accuracy"], "best": m["best/eval_accuracy"],
                             "reward_final": m["train/reward_mean"], "train_wall_s": m["train/wall_s"], "job_wall_s": round(wall, 1),
                             **({"success_rate_init": m["eval/success_rate_init"], "success_rate": m["eval/success_rate"]}
                                if "eval/success_rate" in m else {})}
            print(algo, results[algo], flush=True)
    Path("bench/results").mkdir(parents=True, exist_ok=True)
    Path("bench/results/rl_algos.json").write_text(json.dumps(results, indent=2))
    print(f"\n{'algo':<24}{'acc init':>9}{'acc':>7}{'best':>7}{'reward':>8}{'train s':>9}{'job s':>7}")
    for algo, r in results.items():
        if not r.get("failed"):
            print(f"{algo:<24}{r['accuracy_init']:>9.3f}{r['accuracy']:>7.3f}{r['best']:>7.3f}{r['reward_final']:>8.3f}{r['train_wall_s']:>9.1f}{r['job_wall_s']:>7.1f}")


if __name__ == "__main__":
    main()
