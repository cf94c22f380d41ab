"""Ray token authentication as our nodes and clients use it: the environment of a node we start
(`ray_node_env`), the Authorization header for a job server (`auth_headers`) and the client that
sends it (`job_client`).  Apart from `cluster.py` so the watchdog, which `cluster.py` starts
heads under, can stop a job without importing it."""
from __future__ import annotations

import os
from pathlib import Path

from rlhf_core.runtime.env import head_env

AUTH_MODE, TOKEN_PATH = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"


def auth_disabled(environ=None) -> bool:
    """Token authentication is off only when the user says so: RAY_AUTH_MODE=disabled."""
    return (os.environ if environ is None else environ).get(AUTH_MODE, "").lower() == "disabled"


def ray_node_env(token_path: Path | None) -> dict[str, str]:
    """The environment of a Ray node we start (`head_env`), without RAY_ADDRESS, with token
    authentication on and the token read from `token_path` (this head's own, made by `start`).
    The path is explicit so a token another cluster left in ~/.ray/auth_token (Ray 2.60's plain
    `ray.init()` writes one) or a RAY_AUTH_TOKEN in the user's shell is never used by our nodes:
    both once locked every stage out ("ray head did not come up").  RAY_AUTH_MODE=disabled in
    our environment turns authentication off, for the nodes and our client alike (with a warning)."""
    env = head_env()
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", TOKEN_PATH):
        env.pop(name, None)
    if token_path is None:
        env[AUTH_MODE] = "disabled"
    else:
        env.update({AUTH_MODE: "token", TOKEN_PATH: str(token_path)})
    return env


def auth_headers(environ=None) -> dict[str, str]:
    """The Authorization header for the job server of the cluster our environment names: the
    token at RAY_AUTH_TOKEN_PATH (what `use_head` sets for a head we started, and the SLURM
    template for its cluster), else RAY_AUTH_TOKEN; empty when authentication is off or neither
    is set (Ray's client then looks for ~/.ray/auth_token itself).  Passed to every
    JobSubmissionClient explicitly: Ray's own loader caches the first token it read per process,
    which is the wrong one once a process has talked to two heads."""
    env = os.environ if environ is None else environ
    if auth_disabled(env):
        return {}
    token = Path(env[TOKEN_PATH]).read_text().strip() if env.get(TOKEN_PATH) else env.get("RAY_AUTH_TOKEN", "").strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


def job_client(address: str, environ=None):
    """A JobSubmissionClient for `address` that sends the token `environ` (default ours) names
    (`auth_headers`)."""
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address, headers=auth_headers(environ) or None)
