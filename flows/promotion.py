"""The promotion gate: does the newly trained model replace the champion?

The candidate is the last stage's `model/`.  It is promoted when its `eval/accuracy` is not worse
than the champion's by more than `margin` (or there is no champion yet).  Promotion copies the
model into `artifacts/champion/model` (the next run overwrites the stage's own output) and
rewrites the pointer `artifacts/champion/champion.json`.  Every decision, accepted or refused,
is appended with its reason to `artifacts/champion/decisions.jsonl`: the lineage of the champion.
No torch here: files and JSON only.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path


def _manifest_sha(artifact: Path) -> str | None:
    m = artifact / "manifest.json"
    return hashlib.sha256(m.read_bytes()).hexdigest() if m.exists() else None


def gate(repo: Path, stage: str, margin: float, flow_run_id: str = "") -> dict:
    """Compare, decide, record; returns the decision record."""
    from prefect import get_run_logger

    log = get_run_logger()
    artifact = repo / "artifacts" / stage
    home = repo / "artifacts" / "champion"
    home.mkdir(parents=True, exist_ok=True)
    metrics_path = artifact / "metrics.json"
    if stage == "prepare" or not metrics_path.exists():
        decision = {"decision": "skipped", "reason": f"stage {stage} produces no evaluated model"}
        _record(home, decision, flow_run_id)
        return decision
    candidate = json.loads(metrics_path.read_text()).get("eval/accuracy")
    pointer = home / "champion.json"
    champion = json.loads(pointer.read_text()) if pointer.exists() else None
    record = {"candidate": str(artifact.relative_to(repo) / "model"), "candidate_manifest_sha256": _manifest_sha(artifact),
              "candidate_accuracy": candidate, "champion_accuracy": champion and champion["eval/accuracy"], "margin": margin}
    if candidate is None:
        decision = {**record, "decision": "refused", "reason": f"{metrics_path} has no eval/accuracy"}
    elif champion and champion.get("manifest_sha256") == record["candidate_manifest_sha256"]:
        decision = {**record, "decision": "unchanged", "reason": "the candidate is the current champion"}
    elif champion is None or candidate >= champion["eval/accuracy"] - margin:
        why = "no champion yet" if champion is None else f"{candidate:.4f} >= champion {champion['eval/accuracy']:.4f} - margin {margin}"
        _promote(repo, artifact, home, candidate, flow_run_id, stage)
        decision = {**record, "decision": "promoted", "reason": why}
    else:
        decision = {**record, "decision": "refused",
                    "reason": f"{candidate:.4f} < champion {champion['eval/accuracy']:.4f} - margin {margin}: champion kept"}
    (log.info if decision["decision"] != "refused" else log.warning)("promotion gate: %s (%s)", decision["decision"], decision["reason"])
    _record(home, decision, flow_run_id)
    return decision


def _promote(repo: Path, artifact: Path, home: Path, accuracy: float, flow_run_id: str, stage: str) -> None:
    """Copy model + manifest into the champion slot atomically, then move the pointer."""
    tmp = home / ".tmp-champion"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(artifact / "model", tmp / "model")
    shutil.copy2(artifact / "manifest.json", tmp / "manifest.json")
    shutil.rmtree(home / "model", ignore_errors=True)
    shutil.rmtree(home / "source", ignore_errors=True)
    os.rename(tmp / "model", home / "model")
    os.makedirs(home / "source", exist_ok=True)
    os.rename(tmp / "manifest.json", home / "source" / "manifest.json")  # the candidate's full lineage
    shutil.rmtree(tmp, ignore_errors=True)
    pointer = {"stage": stage, "model": "artifacts/champion/model", "source": str(artifact.relative_to(repo)),
               "manifest_sha256": _manifest_sha(artifact), "eval/accuracy": accuracy, "promoted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "flow_run_id": flow_run_id}
    new = home / "champion.json.tmp"
    new.write_text(json.dumps(pointer, indent=2))
    os.replace(new, home / "champion.json")


def _record(home: Path, decision: dict, flow_run_id: str) -> None:
    with open(home / "decisions.jsonl", "a") as f:
        f.write(json.dumps({"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "flow_run_id": flow_run_id, **decision}) + "\n")
