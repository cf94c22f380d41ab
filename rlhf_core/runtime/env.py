"""The environment Ray processes get from us: an allow-list, never our whole environment.

A Ray job inherits more than its `runtime_env`: its driver is started by the head's job
supervisor and its actors by the raylet, so both see the environment the *head* was started with,
plus the job's `runtime_env` variables on top.  The embedded head is therefore started with
`head_env()` instead of `os.environ`, and a job is submitted with `job_env()`
(`jobs.forward_env`): what the stages need to run (paths, locale, thread and library settings,
offline flags, Ray and vLLM settings), and nothing that looks like a secret -- an API key, a token,
a password in the shell that started the pipeline stays there.

`RLHF_FORWARD_ENV=NAME,NAME` passes further variables by name, secrets included, as an explicit
choice (e.g. `HF_TOKEN` for a gated hub model).
"""
from __future__ import annotations

import os

NAMES = {
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
    "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV", "LD_LIBRARY_PATH",
    "XDG_CACHE_HOME", "TOKENIZERS_PARALLELISM", "NO_PROXY", "no_proxy",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",  # HTTPS to a reward server
}
PREFIXES = ("LC_", "RAY_", "VLLM_", "CUDA_", "NCCL_", "GLOO_", "OMP_", "KMP_", "MKL_", "TORCH_", "PYTORCH_", "HF_", "TRANSFORMERS_",
            "WANDB_")  # WANDB_API_KEY is a secret like any *_KEY: forwarded only when named in RLHF_FORWARD_ENV
# a name with one of these words (between underscores) is a secret, unless it names a path or a mode
SECRET_WORDS = {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "APIKEY", "CREDENTIAL", "CREDENTIALS", "PRIVATE", "SESSION"}
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
    if name in extra_names(environ):
        return True
    return (name in NAMES or name.startswith(PREFIXES)) and not looks_secret(name)


def head_env(environ=None) -> dict[str, str]:
    """The allow-listed part of `environ` (default ours), for a Ray head we start."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if allowed(k, environ)}
