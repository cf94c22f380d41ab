"""A data-parallel training worker: one DeepSpeed rank, run as a Ray actor.

The driver (a stage's `main`, itself the Ray job) owns the data and the loop; workers own the
model.  Stage-specific maths arrives as a function `loss_fn(model, batch, counts) -> (loss, stats)`
(pickled by reference from the stage module), so this class is the same for sft, rm and dpo.
"""
from __future__ import annotations

import contextlib
import hashlib
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from rlhf_core.models import lora
from rlhf_core.models.load import load_model
from rlhf_core.rollout.hf_engine import greedy_generate
from rlhf_core.runtime import faults
from rlhf_core.runtime.actor import PeakMemory
from rlhf_core.runtime.weight_sync import Layout, WeightGroup, flatten
from rlhf_core.training.checkpoint import CheckpointLoadError, explain
from rlhf_core.training.config import TrainConfig
from rlhf_core.training.deepspeed_engine import build_engine, init_distributed


class TrainWorker(PeakMemory):
    def __init__(self, rank: int, world_size: int, master: tuple[str, int], model_path: str, model_kind: str, cfg: TrainConfig,
                 pad_token_id: int | None = None):
        self.rank, self.world_size, self.cfg = rank, world_size, cfg
        torch.set_num_threads(max(1, int(cfg.cpus_per_worker)))
        torch.manual_seed(cfg.seed + rank)
        random.seed(cfg.seed + rank)
        np.random.seed(cfg.seed + rank)
        init_distributed(rank, world_size, master)
        model = load_model(model_path, model_kind, cfg.dtype, cfg.trust_remote_code, load_in_4bit=cfg.load_in_4bit)
        if cfg.load_in_4bit:
            from peft import prepare_model_for_kbit_training

            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing)
        elif cfg.gradient_checkpointing:
            # non-reentrant: works under ZeRO-3's parameter hooks and with inputs that need no grad
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.lora_rank:
            model = lora.add_lora(model, model_kind, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)
        if pad_token_id is not None and getattr(model.config, "pad_token_id", None) is None:
            model.config.pad_token_id = pad_token_id  # sequence classification finds the last token by it
        self.engine = build_engine(model, cfg)

    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.engine.device) if torch.is_tensor(v) else v for k, v in batch.items()}

    # --- memory (the hybrid engine: rl.offload_trainer) ---------------------------------------

    def offload_states(self) -> None:
        """Weights, gradients and optimizer state to CPU memory (DeepSpeed ZeRO, GPUs)."""
        self.engine.offload_states()

    def reload_states(self) -> None:
        self.engine.reload_states()

    # --- training -------------------------------------------------------------------------

    def train_step(self, batches: list[dict], loss_fn, counts: dict) -> dict:
        """One optimizer step on this rank's shard, given as micro-batches: gradients accumulate
        over them (each loss is already normalised by the global batch's counts, so they add up),
        then one `step()` reduces over ranks and updates.  Every rank holds the same number of
        micro-batches; if any rank's loss is non-finite, every rank stops there, drops what it
        accumulated and skips the update (no collective is left half done)."""
        faults.hang("train_step")
        self.engine.train()
        total, stats, rows = 0.0, {}, 0
        for batch in batches:
            # bf16 matmuls over fp32 weights and optimizer state (CPUs with AMX and GPUs run them
            # several times faster); the loss functions upcast logits to fp32 themselves
            with torch.autocast(torch.device(self.engine.device).type, dtype=torch.bfloat16, enabled=self.cfg.mixed_precision == "bf16"):
                loss, micro_stats = loss_fn(self.engine, self._to_device(batch), counts)
            if faults.armed("nan_loss") is not None:  # fault injection for the reliability tests
                loss = loss * float("nan")
            faults.slow_step()
            finite = torch.tensor([1.0 if torch.isfinite(loss).all() else 0.0], device=loss.device)
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
            if finite.item() == 0.0:
                self.engine.zero_grad()
                return {"skipped": 1.0, "loss": float("nan")}
            # DeepSpeed averages gradients over ranks; the loss is normalised by global counts, so
            # scaling by world_size makes the update equal to the single-process one
            self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
            n = len(batch["input_ids"])
            total, rows = total + float(loss.detach()), rows + n
            for k, v in micro_stats.items():  # per-batch means: weighted by the micro-batch's rows
                stats[k] = stats.get(k, 0.0) + float(v) * n
        self.engine.step()
        out = {k: v / max(1, rows) for k, v in stats.items()}
        out.update(loss=total, skipped=0.0, lr=self.engine.get_lr()[0])
        grad_norm = self.engine.get_global_grad_norm()  # None where DeepSpeed does not track it (ZeRO-0)
        if grad_norm is not None:
            out["grad_norm"] = float(grad_norm)
        return out

    @torch.no_grad()
    def evaluate(self, batches: list[dict], eval_fn) -> list:
        """`eval_fn(model, batch) -> list` over batches, concatenated (forward only)."""
        self.engine.eval()
        out = []
        for batch in batches:
            out.extend(eval_fn(self.engine.module, self._to_device(batch)))
        return out

    @torch.no_grad()
    def evaluate_base(self, batches: list[dict], eval_fn) -> list:
        """`evaluate` with the LoRA adapters switched off: the base model (rl's reference)."""
        with self.engine.module.disable_adapter():
            return self.evaluate(batches, eval_fn)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, pad_token_id: int, eos_token_id: int, batch_size: int,
                 pixels: list | None = None) -> list[list[int]]:
        """Greedy continuations (token ids, without the prompt), left-padded batches; `pixels`:
        per prompt its images' pixel values (a VLM's image rows)."""
        self.engine.eval()
        return greedy_generate(self.engine.module, prompts, max_new_tokens, pad_token_id, eos_token_id, batch_size, pixels)

    # --- state ----------------------------------------------------------------------------

    def save_checkpoint(self, tmp_dir: str) -> None:
        """Engine (model, optimizer, scheduler) via DeepSpeed, plus this rank's RNG states."""
        self.engine.save_checkpoint(str(Path(tmp_dir) / "engine"), tag="state", save_latest=False)
        name, keys, pos, has_gauss, cached = np.random.get_state()
        rng = {"torch": torch.get_rng_state(), "python": list(random.getstate()),
               "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached]}
        torch.save(rng, Path(tmp_dir) / f"rng_rank{self.rank}.pt")
        dist.barrier()

    def load_checkpoint(self, ckpt_dir: str) -> None:
        """Engine and RNG states of a checkpoint; any failure is a `CheckpointLoadError` naming
        the checkpoint and why (DeepSpeed's own are often bare asserts)."""
        try:
            path, _ = self.engine.load_checkpoint(str(Path(ckpt_dir) / "engine"), tag="state", load_optimizer_states=True,
                                                  load_lr_scheduler_states=True)
            if path is None:
                raise RuntimeError("DeepSpeed found no engine state in it")
            rng = torch.load(Path(ckpt_dir) / f"rng_rank{self.rank}.pt", weights_only=True)
            torch.set_rng_state(rng["torch"])
            version, state, gauss = rng["python"]
            random.setstate((version, tuple(state), gauss))
            name, keys, pos, has_gauss, cached = rng["numpy"]
            np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        except Exception as e:
            raise CheckpointLoadError(f"checkpoint {ckpt_dir} could not be loaded (rank {self.rank}): {explain(e)}") from e

    def save_model(self, out_dir: str) -> None:
        """HF format (safetensors) from rank 0; ZeRO-3 parameters are gathered first; LoRA: the
        merged model, and the adapter in `adapter/`."""
        if self.cfg.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.engine.module.parameters()), modifier_rank=None):
                if self.rank == 0:
                    self.engine.module.save_pretrained(out_dir, safe_serialization=True)
        elif self.rank == 0 and lora.is_lora(self.engine.module):
            lora.save_merged(self.engine.module, out_dir)
        elif self.rank == 0:
            self.engine.module.save_pretrained(out_dir, safe_serialization=True)
        dist.barrier()

    @torch.no_grad()
    def _with_full_weights(self, fn):
        """`fn(named weights)` on rank 0, the live tensors (HF names; LoRA: merged), with ZeRO-3's
        shards gathered for the call -- every rank must call this; the others return None."""
        module = self.engine.module
        gathered = contextlib.nullcontext()
        if self.cfg.zero_stage == 3:
            import deepspeed

            gathered = deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
        with gathered:
            if self.rank != 0:
                return None
            weights = lora.merged_state_dict(module) if lora.is_lora(module) else module.state_dict()  # engines hold plain HF weights
            return fn(list(weights.items()))

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The full weights as CPU tensors, for a weight sync through Ray's object store."""
        return self._with_full_weights(lambda named: [(k, v.detach().cpu().clone()) for k, v in named]) or []

    # --- weight sync over a collective (rl.rollout.weight_sync=collective; rank 0 is the sender) ---------

    def weight_layout(self) -> Layout | None:
        self.layout = self._with_full_weights(Layout.of)
        return self.layout

    def join_weight_group(self, host: str, port: int, world_size: int, timeout_s: float, backend: str) -> None:
        self.weight_group = WeightGroup(host, port, 0, world_size, timeout_s, backend)

    def broadcast_weights(self) -> None:
        """Rank 0 broadcasts the weights to the engines (every rank calls: ZeRO-3 gathers)."""
        self._with_full_weights(lambda named: self.weight_group.broadcast(flatten(named, self.layout)))

    def params_finite(self) -> bool:
        return all(torch.isfinite(p).all() for p in self.engine.module.parameters())

    def state_fingerprint(self) -> str:
        """sha256 over all parameters (exact-resume tests compare these)."""
        h = hashlib.sha256()
        for name, p in sorted(self.engine.module.state_dict().items()):
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()
