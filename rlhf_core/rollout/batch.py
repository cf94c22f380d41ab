"""`RolloutBatch`: one RL step's samples, columnar and typed, from the rollout workers to the
trainer and the step's Parquet file.

Per-sample fields are lists of length B.  Per-token fields are `(B, L)` float32 tensors over the
*response* tokens (everything after `prompt_len`: model actions and environment feedback, L = the
longest response), right-padded with 0; `action_mask` marks the model's tokens.  The batch is
frozen: each step of the RL step returns a new batch with its columns (`with_columns`), so what a
column holds is decided in one place.  `batch[i::n]`, `batch[a:b]` and `batch.select(idx)` take
samples (the data-parallel split, mini-batches, the kept samples).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

PER_TOKEN = ("action_mask", "engine_logprobs", "old_logprobs", "ref_logprobs", "old_values", "advantages", "returns", "kl")


def response_matrix(rows: list[list[float]] | list[Tensor], width: int | None = None) -> Tensor:
    """Response-aligned rows (lists or 1-d tensors, one per sample, lengths may differ) -> `(B, L)`
    float32, 0-padded."""
    width = width if width is not None else max((len(r) for r in rows), default=0)
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r if isinstance(r, Tensor) else torch.tensor(r, dtype=torch.float32)
    return out


@dataclass(frozen=True)
class RolloutBatch:
    # --- per sample, from the rollout workers
    prompt: list[str]
    label: list[str]
    prompt_id: list[str]
    group: list[int]
    """The prompt's index in the run's prompt sequence: samples of one prompt share it (group baselines)."""
    sample_index: list[int]
    token_ids: list[list[int]]
    """Prompt + response (actions and environment feedback) token ids."""
    prompt_len: list[int]
    response: list[str]
    turns: list[int]
    finish_reason: list[str]
    """"stop" or "length" (truncated)."""
    policy_version: list[int]
    env_reward: list[float | None]
    filter: list[str]
    """"kept" | "invalid" | "zero_variance_group" | "surplus" (DAPO dynamic sampling) | "stale" (async, too old)."""
    # --- per token, (B, L)
    action_mask: Tensor
    engine_logprobs: Tensor
    """The engine's log-probs of its sampled tokens (0 on environment tokens)."""
    token_versions: list[list[int]] | None = None
    """Per response token, the policy version that generated it (partial rollouts: an episode can
    span a weight sync; `policy_version` is the oldest)."""
    images: list[list] | None = None
    """Per sample its image references (paths or bytes) in the order of its image tokens (VLMs)."""
    # --- the step's columns, None until their step ran
    reward: list[float] | None = None
    """Combined reward of the sources (NaN where invalid)."""
    components: list[dict] | None = None
    invalid: list[str | None] | None = None
    """Why a sample's reward is invalid (None: valid)."""
    score: list[float] | None = None
    """Reward after penalties (overlong): what the baseline sees."""
    centred_score: list[float] | None = None
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    old_values: Tensor | None = None
    advantages: Tensor | None = None
    returns: Tensor | None = None
    kl: Tensor | None = None
    """Per-token KL estimate to the reference."""

    def __post_init__(self):
        n = len(self.prompt)
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None and len(v) != n:
                raise ValueError(f"RolloutBatch column {f.name} has {len(v)} rows, the batch {n}")
            if f.name in PER_TOKEN and v is not None and v.shape[1] < max(self.response_lengths, default=0):
                raise ValueError(f"RolloutBatch column {f.name} is narrower ({v.shape[1]}) than the longest response")

    @classmethod
    def from_episodes(cls, episodes: list[dict], samples: list[dict]) -> "RolloutBatch":
        """The rollout workers' episodes (`agents.Episode` as dicts, + `response`, `policy_version`)
        and, for each, its sample's identity (`row`: the data row, `group`, `sample_index`)."""
        return cls(prompt=[s["row"]["prompt"] for s in samples], label=[s["row"]["label"] for s in samples],
                   prompt_id=[s["row"].get("id", str(s["group"])) for s in samples], group=[s["group"] for s in samples],
                   sample_index=[s["sample_index"] for s in samples], token_ids=[e["token_ids"] for e in episodes],
                   prompt_len=[e["prompt_len"] for e in episodes], response=[e["response"] for e in episodes],
                   turns=[e["turns"] for e in episodes], finish_reason=[e["finish_reason"] for e in episodes],
                   policy_version=[e["policy_version"] for e in episodes], env_reward=[e["env_reward"] for e in episodes],
                   filter=["kept"] * len(episodes), action_mask=response_matrix([e["action_mask"] for e in episodes]),
                   engine_logprobs=response_matrix([e["engine_logprobs"] for e in episodes]),
                   token_versions=[e["token_versions"] for e in episodes],
                   images=[e.get("images") or [] for e in episodes] if any(e.get("images") for e in episodes) else None)

    def __len__(self) -> int:
        return len(self.prompt)

    @property
    def response_lengths(self) -> list[int]:
        return [len(t) - p for t, p in zip(self.token_ids, self.prompt_len)]

    @property
    def width(self) -> int:
        return self.action_mask.shape[1]

    def with_columns(self, **columns) -> "RolloutBatch":
        """A new batch with these columns set (per-token ones given as response-aligned lists or a tensor)."""
        for k, v in columns.items():
            if k in PER_TOKEN and v is not None and not isinstance(v, Tensor):
                columns[k] = response_matrix(v, self.width)
        return replace(self, **columns)

    def select(self, idx: list[int]) -> "RolloutBatch":
        """The samples `idx`, per-token columns trimmed to their longest response (a batch's
        width is always its own: reductions over it do not depend on which batch it came from)."""
        rows = torch.tensor(idx, dtype=torch.long)
        width = max((self.response_lengths[i] for i in idx), default=0)
        cols = {}
        for f in fields(self):
            v = getattr(self, f.name)
            cols[f.name] = None if v is None else v[rows, :width] if isinstance(v, Tensor) else [v[i] for i in idx]
        return RolloutBatch(**cols)

    def __getitem__(self, key: slice) -> "RolloutBatch":
        return self.select(list(range(len(self)))[key])

    def where(self, filter_value: str = "kept") -> "RolloutBatch":
        return self.select([i for i, f in enumerate(self.filter) if f == filter_value])

    def per_token(self, column: str, i: int) -> list[float]:
        """Sample i's per-token column, unpadded."""
        return getattr(self, column)[i, : self.response_lengths[i]].tolist()

    @staticmethod
    def concat(batches: list["RolloutBatch"]) -> "RolloutBatch":
        width = max(b.width for b in batches)
        cols = {}
        for f in fields(RolloutBatch):
            vals = [getattr(b, f.name) for b in batches]
            if any(v is None for v in vals):
                if not all(v is None for v in vals):
                    raise ValueError(f"concat: column {f.name} is set in some batches only")
                cols[f.name] = None
            elif isinstance(vals[0], Tensor):
                cols[f.name] = torch.cat([torch.nn.functional.pad(v, (0, width - v.shape[1])) for v in vals])
            else:
                cols[f.name] = [x for v in vals for x in v]
        return RolloutBatch(**cols)

    def reward_inputs(self) -> list[dict]:
        """What the reward sources see of each sample (plain data: it crosses to the reward actor)."""
        return [{"prompt": self.prompt[i], "response": self.response[i], "label": self.label[i], "token_ids": self.token_ids[i],
                 "prompt_len": self.prompt_len[i], "env_reward": self.env_reward[i]} for i in range(len(self))]
