import subprocess
import sys

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
    import ast
    from pathlib import Path

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
    import ast
    from pathlib import Path

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
