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
                "--set", "rl.gpus_per_worker=1", "--set", "rl.rollout.engine_sleep=true", "--set", "rl.rollout.gpu_memory_utilization=0.2",
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
                "--set", "rl.max_steps=4", "--set", "rl.gpus_per_worker=1", "--set", "rl.rollout.engine_sleep=true",
                "--set", "rl.rollout.engine_sleep_level=2",
                "--set", "rl.offload_trainer=true", "--set", "rl.zero_stage=1", "--set", "rl.rollout.gpu_memory_utilization=0.2",
                "--set", "rl.output_dir=artifacts/rl_gpu_hybrid", cwd=project, env={"RAY_ADDRESS": ray_head})
    assert proc.returncode == 0, proc.stdout[-3000:]
    metrics = json.loads((project / "artifacts" / "rl_gpu_hybrid" / "metrics.json").read_text())
    assert metrics["eval/sync_greedy_match"] == 1.0 and metrics["train/steps"] == 4


def _sft(project, ray_head, out: str, *extra: str):
    proc = rlhf("stage", "run", "sft", "--params", "none.yaml", "--set", "sft.max_steps=30", "--set", "sft.gpus_per_worker=1",
                "--set", f"sft.output_dir={out}", *extra, cwd=project, env={"RAY_ADDRESS": ray_head})
    assert proc.returncode == 0, proc.stdout[-3000:]
    return json.loads((project / out / "metrics.json").read_text())


def test_rl_separate_layout_every_role_on_the_gpu(project, ray_head):
    """layout=separate on one GPU shared out: trainer 0.4, engine, reference and reward model 0.2
    each -- the reference and the reward model compute on their GPU share (they stayed on the CPU).
    rl.rollout.weight_sync=collective: trainer and engine share the GPU, so the broadcast falls back to gloo."""
    _sft(project, ray_head, "artifacts/sft_gpu_sep")
    rm = rlhf("stage", "run", "rm", "--params", "none.yaml", "--set", "rm.model_path=artifacts/sft_gpu_sep/model", "--set", "rm.max_steps=10",
              "--set", "rm.gpus_per_worker=1", "--set", "rm.output_dir=artifacts/rm_gpu", cwd=project, env={"RAY_ADDRESS": ray_head})
    assert rm.returncode == 0, rm.stdout[-3000:]
    proc = rlhf("stage", "run", "rl", "--params", "none.yaml", "--set", "rl.model_path=artifacts/sft_gpu_sep/model", "--set", "rl.max_steps=3",
                "--set", "rl.rollout.layout=separate", "--set", "rl.gpus_per_worker=0.4", "--set", "rl.rollout.gpus=0.2",
                "--set", "rl.reward.model=artifacts/rm_gpu/model", "--set", "rl.rollout.gpu_memory_utilization=0.1",
                "--set", "rl.rollout.weight_sync=collective",
                "--set", "rl.output_dir=artifacts/rl_gpu_sep", cwd=project, env={"RAY_ADDRESS": ray_head})
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "broadcasts to 1 engine(s) over gloo" in proc.stdout
    assert json.loads((project / "artifacts" / "rl_gpu_sep" / "metrics.json").read_text())["eval/sync_greedy_match"] == 1.0


def test_nccl_weight_broadcast_between_two_gpus(project, ray_head):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("an NCCL weight group needs the trainer and the engine on GPUs of their own")
    _sft(project, ray_head, "artifacts/sft_gpu_nccl")
    proc = rlhf("stage", "run", "rl", "--params", "none.yaml", "--set", "rl.model_path=artifacts/sft_gpu_nccl/model", "--set", "rl.max_steps=3",
                "--set", "rl.rollout.layout=separate", "--set", "rl.gpus_per_worker=1", "--set", "rl.rollout.gpus=1",
                "--set", "rl.rollout.weight_sync=collective",
                "--set", "rl.rollout.gpu_memory_utilization=0.2",
                "--set", "rl.output_dir=artifacts/rl_gpu_nccl", cwd=project, env={"RAY_ADDRESS": ray_head})
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "broadcasts to 1 engine(s) over nccl" in proc.stdout
    assert json.loads((project / "artifacts" / "rl_gpu_nccl" / "metrics.json").read_text())["eval/sync_greedy_match"] == 1.0


def test_lora_rl_and_qlora_sft_on_the_gpu(project, ray_head):
    """LoRA rl colocated with vLLM (the engine gets merged weights: greedy output equal to the
    trainer's), and QLoRA sft (4-bit NF4 base, bitsandbytes) learning and saving a merged model."""
    _sft(project, ray_head, "artifacts/sft_gpu_lora_base")
    proc = rlhf("stage", "run", "rl", "--params", "none.yaml", "--set", "rl.model_path=artifacts/sft_gpu_lora_base/model",
                "--set", "rl.max_steps=3", "--set", "rl.gpus_per_worker=1", "--set", "rl.lora_rank=8", "--set", "rl.lr=1e-3",
                "--set", "rl.rollout.gpu_memory_utilization=0.2",
                "--set", "rl.output_dir=artifacts/rl_gpu_lora", cwd=project, env={"RAY_ADDRESS": ray_head})
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert json.loads((project / "artifacts" / "rl_gpu_lora" / "metrics.json").read_text())["eval/sync_greedy_match"] == 1.0
    m = _sft(project, ray_head, "artifacts/sft_gpu_qlora", "--set", "sft.lora_rank=8", "--set", "sft.load_in_4bit=true", "--set", "sft.lr=1e-2",
             "--set", "sft.mixed_precision=bf16")
    assert m["eval/loss"] < m["eval/loss_init"]
    assert (project / "artifacts" / "sft_gpu_qlora" / "model" / "adapter" / "adapter_config.json").exists()


def test_vllm_tensor_parallel_engine(project, ray_head):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("tensor parallel needs 2 GPUs")
    _sft(project, ray_head, "artifacts/sft_gpu_tp")
    proc = rlhf("stage", "run", "rl", "--params", "none.yaml", "--set", "rl.model_path=artifacts/sft_gpu_tp/model", "--set", "rl.max_steps=2",
                "--set", "rl.rollout.layout=separate", "--set", "rl.gpus_per_worker=0", "--set", "rl.rollout.gpus=2",
                "--set", "rl.rollout.tensor_parallel=2", "--set", "rl.rollout.gpu_memory_utilization=0.2",
                "--set", "rl.output_dir=artifacts/rl_gpu_tp", cwd=project, env={"RAY_ADDRESS": ray_head})
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert json.loads((project / "artifacts" / "rl_gpu_tp" / "metrics.json").read_text())["eval/sync_greedy_match"] == 1.0
