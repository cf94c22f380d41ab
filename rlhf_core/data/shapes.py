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
    num_train: int = 2000
    num_eval: int = 200

    def __post_init__(self):
        if self.image_size % self.cells or self.image_size // self.cells < 8:
            raise ValueError(f"image_size {self.image_size} must split into {self.cells} cells of >= 8 pixels")
        if not 1 <= self.max_objects <= self.cells ** 2:
            raise ValueError(f"max_objects must be in [1, {self.cells ** 2}]")


@dataclass(frozen=True)
class Thing:
    shape: str
    colour: str
    cell: tuple[int, int]
    """(row, column) of its grid cell."""
    box: tuple[int, int, int, int]
    """(left, top, right, bottom) pixels, inside the cell."""


def draw_scene(rng: random.Random, cfg: ShapesConfig) -> list[Thing]:
    n = rng.randint(1, cfg.max_objects)
    cells = rng.sample([(r, c) for r in range(cfg.cells) for c in range(cfg.cells)], n)
    step = cfg.image_size // cfg.cells
    things = []
    for r, c in sorted(cells):
        size = rng.randint(step * 5 // 8, step - 2)
        left = c * step + rng.randint(1, step - size - 1)
        top = r * step + rng.randint(1, step - size - 1)
        things.append(Thing(rng.choice(SHAPES), rng.choice(sorted(COLOURS)), (r, c), (left, top, left + size, top + size)))
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


def count(things: list[Thing], colour: str, shape: str) -> int:
    return sum(t.colour == colour and t.shape == shape for t in things)


def question(colour: str, shape: str) -> str:
    return f"{IMAGE_TOKEN}How many {colour} {shape}s? A:"


def ask(rng: random.Random, things: list[Thing]) -> tuple[str, str]:
    """A (colour, shape) to count: half the time one that is in the picture, else any (often 0)."""
    if rng.random() < 0.5:
        t = rng.choice(things)
        return t.colour, t.shape
    return rng.choice(sorted(COLOURS)), rng.choice(SHAPES)


def generate_shapes(cfg: ShapesConfig, seed: int) -> dict[str, list[dict]]:
    """{"train": rows, "eval": rows}; a row: prompt, label (the count), `image` (PNG bytes) and
    `scene` (what was drawn).  Eval scenes are drawn from their own stream (seed + 1)."""
    out = {}
    for split, n, offset in (("train", cfg.num_train, 0), ("eval", cfg.num_eval, 1)):
        rng = random.Random(seed * 1_000_003 + offset)
        rows = []
        for i in range(n):
            things = draw_scene(rng, cfg)
            colour, shape = ask(rng, things)
            rows.append({"id": f"{split}-{i:05d}", "prompt": question(colour, shape), "label": str(count(things, colour, shape)),
                         "image": render(things, cfg), "scene": things})
        out[split] = rows
    return out
