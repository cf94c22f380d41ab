"""What reaches Ray processes and files from us: an environment allow-list, and URLs with their
credentials redacted (issue 16, item 3).  The head's sockets and its jobs' environments are
checked for real in tests/runtime/test_cluster.py."""
import base64
import json
import os
import threading
from http.server import ThreadingHTTPServer

import pytest
from conftest import JsonHandler

from rlhf_core.config import config_hash, config_secrets, config_to_dict, redact_url, restore_secrets
from rlhf_core.rollout.config import RewardConfig
from rlhf_core.runtime import env as E
from rlhf_core.runtime.jobs import Secrets, forward_env
from stages.rl import Config

pytestmark = pytest.mark.unit
SECRET = "s3cr3t-pa55"


def test_head_env_is_an_allow_list_without_secrets():
    environ = {"PATH": "/bin", "HOME": "/root", "LC_ALL": "C", "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "1",
               "RAY_AUTH_TOKEN_PATH": "/root/.ray/t", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
               "HF_TOKEN": SECRET, "VLLM_API_KEY": SECRET, "RLHF_TEST_API_KEY": SECRET, "AWS_SECRET_ACCESS_KEY": SECRET,
               "DB_PASSWORD": SECRET, "HTTPS_PROXY": f"http://u:{SECRET}@proxy", "PREFECT_API_KEY": SECRET, "PIP_CERT": "/x",
               "WANDB_MODE": "offline", "WANDB_API_KEY": SECRET}
    kept = E.head_env(environ)
    assert set(kept) == {"PATH", "HOME", "LC_ALL", "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE", "RAY_AUTH_TOKEN_PATH",
                         "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "WANDB_MODE"}
    # an explicit choice passes a named plain variable; a named secret goes through the job's secrets file instead
    assert E.head_env({**environ, "RLHF_FORWARD_ENV": "HF_TOKEN, PIP_CERT"}).keys() == kept.keys() | {"PIP_CERT"}


def test_jobs_get_an_allow_list(monkeypatch):
    monkeypatch.setenv("RLHF_TEST_API_KEY", SECRET)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("RLHF_FAULT", "sigkill_after_step:2")  # ours, not the head's allow-list: the job needs them
    monkeypatch.setenv("RLHF_PREFECT_FLOW_RUN_ID", "f-1")
    monkeypatch.delenv("RLHF_FORWARD_ENV", raising=False)
    env = forward_env()
    assert SECRET not in json.dumps(env) and env["OMP_NUM_THREADS"] == "3"
    assert env["RLHF_FAULT"] == "sigkill_after_step:2" and env["RLHF_PREFECT_FLOW_RUN_ID"] == "f-1"
    monkeypatch.setenv("RLHF_FORWARD_ENV", "RLHF_TEST_API_KEY,PIP_CERT")
    monkeypatch.setenv("PIP_CERT", "/etc/ca.pem")
    # named: a secret travels in the secrets file (Secrets), never in the job's runtime_env; a plain one in it
    assert "RLHF_TEST_API_KEY" not in forward_env() and forward_env()["PIP_CERT"] == "/etc/ca.pem"
    assert Secrets.of().env == {"RLHF_TEST_API_KEY": SECRET}


def test_credentials_in_urls_are_redacted_in_every_file_and_restored_in_the_job():
    url = f"https://user:{SECRET}@rewards.example:8443/score?api_key={SECRET}&model=rm-2"
    assert redact_url(url) == "https://***@rewards.example:8443/score?api_key=***&model=rm-2"
    for plain in ("http://127.0.0.1:8765/score", "artifacts/rm/model", "http://h/score?model=x"):
        assert redact_url(plain) == plain
    cfg = Config(reward=RewardConfig(url=url))
    written = config_to_dict(cfg)  # what config.resolved.json, manifests and `rlhf config show` hold
    assert SECRET not in json.dumps(written) and written["reward"]["url"] == redact_url(url)  # rl.reward.url: a nested key
    assert config_hash(cfg) == config_hash(Config(reward=RewardConfig(url=redact_url(url))))  # no hash of a password either
    assert Secrets.of(cfg).config == {"reward.url": url} == config_secrets(cfg)  # handed to the job in a 0600 file ...
    assert restore_secrets(written, config_secrets(cfg))["reward"]["url"] == url  # ... and put back there
    changed = {**written, "reward": {**written["reward"], "url": "http://other/score"}}
    assert restore_secrets(changed, config_secrets(cfg))["reward"]["url"] == "http://other/score"
    assert Secrets.of(Config()).config == {}


def test_manifest_and_stage_main_keep_credentials_out_of_files(tmp_path, monkeypatch):
    """The job's side: stage_main reads the redacted file plus the environment; finish() writes a
    manifest without the secret."""
    from rlhf_core.training import entrypoint, results
    from rlhf_core.training.config import TrainConfig

    url = f"http://user:{SECRET}@127.0.0.1:9/score"
    resolved = tmp_path / "config.resolved.json"
    resolved.write_text(json.dumps({"stage": "rl", "config": config_to_dict(Config(output_dir=str(tmp_path / "out"), reward=RewardConfig(url=url)))}))
    seen = {}
    path = E.write_secrets_file(tmp_path / "secrets", "job-1", {"reward.url": url}, {"RLHF_TEST_TOKEN": SECRET})
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    monkeypatch.setenv(E.SECRETS_FILE, str(path))
    monkeypatch.delenv("RLHF_CONFIG_SHA256", raising=False)
    monkeypatch.delenv("RLHF_TEST_TOKEN", raising=False)
    entrypoint.stage_main(Config, "rl", lambda cfg: seen.update(url=cfg.reward.url, token=os.environ.get("RLHF_TEST_TOKEN")),
                      ["--config", str(resolved)], needs_ray=False)
    assert seen == {"url": url, "token": SECRET} and SECRET not in resolved.read_text()
    assert not path.exists()  # the job removes its secrets file when it ends

    out = tmp_path / "artifact"
    out.mkdir()
    cfg = TrainConfig(model_path=url)  # any setting: every string is checked
    results.finish(out, "x", cfg, {"m": 1.0})
    assert SECRET not in (out / "manifest.json").read_text() and "***@127.0.0.1:9" in (out / "manifest.json").read_text()


class _Auth(JsonHandler):
    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        good = "Basic " + base64.b64encode(f"user:{SECRET}".encode()).decode()
        if self.headers.get("Authorization") != good:
            return self.reply(code=401)
        self.reply({"rewards": [1.0] * len(body["responses"])})


def test_http_reward_sends_url_credentials_as_basic_auth_and_never_shows_them():
    from rlhf_core.rollout.rewards import HttpReward, RewardError

    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Auth)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        port = srv.server_address[1]
        samples = [{"prompt": "p", "response": "r", "label": "l", "token_ids": [1]}]
        ok = HttpReward(f"http://user:{SECRET}@127.0.0.1:{port}/score")
        assert ok(samples)[0] == [1.0] and SECRET not in ok.name
        with pytest.raises(RewardError) as e:  # wrong password: 401, not retried; the message names the URL, redacted
            HttpReward(f"http://user:wrong@127.0.0.1:{port}/score", retries=0)(samples)
        assert "HTTP 401" in str(e.value) and f"http://***@127.0.0.1:{port}/score" in str(e.value) and "wrong" not in str(e.value)
    finally:
        srv.shutdown()


def test_a_refused_submission_leaves_no_secrets_file(tmp_path, monkeypatch):
    """The job server refuses the submission (here: a 401): the secrets file written for the job is removed."""
    from rlhf_core.runtime import jobs

    class Refusing:
        def submit_job(self, **kw):
            raise RuntimeError("Request failed with status code 401")

    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="401"):
        jobs.submit(Refusing(), "true", {}, "job-x", {}, Secrets({"reward.url": "http://u:p@h/score"}, {}))
    assert not jobs.secrets_path("job-x").exists() and jobs.secrets_path("job-x").parent.is_dir()
