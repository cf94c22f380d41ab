"""The stage registry is the one list of stages: dvc.yaml, the CLI, the job runner and the flow
follow it, and each DVC stage depends on exactly the code it runs."""
import ast
from pathlib import Path

import pytest
import yaml

from rlhf_core import registry

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rlhf_core", "stages")


def _dvc_stages() -> dict[str, dict]:
    """dvc.yaml's stages with `foreach` expanded: name (NAME@KEY for a variant) -> stage."""
    out = {}
    for name, st in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].items():
        if "foreach" not in st:
            out[name] = st
            continue
        for key, item in st["foreach"].items():
            text = yaml.safe_dump(st["do"]).replace("${key}", key)
            for k, v in item.items():
                text = text.replace("${item.%s}" % k, str(v))
            out[f"{name}@{key}"] = yaml.safe_load(text)
    return out


def _file(module: str) -> Path | None:
    base = ROOT / module.replace(".", "/")
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.exists():
            return p
    return None


def _imports(path: Path) -> set[str]:
    """Modules of this project that `path` imports anywhere (function-local imports included:
    Ray actors and lazy imports are code the stage runs too)."""
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}  # `from pkg import module`
    return {m for m in out if m.split(".")[0] in PACKAGES and _file(m)}


def import_closure(module: str) -> set[Path]:
    """Every file of this project that `module` imports, transitively."""
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        f = _file(m)
        parents = [".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)]  # importing a.b.c runs a and a.b
        if f is None or f in seen:
            continue
        seen.add(f)
        todo += list(_imports(f)) + parents
    return {f.relative_to(ROOT) for f in seen}


def test_dvc_yaml_runs_the_registry_in_order():
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    stages = _dvc_stages()
    assert list(stages) == registry.dag(params)
    for name, st in stages.items():
        assert st["cmd"] == ("rlhf prepare" if name == "prepare" else f"rlhf stage run {name}"), name
    assert registry.candidates(params) == ["sft", "dpo", "rl@rlhf", "rl@rlvr"]


def test_dvc_deps_cover_exactly_the_code_each_stage_runs():
    """Each stage's deps name every file its module imports (so a change to that code reruns it)
    and nothing of rlhf_core it does not import (so editing the CLI reruns nothing)."""
    for name, st in _dvc_stages().items():
        deps = [Path(d) for d in st["deps"]]
        code = {f for f in import_closure(registry.get(name).module) if (ROOT / f).stat().st_size}  # empty __init__.py: no code
        missing = [str(f) for f in code if not any(f == d or d in f.parents for d in deps)]
        assert not missing, f"dvc.yaml {name}: deps miss {missing}"
        unused = [str(d) for d in deps if d.parts[0] in PACKAGES and not any(f == d or d in f.parents for f in code)]
        assert not unused, f"dvc.yaml {name}: deps {unused} hold no code the stage imports"
        cli = Path("rlhf_core/cli.py")
        assert cli not in code, f"{name} imports the CLI"
        assert not any(d == cli or d in cli.parents for d in deps), f"dvc.yaml {name}: editing the CLI would rerun it"


def test_import_closure_sees_function_local_imports():
    """The closure must follow imports inside functions (actors, heavy libraries), or a dep would
    be missed: rl starts its rollout workers from inside `Roles.__init__`."""
    assert Path("rlhf_core/rollout/workers.py") in import_closure("stages.rl")
    assert Path("rlhf_core/training/worker.py") in import_closure("stages.sft")


def test_get_names_the_valid_stages():
    assert registry.get("rl@rlhf").module == "stages.rl"
    with pytest.raises(KeyError, match="valid stages: prepare, pretrain"):
        registry.get("ppo")


def test_cli_and_jobs_read_the_registry(tmp_path, monkeypatch):
    """`rlhf stage run` rejects an unknown stage naming the registry's; the job entrypoint is the
    registry's module."""
    from rlhf_core import cli
    from rlhf_core.runtime import jobs

    with pytest.raises(SystemExit, match="valid stages: prepare, pretrain, sft, rm, dpo, rl"):
        cli._stage_module("nope")
    seen = {}

    class Client:
        def submit_job(self, **kw):
            seen.update(kw)
            return kw["submission_id"]

    cfg = tmp_path / "c.json"
    cfg.write_text("{}")
    jobs._submit(Client(), "rl@rlvr", cfg, {}, "sub-1")
    assert " -m stages.rl --config " in seen["entrypoint"]


def test_every_engine_is_selectable_and_speaks_the_engine_interface():
    """Adding an engine = a class in rollout/engines.py + its ENGINES entry + its name in
    `RolloutConfig.engine`'s Literal (`rl.rollout.engine`); the rollout worker constructs each with the same settings."""
    import inspect
    import typing

    from rlhf_core.rollout.config import RolloutConfig
    from rlhf_core.rollout.engines import ENGINES

    assert set(typing.get_args(typing.get_type_hints(RolloutConfig)["engine"])) == set(ENGINES)
    settings = dict(max_model_len=64, seed=0, dtype="float32", gpu_memory_utilization=0.05, enable_sleep_mode=False, trust_remote_code=False)
    for name, cls in ENGINES.items():
        inspect.signature(cls).bind("model", **settings)  # TypeError names the setting an engine does not take
        for method in ("generate", "update_weights", "sleep", "wake_up"):
            assert callable(getattr(cls, method, None)), f"engine {name} lacks {method}()"
