"""Faults while writing a checkpoint: the previous one and `latest` survive; leftovers are cleaned."""
import errno
import subprocess
import sys
import textwrap

import pytest

from rlhf_core.training import checkpoint as ckpt

pytestmark = pytest.mark.unit


def complete(ckpt_dir, step, payload=b"weights"):
    tmp = ckpt.begin(ckpt_dir, step)
    (tmp / "engine.bin").write_bytes(payload)
    return ckpt.commit(ckpt_dir, tmp, step, {"step": step}, keep=2)


def assert_previous_intact(ckpt_dir):
    assert (ckpt_dir / "latest").read_text() == "step_000001"
    assert ckpt.verify(ckpt_dir / "step_000001") == []
    path, state = ckpt.find_resumable(ckpt_dir)
    assert path.name == "step_000001" and state == {"step": 1}
    ckpt.clean_stale(ckpt_dir)  # what the next start does
    assert not list(ckpt_dir.glob(".tmp-*"))


def test_disk_full_while_sealing(tmp_path, monkeypatch):
    complete(tmp_path, 1)

    def full(root):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "_fsync_tree", full)
    tmp = ckpt.begin(tmp_path, 2)
    (tmp / "engine.bin").write_bytes(b"half")
    with pytest.raises(OSError, match="No space left"):
        ckpt.commit(tmp_path, tmp, 2, {"step": 2}, keep=2)
    assert (tmp_path / ".tmp-step_000002").exists() and not (tmp_path / "step_000002").exists()
    assert_previous_intact(tmp_path)


def test_sigkill_while_writing(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from rlhf_core.training import checkpoint as ckpt
        d = Path({str(tmp_path)!r})
        t = ckpt.begin(d, 1); (t / "engine.bin").write_bytes(b"w"); ckpt.commit(d, t, 1, {{"step": 1}}, keep=2)
        t = ckpt.begin(d, 2)
        with open(t / "engine.bin", "wb") as f:
            f.write(b"x" * 1_000_000)
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # dies mid-save
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert_previous_intact(tmp_path)


def test_truncated_newest_checkpoint_falls_back(tmp_path):
    complete(tmp_path, 1)
    complete(tmp_path, 2, b"x" * 1000)
    with open(tmp_path / "step_000002" / "engine.bin", "r+b") as f:
        f.truncate(10)
    path, _ = ckpt.find_resumable(tmp_path)
    assert path.name == "step_000001"
    assert "sha256 mismatch" in ckpt.verify(tmp_path / "step_000002")[0]
