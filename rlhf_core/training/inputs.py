"""A training stage's inputs, on the driver: the tokenizer and a VLM's image side, prompt formatting,
validated data rows and preference pairs (rejects counted, over-long rows refused above the ratio),
the data fingerprint a resume checks, and the image files' lineage records."""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from rlhf_core.artifacts.manifest import hash_tree
from rlhf_core.data.images import ImageRules, VisionInputs, image_files, shown_path, with_images
from rlhf_core.data.io import DataError, load_rows, write_jsonl
from rlhf_core.data.tokenize import chat_ids, prompt_ids, prompt_response, tokenize_rows
from rlhf_core.models import load as models_load
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


def data_fingerprint(cfg: TrainConfig) -> str:
    """Everything that fixes which sample lands in which step; a change makes resume unsafe."""
    hub = cfg.train_data.startswith(models_load.HUB_PREFIX)  # by name and revision: pin `@REVISION` to resume safely
    parts = {"train": cfg.train_data if hub else hash_tree(cfg.train_data), "seed": cfg.seed, "batch": cfg.global_batch_size,
             "max_len": cfg.max_len}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def image_records(rows: list[dict]) -> list[dict]:
    """Lineage records of the image files `rows` reference (one per directory, each file's sha256
    as validated at load), so `rlhf lineage verify` catches a changed picture like a changed row."""
    by_dir: dict[str, dict[str, str]] = {}
    for path, digest in sorted(image_files(rows).items()):
        by_dir.setdefault(shown_path(str(Path(path).parent)), {})[Path(path).name] = digest
    return [{"path": d, "kind": "data", "files": files} for d, files in by_dir.items()]


def tokenize_pair(tokenizer, prompt: list[int], row: dict, max_len: int) -> dict:
    """{chosen: {input_ids, loss_mask}, rejected: {...}, num_tokens}; TooLong if either is over."""
    chosen = prompt_response(tokenizer, prompt, row["chosen"], max_len)
    rejected = prompt_response(tokenizer, prompt, row["rejected"], max_len)
    return {"chosen": chosen, "rejected": rejected, "num_tokens": len(chosen["input_ids"]) + len(rejected["input_ids"])}


def load_pairs(path: str, cfg: TrainConfig, tokenizer, fmt, rejects_dir: Path, name: str) -> list[dict]:
    """Validated, tokenized preference pairs (with their rows' image references); over-long ones
    are rejected and counted."""
    rows = load_data(path, "pref", cfg, rejects_dir / f"{name}.jsonl")
    pairs, too_long = tokenize_rows(rows, lambda r: with_images(tokenize_pair(tokenizer, fmt(r), r, cfg.max_len), r), cfg.max_len)
    check_too_long(too_long, len(rows), cfg, rejects_dir / f"{name}_too_long.jsonl")
    return pairs
