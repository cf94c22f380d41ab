"""What a training stage reports: eval accuracy through the trainers, the model card, and
`finish` (metrics.json, the history as JSON for `dvc plots`, manifest.json with every input)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from rlhf_core import atomic
from rlhf_core.artifacts.manifest import current_run_ids, input_record, write_manifest
from rlhf_core.config import config_hash, config_to_dict
from rlhf_core.data.images import VisionInputs
from rlhf_core.evaluation import exact_match_accuracy
from rlhf_core.models import load as models_load
from rlhf_core.training.config import TrainConfig

log = logging.getLogger("rlhf.stage")


def eval_pixels(vision: VisionInputs | None, rows: list[dict]) -> list | None:
    """Per eval row its images' pixel values (None for a row without), for `eval_accuracy`."""
    return None if vision is None else vision.per_prompt([r.get("images") for r in rows])


def eval_accuracy(group, tokenizer, prompts: list[list[int]], labels: list[str], cfg: TrainConfig, pixels: list | None = None) -> dict:
    """`eval/accuracy`: greedy completion (up to EOS), cut at newline, stripped, == label.
    `pixels`: per prompt its images' pixel values (VLM eval rows), or None."""
    outs = group.call_rank0("generate", prompts, cfg.eval_max_new_tokens, tokenizer.pad_token_id, tokenizer.eos_token_id, cfg.eval_batch_size,
                            pixels)
    texts = [tokenizer.decode(o, skip_special_tokens=True) for o in outs]
    return {"eval/accuracy": exact_match_accuracy(texts, labels)}


def model_card(stage: str, cfg: TrainConfig, metrics: dict, what: str) -> str:
    rows = "\n".join(f"| `{k}` | {v:.4g} |" if isinstance(v, float) else f"| `{k}` | {v} |" for k, v in sorted(metrics.items()))
    return (f"---\nlibrary_name: transformers\ntags: [rlhf-pipeline, {stage}]\n---\n# `{stage}` model\n\n{what}\n\n"
            f"* start model: `{cfg.model_path}`\n* train data: `{cfg.train_data}`\n* eval data: `{cfg.eval_data}`\n"
            f"* steps: {cfg.max_steps}, global batch {cfg.global_batch_size}, lr {cfg.lr}, seed {cfg.seed}, "
            f"{cfg.num_workers} worker(s), ZeRO stage {cfg.zero_stage}\n* config sha256: `{config_hash(cfg)}`\n\n"
            f"| metric | value |\n|---|---|\n{rows}\n\nSee `../manifest.json` for exact inputs and file hashes.\n")


def finish(out_dir: Path, stage: str, cfg: TrainConfig, metrics: dict, extra_inputs: tuple = (), records: list[dict] = ()) -> None:
    """metrics.json + manifest.json (checkpoints/ excluded: they carry their own checksums).
    `extra_inputs`: further files/dirs the result depends on (reward model, reward/agent code);
    `records`: ready lineage records (`image_records`)."""
    atomic.write_json(out_dir / "metrics.json", metrics)
    history = out_dir / "train_history.jsonl"
    if history.exists():  # `dvc plots` reads JSON (a list of rows), not JSON lines
        rows = [json.loads(line) for line in history.read_text().splitlines() if line.strip()]
        atomic.write_text(out_dir / "train_history.json", json.dumps(rows))
    paths = [str(p) for p in (cfg.model_path, cfg.train_data, cfg.eval_data, *extra_inputs) if p]
    # a hub model or dataset (`hf://NAME[@REVISION]`) is recorded by name: nothing local to hash
    records_of_paths = [{"path": p, "kind": "hub"} if p.startswith(models_load.HUB_PREFIX) else input_record(p)
                        for p in paths if p.startswith(models_load.HUB_PREFIX) or Path(p).exists()]
    inputs = list({r["path"]: r for r in records_of_paths}.values())  # train and eval data often share one artifact
    inputs += [r for r in records if r["path"] not in {i["path"] for i in inputs}]  # an artifact's manifest already covers its files
    write_manifest(out_dir, stage=stage, config=config_to_dict(cfg), config_sha256=config_hash(cfg), inputs=inputs,
                   metrics=metrics, seed=cfg.seed, run_ids=current_run_ids())
    log.info("%s done: %s", stage, json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in sorted(metrics.items())}))
