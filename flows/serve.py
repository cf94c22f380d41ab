"""`rlhf serve`: a local Prefect server (SQLite, 127.0.0.1) + the pipeline's deployments.

  alignment-pipeline/full      on demand:  prefect deployment run 'alignment-pipeline/full' --watch
  alignment-pipeline/nightly   cron (default `0 2 * * *`), at most one run at a time

The Prefect UI is served beside the API: open http://127.0.0.1:4200 to watch the pipeline's flow
runs, a task run per stage with its state and retries, and each stage's artifacts (summary,
metrics table, manifest).  With PREFECT_API_URL already set (your own server or Prefect Cloud) no
server is started; the deployments are served against that API.  The server has no authentication: keep it on
127.0.0.1, or set PREFECT_SERVER_API_AUTH_STRING (basic auth) before binding elsewhere.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

log = logging.getLogger("rlhf.serve")


def deployments(repo: str, cron: str = "0 2 * * *"):
    from flows.pipeline import alignment_pipeline

    params = {"repo": repo}
    full = alignment_pipeline.to_deployment(name="full", parameters=params, concurrency_limit=1,
                                            description="The whole pipeline on demand; unchanged stages are skipped.")
    nightly = alignment_pipeline.to_deployment(name="nightly", cron=cron, parameters=params, concurrency_limit=1,
                                               description="Nightly retraining: changed data/params rerun the affected stages, "
                                                           "then the promotion gate.")
    return [full, nightly]


class LocalPrefectServer:
    """`prefect server start` in its own process group, on 127.0.0.1, with its SQLite database
    under `home` (default: the project's .prefect/), with its UI at `ui_url` (`ui=False`: API only)."""

    def __init__(self, home: Path, port: int = 4200, host: str = "127.0.0.1", ui: bool = True):
        self.home, self.port, self.host, self.ui = home, port, host, ui
        self.url = f"http://{host}:{port}/api"
        self.ui_url = f"http://{host}:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> "LocalPrefectServer":
        self.home.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PREFECT_HOME": str(self.home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "PREFECT_SERVER_API_HOST": self.host, "PREFECT_SERVER_API_PORT": str(self.port), "PREFECT_UI_ENABLED": "true" if self.ui else "false",
               "PREFECT_UI_API_URL": self.url}
        env.pop("PREFECT_API_URL", None)
        logf = open(self.home / "server.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", self.host, "--port", str(self.port)],
                                     stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefect server exited with {self.proc.returncode}; see {self.home / 'server.log'}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
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


def serve(repo: str, port: int = 4200, cron: str = "0 2 * * *") -> None:
    """Start (if needed) the server and serve both deployments in the foreground until Ctrl-C."""
    repo = str(Path(repo).resolve())
    server = None
    if not os.environ.get("PREFECT_API_URL"):
        server = LocalPrefectServer(Path(repo) / ".prefect", port).start()
        os.environ["PREFECT_API_URL"] = server.url
        print(f"Prefect UI:  {server.ui_url}  (flow runs, a task per stage, artifacts)\nPrefect API: {server.url}\n"
              f"  export PREFECT_API_URL={server.url}\n  prefect deployment run 'alignment-pipeline/full' --watch", flush=True)
    try:
        from prefect import serve as prefect_serve

        # pause_on_shutdown=False: stopping `rlhf serve` must not pause the nightly schedule
        prefect_serve(*deployments(repo, cron), pause_on_shutdown=False)
    finally:
        if server:
            server.stop()
