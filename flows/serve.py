"""`rlhf serve`: a local Prefect server (SQLite, 127.0.0.1) + the pipeline's deployments.

  alignment-pipeline/full      on demand:  prefect deployment run 'alignment-pipeline/full' --watch
  alignment-pipeline/nightly   cron (default `0 2 * * *`), at most one run at a time

The Prefect UI is served beside the API: open http://127.0.0.1:4200 to watch the pipeline's flow
runs, a task run per stage with its state and retries, and each stage's artifacts (summary,
metrics table, manifest).  With PREFECT_API_URL already set (your own server or Prefect Cloud) no
server is started; the deployments are served against that API.

The local server requires basic auth (PREFECT_SERVER_API_AUTH_STRING): an auth string
`rlhf:<random>` made at the first start, kept 0600 in REPO/.prefect/api-auth (directory 0700) and
reused; this process's own client (which runs the deployments' flow runs) gets it as
PREFECT_API_AUTH_STRING; other clients: `export PREFECT_API_AUTH_STRING="$(cat REPO/.prefect/api-auth)"`.
`--no-auth` turns it off (with a warning).  Flow runs from the deployments accept only the
overrides `flows/overrides.py` allows; `--allow-override KEY` lets more through.
"""
from __future__ import annotations

import base64
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from flows.overrides import ALLOW_ENV, REPO_ENV
from rlhf_core.atomic import private_dir, secret_file

log = logging.getLogger("rlhf.serve")


def deployments(repo: str, cron: str = "0 2 * * *"):
    # heavy: Prefect (seconds), which reads its settings when imported: only once start_local has set PREFECT_API_URL
    from flows.pipeline import alignment_pipeline

    params = {"repo": repo}
    full = alignment_pipeline.to_deployment(name="full", parameters=params, concurrency_limit=1,
                                            description="The whole pipeline on demand; unchanged stages are skipped.")
    nightly = alignment_pipeline.to_deployment(name="nightly", cron=cron, parameters=params, concurrency_limit=1,
                                               description="Nightly retraining: changed data/params rerun the affected stages, "
                                                           "then the promotion gate.")
    return [full, nightly]


def api_auth(repo: str | Path) -> tuple[str, Path]:
    """(auth string, its file): REPO/.prefect/api-auth, made at the first call (`rlhf:<token>`, mode
    0600, directory 0700), reused after."""
    path = private_dir(Path(repo) / ".prefect") / "api-auth"  # 0700 even if it existed: the server's database lives there
    auth, _ = secret_file(path, lambda: f"rlhf:{secrets.token_urlsafe(32)}", "Prefect API auth file")
    return auth, path


class LocalPrefectServer:
    """`prefect server start` in its own process group, on 127.0.0.1, with its SQLite database
    under `home` (default: the project's .prefect/), with its UI at `ui_url` (`ui=False`: API only).
    `auth`: a `user:password` string the API then requires (basic auth; /api/health stays open)."""

    def __init__(self, home: Path, port: int = 4200, host: str = "127.0.0.1", ui: bool = True, auth: str | None = None):
        self.home, self.port, self.host, self.ui, self.auth = home, port, host, ui, auth
        self.url = f"http://{host}:{port}/api"
        self.ui_url = f"http://{host}:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> "LocalPrefectServer":
        self.home.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PREFECT_HOME": str(self.home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "PREFECT_SERVER_API_HOST": self.host, "PREFECT_SERVER_API_PORT": str(self.port), "PREFECT_UI_ENABLED": "true" if self.ui else "false",
               "PREFECT_UI_API_URL": self.url}
        env.pop("PREFECT_API_URL", None)
        headers = {}
        if self.auth:
            env["PREFECT_SERVER_API_AUTH_STRING"] = self.auth
            headers["Authorization"] = "Basic " + base64.b64encode(self.auth.encode()).decode()
        logf = open(self.home / "server.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", self.host, "--port", str(self.port)],
                                     stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefect server exited with {self.proc.returncode}; see {self.home / 'server.log'}")
            try:
                with urllib.request.urlopen(urllib.request.Request(f"{self.url}/health", headers=headers), timeout=2) as r:
                    if r.status == 200:
                        log.info("Prefect server at %s (database under %s)", self.url, self.home)
                        return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"prefect server did not answer on {self.url} within {timeout}s; see {self.home / 'server.log'}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_local(repo: str, port: int, auth: bool) -> LocalPrefectServer:
    """The local server (with the repo's auth string unless `auth` is False), this process's
    client pointed at it, and how to reach it printed (the auth file's path, never its content)."""
    secret, path = api_auth(repo) if auth else (None, None)
    if not auth:
        log.warning("--no-auth: the Prefect API on 127.0.0.1:%d accepts anyone on this machine; "
                    "any local user can then start flow runs, whose stages run as you", port)
    server = LocalPrefectServer(Path(repo) / ".prefect", port, auth=secret).start()
    os.environ["PREFECT_API_URL"] = server.url
    if secret:
        os.environ["PREFECT_API_AUTH_STRING"] = secret
    if "prefect.context" in sys.modules:  # Prefect reads its settings at import: let it see these
        getattr(sys.modules["prefect.context"], "refresh_global_settings_context", lambda: None)()
    login = f" (log in with the content of {path})" if path else ""
    print(f"Prefect UI:  {server.ui_url}  (flow runs, a task per stage, artifacts){login}\nPrefect API: {server.url}\n"
          f"  export PREFECT_API_URL={server.url}\n" + (f'  export PREFECT_API_AUTH_STRING="$(cat {path})"\n' if path else "")
          + "  prefect deployment run 'alignment-pipeline/full' --watch", flush=True)
    return server


def serve(repo: str, port: int = 4200, cron: str = "0 2 * * *", auth: bool = True, allow_overrides: list[str] | tuple = ()) -> None:
    """Start (if needed) the server and serve both deployments in the foreground until Ctrl-C.
    `allow_overrides`: keys the deployments' flow runs may override beyond `flows/overrides.py`'s
    safe ones, handed to them in this process's environment (never as a flow parameter)."""
    repo = str(Path(repo).resolve())
    os.environ[ALLOW_ENV] = ",".join(allow_overrides)  # only this command's flags count, not an inherited value
    os.environ[REPO_ENV] = repo  # a deployment's run may work on this repository only
    if allow_overrides:
        log.warning("deployment flow runs may override %s: anyone with access to the Prefect API can set them", ", ".join(allow_overrides))
    server = None if os.environ.get("PREFECT_API_URL") else start_local(repo, port, auth)
    try:
        from prefect import serve as prefect_serve

        # pause_on_shutdown=False: stopping `rlhf serve` must not pause the nightly schedule
        prefect_serve(*deployments(repo, cron), pause_on_shutdown=False)
    finally:
        if server:
            server.stop()
