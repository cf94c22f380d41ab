"""Pure RL/alignment math: torch only, no I/O, no ray/prefect/vllm/deepspeed.

Each variant family is a plain dict, selected by a `Literal` config field:
`AGGREGATIONS`, `KL_ESTIMATORS`, `SCORE_BASELINES`, `ESTIMATORS`, `ALGO_RECIPES`,
`POLICY_LOSSES` (+ `POLICY_LOSS_DEFAULTS`), `IS_CORRECTIONS`, `RM_LOSSES`, `DPO_LOSSES`.
"""
from .advantages import ALGO_RECIPES, ESTIMATORS, SCORE_BASELINES
from .aggregation import AGGREGATIONS, aggregate, masked_mean, masked_sum, masked_whiten
from .kl import KL_ESTIMATORS, kl_penalty
from .losses import DPO_LOSSES, IS_CORRECTIONS, POLICY_LOSS_DEFAULTS, POLICY_LOSSES, RM_LOSSES
from .shaping import AdaptiveKLController, FixedKLController

__all__ = [
    "AGGREGATIONS", "ALGO_RECIPES", "DPO_LOSSES", "ESTIMATORS", "IS_CORRECTIONS", "KL_ESTIMATORS",
    "POLICY_LOSS_DEFAULTS", "POLICY_LOSSES", "RM_LOSSES", "SCORE_BASELINES", "AdaptiveKLController", "FixedKLController",
    "aggregate", "kl_penalty", "masked_mean", "masked_sum", "masked_whiten",
]
