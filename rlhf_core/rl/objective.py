"""What one RL run optimises, built once from its config: the policy and critic losses with their
settings, the KL controller, the collate, and the derived choices (importance correction, old log-probs)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_core.algos.aggregation import aggregate, masked_mean
from rlhf_core.algos.kl import kl_penalty
from rlhf_core.algos.losses import (
    IS_CORRECTIONS,
    POLICY_LOSSES,
    SEQUENCE_LEVEL_IS,
    batch_normalise_is,
    entropy_bonus,
    entropy_from_logits,
    token_logprobs,
    value_loss,
)
from rlhf_core.algos.shaping import AdaptiveKLController, FixedKLController
from rlhf_core.data.tokenize import forward_inputs
from rlhf_core.models.shared_prefix import model_logits
from rlhf_core.rl.collate import RLCollate, policy_logits
from rlhf_core.rl.config import Config


def make_losses(cfg: Config) -> tuple[PolicyObjective, CriticObjective]:
    """(policy loss, critic loss) as the workers run them, with this run's settings (the KL-loss
    coefficient is set per step)."""
    o, norm_len = cfg.objective, cfg.rollout.max_new_tokens
    settings = o.policy_loss_settings()
    policy = PolicyObjective(loss_type=o.loss_type, dual_clip=o.dual_clip, norm_len=norm_len, temperature=cfg.rollout.temperature,
                             kl_estimator=o.kl_estimator, kl_clamp=o.kl_clamp, entropy_coef=o.entropy_coef, is_correction=is_correction(cfg),
                             is_low=o.is_low, is_high=o.is_high, is_batch_normalize=o.is_batch_normalize, **settings)
    critic = CriticObjective(value_clip=o.value_clip, agg_mode=settings["agg_mode"], norm_len=norm_len)
    return policy, critic


def updates_per_step(cfg: Config) -> int:
    """Optimizer updates each step makes on its samples: epochs x mini-batches (see `update`)."""
    return cfg.ppo_epochs * max(1, round(cfg.rollout.prompts_per_step * cfg.rollout.n_samples / cfg.global_batch_size))


def is_correction(cfg: Config) -> str | None:
    """The correction the policy loss applies: the one set (`rl.objective.is_correction`), else tis
    for async samples (`rl.rollout.mode=async`; see the field)."""
    setting = cfg.objective.is_correction
    if setting is None:
        return "tis" if cfg.rollout.mode == "async" else None
    return None if setting == "none" else setting


def recompute_old(cfg: Config) -> bool:
    """Whether the step runs the policy's forward for old log-probs before the update: asked for, or
    needed (`rl.recompute_old_logprobs`): the KL in the reward reads them before any update, and a
    second update must compare against the weights before the first."""
    if cfg.recompute_old_logprobs is not None:
        return cfg.recompute_old_logprobs
    # async: the samples' policy is older than the trainer's (the engines' log-probs are that
    # behaviour policy's: `is_correction` weighs the proximal old log-probs against them)
    return cfg.objective.kl_mode == "reward" or updates_per_step(cfg) > 1 or cfg.rollout.mode == "async"


@dataclass
class Objective:
    """This run's losses and KL controller, built once from the config."""
    policy_loss: PolicyObjective
    critic_loss: CriticObjective
    kl: AdaptiveKLController | FixedKLController
    collate: RLCollate

    @classmethod
    def of(cls, cfg: Config, pad_id: int, vision=None) -> "Objective":
        policy, critic = make_losses(cfg)
        o = cfg.objective
        kl = AdaptiveKLController(o.kl_coef, o.kl_target, o.kl_horizon) if o.adaptive_kl else FixedKLController(o.kl_coef)
        return cls(policy, critic, kl, RLCollate(pad_id, vision=vision, shared_prefix=cfg.shared_prefix))


@dataclass(frozen=True)
class PolicyObjective:
    """The policy loss of a run, built once from its config (`make_losses`) and shipped
    to the policy workers, which call it as `loss_fn(model, batch, counts)`: the surrogate
    (`POLICY_LOSSES[loss_type]`: ppo / gspo) + optional KL-to-reference term + entropy bonus, all
    on the policy at the sampling `temperature` (logits / T: the distribution the rollouts came
    from, so the ratio to the old and engine log-probs is on-policy at step start).  Aggregated
    with the *global* token/sequence counts of the mini-batch, so the ranks' losses sum to the
    single-process loss.  Each term gets only its own settings, by keyword."""
    loss_type: str
    clip_low: float
    clip_high: float
    dual_clip: float | None
    agg_mode: str
    norm_len: int
    temperature: float = 1.0
    kl_loss_coef: float = 0.0
    """Set per step (the KL controller's value when kl_mode=loss): `dataclasses.replace`."""
    kl_estimator: str = "k3"
    kl_clamp: float | None = None
    entropy_coef: float = 0.0
    is_correction: str | None = None
    is_low: float = 0.5
    is_high: float = 2.0
    is_batch_normalize: bool = False

    def __call__(self, model, batch, counts):
        logits = policy_logits(model, batch)
        if self.temperature != 1.0:
            logits = logits / self.temperature  # once, for the log-probs and the entropy alike
        lp = token_logprobs(logits, batch["input_ids"][:, 1:])
        mask = batch["action_mask"]
        agg = dict(agg_mode=self.agg_mode, num_tokens=counts["num_tokens"], num_seqs=counts["num_seqs"], norm_len=self.norm_len)
        # no old log-probs in the batch: this is the step's only update (on-policy, rl.recompute_old_logprobs),
        # so the policy's own log-probs are the old ones (the ratio is 1, its gradient the policy gradient)
        old = batch["old_logprobs"] if "old_logprobs" in batch else lp.detach()
        is_weights, stats = None, {}
        if self.is_correction:
            is_weights, stats = IS_CORRECTIONS[self.is_correction](old, batch["engine_logprobs"], mask,
                                                                   low=self.is_low, high=self.is_high)
            if self.is_batch_normalize:
                is_weights = batch_normalise_is(is_weights, mask, per_sequence=self.is_correction in SEQUENCE_LEVEL_IS)
        # dual_clip only where set: the config allows it with ppo alone, and gspo has no such knob
        own = {"dual_clip": self.dual_clip} if self.dual_clip is not None else {}
        loss, pstats = POLICY_LOSSES[self.loss_type](lp, old, batch["advantages"], mask, clip_low=self.clip_low,
                                                     clip_high=self.clip_high, is_weights=is_weights, **own, **agg)
        stats.update(pstats)
        if self.kl_loss_coef:
            kl = kl_penalty(lp, batch["ref_logprobs"], self.kl_estimator, self.kl_clamp)
            loss = loss + self.kl_loss_coef * aggregate(kl, mask, self.agg_mode, counts["num_tokens"], counts["num_seqs"], self.norm_len)
            stats["kl_loss"] = masked_mean(kl.detach(), mask)
        if self.entropy_coef:
            ent_loss, estats = entropy_bonus(logits, mask, self.entropy_coef, **agg)
            loss = loss + ent_loss
            stats.update(estats)
        else:
            with torch.no_grad():
                stats["entropy"] = masked_mean(entropy_from_logits(logits), mask)
        return loss, stats


@dataclass(frozen=True)
class CriticObjective:
    """The critic's (clipped) value loss, called by the critic workers as `loss_fn(model, batch, counts)`."""
    value_clip: float | None
    agg_mode: str
    norm_len: int

    def __call__(self, model, batch, counts):
        values = model_logits(model, batch, forward_inputs(batch))[..., 0].float()
        return value_loss(values, batch["old_values"], batch["returns"], batch["action_mask"], clip=self.value_clip, agg_mode=self.agg_mode,
                          num_tokens=counts["num_tokens"], num_seqs=counts["num_seqs"], norm_len=self.norm_len)
