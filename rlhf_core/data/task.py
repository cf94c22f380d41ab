"""The built-in synthetic task: integer arithmetic with verifiable answers.

`Q: 37+58= A:` -> ` 95`.  Seeded and deterministic.  Difficulty knobs: the operand range
(`max_value`), the number of operands and the operators.  The held-out eval prompts are drawn
first and every training split excludes them (checked by `check_no_overlap`).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    operations: tuple[str, ...] = ("+", "-")
    """Operators to draw from: any of + - *."""
    max_value: int = 99
    """Operands are drawn from [0, max_value] (99 = two-digit arithmetic)."""
    num_operands: int = 2
    """Operands per expression (3 makes the task harder)."""
    allow_negative: bool = False
    """If false, expressions with a negative result are redrawn."""
    fixed_width: bool = True
    """Zero-pad operands (and digit-wise answers) to the width of max_value: `07+52= A: 59`.
    Fixed digit positions make the task far easier for a tiny model."""
    allow_carry: bool = False
    """If false, + never carries and - never borrows (digit-wise arithmetic: a tiny model learns it
    in minutes on a CPU, which is what the embedded pipeline needs)."""
    num_sft: int = 4000
    """SFT demonstrations (prompt, response)."""
    sft_wrong_fraction: float = 0.1
    """Fraction of SFT responses that are deliberately wrong, so later stages have something to fix."""
    sft_slip: Literal["none", "reversed"] = "reversed"
    """A systematic annotator slip in the sft demonstrations (the tiny analogue of InstructGPT's
    premise: people compare answers better than they write them).  `reversed`: for problems with
    `sft_slip_op`, a fraction `sft_slip_rate` of the demonstrations write the answer's digits in
    reverse (`45-21=42` shown as ` 42` -> ` 24`).  SFT imitates it; the preference pairs, the
    verifier and the pretraining corpus do not carry it, so RL (and DPO) have something to fix."""
    sft_slip_op: str = "-"
    sft_slip_rate: float = 0.85
    """On the 800-step base: sft 0.57-0.625 greedy, the right answer still sampled, RL +0.16-0.19."""
    num_pref: int = 3000
    """Preference pairs (prompt, chosen = correct, rejected = plausible wrong)."""
    num_rl: int = 2000
    """RL prompts with labels."""
    num_eval: int = 200
    """Held-out eval prompts with labels (no overlap with any training prompt)."""
    num_eval_pref: int = 200
    """Held-out preference pairs (reward-model pair accuracy), prompts disjoint from training."""

    def __post_init__(self):
        bad = set(self.operations) - set(OPS)
        if bad or not self.operations:
            raise ValueError(f"operations must be a non-empty subset of {sorted(OPS)}, got {list(self.operations)}")
        if self.max_value < 1 or self.num_operands < 2:
            raise ValueError("max_value must be >= 1 and num_operands >= 2")
        if not 0.0 <= self.sft_wrong_fraction <= 1.0 or not 0.0 <= self.sft_slip_rate <= 1.0:
            raise ValueError("sft_wrong_fraction and sft_slip_rate must be in [0, 1]")


OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def answer_text(cfg: TaskConfig, value: int) -> str:
    """Digit-wise answers (no carry, no *, no negatives) are padded like the operands."""
    digitwise = cfg.fixed_width and not cfg.allow_carry and "*" not in cfg.operations and value >= 0
    return f"{value:0{len(str(cfg.max_value))}d}" if digitwise else str(value)


def format_prompt(expression: str) -> str:
    return f"Q: {expression}= A:"


def format_response(answer: str) -> str:
    """The completion after the prompt; eval strips whitespace, so ` 95` matches label `95`."""
    return f" {answer}"


def _evaluate(operands: list[int], ops: list[str]) -> int:
    """Usual precedence: fold `*` first, then + and - left to right."""
    terms, signs = [operands[0]], []
    for op, b in zip(ops, operands[1:]):
        if op == "*":
            terms[-1] *= b
        else:
            terms.append(b)
            signs.append(op)
    total = terms[0]
    for op, t in zip(signs, terms[1:]):
        total = OPS[op](total, t)
    return total


def _digitwise(a: int, b: int, op: str) -> bool:
    """True if a op b needs no carry (+) or borrow (-) in any digit; * is always allowed."""
    while a or b:
        da, db = a % 10, b % 10
        if (op == "+" and da + db > 9) or (op == "-" and da < db):
            return False
        a, b = a // 10, b // 10
    return True


def draw_problem(rng: random.Random, cfg: TaskConfig) -> tuple[str, int]:
    """One (expression, answer) pair."""
    while True:
        operands = [rng.randint(0, cfg.max_value) for _ in range(cfg.num_operands)]
        ops = [rng.choice(cfg.operations) for _ in range(cfg.num_operands - 1)]
        answer = _evaluate(operands, ops)
        if not cfg.allow_carry and not all(_digitwise(a, b, op) for a, op, b in zip(operands, ops, operands[1:])):
            continue
        if cfg.allow_negative or answer >= 0:
            width = len(str(cfg.max_value)) if cfg.fixed_width else 0
            expr = "".join(f"{a:0{width}d}{op}" for a, op in zip(operands, ops)) + f"{operands[-1]:0{width}d}"
            return expr, answer


def plausible_wrong(rng: random.Random, answer: int, allow_negative: bool) -> int:
    """A near miss a weak model would make: off by one, off by ten, swapped digits, dropped carry."""
    candidates = {answer + 1, answer - 1, answer + 10, answer - 10}
    digits = str(abs(answer))
    if len(digits) >= 2:
        swapped = int(digits[:-2] + digits[-1] + digits[-2])
        candidates.add(swapped if answer >= 0 else -swapped)
    candidates.discard(answer)
    if not allow_negative:
        candidates = {c for c in candidates if c >= 0}
    return rng.choice(sorted(candidates))


def _unique_problems(rng: random.Random, cfg: TaskConfig, n: int, exclude: set[str]) -> list[tuple[str, int]]:
    seen, out = set(exclude), []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(
                f"the task space is too small for {n} distinct prompts (max_value={cfg.max_value}, "
                f"operations={list(cfg.operations)}); raise max_value or lower the split sizes"
            )
        expr, answer = draw_problem(rng, cfg)
        if expr not in seen:
            seen.add(expr)
            out.append((expr, answer))
    return out


def generate_task(cfg: TaskConfig, seed: int) -> dict[str, list[dict]]:
    """All splits as lists of rows: sft, pref, rl, eval, eval_pref, eval_pref_random.  Deterministic in `seed`."""
    rng = random.Random(seed)
    held_out = _unique_problems(rng, cfg, cfg.num_eval + cfg.num_eval_pref, exclude=set())
    eval_exprs = {e for e, _ in held_out}
    splits: dict[str, list[dict]] = {"eval": [], "eval_pref": []}
    for i, (expr, ans) in enumerate(held_out[: cfg.num_eval]):
        splits["eval"].append({"id": f"eval-{i:06d}", "prompt": format_prompt(expr), "label": answer_text(cfg, ans)})
    for i, (expr, ans) in enumerate(held_out[cfg.num_eval :]):
        wrong = plausible_wrong(rng, ans, cfg.allow_negative)
        splits["eval_pref"].append({"id": f"eval_pref-{i:06d}", "prompt": format_prompt(expr),
                                    "chosen": format_response(answer_text(cfg, ans)), "rejected": format_response(answer_text(cfg, wrong))})

    n_wrong = round(cfg.num_sft * cfg.sft_wrong_fraction)
    sft = _unique_problems(rng, cfg, cfg.num_sft, exclude=eval_exprs)
    wrong_idx = set(rng.sample(range(cfg.num_sft), n_wrong))
    splits["sft"] = []
    for i, (expr, ans) in enumerate(sft):
        answer = answer_text(cfg, ans)
        shown = answer_text(cfg, plausible_wrong(rng, ans, cfg.allow_negative)) if i in wrong_idx else answer
        if i not in wrong_idx and cfg.sft_slip == "reversed" and cfg.sft_slip_op in expr[1:] and rng.random() < cfg.sft_slip_rate:
            shown = answer[::-1]
        splits["sft"].append({"id": f"sft-{i:06d}", "prompt": format_prompt(expr), "response": format_response(shown), "correct": shown == answer})
    splits["pref"] = [
        {"id": f"pref-{i:06d}", "prompt": format_prompt(expr), "chosen": format_response(answer_text(cfg, ans)),
         "rejected": format_response(answer_text(cfg, plausible_wrong(rng, ans, cfg.allow_negative)))}
        for i, (expr, ans) in enumerate(_unique_problems(rng, cfg, cfg.num_pref, exclude=eval_exprs))
    ]
    splits["rl"] = [
        {"id": f"rl-{i:06d}", "prompt": format_prompt(expr), "label": answer_text(cfg, ans)}
        for i, (expr, ans) in enumerate(_unique_problems(rng, cfg, cfg.num_rl, exclude=eval_exprs))
    ]
    # the same held-out prompts with a random wrong number as the rejected answer: a reward model
    # should find these easier than the near misses (its own rng: the other splits do not move)
    far = random.Random(f"{seed}-eval-pref-random")
    top = max(int(r["chosen"]) for r in splits["eval_pref"]) if splits["eval_pref"] else 0
    splits["eval_pref_random"] = [
        {**r, "id": r["id"].replace("eval_pref", "eval_pref_random"),
         "rejected": format_response(answer_text(cfg, random_wrong(far, int(r["chosen"]), top)))}
        for r in splits["eval_pref"]
    ]
    check_no_overlap(splits)
    return splits


def random_wrong(rng: random.Random, answer: int, top: int) -> int:
    """A wrong number drawn uniformly from [0, max(top, 9)] (never the answer)."""
    while (x := rng.randint(0, max(top, 9))) == answer:
        pass
    return x


def check_no_overlap(splits: dict[str, list[dict]]) -> None:
    """Raise if any held-out prompt (eval, eval_pref) appears in a training split."""
    held = {r["prompt"] for name in ("eval", "eval_pref", "eval_pref_random") for r in splits.get(name, [])}
    for name in ("sft", "pref", "rl"):
        leaked = held & {r["prompt"] for r in splits.get(name, [])}
        if leaked:
            raise ValueError(f"{len(leaked)} held-out prompts leaked into {name}, e.g. {sorted(leaked)[0]!r}")
