"""A checkpoint resumes only when config, data and upstream artifacts are those it was built from
(issue 16, item 1); otherwise the run starts over and says why.  Real files, no Ray: the flow-level
test is tests/flows/test_nightly_upstreams.py."""
import logging

import pytest

from rlhf_core.artifacts.manifest import write_manifest
from rlhf_core.runtime import stage_lock
from rlhf_core.training import checkpoint as ckpt
from rlhf_core.training.chassis import ResumeError, resume_inputs, resume_key, resume_point
from rlhf_core.training.config import TrainConfig

pytestmark = pytest.mark.unit


@pytest.fixture
def stage(tmp_path, monkeypatch):
    """A project with an upstream artifact (a manifest over model/) and training data."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "artifacts" / "up" / "model").mkdir(parents=True)
    (tmp_path / "artifacts" / "up" / "model" / "w.bin").write_bytes(b"v1")
    write_manifest(tmp_path / "artifacts" / "up", stage="up", config={}, config_sha256="c", inputs=[])
    (tmp_path / "reward.py").write_text("def reward(p, r, l, **kw): return [0.0] * len(r)\n")
    out = tmp_path / "artifacts" / "down"
    yield out
    stage_lock.release(out)


def spec(data="d1", upstream=("reward.py",)):
    """(training data fingerprint, further upstream inputs) of the downstream stage."""
    return data, upstream


CFG = TrainConfig(model_path="artifacts/up/model", max_steps=4, save_steps=2)


def checkpoint_at(out, step, inputs):
    tmp = ckpt.begin(out / "checkpoints", step)
    (tmp / "engine.bin").write_bytes(b"w")
    ckpt.commit(out / "checkpoints", tmp, step, {"step": step, "resume_key": resume_key(inputs), "resume_inputs": inputs}, keep=2)


def test_same_inputs_resume_and_a_finished_run_has_nothing_to_train(stage):
    inputs = resume_inputs(CFG, *spec())
    assert set(inputs) == {"config", "data", "upstream"} and set(inputs["upstream"]) == {"artifacts/up/model", "reward.py"}
    checkpoint_at(stage, 2, inputs)
    found = resume_point(stage / "checkpoints", CFG, "down", resume_inputs(CFG, *spec()))
    assert found[0].name == "step_000002"
    more = TrainConfig(model_path="artifacts/up/model", max_steps=9, save_steps=3)  # max_steps and save_steps may change
    assert resume_point(stage / "checkpoints", more, "down", resume_inputs(more, *spec()))[0].name == "step_000002"
    checkpoint_at(stage, 4, inputs)
    with pytest.raises(ResumeError, match="nothing to train"):
        resume_point(stage / "checkpoints", CFG, "down", resume_inputs(CFG, *spec()))


@pytest.mark.parametrize("change, why", [
    ("upstream", "upstream artifacts/up/model changed (its stage reran, or it was replaced)"),
    ("reward", "upstream reward.py changed"),
    ("data", "the training data changed"),
    ("config", "the config changed"),
])
def test_changed_inputs_start_over_and_say_why(stage, caplog, change, why):
    """The nightly cases: new data (sft used to fail with a ResumeError), a retrained upstream
    (rm/dpo/rl used to fail with "nothing to train", or an interrupted one resumed a checkpoint
    built on the old upstream model)."""
    checkpoint_at(stage, 2, resume_inputs(CFG, *spec()))
    cfg, sp = CFG, spec()
    if change == "upstream":  # the upstream stage reran: a new manifest (even for the same bytes)
        (stage.parent / "up" / "model" / "w.bin").write_bytes(b"v2")
        write_manifest(stage.parent / "up", stage="up", config={}, config_sha256="c", inputs=[])
    elif change == "reward":
        (stage.parent.parent / "reward.py").write_text("def reward(p, r, l, **kw): return [1.0] * len(r)\n")
    elif change == "data":
        sp = spec(data="d2")
    else:
        cfg = TrainConfig(model_path="artifacts/up/model", max_steps=4, save_steps=2, lr=0.5)
    with caplog.at_level(logging.WARNING):
        assert resume_point(stage / "checkpoints", cfg, "down", resume_inputs(cfg, *sp)) is None
    assert f"not resuming from step_000002: {why}" in caplog.text and "starting over" in caplog.text
    assert not list((stage / "checkpoints").iterdir()) and not ckpt.record_path(stage / "checkpoints").exists()


def test_a_hub_model_id_is_an_upstream_by_name(stage):
    cfg = TrainConfig(model_path="org/some-model", max_steps=4, save_steps=2)
    a = resume_inputs(cfg, *spec(upstream=()))
    assert set(a["upstream"]) == {"org/some-model"}
    b = resume_inputs(TrainConfig(model_path="org/other-model", max_steps=4, save_steps=2), *spec(upstream=()))
    assert resume_key(a) != resume_key(b)
