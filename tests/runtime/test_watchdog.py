"""The watchdog that ties an embedded Ray head to the command that started it (no Ray here: a
process tree shaped like a head's -- children in process groups and sessions of their own, orphans)."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from rlhf_core.runtime.watchdog import descendants

pytestmark = pytest.mark.unit

# like a Ray head: a daemon, a worker in its own process group, a job driver in its own session,
# and an orphan whose parent exited (it must be re-parented to the watchdog, not to init)
TREE = ("sleep 300 & (set -m; sleep 301 & wait) & setsid sleep 302 & (setsid sleep 303 &) ; "
        "trap 'echo INT > {marker}; exit 0' INT; wait")


def stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def wait_until(cond, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def start_command(tmp_path):
    """A stand-in for `rlhf stage run`: it starts the watchdog over TREE, prints its pid, waits."""
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        from rlhf_core.runtime import watchdog
        w = watchdog.spawn(["head", "--", "sh", "-c", {TREE.format(marker=tmp_path / 'int')!r}])
        print(w.pid, flush=True)
        time.sleep(300)
    """)
    cmd = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    wd = int(cmd.stdout.readline())
    assert wait_until(lambda: len(descendants(wd)) >= 6, 20), descendants(wd)  # sh, 4 sleeps, subshell
    return cmd, wd


def test_sigkill_of_the_command_group_kills_every_process_of_the_head(tmp_path):
    cmd, wd = start_command(tmp_path)
    tree = [wd, *descendants(wd)]
    assert any(os.getsid(p) != os.getsid(wd) for p in tree[1:])  # some left the head's session
    assert sum(int(stat(p)[1]) == wd for p in tree[1:]) == 2  # the head, and the orphan it adopted (subreaper)
    os.killpg(cmd.pid, signal.SIGKILL)  # the watchdog is in a session of its own: not hit
    cmd.wait()
    t0 = time.time()
    assert wait_until(lambda: not any(alive(p) for p in tree), 5), [p for p in tree if alive(p)]
    print(f"all {len(tree)} processes gone {time.time() - t0:.2f} s after the kill")


def test_orderly_stop_interrupts_the_head_first_then_sweeps(tmp_path):
    cmd, wd = start_command(tmp_path)
    tree = descendants(wd)
    os.kill(wd, signal.SIGTERM)  # what LocalRayHead.stop does
    assert wait_until(lambda: not any(alive(p) for p in [wd, *tree]), 15)
    assert (tmp_path / "int").read_text().strip() == "INT"  # `ray start --block` stops its daemons on SIGINT
    os.killpg(cmd.pid, signal.SIGKILL)
    cmd.wait()


def test_a_head_that_exits_by_itself_passes_its_exit_code():
    proc = subprocess.run([sys.executable, "-m", "rlhf_core.runtime.watchdog", "head", "--parent", str(os.getpid()), "--",
                           "sh", "-c", "sleep 300 & exit 7"], timeout=30)
    assert proc.returncode == 7  # and the `sleep` it left behind was swept: the watchdog returned
