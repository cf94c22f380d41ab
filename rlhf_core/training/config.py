"""Fields every training stage has; stage configs inherit and add their own (README: "Training stages")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model_path: str | None = None
    """Start model: a local HF dir (one that does not exist is an error, never a hub lookup) or a
    hub id written `hf://ORG/NAME[@REVISION]`; default: the upstream stage's `model/`."""
    train_data: str = ""
    """Training data: a local JSONL/Parquet file or HF datasets dir, or a hub dataset
    `hf://NAME[@REVISION][:SPLIT]` (split default `train`)."""
    eval_data: str = ""
    """Held-out eval data."""
    output_dir: str = ""
    """Default artifacts/STAGE."""
    max_steps: int = 100
    """Optimizer steps in total (a resumed run continues up to this)."""
    save_steps: int = 50
    """Checkpoint every N steps (and at the end)."""
    eval_steps: int = 0
    """Evaluate every N steps (0: only before and after training)."""
    log_steps: int = 10
    """Log a line every N steps."""
    seed: int = 0
    num_workers: int = 1
    """Data-parallel training workers (Ray actors), one DeepSpeed rank each."""
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How the workers' bundles (one per worker) go on the cluster's nodes (Ray placement groups):
    PACK fills a node first, STRICT_SPREAD puts every worker on a node of its own."""
    zero_stage: Literal[0, 1, 2, 3] = 0
    """DeepSpeed ZeRO stage."""
    global_batch_size: int = 32
    """Sequences per optimizer step over all workers."""
    micro_batch_size: int = 0
    """Sequences per forward/backward on one worker: each worker accumulates gradients over its
    share of the global batch in micro-batches of this size, then steps once (0: its whole share
    in one pass).  The update is the same either way -- losses are normalised by the global batch's
    counts -- with activation memory of one micro-batch."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in the backward instead of keeping them (transformers'
    gradient checkpointing): about a third more compute for activation memory of one layer."""
    lora_rank: int = 0
    """LoRA (peft): rank-r adapters on `lora_target_modules`, the base weights frozen (0: full
    fine-tuning).  `model/` holds the merged model (any engine loads it), `model/adapter/` the
    adapter with the base it belongs to; rl's reference is the base with the adapters switched off."""
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: str = "all-linear"
    """Comma-separated module names (`q_proj,v_proj`), or all-linear (every linear layer but the head)."""
    load_in_4bit: bool = False
    """QLoRA: the frozen base quantised to 4-bit NF4 under the LoRA adapters (bitsandbytes, CUDA only)."""
    offload: Literal["none", "optimizer", "all"] = "none"
    """ZeRO offload to CPU memory: the optimizer states (needs zero_stage >= 1), or those and the
    parameters (`all`, needs zero_stage 3).  For models that do not fit on the GPUs."""
    lr: float = 1e-3
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, on weight matrices only (not norm gains or biases); with the
    warmup + cosine schedule and clipping below, the recipe every stage starts from."""
    warmup_steps: int = 10
    lr_scheduler: Literal["cosine", "constant"] = "cosine"
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    max_len: int = 64
    """Max tokens of prompt + response; longer rows are rejected (counted) at load time."""
    max_chars: int = 4096
    input_key: str = "prompt"
    """The data's prompt column (OpenRLHF's --input_key), for train and eval data alike; the four
    below likewise name the response (sft), label (rl, eval), chosen and rejected (rm, dpo) columns.
    A row that has our own column name instead (`prompt`) is read as is."""
    output_key: str = "response"
    label_key: str = "label"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    max_reject_ratio: float = 0.05
    image_modes: str = "RGB,RGBA,L,P"
    """Image rows (`images` column): the PIL modes accepted (each is converted to RGB); an image in
    another mode (CMYK, 16-bit, float) is rejected with the reason, like a corrupt or missing one."""
    max_image_pixels: int = 2048 * 2048
    """Images with more pixels are rejected (a decompression bomb never gets decoded)."""
    max_image_bytes: int = 20 * 1024 * 1024
    image_root: str = ""
    """The directory image paths must resolve inside (`..` and symlinks followed): a row pointing
    elsewhere -- an absolute path, `../..`, a symlink out -- is rejected with the reason, like a
    missing image.  Empty: the data file's own directory (`data/images/` beside `data/*.jsonl`
    passes).  A hub dataset's (`hf://NAME`) image paths need it (relative to it)."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept on disk (older ones are deleted after a newer one is complete)."""
    resume: bool = True
    """Resume from checkpoints/latest when present; false wipes old checkpoints and starts over."""
    max_nan_steps: int = 5
    """Abort after this many consecutive steps with a non-finite loss (each is skipped and counted)."""
    report_to: str = "tensorboard"
    """Where step metrics go besides train_history.jsonl: `tensorboard`, `wandb` or both
    (`tensorboard,wandb`).  W&B runs under OUTPUT_DIR/wandb/ and takes the usual WANDB_* settings
    (WANDB_MODE=offline: nothing leaves the machine, `wandb sync` later); the API key reaches the
    job only when named: RLHF_FORWARD_ENV=WANDB_API_KEY."""
    wandb_project: str = "rlhf"
    trust_remote_code: bool = False
    """Run model code shipped with a hub model; off unless you trust it."""
    eval_max_new_tokens: int = 8
    eval_batch_size: int = 64
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights' dtype (bfloat16: weights, gradients and DeepSpeed's bf16 mode)."""
    mixed_precision: Literal["no", "bf16"] = "no"
    """bf16: the training forward under `torch.autocast(bfloat16)` with fp32 weights and optimizer
    (about 1.5x faster on this CPU's AMX units for the tiny model); evals stay in fp32."""

    def __post_init__(self):
        if self.global_batch_size % self.num_workers:
            raise ValueError(f"global_batch_size {self.global_batch_size} must divide evenly over num_workers {self.num_workers}")
        if self.max_steps < 1 or self.save_steps < 1:
            raise ValueError("max_steps and save_steps must be >= 1")
        if self.micro_batch_size < 0:
            raise ValueError(f"micro_batch_size must be >= 0 (0: no gradient accumulation), not {self.micro_batch_size}")
        unknown = set(self.report_to.split(",")) - {"tensorboard", "wandb"}
        if unknown:
            raise ValueError(f"report_to: unknown {sorted(unknown)}; use tensorboard, wandb or tensorboard,wandb")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0: full fine-tuning), not {self.lora_rank}")
        if self.lora_rank and self.zero_stage == 3:
            raise ValueError("lora_rank with zero_stage=3 is not supported: the adapters are small, use zero_stage <= 2")
        if self.load_in_4bit and not (self.lora_rank and self.gpus_per_worker > 0):
            raise ValueError("load_in_4bit (QLoRA) trains LoRA adapters over a 4-bit base: it needs lora_rank > 0 and GPUs "
                             "(gpus_per_worker > 0; bitsandbytes' 4-bit kernels are CUDA-only)")
        if self.offload == "optimizer" and self.zero_stage < 1 or self.offload == "all" and self.zero_stage != 3:
            need = "zero_stage >= 1" if self.offload == "optimizer" else "zero_stage=3"
            raise ValueError(f"offload={self.offload} needs {need} (ZeRO holds what it offloads); zero_stage is {self.zero_stage}")

    @property
    def per_worker_batch(self) -> int:
        return self.global_batch_size // self.num_workers

    @property
    def micro_batch(self) -> int:
        """Sequences per forward/backward on one worker."""
        return min(self.micro_batch_size or self.per_worker_batch, self.per_worker_batch)
