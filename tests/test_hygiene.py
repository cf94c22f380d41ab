"""Rules of the test suite itself (issue 16, item 7): a test that cannot fail is worse than none.

Every test is marked unit, integration, e2e or gpu (conftest.py refuses to collect an unmarked
one); no subprocess or wait inside a test may outlast pytest's own timeout, since then pytest
kills the test first and the subprocess's own, clearer error never shows."""
import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]


def long_waits(source: str, limit: int) -> list[tuple[int, str]]:
    """(line, call) of every call in `source` that waits `limit` seconds or more: a `timeout=N` /
    `timeout_s=N` keyword, or a literal N >= limit passed positionally to a call whose name has
    `wait` or `timeout` in it (`proc.wait(N)`, `wait_for(cond, N)`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "attr", None) or getattr(node.func, "id", "")
        values = [k.value for k in node.keywords if k.arg in ("timeout", "timeout_s")]
        if "wait" in name or "timeout" in name:
            values += node.args
        found += [(node.lineno, f"{name}(... {v.value} ...)") for v in values
                  if isinstance(v, ast.Constant) and isinstance(v.value, (int, float)) and not isinstance(v.value, bool) and v.value >= limit]
    return found


def test_long_waits_finds_keyword_and_positional_waits():
    src = "p.wait(900)\nwait_for(f, 900, poll=1)\nrun(x, timeout=1200)\nwait_for(f, 60)\nsleep(900)\nrun(x, timeout=True)\n"
    assert [line for line, _ in long_waits(src, limit=900)] == [1, 2, 3]


def test_no_timeout_in_a_test_reaches_the_pytest_timeout():
    limit = int(re.search(r"^timeout\s*=\s*(\d+)", (ROOT / "pyproject.toml").read_text(), re.M).group(1))
    too_long = [f"{path.relative_to(ROOT)}:{line}: {call} >= pytest's {limit}"
                for path in sorted((ROOT / "tests").rglob("*.py")) for line, call in long_waits(path.read_text(), limit)]
    assert too_long == []


def test_an_unmarked_test_is_refused():
    """conftest's collection hook (tests/training/test_engine_units.py had no marker: `-m unit` skipped it)."""
    import conftest

    class Item:
        def __init__(self, nodeid, kinds):
            self.nodeid, self.kinds = nodeid, kinds

        def get_closest_marker(self, name):
            return name if name in self.kinds else None

    with pytest.raises(pytest.UsageError, match=r"no kind marker .*: test_x.py::test_bare$"):
        conftest.pytest_collection_modifyitems(None, [Item("test_x.py::test_marked", {"unit"}), Item("test_x.py::test_bare", set())])


@pytest.mark.xdist_group("hygiene")
def test_xdist_groups_reach_the_scheduler(request):
    """`make test` runs `--dist loadgroup`: tests of one xdist_group share a worker and its module
    fixtures (test_learning's chain).  pytest 9 with pytest-xdist 3.8 silently dropped the groups
    (xdist tags `Node._nodeid`, pytest 9 reads `Node._id`), so every worker rebuilt the chain."""
    if not getattr(request.config.option, "loadgroup", False):  # set in each xdist worker
        pytest.skip("not under --dist loadgroup")
    assert request.node.nodeid.endswith("@hygiene"), request.node.nodeid


def test_no_function_is_longer_than_a_screen():
    """A driver that grows past ~60 lines is two things in one (issue 17): split it."""
    import ast

    long = []
    for pkg in ("rlhf_core", "stages", "flows"):
        for f in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                    long.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long


def test_no_test_calls_another_test():
    """A test that calls another runs it twice and ties their failures together (use a fixture)."""
    calls = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_"):
                calls += [f"{path.relative_to(ROOT)}:{c.lineno}: {fn.name} calls {c.func.id}" for c in ast.walk(fn)
                          if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id.startswith("test_")]
    assert calls == []
