"""`rlhf serve` starts its local Prefect server with API auth: the string made once in
REPO/.prefect/api-auth (0600, directory 0700), handed to the server and to this process's client,
never printed; `--no-auth` and an existing PREFECT_API_URL leave it off; `--allow-override` and the
served repository reach the flow runs through this process's environment."""
import base64
import json
import os
import stat
import urllib.error
import urllib.request

import pytest

import flows.serve as S
from flows.overrides import ALLOW_ENV, REPO_ENV

ENV = ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", ALLOW_ENV, REPO_ENV)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.unit
def test_the_auth_string_is_made_once_0600_in_a_0700_dir(tmp_path):
    (tmp_path / ".prefect").mkdir(mode=0o755)  # an older `rlhf serve`'s database directory
    auth, path = S.api_auth(tmp_path)
    assert path == tmp_path / ".prefect" / "api-auth" and auth.startswith("rlhf:") and len(auth) > 40
    assert mode(path) == 0o600 and mode(path.parent) == 0o700 and path.read_text().strip() == auth
    assert S.api_auth(tmp_path) == (auth, path)  # reused


@pytest.fixture
def fake_serve(monkeypatch):
    """serve() with the server start and Prefect's serve stubbed: returns what they were given."""
    import prefect

    seen = {}
    for name in ENV:  # serve() sets these in os.environ: put them back afterwards
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)
    monkeypatch.setattr(S.LocalPrefectServer, "start", lambda self, timeout=120.0: seen.update(server=self) or self)
    monkeypatch.setattr(S.LocalPrefectServer, "stop", lambda self: seen.update(stopped=True))
    monkeypatch.setattr(S, "deployments", lambda repo, cron: [])
    monkeypatch.setattr(prefect, "serve", lambda *d, **kw: seen.update(env={k: os.environ.get(k) for k in ENV}))
    import prefect.context

    monkeypatch.setattr(prefect.context, "refresh_global_settings_context", lambda: seen.update(refreshed=True))
    return seen


@pytest.mark.unit
def test_serve_starts_the_server_with_auth_and_says_how_to_reach_it(tmp_path, fake_serve, capsys):
    S.serve(str(tmp_path), 4321, allow_overrides=["rl.reward.file", "reward_url"])
    auth = (tmp_path / ".prefect" / "api-auth").read_text().strip()
    assert fake_serve["server"].auth == auth and fake_serve["server"].url == "http://127.0.0.1:4321/api" and fake_serve["stopped"]
    assert fake_serve["env"] == {"PREFECT_API_URL": "http://127.0.0.1:4321/api", "PREFECT_API_AUTH_STRING": auth,
                                 ALLOW_ENV: "rl.reward.file,reward_url", REPO_ENV: str(tmp_path.resolve())}
    out = capsys.readouterr().out
    assert f'export PREFECT_API_AUTH_STRING="$(cat {tmp_path.resolve() / ".prefect" / "api-auth"})"' in out
    assert "export PREFECT_API_URL=http://127.0.0.1:4321/api" in out and auth not in out and auth.split(":")[1] not in out


@pytest.mark.unit
def test_no_auth_is_explicit_and_an_existing_api_is_left_alone(tmp_path, fake_serve, capsys, caplog, monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "reward_file")  # inherited: only serve's own flags count
    S.serve(str(tmp_path), 4321, auth=False)
    assert fake_serve["server"].auth is None and fake_serve["env"]["PREFECT_API_AUTH_STRING"] is None
    assert fake_serve["env"][ALLOW_ENV] == "" and "--no-auth" in caplog.text
    assert not (tmp_path / ".prefect" / "api-auth").exists() and "PREFECT_API_AUTH_STRING" not in capsys.readouterr().out
    fake_serve.clear()
    monkeypatch.setenv("PREFECT_API_URL", "http://elsewhere:4200/api")
    S.serve(str(tmp_path / "other"), 4321)
    assert "server" not in fake_serve and fake_serve["env"]["PREFECT_API_URL"] == "http://elsewhere:4200/api"
    assert fake_serve["env"]["PREFECT_API_AUTH_STRING"] is None and not (tmp_path / "other" / ".prefect").exists()


@pytest.mark.unit
def test_cli_serve_flags():
    from rlhf_core.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.no_auth is False and args.allow_override == []
    args = build_parser().parse_args(["serve", "--no-auth", "--allow-override", "rl.reward.file", "--allow-override", "reward_url"])
    assert args.no_auth is True and args.allow_override == ["rl.reward.file", "reward_url"]


@pytest.mark.integration
def test_the_local_server_refuses_a_client_without_the_auth_string(tmp_path):
    """A real `prefect server start` (API only): /api/health stays open (the start's wait uses it),
    every other route needs the basic-auth string."""
    from rlhf_core.runtime.cluster import free_port

    auth, _ = S.api_auth(tmp_path)
    server = S.LocalPrefectServer(tmp_path / ".prefect", free_port(), ui=False, auth=auth).start(timeout=240)
    try:
        def post(headers):
            req = urllib.request.Request(f"{server.url}/flows/filter", data=b"{}", headers={"Content-Type": "application/json", **headers})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        assert post({}) == (401, {"exception_message": "Unauthorized"})
        assert post({"Authorization": "Basic " + base64.b64encode(b"rlhf:wrong").decode()})[0] == 401
        assert post({"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}) == (200, [])
        with urllib.request.urlopen(f"{server.url}/health", timeout=30) as r:
            assert r.status == 200
    finally:
        server.stop()
