"""Reward sources and their combination.

A source maps a batch of samples to one float per sample, plus named components:

  * `FunctionReward`: a user Python file with `def reward(prompts, responses, labels, **kw)`
    returning a list of floats or `{"rewards": [...], "components": {name: [...]}}` -- or
    OpenRLHF's `def reward_func(queries, prompts, labels, **kw)` (queries: prompt + response)
    returning `{"rewards", "scores", "extra_logs"}`, taken unchanged;
  * `ModelReward`: the `rm` stage's model (sequence classification on the sample's token ids,
    normalised by its saved reward_stats.json);
  * `HttpReward`: POST to a reward server (`rlhf serve-reward`, or any server speaking OpenRLHF's
    remote reward protocol), with a timeout, bounded retries and exponential backoff, and an
    error that names the URL.

`REWARD_SOURCES` is the table the rl stage selects from: each entry names a source's class, the
rl settings that configure it (`rl.reward.*`, `rollout/config.py::RewardConfig`), its weight
setting and the settings that name local inputs.  Adding
a source: its class here (or in a module of its own), one entry, a test.

`combine` weights the sources.  A source that raises, returns None/NaN (as a reward or as any
component) or the wrong number of values marks the affected samples *invalid* (NaN score + a reason); the stage counts them and
aborts the step above a threshold.  Nothing is ever silently turned into 0.0.
"""
from __future__ import annotations

import base64
import importlib.util
import json
import math
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import unquote, urlsplit, urlunsplit

import torch

from rlhf_core.algos.aggregation import masked_sum, pool_response
from rlhf_core.algos.losses import token_logprobs
from rlhf_core.atomic import read_secret_file
from rlhf_core.config import redact_url
from rlhf_core.evaluation import completion_answer
from rlhf_core.models.load import actor_device, load_model
from rlhf_core.models.shared_prefix import PACK_MAX_LEN, model_logits, pack_rows


def exact_match(prompts, responses, labels, **kw) -> list[float]:
    """1.0 when the completion's answer equals the label, else 0.0 (the default task reward)."""
    return [1.0 if completion_answer(r) == str(label).strip() else 0.0 for r, label in zip(responses, labels)]


class RewardError(RuntimeError):
    pass


def from_openrlhf(out, n: int):
    """OpenRLHF's reward result -- `{"rewards": [...], "scores": [...], "extra_logs": {name: value}}`
    (lists or tensors; `scores` and `extra_logs` optional) -- as ours: `rewards` is the reward,
    `scores` and each extra log become components (a scalar log is the same for every sample, so
    its logged mean is the server's value)."""
    if not isinstance(out, dict):
        return out  # _validate says what is wrong with it
    components = {}
    if out.get("scores") is not None:
        components["score"] = out["scores"]
    for key, value in (out.get("extra_logs") or {}).items():
        scalar = not hasattr(value, "__len__") or getattr(value, "ndim", 1) == 0
        components[f"extra/{key}"] = [value] * n if scalar else value
    return {"rewards": out.get("rewards"), "components": components} if "rewards" in out else out


def _validate(name: str, out, n: int) -> tuple[list[float], dict[str, list[float]], list[str | None]]:
    """-> (values, components, per-sample invalid reason or None).  Raises RewardError when the
    output as a whole is unusable (wrong type or length)."""
    components: dict[str, list] = {}
    if isinstance(out, dict):
        if "rewards" not in out:
            raise RewardError(f"{name}: returned a dict without 'rewards' (keys: {sorted(out)})")
        components = dict(out.get("components") or {})
        out = out["rewards"]
    if out is None or not hasattr(out, "__len__"):
        raise RewardError(f"{name}: returned {type(out).__name__}, expected a list of {n} floats")
    if len(out) != n:
        raise RewardError(f"{name}: returned {len(out)} rewards for {n} samples")
    values, reasons = [], []
    for v in out:
        try:
            f = float(v)
        except (TypeError, ValueError):
            f = math.nan
        values.append(f)
        reasons.append(None if math.isfinite(f) else f"{name} returned {v!r}")
    for key, comp in components.items():
        if comp is None or not hasattr(comp, "__len__") or len(comp) != n:
            raise RewardError(f"{name}: component {key!r} is not a list of {n} values")
        floats = []
        for i, c in enumerate(comp):
            try:
                f = float(c)
            except (TypeError, ValueError):
                f = math.nan
            floats.append(f)
            if not math.isfinite(f) and reasons[i] is None:  # a broken component is a broken reward for that sample
                reasons[i] = f"{name} component {key!r} returned {c!r}"
        components[key] = floats
    return values, components, reasons


class BuiltinReward:
    """`exact_match` against the row's label: the default when no reward source is configured."""

    name = "exact_match"

    def __call__(self, samples: list[dict]):
        return _validate(self.name, exact_match(None, [s["response"] for s in samples], [s["label"] for s in samples]), len(samples))


class FunctionReward:
    def __init__(self, path: str):
        if not Path(path).is_file():
            raise FileNotFoundError(f"reward_file {path} does not exist")
        spec = importlib.util.spec_from_file_location(f"rlhf_user_reward_{Path(path).stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        self.openrlhf = not callable(getattr(module, "reward", None)) and callable(getattr(module, "reward_func", None))
        if not (callable(getattr(module, "reward", None)) or self.openrlhf):
            raise AttributeError(f"{path} must define `def reward(prompts, responses, labels, **kw)` "
                                 "(or OpenRLHF's `def reward_func(queries, prompts, labels, **kw)`)")
        self.fn, self.name = module.reward_func if self.openrlhf else module.reward, f"reward_file {path}"

    def __call__(self, samples: list[dict]):
        prompts, responses, labels = [s["prompt"] for s in samples], [s["response"] for s in samples], [s["label"] for s in samples]
        if self.openrlhf:
            out = from_openrlhf(self.fn([p + r for p, r in zip(prompts, responses)], prompts, labels), len(samples))
        else:
            out = self.fn(prompts, responses, labels, token_ids=[s["token_ids"] for s in samples])
        return _validate(self.name, out, len(samples))


class ModelReward:
    """The rm stage's model, scoring the exact token ids of each sample (no re-tokenization).
    `reward_stats.json` beside it gives the pooling (`last`; a token-level model's
    `response_sum`/`response_mean` over the tokens after each sample's `prompt_len`; `logprob`, the
    response's summed log-probability under a causal LM) and the mean/std the scores are
    normalised by."""

    def __init__(self, path: str, pad_token_id: int, normalize: bool = True, trust_remote_code: bool = False):
        stats_path = Path(path) / "reward_stats.json"
        stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
        self.pooling = stats.get("pooling", "last")
        kind = {"last": "reward", "logprob": "causal_lm"}.get(self.pooling, "value")  # token-level poolings: a value head
        self.device = actor_device()
        self.model = load_model(path, kind, dtype=None, trust_remote_code=trust_remote_code).eval().to(self.device)
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = pad_token_id
        self.pad = self.model.config.pad_token_id
        self.mean, self.std = (0.0, 1.0)
        if normalize and stats:
            self.mean, self.std = float(stats["mean"]), max(float(stats["std"]), 1e-6)
        self.name = f"reward_model {path}"

    @torch.no_grad()
    def __call__(self, samples: list[dict]):
        seqs = [s["token_ids"] for s in samples]
        width = max(len(x) for x in seqs)
        ids = torch.tensor([x + [self.pad] * (width - len(x)) for x in seqs])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in seqs])
        inputs = {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}
        if self.pooling == "last":
            scores = self.model(**inputs).logits.cpu().squeeze(-1).float()
        else:
            if any("prompt_len" not in s for s in samples):
                raise RewardError(f"{self.name} pools over the response ({self.pooling}): every sample needs its prompt_len")
            starts = torch.tensor([s["prompt_len"] for s in samples]).unsqueeze(1)
            response = ((torch.arange(width).unsqueeze(0) >= starts) & mask.bool()).float()
            if self.pooling == "logprob":  # summed log-prob of each response token (position t-1 predicts t)
                # a prompt's samples share one forward of it (models/shared_prefix.py): the same log-probs
                packed = pack_rows(seqs, [s["prompt_len"] for s in samples], self.pad, PACK_MAX_LEN) or {}
                batch = {**inputs, **{k: v.to(self.device) for k, v in packed.items()}}
                logits = model_logits(self.model, batch, inputs).cpu()
                scores = masked_sum(token_logprobs(logits, ids[:, 1:]), response[:, 1:], dim=-1)
            else:
                logits = self.model(**inputs).logits.cpu()
                scores = pool_response(logits.squeeze(-1).float(), response, self.pooling)
        return _validate(self.name, ((scores - self.mean) / self.std).tolist(), len(samples))


def url_protocol(url: str, setting: str = "auto") -> str:
    """`rlhf` (POST /score, below) or `openrlhf` (OpenRLHF's remote reward protocol: POST
    `{"query": [prompt + response], "prompts", "labels"}` -> `{"rewards", "scores", "extra_logs"}`).
    `auto`: openrlhf when the URL's path ends in /get_reward, as OpenRLHF's servers' does."""
    if setting != "auto":
        return setting
    return "openrlhf" if urlsplit(url).path.rstrip("/").endswith("/get_reward") else "rlhf"


class HttpReward:
    """`user:password@` in the URL is sent as HTTP basic auth; names and errors show the URL with
    its credentials redacted (they end up in logs and in the rollouts' invalid reasons).
    `token_file`: a file holding a bearer token (`rlhf serve-reward` writes one), sent as
    `Authorization: Bearer ...`; it must exist, and is read once here.  The token itself is never
    part of the name, an error or a log.  `protocol`: see `url_protocol`."""

    def __init__(self, url: str, timeout: float = 10.0, retries: int = 3, backoff: float = 0.5, protocol: str = "auto",
                 token_file: str | None = None):
        self.shown = redact_url(url)
        parts = urlsplit(url)
        self.headers = {"Content-Type": "application/json"}
        if "@" in parts.netloc:
            userinfo, host = parts.netloc.rsplit("@", 1)
            user, _, password = userinfo.partition(":")
            token = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode()
            self.headers["Authorization"] = f"Basic {token}"
            url = urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
        if token_file:
            if "Authorization" in self.headers:
                raise ValueError(f"rl.reward.url {self.shown} has user:password@ and a rl.reward.token_file: give one of them")
            self.headers["Authorization"] = f"Bearer {read_secret_file(token_file, 'rl.reward.token_file')}"
        self.url, self.timeout, self.retries, self.backoff = url, timeout, retries, backoff
        self.protocol = url_protocol(url, protocol)
        self.name = f"reward_url {self.shown}"

    def body(self, samples: list[dict]) -> bytes:
        prompts, responses, labels = [s["prompt"] for s in samples], [s["response"] for s in samples], [s["label"] for s in samples]
        if self.protocol == "openrlhf":
            return json.dumps({"query": [p + r for p, r in zip(prompts, responses)], "prompts": prompts, "labels": labels}).encode()
        return json.dumps({"prompts": prompts, "responses": responses, "labels": labels, "token_ids": [s["token_ids"] for s in samples],
                           **({"prompt_lens": [s["prompt_len"] for s in samples]} if all("prompt_len" in s for s in samples) else {})}).encode()

    def __call__(self, samples: list[dict]):
        body = self.body(samples)
        last = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                req = urllib.request.Request(self.url, data=body, headers=self.headers)
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    out = json.loads(resp.read())
                    return _validate(self.name, from_openrlhf(out, len(samples)) if self.protocol == "openrlhf" else out, len(samples))
            except RewardError:
                raise
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}" + (" (unauthorized: check rl.reward.token_file, the server's token file)" if e.code == 401 else "")
                if e.code < 500:  # a client error will not heal by retrying
                    break
            except (urllib.error.URLError, TimeoutError, OSError, ValueError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        raise RewardError(f"reward server {self.shown} failed after {attempt + 1} attempt(s): {last}")


def combine(results: dict[str, tuple], weights: dict[str, float], n: int) -> tuple[list[float], dict[str, list[float]], list[str | None]]:
    """Weighted sum of sources.  -> (scores, components incl. each source's raw value, invalid reasons)."""
    scores, reasons, components = [0.0] * n, [None] * n, {}
    for name, (values, comps, why) in results.items():
        w = weights.get(name, 1.0)
        components[name] = values
        for key, comp in comps.items():
            components[f"{name}/{key}"] = comp
        for i in range(n):
            scores[i] += w * values[i]
            if why[i] and not reasons[i]:
                reasons[i] = why[i]
    return scores, components, reasons


@dataclass(frozen=True)
class RewardSource:
    """A reward source as the rl stage selects it.  `settings(cfg, pad_token_id)` (cfg: the rl
    config): the keyword arguments `cls` is built with in the reward actor (local paths made
    absolute: the actor runs in another directory), None when the run does not use it; `weight`:
    the `RewardConfig` field (`rl.reward.<weight>`) weighing its score in `combine`; `inputs`: the
    `RewardConfig` fields naming files its scores depend on (a resumed checkpoint and the
    manifest's lineage cover them)."""
    cls: type
    settings: Callable[[Any, int], dict | None]
    weight: str | None = None
    inputs: tuple[str, ...] = ()


def _local(path: str) -> str:
    return str(Path(path).resolve()) if Path(path).exists() else path


# The component name is the key: it names the source in `components`, in the history and in `weights`.
REWARD_SOURCES: dict[str, RewardSource] = {
    "reward_file": RewardSource(FunctionReward, lambda cfg, pad: {"path": _local(cfg.reward.file)} if cfg.reward.file else None,
                                weight="file_weight", inputs=("file",)),
    "reward_model": RewardSource(ModelReward, lambda cfg, pad: dict(path=_local(cfg.reward.model), pad_token_id=pad,
                                                                    trust_remote_code=cfg.trust_remote_code) if cfg.reward.model else None,
                                 weight="model_weight", inputs=("model",)),
    "reward_url": RewardSource(HttpReward, lambda cfg, pad: dict(url=cfg.reward.url, timeout=cfg.reward.url_timeout, retries=cfg.reward.url_retries,
                                                                 protocol=cfg.reward.url_protocol,
                                                                 token_file=_local(cfg.reward.token_file) if cfg.reward.token_file else None)
                               if cfg.reward.url else None, weight="url_weight"),
}
BUILTIN = "exact_match"
"""The source used when a single-turn run configures none: exact match against the row's label."""


def selected_sources(cfg, pad_token_id: int) -> dict[str, dict]:
    """{component name: constructor keywords} of the sources `cfg` (the rl config) turns on, in
    `REWARD_SOURCES` order; the builtin exact match when none is and no environment rewards."""
    chosen = {name: kw for name, src in REWARD_SOURCES.items() if (kw := src.settings(cfg, pad_token_id)) is not None}
    if not chosen and cfg.rollout.agent == "single_turn" and not cfg.rollout.agent_file:
        chosen = {BUILTIN: {}}
    return chosen


def source_weights(cfg) -> dict[str, float]:
    """Each source's weight (`rl.reward.*_weight`; the environment's own reward is the component `env`)."""
    return {**{name: getattr(cfg.reward, src.weight) for name, src in REWARD_SOURCES.items() if src.weight}, "env": cfg.reward.env_weight}


def build_source(name: str, settings: dict):
    """A source from `selected_sources`' entry (in the reward actor)."""
    return BuiltinReward() if name == BUILTIN else REWARD_SOURCES[name].cls(**settings)


def reward_inputs(cfg) -> tuple[str, ...]:
    """The local files the configured sources' scores depend on (`RewardSource.inputs`)."""
    return tuple(getattr(cfg.reward, key) for src in REWARD_SOURCES.values() for key in src.inputs if getattr(cfg.reward, key))
