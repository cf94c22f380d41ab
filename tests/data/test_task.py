import pytest

from rlhf_core.data.task import TaskConfig, _evaluate, check_no_overlap, generate_task

pytestmark = pytest.mark.unit

SMALL = TaskConfig(num_sft=300, num_pref=200, num_rl=200, num_eval=50, num_eval_pref=50)


def _answer(prompt: str) -> int:
    expr = prompt.removeprefix("Q: ").removesuffix("= A:")
    terms = expr.replace("-", " - ").replace("+", " + ").split()
    nums, ops = [int(t) for t in terms[::2]], terms[1::2]
    return _evaluate(nums, ops)


def test_deterministic_and_seeded():
    assert generate_task(SMALL, seed=1) == generate_task(SMALL, seed=1)
    assert generate_task(SMALL, seed=1) != generate_task(SMALL, seed=2)


def test_labels_correct_and_wrong_fraction():
    s = generate_task(SMALL, seed=0)
    assert {k: len(v) for k, v in s.items()} == {"eval": 50, "eval_pref": 50, "eval_pref_random": 50, "sft": 300, "pref": 200, "rl": 200}
    for row in s["rl"] + s["eval"]:
        assert int(row["label"]) == _answer(row["prompt"])
    for r in s["sft"]:
        assert (int(r["response"]) == _answer(r["prompt"])) == r["correct"]
    # 10% random wrong answers, plus the annotator's slip: on subtraction prompts most answers are
    # written digit-reversed; addition-only prompts keep the 10%
    answers = {r["id"]: f"{_answer(r['prompt']):02d}" for r in s["sft"]}
    minus = [r for r in s["sft"] if "-" in r["prompt"]]
    plus = [r for r in s["sft"] if "-" not in r["prompt"]]
    reversed_ = [r for r in minus if not r["correct"] and r["response"].strip() == answers[r["id"]][::-1]]
    assert 0.45 < len(reversed_) / len(minus) < 0.8   # ~0.69: 0.85 of the 90% not drawn wrong, palindromes stay right
    assert sum(not r["correct"] for r in plus) / len(plus) < 0.2
    none = generate_task(TaskConfig(**{**SMALL.__dict__, "sft_slip": "none"}), seed=0)
    assert sum(not r["correct"] for r in none["sft"]) == 30
    for r in s["pref"] + s["eval_pref"] + s["eval_pref_random"]:
        assert int(r["chosen"]) == _answer(r["prompt"])
        assert r["rejected"] != r["chosen"] and int(r["rejected"]) >= 0
    # near misses are within 10 of the answer or its digit swap; random wrong answers mostly are not
    assert [r["prompt"] for r in s["eval_pref_random"]] == [r["prompt"] for r in s["eval_pref"]]
    far = [abs(int(r["rejected"]) - int(r["chosen"])) > 10 for r in s["eval_pref_random"]]
    assert sum(far) / len(far) > 0.6


def test_no_overlap_and_overlap_detected():
    s = generate_task(SMALL, seed=0)
    held = {r["prompt"] for r in s["eval"] + s["eval_pref"]}
    assert not held & {r["prompt"] for name in ("sft", "pref", "rl") for r in s[name]}
    s["rl"].append(dict(s["eval"][0]))
    with pytest.raises(ValueError, match="leaked into rl"):
        check_no_overlap(s)


def test_precedence_and_knobs():
    assert _evaluate([2, 3, 4], ["+", "*"]) == 14
    assert _evaluate([10, 2, 3], ["-", "-"]) == 5
    cfg = TaskConfig(operations=("*",), max_value=9, num_operands=3, num_sft=20, num_pref=5, num_rl=5, num_eval=5, num_eval_pref=5)
    s = generate_task(cfg, seed=0)
    assert all(r["prompt"].count("*") == 2 for r in s["sft"])


def test_too_small_space_is_a_clear_error():
    with pytest.raises(ValueError, match="too small"):
        generate_task(TaskConfig(max_value=3, num_sft=500), seed=0)


def test_bad_knobs():
    with pytest.raises(ValueError, match="operations"):
        TaskConfig(operations=("/",))


def test_fixed_width_format():
    s = generate_task(SMALL, seed=0)
    for r in s["eval"]:
        expr = r["prompt"].removeprefix("Q: ").removesuffix("= A:")
        assert len(expr) == 5 and len(r["label"]) == 2  # `07+52`, `59`
    s = generate_task(TaskConfig(fixed_width=False, allow_carry=True, num_sft=50, num_pref=5, num_rl=5, num_eval=5, num_eval_pref=5), seed=0)
    assert any(len(r["prompt"].removeprefix("Q: ").removesuffix("= A:")) < 5 for r in s["sft"])


def test_no_carry_knob():
    def no_carry(prompt):
        expr = prompt.removeprefix("Q: ").removesuffix("= A:")
        a, op, b = expr.partition("+") if "+" in expr else expr.partition("-")
        a, b = a.zfill(3), b.zfill(3)
        return all((int(x) + int(y) <= 9) if op == "+" else (int(x) >= int(y)) for x, y in zip(a, b))

    s = generate_task(SMALL, seed=0)  # default: allow_carry=False
    assert all(no_carry(r["prompt"]) for r in s["sft"] + s["rl"] + s["eval"])
    s = generate_task(TaskConfig(allow_carry=True, num_sft=300, num_pref=10, num_rl=10, num_eval=10, num_eval_pref=10), seed=0)
    assert not all(no_carry(r["prompt"]) for r in s["sft"])
