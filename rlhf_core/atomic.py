"""Atomic writes: a reader (a resuming job, `lineage verify`, DVC, a second process) sees the old
file or the new one, never half of one.  Write beside the target, fsync, rename over it, fsync the
directory (so the rename itself survives a crash).  The one place every writer of a manifest,
checkpoint record, rollout file, resolved config or model directory goes through."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable


def _tmp(path: Path) -> Path:
    # per process: two writers of one path never share a temp file
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_with(path: str | Path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` writes the file's content to a temp path; it then replaces `path` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp(path)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return path


def write_text(path: str | Path, text: str) -> Path:
    return write_with(path, lambda tmp: tmp.write_text(text))


def write_json(path: str | Path, obj, **dump_kw) -> Path:
    return write_text(path, json.dumps(obj, **{"indent": 2, "sort_keys": True, **dump_kw}))


def replace_dir(tmp_dir: str | Path, final: str | Path) -> Path:
    """A directory fully written at `tmp_dir` (a model, a checkpoint) takes `final`'s place.  The
    old one is removed first, so a crash between the two steps leaves no `final` -- which every
    reader treats as "not there yet" -- but never a mixed one."""
    tmp_dir, final = Path(tmp_dir), Path(final)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp_dir, final)
    fsync_dir(final.parent)
    return final
