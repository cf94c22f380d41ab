"""Which `SECTION.KEY=VALUE` overrides the `alignment-pipeline` flow accepts, checked before
params.yaml is written.

Anyone who can reach the Prefect API can start a deployment's flow run with any parameters, and
an override naming code (`rl.reward.file=/any/file.py`) is then executed by the reward worker.  So a
run *from a deployment* refuses overrides of keys that name code or reach outside the project:

  * code and files: any key ending in `_file` (`rl.reward.file`, `agent_file`, `reward.token_file`
    ...), `trust_remote_code`;
  * a network endpoint: `rl.reward.url`;
  * paths outside the repository: `model_path`, `rl.reward.model`, `output_dir`, `data_dir`, `*_data`,
    `*_dir`, `*_path`, `eval_pairs` whose value does not resolve inside it.

A key in a section is judged by its last part and by its last two parts joined with `_`
(`rl.reward.file` is a `reward_file`), so the old flat names (`rl.reward_file`) and the new ones
are refused alike.

`rlhf serve --allow-override KEY` (repeatable: a dotted key such as `rl.reward.file`, or a key name
such as `reward_file` for every section; an rl setting's old dotted name and its new one are the
same opt-in) lets one through: `rlhf serve` hands the list to its flow
runs in its own environment (`RLHF_DEPLOYMENT_ALLOW_OVERRIDES`), never as a flow parameter, which
is what the API caller controls.

For every caller (`rlhf pipeline run --set` too), a value carrying credentials (a URL with
`user:password@` or a `?token=` ...) is refused: params.yaml is a file in git and in dvc.lock.

Prefect-free and light: no torch, no Prefect import.
"""
from __future__ import annotations

import os
from pathlib import Path

from rlhf_core.config import ConfigError, redact_url
from rlhf_core.rl.renamed import RENAMED

ALLOW_ENV = "RLHF_DEPLOYMENT_ALLOW_OVERRIDES"
REPO_ENV = "RLHF_DEPLOYMENT_REPO"
CODE_KEYS = {"trust_remote_code": "lets model code from its directory or hub repository run", "reward_url": "names a network endpoint"}
PATH_KEYS = {"model_path", "reward_model", "output_dir", "data_dir", "eval_pairs"}
PATH_SUFFIXES = ("_data", "_dir", "_path")


class OverrideRefused(ConfigError):
    pass


def allowed_from_env(environ=os.environ) -> set[str]:
    """The keys `rlhf serve --allow-override` let through (comma-separated in its environment)."""
    return {k.strip() for k in environ.get(ALLOW_ENV, "").split(",") if k.strip()}


def _leaves(key: str, value):
    """(dotted key, leaf value) of an override's value: a YAML mapping or list sets every key in it."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(f"{key}.{k}", v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(key, v)
    else:
        yield key, value


def _parse(item: str) -> tuple[str, object]:
    """(key, value) as `apply_overrides` reads them (ruamel: the same YAML, mappings included)."""
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError

    key, sep, raw = item.partition("=")
    if not sep or "." not in key:
        raise OverrideRefused(f"override {key!r} must look like SECTION.KEY=VALUE")
    try:
        return key, YAML().load(raw) if raw else raw
    except YAMLError:  # the message would quote the value, which may be a secret
        raise OverrideRefused(f"override {key}: its value is not valid YAML") from None


def _inside(value, repo: Path) -> bool:
    path = Path(os.path.expanduser(str(value)))
    return (repo / path).resolve().is_relative_to(repo.resolve())


def _names(key: str) -> set[str]:
    """The names a dotted key is judged by: its last part, and its last two joined by `_` (a
    section's key: `rl.reward.url` is `reward_url`, `rl.reward.file` is `reward_file`)."""
    parts = key.lower().split(".")
    return {parts[-1], "_".join(parts[-2:])}


def why_refused(key: str, value, repo: Path) -> str | None:
    """Why a deployment's flow run may not set `key` (dotted) to `value`; None: it may."""
    names = _names(key)
    if value is None or value == "":  # unsetting a source or path names nothing
        return None
    if any(name.endswith("_file") for name in names):
        return "it names a file the pipeline reads or runs as code"
    code = sorted(names & set(CODE_KEYS))
    if code:
        return f"it {CODE_KEYS[code[0]]}"
    if any(name in PATH_KEYS or name.endswith(PATH_SUFFIXES) for name in names) and isinstance(value, str) and value \
            and not _inside(value, repo):
        return f"{value!r} is outside the repository {repo}"
    return None


def renamed_key(key: str) -> str:
    """An rl setting's dotted key under its old flat name (`rl.kl_coef`, `rl_variants.rlhf.reward_model`)
    -> its key now (`rl.objective.kl_coef`, `rl_variants.rlhf.reward.model`); any other key as it is."""
    parts = key.split(".")
    at = 1 if parts[0] == "rl" else 2 if parts[0] == "rl_variants" and len(parts) > 2 else None
    if at is None or len(parts) != at + 1 or parts[at] not in RENAMED:
        return key
    return ".".join([*parts[:at], RENAMED[parts[at]]])


def check_overrides(overrides: list[str] | None, repo: str | Path, from_deployment: bool, allowed: set[str] = frozenset()) -> None:
    """Raise OverrideRefused naming the first refused override and how to allow it (see the module
    docstring); nothing is written here, so a refused run leaves params.yaml as it was."""
    repo = Path(repo).resolve()
    for item in overrides or []:
        key, value = _parse(item)
        for leaf_key, leaf in _leaves(key, value):
            if isinstance(leaf, str) and redact_url(leaf) != leaf:
                raise OverrideRefused(
                    f"override {leaf_key} carries credentials ({redact_url(leaf)}): it would be written into params.yaml (a file in git "
                    "and dvc.lock). Give the URL without them and the token in a 0600 file: "
                    f"--set rl.reward.token_file=PATH (`rlhf serve-reward` writes one), or run the stage with "
                    f"`rlhf stage run rl --set {leaf_key}=...`, which keeps credentials out of every file")
            # an opt-in under a setting's old name (`rl.reward_file`) lets its new one (`rl.reward.file`) through, and back
            if not from_deployment or renamed_key(leaf_key) in {renamed_key(a) for a in allowed} or _names(leaf_key) & allowed \
                    or key in allowed:
                continue
            why = why_refused(leaf_key, leaf, repo)
            if why:
                raise OverrideRefused(
                    f"override {leaf_key} refused for a flow run from a deployment: {why}. Anyone with access to the Prefect API can "
                    f"start one, so such keys need an opt-in by whoever runs the server: `rlhf serve --allow-override {leaf_key}` "
                    "(or set it in params.yaml, or pass it to `rlhf pipeline run --set`)")


def check_repo(repo: str | Path, from_deployment: bool, environ=os.environ) -> None:
    """A deployment's flow run works on the repository `rlhf serve` serves (`RLHF_DEPLOYMENT_REPO`),
    never another directory an API caller names (its dvc.yaml's commands would run)."""
    served = environ.get(REPO_ENV)
    if from_deployment and served and Path(repo).resolve() != Path(served).resolve():
        raise OverrideRefused(f"repo {repo!r} refused for a flow run from a deployment: `rlhf serve` serves {served}")
