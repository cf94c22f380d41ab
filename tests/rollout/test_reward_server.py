"""`rlhf serve-reward` requires a bearer token by default: the token file (0600 in a 0700 directory,
made once, reused), the 401s, and `HttpReward(token_file=...)` scoring through a real server."""
import contextlib
import json
import logging
import os
import stat
import threading
import urllib.error
import urllib.request

import pytest

from rlhf_core import atomic
from rlhf_core.rollout import reward_server as RS
from rlhf_core.rollout import rewards as R

pytestmark = pytest.mark.unit

TOKEN = "test-token-Zx81hQ3v"
SAMPLES = [{"prompt": "p", "response": "r", "label": "l", "token_ids": x, "prompt_len": 2} for x in ([1, 5, 6, 7, 2], [1, 5, 6, 8, 2])]


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_token_file_is_made_0600_in_a_0700_dir_atomically_and_reused(tmp_path):
    path = tmp_path / "proj" / ".rlhf" / "reward-server.token"
    old = os.umask(0)  # the modes must not depend on the umask
    try:
        token, created = atomic.secret_file(path, lambda: TOKEN)
    finally:
        os.umask(old)
    assert (token, created) == (TOKEN, True) and path.read_text().strip() == TOKEN
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left beside it
    assert atomic.secret_file(path, lambda: "another") == (TOKEN, False)  # the next start reuses it
    assert path.read_text().strip() == TOKEN


def test_a_loose_or_missing_token_file_is_said_clearly_without_the_token(tmp_path, caplog):
    path = tmp_path / "tok"
    with pytest.raises(FileNotFoundError, match=f"rl.reward.token_file {path} does not exist"):
        R.HttpReward("http://127.0.0.1:9/score", token_file=str(path))
    path.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        R.HttpReward("http://127.0.0.1:9/score", token_file=str(path))
    path.write_text(TOKEN + "\n")
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="rlhf.atomic"):
        client = R.HttpReward("http://127.0.0.1:9/score", token_file=str(path))
    assert "group/others" in caplog.text and "chmod 600" in caplog.text and TOKEN not in caplog.text
    assert client.headers["Authorization"] == f"Bearer {TOKEN}" and TOKEN not in client.name
    with pytest.raises(ValueError, match="give one of them"):  # basic auth and a token: ambiguous
        R.HttpReward("http://u:p@127.0.0.1:9/score", token_file=str(path))


def test_serve_writes_the_token_file_and_prints_its_path_never_the_token(tmp_path, monkeypatch, capsys, caplog):
    class Fake:
        server_address = ("127.0.0.1", 1)

        def serve_forever(self):
            raise KeyboardInterrupt

        def server_close(self):
            pass

    seen = {}
    monkeypatch.setattr(RS, "make_server", lambda model, host, port, token: seen.update(token=token) or Fake())
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO):
        RS.serve("m", "127.0.0.1", 0)  # the default file, under the current directory
    token = (tmp_path / ".rlhf" / "reward-server.token").read_text().strip()
    out = capsys.readouterr().out
    assert seen["token"] == token and len(token) >= 40  # token_urlsafe(32)
    assert f"rl.reward.token_file={tmp_path / '.rlhf' / 'reward-server.token'}" in out
    assert token not in out + caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        RS.serve("m", "127.0.0.1", 0, auth=False)
    assert seen["token"] is None and "--no-auth" in caplog.text


def test_cli_serve_reward_requires_auth_unless_told_not_to():
    from rlhf_core.cli import build_parser

    args = build_parser().parse_args(["serve-reward", "artifacts/rm/model"])
    assert args.token_file == ".rlhf/reward-server.token" and args.no_auth is False
    args = build_parser().parse_args(["serve-reward", "m", "--no-auth", "--token-file", "/x/t"])
    assert args.no_auth is True and args.token_file == "/x/t"


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A sequence-classification reward model (random head) on the tiny model."""
    from transformers import AutoModelForSequenceClassification

    from rlhf_core.models.tiny import TinyModelConfig, build_model, build_tokenizer

    base, out = tmp_path_factory.mktemp("tiny"), tmp_path_factory.mktemp("rm")
    tok = build_tokenizer(["Q: 12+30= A: 42 wrong, try again."] * 10, vocab_size=300)
    tok.save_pretrained(base)
    build_model(TinyModelConfig(), tok, seed=0).save_pretrained(base)
    AutoModelForSequenceClassification.from_pretrained(base, num_labels=1).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@contextlib.contextmanager
def served(rm_dir, token):
    srv = RS.make_server(str(rm_dir), port=0, token=token)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def call(url, body=None, auth=None):
    """(status, headers, JSON body) of a GET (body None) or POST."""
    headers = {"Content-Type": "application/json", **({"Authorization": auth} if auth else {})}
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def test_score_and_get_reward_need_the_bearer_token(rm_dir):
    score = {"prompts": ["p", "p"], "responses": ["r", "s"], "token_ids": [s["token_ids"] for s in SAMPLES]}
    openrlhf = {"query": ["p r", "p s"], "prompts": ["p", "p"]}
    with served(rm_dir, TOKEN) as base:
        for path, body in (("/score", score), ("/get_reward", openrlhf)):
            for auth in (None, "Bearer wrong", f"Basic {TOKEN}", f"Bearer {TOKEN}x", "Bearer"):
                code, headers, out = call(base + path, body, auth)
                assert code == 401 and headers["WWW-Authenticate"].startswith("Bearer") and "unauthorized" in out["error"], (path, auth)
                assert "rewards" not in out and TOKEN not in json.dumps(out)
            code, _, out = call(base + path, body, f"Bearer {TOKEN}")
            assert code == 200 and len(out["rewards"]) == 2, (path, out)
            assert call(base + path, body, f"bearer  {TOKEN} ")[0] == 200  # the scheme is case-insensitive
        # health stays open for probes, but says what it serves only to a client with the token
        code, _, out = call(base + "/health")
        assert code == 200 and out == {"status": "ok", "auth": "bearer"}
        assert call(base + "/health", auth=f"Bearer {TOKEN}")[2]["model"] == str(rm_dir)


def test_http_reward_scores_through_the_server_with_its_token_file(rm_dir, tmp_path):
    token_file = tmp_path / ".rlhf" / "reward-server.token"
    token, _ = atomic.secret_file(token_file, lambda: TOKEN)
    local, _, _ = R.ModelReward(str(rm_dir), pad_token_id=0)(SAMPLES)
    with served(rm_dir, token) as base:
        client = R.HttpReward(f"{base}/score", token_file=str(token_file))
        remote, _, why = client(SAMPLES)
        assert remote == pytest.approx(local, abs=1e-5) and why == [None, None]
        assert TOKEN not in client.name and TOKEN not in repr(client)
        # without the token, or with another: a clear 401 error that does not retry, and no token in it
        for kwargs in ({}, {"token_file": str(tmp_path / "other")}):
            if kwargs:
                atomic.secret_file(kwargs["token_file"], lambda: "not-the-token")
            with pytest.raises(R.RewardError) as e:
                R.HttpReward(f"{base}/score", retries=3, backoff=5, **kwargs)(SAMPLES)  # a retry would take 5 s+
            assert "HTTP 401" in str(e.value) and "1 attempt(s)" in str(e.value) and TOKEN not in str(e.value)
            assert "not-the-token" not in str(e.value)


def test_no_auth_is_an_explicit_choice(rm_dir):
    with served(rm_dir, None) as base:
        code, _, out = call(base + "/score", {"prompts": ["p"], "responses": ["r"], "token_ids": [SAMPLES[0]["token_ids"]]})
        assert code == 200 and len(out["rewards"]) == 1
        assert call(base + "/health")[2] == {"status": "ok", "auth": "none", "model": str(rm_dir)}
    with pytest.raises(TypeError):  # make_server has no silent default: token=None must be said
        RS.make_server(str(rm_dir), port=0)
