"""The pretraining corpus `rlhf prepare` writes for the built-in task: the tiny model's "web text".

A real base model has read worked examples in many layouts and text that judges whether a
claimed result is right.  This corpus is the tiny analogue, one document per row (`text`):

  qa       `Q: 07+52= A: 59`                      the task's own layout
  eq       `07+52=59`                             a bare equation
  verdict  `Q: 07+52= A: 58\\nVerdict: wrong`     a claim (right or a plausible/random wrong
                                                  answer, half each) and its judgment

Every problem of the task space that is not held out gets one document per format (up to
`max_problems`).  No held-out prompt may appear: `check_corpus` scans every document for the
expressions of the eval splits.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from rlhf_core.data.task import TaskConfig, answer_text, draw_problem, plausible_wrong

FORMATS = ("qa", "eq", "verdict")
VERDICT_PREFIX = "\nVerdict:"
"""What follows a claimed answer in `verdict` documents; the reward model reads its score here."""


@dataclass(frozen=True, kw_only=True)
class CorpusConfig:
    formats: tuple[str, ...] = FORMATS
    """Document layouts, any of qa, eq, verdict."""
    max_problems: int = 20000
    """Problems drawn from the task space (fewer when the space is smaller)."""
    wrong_claim_fraction: float = 0.5
    """Fraction of `verdict` documents whose claimed answer is wrong."""

    def __post_init__(self):
        bad = set(self.formats) - set(FORMATS)
        if bad or not self.formats:
            raise ValueError(f"corpus formats must be a non-empty subset of {list(FORMATS)}, got {list(self.formats)}")


def _wrong_answer(rng: random.Random, task: TaskConfig, ans: int) -> int:
    """Half near misses (what a weak model says), half random numbers in the answer range."""
    if rng.random() < 0.5:
        return plausible_wrong(rng, ans, task.allow_negative)
    top = task.max_value * (task.num_operands if "*" not in task.operations else task.max_value)
    while True:
        w = rng.randint(-top if task.allow_negative else 0, top)
        if w != ans:
            return w


def document(fmt: str, expr: str, answer: str, claim: str) -> str:
    if fmt == "qa":
        return f"Q: {expr}= A: {answer}"
    if fmt == "eq":
        return f"{expr}={answer}"
    return f"Q: {expr}= A: {claim}{VERDICT_PREFIX} {'right' if claim == answer else 'wrong'}"


def build_corpus(task: TaskConfig, cfg: CorpusConfig, held_out: set[str], seed: int) -> list[dict]:
    """Rows `{id, text}`; `held_out`: expressions (`07+52`) that must not appear."""
    rng = random.Random(seed * 7_919 + 17)
    seen: set[str] = set()
    rows: list[dict] = []
    stale = 0
    while len(seen) < cfg.max_problems and stale < 5_000:  # 5000 draws with nothing new: space exhausted
        expr, ans = draw_problem(rng, task)
        if expr in held_out or expr in seen:
            stale += 1
            continue
        stale = 0
        seen.add(expr)
        answer = answer_text(task, ans)
        claim = answer_text(task, _wrong_answer(rng, task, ans)) if rng.random() < cfg.wrong_claim_fraction else answer
        for fmt in cfg.formats:
            rows.append({"id": f"doc-{len(rows):07d}", "text": document(fmt, expr, answer, claim)})
    rng.shuffle(rows)
    return rows


_EXPR = re.compile(r"(?<![\d+\-*])([\d+\-*]*\d)=")


def expressions(text: str) -> set[str]:
    """Every arithmetic expression followed by `=` in `text` (`Q: 07+52= A:` -> {`07+52`})."""
    return set(_EXPR.findall(text))


def check_corpus(rows: list[dict], held_out: set[str]) -> None:
    """Raise if any document contains a held-out expression."""
    for row in rows:
        leaked = expressions(row["text"]) & held_out
        if leaked:
            raise ValueError(f"held-out prompt {sorted(leaked)[0]!r} leaked into the pretraining corpus ({row['id']})")
