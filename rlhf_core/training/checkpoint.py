"""Atomic, verified checkpoints (ARCHITECTURE.md §6).

Layout under `checkpoints/`:
  step_000050/            one complete checkpoint: engine state (DeepSpeed), per-rank RNG,
    state.json            counters, data position, controller states ...
    CHECKSUMS.json        sha256 of every file above, written last
  latest                  text: the name of the newest complete checkpoint

Protocol: everything is written into `.tmp-step_N/`, fsynced, CHECKSUMS written, the dir renamed
to `step_N/`, and only then is `latest` replaced (tmp file + rename).  Old checkpoints are deleted
after that.  A crash at any point leaves the previous checkpoint and `latest` intact; stale
`.tmp-*` dirs are removed at the next start.  Loading re-hashes the files; a corrupt or truncated
checkpoint is skipped with a warning in favour of the newest complete one, and so is one that
verifies but fails to load (`CheckpointLoadError`, naming it and why; `loop.load_resumable`).
Only the holder of the output directory's lock (`runtime/stage_lock.py`) reads or writes them.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from rlhf_core.artifacts.manifest import hash_tree

log = logging.getLogger("rlhf.checkpoint")
CHECKSUMS = "CHECKSUMS.json"
LATEST = "latest"


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for d in sorted({p.parent for p in root.rglob("*")} | {root}):
        _fsync_dir(d)


def clean_stale(ckpt_dir: Path) -> None:
    """Remove half-written `.tmp-*` checkpoints left by a crash."""
    for tmp in Path(ckpt_dir).glob(".tmp-*"):
        log.warning("removing incomplete checkpoint %s (left by an interrupted save)", tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def begin(ckpt_dir: Path, step: int) -> Path:
    """A fresh temporary directory to write checkpoint `step` into."""
    tmp = Path(ckpt_dir) / f".tmp-{step_name(step)}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit(ckpt_dir: Path, tmp: Path, step: int, state: dict, keep: int) -> Path:
    """Seal `tmp` (state.json + CHECKSUMS), rename it into place, move `latest`, rotate."""
    ckpt_dir = Path(ckpt_dir)
    (tmp / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    (tmp / CHECKSUMS).write_text(json.dumps(hash_tree(tmp, exclude=(CHECKSUMS,)), indent=2, sort_keys=True))
    _fsync_tree(tmp)
    final = ckpt_dir / step_name(step)
    if final.exists():  # a re-save of the same step (e.g. after a resume) replaces it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(ckpt_dir)
    pointer_tmp = ckpt_dir / (LATEST + ".tmp")
    with open(pointer_tmp, "w") as f:
        f.write(final.name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer_tmp, ckpt_dir / LATEST)
    _fsync_dir(ckpt_dir)
    for old in sorted(ckpt_dir.glob("step_*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def verify(path: Path) -> list[str]:
    """Problems with one checkpoint dir (empty = complete and intact)."""
    path = Path(path)
    sums = path / CHECKSUMS
    if not sums.is_file():
        return [f"{path}: no {CHECKSUMS} (incomplete)"]
    try:
        recorded = json.loads(sums.read_text())
    except ValueError:
        return [f"{sums}: unreadable"]
    actual = hash_tree(path, exclude=(CHECKSUMS,))
    problems = [f"{path / f}: missing" for f in sorted(set(recorded) - set(actual))]
    problems += [f"{path / f}: sha256 mismatch" for f in sorted(set(recorded) & set(actual)) if recorded[f] != actual[f]]
    return problems


class CheckpointLoadError(RuntimeError):
    """A checkpoint that verifies but cannot be loaded (the message names it and says why)."""


def explain(e: BaseException) -> str:
    """`Type: message` of an exception; where the message is empty (a bare `assert` inside a
    library), the failing line instead."""
    import traceback

    text = str(e).strip()
    if not text and e.__traceback__ is not None:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        text = f"failed at {Path(frame.filename).name}:{frame.lineno}: {frame.line or '?'}"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def find_resumable(ckpt_dir: Path) -> tuple[Path, dict] | None:
    """The newest intact checkpoint (preferring `latest`) and its state, or None.

    A corrupt one is reported with a warning and the next older complete one is used.
    """
    return next(iter_resumable(ckpt_dir), None)


def iter_resumable(ckpt_dir: Path):
    """Intact checkpoints with their states, in the order to try them: `latest` first, then
    newest to oldest; a corrupt one is reported with a warning and skipped."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return
    candidates = sorted(ckpt_dir.glob("step_*"), reverse=True)
    pointer = ckpt_dir / LATEST
    if pointer.is_file():
        named = ckpt_dir / pointer.read_text().strip()
        candidates = [named] + [c for c in candidates if c != named]
    for cand in candidates:
        problems = verify(cand)
        if not problems:
            yield cand, json.loads((cand / "state.json").read_text())
        else:
            log.warning("checkpoint %s is not usable, falling back to an older one: %s", cand, "; ".join(problems[:3]))
