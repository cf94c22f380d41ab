"""Our stages against TRL's trainers on the same tiny model, data and hyper-parameters, one after
the other in one run (`make bench`; issue 20).

    make bench                                  # builds .venv-bench/ (trl pinned) once, then this
    .venv/bin/python bench/vs_trl.py [--only sft,grpo,dpo] [--project DIR] [--rl-steps N] ...

The project (default build/bench-vs-trl/) gets the default task and the pretrained base from our
own stages once (`rlhf prepare`, `rlhf stage run pretrain`, reused on later runs).  Then:
  sft   ours vs `SFTTrainer`  from artifacts/pretrain/model (prompt-completion, loss on the answer)
  grpo  ours vs `GRPOTrainer` from our sft model (exact-match reward, group-normalised advantages,
        token-mean loss, k3 KL as a loss term, clip 0.2, one update per generation)
  dpo   ours vs `DPOTrainer`  from our sft model (sigmoid + the chosen NLL: our default is RPO)
Every final model, and the start, is scored by one greedy exact-match evaluator (bench/trl_side.py
eval, in .venv-bench) on data/eval.jsonl.  Printed per comparison: median step wall time,
samples/s, tokens/s, the command's wall time (start-up included), accuracy, and ours/TRL ratios.
Differences that remain (documented in docs/benchmarks.md): our cosine decays to 10% of the peak,
HF's to 0; HF's warmup starts at lr 0 on step 1; our rl generates with vLLM, TRL with HF generate
(`use_vllm` needs a GPU server or colocated CUDA)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from flows.report import history  # noqa: E402  (train_history.jsonl rows, as the pipeline report reads them)

BENCH_PY = ROOT / ".venv-bench" / "bin" / "python"
RLHF = [sys.executable, "-m", "rlhf_core.cli"]


def sh(cmd: list[str], cwd: Path, log: Path) -> float:
    """Run `cmd`, its output to `log`; the wall seconds.  A failure stops the bench with the log's tail."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode
    if rc:
        sys.exit(f"{' '.join(map(str, cmd))} failed ({rc}); the end of {log}:\n{log.read_text()[-3000:]}")
    return time.perf_counter() - t0


def trl(spec: dict, project: Path, name: str) -> dict:
    spec = {**spec, "result": str(project / "bench" / f"{name}.result.json")}
    path = project / "bench" / f"{name}.spec.json"
    path.write_text(json.dumps(spec))
    wall = sh([str(BENCH_PY), str(ROOT / "bench" / "trl_side.py"), str(path)], project, project / "bench" / f"{name}.log")
    return {**json.loads(Path(spec["result"]).read_text()), "command_wall_s": wall}


def ensure_project(project: Path) -> None:
    (project / "bench").mkdir(parents=True, exist_ok=True)
    if not (project / "params.yaml").exists():
        shutil.copy(ROOT / "params.yaml", project / "params.yaml")  # the default recipe
    if not (project / "data" / "manifest.json").exists():
        sh([*RLHF, "prepare"], project, project / "bench" / "prepare.log")
    if not (project / "artifacts" / "pretrain" / "model" / "model.safetensors").exists():
        print("pretraining the base model once (reused by later runs) ...", flush=True)
        sh([*RLHF, "stage", "run", "pretrain"], project, project / "bench" / "pretrain.log")


def ours(stage: str, sets: dict, project: Path) -> dict:
    args = [f"{stage}.{k}={v}" for k, v in sets.items()]
    wall = sh([*RLHF, "stage", "run", stage, "--set", f"{stage}.resume=false", *sum((["--set", a] for a in args), [])],
              project, project / "bench" / f"ours-{stage}.log")
    out = project / "artifacts" / stage
    rows = history(out)
    steps = [r["time/step_s"] for r in rows]
    return {"median_step_s": statistics.median(steps), "step_s": steps, "command_wall_s": wall,
            "metrics": json.loads((out / "metrics.json").read_text()), "history": rows}


def compare_sft(project: Path, steps: int) -> tuple[dict, dict, dict]:
    hp = {"max_steps": steps, "lr": 5e-4, "warmup_steps": 20, "scheduler": "cosine", "weight_decay": 0.1, "seed": 0, "batch_size": 64,
          "max_len": 64}
    a = ours("sft", {**{k: hp[k] for k in ("max_steps", "lr", "warmup_steps", "max_len")}, "global_batch_size": hp["batch_size"],
                     "eval_steps": 0, "save_steps": steps}, project)
    b = trl({**hp, "mode": "sft", "model": str(project / "artifacts/pretrain/model"), "out": str(project / "bench/trl-sft"),
             "train_data": str(project / "data/sft.jsonl")}, project, "trl-sft")
    return a, b, {"samples_per_step": 64, "start": "artifacts/pretrain/model", "ours_model": "artifacts/sft/model", "trl_model": "bench/trl-sft"}


def compare_grpo(project: Path, steps: int, prompts: int, n: int) -> tuple[dict, dict, dict]:
    hp = {"max_steps": steps, "lr": 1e-4, "warmup_steps": 3, "scheduler": "constant", "weight_decay": 0.1, "seed": 0,
          "prompts_per_step": prompts, "n_samples": n, "max_new_tokens": 8, "temperature": 1.0, "kl_coef": 0.01}
    shared = ("max_steps", "lr", "warmup_steps", "prompts_per_step", "n_samples", "max_new_tokens", "temperature", "kl_coef")
    key = {"prompts_per_step": "rollout.prompts_per_step", "n_samples": "rollout.n_samples", "max_new_tokens": "rollout.max_new_tokens",
           "temperature": "rollout.temperature", "kl_coef": "objective.kl_coef"}  # our rl config's sections
    a = ours("rl", {**{key.get(k, k): hp[k] for k in shared}, "algo": "grpo", "global_batch_size": prompts * n, "objective.kl_estimator": "k3",
                    "objective.kl_mode": "loss", "eval_steps": 0, "save_steps": steps}, project)
    b = trl({**hp, "mode": "grpo", "model": str(project / "artifacts/sft/model"), "out": str(project / "bench/trl-grpo"),
             "train_data": str(project / "data/rl.jsonl")}, project, "trl-grpo")
    return a, b, {"samples_per_step": prompts * n, "start": "artifacts/sft/model", "ours_model": "artifacts/rl/model", "trl_model": "bench/trl-grpo"}


def compare_dpo(project: Path, steps: int) -> tuple[dict, dict, dict]:
    hp = {"max_steps": steps, "lr": 2e-4, "warmup_steps": 5, "scheduler": "cosine", "weight_decay": 0.1, "seed": 0, "batch_size": 32,
          "max_len": 64, "beta": 0.1, "nll_coef": 1.0}
    a = ours("dpo", {**{k: hp[k] for k in ("max_steps", "lr", "warmup_steps", "beta", "nll_coef")}, "global_batch_size": hp["batch_size"],
                     "eval_steps": 0, "save_steps": steps}, project)
    b = trl({**hp, "mode": "dpo", "model": str(project / "artifacts/sft/model"), "out": str(project / "bench/trl-dpo"),
             "train_data": str(project / "data/prefs.jsonl")}, project, "trl-dpo")
    return a, b, {"samples_per_step": 32, "start": "artifacts/sft/model", "ours_model": "artifacts/dpo/model", "trl_model": "bench/trl-dpo"}


def tokens_per_sample(project: Path, name: str, a: dict, b: dict) -> tuple[float, float]:
    """Tokens one sample puts through the model (prompt with BOS, response, EOS; a DPO pair counts
    both sides), ours and TRL's: equal for sft and dpo (same rows, same tokenizer); for grpo the
    prompt plus each side's own mean completion length."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(project / "artifacts/pretrain/model"))
    n = lambda text, special=True: len(tok(text, add_special_tokens=special).input_ids)  # noqa: E731
    data = {"sft": "sft.jsonl", "grpo": "rl.jsonl", "dpo": "prefs.jsonl"}[name]
    rows = [json.loads(x) for x in (project / "data" / data).read_text().splitlines() if x.strip()]
    if name == "sft":
        t = statistics.mean(n(r["prompt"]) + n(r["response"], False) + 1 for r in rows)
        return t, t
    if name == "dpo":
        t = statistics.mean(2 * n(r["prompt"]) + n(r["chosen"], False) + n(r["rejected"], False) + 2 for r in rows)
        return t, t
    prompt = statistics.mean(n(r["prompt"]) for r in rows)
    ours_len = statistics.mean(r["rl/response_length"] for r in a["history"])
    trl_len = statistics.mean(r["completions/mean_length"] for r in b["log_history"] if "completions/mean_length" in r)
    return prompt + ours_len, prompt + trl_len


def report(name: str, a: dict, b: dict, info: dict, acc: dict, tokens: tuple[float, float]) -> dict:
    n = info["samples_per_step"]
    side = lambda r, model, t: {"median_step_s": r["median_step_s"], "samples_per_s": n / r["median_step_s"],  # noqa: E731
                                "tokens_per_s": n * t / r["median_step_s"], "command_wall_s": r["command_wall_s"],
                                "outside_steps_s": r["command_wall_s"] - sum(r["step_s"]), "accuracy": acc[info[model]]}
    row = {"ours": {**side(a, "ours_model", tokens[0]), "stage_eval_accuracy": a["metrics"].get("eval/accuracy")},
           "trl": side(b, "trl_model", tokens[1]),
           "start_accuracy": acc[info["start"]], "samples_per_step": n}
    row["ratio_samples_per_s"] = row["ours"]["samples_per_s"] / row["trl"]["samples_per_s"]
    row["ratio_command_wall"] = row["ours"]["command_wall_s"] / row["trl"]["command_wall_s"]
    print(f"\n== {name}: {n} samples/step, start accuracy {row['start_accuracy']:.3f}")
    print(f"{'':6} {'median step s':>14} {'samples/s':>10} {'tokens/s':>9} {'command s':>10} {'outside steps s':>16} {'accuracy':>9}")
    for name_, r in (("ours", row["ours"]), ("trl", row["trl"])):
        print(f"{name_:6} {r['median_step_s']:14.3f} {r['samples_per_s']:10.1f} {r['tokens_per_s']:9.0f} {r['command_wall_s']:10.1f} "
              f"{r['outside_steps_s']:16.1f} {r['accuracy']:9.3f}")
    print(f"ours/TRL: samples/s x{row['ratio_samples_per_s']:.2f}, command wall x{row['ratio_command_wall']:.2f}, "
          f"accuracy {row['ours']['accuracy'] - row['trl']['accuracy']:+.3f}  (our stage's own eval: {row['ours']['stage_eval_accuracy']})")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--project", default=str(ROOT / "build" / "bench-vs-trl"))
    ap.add_argument("--only", default="sft,grpo,dpo")
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--rl-steps", type=int, default=20)
    ap.add_argument("--rl-prompts", type=int, default=64)
    ap.add_argument("--rl-samples", type=int, default=8)
    ap.add_argument("--dpo-steps", type=int, default=100)
    args = ap.parse_args()
    if not BENCH_PY.exists():
        sys.exit("no .venv-bench/: run `make bench` (it builds the bench environment with trl pinned)")
    project = Path(args.project).resolve()
    ensure_project(project)
    only = args.only.split(",")
    runs = {}
    if "sft" in only:
        runs["sft"] = compare_sft(project, args.sft_steps)
    if not (project / "artifacts/sft/model/model.safetensors").exists():
        sys.exit("grpo and dpo start from our sft model: run with --only sft first (or all)")
    if "grpo" in only:
        runs["grpo"] = compare_grpo(project, args.rl_steps, args.rl_prompts, args.rl_samples)
    if "dpo" in only:
        runs["dpo"] = compare_dpo(project, args.dpo_steps)
    models = sorted({str(project / m) for _, _, info in runs.values() for m in (info["start"], info["ours_model"], info["trl_model"])})
    acc = trl({"mode": "eval", "models": models, "eval_data": str(project / "data/eval.jsonl"), "max_new_tokens": 8}, project, "eval")
    acc = {str(Path(m).relative_to(project)): v for m, v in acc.items() if m != "command_wall_s"}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    results = {name: report(name, *run, acc, tokens_per_sample(project, name, run[0], run[1])) for name, run in runs.items()}
    (project / "bench" / "vs_trl.json").write_text(json.dumps({"commit": commit, "args": vars(args), "results": results}, indent=2))
    print(f"\ncommit {commit}; everything in {project / 'bench' / 'vs_trl.json'}")


if __name__ == "__main__":
    main()
