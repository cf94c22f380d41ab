"""The embedded Ray head: with another head on the same host; loopback only; no secret reaches its jobs."""
import json
import os
import sys
import time
from pathlib import Path

import pytest

from rlhf_core.runtime.cluster import LocalRayHead

PRINT_GCS = sys.executable + " -c \"import ray; ray.init(address='auto'); print('GCS', ray.get_runtime_context().gcs_address)\""


@pytest.mark.integration
@pytest.mark.xdist_group("rl_more")  # shares that worker's session head
def test_a_job_runs_on_the_head_it_was_submitted_to(ray_head):
    """A head started later on the same host must not capture this head's jobs.  With Ray's shared
    /tmp/ray, the job supervisor gives the driver the address of the head started last (its
    ray_current_cluster file): the driver ran on the other head and died when that one stopped."""
    from rlhf_core.runtime.cluster import job_client

    with LocalRayHead() as later:
        # `ray start` records its address (ray_current_cluster) just before it settles into --block
        deadline = time.time() + 60
        while "block forever" not in Path(later.log_file.name).read_text() and time.time() < deadline:
            time.sleep(0.5)
        client = job_client(ray_head)
        job = client.submit_job(entrypoint=PRINT_GCS)
        deadline = time.time() + 120
        while (status := client.get_job_status(job)) not in ("SUCCEEDED", "FAILED", "STOPPED") and time.time() < deadline:
            time.sleep(0.5)
        logs = client.get_job_logs(job)
        assert status == "SUCCEEDED", logs[-3000:]
        gcs = [line.split()[-1] for line in logs.splitlines() if line.startswith("GCS ")]
        assert gcs and not gcs[0].endswith(f":{later.gcs_port}"), (gcs, later.gcs_port)
        temp_dir = later.temp_dir
    assert not os.path.exists(temp_dir)  # stop() removes the head's session files


SECRET = "sk-test-0a1b2c3d4e5f"


def listening(pids: list[int]) -> list[tuple]:
    """(pid, process name, address, port) of every listening TCP socket and bound UDP socket."""
    import psutil

    out = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            conns = proc.net_connections(kind="inet")
            name = proc.name()
        except psutil.Error:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN or (c.status == psutil.CONN_NONE and c.laddr):
                out.append((pid, name, c.laddr.ip, c.laddr.port))
    return out


@pytest.mark.integration
@pytest.mark.xdist_group("rl_more")
def test_the_head_listens_on_loopback_only_and_its_jobs_see_no_secret(monkeypatch, tmp_path):
    """Every socket the embedded head and a running job open listens on 127.0.0.1 (GCS, raylet,
    object manager, agents and metrics bound every interface); no process of it -- job driver
    and actors included, which inherit the head's environment -- has a secret of ours in its
    environment; a secret forwarded on purpose (RLHF_FORWARD_ENV=HF_TOKEN) reaches the driver and
    the actor through a 0600 file, and the job API shows neither it nor anything but its path."""
    from rlhf_core.runtime import jobs
    from rlhf_core.runtime.watchdog import descendants

    for name in ("RLHF_TEST_API_KEY", "HF_TOKEN", "DB_PASSWORD", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, SECRET)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # an allowed one arrives
    monkeypatch.setenv("RLHF_FORWARD_ENV", "HF_TOKEN")
    monkeypatch.chdir(tmp_path)  # the secrets file lives under the project dir (.rlhf/secrets)
    with LocalRayHead(num_cpus=2) as head:
        client = head.client()
        secrets = jobs.Secrets.of()
        assert secrets.env == {"HF_TOKEN": SECRET}
        job = jobs.submit(client, ENV_JOB, jobs.forward_env(), jobs.new_submission_id("env"), {"stage": "env"}, secrets)
        path = jobs.secrets_path(job)
        assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
        deadline = time.time() + 180
        env_line = lambda: next((x for x in client.get_job_logs(job).splitlines() if x.startswith("ENV={")), None)  # noqa: E731
        while not env_line() and time.time() < deadline:  # the job and its actor are up
            assert client.get_job_status(job) not in ("FAILED", "STOPPED"), client.get_job_logs(job)[-3000:]
            time.sleep(0.5)
        assert env_line(), client.get_job_logs(job)[-3000:]
        pids = descendants(head.proc.pid)  # watchdog's tree: GCS, raylet, agents, dashboard, job driver, actor
        sockets = listening(pids)
        exposed = [s for s in sockets if s[2] not in ("127.0.0.1", "::ffff:127.0.0.1", "::1")]
        assert len(sockets) >= 8 and not exposed, exposed  # 8+: GCS, raylet x2, agents, dashboard, client server, workers
        seen = json.loads(env_line()[4:])
        for who, env in seen.items():
            assert env.get("HF_TOKEN") == SECRET, who  # forwarded on purpose: it arrives ...
            others = {k for k, v in env.items() if v == SECRET} - {"HF_TOKEN"}
            assert not others, (who, others)  # ... and nothing else does
            assert env.get("OMP_NUM_THREADS") == "1", who
        info = client.get_job_info(job)  # what anyone who reaches the job API reads back
        shown = json.dumps(info.model_dump(), default=str)
        assert SECRET not in shown and str(path) in shown, shown
        holders = []
        for pid in pids:  # the processes' starting environments: the hook sets the actor's later
            try:
                if SECRET.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                    holders.append(pid)
            except OSError:
                pass
        assert not holders
        client.stop_job(job)


ENV_JOB = sys.executable + """ -c "
import json, os, time, ray
from rlhf_core.runtime.env import apply_job_secrets
apply_job_secrets()  # what stage_main does
ray.init(address='auto')
@ray.remote
class A:
    def env(self):
        return dict(os.environ)
a = A.remote()
print('ENV=' + json.dumps({'driver': dict(os.environ), 'actor': ray.get(a.env.remote())}), flush=True)
time.sleep(60)
"
"""


@pytest.mark.integration
def test_the_job_api_needs_the_heads_token_and_a_stale_home_token_does_not_lock_us_out(monkeypatch, tmp_path):
    """Token authentication is on for every head we start, with a token of its own (0600, in a
    0700 dir): the job API refuses a request without it or with another; neither a token a plain
    `ray.init()` left in ~/.ray/auth_token nor a RAY_AUTH_TOKEN in the shell locks our commands
    out (both once made every stage fail with "ray head did not come up within 120s")."""
    import urllib.error
    import urllib.request

    from rlhf_core.runtime.cluster import job_client, use_head

    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("0123456789abcdef" * 4)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RAY_AUTH_TOKEN", "f" * 64)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with LocalRayHead(num_cpus=1, startup_timeout=90) as head:
        assert head.token_path.stat().st_mode & 0o777 == 0o600 and head.token_path.parent.stat().st_mode & 0o777 == 0o700
        for headers in ({}, {"Authorization": "Bearer " + "0123456789abcdef" * 4}):
            req = urllib.request.Request(f"{head.job_address}/api/jobs/", headers=headers)
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(req, timeout=10)
            assert refused.value.code in (401, 403), headers
        client = head.client()
        job = client.submit_job(entrypoint=sys.executable + " -c \"import ray; ray.init(address='auto'); print('UP', ray.get(ray.put(7)))\"")
        deadline = time.time() + 120
        while (status := client.get_job_status(job)) not in ("SUCCEEDED", "FAILED", "STOPPED") and time.time() < deadline:
            time.sleep(0.5)
        logs = client.get_job_logs(job)
        assert status == "SUCCEEDED" and "UP 7" in logs, logs[-3000:]
        # a command run meanwhile (what `rlhf stage run` does inside job_server) authenticates through our environment
        with use_head(head):
            assert "RAY_AUTH_TOKEN" not in os.environ and os.environ["RAY_AUTH_TOKEN_PATH"] == str(head.token_path)
            assert job in [j.submission_id for j in job_client(head.job_address).list_jobs()]
        token_dir = head.token_path.parent
    assert not token_dir.exists()
    assert os.environ["RAY_AUTH_TOKEN"] == "f" * 64  # use_head gave it back


@pytest.mark.integration
def test_auth_off_only_when_the_user_says_so(monkeypatch, caplog):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    import urllib.request

    with LocalRayHead(num_cpus=1, startup_timeout=90) as head:
        assert head.token_path is None and "token authentication is off" in caplog.text
        with urllib.request.urlopen(f"{head.job_address}/api/jobs/", timeout=10) as r:
            assert r.status == 200
