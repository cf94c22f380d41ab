"""The pipeline's stages, in DAG order: the one list the CLI, the job runner and the Prefect flow
read.  `tests/test_registry.py` checks dvc.yaml against it (same stages, same order, deps that
cover every module a stage imports).

Adding a stage: its module under `stages/` (a `Config` dataclass and `run(cfg)`, plus `main` for
`python -m`), one line below, and its entry in dvc.yaml.  Pure data: importing this module must
stay cheap (the flow and `rlhf --help` read it; no torch).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    name: str
    module: str
    """Runs as `python -m MODULE --config resolved.json` (a Ray job), or in-process for prepare."""
    candidate: bool = False
    """Its `model/` is a policy the promotion gate may choose as champion."""
    variants: bool = False
    """A DVC `foreach` over params.yaml's `NAME_variants`: it runs as NAME@KEY for each key."""


STAGES: tuple[Stage, ...] = (
    Stage("prepare", "stages.prepare"),
    Stage("pretrain", "stages.pretrain"),
    Stage("sft", "stages.sft", candidate=True),
    Stage("rm", "stages.rm"),
    Stage("dpo", "stages.dpo", candidate=True),
    Stage("rl", "stages.rl", candidate=True, variants=True),
)
BY_NAME = {s.name: s for s in STAGES}


def get(name: str) -> Stage:
    """The stage of `name` or of a variant `NAME@KEY`; KeyError listing the valid ones."""
    section = name.partition("@")[0]
    if section not in BY_NAME:
        raise KeyError(f"unknown stage {name!r}; valid stages: {', '.join(BY_NAME)} (a variant: STAGE@NAME)")
    return BY_NAME[section]


def dag(params: dict) -> list[str]:
    """Every DVC stage name in run order; a stage with variants expands to NAME@KEY for each key
    of `params[NAME_variants]`, in the file's order (rl -> rl@rlhf, rl@rlvr)."""
    out = []
    for s in STAGES:
        out += [f"{s.name}@{k}" for k in (params.get(f"{s.name}_variants") or {})] if s.variants else [s.name]
    return out


def candidates(params: dict) -> list[str]:
    """The DVC stages whose models the promotion gate compares."""
    return [n for n in dag(params) if get(n).candidate]
