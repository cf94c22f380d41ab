"""Burst load on the rollout and reward path: the default rl batch and N times it, side by side.

    .venv/bin/python bench/burst.py [--factor 10] [--steps 2] [--engine vllm]

Starts from artifacts/sft/model.  Each run is the real rl stage job (one embedded Ray head for both);
prints per-step rollout time, samples/s and the peak resident memory of every role's processes
(`mem/peak_mb_*` in the stage's metrics), with the burst/default ratios, and writes
bench/results/burst.json.  Memory stays bounded when the ratios stay near 1 while the work grows N x:
vLLM's KV cache is a fixed reservation and the HF engine generates one request at a time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--factor", type=int, default=10)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--engine", default="vllm")
    args = ap.parse_args()
    from rlhf_core.runtime.cluster import LocalRayHead
    from stages.rl import Config

    base = Config().rollout.prompts_per_step
    results = {}
    with LocalRayHead() as head:
        for name, prompts in (("default", base), (f"burst_x{args.factor}", base * args.factor)):
            out = f"bench/results/burst_{name}"
            sets = [f"rl.max_steps={args.steps}", f"rl.rollout.prompts_per_step={prompts}", f"rl.rollout.engine={args.engine}",
                    f"rl.output_dir={out}", "rl.resume=false", "rl.eval_steps=0", "rl.pass_k=1"]
            cmd = [sys.executable, "-m", "rlhf_core.cli", "stage", "run", "rl", *[x for s in sets for x in ("--set", s)]]
            t0 = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "RAY_ADDRESS": head.job_address})
            if proc.returncode:
                sys.exit(f"{name}: FAILED\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
            m = json.loads(Path(out, "metrics.json").read_text())
            hist = [json.loads(x) for x in Path(out, "train_history.jsonl").read_text().splitlines()]
            samples = prompts * Config().rollout.n_samples
            rollout_s = sum(h["rl/rollout_s"] for h in hist) / len(hist)
            results[name] = {"samples_per_step": samples, "rollout_s_per_step": round(rollout_s, 2), "samples_per_s": round(samples / rollout_s, 1),
                             "job_wall_s": round(time.time() - t0, 1), **{k: round(v) for k, v in m.items() if k.startswith("mem/")}}
            print(name, results[name], flush=True)
    Path("bench/results").mkdir(parents=True, exist_ok=True)
    Path("bench/results/burst.json").write_text(json.dumps(results, indent=2))
    d, b = results["default"], results[f"burst_x{args.factor}"]
    print(f"\n{'':<22}{'default':>10}{'burst':>10}{'ratio':>8}")
    for k in d:
        if isinstance(d[k], (int, float)) and d[k]:
            print(f"{k:<22}{d[k]:>10}{b[k]:>10}{b[k] / d[k]:>8.2f}")


if __name__ == "__main__":
    main()
