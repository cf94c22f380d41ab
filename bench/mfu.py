"""Model FLOP utilisation per RL phase against this machine's measured matmul peak (issue 20).

    .venv/bin/python bench/mfu.py [--steps 4] [--models default,25m] [--peak-only]

1. Peak: a square matmul (n=2048) in fp32 and bf16 with every core torch gets; FLOP/s = 2n^3 / t.
2. For each model (the default tiny one, 3.5M; a ~25M one: width 512, 8 layers), a scratch project
   gets `rlhf prepare` and `--steps` rl steps (grpo, the default 64 x 8 samples, from the random
   base: throughput does not care what the model knows).  From each step's timings in
   train_history.jsonl (first step dropped as warm-up; medians):
     rollout  2 N (prompt + response) per sample            / rl/rollout_s   (vLLM, fp32)
     forward  k x 2 N (prompt + response) per sample        / rl/forward_s   (k forwards: the reference, plus the
                                                                              old log-probs where recomputed)
     update   6 N (prompt + response) per sample            / rl/update_s    (forward + backward)
   N counts the matmul weights a token goes through (every linear layer and the tied LM head; the
   embedding lookup is free; attention's score/value products are ~2 x layers x width x context
   per token, under 3% at these 20-token contexts, and left out).  MFU = achieved / fp32 peak.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"default": [], "25m": ["prepare.model.hidden_size=512", "prepare.model.num_heads=8", "prepare.model.num_layers=8",
                                 "prepare.model.intermediate_size=1536"]}


def matmul_peak(dtype: torch.dtype, n: int = 2048, seconds: float = 3.0) -> float:
    """FLOP/s of `a @ b` for n x n matrices of `dtype` (best of a few timed batches)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(2):
        a @ b
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
    return best


def matmul_params(config: dict) -> int:
    """Weights of every linear layer a token passes through, plus the LM head."""
    d, ff, layers, vocab = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"], config["vocab_size"]
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config.get("head_dim") or d // config["num_attention_heads"]
    attn = d * heads * hd + 2 * d * kv * hd + heads * hd * d
    return layers * (attn + 3 * d * ff) + d * vocab


def rlhf(args: list[str], cwd: Path, log: Path) -> None:
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "rlhf_core.cli", *args], cwd=cwd, stdout=f, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode
    if rc:
        sys.exit(f"rlhf {' '.join(args)} failed ({rc}):\n{log.read_text()[-3000:]}")


def phase_mfu(name: str, extra: list[str], steps: int, peak: float, work: Path) -> dict:
    from transformers import AutoTokenizer

    project = work / name
    project.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    rlhf(["prepare", *sum((["--set", s] for s in extra), [])], project, project / "prepare.log")
    rlhf(["stage", "run", "rl", "--set", "rl.model_path=artifacts/base", "--set", f"rl.max_steps={steps}", "--set", "rl.eval_steps=0",
          "--set", f"rl.save_steps={steps}"], project, project / "rl.log")
    config = json.loads((project / "artifacts/base/config.json").read_text())
    n = matmul_params(config)
    tok = AutoTokenizer.from_pretrained(str(project / "artifacts/base"))
    prompts = [json.loads(x)["prompt"] for x in (project / "data/rl.jsonl").read_text().splitlines() if x.strip()]
    prompt_len = statistics.mean(len(tok(p).input_ids) for p in prompts)
    from flows.report import history

    rows = history(project / "artifacts/rl")[1:]
    samples = statistics.median(r["rl/kept"] for r in rows)
    tokens = samples * (prompt_len + statistics.median(r["rl/response_length"] for r in rows))
    from rlhf_core.config import from_dict
    from rlhf_core.rl.objective import recompute_old
    from stages import rl

    cfg = from_dict(rl.Config, json.loads((project / "artifacts/rl/config.resolved.json").read_text())["config"])
    forwards = 1 + recompute_old(cfg) + rl.ALGO_RECIPES[cfg.algo].needs_critic  # reference (+ old log-probs, + values)
    flops = {"rollout": 2 * n * tokens, "forward": forwards * 2 * n * tokens, "update": 6 * n * tokens}
    secs = {"rollout": "rl/rollout_s", "forward": "rl/forward_s", "update": "rl/update_s"}
    out = {"matmul_params": n, "tokens_per_step": tokens, "step_s": statistics.median(r["time/step_s"] for r in rows)}
    for phase, key in secs.items():
        t = statistics.median(r[key] for r in rows)
        out[phase] = {"s": t, "flop_s": flops[phase] / t, "mfu": flops[phase] / t / peak}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--models", default="default,25m")
    ap.add_argument("--peak-only", action="store_true")
    args = ap.parse_args()
    peaks = {"fp32": matmul_peak(torch.float32), "bf16": matmul_peak(torch.bfloat16)}
    print(f"matmul peak ({torch.get_num_threads()} threads): fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s "
          f"(bf16/fp32 x{peaks['bf16'] / peaks['fp32']:.2f})")
    results = {"peak_flop_s": peaks, "models": {}}
    if not args.peak_only:
        with tempfile.TemporaryDirectory(prefix="rlhf-mfu-") as work:
            for name in args.models.split(","):
                r = results["models"][name] = phase_mfu(name, MODELS[name], args.steps, peaks["fp32"], Path(work))
                print(f"\n{name}: {r['matmul_params'] / 1e6:.1f}M matmul params, {r['tokens_per_step']:.0f} tokens/step, step {r['step_s']:.2f} s")
                for phase in ("rollout", "forward", "update"):
                    p = r[phase]
                    print(f"  {phase:8} {p['s']:7.2f} s  {p['flop_s'] / 1e9:7.2f} GFLOP/s  MFU {100 * p['mfu']:5.1f}% of the fp32 peak")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    print(f"\ncommit {commit}")
    print(json.dumps({"commit": commit, **results}))


if __name__ == "__main__":
    main()
