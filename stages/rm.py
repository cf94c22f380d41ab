"""Stage `rm`: a Bradley-Terry reward model on `prompt,chosen,rejected` pairs.

The sft model gets a one-logit head.  `pooling` says where the reward is read:

  last           the logit at the last non-pad token (`AutoModelForSequenceClassification`): the
                 classic RM (OpenRLHF, TRL)
  response_sum   a logit at every token (`AutoModelForTokenClassification`), summed over the
  response_mean  response tokens (or averaged): a dense, token-level reward whose sum is the score
  logprob        no head: the response's summed log-probability under the model itself
                 (`AutoModelForCausalLM`), a reference-free implicit reward (the reward of SimPO,
                 unnormalised by length); BT training makes the model's likelihood rank the pairs

On the embedded task (docs/benchmarks.md, "the learning chain") `response_sum` learns faster than
`last` -- each answer token's score only has to compare that token with what the model predicted
one position earlier, while `last` must route every digit's verdict to one position -- and
`logprob` starts where the others end: the sft model already ranks most held-out pairs right by
likelihood, so BT training only has to correct what sft got wrong.
Metrics: `eval/pair_accuracy` on held-out near-miss pairs (`eval/pair_accuracy_random` on the same
prompts with random wrong answers) and the reward mean/std there, saved with the model
(`reward_stats.json`, with the pooling) for the rl stage's normalisation.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

from rlhf_core import atomic
from rlhf_core.algos.aggregation import masked_sum, pool_response
from rlhf_core.algos.losses import RM_LOSSES, rm_centering_loss, token_logprobs
from rlhf_core.models.shared_prefix import model_logits
from rlhf_core.training import batching, entrypoint, inputs, results
from rlhf_core.training.config import TrainConfig
from rlhf_core.training.loop import StageSpec, train
from rlhf_core.training.worker_group import save_final_model


@dataclass(frozen=True, kw_only=True)
class Config(TrainConfig):
    model_path: str | None = "artifacts/sft/model"
    train_data: str = "data/prefs.jsonl"
    eval_data: str = "data/eval_prefs.jsonl"
    """Held-out pairs whose rejected answer is a near miss (off by one or ten, swapped digits)."""
    eval_random_data: str | None = "data/eval_prefs_random.jsonl"
    """The same held-out prompts with a random wrong number rejected (`eval/pair_accuracy_random`);
    None, or a file that does not exist, skips it."""
    output_dir: str = "artifacts/rm"
    max_steps: int = 150
    save_steps: int = 50
    lr: float = 1e-3
    loss: Literal["sigmoid", "logexp"] = "sigmoid"
    """Pairwise loss (`algos.losses.RM_LOSSES`)."""
    margin: float = 0.0
    """Margin of the sigmoid loss."""
    center_rewards_coef: float = 0.0
    """Weight of the reward centring term mean((r_c + r_r)^2) (TRL `center_rewards_coefficient`,
    0.01 in its docs); 0 is off.  Meant for the head poolings: with `logprob` it pulls the
    log-likelihoods themselves towards 0."""
    pooling: Literal["last", "response_sum", "response_mean", "logprob"] = "last"
    """Where the reward is read: the last token, per token summed/averaged over the response, or
    the response's summed log-probability under the model (no head)."""
    shared_prefix: bool = True
    """With `pooling=logprob`, forwards compute a pair's prompt once for both responses
    (`rlhf_core.models.shared_prefix`; the same rewards and gradients).  The head poolings read
    every position of their own sequence and are not packed."""


# --- maths: run inside the workers ---------------------------------------------------------


MODEL_KINDS = {"last": "reward", "response_sum": "value", "response_mean": "value", "logprob": "causal_lm"}
"""pooling -> the model class the workers load (sequence head, token head, plain LM)."""


def rewards_of(model, batch, pooling: str):
    """Scalar reward per sequence `(2B,)`: chosen first, then rejected."""
    if pooling == "logprob":
        logits = model_logits(model, batch, {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]})
        logprobs = token_logprobs(logits, batch["input_ids"][:, 1:])
        return masked_sum(logprobs, batch["loss_mask"][:, 1:].float(), dim=-1)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1).float()
    if pooling == "last":
        return logits
    return pool_response(logits, batch["loss_mask"].float(), pooling)


def loss_fn(model, batch, counts, loss: str, margin: float, pooling: str, center_rewards_coef: float = 0.0):
    rewards = rewards_of(model, batch, pooling)
    b = rewards.shape[0] // 2
    value, stats = RM_LOSSES[loss](rewards[:b], rewards[b:], margin)
    if center_rewards_coef:
        centring = rm_centering_loss(rewards[:b], rewards[b:])
        value = value + center_rewards_coef * centring
        stats["centring"] = centring.detach()
    return value * b / counts["num_pairs"], stats  # mean over the global batch, summed over ranks


def pair_rewards_fn(model, batch, pooling: str):
    return batching.split_pairs(rewards_of(model, batch, pooling))


# --- driver ---------------------------------------------------------------------------------


def build_spec(cfg: Config, out_dir: Path):
    tokenizer = inputs.load_tokenizer(cfg)
    fmt = inputs.prompt_formatter(tokenizer, False)
    pairs = inputs.load_pairs(cfg.train_data, cfg, tokenizer, fmt, out_dir / "rejects", "train")
    eval_pairs = inputs.load_pairs(cfg.eval_data, cfg, tokenizer, fmt, out_dir / "rejects", "eval")
    random_pairs = (inputs.load_pairs(cfg.eval_random_data, cfg, tokenizer, fmt, out_dir / "rejects", "eval_random")
                    if cfg.eval_random_data and Path(cfg.eval_random_data).exists() else None)
    collate = batching.CollatePairs(tokenizer.pad_token_id, shared_prefix=cfg.shared_prefix and cfg.pooling == "logprob")

    def pair_rewards(group, pairs) -> list:
        return group.call_rank0("evaluate", batching.batches(collate, pairs, cfg.eval_batch_size), partial(pair_rewards_fn, pooling=cfg.pooling))

    def evaluate(group) -> dict:
        pr = pair_rewards(group, eval_pairs)
        flat = [r for pair in pr for r in pair]
        mean = sum(flat) / len(flat)
        std = (sum((r - mean) ** 2 for r in flat) / max(1, len(flat) - 1)) ** 0.5
        out = {"eval/pair_accuracy": sum(c > r for c, r in pr) / len(pr), "eval/reward_mean": mean, "eval/reward_std": std}
        if random_pairs:
            out["eval/pair_accuracy_random"] = sum(c > r for c, r in pair_rewards(group, random_pairs)) / len(random_pairs)
        return out

    spec = StageSpec(name="rm", model_path=cfg.model_path, model_kind=MODEL_KINDS[cfg.pooling], examples=pairs,
                     collate=collate, loss_fn=partial(loss_fn, loss=cfg.loss, margin=cfg.margin, pooling=cfg.pooling,
                                                     center_rewards_coef=cfg.center_rewards_coef), counts=batching.count_pairs,
                     evaluate=evaluate, data_fingerprint=inputs.data_fingerprint(cfg), pad_token_id=tokenizer.pad_token_id)
    return spec, tokenizer


def run(cfg: Config) -> dict:
    out_dir = Path(cfg.output_dir)
    spec, tokenizer = build_spec(cfg, out_dir)
    group, metrics = train(spec, cfg, out_dir)
    where = {"last": "the logit at the last non-pad token", "response_sum": "the per-token logits summed over the response tokens",
             "response_mean": "the per-token logits averaged over the response tokens",
             "logprob": "the response's summed log-probability under this causal LM"}[cfg.pooling]
    card = results.model_card("rm", cfg, metrics, f"Reward model: the sft model (with a one-logit head unless `logprob`), trained with a pairwise "
                             f"Bradley-Terry loss. Reward = {where} (`reward_stats.json` has the pooling and the normalisation).")
    model_dir = save_final_model(group, out_dir, tokenizer, card)
    # what the rl stage uses to normalise rewards from this model
    stats = {"mean": metrics["eval/reward_mean"], "std": metrics["eval/reward_std"], "pooling": cfg.pooling}
    atomic.write_json(model_dir / "reward_stats.json", stats)
    results.finish(out_dir, "rm", cfg, metrics)
    return metrics


def main(argv: list[str] | None = None) -> None:
    entrypoint.stage_main(Config, "rm", run, argv)


if __name__ == "__main__":
    main()
