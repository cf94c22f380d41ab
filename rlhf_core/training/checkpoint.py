"""Atomic, verified checkpoints (docs/reliability.md: what a kill at any point leaves).

Layout under `checkpoints/`:
  step_000050/            one complete checkpoint: engine state (DeepSpeed), per-rank RNG,
    state.json            counters, data position, controller states ...
    CHECKSUMS.json        sha256 of every file above, written last
  latest                  text: the name of the newest complete checkpoint
and beside it, outside the checkpoint directory:
  checkpoint_hashes.json  {step_N: {file: sha256}} of every complete checkpoint: the trusted record

Protocol: everything is written into `.tmp-step_N/`, fsynced, CHECKSUMS written, the step's hashes
added to `checkpoint_hashes.json` (tmp file + fsync + rename), the dir renamed to `step_N/`, and
only then is `latest` replaced (tmp file + rename).  Old checkpoints (and their records) are
deleted after that.  A crash at any point leaves the previous checkpoint, its record and `latest`
intact; stale `.tmp-*` dirs are removed at the next start.

Loading re-hashes the files against both CHECKSUMS.json (a torn or corrupt write) and the record
outside the directory, before anything is unpickled: DeepSpeed engine states load with
`torch.load(weights_only=False)`, so a checkpoint is code.  A checkpoint directory that is not in
the record (dropped in, copied from elsewhere, written by other code) or whose files differ from
it (replaced, CHECKSUMS resealed) is refused.  Trust boundary: docs/reliability.md ("checkpoints
are code").  An unusable checkpoint is skipped with a warning in favour of the newest complete one,
and so is one that verifies but fails to load (`CheckpointLoadError`, naming it and why;
`chassis.load_resumable`).  Only the holder of the output directory's lock (`runtime/stage_lock.py`)
reads or writes them.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import traceback
from pathlib import Path

from rlhf_core import atomic
from rlhf_core.artifacts.manifest import hash_tree

log = logging.getLogger("rlhf.checkpoint")
CHECKSUMS = "CHECKSUMS.json"
LATEST = "latest"
RECORD = "checkpoint_hashes.json"
"""Beside `checkpoints/` (in the stage's output dir, so the stage manifest covers it)."""


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for d in sorted({p.parent for p in root.rglob("*")} | {root}):
        atomic.fsync_dir(d)


def record_path(ckpt_dir: Path) -> Path:
    return Path(ckpt_dir).parent / RECORD


def read_record(ckpt_dir: Path) -> dict:
    """{step_N: {file: sha256}} of the complete checkpoints (empty when there is none)."""
    path = record_path(ckpt_dir)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except ValueError:
        log.warning("%s is unreadable: no checkpoint beside it is trusted", path)
        return {}


def _write_record(ckpt_dir: Path, record: dict) -> None:
    atomic.write_json(record_path(ckpt_dir), record)


def reset(ckpt_dir: Path) -> None:
    """Remove every checkpoint and the record (a run that starts over)."""
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    record_path(ckpt_dir).unlink(missing_ok=True)
    Path(ckpt_dir).mkdir(parents=True, exist_ok=True)


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
    files = hash_tree(tmp, exclude=(CHECKSUMS,))
    (tmp / CHECKSUMS).write_text(json.dumps(files, indent=2, sort_keys=True))
    _fsync_tree(tmp)
    final = ckpt_dir / step_name(step)
    # recorded before the rename: a complete checkpoint always has its record (a record without
    # its directory, after a crash in between, is harmless and pruned by the next commit)
    _write_record(ckpt_dir, {**read_record(ckpt_dir), final.name: files})
    atomic.replace_dir(tmp, final)  # a re-save of the same step (e.g. after a resume) replaces it
    atomic.write_text(ckpt_dir / LATEST, final.name)
    for old in sorted(ckpt_dir.glob("step_*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    present = {p.name for p in ckpt_dir.glob("step_*")}
    _write_record(ckpt_dir, {k: v for k, v in read_record(ckpt_dir).items() if k in present})
    return final


def verify(path: Path, trusted: dict | None = None) -> list[str]:
    """Problems with one checkpoint dir (empty = complete and intact): its files against its
    CHECKSUMS.json and, when `trusted` (the record's entry for it, from outside the directory) is
    given, against that too -- a file not in the record is a problem, since it would be loaded."""
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
    if trusted is not None and not problems:
        problems += [f"{path / f}: not in {RECORD}" for f in sorted(set(actual) - set(trusted))]
        problems += [f"{path / f}: missing" for f in sorted(set(trusted) - set(actual))]
        problems += [f"{path / f}: sha256 differs from {RECORD} (replaced after it was written)"
                     for f in sorted(set(trusted) & set(actual)) if trusted[f] != actual[f]]
    return problems


class CheckpointLoadError(RuntimeError):
    """A checkpoint that verifies but cannot be loaded (the message names it and says why)."""


def explain(e: BaseException) -> str:
    """`Type: message` of an exception; where the message is empty (a bare `assert` inside a
    library), the failing line instead."""
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
    record = read_record(ckpt_dir)
    for cand in candidates:
        if cand.name in record:
            problems = verify(cand, record[cand.name])
        else:  # never unpickle what this pipeline did not record writing
            problems = [f"{cand}: not in {record_path(ckpt_dir)} (not written by this output dir's runs: refusing to load it)"]
        if not problems:
            yield cand, json.loads((cand / "state.json").read_text())
        else:
            log.warning("checkpoint %s is not usable, falling back to an older one: %s", cand, "; ".join(problems[:3]))
