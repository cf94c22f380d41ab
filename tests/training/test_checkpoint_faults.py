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


@pytest.fixture
def ckpts(tmp_path):
    """A stage's checkpoints/ dir (its hash record lives beside it, in the stage dir)."""
    return tmp_path / "checkpoints"


def test_disk_full_while_sealing(ckpts, monkeypatch):
    tmp_path = ckpts
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


def test_sigkill_while_writing(ckpts):
    tmp_path = ckpts
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


def test_truncated_newest_checkpoint_falls_back(ckpts):
    tmp_path = ckpts
    complete(tmp_path, 1)
    complete(tmp_path, 2, b"x" * 1000)
    with open(tmp_path / "step_000002" / "engine.bin", "r+b") as f:
        f.truncate(10)
    path, _ = ckpt.find_resumable(tmp_path)
    assert path.name == "step_000001"
    assert "sha256 mismatch" in ckpt.verify(tmp_path / "step_000002")[0]


# --- checkpoints are code: hashes recorded outside the checkpoint dir (issue 16, item 8) ------------


def reseal(ckpt):
    """What an attacker who can write the checkpoint would do: recompute its CHECKSUMS.json."""
    import json

    from rlhf_core.artifacts.manifest import hash_tree

    (ckpt / "CHECKSUMS.json").write_text(json.dumps(hash_tree(ckpt, exclude=("CHECKSUMS.json",))))


def test_a_replaced_checkpoint_with_resealed_checksums_is_not_loaded(ckpts):
    """DeepSpeed unpickles engine states (`weights_only=False`): CHECKSUMS.json inside the dir
    catches a torn write, not a replaced file.  The record beside checkpoints/ does."""
    import json
    import shutil

    complete(ckpts, 1)
    complete(ckpts, 2, b"good weights")
    record = json.loads((ckpts.parent / "checkpoint_hashes.json").read_text())
    assert sorted(record) == ["step_000001", "step_000002"]
    assert record["step_000002"] == json.loads((ckpts / "step_000002" / "CHECKSUMS.json").read_text())

    (ckpts / "step_000002" / "engine.bin").write_bytes(b"a pickle that runs code")
    reseal(ckpts / "step_000002")
    assert ckpt.verify(ckpts / "step_000002") == []  # self-consistent: the old check passed it
    assert "sha256 differs from checkpoint_hashes.json" in ckpt.verify(ckpts / "step_000002", record["step_000002"])[0]
    path, _ = ckpt.find_resumable(ckpts)
    assert path.name == "step_000001"

    # a checkpoint dropped in (copied from elsewhere, written by other code) is not in the record
    shutil.copytree(ckpts / "step_000001", ckpts / "step_000009")
    (ckpts / "latest").write_text("step_000009")
    path, _ = ckpt.find_resumable(ckpts)
    assert path.name == "step_000001"
    # an extra file slipped into a recorded checkpoint would be loaded too: refused
    (ckpts / "step_000001" / "extra.pt").write_bytes(b"x")
    reseal(ckpts / "step_000001")
    assert ckpt.find_resumable(ckpts) is None


def test_the_record_follows_rotation_and_a_restart(ckpts):
    import json

    for step in (1, 2, 3):
        complete(ckpts, step)  # keep=2
    record = json.loads((ckpts.parent / "checkpoint_hashes.json").read_text())
    assert sorted(record) == ["step_000002", "step_000003"] and ckpt.find_resumable(ckpts)[0].name == "step_000003"
    ckpt.reset(ckpts)  # a run that starts over
    assert not (ckpts.parent / "checkpoint_hashes.json").exists() and ckpts.is_dir() and not list(ckpts.iterdir())
