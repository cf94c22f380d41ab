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
