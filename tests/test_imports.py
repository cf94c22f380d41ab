import ast
import io
import json
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit


def test_algos_import_no_heavy_frameworks():
    """rlhf_core.algos is pure math: importing it must not pull in any runtime framework."""
    code = (
        "import sys, rlhf_core.algos\n"
        "bad = [m for m in ('ray', 'prefect', 'vllm', 'deepspeed', 'transformers') if m in sys.modules]\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# rlhf_core's packages in layers: a package imports only from layers before its own (ARCHITECTURE:
# runtime at the bottom; each package owns its actors).  A cycle makes a change anywhere in it a
# change everywhere, and drags Ray actors' imports into pure code.
LAYERS = [{"atomic", "config", "registry"}, {"runtime", "algos", "evaluation", "models"}, {"artifacts", "data"},
          {"rollout"}, {"training"}, {"rl"}, {"cli"}]


def _package_imports() -> dict[str, set[str]]:
    root = Path(__file__).resolve().parents[1] / "rlhf_core"
    out: dict[str, set[str]] = {}
    for f in root.rglob("*.py"):
        pkg = f.relative_to(root).parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rlhf_core"):
                parts = node.module.split(".")
                names = [parts[1]] if len(parts) > 1 else [a.name for a in node.names]  # `from rlhf_core import atomic`
            elif isinstance(node, ast.Import):
                names = [a.name.split(".")[1] for a in node.names if a.name.startswith("rlhf_core.")]
            out.setdefault(pkg, set()).update(n for n in names if n != pkg)
    return out


def test_packages_import_one_way():
    layer = {pkg: i for i, group in enumerate(LAYERS) for pkg in group}
    imports = _package_imports()
    assert set(imports) - {"__init__"} <= set(layer), f"a new package: place it in LAYERS: {set(imports) - set(layer)}"
    upward = [f"{pkg} -> {dep}" for pkg, deps in imports.items() for dep in deps if pkg in layer and layer[dep] >= layer[pkg]]
    assert not upward, f"imports against the layering: {upward}"


def _module_imports() -> dict[str, set[str]]:
    """{module: the rlhf_core modules it imports}, function-level imports included (one hidden in a
    function still runs, and still ties the two modules together)."""
    root = Path(__file__).resolve().parents[1]
    files = {".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): f for f in (root / "rlhf_core").rglob("*.py")}
    graph = {}
    for name, f in files.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rlhf_core"):
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("rlhf_core")}
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_back():
    """Module level, not only package level: two modules that import each other (even inside a
    function) are one module in two files.  The check finds a planted cycle."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = _module_imports()
    assert "rlhf_core.rl.step" in graph and graph["rlhf_core.rl.step"]  # the scan sees the tree
    assert not cycles(graph), f"modules importing each other: {cycles(graph)}"


# The command, the Prefect flows and the environment host's child process (which runs a user's
# environment file, and that imports `rollout.agents`) are light: none pulls in these frameworks.
HEAVY = ("torch", "ray", "prefect", "vllm", "deepspeed", "transformers")
LIGHT = [("rlhf_core.cli", HEAVY), *[(f"rlhf_core.rollout.{m}", HEAVY) for m in ("env_host", "environment", "agents")],
         *[(f"flows.{m}", tuple(h for h in HEAVY if h != "prefect")) for m in ("overrides", "promotion", "report", "serve", "pipeline")]]


def test_light_modules_import_no_heavy_frameworks():
    """Imported one after the other in one process, each module is charged with what it adds
    (Prefect is allowed to the flows: flows.pipeline, imported last, is a Prefect flow)."""
    code = (
        "import importlib, json, sys\n"
        "bad = {}\n"
        "for name, banned in json.loads(sys.argv[1]):\n"
        "    importlib.import_module(name)\n"
        "    bad.update({name: [m for m in banned if m in sys.modules]} if any(m in sys.modules for m in banned) else {})\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(LIGHT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# An import inside a function once hid an import cycle.  One of our own modules is imported there
# only for a reason -- a heavy or optional dependency, code that runs only in a Ray actor -- and
# says so, in a comment on its line or on the line just above.  A stdlib module never has one.
OWN = ("rlhf_core", "stages", "flows")
PRAGMAS = ("noqa", "type:", "pragma", "fmt:", "isort:")  # comments for tools, not reasons


def function_imports(source: str) -> list[tuple[int, str, str]]:
    """(line, module, verdict) of every import inside a function of `source`; verdict: `ok`
    (third-party, or ours with a reason), `no reason` (ours without one) or `stdlib`."""
    lines = source.splitlines()
    reasons = {t.start[0] for t in tokenize.generate_tokens(io.StringIO(source).readline)
               if t.type == tokenize.COMMENT and not t.string.lstrip("#").strip().startswith(PRAGMAS)}
    out = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                names = ["." * child.level + (child.module or "")] if isinstance(child, ast.ImportFrom) else [a.name for a in child.names]
                above = child.lineno - 1  # a comment line of its own, not the trailing comment of another statement
                reason = (any(n in reasons for n in range(child.lineno, child.end_lineno + 1))
                          or (above in reasons and lines[above - 1].lstrip().startswith("#")))
                for name in names:
                    top = name.split(".")[0]
                    own = name.startswith(".") or top in OWN
                    out.append((child.lineno, name, "stdlib" if top in sys.stdlib_module_names else "no reason" if own and not reason else "ok"))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(source), False)
    return out


PLANTED = """\
import json  # top level: anything goes
from rlhf_core import config


def f():
    import torch
    from rlhf_core.models import load
    # heavy: pulls in torch
    from rlhf_core.rl import step
    from stages import sft  # runs in the Ray actor only
    from flows import report  # noqa: F401
    import os
    from . import sibling
    x = 1  # a comment for this line, not for the import below
    from flows import pipeline
    from flows import (
        serve,  # optional: needs prefect
    )


class C:
    def m(self):
        from pathlib import Path
        from flows import promotion
"""


def test_function_imports_have_a_reason():
    """The check finds the planted ones, then none in rlhf_core/, stages/ or flows/."""
    flagged = [(line, name, verdict) for line, name, verdict in function_imports(PLANTED) if verdict != "ok"]
    assert flagged == [(7, "rlhf_core.models", "no reason"), (11, "flows", "no reason"), (12, "os", "stdlib"), (13, ".", "no reason"),
                       (15, "flows", "no reason"), (23, "pathlib", "stdlib"), (24, "flows", "no reason")], flagged
    root = Path(__file__).resolve().parents[1]
    scanned, problems = 0, []
    for f in sorted(p for pkg in OWN for p in (root / pkg).rglob("*.py")):
        for line, name, verdict in function_imports(f.read_text()):
            scanned += 1
            if verdict != "ok":
                problems.append(f"{f.relative_to(root)}:{line}: {name} ({verdict})")
    assert scanned > 20, "the scan does not see the tree"
    assert not problems, ("imports inside functions: a stdlib one goes at the top; one of ours goes at the top, or says why not "
                          f"(heavy, optional, runs in an actor only) on its line or the line above: {problems}")
