"""The TRL half of bench/vs_trl.py: runs in .venv-bench/ (trl pinned there, never in the project's
environment) and imports nothing from this project, so what it measures is TRL as a user runs it.

    .venv-bench/bin/python bench/trl_side.py SPEC.json     # writes SPEC's "result" path

SPEC: {"mode": "grpo" | "sft" | "dpo" | "eval", "model": DIR, "out": DIR, "result": FILE, ...the
hyperparameters vs_trl.py sets identically for both sides}.  `eval` is the one greedy exact-match
evaluator both sides' final models go through (the same rule as rlhf_core.evaluation: greedy, the
completion up to EOS, cut at the first newline, stripped, equal to the label)."""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback


def rows(path: str, n: int | None = None) -> list[dict]:
    out = [json.loads(line) for line in open(path) if line.strip()]
    return out[:n] if n else out


class StepTimer(TrainerCallback):
    """Wall time of every optimizer step (generation included for GRPO: it runs inside the step)."""

    def __init__(self):
        self.times, self.t0 = [], None

    def on_step_begin(self, args, state, control, **kw):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self.t0)


def common_args(spec: dict) -> dict:
    return dict(output_dir=spec["out"], max_steps=spec["max_steps"], learning_rate=spec["lr"], warmup_steps=spec["warmup_steps"],
                lr_scheduler_type="constant_with_warmup" if spec["scheduler"] == "constant" else "cosine", weight_decay=spec["weight_decay"],
                max_grad_norm=1.0, use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1, seed=spec["seed"],
                dataloader_num_workers=0, disable_tqdm=True)


def exact_match(completions: list[str], label: list[str], **kw) -> list[float]:
    """The gold reward of our rl stage's default (exact match of the answer against `label`)."""
    return [float(c.split("\n", 1)[0].strip() == str(y).strip()) for c, y in zip(completions, label)]


def grpo(spec: dict, tok, timer) -> list[dict]:
    from trl import GRPOConfig, GRPOTrainer

    data = rows(spec["train_data"])
    ds = Dataset.from_list([{"prompt": r["prompt"], "label": r["label"]} for r in data])
    batch = spec["prompts_per_step"] * spec["n_samples"]
    args = GRPOConfig(**common_args(spec), per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                      num_generations=spec["n_samples"], max_completion_length=spec["max_new_tokens"], temperature=spec["temperature"],
                      beta=spec["kl_coef"], epsilon=0.2, num_iterations=1, loss_type="dapo", scale_rewards="group")
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=exact_match, args=args, train_dataset=ds, processing_class=tok,
                          callbacks=[timer])
    trainer.train()
    trainer.save_model(spec["out"])
    return trainer.state.log_history


def sft(spec: dict, tok, timer) -> list[dict]:
    from trl import SFTConfig, SFTTrainer

    # prompt-completion rows: the loss on the completion only, EOS appended (as our sft)
    ds = Dataset.from_list([{"prompt": r["prompt"], "completion": r["response"]} for r in rows(spec["train_data"])])
    args = SFTConfig(**common_args(spec), per_device_train_batch_size=spec["batch_size"], gradient_accumulation_steps=1,
                     max_length=spec["max_len"], completion_only_loss=True, packing=False)
    trainer = SFTTrainer(model=spec["model"], args=args, train_dataset=ds, processing_class=tok, callbacks=[timer])
    trainer.train()
    trainer.save_model(spec["out"])
    return trainer.state.log_history


def dpo(spec: dict, tok, timer) -> list[dict]:
    from trl import DPOConfig, DPOTrainer

    ds = Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows(spec["train_data"])])
    # our dpo's default is RPO: the sigmoid loss plus the chosen answer's NLL (weight nll_coef)
    args = DPOConfig(**common_args(spec), per_device_train_batch_size=spec["batch_size"], gradient_accumulation_steps=1,
                     beta=spec["beta"], loss_type=["sigmoid", "sft"], loss_weights=[1.0, spec["nll_coef"]], max_length=spec["max_len"])
    trainer = DPOTrainer(model=spec["model"], args=args, train_dataset=ds, processing_class=tok, callbacks=[timer])
    trainer.train()
    trainer.save_model(spec["out"])
    return trainer.state.log_history


@torch.no_grad()
def evaluate(model_dir: str, eval_path: str, max_new_tokens: int, batch_size: int = 64) -> float:
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    data = rows(eval_path)
    right = 0
    for i in range(0, len(data), batch_size):
        part = data[i:i + batch_size]
        enc = tok([r["prompt"] for r in part], return_tensors="pt", padding=True)
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        for r, ids in zip(part, out[:, enc["input_ids"].shape[1]:].tolist()):
            ids = ids[:ids.index(tok.eos_token_id)] if tok.eos_token_id in ids else ids
            right += tok.decode(ids, skip_special_tokens=True).split("\n", 1)[0].strip() == str(r["label"]).strip()
    return right / len(data)


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    torch.manual_seed(spec.get("seed", 0))
    if spec["mode"] == "eval":
        result = {m: evaluate(m, spec["eval_data"], spec["max_new_tokens"]) for m in spec["models"]}
    else:
        tok = AutoTokenizer.from_pretrained(spec["model"])
        timer, t0 = StepTimer(), time.perf_counter()
        logs = {"grpo": grpo, "sft": sft, "dpo": dpo}[spec["mode"]](spec, tok, timer)
        result = {"train_wall_s": time.perf_counter() - t0, "step_s": timer.times, "log_history": logs,
                  "median_step_s": statistics.median(timer.times) if timer.times else None}
    with open(spec["result"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
