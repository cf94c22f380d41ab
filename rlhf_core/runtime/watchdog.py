"""Ray work dies with the command that started it, however that command dies (SIGKILL included).

  python -m rlhf_core.runtime.watchdog head --parent PID [--temp-dir DIR] -- ray start --head --block ...
  python -m rlhf_core.runtime.watchdog job --parent PID ADDRESS JOB_ID

Each runs in a session of its own (the starter passes `start_new_session`), so a signal to the
command's process group -- a scheduler's kill, Ctrl-C, `kill -9 -PGID` -- does not reach it; it
polls its parent (`getppid()` changes when the parent dies: no signal is needed, and unlike
`PR_SET_PDEATHSIG` it does not fire when merely the starting *thread* ends).

`head`: starts the embedded head as its child and is a child subreaper (`PR_SET_CHILD_SUBREAPER`),
so every process of the head -- GCS, raylet, dashboard, workers in process groups of their own,
job drivers in sessions of their own, and the orphans of any of them -- stays its descendant.
The parent gone: SIGKILL every descendant (the head and every job in it), remove the head's temp
dir, exit.  SIGTERM (an orderly `LocalRayHead.stop`): SIGINT to `ray start` first (it tears its
daemons down), then the same sweep.  Should the watchdog itself be killed, `ray start` gets
SIGINT from the kernel (its `PR_SET_PDEATHSIG`).

`job`: a stage job on an external cluster (`RAY_ADDRESS`).  The parent gone: stop the job (the job
server SIGTERMs its driver, whose actors die with it), retrying for a while in case the
submission was still in flight.  SIGTERM: the command finished; exit quietly.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlhf_core.runtime.ray_auth import job_client

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
POLL_S = 0.2


def _prctl(option: int, arg: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux: the sweep below still finds direct descendants
        return False


def _say(msg: str) -> None:
    try:
        print(f"{time.strftime('%H:%M:%S')} rlhf.watchdog[{os.getpid()}] {msg}", file=sys.stderr, flush=True)
    except OSError:  # the parent's stderr may be a pipe nobody reads any more
        pass


def live_children() -> dict[int, list[int]]:
    """ppid -> pids of every live (non-zombie) process, from /proc."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]  # the command name may hold spaces and parens
        if state not in ("Z", "X"):
            kids.setdefault(int(ppid), []).append(int(entry))
    return kids


def descendants(root: int) -> list[int]:
    """Every live process below `root` in the process tree."""
    if not os.path.isdir("/proc"):  # macOS: no /proc (and no subreaper: orphans escape the sweep)
        import psutil  # a Ray dependency

        found = []
        try:
            kids = psutil.Process(root).children(recursive=True)
        except psutil.Error:
            return found
        for child in kids:
            try:
                if child.status() != psutil.STATUS_ZOMBIE:
                    found.append(child.pid)
            except psutil.Error:  # gone meanwhile
                pass
        return found
    kids, out, stack = live_children(), [], [root]
    while stack:
        for child in kids.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def reap(watch: int | None = None) -> int | None:
    """Collect every exited child (as a subreaper we inherit orphans); the exit code of `watch`
    if it was among them."""
    code = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return code
        if pid == 0:
            return code
        if pid == watch:
            code = os.waitstatus_to_exitcode(status)


def kill_descendants(timeout: float = 10.0) -> list[int]:
    """SIGKILL everything below us until nothing is left (a process forked between two sweeps is
    caught by the next); returns what still lives after `timeout` (a process stuck in the kernel)."""
    deadline = time.time() + timeout
    while True:
        pids = descendants(os.getpid())
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reap()
        if not pids or time.time() > deadline:
            return pids
        time.sleep(0.05)


def run_head(parent: int, cmd: list[str], temp_dirs: list[str], grace: float) -> int:
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append("stop"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only our parent's SIGTERM or its death stop us

    def child_setup():  # in the forked child (we have no threads): SIGINT as usual, and sent to it if we die
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        _prctl(PR_SET_PDEATHSIG, signal.SIGINT)

    head = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=child_setup)
    code = None
    try:
        while code is None:
            code = reap(head.pid)
            if code is not None:
                _say(f"ray head exited by itself (code {code})")
            elif stop:
                os.kill(head.pid, signal.SIGINT)  # `ray start --block` tears its daemons down on SIGINT
                deadline = time.time() + grace
                while code is None and time.time() < deadline:
                    time.sleep(0.1)
                    code = reap(head.pid)
                code = 0
            elif os.getppid() != parent:
                _say(f"parent {parent} is gone: stopping its Ray head and every job in it")
                code = 0
            else:
                time.sleep(POLL_S)
    finally:
        left = kill_descendants()
        if left:
            _say(f"could not kill {left}")
        for temp_dir in temp_dirs:  # session logs, sockets, spilled objects; the head's token
            shutil.rmtree(temp_dir, ignore_errors=True)
    return code


def run_job(parent: int, address: str, job_id: str, window: float) -> int:
    done = []
    signal.signal(signal.SIGTERM, lambda *_: done.append(True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while not done and os.getppid() == parent:
        time.sleep(POLL_S)
    if done:
        return 0
    _say(f"parent {parent} is gone: stopping Ray job {job_id} at {address}")
    deadline = time.time() + window
    while True:
        try:
            job_client(address).stop_job(job_id)  # False: it had already ended
            return 0
        except Exception as e:  # not (yet) known to the server, or the server is unreachable
            if time.time() > deadline:
                _say(f"could not stop Ray job {job_id}: {e}")
                return 1
            time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf_core.runtime.watchdog")
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("head", help="run CMD (the Ray head); kill it and everything it started when the parent dies")
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--temp-dir", action="append", default=[], help="removed once the head is gone (repeatable)")
    p.add_argument("--grace", type=float, default=10.0, help="seconds `ray start` gets to stop on an orderly stop")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    p = sub.add_parser("job", help="stop a Ray job when the parent dies")
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--window", type=float, default=30.0, help="seconds to keep trying to stop the job")
    p.add_argument("address")
    p.add_argument("job_id")
    args = parser.parse_args(argv)
    if args.what == "head":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        return run_head(args.parent, cmd, args.temp_dir, args.grace)
    return run_job(args.parent, args.address, args.job_id, args.window)


def spawn(args: list[str], **popen) -> subprocess.Popen:
    """Start a watchdog for this process, in a session of its own."""
    cmd = [sys.executable, "-m", "rlhf_core.runtime.watchdog", args[0], "--parent", str(os.getpid()), *args[1:]]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True, **popen)


if __name__ == "__main__":
    sys.exit(main())
