"""The `alignment-pipeline` Prefect flow: one task per stage, each run through DVC.

Prefect only (never imports torch).  DVC decides what runs: a task calls `dvc repro -s STAGE`,
which skips a stage whose code, data, params and upstream outputs are unchanged (the task then
completes as "skipped"), and reruns a failed or interrupted stage, which resumes from its own
checkpoints.  The Prefect run ids reach the stage's manifest through the environment.

After the last stage, the promotion gate (`flows/promotion.py`) compares the candidate's
`eval/accuracy` with the current champion's.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
from pathlib import Path

import yaml
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import deployment, flow_run, task_run
from prefect.states import Completed, State

from flows import promotion, report
from flows.overrides import allowed_from_env, check_overrides, check_repo, renamed_key
from rlhf_core import atomic, registry
from rlhf_core.runtime.cluster import shared_head


class StageFailed(RuntimeError):
    pass


def _dvc(args: list[str], repo: Path, env: dict | None = None, stream: bool = False) -> subprocess.CompletedProcess:
    cmd = ["dvc", *args]
    if not stream:
        return subprocess.run(cmd, cwd=repo, capture_output=True, text=True, env={**os.environ, **(env or {})})
    logger = get_run_logger()
    # own process group: if this flow run is cancelled or crashes, the whole stage (dvc ->
    # rlhf stage run -> its Ray job) is told to stop instead of running on as an orphan
    proc = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})},
                            start_new_session=True)
    tail: list[str] = []
    try:
        for line in proc.stdout:
            line = line.rstrip()
            tail = (tail + [line])[-60:]
            if line and "it/s]" not in line and "step/s]" not in line:  # progress bars stay in the stage logs
                logger.info(line)
        proc.wait()
    except BaseException:
        _stop_group(proc)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, "\n".join(tail), "")


def _stop_group(proc: subprocess.Popen, grace: float = 60.0) -> None:
    """SIGTERM the stage's process group (`rlhf stage run` stops its Ray job on it), then SIGKILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stage_changed(stage: str, repo: Path) -> bool:
    """True if `dvc repro -s STAGE` would run it (changed deps/params/outs, or never run)."""
    proc = _dvc(["status", "--json", stage], repo)
    if proc.returncode:
        raise StageFailed(f"dvc status {stage} failed: {proc.stderr.strip()[-2000:]}")
    return bool(json.loads(proc.stdout or "{}"))


def _key(stage: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes): `rl@rlhf` -> `rl-rlhf`."""
    return stage.replace("@", "-").replace("_", "-").lower()


SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 40) -> str:
    """A one-line chart: `values` averaged into at most `width` buckets, each drawn as one of 8
    block heights between the series' min and max.  Example: [0, 1, 2, 3] -> '▁▃▆█'."""
    if not values:
        return ""
    n = min(width, len(values))
    buckets = [values[i * len(values) // n:(i + 1) * len(values) // n] for i in range(n)]
    means = [sum(b) / len(b) for b in buckets]
    lo, hi = min(means), max(means)
    span = (hi - lo) or 1.0
    return "".join(SPARKS[min(7, int((m - lo) / span * 7 + 0.5))] for m in means)


def _curves(out: Path) -> str:
    """Markdown rows `tag | first -> last | sparkline` from the stage's train_history.jsonl."""
    rows = report.history(out)
    lines = [f"| `{tag}` | {pts[0][1]:.4g} → {pts[-1][1]:.4g} | `{sparkline([v for _, v in pts])}` |"
             for tag in report.CURVES if (pts := report.series(rows, tag))]
    return ("\n## curves (per step)\n\n| tag | first → last | curve |\n|---|---|---|\n" + "\n".join(lines) + "\n") if lines else ""


def plot_targets(stage: str, repo: Path) -> list[str]:
    """What `dvc plots show` draws for a stage: its history file (the stage's own `plots:` in
    dvc.yaml) and every top-level plot whose y reads that file (rl@rlhf's gold vs proxy reward)."""
    history = f"artifacts/{stage}/train_history.json"
    if not (repo / history).exists():
        return []
    spec = yaml.safe_load((repo / "dvc.yaml").read_text()) if (repo / "dvc.yaml").exists() else {}
    tops = [pid for entry in (spec or {}).get("plots") or [] if isinstance(entry, dict)
            for pid, plot in entry.items() if isinstance(plot, dict) and history in (plot.get("y") or {})]
    return [history, *tops]


def dvc_plots(stage: str, repo: Path) -> str:
    """Render the stage's `dvc plots` to reports/plots/<key>[-<plot id>]/index.html (one page per
    target: given a file and a plot id together, DVC draws only the latter) and return markdown
    lines linking them, or saying why one is missing (a failure to draw never fails the stage)."""
    lines, repo = [], repo.resolve()
    for target in plot_targets(stage, repo):
        dest = repo / "reports" / "plots" / (_key(stage) + ("" if target.endswith(".json") else f"-{_key(target)}"))
        shutil.rmtree(dest, ignore_errors=True)
        dest.parent.mkdir(parents=True, exist_ok=True)  # dvc creates the last level only
        proc = _dvc(["plots", "show", target, "-o", str(dest)], repo)
        said = (proc.stderr + proc.stdout).strip()
        index = dest / "index.html"
        if proc.returncode or "failed to load" in said or not index.exists():  # DVC exits 0 on an unreadable file
            why = next((x for x in said.splitlines() if "failed" in x or "ERROR" in x), said.splitlines()[-1] if said else "no index.html")
            logging.getLogger(__name__).warning("%s: dvc plots show %s failed (exit %s): %s", stage, target, proc.returncode, why)
            lines.append(f"dvc plots `{target}`: not drawn (exit {proc.returncode}: {why})")
            shutil.rmtree(dest, ignore_errors=True)  # DVC writes a page without the plot: none is clearer
        else:  # DVC's page loads Vega from its CDN; offline, `dvc plots show --json` has the same data
            lines.append(f"dvc plots `{target}`: [`{index.relative_to(repo)}`](file://{index.resolve()})")
    return "".join(f"\n{line}\n" for line in lines)


def _summary(stage: str, repo: Path, status: str, plots: str = "") -> str:
    out = repo / "artifacts" / ("base" if stage == "prepare" else stage)
    metrics = json.loads((out / "metrics.json").read_text()) if (out / "metrics.json").exists() else {}
    rows = "\n".join(f"| `{k}` | {v:.4g} |" if isinstance(v, float) else f"| `{k}` | {v} |" for k, v in sorted(metrics.items()))
    manifest = out / "manifest.json"
    return (f"# stage `{stage}`: {status}\n\nmanifest: [`{manifest}`](file://{manifest.resolve()})\n\n"
            f"| metric | value |\n|---|---|\n{rows or '| (none) | |'}\n{_curves(out)}{plots}")


@task(retries=1, retry_delay_seconds=5, task_run_name="{stage}")
def run_stage(stage: str, repo: str, push: bool = True):
    """One stage through DVC; skipped when unchanged; pushes its outputs to the DVC remote."""
    logger = get_run_logger()
    root = Path(repo)
    if not stage_changed(stage, root):
        logger.info("%s: unchanged, skipped", stage)
        create_markdown_artifact(key=f"{_key(stage)}-summary", markdown=_summary(stage, root, "skipped (unchanged)", dvc_plots(stage, root)),
                                 description=f"{stage} (skipped)")
        return Completed(message=f"{stage}: unchanged, skipped", data={"stage": stage, "ran": False})
    env = {"RLHF_PREFECT_FLOW_RUN_ID": str(flow_run.id or ""), "RLHF_PREFECT_TASK_RUN_ID": str(task_run.id or "")}
    proc = _dvc(["repro", "-s", stage], root, env, stream=True)
    if proc.returncode:
        raise StageFailed(f"stage {stage} failed (dvc repro -s {stage} exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    if push and has_remote(root):
        pushed = _dvc(["push", stage], root)
        if pushed.returncode:
            raise StageFailed(f"dvc push {stage} failed: {pushed.stderr.strip()[-2000:]}")
    create_markdown_artifact(key=f"{_key(stage)}-summary", markdown=_summary(stage, root, "ran", dvc_plots(stage, root)),
                             description=f"{stage} (ran)")
    return {"stage": stage, "ran": True}


def has_remote(repo: Path) -> bool:
    return bool(_dvc(["remote", "list"], repo).stdout.strip())


def ensure_remote(repo: Path) -> None:
    """A local directory remote by default (`.dvc/remote`, machine-local config)."""
    if not has_remote(repo):
        _dvc(["remote", "add", "--local", "-d", "local", ".dvc/remote"], repo)  # run from the repo root


def apply_overrides(repo: Path, overrides: list[str]) -> None:
    """`SECTION.KEY=VALUE` overrides written into params.yaml (comments kept), so DVC sees them
    (`dvc params diff`) and reruns exactly the stages that read them."""
    if not overrides:
        return
    from ruamel.yaml import YAML

    yaml = YAML()
    path = repo / "params.yaml"
    data = yaml.load(path.read_text()) if path.exists() else {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise ValueError(f"override {item!r} must look like SECTION.KEY=VALUE")
        # written under an old name beside a params.yaml holding the new one, the stage would refuse both
        if (new := renamed_key(key)) != key:
            logging.getLogger(__name__).warning("%s is now %s", key, new)
        node, *parts = new.split(".")
        cur = data.setdefault(node, {})
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
        cur[parts[-1]] = yaml.load(value) if value else value

    def dump(tmp: Path) -> None:
        with open(tmp, "w") as f:
            yaml.dump(data, f)  # ruamel: comments kept; it writes to a stream only
    atomic.write_with(path, dump)  # a kill mid-write keeps the old params.yaml, never half of it


def _value(result):
    """A task that returned a State (skipped stages complete with a message) hands back that state."""
    return result.result() if isinstance(result, State) else result


@contextlib.contextmanager
def repo_lock(repo: Path):
    """One pipeline writer per repository: a second run is refused with a clear message."""
    path = repo / ".dvc" / "tmp" / "pipeline.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise RuntimeError(f"another pipeline run holds {path} ({f.read().strip() or 'unknown'}); "
                               "runs on one repository are serialised: wait for it or stop it") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} flow run {flow_run.id}\n")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@flow(name="alignment-pipeline", log_prints=True)
def alignment_pipeline(stages: list[str] | None = None, overrides: list[str] | None = None, repo: str = ".",
                       promote: bool = True, promotion_margin: float = 0.0, push: bool = True, retries: int = 1) -> dict:
    """Run the DVC pipeline stage by stage.  `stages`: which to run (default all, in DAG order);
    `overrides`: `SECTION.KEY=VALUE` params; `repo`: the project directory (the data location is
    its `data/`, a DVC-tracked output of `prepare`); `retries`: per stage, for transient failures
    (a retried stage resumes from its checkpoint).  From a deployment, overrides naming code or
    paths outside the repository are refused (`flows/overrides.py`; `rlhf serve --allow-override`)."""
    root = Path(repo).resolve()
    from_deployment = bool(deployment.id)
    check_repo(root, from_deployment)  # before anything is read or written (the lock file included)
    check_overrides(overrides, root, from_deployment, allowed_from_env())

    # the lock comes first: a second run is refused before it reads (or rewrites) anything
    with repo_lock(root):
        params = yaml.safe_load((root / "params.yaml").read_text()) or {}
        order = registry.dag(params)  # DAG order, variants expanded (rl -> rl@rlhf, rl@rlvr)
        chosen = [s for s in order if s in (stages or order)]
        unknown = set(stages or []) - set(order)
        if unknown:
            raise ValueError(f"unknown stages {sorted(unknown)}; valid: {order}")
        apply_overrides(root, overrides or [])
        if push:
            ensure_remote(root)
        task = run_stage.with_options(retries=retries)
        results = {}
        with shared_head():  # one Ray head for every stage of the run
            for stage in order:  # in DAG order, each after the one before finished
                results[stage] = _value(task(stage, str(root), push)) if stage in chosen else None
        # the candidates: every policy the DAG trains; the gate picks by gold eval/accuracy
        candidates = registry.candidates(params)
        decision = promotion.gate(root, candidates, promotion_margin, str(flow_run.id or "")) if promote and chosen else None
    return {"stages": results, "promotion": decision}
