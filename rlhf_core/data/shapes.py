"""A synthetic visual task with verifiable answers (issue 21's first piece): small images of coloured
shapes and counting questions, `<image>How many red squares? A:` -> ` 2`.

Each image is a grid of `cells x cells` cells; every object sits in a cell of its own (no overlap,
so the count is exact) with a seeded colour, shape, size and offset.  The scene is returned with
the image, so a test (or a verifier) can check every answer against what was drawn.  Seeded and
deterministic: the same seed gives the same PNG bytes.
"""
from __future__ import annotations

import io
import random
from dataclasses import dataclass

from rlhf_core.models.tiny_vlm import IMAGE_TOKEN

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220)}
SHAPES = ("square", "circle", "triangle")


@dataclass(frozen=True, kw_only=True)
class ShapesConfig:
    image_size: int = 56
    """Pixels per side (a multiple of the vision patch size, 14)."""
    cells: int = 4
    """The scene is a cells x cells grid, one object per occupied cell."""
    max_objects: int = 6
    max_count: int = 3
    """Answers are drawn uniformly from 0..max_count (then the scene is drawn to match), so no
    blind guess beats 1 / (max_count + 1): the picture has to be looked at."""
    num_train: int = 2000
    """sft rows (image, question, answer)."""
    sft_undercount_rate: float = 0.6
    """The share of sft demonstrations of the largest count (max_count) that answer one less, as a
    hurried annotator does: sft learns the slip, the verifier (exact count) does not -- rl fixes it
    (the text task's `sft_slip` in visual form).  0 gives faithful demonstrations."""
    num_rl: int = 1000
    """rl prompts (image, question, label), scenes of their own."""
    num_eval: int = 200

    def __post_init__(self):
        if self.image_size % self.cells or self.image_size // self.cells < 8:
            raise ValueError(f"image_size {self.image_size} must split into {self.cells} cells of >= 8 pixels")
        if not 1 <= self.max_objects <= self.cells ** 2:
            raise ValueError(f"max_objects must be in [1, {self.cells ** 2}]")
        if not 1 <= self.max_count <= self.max_objects:
            raise ValueError(f"max_count must be in [1, max_objects={self.max_objects}]")
        if not 0.0 <= self.sft_undercount_rate <= 1.0:
            raise ValueError("sft_undercount_rate must be in [0, 1]")


@dataclass(frozen=True)
class Thing:
    shape: str
    colour: str
    cell: tuple[int, int]
    """(row, column) of its grid cell."""
    box: tuple[int, int, int, int]
    """(left, top, right, bottom) pixels, inside the cell."""


def matches(colour: str, shape: str, query: tuple[str | None, str | None]) -> bool:
    """Whether a (colour, shape) object is what `query` counts (None: any colour / any shape)."""
    return query[0] in (None, colour) and query[1] in (None, shape)


def draw_scene(rng: random.Random, cfg: ShapesConfig, query: tuple[str | None, str | None], k: int) -> list[Thing]:
    """A scene with exactly `k` objects matching `query` among up to max_objects."""
    n = rng.randint(max(k, 1), cfg.max_objects)
    cells = rng.sample([(r, c) for r in range(cfg.cells) for c in range(cfg.cells)], n)
    wanted = [(colour, shape) for colour in sorted(COLOURS) for shape in SHAPES if matches(colour, shape, query)]
    others = [(colour, shape) for colour in sorted(COLOURS) for shape in SHAPES if not matches(colour, shape, query)]
    kinds = [rng.choice(wanted) for _ in range(k)] + [rng.choice(others) for _ in range(n - k)]
    rng.shuffle(kinds)
    step = cfg.image_size // cfg.cells
    things = []
    for (r, c), (colour, shape) in zip(sorted(cells), kinds):
        size = rng.randint(step * 5 // 8, step - 2)
        left = c * step + rng.randint(1, step - size - 1)
        top = r * step + rng.randint(1, step - size - 1)
        things.append(Thing(shape, colour, (r, c), (left, top, left + size, top + size)))
    return things


def render(things: list[Thing], cfg: ShapesConfig) -> bytes:
    """PNG bytes of the scene: white background, each thing filled in its colour."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (cfg.image_size, cfg.image_size), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    for t in things:
        fill = COLOURS[t.colour]
        left, top, right, bottom = t.box
        if t.shape == "square":
            pen.rectangle(t.box, fill=fill)
        elif t.shape == "circle":
            pen.ellipse(t.box, fill=fill)
        else:
            pen.polygon([((left + right) // 2, top), (left, bottom), (right, bottom)], fill=fill)
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def count(things: list[Thing], query: tuple[str | None, str | None]) -> int:
    return sum(matches(t.colour, t.shape, query) for t in things)


def question(query: tuple[str | None, str | None]) -> str:
    """`<image>How many red squares? A:` / `... red shapes?` / `... circles?`"""
    colour, shape = query
    words = " ".join(w for w in (colour, f"{shape}s" if shape else "shapes") if w)
    return f"{IMAGE_TOKEN}How many {words}? A:"


def parse_question(prompt: str) -> tuple[str | None, str | None]:
    """The query a `question` asks (for checking answers against a scene)."""
    words = prompt.split("How many ", 1)[1].split("?", 1)[0].split()
    colour = words[0] if words[0] in COLOURS else None
    shape = words[-1][:-1] if words[-1][:-1] in SHAPES else None
    return colour, shape


def ask(rng: random.Random) -> tuple[str | None, str | None]:
    """A query: a colour and a shape, a colour alone, or a shape alone (a third each)."""
    colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
    return [(colour, shape), (colour, None), (None, shape)][rng.randrange(3)]


def generate_shapes(cfg: ShapesConfig, seed: int) -> dict[str, list[dict]]:
    """{"train", "rl", "eval": rows}; a row: prompt, label (the count), `image` (PNG bytes) and
    `scene` (what was drawn); a train row also `response`, its demonstration (`sft_undercount_rate`).
    Each split's scenes come from a stream of their own."""
    out = {}
    for split, n, offset in (("train", cfg.num_train, 0), ("eval", cfg.num_eval, 1), ("rl", cfg.num_rl, 2)):
        rng = random.Random(seed * 1_000_003 + offset)
        rows = []
        for i in range(n):
            query, k = ask(rng), rng.randint(0, cfg.max_count)
            things = draw_scene(rng, cfg, query, k)
            row = {"id": f"{split}-{i:05d}", "prompt": question(query), "label": str(count(things, query)), "image": render(things, cfg),
                   "scene": things}
            if split == "train":
                slip = k == cfg.max_count and rng.random() < cfg.sft_undercount_rate
                row["response"] = f" {k - 1 if slip else k}"
            rows.append(row)
        out[split] = rows
    return out


def mark_objects(image: bytes, cfg: ShapesConfig = ShapesConfig()) -> bytes:
    """The picture with every occupied grid cell outlined in black (a visual hint: "these are the
    objects, count again") -- found from the pixels, so it works on any picture of this task."""
    from PIL import Image, ImageDraw

    with Image.open(io.BytesIO(image)) as src:
        picture = src.convert("RGB")
    step = picture.width // cfg.cells
    pen = ImageDraw.Draw(picture)
    for r in range(cfg.cells):
        for c in range(cfg.cells):
            box = (c * step, r * step, (c + 1) * step - 1, (r + 1) * step - 1)
            lo, _ = picture.crop(box).convert("L").getextrema()  # darkest pixel: anything drawn is darker than white
            if lo < 255:
                pen.rectangle(box, outline=(0, 0, 0))
    buf = io.BytesIO()
    picture.save(buf, format="PNG", optimize=False)
    return buf.getvalue()
