"""Rollout Parquet: one row per sample, one file per RL step (`rollouts/step_NNNNNN.parquet`).

The schema is explicit (not inferred from the first row) so every step's file has the same
column types and a reader can rely on them.  `summarize` backs `rlhf rollouts show`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_core import atomic

I64, F32, STR = pa.int64(), pa.float32(), pa.string()
SCHEMA = pa.schema([
    ("run_id", STR), ("step", I64), ("policy_version", I64), ("prompt_id", STR), ("sample_index", I64),
    ("prompt", STR), ("prompt_token_ids", pa.list_(pa.int32())), ("response", STR), ("response_token_ids", pa.list_(pa.int32())),
    ("label", STR), ("engine_logprobs", pa.list_(F32)), ("old_logprobs", pa.list_(F32)), ("ref_logprobs", pa.list_(F32)),
    ("values", pa.list_(F32)), ("action_mask", pa.list_(pa.int8())), ("reward", F32),
    ("reward_components", STR), ("score", F32), ("kl", F32), ("advantages", pa.list_(F32)), ("returns", pa.list_(F32)),
    ("response_length", I64), ("num_turns", I64), ("truncated", pa.bool_()), ("finish_reason", STR),
    ("filter", STR), ("invalid_reason", STR),
])
"""`reward` = combined reward from the sources; `score` = reward after penalties (what the baseline
sees); `kl` = summed per-token KL to the reference; `filter` = "kept" | "invalid" |
"zero_variance_group" | "surplus" (DAPO dynamic sampling: a kept group beyond the step's batch);
`reward_components` = JSON {source: value}."""


def _f(v):
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


def to_row(s: dict, run_id: str, step: int) -> dict:
    p = s["prompt_len"]
    return {
        "run_id": run_id, "step": step, "policy_version": s["policy_version"], "prompt_id": s["prompt_id"], "sample_index": s["sample_index"],
        "prompt": s["prompt"], "prompt_token_ids": s["token_ids"][:p], "response": s["response"], "response_token_ids": s["token_ids"][p:],
        "label": s["label"], "engine_logprobs": s["engine_logprobs"], "old_logprobs": s.get("old_logprobs"),
        "ref_logprobs": s.get("ref_logprobs"), "values": s.get("old_values"), "action_mask": s["action_mask"],
        "reward": _f(s.get("reward")), "reward_components": json.dumps({k: _f(v) for k, v in s.get("components", {}).items()}),
        "score": _f(s.get("score")), "kl": _f(sum(s["kl"]) if s.get("kl") else None), "advantages": s.get("advantages"),
        "returns": s.get("returns"), "response_length": len(s["token_ids"]) - p, "num_turns": s["turns"],
        "truncated": s["finish_reason"] == "length", "finish_reason": s["finish_reason"], "filter": s["filter"],
        "invalid_reason": s.get("invalid"),
    }


def write_step(rollout_dir: Path, step: int, samples: list[dict], run_id: str) -> Path:
    """Atomically write one step's rollouts (temp file + rename: a killed run leaves no half file)."""
    table = pa.Table.from_pylist([to_row(s, run_id, step) for s in samples], schema=SCHEMA)
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
