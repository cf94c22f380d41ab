"""One writer per stage output directory: a held lock refuses naming its holder; a dead holder's is taken over."""
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from rlhf_core.artifacts.manifest import verify_manifest, write_manifest
from rlhf_core.runtime import stage_lock

pytestmark = pytest.mark.unit


def hold_in_another_process(out):
    """A stand-in for a running stage job: takes the lock, says so, trains on (sleeps)."""
    script = textwrap.dedent(f"""
        import time
        from rlhf_core.runtime import stage_lock
        stage_lock.acquire({str(out)!r}, "sft")
        print("held", flush=True)
        time.sleep(300)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "RLHF_RAY_JOB_ID": "rlhf-sft-holder"})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_lock_refuses_naming_the_holder_and_a_dead_holder_is_taken_over(tmp_path, caplog):
    out = tmp_path / "artifacts" / "sft"
    holder = hold_in_another_process(out)
    try:
        for attempt in (stage_lock.check, stage_lock.acquire):
            with pytest.raises(stage_lock.StageLocked) as e:
                attempt(out, "sft")
            msg = str(e.value)
            assert "is being written by another run: Ray job rlhf-sft-holder" in msg and f"pid {holder.pid} on host" in msg, msg
            assert "ray job stop rlhf-sft-holder" in msg and "sft.output_dir" in msg
        assert stage_lock.holder(out)["ray_job_id"] == "rlhf-sft-holder"
    finally:
        holder.send_signal(signal.SIGKILL)  # dies without releasing: the kernel drops the flock
        holder.wait()

    assert stage_lock.holder(out) is None  # free, though the file still names the dead holder
    with caplog.at_level(logging.WARNING, logger="rlhf.lock"):
        stage_lock.acquire(out, "sft")
    assert "taking over a stale lock" in caplog.text and "rlhf-sft-holder" in caplog.text and "its pid is gone" in caplog.text
    assert stage_lock.held(out) and json.loads((out / ".lock").read_text())["pid"] == os.getpid()
    stage_lock.acquire(out, "sft")  # re-entrant within the holder (stage_main, then resume_point)

    stage_lock.release(out)  # a clean end empties the record: the next holder has nothing to warn about
    assert (out / ".lock").read_text() == "" and not stage_lock.held(out)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlhf.lock"):
        stage_lock.acquire(out, "sft")
    assert "stale" not in caplog.text
    stage_lock.release(out)


def test_the_lock_file_is_not_part_of_the_artifact(tmp_path):
    out = tmp_path / "rm"
    stage_lock.acquire(out, "rm")
    (out / "metrics.json").write_text("{}")
    write_manifest(out, stage="rm", config={}, config_sha256="0", inputs=[])
    stage_lock.release(out)  # the lock file changes after the manifest was written
    assert verify_manifest(out) == []
