import json
import os
from http.server import BaseHTTPRequestHandler

import pytest

# Services and libraries phone home by default; this machine is offline.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


KINDS = ("unit", "integration", "e2e", "gpu")


def pytest_collection_modifyitems(config, items):
    # every test says what it needs (`make test-unit`, CI selection): an unmarked one is refused
    unmarked = [item.nodeid for item in items if not any(item.get_closest_marker(k) for k in KINDS)]
    if unmarked:
        raise pytest.UsageError(f"tests with no kind marker ({', '.join(KINDS)}): {', '.join(unmarked)}")
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


SMALL_TASK = ["prepare.task.num_sft=600", "prepare.task.num_pref=400", "prepare.task.num_rl=200",
              "prepare.task.num_eval=40", "prepare.task.num_eval_pref=40"]


def rlhf(*args, cwd, env=None, timeout=600):
    """Run the `rlhf` CLI as a user would; returns the CompletedProcess."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "rlhf_core.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="session")
def ray_head():
    """One embedded Ray head for the whole session; tests submit jobs to it via RAY_ADDRESS.  Its
    token's path is in our environment meanwhile (`use_head`), so the commands tests start
    authenticate to it; a test's own client is `runtime.cluster.job_client` (a plain
    JobSubmissionClient sends no token: Ray reads RAY_AUTH_MODE once per process, at import)."""
    from rlhf_core.runtime.cluster import LocalRayHead, use_head

    with LocalRayHead() as head, use_head(head):
        yield head.job_address


@pytest.fixture(scope="session")
def project(tmp_path_factory):
    """A project directory with a small prepared task and the tiny base model."""
    root = tmp_path_factory.mktemp("project")
    proc = rlhf("prepare", "--params", "none.yaml", *[a for s in SMALL_TASK for a in ("--set", s)], cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


# tests start sft from the random base model (a few steps test the machinery, not learning;
# tests/stages/test_learning.py checks the pretrain -> sft -> rm chain learns)
SFT = ["--set", "sft.model_path=artifacts/base", "--set", "sft.max_steps=8", "--set", "sft.save_steps=3", "--set", "sft.global_batch_size=16",
       "--set", "sft.log_steps=4", "--set", "sft.eval_max_new_tokens=4"]


def run_stage(project, ray_head, stage, *args, env=None):
    return rlhf("stage", "run", stage, "--params", "none.yaml", *args, cwd=project, env={"RAY_ADDRESS": ray_head, **(env or {})})


@pytest.fixture(scope="session")
def sft_reference(project, ray_head):
    """An uninterrupted 8-step sft run (the model later stages start from)."""
    proc = run_stage(project, ray_head, "sft", *SFT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return project / "artifacts" / "sft"


def history(out_dir) -> list[dict]:
    """A stage's train_history.jsonl rows."""
    return [json.loads(line) for line in (out_dir / "train_history.jsonl").read_text().splitlines()]


# 5 sft steps of 16 from the base model: the curve every worker layout must reproduce
SFT_CURVE = ["--set", "sft.model_path=artifacts/base", "--set", "sft.max_steps=5", "--set", "sft.global_batch_size=16",
             "--set", "sft.eval_max_new_tokens=2"]


@pytest.fixture(scope="session")
def sft_loss_curve(project, ray_head):
    """SFT_CURVE's train/loss per step with one worker, no ZeRO, no accumulation."""
    proc = run_stage(project, ray_head, "sft", *SFT_CURVE, "--set", "sft.output_dir=artifacts/sft_curve")
    assert proc.returncode == 0, proc.stdout[-3000:]
    return [r["train/loss"] for r in history(project / "artifacts" / "sft_curve")]


class JsonHandler(BaseHTTPRequestHandler):
    """Base of the tests' stand-in HTTP servers (reward servers): `reply` sends a JSON body, or
    only a status; no request log."""

    def reply(self, body: dict | None = None, code: int = 200) -> None:
        self.send_response(code)
        if body is None:
            self.end_headers()
            return
        data = json.dumps(body).encode()
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def make_batch(samples: list[dict]):
    """A RolloutBatch from sample dicts: `token_ids`, `prompt_len` and `action_mask` are needed;
    any other RolloutBatch field given in every sample is taken (per-token ones as response-aligned
    lists), the rest get defaults."""
    from dataclasses import fields

    from rlhf_core.rollout.batch import PER_TOKEN, RolloutBatch, response_matrix

    n = len(samples)
    cols = dict(prompt=["Q: 1+1= A:"] * n, label=["2"] * n, prompt_id=[str(i) for i in range(n)], group=list(range(n)),
                sample_index=[0] * n, response=[" 2"] * n, turns=[1] * n, finish_reason=["stop"] * n, policy_version=[0] * n,
                env_reward=[None] * n, filter=["kept"] * n,
                engine_logprobs=[[-1.0] * (len(s["token_ids"]) - s["prompt_len"]) for s in samples])
    for f in fields(RolloutBatch):
        if all(f.name in s for s in samples):
            cols[f.name] = [s[f.name] for s in samples]
    per_token = {k: response_matrix(cols.pop(k)) for k in PER_TOKEN if k in cols}
    return RolloutBatch(**cols, **per_token)
