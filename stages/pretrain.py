"""Stage `pretrain`: causal-LM training with sequence packing on a text corpus (`text` rows).

On the embedded task it turns the random base model of `prepare` into a base model that has
read the corpus `prepare` writes (`data/pretrain.jsonl`: worked examples in several layouts and
right/wrong verdicts on claimed answers).  At a user's site it is continued pretraining: point
`pretrain.model_path` at a model and `pretrain.train_data` at a JSONL/Parquet/HF dataset with a
`text` column.

Reads top to bottom: config, data (tokenize, pack), main.  The loss is sft's with every token
counted (`rlhf_core.training.lm`); the loop, workers, checkpoints and resume are shared
(`rlhf_core.training.loop`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.data.tokenize import pack_documents
from rlhf_core.training import batching, entrypoint, inputs, results
from rlhf_core.training.config import TrainConfig
from rlhf_core.training.lm import count_tokens, loss_fn, make_evaluate
from rlhf_core.training.loop import StageSpec, train
from rlhf_core.training.worker_group import save_final_model

log = logging.getLogger("rlhf.pretrain")


@dataclass(frozen=True, kw_only=True)
class Config(TrainConfig):
    model_path: str | None = "artifacts/base"
    train_data: str = "data/pretrain.jsonl"
    eval_data: str = "data/eval.jsonl"
    """Task prompts with labels: `eval/accuracy` tells how much of the task the base model already does."""
    output_dir: str = "artifacts/pretrain"
    max_steps: int = 800
    """At 400 steps the base sits on its late jump in task accuracy (0.31-0.725 over seeds and CPUs);
    at 800 it is past it (0.955-1.0): the chain below starts from the same place everywhere."""
    save_steps: int = 200
    log_steps: int = 25
    global_batch_size: int = 16
    """Packed windows per step (global_batch_size x max_len tokens)."""
    max_len: int = 128
    """Window length of the packing (tokens); documents are concatenated and cut to it."""
    lr: float = 2e-3
    warmup_steps: int = 40
    max_chars: int = 100_000
    label_prefix: str = " "
    """How an eval label is written as a response, for `eval/loss`."""


def build_spec(cfg: Config, out_dir: Path) -> tuple[StageSpec, object]:
    tokenizer = inputs.load_tokenizer(cfg)
    rows = inputs.load_data(cfg.train_data, "text", cfg, out_dir / "rejects" / "train.jsonl")
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    docs = [bos + tokenizer(r["text"], add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for r in rows]
    windows, dropped = pack_documents(docs, cfg.max_len, cfg.seed)
    if len(windows) < cfg.global_batch_size:
        raise ValueError(f"{cfg.train_data}: {sum(map(len, docs))} tokens make {len(windows)} windows of max_len={cfg.max_len}, "
                         f"fewer than global_batch_size={cfg.global_batch_size}; add text or lower them")
    tokens = len(windows) * cfg.max_len
    log.info("%d documents -> %d windows of %d tokens (%d tokens, %d dropped at the end); %d steps see %.1f epochs",
             len(docs), len(windows), cfg.max_len, tokens, dropped, cfg.max_steps, cfg.max_steps * cfg.global_batch_size / len(windows))
    collate = batching.Collate(tokenizer.pad_token_id)
    evaluate = make_evaluate(cfg, tokenizer, inputs.prompt_formatter(tokenizer, False), collate, out_dir)
    spec = StageSpec(name="pretrain", model_path=cfg.model_path, model_kind="causal_lm", examples=windows, collate=collate,
                     loss_fn=loss_fn, counts=count_tokens, evaluate=evaluate,
                     data_fingerprint=inputs.data_fingerprint(cfg), pad_token_id=tokenizer.pad_token_id)
    return spec, tokenizer


def run(cfg: Config) -> dict:
    out_dir = Path(cfg.output_dir)
    spec, tokenizer = build_spec(cfg, out_dir)
    group, metrics = train(spec, cfg, out_dir)
    metrics["train/tokens"] = metrics["train/steps"] * cfg.global_batch_size * cfg.max_len
    card = results.model_card("pretrain", cfg, metrics, "Causal-LM pretraining with sequence packing (every token in the loss).")
    save_final_model(group, out_dir, tokenizer, card)
    results.finish(out_dir, "pretrain", cfg, metrics)
    return metrics


def main(argv: list[str] | None = None) -> None:
    entrypoint.stage_main(Config, "pretrain", run, argv)


if __name__ == "__main__":
    main()
