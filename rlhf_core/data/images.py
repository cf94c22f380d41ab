"""Image columns of user data (issue 21): validation at load time, and loading for the processor.

A row may carry `images`: a list (or one) of image references -- a path (relative to the data
file's directory, or absolute) or the image's bytes (a Parquet binary column) -- one per `<image>`
placeholder in its prompt, in order.  An optional `image_sha256` list pins each file's content.

A path must resolve (`..` and symlinks followed) inside the allowed root: `image_root` when set,
else the data file's own directory -- data cannot make a run read any file of the host (an
absolute path, `../..`, or a symlink out of the directory is rejected with the reason, like a
missing image).  A hub dataset (`hf://NAME`) has no directory of its own: its image paths need
`image_root` (relative ones are then relative to it).

A row is rejected with a reason (and counted, like any malformed row) when an image is missing,
unreadable or truncated, in a mode the model cannot take (`image_modes`), over `max_image_pixels`
or `max_image_bytes`, differs from its `image_sha256`, or when the images do not match the
placeholders, or when a path leads outside the allowed root.  Accepted rows get `images` as a
list of absolute, symlink-free paths (or bytes) and
`image_sha256` as computed here, so what trained is what the manifest records.
"""
from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.models.tiny_vlm import IMAGE_TOKEN


@dataclass(frozen=True)
class ImageRules:
    modes: tuple[str, ...] = ("RGB", "RGBA", "L", "P")
    """PIL modes accepted (each becomes RGB for the processor); CMYK, 16-bit, float ... are rejected."""
    max_pixels: int = 2048 * 2048
    max_bytes: int = 20 * 1024 * 1024
    image_root: str = ""
    """The directory every image path must resolve inside (symlinks followed); empty: the data
    file's own directory (a HF `datasets` directory: itself)."""


def image_path(ref: str, base_dir: Path | None, rules: ImageRules) -> tuple[Path | None, str | None]:
    """(the file `ref` names, resolved: absolute, no `..`, no symlinks; None) or (None, reason):
    relative to `base_dir` (the data file's directory; `image_root` when the data has none), and
    inside `image_root` or, when that is unset, inside `base_dir`."""
    root = Path(rules.image_root) if rules.image_root else base_dir
    if root is None:
        return None, f"image {ref!r}: data without a directory of its own (a hub dataset) needs image_root set for image paths"
    root = root.resolve()
    try:
        path = ((base_dir if base_dir is not None else root) / ref).resolve()  # an absolute `ref` replaces the base
    except (OSError, RuntimeError, ValueError) as e:  # a symlink loop, a NUL byte
        return None, f"image {ref!r} is not a usable path ({e})"
    if not path.is_relative_to(root):
        where = "image_root" if rules.image_root else "the data file's directory"
        return None, f"image {ref!r} is outside {where} (resolves to {path}, not under {root})"
    return path, None


def _raw(ref, base_dir: Path | None, rules: ImageRules) -> tuple[bytes | None, Path | None, str | None]:
    """(bytes, the resolved path or None for bytes, None) or (None, None, reason)."""
    if isinstance(ref, (bytes, bytearray)):
        return bytes(ref), None, None
    if not isinstance(ref, str) or not ref:
        return None, None, f"an image must be a path or bytes, got {type(ref).__name__}"
    path, reason = image_path(ref, base_dir, rules)
    if reason:
        return None, None, reason
    if not path.is_file():
        return None, None, f"image {ref!r} not found"
    if path.stat().st_size > rules.max_bytes:  # not read into memory to find out
        return None, None, f"{path.stat().st_size} bytes, over max_image_bytes={rules.max_bytes}"
    return path.read_bytes(), path, None


def image_problem(data: bytes, rules: ImageRules) -> str | None:
    """Why these bytes are not a usable image, or None."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > rules.max_bytes:
        return f"{len(data)} bytes, over max_image_bytes={rules.max_bytes}"
    try:
        with Image.open(io.BytesIO(data)) as img:  # reads the header only: size and mode before any decoding
            if img.width * img.height > rules.max_pixels:
                return f"{img.width}x{img.height} pixels, over max_image_pixels={rules.max_pixels}"
            if img.mode not in rules.modes:
                return f"mode {img.mode} (accepted: {', '.join(rules.modes)})"
            img.load()  # decodes everything: a truncated or corrupt body fails here
    except UnidentifiedImageError:
        return "not an image file PIL can read"
    except (OSError, SyntaxError, ValueError) as e:  # truncated / corrupt data
        return f"corrupt image ({e})"
    return None


def check_row_images(row: dict, base_dir: Path | None, rules: ImageRules) -> str | None:
    """Validate `row['images']` in place (see the module doc); the reason it is unusable, or None.
    `base_dir`: the data file's directory (None: data with none, a hub dataset)."""
    refs = row["images"]
    refs = [refs] if isinstance(refs, (str, bytes, bytearray)) else refs
    if not isinstance(refs, list):
        return f"'images' must be a list of paths or bytes, got {type(refs).__name__}"
    text = row.get("prompt") if isinstance(row.get("prompt"), str) else ""
    if text.count(IMAGE_TOKEN) != len(refs):
        return f"{len(refs)} image(s) but {text.count(IMAGE_TOKEN)} {IMAGE_TOKEN} placeholder(s) in the prompt"
    pinned = row.get("image_sha256")
    if pinned is not None and (not isinstance(pinned, list) or len(pinned) != len(refs)):
        return "'image_sha256' must list one sha256 per image"
    resolved, digests = [], []
    for i, ref in enumerate(refs):
        data, path, reason = _raw(ref, base_dir, rules)
        reason = reason or image_problem(data, rules)
        if reason:
            return f"images[{i}]: {reason}"
        digest = hashlib.sha256(data).hexdigest()
        if pinned is not None and pinned[i] != digest:
            return f"images[{i}]: sha256 {digest[:12]} differs from its image_sha256 {str(pinned[i])[:12]} (changed or corrupted)"
        resolved.append(ref if path is None else str(path))
        digests.append(digest)
    row["images"], row["image_sha256"] = resolved, digests
    return None


def open_rgb(ref):
    """A validated reference (absolute path or bytes) as an RGB PIL image."""
    from PIL import Image

    src = io.BytesIO(ref) if isinstance(ref, (bytes, bytearray)) else ref
    with Image.open(src) as img:
        return img.convert("RGB")


def shown_path(path: str) -> str:
    """A path as artifacts record it: relative to the project (the working directory) when inside
    it -- no machine paths in manifests and rollouts -- else absolute."""
    try:
        return Path(path).relative_to(Path.cwd()).as_posix()
    except ValueError:
        return Path(path).as_posix()


def image_files(rows: list[dict]) -> dict[str, str]:
    """{absolute path: sha256} of every image file the rows reference (bytes are in the data file)."""
    return {ref: digest for r in rows for ref, digest in zip(r.get("images", ()), r.get("image_sha256", ())) if isinstance(ref, str)}


class VisionInputs:
    """A vision-language model's image side, on the driver: prompt ids with each placeholder
    expanded by the model's own processor (the image-token count is the processor's business),
    and the `pixel_values` of a batch's images."""

    def __init__(self, processor):
        self.processor = processor
        self.image_token_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        """The placeholder's id: a prompt token only -- the engines never sample it (an image token in
        a response would have no picture behind it)."""

    def prompt_ids(self, prompt: str, refs: list, special: bool = True) -> list[int]:
        """Token ids of `prompt` with each placeholder expanded for its picture (`special`: with
        BOS, as a prompt; without, for environment feedback appended mid-episode)."""
        out = self.processor(text=[prompt], images=[open_rgb(r) for r in refs], return_tensors="pt", add_special_tokens=special)
        return out["input_ids"][0].tolist()

    def pixel_values(self, refs: list):
        """(images, 3, H, W) for the references in order, or None for none."""
        if not refs:
            return None
        return self.processor.image_processor([open_rgb(r) for r in refs], return_tensors="pt")["pixel_values"]

    def per_prompt(self, images: list) -> list | None:
        """Per prompt its pictures' pixel values (None for a prompt without), or None when no
        prompt has any: the engines' and the eval generation's `pixels` argument."""
        if not any(images):
            return None
        return [self.pixel_values(refs or []) for refs in images]


def with_images(example: dict, row: dict) -> dict:
    """`example` carrying its row's image references and hashes (the collate turns the references
    into pixel values; `training/inputs.py::image_records` reads the hashes for the manifest)."""
    return {**example, "images": row["images"], "image_sha256": row["image_sha256"]} if row.get("images") else example
