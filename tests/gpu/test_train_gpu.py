"""The same sft job on a GPU worker (nccl, bf16).  Skipped without CUDA (conftest)."""
import json

import pytest

from conftest import rlhf

pytestmark = pytest.mark.gpu


def test_sft_on_gpu_learns(project, ray_head):
    proc = rlhf("stage", "run", "sft", "--params", "none.yaml", "--set", "sft.max_steps=30", "--set", "sft.gpus_per_worker=1",
                "--set", "sft.dtype=bfloat16", "--set", "sft.output_dir=artifacts/sft_gpu", cwd=project, env={"RAY_ADDRESS": ray_head})
    assert proc.returncode == 0, proc.stdout[-3000:]
    metrics = json.loads((project / "artifacts" / "sft_gpu" / "metrics.json").read_text())
    assert metrics["eval/loss"] < metrics["eval/loss_init"]
