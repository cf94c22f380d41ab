"""Nightly retraining when upstreams change (issue 16, item 1), through the real flow: Prefect over
DVC in a fresh git repository, every stage a Ray job, checkpoints `persist: true`.

A checkpoint resumes only when config, data and upstream artifacts are those it was built from.
Before, new data made a stage fail ("nothing to train" or a data ResumeError), a retrained sft
made dpo/rl fail with "nothing to train", and an interrupted dpo resumed on top of the *old* sft
model (and its cached reference log-probs).  Here: a first run; new data with dpo killed mid-stage;
then a retrained sft -- every stage that should rerun does, from its current parent, and the
lineage verifies."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import SMALL_TASK, rlhf

from rlhf_core.artifacts.manifest import sha256_file

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
BIN = str(Path(sys.executable).parent)
STAGES = "prepare,pretrain,sft,dpo,rl@rlvr"  # rm and rl@rlhf take the same code paths as dpo and rl@rlvr
PARAMS = {
    "prepare": {"seed": 0, "task": {k.split(".")[-1]: int(v) for k, v in (s.split("=") for s in SMALL_TASK)}},
    "pretrain": {"max_steps": 2, "save_steps": 2, "global_batch_size": 8, "max_len": 64, "eval_max_new_tokens": 2},
    "sft": {"max_steps": 2, "save_steps": 2, "global_batch_size": 16, "eval_max_new_tokens": 2},
    "rm": {"max_steps": 2, "global_batch_size": 16},
    "dpo": {"max_steps": 4, "save_steps": 2, "global_batch_size": 16, "eval_max_new_tokens": 2},
    "rl": {"max_steps": 2, "global_batch_size": 16, "pass_k": 1, "sync_check_prompts": 0, "eval_max_new_tokens": 2,
           "rollout": {"prompts_per_step": 4, "n_samples": 4, "engine": "hf", "max_new_tokens": 4}},
    "rl_variants": {"rlhf": {"algo": "ppo", "reward": {"model": "artifacts/rm/model"}}, "rlvr": {"algo": "grpo"}},
}


def sh(*cmd, cwd, env=None, timeout=300):
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def nightly_repo(tmp_path_factory, ray_head):
    """The project's code, dvc.yaml and .dvc/ in a fresh git repo with tiny params, and a Prefect server."""
    from flows.serve import LocalPrefectServer
    from rlhf_core.runtime.cluster import free_port

    root = tmp_path_factory.mktemp("nightly_repo")
    for f in sh("git", "ls-files", cwd=REPO).stdout.split():
        if f.startswith(("tests/", "docs/", "bench/")) or not (REPO / f).is_file():
            continue
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, root / f)
    (root / "dvc.lock").unlink(missing_ok=True)
    (root / "params.yaml").write_text(yaml.safe_dump(PARAMS))
    env = {"PATH": f"{BIN}:{os.environ['PATH']}", "RAY_ADDRESS": ray_head, "DVC_SITE_CACHE_DIR": str(root / ".dvc" / "tmp" / "site"),
           "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "init"]):
        assert sh(*cmd, cwd=root, env=env).returncode == 0
    server = LocalPrefectServer(root / ".prefect_tests", port=free_port()).start(timeout=180)
    yield root, {**env, "PREFECT_API_URL": server.url}
    server.stop()


def pipeline(root: Path, env: dict, stages: str, *args: str, fault: str | None = None):
    extra = {"RLHF_FAULT": fault, "RLHF_FAULT_ONCE": str(root / f"fault-{fault}.once")} if fault else {}
    return rlhf("pipeline", "run", "--repo", str(root), "--stages", stages, "--no-promote", "--no-push", "--retries", "0", *args,
                cwd=root, env={**env, **extra})


def ran(proc) -> dict:
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    return {stage: bool(v and v["ran"]) for stage, v in result["stages"].items() if v is not None}


def parent_of(root: Path, stage: str, parent: str) -> str:
    """The manifest hash `stage` recorded for its input artifact `parent`."""
    inputs = json.loads((root / "artifacts" / stage / "manifest.json").read_text())["inputs"]
    return next(i["manifest_sha256"] for i in inputs if i["path"] == f"artifacts/{parent}")


def started_over(text: str, checkpoint: str, why: str) -> bool:
    """A stage's log said it did not resume from `checkpoint` because `why` (among its reasons)."""
    return any(why in m for m in re.findall(rf"not resuming from {checkpoint}: (.*?); starting over", text))


def steps(root: Path, stage: str) -> list[int]:
    return [json.loads(line)["step"] for line in (root / "artifacts" / stage / "train_history.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def second_night(nightly_repo):
    """Night 1: the chain.  Night 2: new data (a changed prepare param regenerates data/), and dpo
    is killed after its step 3 (its step-2 checkpoint stays).  Returns night 2's log."""
    root, env = nightly_repo
    first = pipeline(root, env, STAGES)
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    assert all(ran(first).values()), ran(first)
    second = pipeline(root, env, "prepare,pretrain,sft,dpo", "--set", "prepare.task.num_sft=560", fault="sigkill_after_step:3")
    assert second.returncode == 1, (second.stdout + second.stderr)[-4000:]
    return root, env, second.stdout + second.stderr


def manifest(root: Path, stage: str) -> str:
    return sha256_file(root / "artifacts" / stage / "manifest.json")


@pytest.mark.xdist_group("flows_nightly")
def test_new_data_starts_the_stages_over_on_their_current_parents(second_night):
    root, env, text = second_night
    assert "stage dpo failed" in text, text[-4000:]  # killed, as planned
    assert "nothing to train" not in text and "ResumeError" not in text, text[-4000:]
    assert started_over(text, "step_000002", "the training data changed")  # pretrain and sft: new data, a new run
    assert started_over(text, "step_000004", "upstream artifacts/sft/model changed")  # dpo: on the new sft
    assert steps(root, "sft") == [1, 2] and parent_of(root, "sft", "pretrain") == manifest(root, "pretrain")
    dpo = root / "artifacts" / "dpo" / "checkpoints"
    assert json.loads((dpo / "step_000002" / "state.json").read_text())["step"] == 2 and not (dpo / "step_000004").exists()


@pytest.mark.xdist_group("flows_nightly")
def test_a_retrained_sft_reruns_the_interrupted_dpo_and_the_finished_rl_from_step_one(second_night):
    """The interrupted dpo must not resume on the sft it was started from, and rl@rlvr, finished on
    the first night's sft, must rerun rather than have "nothing to train"."""
    root, env, _ = second_night
    sft_before = manifest(root, "sft")
    third = pipeline(root, env, "sft,dpo,rl@rlvr", "--set", "sft.lr=0.002")
    text = third.stdout + third.stderr
    assert third.returncode == 0, text[-4000:]
    assert ran(third) == {"sft": True, "dpo": True, "rl@rlvr": True}
    assert manifest(root, "sft") != sft_before
    assert started_over(text, "step_000002", "the config changed")  # sft
    assert started_over(text, "step_000002", "upstream artifacts/sft/model changed")  # the interrupted dpo (and rl@rlvr)
    assert "resumed from" not in text, text[-4000:]
    for stage in ("dpo", "rl@rlvr"):
        assert parent_of(root, stage, "sft") == manifest(root, "sft"), stage  # built on tonight's sft
    assert steps(root, "dpo") == [1, 2, 3, 4] and steps(root, "rl@rlvr") == [1, 2]  # each a run of its own, from step 1
    from rlhf_core.training.chassis import upstream_digest

    cache = json.loads((root / "artifacts" / "dpo" / "checkpoints" / "reference_logps.json").read_text())
    here = os.getcwd()
    os.chdir(root)
    try:
        assert cache["key"]["model"] == upstream_digest("artifacts/sft/model")  # reference log-probs of tonight's sft
    finally:
        os.chdir(here)
    for artifact in ("artifacts/dpo/model", "artifacts/rl@rlvr/model"):
        ok = rlhf("lineage", "verify", artifact, cwd=root, env=env)
        assert ok.returncode == 0 and "lineage intact" in ok.stdout, ok.stdout + ok.stderr
    status = sh("dvc", "status", "sft", "dpo", "rl@rlvr", cwd=root, env=env)
    assert "changed" not in status.stdout, status.stdout
