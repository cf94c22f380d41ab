"""Stage `sft`: prompt-masked NLL on `prompt,response` (or chat `messages`) rows.

Reads top to bottom: config, data, maths (loss + eval), main.  The loop, workers, checkpoints
and resume are shared (`rlhf_core.training.loop`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rlhf_core.algos.losses import sft_loss, token_logprobs
from rlhf_core.data.tokenize import prompt_response, tokenize_rows
from rlhf_core.training import common
from rlhf_core.training.config import TrainConfig
from rlhf_core.training.loop import StageSpec, save_final_model, train


@dataclass(frozen=True, kw_only=True)
class Config(TrainConfig):
    model_path: str | None = "artifacts/pretrain/model"
    train_data: str = "data/sft.jsonl"
    eval_data: str = "data/eval.jsonl"
    output_dir: str = "artifacts/sft"
    max_steps: int = 800
    save_steps: int = 200
    lr: float = 3e-3
    lr_scheduler: Literal["cosine", "constant"] = "constant"
    global_batch_size: int = 64
    use_chat_template: bool = False
    """Wrap `prompt` as a user turn with the tokenizer's chat template (error if it has none)."""
    label_prefix: str = " "
    """How an eval label is written as a response, for `eval/loss` (` 95` for label `95`)."""


# --- maths: run inside the workers ---------------------------------------------------------


def loss_fn(model, batch, counts):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    logprobs = token_logprobs(logits, batch["input_ids"][:, 1:])
    return sft_loss(logprobs, batch["loss_mask"][:, 1:], num_tokens=counts["num_tokens"])


def nll_fn(model, batch):
    """Per example (summed NLL, tokens) of the response."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    logprobs = token_logprobs(logits, batch["input_ids"][:, 1:])
    mask = batch["loss_mask"][:, 1:].float()
    return list(zip((-(logprobs * mask).sum(-1)).tolist(), mask.sum(-1).tolist()))


def count_tokens(batch: list[dict]) -> dict:
    return {"num_tokens": sum(sum(e["loss_mask"]) for e in batch)}


# --- driver ---------------------------------------------------------------------------------


def build_spec(cfg: Config, out_dir: Path) -> tuple[StageSpec, object]:
    tokenizer = common.load_tokenizer(cfg)
    format_prompt = common.prompt_formatter(tokenizer, cfg.use_chat_template)
    rows = common.load_data(cfg.train_data, "sft", cfg, out_dir / "rejects" / "train.jsonl")
    examples, too_long = tokenize_rows(rows, lambda r: prompt_response(tokenizer, format_prompt(r), common.response_text(r), cfg.max_len), cfg.max_len)
    common.check_too_long(too_long, len(rows), cfg, out_dir / "rejects" / "train_too_long.jsonl")
    collate = common.Collate(tokenizer.pad_token_id)
    evaluate = make_evaluate(cfg, tokenizer, format_prompt, collate, out_dir)
    spec = StageSpec(name="sft", model_path=cfg.model_path, model_kind="causal_lm", examples=examples, collate=collate,
                     loss_fn=loss_fn, counts=count_tokens, evaluate=evaluate,
                     data_fingerprint=common.data_fingerprint(cfg), pad_token_id=tokenizer.pad_token_id)
    return spec, tokenizer


def make_evaluate(cfg, tokenizer, format_prompt, collate, out_dir: Path):
    """`eval/accuracy` (greedy, exact match) and `eval/loss` (NLL of ` label`) on `cfg.eval_data`."""
    eval_rows = common.load_data(cfg.eval_data, "rl", cfg, out_dir / "rejects" / "eval.jsonl")
    eval_prompts = [format_prompt(r) for r in eval_rows]
    eval_examples, eval_too_long = tokenize_rows(eval_rows, lambda r: prompt_response(tokenizer, format_prompt(r), cfg.label_prefix + r["label"], cfg.max_len), cfg.max_len)
    common.check_too_long(eval_too_long, len(eval_rows), cfg, out_dir / "rejects" / "eval_too_long.jsonl")

    def evaluate(group) -> dict:
        metrics = common.eval_accuracy(group, tokenizer, eval_prompts, [r["label"] for r in eval_rows], cfg)
        nll = group.call_rank0("evaluate", common.batches(collate, eval_examples, cfg.eval_batch_size), nll_fn)
        metrics["eval/loss"] = sum(s for s, _ in nll) / max(1.0, sum(n for _, n in nll))
        return metrics
    return evaluate


def run(cfg: Config) -> dict:
    out_dir = Path(cfg.output_dir)
    spec, tokenizer = build_spec(cfg, out_dir)
    group, metrics = train(spec, cfg, out_dir)
    save_final_model(group, out_dir, tokenizer, common.model_card("sft", cfg, metrics, "Supervised fine-tuning (prompt-masked NLL)."))
    common.finish(out_dir, "sft", cfg, metrics)
    return metrics


def main(argv: list[str] | None = None) -> None:
    common.stage_main(Config, "sft", run, argv)


if __name__ == "__main__":
    main()
