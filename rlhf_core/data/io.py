"""Load user data (JSONL, Parquet, HF `datasets` directories, hub datasets) and validate every row.

Where (`train_data`, `eval_data`, `rlhf data check PATH`): a data path is local -- a `.jsonl`,
a `.parquet`, or a directory written by `datasets`' `save_to_disk` -- and one that does not exist
is an error, never a hub lookup.  A hub dataset is asked for explicitly (OpenRLHF's `--dataset`):

  hf://NAME[@REVISION][:SPLIT]   datasets.load_dataset(NAME, split=SPLIT, revision=REVISION)

NAME is a hub id (`openai/gsm8k`) or anything else `load_dataset` takes (a local directory of
JSON/Parquet files: `hf:///abs/dir`); SPLIT defaults to `train` and may slice (`test[:100]`);
REVISION is a branch, tag or commit.  Its rows go through the same validation; image paths in
a dataset with no local directory need `image_root` (`data/images.py`).

Formats:
  sft   prompt, response      (or `messages`: [{role, content}, ...] with an assistant turn)
  pref  prompt, chosen, rejected
  rl    prompt, label          (also the eval format)
  text  text                   (pretraining documents)

A malformed row (missing key, wrong type, empty text, non-UTF-8, over `max_chars`, duplicate
`id`, chosen == rejected, a bad image: `data/images.py`) is rejected with a reason, written to a
rejects file and counted.
Nothing is silently dropped: above `max_reject_ratio` the load fails with a summary.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from rlhf_core import atomic
from rlhf_core.data.images import ImageRules, check_row_images
from rlhf_core.models.load import HUB_PREFIX

SCHEMAS = {"sft": ("prompt", "response"), "pref": ("prompt", "chosen", "rejected"), "rl": ("prompt", "label"), "text": ("text",),
           "unpaired": ("prompt", "completion")}
"""Text columns per data kind; `unpaired` (KTO) also needs a boolean `label` (true: desirable)."""


class DataError(ValueError):
    """The data cannot be used; the message says why and where the rejects are."""


@dataclass
class LoadResult:
    rows: list[dict]
    num_total: int
    num_rejected: int
    reasons: Counter = field(default_factory=Counter)
    rejects_path: Path | None = None


def _iter_jsonl(path: Path) -> Iterator[tuple[int, dict, str | None]]:
    """(line number, row, reason or None) per non-blank line; bytes are decoded strictly.
    An unparsable line comes back as {"_raw": text} with its reason."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield lineno, {"_raw": raw.decode("utf-8", "backslashreplace")}, f"not valid UTF-8 ({e.reason} at byte {e.start})"
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                yield lineno, {"_raw": text}, f"invalid JSON ({e.msg})"
                continue
            yield (lineno, row, None) if isinstance(row, dict) else (lineno, {"_raw": text}, "row is not a JSON object")


def _iter_rows(path: Path) -> Iterator[tuple[int, dict, str | None]]:
    if path.is_dir():
        from datasets import load_from_disk  # HF `datasets` dir written by save_to_disk

        ds = load_from_disk(str(path))
        if hasattr(ds, "keys"):  # a DatasetDict: take "train"
            if "train" not in ds:
                raise DataError(f"{path}: a DatasetDict without a 'train' split (has {list(ds.keys())})")
            ds = ds["train"]
        for i, row in enumerate(ds, start=1):
            yield i, dict(row), None
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield i, row, None
    elif path.suffix in (".jsonl", ".json"):
        yield from _iter_jsonl(path)
    else:
        raise DataError(f"{path}: unsupported data format (use .jsonl, .parquet or a HF datasets directory)")


def hub_dataset_ref(path: str | Path) -> tuple[str, str | None, str] | None:
    """(NAME, REVISION or None, SPLIT) of a hub dataset path `hf://NAME[@REVISION][:SPLIT]` (module
    doc), or None for a local path.  A malformed one is a DataError."""
    if not isinstance(path, str) or not path.startswith(HUB_PREFIX):
        return None
    name, _, split = path[len(HUB_PREFIX):].partition(":")
    name, at, revision = name.partition("@")
    if not name or any(c.isspace() for c in name) or (at and not revision):
        raise DataError(f"{path}: not a hub dataset; write {HUB_PREFIX}NAME, {HUB_PREFIX}NAME:SPLIT or {HUB_PREFIX}NAME@REVISION:SPLIT")
    return name, revision or None, split or "train"


def _iter_hub(name: str, revision: str | None, split: str) -> Iterator[tuple[int, dict, str | None]]:
    from datasets import load_dataset

    try:
        ds = load_dataset(name, split=split, revision=revision)
    except Exception as e:  # not found, offline, no such split: one clear error naming what was asked
        raise DataError(f"{HUB_PREFIX}{name}: load_dataset({name!r}, split={split!r}, revision={revision!r}) failed: "
                        f"{type(e).__name__}: {e}") from e
    for i, row in enumerate(ds, start=1):
        yield i, dict(row), None


def _text_problem(row: dict, key: str, max_chars: int) -> str | None:
    if key not in row or row[key] is None:
        return f"missing key {key!r}"
    value = row[key]
    if not isinstance(value, str):
        return f"{key!r} must be a string, got {type(value).__name__}"
    if not value.strip():
        return f"empty {key!r}"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return f"{key!r} is not valid UTF-8 (lone surrogate)"
    if len(value) > max_chars:
        return f"{key!r} has {len(value)} characters, over max_chars={max_chars}"
    return None


def _messages_problem(row: dict, max_chars: int) -> str | None:
    msgs = row["messages"]
    if not isinstance(msgs, list) or not msgs:
        return "'messages' must be a non-empty list"
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"messages[{i}] must be an object with a string 'role'"
        problem = _text_problem(m, "content", max_chars)
        if problem:
            return f"messages[{i}]: {problem}"
    if msgs[-1]["role"] != "assistant":  # the last turn is the response; the ones before it, the prompt
        return "no assistant turn at the end of 'messages' to learn from (the last turn is the response)"
    return None


def validate_row(row: dict, kind: str, max_chars: int) -> str | None:
    """The reason `row` is unusable for `kind`, or None if it is fine."""
    if kind == "sft" and "messages" in row and "response" not in row:
        return _messages_problem(row, max_chars)
    if kind == "rl" and isinstance(row.get("label"), int) and not isinstance(row.get("label"), bool):
        row["label"] = str(row["label"])  # integer answers are common in task data
    for key in SCHEMAS[kind]:
        problem = _text_problem(row, key, max_chars)
        if problem:
            return problem
    if kind == "pref" and row["chosen"] == row["rejected"]:
        return "chosen == rejected (no preference to learn)"
    if kind == "unpaired" and not isinstance(row.get("label"), bool):
        return f"'label' must be true (desirable) or false (undesirable), got {row.get('label')!r}"
    return None


def map_keys(row: dict, keys: dict[str, str]) -> dict:
    """`row` with each of our column names (`prompt`, `label`, ...) taken from the user's column
    `keys[name]` where that differs (OpenRLHF's input_key / label_key / ... settings)."""
    mapped = {ours: row[theirs] for ours, theirs in keys.items() if theirs != ours and theirs in row}
    return {**row, **mapped} if mapped else row


def load_rows(path: str | Path, kind: str, *, rejects_path: str | Path, max_chars: int = 4096, max_reject_ratio: float = 0.05,
              keys: dict[str, str] | None = None, image_rules: ImageRules | None = None) -> LoadResult:
    """Read and validate `path` as `kind` data; write rejects (JSONL: line, reason, row) to `rejects_path`.
    `keys`: our column name -> the file's (see `map_keys`); a missing one is named both ways.
    Rows with `images` have them checked against `image_rules` (paths relative to the file's dir).
    `path`: a local file or directory, or a hub dataset `hf://NAME[@REVISION][:SPLIT]` (module doc).

    Raises DataError if the file is missing (or the hub dataset cannot be loaded), no row is valid,
    or more than `max_reject_ratio` of the rows are rejected.
    """
    renamed = {ours: theirs for ours, theirs in (keys or {}).items() if theirs != ours}
    if kind not in SCHEMAS:
        raise ValueError(f"unknown data kind {kind!r}; valid: {sorted(SCHEMAS)}")
    hub = hub_dataset_ref(path)
    if hub:  # image paths: inside the dataset's directory when it is a local one, else only under image_root
        source, image_dir = _iter_hub(*hub), Path(hub[0]) if Path(hub[0]).is_dir() else None
    else:
        path = Path(path)
        if not path.exists():
            raise DataError(f"{path}: no such file or directory (a local path; a hub dataset is written {HUB_PREFIX}NAME[:SPLIT])")
        source, image_dir = _iter_rows(path), path if path.is_dir() else path.parent
    rows, rejects, seen_ids = [], [], set()
    for lineno, row, reason in source:
        if reason is None:
            row = map_keys(row, renamed)
            reason = validate_row(row, kind, max_chars)
            missing = reason and reason.startswith("missing key ") and reason.split("'")[1]
            if missing in renamed:
                reason = f"missing key {renamed[missing]!r} (the {missing} column, set by its *_key setting)"
        if reason is None and row.get("images") is not None:
            reason = check_row_images(row, image_dir, image_rules or ImageRules())
        if reason is None and "id" in row:
            if row["id"] in seen_ids:
                reason = f"duplicate id {row['id']!r}"
            seen_ids.add(row["id"])
        if reason is None:
            rows.append(row)
        else:
            rejects.append({"source": str(path), "line": lineno, "reason": reason, "row": _preview(row)})
    total = len(rows) + len(rejects)
    reasons = Counter(r["reason"].split(" (")[0] for r in rejects)
    rejects_path = Path(rejects_path)
    write_jsonl(rejects_path, rejects, ensure_ascii=True)
    result = LoadResult(rows, total, len(rejects), reasons, rejects_path)
    if total == 0 or not rows:
        raise DataError(f"{path}: no valid {kind} rows ({len(rejects)} rejected: {dict(reasons)}; see {rejects_path})")
    if len(rejects) / total > max_reject_ratio:
        raise DataError(
            f"{path}: {len(rejects)} of {total} rows ({len(rejects) / total:.1%}) rejected, above "
            f"max_reject_ratio={max_reject_ratio}; reasons: {dict(reasons)}; see {rejects_path}"
        )
    return result


def _preview(row: dict, limit: int = 500) -> str:
    text = json.dumps(row, ensure_ascii=True, default=repr)
    return text if len(text) <= limit else text[:limit] + "..."


def write_jsonl(path: str | Path, rows: list[dict], ensure_ascii: bool = False) -> None:
    """One JSON row per line, written atomically (the parent directory is created)."""
    atomic.write_text(path, "".join(json.dumps(row, ensure_ascii=ensure_ascii) + "\n" for row in rows))
