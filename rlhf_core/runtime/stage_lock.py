"""One writer per stage output directory.

`OUTPUT_DIR/.lock` is held with `flock` by the process that reads and writes the checkpoints:
the stage's job driver (`training/entrypoint.py::stage_main` takes it before anything else, `chassis.resume_point`
makes sure of it).  The kernel drops a flock when its holder dies, however it dies, so a job
that is still running (say, its command was killed and it was detached) still holds the lock --
correct, it is still writing -- and a stopped or killed job frees it at once.

The file also records the holder (host, pid, Ray job id, since when) for the error message; a
holder that ended cleanly empties it.  A non-empty file whose lock is free is therefore the trace
of a holder that died (SIGKILL, OOM, a lost node): taken over with a warning naming it.  The file
is never deleted: deleting a flock'ed file lets two processes lock two different inodes.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

log = logging.getLogger("rlhf.lock")
LOCK = ".lock"
_held: dict[str, int] = {}  # realpath of the output dir -> our locked fd (one per dir per process)


class StageLocked(RuntimeError):
    """Another run holds the output directory."""


def _path(output_dir: str | Path) -> Path:
    return Path(os.path.realpath(output_dir)) / LOCK


def describe(holder: dict) -> str:
    job = holder.get("ray_job_id")
    who = f"Ray job {job} " if job else ""
    return f"{who}(pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, since {holder.get('since', '?')})"


def _read(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 65536).decode(errors="replace").strip()
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except ValueError:
        return {"raw": raw[:200]}


def _refusal(path: Path, holder: dict, stage: str | None) -> StageLocked:
    key = f"{stage}.output_dir" if stage else "output_dir"
    job = holder.get("ray_job_id")
    stop = f" (`ray job stop {job}`)" if job else ""
    return StageLocked(f"{path.parent} is being written by another run: {describe(holder)}. One writer per output "
                       f"directory: wait for it, stop it{stop}, or set {key} to another directory. Lock: {path}")


def _try_lock(path: Path, attempts: int = 5) -> int | None:
    """Our fd with the lock taken, or None if another process holds it.  A few attempts: a
    concurrent `check` holds a shared lock for an instant and must not make a starting run fail."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    for attempt in range(attempts):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if attempt < attempts - 1:
                time.sleep(0.1)
    os.close(fd)
    return None


def holder(output_dir: str | Path) -> dict | None:
    """Who holds the lock now (None if nobody); takes nothing."""
    path = _path(output_dir)
    if str(path.parent) in _held:
        return _read(_held[str(path.parent)])
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read(fd) or {"raw": "(holder not recorded yet)"}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def check(output_dir: str | Path, stage: str | None = None) -> None:
    """Fail fast (before submitting anything) if another run holds `output_dir`."""
    found = holder(output_dir)
    if found is not None:
        raise _refusal(_path(output_dir), found, stage)


def acquire(output_dir: str | Path, stage: str | None = None) -> None:
    """Take the lock for this process (a no-op if it already holds it); `StageLocked` naming the
    holder if another run has it.  Held until `release` or the process ends."""
    path = _path(output_dir)
    if str(path.parent) in _held:
        return
    fd = _try_lock(path)
    if fd is None:
        fd_read = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            found = _read(fd_read)
        finally:
            os.close(fd_read)
        raise _refusal(path, found or {"raw": "(holder not recorded yet)"}, stage)
    previous = _read(fd)
    if previous:
        alive = ""
        if previous.get("host") == socket.gethostname() and isinstance(previous.get("pid"), int):
            alive = " (its pid is still alive: reused, or on another host)" if _pid_alive(previous["pid"]) else " (its pid is gone)"
        log.warning("taking over a stale lock on %s: its holder %s died without releasing it%s", path.parent, describe(previous), alive)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "ray_job_id": os.environ.get("RLHF_RAY_JOB_ID"),
          "stage": stage, "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps(me) + "\n").encode())
    os.fsync(fd)
    _held[str(path.parent)] = fd
    log.info("holding %s for %s", path, describe(me))


def held(output_dir: str | Path) -> bool:
    return str(_path(output_dir).parent) in _held


def release(output_dir: str | Path) -> None:
    """Empty the holder record (a clean end), then unlock."""
    fd = _held.pop(str(_path(output_dir).parent), None)
    if fd is None:
        return
    try:
        os.ftruncate(fd, 0)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
