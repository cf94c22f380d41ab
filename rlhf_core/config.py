"""Typed configs: dataclass defaults -> the stage's `params.yaml` section -> dotted `--set` overrides.

Every stage config is a `@dataclass(frozen=True, kw_only=True)`; nested dataclasses are
sections (`rl.objective.kl_coef`).  A setting that moved keeps working under its old name for a
while: a config class's `RENAMED` (old key -> new dotted key) moves it, with a warning
(`apply_renames`).  Loading is strict: an unknown key or a value of the wrong type is a
`ConfigError` naming the key and listing the valid ones.  The resolved config is plain JSON
(`config_to_dict`) with a stable hash (`config_hash`) that lineage records.

Credentials in a URL (`rl.reward.url: https://user:pass@host/score`, `...?token=...`) never reach a
file: `config_to_dict` (hence the resolved config, manifests, `rlhf config show`) and `config_hash`
see them as `***`; `config_secrets` lists the real values, which `rlhf stage run` hands to its
job in a 0600 file by path (`runtime/jobs.py:Secrets`), and the job puts back (`restore_secrets`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import yaml

T = TypeVar("T")
log = logging.getLogger("rlhf.config")


class ConfigError(ValueError):
    """A config key or value that cannot be used; the message says which and what is valid."""


def _valid_keys(cls, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            keys += _valid_keys(tp, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; return it converted (int -> float, list -> tuple)."""
    origin, args = get_origin(tp), get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} keys, got {value!r}")
        return from_dict(tp, value, prefix=key + ".")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {list(args)}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError("; ".join(errors))
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        item_tp = args[0] if args else Any
        return tuple(_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value))
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML reads `3e-4` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    raise ConfigError(f"{key}: unsupported annotation {tp!r}")


def apply_renames(cls, data: dict, prefix: str = "") -> dict:
    """`data` with every key that `cls.RENAMED` (old key -> dotted key now, e.g. `"kl_coef":
    "objective.kl_coef"`) lists moved to its new place, each move logged as a warning naming both
    (`rl.kl_coef is now rl.objective.kl_coef`).  Giving a setting under both names is an error.
    `data` itself is not changed."""
    renamed = getattr(cls, "RENAMED", None) or {}
    if not isinstance(data, dict) or not any(key in renamed for key in data):
        return data
    out = _copy_tree(data)
    for old in [k for k in data if k in renamed]:
        new = renamed[old]
        *path, leaf = new.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{prefix}{old} is now {prefix}{new}, but {prefix}{part} is not a mapping: {node!r}")
        if leaf in node:
            raise ConfigError(f"{prefix}{old} and {prefix}{new} are both given: {prefix}{old} is the old name of {prefix}{new}; "
                              f"keep only {prefix}{new}")
        node[leaf] = out.pop(old)
        log.warning("%s%s is now %s%s: please rename it (the old name still works for now)", prefix, old, prefix, new)
    return out


def _copy_tree(data: dict) -> dict:
    return {k: _copy_tree(v) if isinstance(v, dict) else v for k, v in data.items()}


def from_dict(cls: type[T], data: dict, prefix: str = "") -> T:
    """Build dataclass `cls` from a (nested) dict, strictly; keys under an old name (`cls.RENAMED`)
    are moved to the new one (`apply_renames`)."""
    data = apply_renames(cls, data, prefix)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]!s}; valid keys: {', '.join(_valid_keys(cls, prefix))}"
        )
    kwargs = {name: _coerce(value, hints[name], prefix + name) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:  # __post_init__ checks raise ValueError
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {e}") from e


def parse_overrides(overrides: typing.Iterable[str], section: str) -> dict:
    """`["rl.algo=ppo", "rl.objective.kl_coef=0.1"]` -> `{"algo": "ppo", "objective": {"kl_coef": 0.1}}`.

    Values are parsed as YAML scalars (`20` -> int, `0.1` -> float, `true` -> bool,
    `[1, 2]` -> list).  The leading `SECTION.` is optional.
    """
    out: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not KEY=VALUE (e.g. {section}.max_steps=20)")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if parts[0] == section and len(parts) > 1:
            parts = parts[1:]
        value = yaml.safe_load(raw) if raw.strip() else ""
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with an earlier one")
        node[parts[-1]] = value
    return out


def _merge(base: dict, update: dict) -> dict:
    merged = dict(base)
    for k, v in update.items():
        merged[k] = _merge(merged[k], v) if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
    return merged


def load_params(params_path: str | Path = "params.yaml") -> dict:
    """The whole `params.yaml` as a dict (empty if the file does not exist)."""
    path = Path(params_path)
    if not path.exists():
        return {}
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of stage sections")
    return data


def split_stage(stage: str) -> tuple[str, str | None]:
    """`rl@rlhf` -> ("rl", "rlhf"): a variant of a stage (a DVC `foreach` item); `sft` -> ("sft", None)."""
    section, _, variant = stage.partition("@")
    return section, variant or None


def load_config(cls: type[T], stage: str, params_path: str | Path = "params.yaml", overrides: typing.Iterable[str] = ()) -> T:
    """Defaults of `cls`, updated by `params.yaml[section]`, by `params.yaml[section_variants][variant]`
    for a variant stage `section@variant`, then by the overrides.  A variant writes to
    `artifacts/section@variant` unless it sets its own `output_dir`."""
    section, variant = split_stage(stage)
    params = load_params(params_path)
    prefix = f"{section}."
    # each layer's old key names are moved before the layers merge, so an override under an old name
    # (`--set rl.kl_coef=...`) still overrides the params.yaml value under the new one
    data = apply_renames(cls, params.get(section) or {}, prefix)
    if variant:
        variants = params.get(f"{section}_variants") or {}
        if variant not in variants:
            raise ConfigError(f"unknown variant {stage!r}: {params_path} has no {section}_variants.{variant} "
                              f"(variants: {', '.join(sorted(variants)) or 'none'})")
        data = _merge({"output_dir": f"artifacts/{stage}", **data}, apply_renames(cls, variants[variant] or {}, f"{section}_variants.{variant}."))
    data = _merge(data, apply_renames(cls, parse_overrides(overrides, section), prefix))
    return from_dict(cls, data, prefix=prefix)


# query parameters whose value is a credential (words between `_` or `-`, case-insensitive)
URL_SECRET_WORDS = {"TOKEN", "KEY", "APIKEY", "SECRET", "PASSWORD", "PASSWD", "PASS", "SIG", "SIGNATURE", "AUTH", "CREDENTIAL",
                    "CREDENTIALS", "CODE"}
REDACTED = "***"


def redact_url(value: str) -> str:
    """`value` with a URL's credentials replaced by `***`: the `user:password@` part and the values
    of query parameters named like credentials (`token`, `api_key`, `X-Amz-Signature` ...).  Any
    other string is returned unchanged.  e.g. `https://u:p@h/s?token=t&m=1` -> `https://***@h/s?token=***&m=1`."""
    if "://" not in value:
        return value
    parts = urlsplit(value)
    netloc = f"{REDACTED}@{parts.netloc.rsplit('@', 1)[1]}" if "@" in parts.netloc else parts.netloc
    query = parts.query
    secret = lambda name: bool(URL_SECRET_WORDS & set(re.split(r"[_\-]", name.upper())))  # noqa: E731
    pairs = parse_qsl(query, keep_blank_values=True)
    if any(secret(k) for k, _ in pairs):
        query = "&".join(f"{k}={REDACTED if secret(k) else v}" for k, v in pairs)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _walk(data: dict, prefix: str = ""):
    for k, v in data.items():
        if isinstance(v, dict):
            yield from _walk(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _redact(value):
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, dict):
        return {k: _redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact(v) for v in value]
    return value


def redact(data: dict) -> dict:
    """A config dict with every credential in it replaced by `***` (see `redact_url`)."""
    return _redact(data)


def config_secrets(cfg) -> dict[str, str]:
    """{dotted key: real value} of the settings `config_to_dict` redacts (empty for most configs)."""
    raw = json.loads(json.dumps(dataclasses.asdict(cfg)))
    return {k: v for k, v in _walk(raw) if isinstance(v, str) and redact_url(v) != v}


def restore_secrets(data: dict, secrets: dict[str, str]) -> dict:
    """Put the real values of `secrets` (from `config_secrets`) back into a redacted config dict,
    where the redacted value is still the one they redact to (a changed setting stays as it is)."""
    data = json.loads(json.dumps(data))
    for key, value in secrets.items():
        node, *path = data, *key.split(".")
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(path[-1]) == redact_url(value):
            node[path[-1]] = value
    return data


def config_to_dict(cfg) -> dict:
    """JSON-ready dict (tuples become lists), credentials in URLs redacted: what files hold."""
    return redact(json.loads(json.dumps(dataclasses.asdict(cfg))))


def config_hash(cfg) -> str:
    """sha256 of the canonical JSON of the resolved config (sorted keys, no whitespace), credentials
    redacted (a hash of a short password would let it be guessed)."""
    canonical = json.dumps(config_to_dict(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()
