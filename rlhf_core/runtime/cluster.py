"""Where stages run: the cluster at `RAY_ADDRESS`, or an embedded local Ray head.

The embedded head binds every port it opens -- GCS, raylet (node and object manager), dashboard
and job server, dashboard and runtime-env agents, metrics exporters, Ray client server -- to
127.0.0.1, each on a free port, and gets an allow-list of our environment (`runtime/env.py`:
its job drivers and workers inherit it).  It runs under a watchdog (`runtime/watchdog.py`) in a
session of its own: the watchdog starts `ray start --head --block`, keeps every process of the
head as its descendant, and kills them all -- jobs included -- when we stop the head or when this
process dies, however it dies.  Never `ray stop`, which would
kill every Ray process on the host.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from rlhf_core import atomic
from rlhf_core.runtime import watchdog
from rlhf_core.runtime.ray_auth import AUTH_MODE, TOKEN_PATH, auth_disabled, auth_headers, job_client, ray_node_env

log = logging.getLogger("rlhf.cluster")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """n distinct free ports, all bound at once before any is released: asked one at a time, the
    OS may hand out the same port twice, and Ray refuses to start ("trying to use a port number
    ... that is used by other components")."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


PORT_FLAGS = ("ray-client-server-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
              "metrics-export-port", "node-manager-port", "object-manager-port")
PORT_ENV = ("AUTOSCALER_METRIC_PORT", "DASHBOARD_METRIC_PORT")


class LocalRayHead:
    """A Ray head on this machine, owned by this process.  Use as a context manager."""

    def __init__(self, num_cpus: int | None = None, startup_timeout: float = 120.0, multi_node: bool = False):
        self.num_cpus = num_cpus or os.cpu_count() or 1
        self.multi_node = multi_node
        """Other nodes may join (`add_node`): the head then binds the host's address, not 127.0.0.1."""
        self.startup_timeout = startup_timeout
        # GCS, dashboard, then the ports `start` assigns: every one explicit and distinct
        self.gcs_port, self.dashboard_port, *self._ports = free_ports(2 + len(PORT_FLAGS) + len(PORT_ENV))
        self.proc: subprocess.Popen | None = None
        self.nodes: list[subprocess.Popen] = []  # further nodes joined to this head (`add_node`)
        self.log_file = tempfile.NamedTemporaryFile(prefix="rlhf-ray-head-", suffix=".log", delete=False)
        # A temp dir of its own, not the shared /tmp/ray: Ray's job supervisor hands each job driver
        # the address in {temp_dir}/ray_current_cluster, which names the head started *last* on the
        # host.  With a shared dir, a job submitted here ran its driver on another head (a second
        # pipeline, a parallel test) and died when that one stopped ("Owner's node has crashed").
        # Short and under /tmp: Ray's Unix socket paths live inside and are limited to 107 bytes.
        self.temp_dir = tempfile.mkdtemp(prefix="rlhf-ray-", dir="/tmp")
        # its token: 0600 in a 0700 dir of its own (Ray makes its temp dir world-writable), removed with the head
        self.token_path = None
        if not auth_disabled():
            self.token_path = atomic.write_private(Path(tempfile.mkdtemp(prefix="rlhf-ray-auth-")) / "auth_token", secrets.token_hex(32))

    @property
    def auth_env(self) -> dict[str, str]:
        """What a client of this head needs in its environment (`use_head`, `auth_headers`)."""
        return {AUTH_MODE: "disabled"} if self.token_path is None else {AUTH_MODE: "token", TOKEN_PATH: str(self.token_path)}

    @property
    def headers(self) -> dict[str, str]:
        return auth_headers(self.auth_env)

    def client(self):
        """A JobSubmissionClient of this head, with its token."""
        return job_client(self.job_address, self.auth_env)

    def _get(self, path: str, timeout: float):
        return urllib.request.urlopen(urllib.request.Request(self.job_address + path, headers=self.headers), timeout=timeout)

    @property
    def job_address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def start(self) -> "LocalRayHead":
        cmd = [
            _ray_bin(), "start", "--head", "--block", "--disable-usage-stats",
            f"--port={self.gcs_port}", "--node-ip-address=127.0.0.1",
            "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
            f"--num-cpus={self.num_cpus}", f"--temp-dir={self.temp_dir}",
        ]
        # every listening port explicit and free: defaults (e.g. the agent's 52365) collide with
        # a head that is still shutting down, or a second pipeline on the same host
        ports = iter(self._ports)
        cmd += [f"--{flag}={next(ports)}" for flag in PORT_FLAGS]
        if self.token_path is None:
            log.warning("Ray token authentication is off (RAY_AUTH_MODE=disabled): any local user can submit jobs to this "
                        "head, i.e. run code as you, and read their environment")
        env = ray_node_env(self.token_path)  # job drivers and workers inherit the head's environment: never all of ours
        env.update({
            "RAY_USAGE_STATS_ENABLED": "0",
            # Ray 2.60's `ray start` replaces --node-ip-address=127.0.0.1 by the host's address
            # (services.resolve_ip_for_localhost) unless clustering is off, and then GCS, raylet and
            # agents bind every interface; off, every one of them binds 127.0.0.1 -- and no node can join
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1" if self.multi_node else "0",
            # the two metrics ports that have no `ray start` flag (defaults 44217 and 44227)
            **{name: str(next(ports)) for name in PORT_ENV},
        })
        log.info("starting local Ray head (dashboard %s, token dir %s, temp dir %s)", self.job_address,
                 self.token_path.parent if self.token_path else "none: auth off", self.temp_dir)
        dirs = [self.temp_dir, *([str(self.token_path.parent)] if self.token_path else [])]  # the watchdog removes both, however we die
        self.proc = watchdog.spawn(["head", *[a for d in dirs for a in ("--temp-dir", d)], "--", *cmd], stdout=self.log_file,
                                   stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + self.startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray head exited with code {self.proc.returncode}; log: {self.log_file.name}\n{self._tail()}")
            if self._job_server_up():
                return self
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"ray head did not come up within {self.startup_timeout:.0f}s; log: {self.log_file.name}\n{self._tail()}")

    def add_node(self, num_cpus: int, resources: dict[str, float] | None = None, timeout: float = 60.0) -> None:
        """Join a second Ray node on this machine to the head (`ray start --address`, as a worker
        node of a real cluster joins), with its own CPUs and custom `resources` that work can be
        pinned to.  A two-node cluster on one host: the multi-node tests place ranks and roles on
        both.  Stopped with the head, under a watchdog of its own.  Needs `multi_node=True`."""
        if not self.multi_node:
            raise RuntimeError("this head binds 127.0.0.1 only and takes no other node: start it with multi_node=True")
        ports = free_ports(6)
        cmd = [_ray_bin(), "start", "--block", "--disable-usage-stats", f"--address=127.0.0.1:{self.gcs_port}",
               "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}", f"--resources={json.dumps(resources or {})}",
               *[f"--{flag}={port}" for flag, port in zip(("node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
                                                         "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port"), ports)]]
        env = ray_node_env(self.token_path)
        env.update({"RAY_USAGE_STATS_ENABLED": "0"})
        self.nodes.append(watchdog.spawn(["head", "--", *cmd], stdout=self.log_file, stderr=subprocess.STDOUT, env=env))
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self._alive_nodes() >= 1 + len(self.nodes):
                return
            if self.nodes[-1].poll() is not None:
                break
            time.sleep(0.5)
        raise RuntimeError(f"the added Ray node did not join within {timeout:.0f}s; log: {self.log_file.name}\n{self._tail()}")

    def _alive_nodes(self) -> int:
        try:
            with self._get("/nodes?view=summary", timeout=5) as r:
                return sum(1 for n in json.loads(r.read())["data"]["summary"] if n["raylet"]["state"] == "ALIVE")
        except (OSError, KeyError, ValueError):
            return 0

    def _job_server_up(self) -> bool:
        try:
            with self._get("/api/version", timeout=2) as r:
                return r.status == 200
        except urllib.error.HTTPError as e:
            return e.code in (401, 403)  # up, and it does not take our token: the job client will say so
        except OSError:
            return False

    def _tail(self, n: int = 4000) -> str:
        return Path(self.log_file.name).read_text(errors="replace")[-n:]

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM our watchdog: it SIGINTs `ray start --block` (which tears its daemons down;
        SIGTERM would not), then SIGKILLs every process of the head that is left.  Should the
        watchdog not finish, SIGKILL its process group (`ray start` then gets SIGINT from the kernel)."""
        if self.proc is None:
            return
        for node in self.nodes:  # the added nodes first: their raylets would otherwise wait for the GCS
            self._stop_watchdog(node, timeout)
        self.nodes = []
        self._stop_watchdog(self.proc, timeout)
        self.proc = None
        shutil.rmtree(self.temp_dir, ignore_errors=True)  # the watchdog did; unless it could not
        if self.token_path is not None:
            shutil.rmtree(self.token_path.parent, ignore_errors=True)
        log.info("stopped local Ray head")

    @staticmethod
    def _stop_watchdog(proc: subprocess.Popen, timeout: float) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("a Ray node's watchdog did not stop in time: killing it")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)

    def __enter__(self) -> "LocalRayHead":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def cluster_job_address() -> str | None:
    """The job-submission address of the cluster at `RAY_ADDRESS` (a dashboard URL, or
    `ray://host:10001` whose dashboard is on 8265); None when it is not set."""
    address = os.environ.get("RAY_ADDRESS")
    if address and address.startswith("ray://"):
        address = "http://" + address[len("ray://"):].rsplit(":", 1)[0] + ":8265"
    return address or None


@contextlib.contextmanager
def use_head(head: LocalRayHead):
    """While the block runs, our environment names `head`'s token (RAY_AUTH_MODE,
    RAY_AUTH_TOKEN_PATH: a path, never the token), so our job client, the job guard and every
    `rlhf stage run` started from here authenticate to it; the previous values come back after."""
    saved = {k: os.environ.get(k) for k in (AUTH_MODE, TOKEN_PATH, "RAY_AUTH_TOKEN")}
    os.environ.pop("RAY_AUTH_TOKEN", None)
    os.environ.pop(TOKEN_PATH, None)
    os.environ.update(head.auth_env)
    try:
        yield head
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def job_server():
    """Yield the job-submission address: the cluster at `RAY_ADDRESS`, or a fresh embedded head,
    stopped afterwards (and killed with us, should we die first)."""
    address = cluster_job_address()
    if address:
        yield address
        return
    with LocalRayHead() as head, use_head(head):
        yield head.job_address


@contextlib.contextmanager
def shared_head():
    """For a run of several stages (the pipeline flow): one embedded head for all of them, its
    address in `RAY_ADDRESS` so every `rlhf stage run` submits to it instead of starting its own
    (each start costs ~10 s of a 2-core machine).  With `RAY_ADDRESS` already set, nothing to do."""
    if cluster_job_address():
        yield os.environ["RAY_ADDRESS"]
        return
    with LocalRayHead() as head, use_head(head):
        os.environ["RAY_ADDRESS"] = head.job_address
        try:
            yield head.job_address
        finally:
            os.environ.pop("RAY_ADDRESS", None)
