"""The vision-language recipe end to end (issue 21): `rlhf prepare --set prepare.modality=vision`,
sft of the tiny LLaVA on the shapes-counting rows, then grpo with the exact-count reward (HF engine),
as real Ray jobs in build/bench-vision/.  Prints held-out accuracy after each stage, per true
count, so what rl fixed is visible (sft learns the undercounted demonstrations of 3).

    python bench/vision.py                      # the documented recipe (docs/benchmarks.md)
    python bench/vision.py --undercount 0       # faithful demonstrations
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rlhf(cwd: Path, *args: str) -> float:
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "rlhf_core.cli", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"rlhf {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.time() - t0


def per_count(cwd: Path, model: str) -> dict[str, float]:
    """Greedy accuracy on data/eval.jsonl per true count (the stage's own eval, split by label)."""
    sys.path.insert(0, str(ROOT))
    from rlhf_core.data.images import VisionInputs
    from rlhf_core.models.load import load_model, load_processor, load_tokenizer
    from rlhf_core.rollout.hf_engine import greedy_generate

    path = str(cwd / model)
    m, tok, vision = load_model(path).eval(), load_tokenizer(path), VisionInputs(load_processor(path))
    rows = [json.loads(line) for line in (cwd / "data" / "eval.jsonl").read_text().splitlines()]
    refs = [[str(cwd / "data" / p) for p in r["images"]] for r in rows]
    outs = greedy_generate(m, [vision.prompt_ids(r["prompt"], f) for r, f in zip(rows, refs)], 3, tok.pad_token_id, tok.eos_token_id, 64,
                           [vision.pixel_values(f) for f in refs])
    hits = defaultdict(list)
    for r, o in zip(rows, outs):
        hits[r["label"]].append(tok.decode(o, skip_special_tokens=True).strip() == r["label"])
    return {k: round(sum(v) / len(v), 3) for k, v in sorted(hits.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--undercount", type=float, default=0.6, help="prepare.shapes.sft_undercount_rate")
    ap.add_argument("--sft-lr", type=float, default=1.5e-4)
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--rl-lr", type=float, default=1e-5)
    ap.add_argument("--rl-steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cwd = ROOT / "build" / "bench-vision"
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    seed = ["--set", f"prepare.seed={args.seed}"]
    t_prep = rlhf(cwd, "prepare", "--params", "none.yaml", "--set", "prepare.modality=vision", "--set",
                  f"prepare.shapes.sft_undercount_rate={args.undercount}", *seed)
    t_sft = rlhf(cwd, "stage", "run", "sft", "--params", "none.yaml", "--set", "sft.model_path=artifacts/base", "--set", f"sft.lr={args.sft_lr}",
                 "--set", f"sft.max_steps={args.sft_steps}", "--set", f"sft.save_steps={args.sft_steps}", "--set", "sft.cpus_per_worker=2",
                 "--set", f"sft.seed={args.seed}")
    t_rl = rlhf(cwd, "stage", "run", "rl", "--params", "none.yaml", "--set", "rl.model_path=artifacts/sft/model", "--set", "rl.rollout.engine=hf",
                "--set", "rl.algo=grpo", "--set", f"rl.lr={args.rl_lr}", "--set", f"rl.max_steps={args.rl_steps}", "--set",
                f"rl.save_steps={args.rl_steps}", "--set", "rl.rollout.prompts_per_step=32", "--set", "rl.rollout.n_samples=8",
                "--set", "rl.global_batch_size=256",
                "--set", "rl.eval_steps=20", "--set", f"rl.seed={args.seed}")
    sft = json.loads((cwd / "artifacts" / "sft" / "metrics.json").read_text())
    rl = json.loads((cwd / "artifacts" / "rl" / "metrics.json").read_text())
    print(f"settings: {vars(args)}")
    print(f"prepare {t_prep:.0f}s, sft {t_sft:.0f}s, rl {t_rl:.0f}s (commands, this machine)")
    print(f"sft: eval/accuracy {sft['eval/accuracy_init']:.3f} -> {sft['eval/accuracy']:.3f}   per count {per_count(cwd, 'artifacts/sft/model')}")
    print(f"rl:  eval/accuracy {rl['eval/accuracy_init']:.3f} -> {rl['eval/accuracy']:.3f} (best {rl['best/eval_accuracy']:.3f} "
          f"at step {rl['best/step']}), pass@4 {rl['eval/pass@4_init']:.3f} -> {rl['eval/pass@4']:.3f}   "
          f"per count {per_count(cwd, 'artifacts/rl/model')}")


if __name__ == "__main__":
    main()
