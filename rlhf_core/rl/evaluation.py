"""Eval of the policy through the rollout engine (what the engine holds is what is measured): greedy
accuracy, pass@k, the weight-sync check, an environment's success rate; keeps the best model."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from rlhf_core.evaluation import exact_match_accuracy
from rlhf_core.rl.config import Config
from rlhf_core.rl.roles import Roles
from rlhf_core.rollout.producer import image_refs
from rlhf_core.training import inputs, results
from rlhf_core.training.chassis import RunState, StepLog
from rlhf_core.training.worker_group import save_final_model

log = logging.getLogger("rlhf.rl")


def evaluate(roles: Roles, cfg: Config, tokenizer, eval_rows: list[dict], eval_prompts: list[list[int]], pixels: list | None = None) -> dict:
    """Greedy `eval/accuracy` and sampled pass@k through the rollout engine (so it measures the
    weights the engine actually holds); success rate of the environment for reward-giving agents.
    `pixels`: per eval row its images' pixel values, for the trainer's side of the sync check."""
    w = roles.rollout[0]
    labels = [r["label"] for r in eval_rows]
    images = image_refs(eval_rows)  # the rollout worker makes its own pixel values from these
    greedy = roles.get(w.greedy.remote(eval_prompts, cfg.eval_max_new_tokens, *images), "eval generation")
    metrics = {"eval/accuracy": exact_match_accuracy([tokenizer.decode(g, skip_special_tokens=True) for g in greedy], labels)}
    # the weight-sync check: the engine's greedy output must equal the trainer's on the same prompts
    k = min(cfg.sync_check_prompts, len(eval_prompts))
    if k:
        eos = tokenizer.eos_token_id
        trainer = roles.policy.call_rank0("generate", eval_prompts[:k], cfg.eval_max_new_tokens, tokenizer.pad_token_id, eos, cfg.eval_batch_size,
                                          pixels[:k] if pixels else None)
        strip = lambda ids: [t for t in ids if t != eos]  # noqa: E731
        metrics["eval/sync_greedy_match"] = sum(strip(a) == strip(b) for a, b in zip(greedy[:k], trainer)) / k
    if cfg.pass_k > 1:
        prompts = [p for p in eval_prompts for _ in range(cfg.pass_k)]
        seeds = [10_000_019 + i for i in range(len(prompts))]
        more = ([refs for refs in images[0] for _ in range(cfg.pass_k)],) if images else ()
        outs = roles.get(w.sample.remote(prompts, cfg.eval_max_new_tokens, cfg.rollout.temperature, seeds, *more), "eval sampling")
        texts = [tokenizer.decode(o, skip_special_tokens=True) for o in outs]
        solved = [any(exact_match_accuracy([texts[i * cfg.pass_k + k]], [labels[i]]) for k in range(cfg.pass_k)) for i in range(len(labels))]
        metrics[f"eval/pass@{cfg.pass_k}"] = sum(solved) / len(solved)
    if cfg.rollout.agent != "single_turn" or cfg.rollout.agent_file:
        prompts = [r["prompt"] for r in eval_rows]
        eps = roles.get(w.rollout.remote(prompts, labels, list(range(len(labels))), cfg.rollout.max_new_tokens, 0.0, *images), "eval episodes")
        rewards = [e["env_reward"] for e in eps if e["env_reward"] is not None]
        if rewards:
            metrics["eval/success_rate"] = sum(r > 0 for r in rewards) / len(eps)
            metrics["eval/turns"] = sum(e["turns"] for e in eps) / len(eps)
    return metrics


class Evaluation:
    """Greedy accuracy, pass@k and the sync check on the eval prompts, through the rollout engine;
    keeps the best model so far in best_model/ (by eval/accuracy)."""

    def __init__(self, roles: Roles, cfg: Config, tokenizer, eval_rows: list[dict], out_dir: Path, vision=None):
        self.roles, self.cfg, self.tokenizer, self.rows, self.out_dir = roles, cfg, tokenizer, eval_rows, out_dir
        self.prompts = [inputs.prompt_formatter(tokenizer, False, vision)(r) for r in eval_rows]
        self.pixels = results.eval_pixels(vision, eval_rows)
        self.saver = vision.processor if vision else tokenizer  # what saves the tokenizer (a VLM's: with its processor)

    def __call__(self, state: RunState, steplog: StepLog | None = None) -> dict:
        metrics = evaluate(self.roles, self.cfg, self.tokenizer, self.rows, self.prompts, self.pixels)
        if steplog:
            steplog.scalars(metrics, state.step)
            log.info("eval at step %d: %s", state.step, metrics)
        best = state.extra.get("best", {})
        if metrics["eval/accuracy"] > best.get("eval/accuracy", -1.0):  # the starting model is the first "best"
            state.extra["best"] = {"step": state.step, **metrics}
            card = f"Best rl policy so far: step {state.step}, eval/accuracy {metrics['eval/accuracy']:.3f} (see best.json).\n"
            save_final_model(self.roles.policy, self.out_dir, self.saver, card, name="best_model",
                             extra={"best.json": json.dumps(state.extra["best"], indent=2)})
        return metrics
