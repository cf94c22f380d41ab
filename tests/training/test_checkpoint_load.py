"""A checkpoint that verifies but fails to load: a clear error naming it and why, then the previous one."""
import logging

import pytest

from rlhf_core.training import checkpoint as ckpt
from rlhf_core.training.chassis import ResumeError, load_resumable

pytestmark = pytest.mark.unit


def complete(ckpt_dir, step, key="k"):
    tmp = ckpt.begin(ckpt_dir, step)
    (tmp / "engine.bin").write_bytes(b"w%d" % step)
    return ckpt.commit(ckpt_dir, tmp, step, {"step": step, "resume_key": key}, keep=3)


def deepspeed_like_load(path):
    if not (path / "missing.pt").exists(): raise AssertionError  # noqa: E701  (a bare `assert` in a library; pytest rewrites ours)


def test_explain_names_the_failing_line_of_a_bare_assert():
    try:
        deepspeed_like_load(ckpt.Path("/nonexistent"))
    except AssertionError as e:
        why = ckpt.explain(e)
    assert why.startswith("AssertionError: failed at test_checkpoint_load.py:") and "missing.pt" in why, why
    assert ckpt.explain(ValueError("bad shape")) == "ValueError: bad shape"


def test_a_checkpoint_that_fails_to_load_falls_back_to_the_previous_complete_one(tmp_path, caplog):
    tmp_path = tmp_path / "checkpoints"  # the stage dir holds the hash record beside it
    complete(tmp_path, 1, key="other run")  # not ours: never tried
    complete(tmp_path, 2)
    complete(tmp_path, 3)
    tried = []

    def load(path):
        tried.append(path.name)
        if path.name == "step_000003":
            raise ckpt.CheckpointLoadError(f"checkpoint {path} could not be loaded (rank 0): AssertionError: failed at engine.py:1")

    with caplog.at_level(logging.WARNING):
        path, state = load_resumable(tmp_path, ckpt.find_resumable(tmp_path), "sft", "k", load)
    assert (path.name, state["step"], tried) == ("step_000002", 2, ["step_000003", "step_000002"])
    assert "step_000003 could not be loaded, trying the previous complete one" in caplog.text
    assert f"checkpoint {tmp_path}/step_000003 could not be loaded (rank 0): AssertionError" in caplog.text

    def broken(path):
        deepspeed_like_load(path)

    with pytest.raises(ResumeError) as e:
        load_resumable(tmp_path, ckpt.find_resumable(tmp_path), "sft", "k", broken)
    msg = str(e.value)
    assert "step_000003: AssertionError: failed at" in msg and "step_000002: AssertionError" in msg and "step_000001" not in msg
    assert "--set sft.resume=false" in msg
