"""Stage `rm`: a Bradley-Terry reward model on `prompt,chosen,rejected` pairs.

The sft model gets a one-logit sequence-classification head (`AutoModelForSequenceClassification`,
num_labels=1); the reward is that logit at the last non-pad token.  Metrics: `eval/pair_accuracy`
on held-out pairs and the reward mean/std there (saved with the model for later normalisation).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

from rlhf_core.algos.losses import RM_LOSSES
from rlhf_core.training import common
from rlhf_core.training.config import TrainConfig
from rlhf_core.training.loop import StageSpec, save_final_model, train


@dataclass(frozen=True, kw_only=True)
class Config(TrainConfig):
    model_path: str | None = "artifacts/sft/model"
    train_data: str = "data/prefs.jsonl"
    eval_data: str = "data/eval_prefs.jsonl"
    output_dir: str = "artifacts/rm"
    max_steps: int = 150
    save_steps: int = 50
    lr: float = 1e-3
    loss: Literal["sigmoid", "logexp"] = "sigmoid"
    """Pairwise loss (`algos.losses.RM_LOSSES`)."""
    margin: float = 0.0
    """Margin of the sigmoid loss."""


# --- maths: run inside the workers ---------------------------------------------------------


def rewards_of(model, batch):
    """Scalar reward per sequence `(2B,)`: chosen first, then rejected."""
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1).float()


def loss_fn(model, batch, counts, loss: str, margin: float):
    rewards = rewards_of(model, batch)
    b = rewards.shape[0] // 2
    value, stats = RM_LOSSES[loss](rewards[:b], rewards[b:], margin)
    return value * b / counts["num_pairs"], stats  # mean over the global batch, summed over ranks


def pair_rewards_fn(model, batch):
    return common.split_pairs(rewards_of(model, batch))


# --- driver ---------------------------------------------------------------------------------


def build_spec(cfg: Config, out_dir: Path):
    tokenizer = common.load_tokenizer(cfg)
    fmt = common.prompt_formatter(tokenizer, False)
    pairs = common.load_pairs(cfg.train_data, cfg, tokenizer, fmt, out_dir / "rejects", "train")
    eval_pairs = common.load_pairs(cfg.eval_data, cfg, tokenizer, fmt, out_dir / "rejects", "eval")
    collate = common.CollatePairs(tokenizer.pad_token_id)

    def evaluate(group) -> dict:
        pr = group.call_rank0("evaluate", common.batches(collate, eval_pairs, cfg.eval_batch_size), pair_rewards_fn)
        flat = [r for pair in pr for r in pair]
        mean = sum(flat) / len(flat)
        std = (sum((r - mean) ** 2 for r in flat) / max(1, len(flat) - 1)) ** 0.5
        return {"eval/pair_accuracy": sum(c > r for c, r in pr) / len(pr), "eval/reward_mean": mean, "eval/reward_std": std}

    spec = StageSpec(name="rm", model_path=cfg.model_path, model_kind="reward", examples=pairs, collate=collate,
                     loss_fn=partial(loss_fn, loss=cfg.loss, margin=cfg.margin), counts=common.count_pairs,
                     evaluate=evaluate, data_fingerprint=common.data_fingerprint(cfg), pad_token_id=tokenizer.pad_token_id)
    return spec, tokenizer


def run(cfg: Config) -> dict:
    out_dir = Path(cfg.output_dir)
    spec, tokenizer = build_spec(cfg, out_dir)
    group, metrics = train(spec, cfg, out_dir)
    card = common.model_card("rm", cfg, metrics, "Reward model: Llama with a one-logit sequence-classification head, "
                             "trained with a pairwise Bradley-Terry loss. Reward = logit at the last non-pad token.")
    model_dir = save_final_model(group, out_dir, tokenizer, card)
    # what the rl stage uses to normalise rewards from this model
    (model_dir / "reward_stats.json").write_text(json.dumps({"mean": metrics["eval/reward_mean"], "std": metrics["eval/reward_std"]}, indent=2))
    common.finish(out_dir, "rm", cfg, metrics)
    return metrics


def main(argv: list[str] | None = None) -> None:
    common.stage_main(Config, "rm", run, argv)


if __name__ == "__main__":
    main()
