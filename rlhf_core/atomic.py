"""Atomic writes: a reader (a resuming job, `lineage verify`, DVC, a second process) sees the old
file or the new one, never half of one.  Write beside the target, fsync, rename over it, fsync the
directory (so the rename itself survives a crash).  The one place every writer of a manifest,
checkpoint record, rollout file, resolved config or model directory goes through.

Private files too: a credential (Ray token, a job's secrets, the reward server's token, the Prefect
auth string) is created 0600 from its first byte, in a 0700 directory, and never printed."""
from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
from pathlib import Path
from typing import Callable

log = logging.getLogger("rlhf.atomic")


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


# --- private files: credentials ----------------------------------------------------------------


def private_dir(path: str | Path) -> Path:
    """`path` created 0700 (parents as usual), and made 0700 if it already existed."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def write_private(path: str | Path, text: str) -> Path:
    """`text` into a new file `path` created 0600 (O_EXCL: never over an existing file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # the umask can only narrow the mode; this names it exactly
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return Path(path)


def read_secret_file(path: str | Path, what: str = "token file") -> str:
    """The secret in `path`, stripped.  A missing or empty file is an error naming it (never its
    content); a file group or others can read is used with a warning."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        text = p.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {p} does not exist") from None
    if mode & 0o077:
        log.warning("%s %s can be read by group/others (mode %03o): run `chmod 600 %s`", what, p, mode & 0o777, p)
    if not text.strip():
        raise ValueError(f"{what} {p} is empty")
    return text.strip()


def secret_file(path: str | Path, generate: Callable[[], str], what: str = "token file") -> tuple[str, bool]:
    """(secret, created): the secret in `path`, or a new `generate()` written there -- mode 0600
    from its creation (O_EXCL on a temp name beside it, then linked into place, so no reader ever
    sees it half-written or with wider permissions, and two starters never overwrite each other),
    its directory created 0700."""
    p = Path(path)
    if p.exists():
        return read_secret_file(p, what), False
    p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    secret = generate()
    tmp = p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        write_private(tmp, secret + "\n")
        try:
            os.link(tmp, p)  # atomic, and never over a file another start wrote meanwhile
        except FileExistsError:
            return read_secret_file(p, what), False
        except OSError:  # a filesystem without hard links
            os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)
    return secret, True
