"""Agents and environments: token in, token out.

An environment is a small object with two methods (the whole contract for user code):

    reset(prompt: str, label: str) -> str          the first observation (text shown to the model)
    step(action: str) -> Step                      the model's turn, decoded; returns a Step

`Step(reward=None | float, feedback=None | str, done=bool, images=None | [bytes])`.  The runner
(`run_episodes`) owns the tokens: observations and feedback are tokenized once when they enter
the context, the model's actions stay exactly the token ids the engine sampled (never
re-tokenized), and a per-token `action_mask` marks model tokens 1 and environment tokens 0 (masked
out of the loss).  With a vision-language model an environment may show pictures: `Step.images`
are PNG/JPEG bytes, one per `<image>` in `feedback` (their image tokens are environment tokens);
an environment whose `reset` takes an `images` argument gets the prompt's pictures.

Single-turn RLHF is `SingleTurn`: one action, no environment reward (the reward sources score
it).  `RetryArithmetic` is the multi-turn example: a wrong answer gets feedback and another try.
A user environment is a Python file defining `class Environment` (see `load_environment`); it
runs in a child process of its own (`env_host.EnvironmentProcess`), where a call past
`env_timeout` is ended by killing that process.  The built-ins run in-process (`LocalEnvironments`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rlhf_core.data.images import ImageRules, image_problem
from rlhf_core.models.tiny_vlm import IMAGE_TOKEN
from rlhf_core.rollout.env_host import EnvironmentProcess
from rlhf_core.rollout.environment import BUILTIN, RetryArithmetic, RetryCounting, SingleTurn, Step, load_environment, takes_images

__all__ = ["BUILTIN", "RetryArithmetic", "RetryCounting", "SingleTurn", "Step", "load_environment", "takes_images"]  # the contract, re-exported


@dataclass
class Episode:
    """One trajectory.  `token_ids` = prompt + (action, feedback)*; masks/logprobs align with it."""
    prompt_len: int
    token_ids: list[int]
    action_mask: list[int] = field(default_factory=list)
    """Over the tokens after the prompt: 1 = sampled by the model, 0 = environment text."""
    engine_logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    """Over the tokens after the prompt: the policy version of the engine when each was added (one
    value unless a partial rollout continued the episode under newer weights)."""
    env_reward: float | None = None
    turns: int = 0
    finish_reason: str = "stop"
    last_action: str = ""
    actions: list[str] = field(default_factory=list)
    images: list = field(default_factory=list)
    """Image references (paths or bytes) in the order of the token_ids' image placeholders (VLMs)."""


class LocalEnvironments:
    """The built-in environments (this package's code, which does not block), in this process:
    `new(n)`, then `reset(i, prompt, label)` / `step(i, action)` on the i-th."""

    def __init__(self, env_cls):
        self.env_cls, self.envs = env_cls, []

    def new(self, n: int) -> None:
        self.envs = [self.env_cls() for _ in range(n)]

    def reset(self, i: int, prompt: str, label: str, images: list | None = None) -> str:
        env = self.envs[i]
        return env.reset(prompt, label, images=images) if takes_images(env) else env.reset(prompt, label)

    def step(self, i: int, action: str) -> Step:
        return self.envs[i].step(action)

    def close(self) -> None:
        self.envs = []


def environments(agent: str, agent_file: str | None, timeout: float):
    """Where the episodes' environments run: a user's file in a child process whose calls are
    bounded by `timeout` seconds (`env_host`), a built-in in this process."""
    load_environment(agent, agent_file)  # a missing file or class is an error now, in the caller
    if agent_file:
        return EnvironmentProcess(agent, agent_file, timeout)
    return LocalEnvironments(BUILTIN[agent])


def generate_turn(engine, contexts: list[list[int]], budgets: list[int], temperature: float, seeds: list[int], segment: int,
                  version, pixels: list | None = None) -> list[tuple]:
    """One turn of every context: (completion, each token's policy version).  With `segment` > 0
    (partial rollouts) it is generated `segment` tokens at a time and `version()` -- which first
    lets a waiting weight sync in -- is asked before each piece: an episode interrupted by a sync
    continues from its tokens so far under the new weights.  Piece p > 0 of a context samples
    with its own seed (the first piece with the turn's, so segment=0 and one piece agree).
    `pixels`: per context its images' pixel values (a VLM), None where it has none."""
    # here, not at the top: a user's environment file imports `agents.Step` in the environment host process, which needs no torch
    from rlhf_core.rollout.engines import Completion

    images = {"pixels": pixels} if pixels and any(p is not None for p in pixels) else {}
    if segment <= 0:
        v = version()
        return [(out, [v] * len(out.token_ids)) for out in engine.generate(contexts, budgets, temperature, seeds, **images)]
    if images:
        raise NotImplementedError("partial rollouts (rl.rollout.partial_rollout_tokens) of image prompts are not supported yet")
    done = [(Completion([], [], "length"), []) for _ in contexts]
    active, piece = list(range(len(contexts))), 0
    while active:
        v = version()
        outs = engine.generate([contexts[i] + done[i][0].token_ids for i in active], [min(segment, budgets[i] - len(done[i][0].token_ids))
                               for i in active], temperature, [seeds[i] + 1_000_003 * piece for i in active])
        still = []
        for i, out in zip(active, outs):
            comp, versions = done[i]
            comp.token_ids += out.token_ids
            comp.logprobs += out.logprobs
            versions += [v] * len(out.token_ids)
            if out.finish_reason == "stop":
                comp.finish_reason = "stop"
            elif len(comp.token_ids) < budgets[i]:
                still.append(i)
        active, piece = still, piece + 1
    return done


def feedback_ids(tokenizer, vision, step: Step) -> list[int]:
    """The feedback's token ids (no BOS); with pictures, each `<image>` expanded by the processor.
    A picture that is not a usable image, or pictures without a VLM, are the environment's error."""
    if not step.images:
        return tokenizer(step.feedback or "", add_special_tokens=False).input_ids
    if vision is None:
        raise ValueError("the environment returned images, but the policy is not a vision-language model")
    if (step.feedback or "").count(IMAGE_TOKEN) != len(step.images):
        raise ValueError(f"the environment returned {len(step.images)} image(s) for {(step.feedback or '').count(IMAGE_TOKEN)} "
                         f"{IMAGE_TOKEN} placeholder(s) in its feedback")
    for k, data in enumerate(step.images):
        problem = image_problem(data, ImageRules()) if isinstance(data, bytes) else f"not bytes but {type(data).__name__}"
        if problem:
            raise ValueError(f"the environment's feedback image {k}: {problem}")
    return vision.prompt_ids(step.feedback, list(step.images), special=False)


def run_episodes(engine, tokenizer, envs, prompts: list[str], labels: list[str], seeds: list[int], max_new_tokens: int,
                 temperature: float, max_len: int, max_turns: int = 8, segment: int = 0, version=lambda: 0, images: list | None = None,
                 vision=None) -> list[Episode]:
    """Play one episode per (prompt, label, seed), all turns batched through the engine; `envs`
    from `environments` (a fresh environment per episode).  `segment`, `version`: partial
    rollouts (`generate_turn`); `version()` is the engine's policy version.  `images`: per prompt
    its image references (VLM rows; `vision`, a `data.images.VisionInputs`, expands their
    placeholders and makes their pixel values)."""
    eos = tokenizer.eos_token_id
    envs.new(len(prompts))
    episodes, pixels = [], []
    for i, (prompt, label) in enumerate(zip(prompts, labels)):
        refs = list((images or [None] * len(prompts))[i] or [])
        obs = envs.reset(i, prompt, label, refs) if refs else envs.reset(i, prompt, label)
        ids = vision.prompt_ids(obs, refs) if refs else tokenizer(obs).input_ids
        episodes.append(Episode(prompt_len=len(ids), token_ids=list(ids), images=refs))
        pixels.append(vision.pixel_values(refs) if refs else None)
    active = list(range(len(episodes)))
    for turn in range(max_turns):
        if not active:
            break
        budget = [min(max_new_tokens, max_len - len(episodes[i].token_ids)) for i in active]
        runnable = [i for i, b in zip(active, budget) if b > 0]
        for i in set(active) - set(runnable):
            episodes[i].finish_reason = "length"
        # one seed per (episode, turn): turns of one episode never reuse a random stream
        outs = generate_turn(engine, [episodes[i].token_ids for i in runnable], [b for b in budget if b > 0], temperature,
                             [seeds[i] * 8191 + turn for i in runnable], segment, version, [pixels[i] for i in runnable]) if runnable else []
        still = []
        for i, (out, versions) in zip(runnable, outs):
            ep = episodes[i]
            ep.token_ids += out.token_ids
            ep.action_mask += [1] * len(out.token_ids)
            ep.engine_logprobs += out.logprobs
            ep.token_versions += versions
            ep.turns += 1
            ep.finish_reason = out.finish_reason
            action = tokenizer.decode([t for t in out.token_ids if t != eos], skip_special_tokens=True)
            ep.last_action = action
            ep.actions.append(action)
            step = envs.step(i, action)
            if step.reward is not None:
                ep.env_reward = float(step.reward)
            if step.done or out.finish_reason == "length":
                continue
            fb = feedback_ids(tokenizer, vision, step)
            if len(ep.token_ids) + len(fb) >= max_len:
                ep.finish_reason = "length"
                continue
            if step.images:  # the next turns see them: pixel values of every picture so far, in order
                ep.images += list(step.images)
                pixels[i] = vision.pixel_values(ep.images)
            ep.token_ids += fb
            ep.action_mask += [0] * len(fb)
            ep.engine_logprobs += [0.0] * len(fb)
            ep.token_versions += [versions[-1]] * len(fb)
            still.append(i)
        active = still
    return episodes
