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
    from ray.job_submission import JobSubmissionClient

    with LocalRayHead() as later:
        # `ray start` records its address (ray_current_cluster) just before it settles into --block
        deadline = time.time() + 60
        while "block forever" not in Path(later.log_file.name).read_text() and time.time() < deadline:
            time.sleep(0.5)
        client = JobSubmissionClient(ray_head)
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
# a job with an actor: prints the environment each sees, then stays up while the test looks around
ENV_JOB = sys.executable + """ -c "
import json, os, time, ray
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
def test_the_head_listens_on_loopback_only_and_its_jobs_see_no_secret(monkeypatch):
    """Every socket the embedded head and a running job open listens on 127.0.0.1 (GCS, raylet,
    object manager, agents and metrics bound every interface), and no process of it -- job driver
    and actors included, which inherit the head's environment -- sees a secret of ours."""
    from ray.job_submission import JobSubmissionClient

    from rlhf_core.runtime.jobs import forward_env
    from rlhf_core.runtime.watchdog import descendants

    for name in ("RLHF_TEST_API_KEY", "HF_TOKEN", "DB_PASSWORD", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, SECRET)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # an allowed one arrives
    with LocalRayHead(num_cpus=2) as head:
        client = JobSubmissionClient(head.job_address)
        job = client.submit_job(entrypoint=ENV_JOB, runtime_env={"env_vars": forward_env()})
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
            assert SECRET not in json.dumps(env), (who, sorted(k for k, v in env.items() if v == SECRET))
            assert env.get("OMP_NUM_THREADS") == "1", who
        holders = []
        for pid in pids:
            try:
                if SECRET.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                    holders.append(pid)
            except OSError:
                pass
        assert not holders
        client.stop_job(job)


@pytest.mark.integration
def test_a_ray_auth_token_left_by_a_plain_ray_init_does_not_stop_our_head(monkeypatch, tmp_path):
    """Ray 2.60 turns token authentication on for every node started after any `ray.init()` on the
    machine wrote ~/.ray/auth_token; our head then never answered the job client (every stage:
    "ray head did not come up within 120s").  With such a token in HOME, a job still runs."""
    from ray.job_submission import JobSubmissionClient

    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("0123456789abcdef" * 4)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with LocalRayHead(num_cpus=1, startup_timeout=90) as head:
        client = JobSubmissionClient(head.job_address)
        job = client.submit_job(entrypoint=sys.executable + " -c \"import ray; ray.init(address='auto'); print('UP', ray.get(ray.put(7)))\"")
        deadline = time.time() + 120
        while (status := client.get_job_status(job)) not in ("SUCCEEDED", "FAILED", "STOPPED") and time.time() < deadline:
            time.sleep(0.5)
        logs = client.get_job_logs(job)
    assert status == "SUCCEEDED" and "UP 7" in logs, logs[-3000:]
