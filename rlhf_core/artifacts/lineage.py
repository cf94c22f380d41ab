"""Lineage: walk an artifact's manifests back to raw data, print the tree, re-verify every hash.

An artifact is a directory with a `manifest.json`; a model dir inside one (`artifacts/sft/model`)
belongs to its parent's manifest.  Inputs are either parent artifacts (recorded with the sha256 of
their manifest, so an edited parent manifest is caught) or data (recorded with per-file hashes).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .manifest import MANIFEST, hash_tree, sha256_file, verify_manifest


def artifact_root(path: str | Path) -> Path:
    """The directory whose manifest covers `path` (itself or its parent)."""
    path = Path(path)
    for cand in (path, path.parent):
        if (cand / MANIFEST).is_file():
            return cand
    raise FileNotFoundError(f"{path}: no {MANIFEST} here or in the parent directory")


def load(path: str | Path) -> dict:
    return json.loads((artifact_root(path) / MANIFEST).read_text())


def dvc_lock_check(root: Path) -> list[str]:
    """Cross-check with DVC: if a `dvc.lock` above `root` records `root/manifest.json` as a stage
    output, its md5 must match the file (an artifact rebuilt or edited outside `dvc repro` fails)."""
    import yaml

    root = root.resolve()
    for repo in root.parents:
        lock = repo / "dvc.lock"
        if lock.is_file():
            break
    else:
        return []
    rel = str((root / MANIFEST).relative_to(repo))
    stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
    for name, stage in stages.items():
        for out in stage.get("outs", []):
            if out.get("path") == rel and "md5" in out:
                actual = hashlib.md5((root / MANIFEST).read_bytes()).hexdigest()
                if actual != out["md5"]:
                    return [f"{root / MANIFEST}: differs from what dvc.lock recorded for stage {name} (md5 {actual[:12]} != {out['md5'][:12]})"]
    return []


def verify_chain(path: str | Path, _seen: set | None = None) -> list[str]:
    """Every problem in `path`'s artifact and all of its ancestors (empty list = intact), with
    each artifact's manifest cross-checked against `dvc.lock` where DVC produced it."""
    seen = _seen if _seen is not None else set()
    root = artifact_root(path)
    if root.resolve() in seen:
        return []
    seen.add(root.resolve())
    problems = verify_manifest(root)
    if problems:
        return problems  # an unreadable manifest has no inputs to follow
    problems += dvc_lock_check(root)
    for record in load(root)["inputs"]:
        src = Path(record["path"])
        if record["kind"] == "hub":  # by name (and revision): pin `@REVISION` for a reproducible input
            continue
        if record["kind"] == "artifact":
            try:
                parent = artifact_root(src)
            except FileNotFoundError as e:
                problems.append(f"{root}: input {e}")
                continue
            if sha256_file(parent / MANIFEST) != record["manifest_sha256"]:
                problems.append(f"{parent / MANIFEST}: changed since {root} was built from it (sha256 mismatch)")
            problems += verify_chain(parent, seen)
        else:
            if not src.exists():
                problems.append(f"{src}: missing (input of {root})")
                continue
            actual = hash_tree(src)
            for rel, digest in sorted(record["files"].items()):
                name = src / rel if src.is_dir() else src
                if rel not in actual:
                    problems.append(f"{name}: missing (input of {root})")
                elif actual[rel] != digest:
                    problems.append(f"{name}: sha256 mismatch (input of {root})")
    return problems


def render(path: str | Path, indent: str = "") -> str:
    """A text tree of the ancestry: stage, config hash, git commit, run ids, headline metrics, data hashes."""
    root = artifact_root(path)
    m = load(root)
    git = m.get("git") or {}
    commit = (git.get("commit") or "unknown")[:12] + (" (dirty)" if git.get("dirty") else "")
    metrics = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(m.get("metrics", {}).items())
                        if k.startswith("eval/"))
    lines = [f"{indent}{root}  [{m['stage']}]  {m['created_at']}",
             f"{indent}  config {m['config_sha256'][:12]}  code {commit}  seed {m.get('seed')}"
             + (f"  runs {m['run_ids']}" if m.get("run_ids") else "")]
    if metrics:
        lines.append(f"{indent}  {metrics}")
    for record in m["inputs"]:
        if record["kind"] == "hub":
            lines.append(f"{indent}    hub {record['path']}" + ("" if "@" in record["path"] else " (no revision pinned)"))
        elif record["kind"] == "artifact":
            lines.append(render(record["path"], indent + "    "))
        else:
            files = record["files"]
            first = next(iter(files.values()), "")[:12]
            lines.append(f"{indent}    data {record['path']} ({len(files)} file{'s' if len(files) != 1 else ''}, {first}…)")
    return "\n".join(lines)
