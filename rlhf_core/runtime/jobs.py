"""Run a stage as a Ray job: `python -m MODULE --config resolved.json` (the module from
`rlhf_core.registry`), logs streamed."""
from __future__ import annotations

import hashlib
import logging
import os
import shlex
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from rlhf_core import atomic, registry
from rlhf_core.config import config_secrets
from rlhf_core.runtime import watchdog
from rlhf_core.runtime.cluster import job_client
from rlhf_core.runtime.env import SECRETS_FILE, SETUP_HOOK, extra_names, looks_secret, write_secrets_file

log = logging.getLogger("rlhf.jobs")

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


class JobFailed(RuntimeError):
    """The stage's Ray job did not succeed; the message carries the job's error."""


def write_resolved_config(stage: str, config: dict, output_dir: str | Path) -> Path:
    """The resolved config is the only thing the job receives; it lives beside the artifact."""
    # atomic: a starting job never reads half a file
    return atomic.write_json(Path(output_dir) / "config.resolved.json", {"stage": stage, "config": config})


SECRETS_DIR = Path(".rlhf") / "secrets"
"""Under the project directory (the job runs there, on a cluster's shared file system too): one
0600 file per job with secrets, removed when the job ends."""


@dataclass(frozen=True)
class Secrets:
    """What a job needs that must not be readable through the job API: the config's credentials
    (redacted in config.resolved.json) and secret-looking variables named in RLHF_FORWARD_ENV."""
    config: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, cfg=None) -> "Secrets":
        env = {k: os.environ[k] for k in extra_names() if k in os.environ and looks_secret(k)}
        return cls(config_secrets(cfg) if cfg is not None else {}, env)


def secrets_path(submission_id: str) -> Path:
    return (Path.cwd() / SECRETS_DIR / f"{submission_id}.json").resolve()


def submit(client, entrypoint: str, env_vars: dict[str, str], submission_id: str, metadata: dict[str, str],
           secrets: Secrets | None = None) -> str:
    """Submit `entrypoint` as job `submission_id`.  `secrets` go into a 0600 file whose path the
    job's environment names (RLHF_SECRETS_FILE; `stage_main` reads it, and Ray's setup hook
    gives its actors the variables): the job API shows a runtime_env to anyone who can reach
    the dashboard, so it holds the path only."""
    runtime_env = {"env_vars": dict(env_vars)}
    secrets = secrets or Secrets()
    path = write_secrets_file(secrets_path(submission_id).parent, submission_id, secrets.config, secrets.env)
    if path:
        runtime_env["env_vars"][SECRETS_FILE] = str(path)
        if secrets.env:
            runtime_env["worker_process_setup_hook"] = SETUP_HOOK
    try:
        return _submit_with_retry(client, entrypoint=entrypoint, runtime_env=runtime_env, metadata=metadata, submission_id=submission_id)
    except BaseException:  # no job will read it
        if path:
            path.unlink(missing_ok=True)
        raise


def _submit(client, stage: str, config_path: Path, env_vars: dict[str, str] | None, submission_id: str,
            secrets: Secrets | None = None) -> str:
    cwd = Path.cwd().resolve()
    python = f"{shlex.quote(sys.executable)} -u -m {registry.get(stage).module}"
    entrypoint = f"cd {shlex.quote(str(cwd))} && {python} --config {shlex.quote(str(config_path.resolve()))}"
    # our own submission id, passed into the job too (Ray strips RAY_JOB_ID from a job's env):
    # the stage records it in its manifest and its output-directory lock.  The config's sha256
    # lets the job see that another run on the directory replaced the file before it got the lock.
    env = {"PYTHONUNBUFFERED": "1", **(env_vars or {}), "RLHF_RAY_JOB_ID": submission_id,
           "RLHF_CONFIG_SHA256": hashlib.sha256(config_path.read_bytes()).hexdigest()}
    job_id = submit(client, entrypoint, env, submission_id, {"stage": stage}, secrets)
    log.info("submitted %s as Ray job %s", stage, job_id)
    return job_id


def new_submission_id(stage: str) -> str:
    return f"rlhf-{stage.replace('@', '-')}-{uuid.uuid4().hex[:12]}"


def submit_detached(address: str, stage: str, config_path: Path, env_vars: dict[str, str] | None = None,
                    secrets: Secrets | None = None) -> str:
    """Submit the stage job and return its id at once; it runs on when this process ends (its
    driver removes its secrets file when it ends)."""
    return _submit(job_client(address), stage, config_path, env_vars, new_submission_id(stage), secrets)


def submit_and_wait(address: str, stage: str, config_path: Path, env_vars: dict[str, str] | None = None,
                    poll_s: float = 1.0, out=sys.stdout, guard: bool = True, secrets: Secrets | None = None) -> str:
    """Submit the stage job to the job server at `address`, stream its logs to `out`, and
    return the job id; raise `JobFailed` with the job's message and log tail on failure.
    Ctrl-C stops the job before re-raising.  `guard`: a watchdog in a session of its own stops the
    job if this process dies before the job ends, however it dies (off for an embedded head,
    whose own watchdog takes every job along)."""
    client = job_client(address)
    submission_id = new_submission_id(stage)
    # started before the submission: a kill in between must not leave the job running
    guard_proc = watchdog.spawn(["job", address, submission_id]) if guard else None
    ended = False
    try:
        job_id = _submit(client, stage, config_path, env_vars, submission_id, secrets)
        try:
            _wait(client, stage, job_id, poll_s, out)
        except JobFailed:  # ended by itself
            ended = True
            raise
        except KeyboardInterrupt:  # Ctrl-C / SIGTERM: stop the job, then go
            log.warning("interrupted: stopping Ray job %s", job_id)
            client.stop_job(job_id)
            ended = True
            raise
        ended = True
        return job_id
    finally:
        # dismissed once the job has ended or was stopped; on any other way out (our stdout is a
        # pipe whose reader died, the job server went away ...) it stays and stops the job once we exit
        if guard_proc is not None and ended:
            guard_proc.terminate()
            guard_proc.wait()
        if ended:  # the job's driver removes it too; a job still running (we died) still needs it
            secrets_path(submission_id).unlink(missing_ok=True)


def _wait(client, stage: str, job_id: str, poll_s: float, out) -> str:
    printed = 0
    while True:
        status = str(client.get_job_status(job_id).value)
        logs = client.get_job_logs(job_id)
        if len(logs) > printed:
            out.write(logs[printed:])
            out.flush()
            printed = len(logs)
        if status in TERMINAL:
            break
        time.sleep(poll_s)
    if status != "SUCCEEDED":
        info = client.get_job_info(job_id)
        raise JobFailed(f"stage {stage} (Ray job {job_id}) {status}: {info.message}\n--- log tail ---\n{logs[-3000:]}")
    return job_id


def _submit_with_retry(client, timeout: float = 120.0, **kwargs) -> str:
    """A head whose HTTP server is up may not have its job agent yet ("No available agent")."""
    deadline = time.time() + timeout
    delay = 0.5
    while True:
        try:
            return client.submit_job(**kwargs)
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.time() > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def forward_env() -> dict[str, str]:
    """Environment the job needs from ours (threading, offline flags, fault injection, run ids):
    an allow-list, never secrets (`Secrets` carries those); plus the plain variables
    `RLHF_FORWARD_ENV` names (`runtime/env.py`)."""
    keys = ("VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS", "HF_HUB_OFFLINE", "RLHF_FAULT", "RLHF_FAULT_ONCE", "RLHF_PREFECT_FLOW_RUN_ID",
            "RLHF_PREFECT_TASK_RUN_ID", *extra_names())
    # W&B's settings (mode, project, entity, dir...) for report_to=wandb; its API key through `Secrets`
    wandb = [k for k in os.environ if k.startswith("WANDB_")]
    return {k: os.environ[k] for k in (*keys, *wandb) if k in os.environ and not looks_secret(k)}
