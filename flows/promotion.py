"""The promotion gate: does a newly trained model replace the champion?

The candidates are the policies the DAG trains (sft, dpo, rl@rlhf, rl@rlvr).  The gate takes the
one with the best gold `eval/accuracy` (ties: the later stage) and promotes it when it is not
worse than the champion's by more than `margin` (or there is no champion yet).

The swap is atomic: the model, its source manifest and the pointer `champion.json` are written
into a new version directory `artifacts/champion/versions/<manifest sha>-<time>/`, then the link
`artifacts/champion/current` is switched to it with one `rename`; `champion/model` and
`champion/champion.json` are fixed links into `current`.  A crash at any moment leaves a complete,
consistent champion: the old one or the new one.  Old versions are deleted only after the switch.
Every decision, accepted or refused, is appended with its reason
to `artifacts/champion/decisions.jsonl`: the lineage of the champion.  No torch here: files and
JSON only.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

from rlhf_core.runtime import faults


def _manifest_sha(artifact: Path) -> str | None:
    m = artifact / "manifest.json"
    return hashlib.sha256(m.read_bytes()).hexdigest() if m.exists() else None


def best_candidate(repo: Path, stages: list[str]) -> tuple[str, float] | None:
    """(stage, eval/accuracy) of the best candidate that has a model and an accuracy; ties go to
    the later stage (further down the DAG)."""
    best = None
    for stage in stages:
        metrics = repo / "artifacts" / stage / "metrics.json"
        if not metrics.exists() or not (repo / "artifacts" / stage / "model").exists():
            continue
        acc = json.loads(metrics.read_text()).get("eval/accuracy")
        if acc is not None and (best is None or acc >= best[1]):
            best = (stage, acc)
    return best


def gate(repo: Path, stages: list[str] | str, margin: float, flow_run_id: str = "") -> dict:
    """Pick the best candidate among `stages`, compare, decide, record; returns the decision record."""
    log = _logger()
    stages = [stages] if isinstance(stages, str) else list(stages)
    home = repo / "artifacts" / "champion"
    home.mkdir(parents=True, exist_ok=True)
    found = best_candidate(repo, stages)
    if found is None:
        decision = {"decision": "skipped", "reason": f"no evaluated model among {stages}"}
        _record(home, decision, flow_run_id)
        return decision
    stage, candidate = found
    artifact = repo / "artifacts" / stage
    pointer = home / "champion.json"
    champion = json.loads(pointer.read_text()) if pointer.exists() else None
    record = {"candidate": str(artifact.relative_to(repo) / "model"), "candidate_manifest_sha256": _manifest_sha(artifact),
              "candidate_accuracy": candidate, "champion_accuracy": champion and champion["eval/accuracy"], "margin": margin,
              "candidates": {s: _accuracy(repo, s) for s in stages}}
    if champion and champion.get("manifest_sha256") == record["candidate_manifest_sha256"]:
        decision = {**record, "decision": "unchanged", "reason": "the candidate is the current champion"}
    elif champion is None or candidate >= champion["eval/accuracy"] - margin:
        why = "no champion yet" if champion is None else f"{candidate:.4f} >= champion {champion['eval/accuracy']:.4f} - margin {margin}"
        promote(repo, artifact, home, candidate, flow_run_id, stage)
        decision = {**record, "decision": "promoted", "reason": f"{stage}: {why}"}
    else:
        decision = {**record, "decision": "refused",
                    "reason": f"{stage}: {candidate:.4f} < champion {champion['eval/accuracy']:.4f} - margin {margin}: champion kept"}
    (log.info if decision["decision"] != "refused" else log.warning)("promotion gate: %s (%s)", decision["decision"], decision["reason"])
    _record(home, decision, flow_run_id)
    return decision


def _logger():
    """The Prefect run logger inside a flow run, a plain logger outside one (tests, scripts)."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("rlhf.promotion")


def _accuracy(repo: Path, stage: str) -> float | None:
    metrics = repo / "artifacts" / stage / "metrics.json"
    return json.loads(metrics.read_text()).get("eval/accuracy") if metrics.exists() else None


def promote(repo: Path, artifact: Path, home: Path, accuracy: float, flow_run_id: str, stage: str) -> None:
    """Write the new champion (model, source manifest, champion.json) into a version directory,
    then switch the `current` link to it with one atomic rename."""
    sha = _manifest_sha(artifact) or hashlib.sha256(str(time.time()).encode()).hexdigest()
    versions = home / "versions"
    name = f"{sha[:16]}-{time.time_ns()}"  # unique: never the directory `current` points at
    version, tmp = versions / name, versions / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(artifact / "model", tmp / "model")
    shutil.copy2(artifact / "manifest.json", tmp / "manifest.json")  # the candidate's full lineage
    pointer = {"stage": stage, "model": "artifacts/champion/model", "version": f"artifacts/champion/versions/{version.name}",
               "source": str(artifact.relative_to(repo)), "manifest_sha256": _manifest_sha(artifact), "eval/accuracy": accuracy,
               "promoted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "flow_run_id": flow_run_id}
    (tmp / "champion.json").write_text(json.dumps(pointer, indent=2))
    os.rename(tmp, version)
    _legacy_layout(home, versions)
    faults.sigkill_at("promotion")  # the fault test: killed after the copy, before the switch
    _switch(home, version)
    for old in versions.iterdir():  # only now: the new champion is complete and current
        if old != version:
            shutil.rmtree(old, ignore_errors=True)


def _switch(home: Path, version: Path) -> None:
    """`current` -> version, atomically (a symlink renamed over the old one)."""
    link = home / ".current.tmp"
    link.unlink(missing_ok=True)
    os.symlink(Path("versions") / version.name, link)
    os.replace(link, home / "current")


def _legacy_layout(home: Path, versions: Path) -> None:
    """Make `model` and `champion.json` stable links into `current` (a champion written before
    versioned promotion, with real files there, becomes the version `legacy`)."""
    versions.mkdir(parents=True, exist_ok=True)
    legacy = versions / "legacy"
    for name in ("model", "champion.json"):
        path = home / name
        if path.exists() and not path.is_symlink():
            legacy.mkdir(exist_ok=True)
            os.rename(path, legacy / name)
    if legacy.exists() and not (home / "current").is_symlink():
        _switch(home, legacy)
    for name in ("model", "champion.json"):
        if not (home / name).is_symlink():
            os.symlink(Path("current") / name, home / name)


def _record(home: Path, decision: dict, flow_run_id: str) -> None:
    with open(home / "decisions.jsonl", "a") as f:
        f.write(json.dumps({"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "flow_run_id": flow_run_id, **decision}) + "\n")
