"""Stage `prepare`: the task data and pretraining corpus in `data/`, the tiny base model in `artifacts/base/`.
With `modality=vision`: the shapes-counting task (PNG images in `data/images/`, rows that
reference them) and a tiny LLaVA VLM with its processor (issue 21).

Reads top to bottom: config, data (generate, write, validate), tokenizer + model, save, manifest.
At a user's site `sft.model_path` points at real weights and their own data replaces `data/`;
this stage is how the project runs end to end with nothing downloaded.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rlhf_core import atomic
from rlhf_core.artifacts.manifest import current_run_ids, input_record, write_manifest
from rlhf_core.config import config_hash, config_to_dict
from rlhf_core.data.corpus import CorpusConfig, build_corpus, check_corpus
from rlhf_core.data.io import load_rows, write_jsonl
from rlhf_core.data.shapes import ShapesConfig, generate_shapes
from rlhf_core.data.task import TaskConfig, generate_task
from rlhf_core.models.tiny import TinyModelConfig, build_model, build_tokenizer
from rlhf_core.models.tiny_vlm import TinyVLMConfig, build_vlm
from rlhf_core.training.entrypoint import stage_main

log = logging.getLogger("rlhf.prepare")

# split name -> (file in data/, schema kind for validation)
SPLITS = {"sft": ("sft.jsonl", "sft"), "pref": ("prefs.jsonl", "pref"), "rl": ("rl.jsonl", "rl"),
          "eval": ("eval.jsonl", "rl"), "eval_pref": ("eval_prefs.jsonl", "pref"),
          "eval_pref_random": ("eval_prefs_random.jsonl", "pref"), "pretrain": ("pretrain.jsonl", "text")}


@dataclass(frozen=True, kw_only=True)
class Config:
    seed: int = 0
    """Seeds the task generator and the model initialisation."""
    data_dir: str = "data"
    """Where the task data is written."""
    output_dir: str = "artifacts/base"
    """Where the base model and tokenizer are written."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The synthetic arithmetic task and its split sizes."""
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    """The pretraining corpus (data/pretrain.jsonl) written from the task."""
    model: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Size of the tiny Llama (with modality=vision: the VLM's language model)."""
    modality: Literal["text", "vision"] = "text"
    """text: the arithmetic task and a causal LM; vision: the shapes-counting task (images) and a
    tiny LLaVA VLM -- then `sft.model_path=artifacts/base` (no pretraining stage)."""
    shapes: ShapesConfig = field(default_factory=ShapesConfig)
    """The visual task (modality=vision)."""
    vision: TinyVLMConfig = field(default_factory=TinyVLMConfig)
    """The VLM's vision tower (modality=vision); its image_size must be the task's."""

    def __post_init__(self):
        if self.modality == "vision" and self.vision.image_size != self.shapes.image_size:
            raise ValueError(f"vision.image_size {self.vision.image_size} != shapes.image_size {self.shapes.image_size}")


MODEL_CARD = """---
library_name: transformers
tags: [rlhf-pipeline, tiny-llama, base]
---
# Tiny base model (stage `prepare`)

A randomly initialised {arch}-architecture causal LM ({params:,} parameters, {layers} layers,
hidden size {hidden}, head_dim 64) with a byte-level BPE tokenizer ({vocab} tokens) trained on the
synthetic arithmetic task (`Q: 37+58= A:` -> ` 95`). It knows nothing yet: the `pretrain` stage
trains it on `data/pretrain.jsonl`, then `sft` teaches the task.

* data: {data_dir}/ ({counts})
* config sha256: `{config_sha}`
* seed: {seed}

Load with `AutoModelForCausalLM.from_pretrained(path)` and `AutoTokenizer.from_pretrained(path)`.
See `manifest.json` for the exact inputs and file hashes.
"""


def write_data(cfg: Config) -> dict[str, list[dict]]:
    """Generate, write and validate every split; returns the validated rows per split."""
    splits = generate_task(cfg.task, cfg.seed)
    held_out = {r["prompt"].removeprefix("Q: ").removesuffix("= A:") for name in ("eval", "eval_pref") for r in splits[name]}
    splits["pretrain"] = build_corpus(cfg.task, cfg.corpus, held_out, cfg.seed)
    check_corpus(splits["pretrain"], held_out)  # like the split check: no held-out prompt in training text
    data_dir = Path(cfg.data_dir)
    validated = {}
    for name, (filename, kind) in SPLITS.items():
        write_jsonl(data_dir / filename, splits[name])
        # our own data goes through the same validation users' data does
        validated[name] = load_rows(data_dir / filename, kind, rejects_path=data_dir / "rejects" / filename, max_reject_ratio=0.0).rows
    return validated


def build_base(cfg: Config, splits: dict[str, list[dict]]) -> dict:
    """Train the tokenizer, build the model and save both atomically into `output_dir`."""
    counts = {name: len(rows) for name, rows in splits.items()}
    # training splits only: the tokenizer never sees held-out text
    corpus = [r["prompt"] + r.get("response", r.get("chosen", "")) for name in ("sft", "pref", "rl") for r in splits[name]]
    corpus += [r["text"] for r in splits["pretrain"]]
    tokenizer = build_tokenizer(corpus, cfg.model.vocab_size)
    model = build_model(cfg.model, tokenizer, cfg.seed)
    params = sum(p.numel() for p in model.parameters())

    out = Path(cfg.output_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    metrics = {"params": params, "vocab_size": len(tokenizer), **{f"rows/{k}": v for k, v in counts.items()}}
    (tmp / "README.md").write_text(MODEL_CARD.format(
        arch=cfg.model.arch, params=params, layers=cfg.model.num_layers, hidden=cfg.model.hidden_size, vocab=len(tokenizer),
        data_dir=cfg.data_dir, counts=", ".join(f"{k}: {v}" for k, v in counts.items()),
        config_sha=config_hash(cfg), seed=cfg.seed))
    (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
    atomic.replace_dir(tmp, out)
    return metrics


VISION_SPLITS = {"sft": ("sft.jsonl", "sft", "train"), "pref": ("prefs.jsonl", "pref", "train"), "rl": ("rl.jsonl", "rl", "rl"),
                 "eval": ("eval.jsonl", "rl", "eval")}


def vision_row(r: dict, kind: str, row: dict, max_count: int) -> dict:
    """The split's columns: sft the demonstration, pref the true count over a near miss (one more,
    or one less at the largest count -- what a miscount looks like), rl/eval the label."""
    if kind == "sft":
        return {**row, "response": r["response"]}
    if kind == "pref":
        k = int(r["label"])
        miss = k + 1 if k < max_count else k - 1
        return {**row, "chosen": f" {k}", "rejected": f" {miss}"}
    return {**row, "label": r["label"]}


def write_vision_data(cfg: Config) -> dict[str, list[dict]]:
    """The shapes task: every picture a PNG in data/images/, rows referencing it (path relative
    to the data dir, with its sha256) -- validated like users' image rows."""
    data_dir = Path(cfg.data_dir)
    shutil.rmtree(data_dir / "images", ignore_errors=True)
    (data_dir / "images").mkdir(parents=True)
    drawn = generate_shapes(cfg.shapes, cfg.seed)
    validated = {}
    for name, (filename, kind, split) in VISION_SPLITS.items():
        rows = []
        for r in drawn[split]:
            path = f"images/{r['id']}.png"
            (data_dir / path).write_bytes(r["image"])
            row = {"id": r["id"], "prompt": r["prompt"], "images": [path], "image_sha256": [hashlib.sha256(r["image"]).hexdigest()]}
            rows.append(vision_row(r, kind, row, cfg.shapes.max_count))
        write_jsonl(data_dir / filename, rows)
        validated[name] = load_rows(data_dir / filename, kind, rejects_path=data_dir / "rejects" / filename, max_reject_ratio=0.0).rows
    return validated


def build_vision_base(cfg: Config, splits: dict[str, list[dict]]) -> dict:
    """Tokenizer (trained on the training questions and answers), the tiny VLM and its processor."""
    tokenizer = build_tokenizer([r["prompt"] + r.get("response", "") for name in ("sft", "rl") for r in splits[name]], cfg.model.vocab_size)
    model, processor = build_vlm(cfg.vision, cfg.model, tokenizer, cfg.seed)
    out = Path(cfg.output_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    processor.save_pretrained(tmp)
    metrics = {"params": sum(p.numel() for p in model.parameters()), "vocab_size": len(tokenizer), "image_tokens": cfg.vision.image_tokens,
               **{f"rows/{k}": len(v) for k, v in splits.items()}}
    (tmp / "README.md").write_text(f"# Tiny VLM base (stage `prepare`, modality=vision)\n\nA randomly initialised LLaVA: CLIP vision tower "
                                   f"({cfg.vision.vision_layers} layers, width {cfg.vision.vision_hidden_size}) + Qwen3 language model "
                                   f"({metrics['params']:,} parameters in all), {cfg.vision.image_tokens} tokens per "
                                   f"{cfg.vision.image_size}px image. Load with `AutoModelForImageTextToText` and `AutoProcessor`.\n")
    (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
    atomic.replace_dir(tmp, out)
    return metrics


def run(cfg: Config) -> dict:
    t0 = time.time()
    splits = (write_vision_data if cfg.modality == "vision" else write_data)(cfg)
    counts = {name: len(rows) for name, rows in splits.items()}
    log.info("data: %s", ", ".join(f"{k}={v}" for k, v in counts.items()))
    task = cfg.shapes if cfg.modality == "vision" else cfg.task
    write_manifest(cfg.data_dir, stage="prepare-data", config=config_to_dict(task), config_sha256=config_hash(task),
                   inputs=[], metrics={f"rows/{k}": v for k, v in counts.items()}, seed=cfg.seed, run_ids=current_run_ids())
    metrics = (build_vision_base if cfg.modality == "vision" else build_base)(cfg, splits)
    write_manifest(cfg.output_dir, stage="prepare", config=config_to_dict(cfg), config_sha256=config_hash(cfg),
                   inputs=[input_record(cfg.data_dir)], metrics=metrics, seed=cfg.seed, run_ids=current_run_ids())
    log.info("base model: %s params, vocab %s -> %s (%.1fs)", f"{metrics['params']:,}", metrics["vocab_size"], cfg.output_dir, time.time() - t0)
    return metrics


def main(argv: list[str] | None = None) -> None:
    """Job entrypoint: `python -m stages.prepare --config resolved.json`."""
    stage_main(Config, "prepare", run, argv, needs_ray=False)


if __name__ == "__main__":
    main()
