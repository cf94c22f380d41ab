"""Stage `dpo`: direct preference optimisation (sigmoid / IPO / cDPO, optional NLL term).

The reference is the starting model: its summed log-probs of every chosen and rejected response
are computed once per example, by the workers before any update, and cached beside the
checkpoints (a resume reuses them, never recomputes them from trained weights), keyed by the
data and the starting model's content (a retrained sft model at the same path is another key).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

from rlhf_core import atomic
from rlhf_core.algos.losses import dpo_loss, kto_loss, token_logprobs
from rlhf_core.data.io import write_jsonl
from rlhf_core.data.tokenize import forward_inputs, prompt_response, tokenize_rows
from rlhf_core.models.shared_prefix import model_logits
from rlhf_core.training import batching, entrypoint, inputs, results
from rlhf_core.training.chassis import upstream_digest
from rlhf_core.training.config import TrainConfig
from rlhf_core.training.loop import StageSpec, train
from rlhf_core.training.worker_group import save_final_model


@dataclass(frozen=True, kw_only=True)
class Config(TrainConfig):
    model_path: str | None = "artifacts/sft/model"
    train_data: str = "data/prefs.jsonl"
    eval_data: str = "data/eval.jsonl"
    eval_pairs: str | None = "data/eval_prefs.jsonl"
    """Held-out preference pairs: each pair's implicit rewards beta (log pi - log ref) at the end go
    to `eval_pair_rewards.jsonl`, and `eval/rewards_accuracy` / `eval/rewards_margin` to the
    metrics.  None, or a file that does not exist, skips it."""
    output_dir: str = "artifacts/dpo"
    max_steps: int = 100
    save_steps: int = 50
    lr: float = 2e-4
    warmup_steps: int = 5
    beta: float = 0.1
    loss_type: Literal["sigmoid", "cdpo", "robust", "hinge", "ipo", "ipo_norm", "sigmoid_norm", "kto_pair", "kto"] = "sigmoid"
    """The DPO-family loss (`rlhf_core/algos/losses.py:dpo_loss`, docs/algorithms.md).  `kto` trains
    on unpaired rows instead (`prompt, completion, label` with label true = desirable; `kto_loss`)."""
    desirable_weight: float = 1.0
    """KTO's weight of desirable completions (lambda_D)."""
    undesirable_weight: float = 1.0
    """KTO's weight of undesirable completions (lambda_U)."""
    label_smoothing: float = 0.0
    """Label noise: cDPO's smoothing (cdpo, sigmoid, sigmoid_norm) or robust DPO's flip rate (< 0.5)."""
    nll_coef: float = 1.0
    """Weight of the chosen-response NLL term (RPO, Pang et al. 2024); 0 is plain DPO.  On the
    default task's near-miss pairs plain DPO lowers both responses' likelihood and greedy accuracy
    falls (sft 0.80 -> 0.49 in 30 steps, 0.695 in 100); with the term: 0.975 and 0.99."""

    shared_prefix: bool = True
    """Forwards compute a pair's prompt once for both responses (`rlhf_core.models.shared_prefix`):
    the same log-probs and gradients, ~1.5x fewer tokens on the default task.  Text models only."""

    def __post_init__(self):
        super().__post_init__()
        if self.loss_type == "robust" and not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"dpo.loss_type=robust needs 0 <= dpo.label_smoothing < 0.5 (the label flip rate), got {self.label_smoothing}")


# --- maths: run inside the workers ---------------------------------------------------------


def sequence_logps(model, batch):
    """Summed response log-probs and response lengths, `(2B,)` each: chosen first, then rejected."""
    logits = model_logits(model, batch, forward_inputs(batch))
    logprobs = token_logprobs(logits, batch["input_ids"][:, 1:])
    mask = batch["loss_mask"][:, 1:].to(logprobs.dtype)
    return (logprobs * mask).sum(-1), mask.sum(-1)


def loss_fn(model, batch, counts, beta: float, loss_type: str, label_smoothing: float, nll_coef: float,
            desirable_weight: float = 1.0, undesirable_weight: float = 1.0):
    logps, lengths = sequence_logps(model, batch)
    b = logps.shape[0] // 2
    if loss_type == "kto":  # the "pairs" are (completion, mismatched completion for the KL estimate)
        loss, stats = kto_loss(logps[:b], batch["ref_chosen"], logps[b:], batch["ref_rejected"], batch["desirable"], beta=beta,
                               desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
        if nll_coef:  # RPO's NLL term, on the desirable completions only
            nll = -logps[:b] / lengths[:b].clamp(min=1)
            loss = loss + nll_coef * (nll * batch["desirable"]).mean()
        return loss * b / counts["num_pairs"], stats
    loss, stats = dpo_loss(logps[:b], logps[b:], batch["ref_chosen"], batch["ref_rejected"], beta=beta, loss_type=loss_type,
                           label_smoothing=label_smoothing, chosen_nll=-logps[:b] / lengths[:b].clamp(min=1), nll_coef=nll_coef,
                           chosen_lengths=lengths[:b], rejected_lengths=lengths[b:])
    return loss * b / counts["num_pairs"], stats


def ref_logps_fn(model, batch):
    return batching.split_pairs(sequence_logps(model, batch)[0])


# --- driver ---------------------------------------------------------------------------------


def load_unpaired(cfg: Config, tokenizer, fmt, rejects_dir: Path) -> list[dict]:
    """KTO rows as the pair layout the workers batch: `chosen` = prompt_i + completion_i,
    `rejected` = prompt_i + completion_{i+1} (a mismatched completion, for KTO's KL reference
    point; fixed at load, so resumes see the same), `desirable` = the label as 1.0 / 0.0."""
    rows = inputs.load_data(cfg.train_data, "unpaired", cfg, rejects_dir / "train.jsonl")
    if len(rows) < 2:
        raise ValueError(f"dpo.loss_type=kto needs at least 2 rows in {cfg.train_data} "
                         "(the KL estimate pairs each prompt with another row's completion)")

    def example(row: dict) -> dict:
        i = row["row_index_"]
        prompt, other = fmt(rows[i]), rows[(i + 1) % len(rows)]["completion"]
        real = prompt_response(tokenizer, prompt, rows[i]["completion"], cfg.max_len)
        mismatched = prompt_response(tokenizer, prompt, other, cfg.max_len)
        return {"chosen": real, "rejected": mismatched, "desirable": float(rows[i]["label"]),
                "num_tokens": len(real["input_ids"]) + len(mismatched["input_ids"])}

    examples, too_long = tokenize_rows([{"row_index_": i, "id": r.get("id")} for i, r in enumerate(rows)], example, cfg.max_len)
    inputs.check_too_long(too_long, len(rows), cfg, rejects_dir / "train_too_long.jsonl")
    return examples


def build_spec(cfg: Config, out_dir: Path):
    tokenizer, vision = inputs.load_tokenizer(cfg), inputs.load_vision(cfg)
    fmt = inputs.prompt_formatter(tokenizer, False, vision)
    kto = cfg.loss_type == "kto"
    if kto and vision is not None:
        raise ValueError("dpo.loss_type=kto on a vision-language model is not supported yet (the pair losses are)")
    pairs = load_unpaired(cfg, tokenizer, fmt, out_dir / "rejects") if kto else inputs.load_pairs(cfg.train_data, cfg, tokenizer, fmt,
                                                                                                  out_dir / "rejects", "train")
    eval_rows = inputs.load_data(cfg.eval_data, "rl", cfg, out_dir / "rejects" / "eval.jsonl")
    eval_prompts = [fmt(r) for r in eval_rows]
    held_out = (inputs.load_pairs(cfg.eval_pairs, cfg, tokenizer, fmt, out_dir / "rejects", "eval_pairs")
                if cfg.eval_pairs and Path(cfg.eval_pairs).exists() else [])
    collate = batching.CollatePairs(tokenizer.pad_token_id, extra=("ref_chosen", "ref_rejected") + (("desirable",) if kto else ()), vision=vision,
                                  shared_prefix=cfg.shared_prefix)
    plain = batching.CollatePairs(tokenizer.pad_token_id, vision=vision, shared_prefix=cfg.shared_prefix)
    pixels = results.eval_pixels(vision, eval_rows)
    fingerprint = inputs.data_fingerprint(cfg)
    cache = out_dir / "checkpoints" / "reference_logps.json"

    def compute_reference(group) -> None:
        """Once per example with the starting weights; cached for resumes (keyed by data + model)."""
        key = {"data": fingerprint, "model": upstream_digest(cfg.model_path)}
        cached = json.loads(cache.read_text()) if cache.is_file() else {}
        if cached.get("key") == key:
            values = cached["logps"]
        else:
            values = group.call_rank0("evaluate", batching.batches(plain, pairs, cfg.eval_batch_size), ref_logps_fn)
            atomic.write_text(cache, json.dumps({"key": key, "logps": values}))
        for pair, (c, r) in zip(pairs, values):
            pair["ref_chosen"], pair["ref_rejected"] = c, r
        # the held-out pairs' reference too: these are the starting weights on every run, resumed or not
        for pair, (c, r) in zip(held_out, group.call_rank0("evaluate", batching.batches(plain, held_out, cfg.eval_batch_size), ref_logps_fn)):
            pair["ref_chosen"], pair["ref_rejected"] = c, r

    def held_out_rewards(group) -> tuple[list[dict], dict]:
        """Per held-out pair: implicit rewards beta (log pi - log ref) of chosen and rejected, with
        the decoded texts; and their accuracy / mean margin."""
        if not held_out:
            return [], {}
        logps = group.call_rank0("evaluate", batching.batches(plain, held_out, cfg.eval_batch_size), ref_logps_fn)
        rows = [{"pair": i, "chosen": tokenizer.decode(p["chosen"]["input_ids"]), "rejected": tokenizer.decode(p["rejected"]["input_ids"]),
                 "chosen_reward": cfg.beta * (c - p["ref_chosen"]), "rejected_reward": cfg.beta * (r - p["ref_rejected"])}
                for i, (p, (c, r)) in enumerate(zip(held_out, logps))]
        margins = [row["chosen_reward"] - row["rejected_reward"] for row in rows]
        return rows, {"eval/rewards_accuracy": sum(m > 0 for m in margins) / len(rows), "eval/rewards_margin": sum(margins) / len(rows)}

    def evaluate(group) -> dict:
        return results.eval_accuracy(group, tokenizer, eval_prompts, [r["label"] for r in eval_rows], cfg, pixels)

    spec = StageSpec(name="dpo", model_path=cfg.model_path, model_kind="causal_lm", examples=pairs, collate=collate,
                     loss_fn=partial(loss_fn, beta=cfg.beta, loss_type=cfg.loss_type, label_smoothing=cfg.label_smoothing, nll_coef=cfg.nll_coef,
                                     desirable_weight=cfg.desirable_weight, undesirable_weight=cfg.undesirable_weight),
                     counts=batching.count_pairs, evaluate=evaluate, data_fingerprint=fingerprint,
                     pad_token_id=tokenizer.pad_token_id, before_train=compute_reference, lineage=inputs.image_records(pairs))
    return spec, (vision.processor if vision else tokenizer), held_out_rewards  # a VLM's model/ gets its processor


def run(cfg: Config) -> dict:
    out_dir = Path(cfg.output_dir)
    spec, saver, held_out_rewards = build_spec(cfg, out_dir)
    group, metrics = train(spec, cfg, out_dir)
    # the last step's preference statistics (implicit rewards beta * (pi - ref))
    last = json.loads((out_dir / "train_history.jsonl").read_text().splitlines()[-1])
    metrics.update({k: v for k, v in last.items() if k.startswith("rewards/")})
    rows, held_out_metrics = held_out_rewards(group)
    metrics.update(held_out_metrics)
    if rows:
        write_jsonl(out_dir / "eval_pair_rewards.jsonl", rows, ensure_ascii=True)
    save_final_model(group, out_dir, saver, results.model_card("dpo", cfg, metrics, f"DPO ({cfg.loss_type}, beta {cfg.beta}) from the sft model."))
    results.finish(out_dir, "dpo", cfg, metrics, extra_inputs=(cfg.eval_pairs,) if rows else (), records=spec.lineage)
    return metrics


def main(argv: list[str] | None = None) -> None:
    entrypoint.stage_main(Config, "dpo", run, argv)


if __name__ == "__main__":
    main()
