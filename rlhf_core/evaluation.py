"""Task metrics shared by the stages (`eval/accuracy` and its kin in every stage's metrics.json)."""
from __future__ import annotations


def completion_answer(text: str) -> str:
    """The answer in a completion: cut at the first newline, surrounding whitespace stripped.
    (Text is decoded up to EOS by the caller.)"""
    return text.split("\n", 1)[0].strip()


def exact_match_accuracy(completions: list[str], labels: list[str]) -> float:
    """`eval/accuracy`: fraction of completions whose answer equals the label."""
    if not labels:
        return 0.0
    return sum(completion_answer(c) == str(label).strip() for c, label in zip(completions, labels)) / len(labels)
