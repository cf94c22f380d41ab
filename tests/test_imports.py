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
