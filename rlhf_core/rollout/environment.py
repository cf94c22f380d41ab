"""The environment contract (token in, token out: docs in `agents.py`) and the built-in
environments: `Step`, `SingleTurn`, `RetryArithmetic`, `RetryCounting`, the `BUILTIN` table and
`load_environment` (a built-in or a user's `class Environment`).  No torch here: the environment
host child process (`env_host.py`) imports this module, and the runner (`agents.py`) both."""
from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.data.shapes import mark_objects
from rlhf_core.evaluation import completion_answer
from rlhf_core.models.tiny_vlm import IMAGE_TOKEN


@dataclass
class Step:
    reward: float | None = None
    """Environment reward for the episode so far (None: leave scoring to the reward sources)."""
    feedback: str | None = None
    """Text appended to the context before the model's next turn (masked out of the loss)."""
    done: bool = True
    images: list[bytes] | None = None
    """Pictures shown with the feedback (encoded image bytes), one per `<image>` in it, in order."""


class SingleTurn:
    """One prompt, one answer: classic RLHF."""

    def reset(self, prompt: str, label: str) -> str:
        return prompt

    def step(self, action: str) -> Step:
        return Step(done=True)


class RetryArithmetic:
    """Multi-turn example: answer the question; a wrong answer gets the feedback
    `" wrong, try again. A:"` and another turn, up to `max_turns`.  Reward 1 if any turn is right
    (the episode's success), else 0.  Subclasses change only `retry()`, the wrong answer's feedback."""

    max_turns = 3

    def reset(self, prompt: str, label: str) -> str:
        self.label, self.turn = str(label).strip(), 0
        return prompt

    def step(self, action: str) -> Step:
        self.turn += 1
        if completion_answer(action) == self.label:
            return Step(reward=1.0, done=True)
        if self.turn >= self.max_turns:
            return Step(reward=0.0, done=True)
        return self.retry()  # reward 0 so far (an episode cut short keeps it)

    def retry(self) -> Step:
        return Step(reward=0.0, feedback=" wrong, try again. A:", done=False)


class RetryCounting(RetryArithmetic):
    """Multi-turn with image feedback (the shapes task, `prepare.modality=vision`): a wrong count
    gets the picture back with every object outlined and `" wrong, count again<image> A:"`, up to
    `max_turns`.  Reward 1 if any turn is right, else 0."""

    max_turns = 2

    def reset(self, prompt: str, label: str, images: list | None = None) -> str:
        if not images:
            raise ValueError("agent retry_counting needs image rows (its feedback is the prompt's picture, marked): "
                             "`rlhf prepare --set prepare.modality=vision` data and a vision-language model")
        self.picture = images[0] if isinstance(images[0], bytes) else Path(images[0]).read_bytes()
        return super().reset(prompt, label)

    def retry(self) -> Step:
        return Step(reward=0.0, feedback=f" wrong, count again{IMAGE_TOKEN} A:", done=False, images=[mark_objects(self.picture)])


BUILTIN = {"single_turn": SingleTurn, "retry_arithmetic": RetryArithmetic, "retry_counting": RetryCounting}


def takes_images(env) -> bool:
    """Whether an environment's `reset` wants the prompt's pictures (an `images` parameter)."""
    return "images" in inspect.signature(env.reset).parameters


def load_environment(agent: str, agent_file: str | None):
    """The Environment class: a built-in name, or `class Environment` from a user file."""
    if agent_file:
        path = Path(agent_file)
        if not path.is_file():
            raise FileNotFoundError(f"agent_file {agent_file} does not exist")
        spec = importlib.util.spec_from_file_location(f"rlhf_user_agent_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not hasattr(module, "Environment"):
            raise AttributeError(f"{agent_file} must define `class Environment` with reset(prompt, label) and step(action)")
        return module.Environment
    if agent not in BUILTIN:
        raise ValueError(f"unknown agent {agent!r}; built-ins: {sorted(BUILTIN)} (or set agent_file)")
    return BUILTIN[agent]
