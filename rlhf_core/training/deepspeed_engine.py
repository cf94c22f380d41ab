"""DeepSpeed engine setup: process group, optimizer, scheduler, ds_config (models load through
`rlhf_core.models.load`).

A torch AdamW is handed to `deepspeed.initialize` (DeepSpeed's own CPU Adam compiles C++ on
first use, 20-35 s on every fresh machine).  Gradient accumulation is DeepSpeed's *unmanaged*
mode: each `backward` only accumulates, and the caller's `step()` is the boundary that reduces
and updates.  That keeps the non-finite-loss skip exact: the ranks agree on every micro-batch's
loss before its backward, and a skipped step never reaches an optimizer update.
"""
from __future__ import annotations

import math
import os

import torch

from rlhf_core.runtime.rendezvous import tcp_store
from rlhf_core.training.config import TrainConfig


def init_distributed(rank: int, world_size: int, master: tuple[str, int], backend: str | None = None) -> None:
    """Set the env DeepSpeed reads without a launcher and join the process group at `master`
    (rank 0's node address and port, `runtime.actor.rendezvous_at`).  LOCAL_RANK is 0 on purpose:
    Ray gives each actor only its own GPU (CUDA_VISIBLE_DEVICES), which is device 0 inside it."""
    import deepspeed

    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    # the group joins through our own store, served on MASTER_ADDR only (env:// would make torch's,
    # which listens on every interface); DeepSpeed then finds the default group initialised
    from deepspeed.constants import default_pg_timeout

    store = tcp_store(master[0], master[1], world_size, is_master=rank == 0, timeout=default_pg_timeout)
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=default_pg_timeout)
    if backend == "gloo":
        # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op at every process-group
        # start: ~50-80 s of both cores whenever the build flags differ from the cached build, and a
        # build killed midway leaves a file lock on which every later worker waits forever (seen: all
        # stages hung in FileBaton.wait).  Only DeepSpeed's inference all-reduce uses that op;
        # training reduces through torch.distributed (gloo), so the op is skipped.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def ds_config(cfg: TrainConfig) -> dict:
    zero = {"stage": cfg.zero_stage}
    if cfg.offload in ("optimizer", "all"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if cfg.offload == "all":
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": -(-cfg.per_worker_batch // cfg.micro_batch),
        # the worker calls step() once per optimizer step, after all its micro-batches' backwards
        "managed_gradient_accumulation": False,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # ZeRO partitions our torch AdamW's state
        "zero_force_ds_cpu_optimizer": False,  # offload keeps the torch AdamW (DeepSpeed's CPU Adam is a C++ build)
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if cfg.dtype == "bfloat16":
        config["bf16"] = {"enabled": True}
    return config


def lr_lambda(cfg: TrainConfig):
    """Linear warmup, then cosine decay to min_lr_ratio (or constant)."""
    def fn(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / max(1, cfg.warmup_steps)
        if cfg.lr_scheduler == "constant":
            return 1.0
        progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return fn


def param_groups(model, weight_decay: float) -> list[dict]:
    """nanoGPT's split: weight decay on matrices (linear, embedding) only; norm gains and biases are
    not pulled towards 0 (decaying an RMSNorm gain shrinks the whole layer's input)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_engine(model, cfg: TrainConfig):
    import deepspeed

    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config(cfg))
    return engine
