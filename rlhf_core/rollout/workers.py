"""The non-training roles of an RL step, run as Ray actors by `rlhf_core/rl/roles.py`.

  RolloutWorker   holds a generation engine; plays agent episodes; takes weight syncs in place
  RewardWorker    runs the reward sources (user code lives here, never in the trainer)
  ForwardWorker   a frozen model that only scores: the reference policy

Plain classes: `ray.remote(cls)` makes them actors, and tests can use them in-process.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import asdict

import torch

from rlhf_core.data.images import VisionInputs
from rlhf_core.models.load import actor_device, is_vision_model, load_model, load_processor, load_tokenizer
from rlhf_core.rollout import rewards as R
from rlhf_core.rollout.agents import environments, run_episodes
from rlhf_core.rollout.engines import ENGINES
from rlhf_core.rollout.rewards import RewardError, build_source, combine
from rlhf_core.runtime import faults
from rlhf_core.runtime.actor import PeakMemory
from rlhf_core.runtime.weight_sync import Layout, WeightGroup, empty_buffers, unflatten


class RolloutWorker(PeakMemory):
    """With `segment` > 0 (partial rollouts, rl.rollout.partial_rollout_tokens) the actor runs weight syncs
    in a concurrency group of their own (`SYNC_GROUP`): a sync arriving mid-round waits only for
    the piece being generated, and the episodes go on under the new weights.  The engine is used
    by one thread at a time (`self.lock`)."""

    SYNC_GROUP = "sync"

    def __init__(self, *, engine: str, model_path: str, max_len: int, seed: int, agent: str, agent_file: str | None, env_timeout: float,
                 max_turns: int, dtype: str = "float32", gpu_memory_utilization: float = 0.05, sleep: int = 0,
                 trust_remote_code: bool = False, threads: int = 1, segment: int = 0, tensor_parallel: int = 1):
        torch.set_num_threads(max(1, threads))
        self.tokenizer = load_tokenizer(model_path, trust_remote_code)
        self.vision = None  # a VLM's processor side: image placeholders and pixel values
        if is_vision_model(model_path, trust_remote_code):
            self.vision = VisionInputs(load_processor(model_path, trust_remote_code))
        # every engine takes the same settings and ignores what it has no use for (hf: memory, sleep)
        self.engine = ENGINES[engine](model_path, max_model_len=max_len, seed=seed, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                                      enable_sleep_mode=bool(sleep), sleep_level=int(sleep) or 1, trust_remote_code=trust_remote_code,
                                      tensor_parallel_size=tensor_parallel)
        self.envs = environments(agent, agent_file, env_timeout)  # a user's file: in a process of its own, killed on a timeout
        self.max_len, self.max_turns, self.segment = max_len, max_turns, segment
        self.version = 0
        self.lock = threading.Lock()
        self.syncs_waiting = 0

    def rollout(self, prompts: list[str], labels: list[str], seeds: list[int], max_new_tokens: int, temperature: float,
                images: list | None = None) -> list[dict]:
        """Play one episode per prompt; returns plain dicts (token ids, masks, engine log-probs).
        `images`: per prompt its image references (VLM rows)."""
        faults.hang("rollout")
        t0 = time.time()
        episodes = run_episodes(Locked(self.engine, self.lock), self.tokenizer, self.envs, prompts, labels, seeds, max_new_tokens,
                                temperature, self.max_len, self.max_turns, self.segment, self.current_version, images, self.vision)
        out = []
        for ep in episodes:
            d = asdict(ep)
            d["response"] = self.tokenizer.decode(ep.token_ids[ep.prompt_len:], skip_special_tokens=True)
            d["policy_version"] = min(ep.token_versions, default=self.version)  # the oldest weights that wrote it
            out.append(d)
        for d in out:
            d["generated"] = (t0, time.time())  # this call's wall-clock interval (the rollout workers' busy time)
        return out

    def current_version(self) -> int:
        """Before each piece of a rollout: a weight sync waiting for the engine goes first."""
        while self.syncs_waiting:
            time.sleep(0.001)
        return self.version

    def ready(self) -> bool:
        return True

    def _pixels(self, images: list | None) -> dict:
        """The engine's `pixels` argument for per-prompt image references (none: no argument)."""
        pixels = self.vision.per_prompt(images) if images else None
        return {"pixels": pixels} if pixels else {}

    def greedy(self, prompt_ids: list[list[int]], max_new_tokens: int, images: list | None = None) -> list[list[int]]:
        with self.lock:
            outs = self.engine.generate(prompt_ids, [max_new_tokens] * len(prompt_ids), 0.0, [0] * len(prompt_ids), **self._pixels(images))
        return [o.token_ids for o in outs]

    def sample(self, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float, seeds: list[int],
               images: list | None = None) -> list[list[int]]:
        with self.lock:
            outs = self.engine.generate(prompt_ids, [max_new_tokens] * len(prompt_ids), temperature, seeds, **self._pixels(images))
        return [o.token_ids for o in outs]

    def update_weights(self, named_tensors, version: int) -> float:
        """In-place weight sync from the trainer; returns seconds taken."""
        t0 = time.time()
        faults.hang("sync")
        self.syncs_waiting += 1  # one sync at a time (its own group of one thread): no race on the counter
        try:
            with self.lock:
                if version >= self.version:
                    self.engine.update_weights(named_tensors)
                    self.version = version
        finally:
            self.syncs_waiting -= 1
        return time.time() - t0

    def join_weight_group(self, host: str, port: int, rank: int, world_size: int, timeout_s: float, backend: str, layout: Layout) -> None:
        """rl.rollout.weight_sync=collective: join the trainer's weight group as `rank` (1..n)."""
        self.weight_group, self.layout = WeightGroup(host, port, rank, world_size, timeout_s, backend), layout

    def receive_weights(self, version: int) -> float:
        """The trainer's broadcast, into fresh buffers, then the in-place update; returns seconds."""
        t0 = time.time()
        flats = empty_buffers(self.layout, self.weight_group.device)
        self.weight_group.broadcast(flats)
        self.update_weights(unflatten(flats, self.layout), version)
        return time.time() - t0

    def sleep(self) -> None:
        with self.lock:
            self.engine.sleep()

    def wake_up(self) -> None:
        with self.lock:
            self.engine.wake_up()


class Locked:
    """An engine whose `generate` holds `lock` for the call (one piece of a partial rollout)."""

    def __init__(self, engine, lock: threading.Lock):
        self.engine, self.lock = engine, lock

    def generate(self, *args, **kwargs):
        with self.lock:
            out = self.engine.generate(*args, **kwargs)
            faults.slow_piece()  # a slow engine, for the tests: a sync arriving now waits for the piece
            return out


class RewardWorker(PeakMemory):
    """Scores finished episodes with every configured source and combines them.  `sources`:
    {component name: constructor keywords} (`rewards.selected_sources`), `weights`: per component."""

    def __init__(self, *, sources: dict[str, dict], weights: dict[str, float], threads: int = 1):
        torch.set_num_threads(max(1, threads))  # a reward model's forward
        self.sources = {name: build_source(name, settings) for name, settings in sources.items()}
        self.weights = weights

    def ready(self) -> bool:
        return True

    def score(self, samples: list[dict]) -> list[dict]:
        """Per sample: score (NaN if invalid), components, invalid reason.  The environment's own
        reward (multi-turn agents) is the component `env`."""
        faults.hang("reward")
        n = len(samples)
        results = {}
        for name, source in self.sources.items():
            try:
                results[name] = source(samples)
            except RewardError:
                raise
            except Exception as e:  # user code raised: every sample of the batch is invalid, and says why
                results[name] = ([math.nan] * n, {}, [f"{name} raised {type(e).__name__}: {e}"] * n)
        env = [s.get("env_reward") for s in samples]
        if any(v is not None for v in env):
            results["env"] = ([math.nan if v is None else float(v) for v in env], {},
                              [None if v is not None else "environment gave no reward" for v in env])
        if not results:
            raise RewardError("no reward source: set rl.reward.file, rl.reward.model or rl.reward.url, or use an agent whose environment rewards")
        scores, components, reasons = combine(results, self.weights, n)
        # the gold (verifiable) reward, logged beside whatever the policy is trained on -- with a
        # reward model that is the over-optimisation curve; weight 0, never part of the score
        labels = [s.get("label") for s in samples]
        if all(isinstance(label, str) and label for label in labels):
            components["gold"] = R.exact_match(None, [s["response"] for s in samples], labels)
        return [{"score": scores[i] if reasons[i] is None else math.nan, "components": {k: v[i] for k, v in components.items()},
                 "invalid": reasons[i]} for i in range(n)]


class ForwardWorker(PeakMemory):
    """A frozen model used only for forward passes (the reference policy)."""

    def __init__(self, model_path: str, dtype: str = "float32", trust_remote_code: bool = False, threads: int = 1):
        torch.set_num_threads(max(1, threads))
        self.device = actor_device()
        self.model = load_model(model_path, "causal_lm", dtype, trust_remote_code).eval().to(self.device)

    def ready(self) -> bool:
        return True

    @torch.no_grad()
    def evaluate(self, batches: list[dict], fn) -> list:
        """`fn(model, batch) -> list` over batches (its results come back on the CPU)."""
        out = []
        for b in batches:
            out.extend(fn(self.model, {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in b.items()}))
        return out
