"""Each stage's Prefect summary artifact: the metrics table and the stage's curves as sparklines."""
import json

import pytest

from flows.pipeline import _summary, sparkline

pytestmark = pytest.mark.unit


def test_sparkline_hand_values():
    assert sparkline([0, 1, 2, 3]) == "▁▃▆█"
    assert sparkline([5.0, 5.0]) == "▁▁"  # a flat series: the lowest block, not a division by zero
    assert sparkline([]) == ""
    assert len(sparkline(list(range(100)), width=40)) == 40  # averaged into at most `width` buckets


def test_summary_draws_the_rl_curves_it_finds(tmp_path):
    out = tmp_path / "artifacts" / "rl@rlhf"
    out.mkdir(parents=True)
    (out / "metrics.json").write_text(json.dumps({"eval/accuracy": 0.9}))
    rows = [{"step": i, "train/loss": 1.0 / i, "train/reward_gold": 0.1 * i, "train/reward_proxy": 0.2 * i, "rl/kl": float("nan")}
            for i in range(1, 9)]
    (out / "train_history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = _summary("rl@rlhf", tmp_path, "ran")
    assert "| `eval/accuracy` | 0.9 |" in md
    assert "| `train/reward_gold` | 0.1 → 0.8 | `▁▂▃▄▅▆▇█` |" in md
    assert "| `train/loss` | 1 → 0.125 | `█" in md and "`train/reward_proxy`" in md
    assert "rl/kl" not in md  # no finite value: no row
    # a stage without history (prepare) has the table only
    (out / "train_history.jsonl").unlink()
    assert "curves" not in _summary("rl@rlhf", tmp_path, "ran")


def test_pipeline_report_lists_the_dag_with_states_metrics_and_one_chart_per_curve(tmp_path):
    from flows.report import build, svg_chart

    (tmp_path / "params.yaml").write_text("rl_variants:\n  rlhf: {}\n  rlvr: {}\n")
    sft = tmp_path / "artifacts" / "sft"
    sft.mkdir(parents=True)
    (sft / "metrics.json").write_text(json.dumps({"eval/accuracy": 0.83, "eval/accuracy_init": 0.665, "train/loss": 0.2}))
    (sft / "train_history.jsonl").write_text("".join(json.dumps({"step": i, "train/loss": 1.0 / i}) + "\n" for i in range(1, 6)))
    rl = tmp_path / "artifacts" / "rl@rlhf"
    rl.mkdir(parents=True)
    (rl / "metrics.json").write_text(json.dumps({"eval/accuracy": 0.96}))
    (rl / "train_history.jsonl").write_text("".join(json.dumps({"step": i, "train/loss": 0.1, "train/reward_gold": 0.5 + i / 100,
                                                                 "train/reward_proxy": i / 10}) + "\n" for i in range(1, 4)))
    page = build(tmp_path)
    for stage in ("prepare", "pretrain", "sft", "rm", "dpo", "rl@rlhf", "rl@rlvr"):  # the whole DAG, in order
        assert f'<section id="{stage}">' in page, stage
    assert page.index('id="sft"') < page.index('id="rm"') < page.index('id="rl@rlvr"')
    assert page.count("not run") == 5 and page.count(">trained<") == 2
    assert "<td><code>eval/accuracy</code></td><td>0.665</td><td>0.83</td>" in page
    assert page.count("<svg") == 1 + 3  # sft: loss; rl@rlhf: loss, gold and proxy reward
    assert "none promoted yet" in page
    # the chart scales into its box: a rising line goes from the bottom-left to the top-right
    assert 'points="8.0,112.0 272.0,8.0"' in svg_chart([(1, 0.0), (2, 1.0)], "t")


@pytest.mark.integration
def test_dvc_plots_pages_for_a_stage_from_the_projects_dvc_yaml(tmp_path):
    """`dvc plots show` (the real CLI, on this project's dvc.yaml) draws rl@rlhf's own plot and the
    top-level gold-vs-proxy plot that reads the same file; an unreadable history says so."""
    import shutil
    import subprocess
    from pathlib import Path

    from flows.pipeline import dvc_plots, plot_targets

    shutil.copy(Path(__file__).parents[2] / "dvc.yaml", tmp_path / "dvc.yaml")
    subprocess.run(["dvc", "init", "-q", "--no-scm"], cwd=tmp_path, check=True)
    out = tmp_path / "artifacts" / "rl@rlhf"
    out.mkdir(parents=True)
    assert plot_targets("rl@rlhf", tmp_path) == [] and dvc_plots("rl@rlhf", tmp_path) == ""  # not trained yet: nothing to draw
    rows = [{"step": i, "rl/reward_mean": i / 10, "train/reward_proxy": i / 5, "train/reward_gold": i / 20} for i in range(1, 6)]
    (out / "train_history.json").write_text(json.dumps(rows))
    assert plot_targets("rl@rlhf", tmp_path) == ["artifacts/rl@rlhf/train_history.json", "rlhf_gold_vs_proxy"]
    md = dvc_plots("rl@rlhf", tmp_path)
    own, gold = tmp_path / "reports/plots/rl-rlhf/index.html", tmp_path / "reports/plots/rl-rlhf-rlhf-gold-vs-proxy/index.html"
    assert f"(file://{own})" in md and f"(file://{gold})" in md and "not drawn" not in md
    assert '"rl/reward_mean": 0.5' in own.read_text() and '"field": "train/reward_gold"' in gold.read_text()
    assert _summary("rl@rlhf", tmp_path, "ran", md).endswith(md)  # the links close the stage's summary artifact
    (out / "train_history.json").write_text("{broken")
    md = dvc_plots("rl@rlhf", tmp_path)
    assert md.count("not drawn") == 2 and "failed to load" in md and not own.exists()  # no stale page left behind
