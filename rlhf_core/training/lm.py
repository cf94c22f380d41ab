"""Causal-LM pieces shared by the `pretrain` and `sft` stages: the masked NLL loss (run inside the
workers) and the task evaluation (driver side)."""
from __future__ import annotations

from pathlib import Path

from rlhf_core.algos.losses import sft_loss, token_logprobs
from rlhf_core.data.images import with_images
from rlhf_core.data.tokenize import forward_inputs, prompt_response, tokenize_rows
from rlhf_core.training import batching, inputs, results

# --- maths: run inside the workers (pickled by reference) -----------------------------------


def loss_fn(model, batch, counts):
    """Masked NLL of the tokens `loss_mask` marks (the response for sft, every token when pretraining)."""
    logits = model(**forward_inputs(batch)).logits[:, :-1]
    logprobs = token_logprobs(logits, batch["input_ids"][:, 1:])
    return sft_loss(logprobs, batch["loss_mask"][:, 1:], num_tokens=counts["num_tokens"])


def nll_fn(model, batch):
    """Per example (summed NLL, tokens) of the masked tokens."""
    logits = model(**forward_inputs(batch)).logits[:, :-1]
    logprobs = token_logprobs(logits, batch["input_ids"][:, 1:])
    mask = batch["loss_mask"][:, 1:].float()
    return list(zip((-(logprobs * mask).sum(-1)).tolist(), mask.sum(-1).tolist()))


def count_tokens(batch: list[dict]) -> dict:
    return {"num_tokens": sum(sum(e["loss_mask"]) for e in batch)}


# --- driver ---------------------------------------------------------------------------------


def make_evaluate(cfg, tokenizer, format_prompt, collate, out_dir: Path, vision=None):
    """`eval/accuracy` (greedy, exact match) and `eval/loss` (NLL of `label_prefix + label`) on
    `cfg.eval_data` (prompt, label rows; with `vision`, image rows too)."""
    eval_rows = inputs.load_data(cfg.eval_data, "rl", cfg, out_dir / "rejects" / "eval.jsonl")
    eval_prompts = [format_prompt(r) for r in eval_rows]
    encode = lambda r: with_images(prompt_response(tokenizer, format_prompt(r), cfg.label_prefix + r["label"], cfg.max_len), r)  # noqa: E731
    eval_examples, eval_too_long = tokenize_rows(eval_rows, encode, cfg.max_len)
    inputs.check_too_long(eval_too_long, len(eval_rows), cfg, out_dir / "rejects" / "eval_too_long.jsonl")
    pixels = results.eval_pixels(vision, eval_rows)

    def evaluate(group) -> dict:
        metrics = results.eval_accuracy(group, tokenizer, eval_prompts, [r["label"] for r in eval_rows], cfg, pixels)
        nll = group.call_rank0("evaluate", batching.batches(collate, eval_examples, cfg.eval_batch_size), nll_fn)
        metrics["eval/loss"] = sum(s for s, _ in nll) / max(1.0, sum(n for _, n in nll))
        return metrics
    return evaluate
