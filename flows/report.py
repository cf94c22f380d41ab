"""`rlhf pipeline report`: one static HTML page for the project's last run.

The stage DAG in order with each stage's state (trained, or not yet), its headline metrics and
its curves (inline SVG, no plotting library), then the promoted model: `champion.json`, the last
gate decisions and the lineage tree of the champion.  Files only (metrics.json,
train_history.jsonl, manifests): no Prefect, no torch, so it also runs on a copy pulled with
`dvc pull`.
"""
from __future__ import annotations

import contextlib
import html
import json
import math
import time
from pathlib import Path

import yaml

from rlhf_core import atomic, registry
from rlhf_core.artifacts.lineage import render

CURVES = ("train/loss", "train/reward_gold", "train/reward_proxy", "rl/kl", "rl/response_length")
"""History tags drawn per stage where it logs them (rl: gold vs proxy reward, the over-optimisation pair)."""
HEADLINE = ("eval/accuracy", "eval/loss", "eval/pair_accuracy", "eval/pair_accuracy_random", "eval/pass@4", "eval/rewards_accuracy")


def history(out: Path) -> list[dict]:
    path = out / "train_history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def series(rows: list[dict], tag: str) -> list[tuple[float, float]]:
    """(step, value) points of `tag`, finite values only."""
    return [(float(r.get("step", i + 1)), float(r[tag])) for i, r in enumerate(rows)
            if isinstance(r.get(tag), (int, float)) and math.isfinite(r[tag])]


def svg_chart(points: list[tuple[float, float]], title: str, width: int = 280, height: int = 120) -> str:
    """A line chart of `points` scaled into the box, with the value range and step range written
    beside it.  Example: [(1, 0), (2, 1)] -> a rising diagonal."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    pad = 8

    def sx(x: float) -> float:
        return pad + (x - x0) / ((x1 - x0) or 1.0) * (width - 2 * pad)

    def sy(y: float) -> float:
        return height - pad - (y - y0) / ((y1 - y0) or 1.0) * (height - 2 * pad)

    line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
    return (f'<figure><svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
            f'aria-label="{html.escape(title)}"><rect width="{width}" height="{height}" fill="#fafafa" stroke="#ccc"/>'
            f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{line}"/></svg>'
            f'<figcaption><code>{html.escape(title)}</code>: {ys[0]:.4g} → {ys[-1]:.4g} '
            f'(min {y0:.4g}, max {y1:.4g}; steps {x0:g}–{x1:g})</figcaption></figure>')


def stage_section(repo: Path, stage: str) -> str:
    out = repo / "artifacts" / ("base" if stage == "prepare" else stage)
    metrics_path = out / "metrics.json"
    if not metrics_path.exists():
        return f'<section id="{html.escape(stage)}"><h2>{html.escape(stage)} <span class="state missing">not run</span></h2></section>'
    metrics = json.loads(metrics_path.read_text())
    shown = [k for k in HEADLINE if k in metrics]
    rows = "".join(f"<tr><td><code>{k}</code></td><td>{_fmt(metrics.get(k + '_init'))}</td><td>{_fmt(metrics[k])}</td></tr>" for k in shown)
    table = f"<table><tr><th>metric</th><th>start</th><th>end</th></tr>{rows}</table>" if rows else ""
    rows_h = history(out)
    charts = "".join(svg_chart(pts, tag) for tag in CURVES if len(pts := series(rows_h, tag)) >= 2)
    manifest = out / "manifest.json"
    created = json.loads(manifest.read_text()).get("created_at", "") if manifest.exists() else "no manifest"
    return (f'<section id="{html.escape(stage)}"><h2>{html.escape(stage)} <span class="state done">trained</span> '
            f'<small>{html.escape(created)}</small></h2>{table}<div class="charts">{charts}</div></section>')


def _fmt(v) -> str:
    return "" if v is None else (f"{v:.4g}" if isinstance(v, float) else html.escape(str(v)))


def champion_section(repo: Path) -> str:
    home = repo / "artifacts" / "champion"
    pointer = home / "champion.json"
    if not pointer.exists():
        return "<section id=\"champion\"><h2>champion</h2><p>none promoted yet</p></section>"
    champion = json.loads(pointer.read_text())
    decisions = (home / "decisions.jsonl").read_text().splitlines()[-5:] if (home / "decisions.jsonl").exists() else []
    try:
        # the version directory holds the candidate's manifest; its inputs are paths relative to the project
        with contextlib.chdir(repo):
            tree = render(Path("artifacts/champion/current/model"))
    except (OSError, KeyError, ValueError) as e:  # a partial copy: say so instead of failing the report
        tree = f"lineage unavailable: {e}"
    return (f'<section id="champion"><h2>champion</h2><pre>{html.escape(json.dumps(champion, indent=2))}</pre>'
            f"<h3>last gate decisions</h3><pre>{html.escape(chr(10).join(decisions))}</pre>"
            f"<h3>lineage</h3><pre>{html.escape(tree)}</pre></section>")


def build(repo: str | Path) -> str:
    repo = Path(repo).resolve()
    params = (yaml.safe_load((repo / "params.yaml").read_text()) or {}) if (repo / "params.yaml").exists() else {}
    order = registry.dag(params)
    dag = " → ".join(f'<a href="#{html.escape(s)}">{html.escape(s)}</a>' for s in order)
    body = "".join(stage_section(repo, s) for s in order) + champion_section(repo)
    style = ("body{font-family:sans-serif;max-width:1100px;margin:auto}.charts{display:flex;flex-wrap:wrap;gap:12px}"
             "figure{margin:0}.state{font-size:60%;padding:2px 6px;border-radius:4px}.done{background:#cfc}.missing{background:#fcc}"
             "table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:2px 8px}")
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>alignment pipeline: {html.escape(repo.name)}</title>"
            f"<style>{style}</style></head><body><h1>alignment pipeline: {html.escape(str(repo))}</h1>"
            f"<p>generated {time.strftime('%Y-%m-%d %H:%M:%S')}; DAG: {dag}</p>{body}</body></html>")


def write(repo: str | Path, out: str | Path | None = None) -> Path:
    path = Path(out) if out else Path(repo) / "reports" / "pipeline.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path, build(repo))
    return path
