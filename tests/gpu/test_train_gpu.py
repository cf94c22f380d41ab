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


def test_rl_colocated_vllm_on_gpu_with_sleep(project, ray_head):
    """GRPO with the GPU vLLM build, colocated on one GPU: the engine sleeps during updates and
    the in-place weight sync keeps its greedy output equal to the trainer's."""
    sft = rlhf("stage", "run", "sft", "--params", "none.yaml", "--set", "sft.max_steps=30", "--set", "sft.gpus_per_worker=1",
               "--set", "sft.output_dir=artifacts/sft_gpu_rl", cwd=project, env={"RAY_ADDRESS": ray_head})
    assert sft.returncode == 0, sft.stdout[-3000:]
    proc = rlhf("stage", "run", "rl", "--params", "none.yaml", "--set", "rl.model_path=artifacts/sft_gpu_rl/model", "--set", "rl.max_steps=4",
                "--set", "rl.gpus_per_worker=1", "--set", "rl.engine_sleep=true", "--set", "rl.gpu_memory_utilization=0.2",
                "--set", "rl.output_dir=artifacts/rl_gpu", cwd=project, env={"RAY_ADDRESS": ray_head})
    assert proc.returncode == 0, proc.stdout[-3000:]
    metrics = json.loads((project / "artifacts" / "rl_gpu" / "metrics.json").read_text())
    assert metrics["eval/sync_greedy_match"] == 1.0


def test_rl_hybrid_engine_level2_sleep_and_trainer_offload(project, ray_head):
    """The colocated hybrid engine on one GPU: vLLM sleeps at level 2 during updates (weights and
    KV cache freed; the weight sync rewrites them), DeepSpeed ZeRO-1 moves the policy's states to
    CPU memory while vLLM generates.  The engine must still hold exactly the trainer's weights."""
    sft = rlhf("stage", "run", "sft", "--params", "none.yaml", "--set", "sft.max_steps=30", "--set", "sft.gpus_per_worker=1",
               "--set", "sft.output_dir=artifacts/sft_gpu_hybrid", cwd=project, env={"RAY_ADDRESS": ray_head})
    assert sft.returncode == 0, sft.stdout[-3000:]
    proc = rlhf("stage", "run", "rl", "--params", "none.yaml", "--set", "rl.model_path=artifacts/sft_gpu_hybrid/model",
                "--set", "rl.max_steps=4", "--set", "rl.gpus_per_worker=1", "--set", "rl.engine_sleep=true", "--set", "rl.engine_sleep_level=2",
                "--set", "rl.offload_trainer=true", "--set", "rl.zero_stage=1", "--set", "rl.gpu_memory_utilization=0.2",
                "--set", "rl.output_dir=artifacts/rl_gpu_hybrid", cwd=project, env={"RAY_ADDRESS": ray_head})
    assert proc.returncode == 0, proc.stdout[-3000:]
    metrics = json.loads((project / "artifacts" / "rl_gpu_hybrid" / "metrics.json").read_text())
    assert metrics["eval/sync_greedy_match"] == 1.0 and metrics["train/steps"] == 4
