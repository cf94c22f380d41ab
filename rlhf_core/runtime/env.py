"""The environment Ray processes get from us: an allow-list, never our whole environment.

A Ray job inherits more than its `runtime_env`: its driver is started by the head's job
supervisor and its actors by the raylet, so both see the environment the *head* was started with,
plus the job's `runtime_env` variables on top.  The embedded head is therefore started with
`head_env()` instead of `os.environ`, and a job is submitted with `job_env()`
(`jobs.forward_env`): what the stages need to run (paths, locale, thread and library settings,
offline flags, Ray and vLLM settings), and nothing that looks like a secret -- an API key, a token,
a password in the shell that started the pipeline stays there.

`RLHF_FORWARD_ENV=NAME,NAME` passes further variables by name, as an explicit choice (e.g.
`HF_TOKEN` for a gated hub model): a plain one in the job's environment, a secret-looking one
(and a credential in a config setting) through a 0600 file whose path the job gets
(`write_secrets_file`), never in the head's environment or the job's runtime_env.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from rlhf_core import atomic

NAMES = {
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
    "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV", "LD_LIBRARY_PATH",
    "XDG_CACHE_HOME", "TOKENIZERS_PARALLELISM", "NO_PROXY", "no_proxy",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",  # HTTPS to a reward server
}
PREFIXES = ("LC_", "RAY_", "VLLM_", "CUDA_", "NCCL_", "GLOO_", "OMP_", "KMP_", "MKL_", "TORCH_", "PYTORCH_", "HF_", "TRANSFORMERS_",
            "WANDB_")  # WANDB_API_KEY is a secret like any *_KEY: forwarded only when named in RLHF_FORWARD_ENV
# a name with one of these words (between underscores) is a secret, unless it names a path or a mode
SECRET_WORDS = {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "APIKEY", "CREDENTIAL", "CREDENTIALS", "PRIVATE", "SESSION", "AUTH"}
NOT_SECRET_SUFFIXES = ("_PATH", "_FILE", "_DIR", "_MODE")
EXTRA = "RLHF_FORWARD_ENV"


def looks_secret(name: str) -> bool:
    upper = name.upper()
    return not upper.endswith(NOT_SECRET_SUFFIXES) and bool(SECRET_WORDS & set(upper.split("_")))


def extra_names(environ=None) -> list[str]:
    """The names listed in RLHF_FORWARD_ENV (comma or space separated)."""
    environ = os.environ if environ is None else environ
    return [n for n in environ.get(EXTRA, "").replace(",", " ").split() if n]


def allowed(name: str, environ=None) -> bool:
    """Whether `name` may be in a Ray process's environment: allow-listed or named in
    RLHF_FORWARD_ENV, and not a secret (those go through the secrets file)."""
    if looks_secret(name):
        return False
    return name in NAMES or name.startswith(PREFIXES) or name in extra_names(environ)


def head_env(environ=None) -> dict[str, str]:
    """The allow-listed part of `environ` (default ours), for a Ray head we start."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if allowed(k, environ)}


# --- secrets a job needs: by a 0600 file's path, never in its runtime_env -------------------

SECRETS_FILE = "RLHF_SECRETS_FILE"
"""The job's environment names the file (a path is no secret); Ray's job API shows a job's
runtime_env to anyone who can reach the dashboard, so the values themselves never go there."""
SETUP_HOOK = "rlhf_core.runtime.env.apply_job_secrets"
"""Ray's worker_process_setup_hook for a job with environment secrets: every worker process of
the job (the actors) runs it before any task."""


def write_secrets_file(directory: Path, name: str, config: dict[str, str], env: dict[str, str]) -> Path | None:
    """{"config": {dotted key: value}, "env": {NAME: value}} in DIRECTORY/NAME.json (dir 0700, file
    0600), or None when there is nothing secret to pass."""
    if not config and not env:
        return None
    return atomic.write_private(atomic.private_dir(directory) / f"{name}.json", json.dumps({"config": config, "env": env}))


def read_secrets_file(environ=None) -> dict:
    """The job's secrets ({"config": ..., "env": ...}; empty parts when it has none)."""
    environ = os.environ if environ is None else environ
    path = environ.get(SECRETS_FILE)
    data = json.loads(Path(path).read_text()) if path else {}
    return {"config": data.get("config", {}), "env": data.get("env", {})}


def apply_job_secrets() -> None:
    """Put the job's environment secrets (e.g. HF_TOKEN named in RLHF_FORWARD_ENV) into this
    process's environment: the job driver calls it, Ray runs it in every worker (SETUP_HOOK)."""
    os.environ.update(read_secrets_file()["env"])
