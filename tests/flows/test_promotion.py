"""The promotion gate on real files: best candidate by gold accuracy, atomic switch, a crash between
copy and switch leaves the old champion whole."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows import promotion

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


def make_stage(root: Path, stage: str, acc: float, weights: bytes) -> None:
    art = root / "artifacts" / stage
    (art / "model").mkdir(parents=True, exist_ok=True)
    (art / "model" / "model.safetensors").write_bytes(weights)
    (art / "metrics.json").write_text(json.dumps({"eval/accuracy": acc}))
    (art / "manifest.json").write_text(json.dumps({"stage": stage, "weights": weights.decode()}))


def champion(root: Path) -> tuple[dict, bytes]:
    home = root / "artifacts" / "champion"
    return json.loads((home / "champion.json").read_text()), (home / "model" / "model.safetensors").read_bytes()


def test_best_candidate_is_promoted_then_unchanged_then_refused(tmp_path):
    make_stage(tmp_path, "sft", 0.60, b"sft")
    make_stage(tmp_path, "rl@rlhf", 0.85, b"rlhf")
    make_stage(tmp_path, "rl@rlvr", 0.80, b"rlvr")
    stages = ["sft", "dpo", "rl@rlhf", "rl@rlvr"]  # dpo never ran: not a candidate
    d = promotion.gate(tmp_path, stages, margin=0.0)
    assert d["decision"] == "promoted" and d["candidate"] == "artifacts/rl@rlhf/model", d
    assert d["candidates"] == {"sft": 0.6, "dpo": None, "rl@rlhf": 0.85, "rl@rlvr": 0.8}
    pointer, weights = champion(tmp_path)
    assert pointer["source"] == "artifacts/rl@rlhf" and weights == b"rlhf"
    assert promotion.gate(tmp_path, stages, margin=0.0)["decision"] == "unchanged"
    make_stage(tmp_path, "rl@rlhf", 0.70, b"rlhf-worse")  # a rerun made it worse: rlvr is now the best
    d = promotion.gate(tmp_path, stages, margin=0.01)
    assert d["decision"] == "refused" and d["candidate"] == "artifacts/rl@rlvr/model" and "champion kept" in d["reason"]
    assert champion(tmp_path)[1] == b"rlhf"
    decisions = [json.loads(x)["decision"] for x in (tmp_path / "artifacts" / "champion" / "decisions.jsonl").read_text().splitlines()]
    assert decisions == ["promoted", "unchanged", "refused"]


def test_crash_between_copy_and_switch_keeps_the_old_champion_whole(tmp_path):
    make_stage(tmp_path, "sft", 0.5, b"old")
    promotion.gate(tmp_path, ["sft"], margin=0.0)
    make_stage(tmp_path, "sft", 0.9, b"new")
    code = f"from pathlib import Path; from flows import promotion; promotion.gate(Path({str(tmp_path)!r}), ['sft'], 0.0)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "RLHF_FAULT": "sigkill_at:promotion"})
    assert proc.returncode == -9, proc.stderr[-2000:]  # it died mid-promotion
    pointer, weights = champion(tmp_path)
    assert weights == b"old" and pointer["eval/accuracy"] == 0.5  # whole and consistent
    home = tmp_path / "artifacts" / "champion"
    assert len(list((home / "versions").iterdir())) == 2  # the new copy is complete but not current
    d = promotion.gate(tmp_path, ["sft"], margin=0.0)  # the next run completes it and cleans up
    assert d["decision"] == "promoted" and champion(tmp_path)[1] == b"new"
    assert [p.name for p in (home / "versions").iterdir()] == [Path(os.readlink(home / "current")).name]


def test_a_champion_from_before_versioning_is_kept_then_replaced(tmp_path):
    home = tmp_path / "artifacts" / "champion"
    (home / "model").mkdir(parents=True)
    (home / "model" / "model.safetensors").write_bytes(b"legacy")
    (home / "champion.json").write_text(json.dumps({"eval/accuracy": 0.4, "manifest_sha256": "x"}))
    make_stage(tmp_path, "sft", 0.3, b"worse")
    assert promotion.gate(tmp_path, ["sft"], 0.0)["decision"] == "refused"
    assert champion(tmp_path)[1] == b"legacy"
    make_stage(tmp_path, "sft", 0.5, b"better")
    assert promotion.gate(tmp_path, ["sft"], 0.0)["decision"] == "promoted"
    assert champion(tmp_path)[1] == b"better" and (home / "model").is_symlink()
