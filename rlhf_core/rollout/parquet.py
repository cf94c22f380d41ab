"""Rollout Parquet: one row per sample, one file per RL step (`rollouts/step_NNNNNN.parquet`).

The schema is explicit (not inferred from the first row) so every step's file has the same
column types and a reader can rely on them.  `summarize` backs `rlhf rollouts show`.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_core import atomic
from rlhf_core.data.images import shown_path
from rlhf_core.rollout.batch import RolloutBatch

I64, F32, STR = pa.int64(), pa.float32(), pa.string()
SCHEMA = pa.schema([
    ("run_id", STR), ("step", I64), ("policy_version", I64), ("prompt_id", STR), ("sample_index", I64),
    ("prompt", STR), ("prompt_token_ids", pa.list_(pa.int32())), ("response", STR), ("response_token_ids", pa.list_(pa.int32())),
    ("label", STR), ("engine_logprobs", pa.list_(F32)), ("old_logprobs", pa.list_(F32)), ("ref_logprobs", pa.list_(F32)),
    ("values", pa.list_(F32)), ("action_mask", pa.list_(pa.int8())), ("reward", F32),
    ("reward_components", STR), ("score", F32), ("kl", F32), ("advantages", pa.list_(F32)), ("returns", pa.list_(F32)),
    ("response_length", I64), ("num_turns", I64), ("truncated", pa.bool_()), ("finish_reason", STR),
    ("filter", STR), ("invalid_reason", STR), ("token_versions", pa.list_(I64)),
    ("images", pa.list_(STR)), ("image_sha256", pa.list_(STR)),
])
"""`reward` = combined reward from the sources; `score` = reward after penalties (what the baseline
sees); `kl` = summed per-token KL to the reference; `filter` = "kept" | "invalid" |
"zero_variance_group" | "surplus" (DAPO dynamic sampling: a kept group beyond the step's batch) |
"stale" (async: generated more than rl.rollout.max_staleness policy versions before the step's);
`policy_version` = the version of the weights that generated the sample (the oldest, when a
partial rollout spans a sync: `token_versions` has each response token's); `reward_components` = JSON {source: value};
`images` / `image_sha256` = the sample's pictures (VLM rows) in the order of its image tokens: each
file's path (`<bytes>` for one given inline) and sha256, so a rollout names exactly what was seen."""


def _f(v):
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


# where each Parquet column comes from: a RolloutBatch field (the per-token ones unpadded), or
# derived.  Fields not stored: env_reward (it is the `env` reward component), centred_score.
DERIVED = {"run_id", "step", "prompt_token_ids", "response_token_ids", "response_length", "truncated", "kl", "values",
           "reward_components", "num_turns", "invalid_reason", "images", "image_sha256"}
NOT_STORED = {"env_reward", "centred_score", "group", "token_ids", "prompt_len", "components", "invalid", "turns"}


def records(batch: RolloutBatch, run_id: str, step: int) -> list[dict]:
    """One Parquet row per sample of `batch` (per-token columns a step has not computed are null)."""
    out = []
    for i, p in enumerate(batch.prompt_len):
        tokens = lambda col: batch.per_token(col, i) if getattr(batch, col) is not None else None  # noqa: E731
        kl = tokens("kl")
        out.append({
            "run_id": run_id, "step": step, "policy_version": batch.policy_version[i], "prompt_id": batch.prompt_id[i],
            "sample_index": batch.sample_index[i], "prompt": batch.prompt[i], "prompt_token_ids": batch.token_ids[i][:p],
            "response": batch.response[i], "response_token_ids": batch.token_ids[i][p:], "label": batch.label[i],
            "engine_logprobs": tokens("engine_logprobs"), "old_logprobs": tokens("old_logprobs"), "ref_logprobs": tokens("ref_logprobs"),
            "values": tokens("old_values"), "action_mask": [int(x) for x in tokens("action_mask")],
            "reward": _f(batch.reward[i]) if batch.reward else None,
            "reward_components": json.dumps({k: _f(v) for k, v in (batch.components[i] if batch.components else {}).items()}),
            "score": _f(batch.score[i]) if batch.score else None, "kl": _f(sum(kl)) if kl else None,
            "advantages": tokens("advantages"), "returns": tokens("returns"), "response_length": len(batch.token_ids[i]) - p,
            "num_turns": batch.turns[i], "truncated": batch.finish_reason[i] == "length", "finish_reason": batch.finish_reason[i],
            "filter": batch.filter[i], "invalid_reason": batch.invalid[i] if batch.invalid else None,
            "token_versions": batch.token_versions[i] if batch.token_versions else None,
            **_image_columns(batch.images[i] if batch.images else None),
        })
    return out


def _image_columns(refs: list | None) -> dict:
    if not refs:
        return {"images": None, "image_sha256": None}
    return {"images": [shown_path(r) if isinstance(r, str) else "<bytes>" for r in refs],
            "image_sha256": [hashlib.sha256(Path(r).read_bytes() if isinstance(r, str) else r).hexdigest() for r in refs]}


def write_step(rollout_dir: Path, step: int, rows: list[dict]) -> Path:
    """Atomically write one step's rollouts (`records`; temp file + rename: a killed run leaves no half file)."""
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    return atomic.write_with(rollout_dir / f"step_{step:06d}.parquet", lambda tmp: pq.write_table(table, tmp))


def summarize(path: str, num_samples: int = 3) -> str:
    """Text summary of a rollout file or directory: per-step reward/length/KL and a few samples."""
    p = Path(path)
    files = sorted(p.glob("step_*.parquet")) if p.is_dir() else [p]
    if not files:
        raise FileNotFoundError(f"no step_*.parquet under {path}")
    lines = [f"{'step':>6} {'n':>5} {'reward':>8} {'±std':>7} {'len':>6} {'kl':>8} {'trunc':>6} {'invalid':>7} {'kept':>5} {'version':>7}"]
    last = None
    for f in files:
        t = pq.read_table(f).to_pylist()
        last = t
        rewards = [r["reward"] for r in t if r["reward"] is not None]
        mean = sum(rewards) / len(rewards) if rewards else float("nan")
        std = (sum((x - mean) ** 2 for x in rewards) / max(1, len(rewards) - 1)) ** 0.5 if rewards else float("nan")
        kls = [r["kl"] for r in t if r["kl"] is not None]
        lines.append(f"{t[0]['step']:>6} {len(t):>5} {mean:>8.3f} {std:>7.3f} {sum(r['response_length'] for r in t) / len(t):>6.1f} "
                     f"{(sum(kls) / len(kls) if kls else float('nan')):>8.4f} {sum(r['truncated'] for r in t):>6} "
                     f"{sum(r['filter'] == 'invalid' for r in t):>7} {sum(r['filter'] == 'kept' for r in t):>5} {t[0]['policy_version']:>7}")
    lines.append(f"\nsamples from {files[-1].name}:")
    for r in last[:num_samples]:
        lines.append(f"  [{r['prompt_id']}#{r['sample_index']}] {r['prompt']!r} -> {r['response']!r} (label {r['label']!r}) "
                     f"reward {r['reward']} components {r['reward_components']} filter {r['filter']}")
    return "\n".join(lines)
