"""Stage `sft`: prompt-masked NLL on `prompt,response` (or chat `messages`) rows; a
vision-language start model also takes image rows (`images`: the prompt's pictures, in order).

Reads top to bottom: config, data, main.  The loss and eval are the causal-LM ones
(`rlhf_core.training.lm`); the loop, workers, checkpoints and resume are shared
(`rlhf_core.training.loop`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlhf_core.data.images import with_images
from rlhf_core.data.tokenize import prompt_response, tokenize_rows
from rlhf_core.training import batching, entrypoint, inputs, results
from rlhf_core.training.config import TrainConfig
from rlhf_core.training.lm import count_tokens, loss_fn, make_evaluate
from rlhf_core.training.loop import StageSpec, train
from rlhf_core.training.worker_group import save_final_model


@dataclass(frozen=True, kw_only=True)
class Config(TrainConfig):
    model_path: str | None = "artifacts/pretrain/model"
    train_data: str = "data/sft.jsonl"
    eval_data: str = "data/eval.jsonl"
    output_dir: str = "artifacts/sft"
    max_steps: int = 300
    save_steps: int = 100
    lr: float = 5e-4
    warmup_steps: int = 20
    global_batch_size: int = 64
    use_chat_template: bool = False
    """Wrap `prompt` as a user turn with the tokenizer's chat template (error if it has none)."""
    label_prefix: str = " "
    """How an eval label is written as a response, for `eval/loss` (` 95` for label `95`)."""


# --- driver ---------------------------------------------------------------------------------


def build_spec(cfg: Config, out_dir: Path) -> tuple[StageSpec, object]:
    """(spec, what saves the tokenizer beside the model: the tokenizer, or a VLM's processor)."""
    tokenizer, vision = inputs.load_tokenizer(cfg), inputs.load_vision(cfg)
    format_prompt = inputs.prompt_formatter(tokenizer, cfg.use_chat_template, vision)
    rows = inputs.load_data(cfg.train_data, "sft", cfg, out_dir / "rejects" / "train.jsonl")
    encode = lambda r: with_images(prompt_response(tokenizer, format_prompt(r), inputs.response_text(r), cfg.max_len), r)  # noqa: E731
    examples, too_long = tokenize_rows(rows, encode, cfg.max_len)
    inputs.check_too_long(too_long, len(rows), cfg, out_dir / "rejects" / "train_too_long.jsonl")
    collate = batching.Collate(tokenizer.pad_token_id, vision=vision)
    evaluate = make_evaluate(cfg, tokenizer, format_prompt, collate, out_dir, vision)
    spec = StageSpec(name="sft", model_path=cfg.model_path, model_kind="causal_lm", examples=examples, collate=collate,
                     loss_fn=loss_fn, counts=count_tokens, evaluate=evaluate,
                     data_fingerprint=inputs.data_fingerprint(cfg), pad_token_id=tokenizer.pad_token_id, lineage=inputs.image_records(rows))
    return spec, (vision.processor if vision else tokenizer)  # a VLM's model/ gets its processor (the tokenizer with it)


def run(cfg: Config) -> dict:
    out_dir = Path(cfg.output_dir)
    spec, tokenizer = build_spec(cfg, out_dir)
    group, metrics = train(spec, cfg, out_dir)
    save_final_model(group, out_dir, tokenizer, results.model_card("sft", cfg, metrics, "Supervised fine-tuning (prompt-masked NLL)."))
    results.finish(out_dir, "sft", cfg, metrics, records=spec.lineage)
    return metrics


def main(argv: list[str] | None = None) -> None:
    entrypoint.stage_main(Config, "sft", run, argv)


if __name__ == "__main__":
    main()
