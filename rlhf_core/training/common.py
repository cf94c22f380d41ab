"""Driver-side helpers the training stages share: tokenizer, data, eval, card, manifest, main()."""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
from pathlib import Path

from rlhf_core import atomic
from rlhf_core.artifacts.manifest import current_run_ids, hash_tree, input_record, write_manifest
from rlhf_core.config import config_hash, config_to_dict, from_dict, restore_secrets
from rlhf_core.data.images import ImageRules, VisionInputs, image_files, shown_path, with_images
from rlhf_core.data.io import DataError, load_rows, write_jsonl
from rlhf_core.data.tokenize import chat_ids, pad_batch, prompt_ids, prompt_response, tokenize_rows
from rlhf_core.evaluation import exact_match_accuracy
from rlhf_core.models import load as models_load
from rlhf_core.runtime import stage_lock
from rlhf_core.runtime.env import SECRETS_FILE, read_secrets_file
from rlhf_core.training.config import TrainConfig

log = logging.getLogger("rlhf.stage")


def load_tokenizer(cfg: TrainConfig):
    return models_load.load_tokenizer(cfg.model_path, cfg.trust_remote_code)


def load_vision(cfg: TrainConfig) -> VisionInputs | None:
    """The start model's image side if it is a vision-language model, else None."""
    if not models_load.is_vision_model(cfg.model_path, cfg.trust_remote_code):
        return None
    return VisionInputs(models_load.load_processor(cfg.model_path, cfg.trust_remote_code))


def prompt_formatter(tokenizer, use_chat_template: bool, vision: VisionInputs | None = None):
    """row -> prompt token ids, optionally through the tokenizer's chat template; a row with
    `images` goes through the VLM's processor (an error for a text-only model)."""
    if use_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("use_chat_template is set but the tokenizer has no chat template")
    if use_chat_template:
        text = lambda row: chat_ids(tokenizer, [{"role": "user", "content": row["prompt"]}]) if "prompt" in row else prompt_ids(tokenizer, row)  # noqa: E731
    else:
        text = lambda row: prompt_ids(tokenizer, row)  # noqa: E731

    def fmt(row: dict) -> list[int]:
        if not row.get("images"):
            return text(row)
        if vision is None:
            raise ValueError("the data has image rows (an `images` column) but model_path is not a vision-language model")
        if use_chat_template:
            raise ValueError("use_chat_template with image rows is not supported yet: write the prompt with its <image> placeholders")
        return vision.prompt_ids(row["prompt"], row["images"])
    return fmt


def response_text(row: dict) -> str:
    return row["response"] if "response" in row else row["messages"][-1]["content"]


def load_data(path: str, kind: str, cfg: TrainConfig, rejects_path: Path) -> list[dict]:
    keys = {"prompt": cfg.input_key, "response": cfg.output_key, "label": cfg.label_key, "chosen": cfg.chosen_key, "rejected": cfg.rejected_key}
    images = ImageRules(tuple(cfg.image_modes.split(",")), cfg.max_image_pixels, cfg.max_image_bytes, cfg.image_root)
    result = load_rows(path, kind, rejects_path=rejects_path, max_chars=cfg.max_chars, max_reject_ratio=cfg.max_reject_ratio, keys=keys,
                       image_rules=images)
    if result.num_rejected:
        log.warning("%s: %d of %d rows rejected (%s); see %s", path, result.num_rejected, result.num_total, dict(result.reasons), rejects_path)
    return result.rows


def check_too_long(rejects: list[dict], total: int, cfg: TrainConfig, path: Path) -> None:
    """Rows over max_len tokens are rejected with a reason, counted, and fail the load above the ratio."""
    write_jsonl(path, rejects, ensure_ascii=True)
    if rejects:
        log.warning("%d of %d rows over max_len=%d tokens rejected; see %s", len(rejects), total, cfg.max_len, path)
    if total and len(rejects) / total > cfg.max_reject_ratio:
        raise DataError(f"{len(rejects)} of {total} rows are over max_len={cfg.max_len} tokens, "
                        f"above max_reject_ratio={cfg.max_reject_ratio}; see {path}")


class Collate:
    """Padded batches; with `vision`, also the `pixel_values` of the examples' images in order."""

    def __init__(self, pad_id: int, keys=("input_ids", "loss_mask"), vision: VisionInputs | None = None):
        self.pad_id, self.keys, self.vision = pad_id, keys, vision

    def __call__(self, examples: list[dict]) -> dict:
        batch = pad_batch(examples, self.pad_id, self.keys)
        if self.vision is not None:
            batch["pixel_values"] = self.vision.pixel_values([ref for e in examples for ref in e.get("images", ())])
        return batch


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


def data_fingerprint(cfg: TrainConfig) -> str:
    """Everything that fixes which sample lands in which step; a change makes resume unsafe."""
    hub = cfg.train_data.startswith(models_load.HUB_PREFIX)  # by name and revision: pin `@REVISION` to resume safely
    parts = {"train": cfg.train_data if hub else hash_tree(cfg.train_data), "seed": cfg.seed, "batch": cfg.global_batch_size,
             "max_len": cfg.max_len}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def model_card(stage: str, cfg: TrainConfig, metrics: dict, what: str) -> str:
    rows = "\n".join(f"| `{k}` | {v:.4g} |" if isinstance(v, float) else f"| `{k}` | {v} |" for k, v in sorted(metrics.items()))
    return (f"---\nlibrary_name: transformers\ntags: [rlhf-pipeline, {stage}]\n---\n# `{stage}` model\n\n{what}\n\n"
            f"* start model: `{cfg.model_path}`\n* train data: `{cfg.train_data}`\n* eval data: `{cfg.eval_data}`\n"
            f"* steps: {cfg.max_steps}, global batch {cfg.global_batch_size}, lr {cfg.lr}, seed {cfg.seed}, "
            f"{cfg.num_workers} worker(s), ZeRO stage {cfg.zero_stage}\n* config sha256: `{config_hash(cfg)}`\n\n"
            f"| metric | value |\n|---|---|\n{rows}\n\nSee `../manifest.json` for exact inputs and file hashes.\n")


def image_records(rows: list[dict]) -> list[dict]:
    """Lineage records of the image files `rows` reference (one per directory, each file's sha256
    as validated at load), so `rlhf lineage verify` catches a changed picture like a changed row."""
    by_dir: dict[str, dict[str, str]] = {}
    for path, digest in sorted(image_files(rows).items()):
        by_dir.setdefault(shown_path(str(Path(path).parent)), {})[Path(path).name] = digest
    return [{"path": d, "kind": "data", "files": files} for d, files in by_dir.items()]


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


def stage_main(cls, section: str, run, argv: list[str] | None = None, needs_ray: bool = True) -> None:
    """`python -m stages.STAGE --config resolved.json`: the Ray job entrypoint.  A training stage
    takes its output directory's lock first (`runtime/stage_lock.py`): one writer per directory."""
    parser = argparse.ArgumentParser(prog=f"python -m stages.{section}")
    parser.add_argument("--config", required=True, help="resolved config JSON written by `rlhf stage run`")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)
    raw = Path(args.config).read_bytes()
    data = json.loads(raw)
    # the file has credentials redacted; `rlhf stage run` passed the real ones in a 0600 file
    # (runtime/env.py), with any secret variables the job was asked to forward
    secrets = read_secrets_file()
    os.environ.update(secrets["env"])
    cfg = from_dict(cls, restore_secrets(data.get("config", data), secrets["config"]), prefix=f"{section}.")
    output_dir = getattr(cfg, "output_dir", None) if needs_ray else None  # prepare writes data/ and base/ in-process
    if output_dir:
        try:
            stage_lock.acquire(output_dir, section)
        except stage_lock.StageLocked as e:  # the reason, not a traceback, is what the user needs
            print(f"rlhf: {e}", file=sys.stderr, flush=True)
            raise SystemExit(3) from None
        expected = os.environ.get("RLHF_CONFIG_SHA256")
        if expected and hashlib.sha256(raw).hexdigest() != expected:
            # another `rlhf stage run` on this directory rewrote the file before we held the lock
            stage_lock.release(output_dir)
            raise RuntimeError(f"{args.config} is not the config this job was submitted with: another `rlhf stage run` on "
                               f"{output_dir} replaced it. One writer per output directory; rerun when that run is done.")
    try:
        if not needs_ray:
            run(cfg)
            return
        import ray

        ray.init(address="auto" if os.environ.get("RAY_ADDRESS") else None, logging_level=logging.WARNING)
        try:
            run(cfg)
        finally:
            ray.shutdown()
    finally:
        if output_dir:
            stage_lock.release(output_dir)
        if os.environ.get(SECRETS_FILE):  # read by now (driver and actors): gone with the job
            Path(os.environ[SECRETS_FILE]).unlink(missing_ok=True)


# --- preference pairs (rm, dpo) -------------------------------------------------------------


def tokenize_pair(tokenizer, prompt: list[int], row: dict, max_len: int) -> dict:
    """{chosen: {input_ids, loss_mask}, rejected: {...}, num_tokens}; TooLong if either is over."""
    chosen = prompt_response(tokenizer, prompt, row["chosen"], max_len)
    rejected = prompt_response(tokenizer, prompt, row["rejected"], max_len)
    return {"chosen": chosen, "rejected": rejected, "num_tokens": len(chosen["input_ids"]) + len(rejected["input_ids"])}


class CollatePairs:
    """Pairs -> one padded batch: the B chosen sequences, then the B rejected ones.  Extra
    per-pair float fields (e.g. reference log-probs) become `(B,)` tensors; with `vision`, the
    pairs' pictures as `pixel_values` in the same layout (a pair's picture twice).  With
    `shared_prefix` (text models), also the packed forward inputs in which a pair's two sequences
    share one copy of their prompt (`shared_prefix.pack_rows`; the forward reads them through
    `shared_prefix.model_logits`)."""

    def __init__(self, pad_id: int, extra: tuple[str, ...] = (), vision: VisionInputs | None = None, shared_prefix: bool = False):
        self.pad_id, self.extra, self.vision = pad_id, extra, vision
        self.shared_prefix = shared_prefix and vision is None

    def __call__(self, pairs: list[dict]) -> dict:
        import torch

        from rlhf_core.models.shared_prefix import PACK_MAX_LEN, pack_rows

        sequences = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
        batch = pad_batch(sequences, self.pad_id)
        if self.shared_prefix:  # the prompt: the tokens before the loss mask's first 1
            prompt_len = [e["loss_mask"].index(1) if 1 in e["loss_mask"] else len(e["loss_mask"]) for e in sequences]
            batch.update(pack_rows([e["input_ids"] for e in sequences], prompt_len, self.pad_id, PACK_MAX_LEN) or {})
        if self.vision is not None:
            refs = [ref for p in pairs for ref in p.get("images", ())]
            batch["pixel_values"] = self.vision.pixel_values(refs + refs)
        for key in self.extra:
            batch[key] = torch.tensor([p[key] for p in pairs], dtype=torch.float32)
        return batch


def count_pairs(batch: list[dict]) -> dict:
    return {"num_pairs": len(batch)}


def load_pairs(path: str, cfg: TrainConfig, tokenizer, fmt, rejects_dir: Path, name: str) -> list[dict]:
    """Validated, tokenized preference pairs (with their rows' image references); over-long ones
    are rejected and counted."""
    rows = load_data(path, "pref", cfg, rejects_dir / f"{name}.jsonl")
    pairs, too_long = tokenize_rows(rows, lambda r: with_images(tokenize_pair(tokenizer, fmt(r), r, cfg.max_len), r), cfg.max_len)
    check_too_long(too_long, len(rows), cfg, rejects_dir / f"{name}_too_long.jsonl")
    return pairs


def split_pairs(values) -> list[tuple[float, float]]:
    """A `(2B,)` tensor laid out chosen-then-rejected -> B (chosen, rejected) tuples."""
    b = values.shape[0] // 2
    return list(zip(values[:b].tolist(), values[b:].tolist()))


def batches(collate, examples: list[dict], size: int) -> list[dict]:
    return [collate(examples[i:i + size]) for i in range(0, len(examples), size)]
