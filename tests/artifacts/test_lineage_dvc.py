"""`lineage verify` cross-checks each manifest with what dvc.lock recorded."""
import hashlib

import pytest
import yaml

from rlhf_core.artifacts.lineage import verify_chain
from rlhf_core.artifacts.manifest import write_manifest

pytestmark = pytest.mark.unit


def test_manifest_must_match_dvc_lock(tmp_path):
    art = tmp_path / "artifacts" / "sft"
    (art / "model").mkdir(parents=True)
    (art / "model" / "w.bin").write_bytes(b"weights")
    write_manifest(art, stage="sft", config={}, config_sha256="0", inputs=[], metrics={})
    md5 = hashlib.md5((art / "manifest.json").read_bytes()).hexdigest()
    lock = {"schema": "2.0", "stages": {"sft": {"cmd": "rlhf stage run sft", "outs": [{"path": "artifacts/sft/manifest.json", "md5": md5}]}}}
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(lock))
    assert verify_chain(art / "model") == []
    lock["stages"]["sft"]["outs"][0]["md5"] = "0" * 32  # the artifact on disk is not the one DVC recorded
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(lock))
    problems = verify_chain(art / "model")
    assert len(problems) == 1 and "differs from what dvc.lock recorded for stage sft" in problems[0]
