"""docs/architecture.md's "How to add ..." lists are complete: each names the files where the code
keeps what such an addition must extend (found here from the code, not from the doc), every file
it names exists, and every test it cites is defined.  Static (ast): no torch, no Ray."""
import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()
SOURCES = sorted(p for d in ("rlhf_core", "stages") for p in (ROOT / d).rglob("*.py"))


def section(title: str) -> str:
    """The text of `## How to add <title>` up to the next `## `."""
    m = re.search(rf"^## How to add {re.escape(title)}\n(.*?)(?=^## )", DOC, re.S | re.M)
    assert m, f"docs/architecture.md has no '## How to add {title}' section"
    return m.group(1)


def named_paths(text: str) -> set[str]:
    """Backticked repository paths (`stages/rl.py`, `dvc.yaml`, `stages/rl.py::rl_step_once`), the
    `::` part dropped."""
    return {m.split("::")[0] for m in re.findall(r"`([\w./]+(?:\.py|\.yaml)(?:::\w+)?)`", text)}


def defines(name: str) -> list[str]:
    """Repository paths of the modules that bind `name` at their top level."""
    out = []
    for path in SOURCES:
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                out.append(str(path.relative_to(ROOT)))
    return out


def config_with_field(field: str) -> list[str]:
    """Repository paths of the modules whose config dataclasses (a class named `Config` or
    `...Config`: a stage's config or one of its sections, e.g. rl's `RolloutConfig`) declare
    `field` with a `Literal` (the user-facing choice a new algorithm / engine must be added to)."""
    out = []
    for path in SOURCES:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("Config"):
                for stmt in node.body:
                    if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == field
                            and "Literal" in ast.unparse(stmt.annotation)):
                        out.append(str(path.relative_to(ROOT)))
    return out


def class_file(name: str) -> list[str]:
    """Repository paths of the modules that define class `name` at their top level."""
    return [str(p.relative_to(ROOT)) for p in SOURCES if any(isinstance(n, ast.ClassDef) and n.name == name for n in ast.parse(p.read_text()).body)]


CASES = {
    # what a new algorithm extends: the recipe table, the parts it is built of, the rl Config's choice
    "an algorithm": lambda: {*defines("ALGO_RECIPES"), *defines("ESTIMATORS"), *defines("SCORE_BASELINES"),
                             *defines("POLICY_LOSSES"), *config_with_field("algo")},
    # a new stage: its module (the registry's naming rule), the ordered list, the DAG and its params
    "a stage": lambda: {*defines("STAGES"), "dvc.yaml", "params.yaml", "stages/NAME.py"},
    # a new engine: the engine table and the choice in rl's rollout section (RolloutConfig)
    "a rollout engine": lambda: {*defines("ENGINES"), *config_with_field("engine")},
    # a new reward source: the source table and the section its settings live in
    "a reward source": lambda: {*defines("REWARD_SOURCES"), *class_file("RewardConfig")},
}


@pytest.mark.parametrize("title", CASES)
def test_each_how_to_add_list_names_every_file_the_code_needs(title):
    text = section(title)
    needed = CASES[title]()
    assert len(needed) >= 2, needed  # the search found the tables (a renamed one would empty it)
    missing = needed - named_paths(text)
    assert not missing, f"'How to add {title}' does not name {sorted(missing)}"


@pytest.mark.parametrize("title", CASES)
def test_each_how_to_add_list_names_only_real_files_and_tests(title):
    text = section(title)
    for path in named_paths(text) - {"stages/NAME.py"}:
        assert (ROOT / path).exists(), f"'How to add {title}' names {path}, which does not exist"
    for path, name in re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text):
        tree = ast.parse((ROOT / path).read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body), f"{path}::{name} is not a test"
    for name in re.findall(r"`(test_\w+)`", text):  # bare test names: defined somewhere under tests/
        assert any(re.search(rf"^def {name}\(", p.read_text(), re.M) for p in (ROOT / "tests").rglob("test_*.py")), name


def test_every_stage_module_follows_the_naming_rule():
    """`stages/NAME.py` in the list is a rule: every registered stage runs the module at that path."""
    tree = ast.parse((ROOT / "rlhf_core" / "registry.py").read_text())
    entries = [[a.value for a in n.args[:2]] for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Stage"]
    assert len(entries) >= 6, entries
    for name, module in entries:
        assert module == f"stages.{name}" and (ROOT / "stages" / f"{name}.py").exists(), (name, module)
