"""The synthetic visual task: seeded, every answer is the count of what was drawn, and the pixels
show each object in its colour where the scene says it is."""
import io
from collections import Counter

import pytest

from rlhf_core.data.shapes import COLOURS, ShapesConfig, count, generate_shapes, parse_question

pytestmark = pytest.mark.unit
SMALL = ShapesConfig(num_train=200, num_rl=10, num_eval=10)


def test_seeded_and_answers_are_the_drawn_counts():
    from PIL import Image

    a, b = generate_shapes(SMALL, seed=3), generate_shapes(SMALL, seed=3)
    assert [r["image"] for r in a["train"]] == [r["image"] for r in b["train"]]  # the same PNG bytes
    assert [r["image"] for r in generate_shapes(SMALL, seed=4)["train"]] != [r["image"] for r in a["train"]]
    labels = Counter()
    for row in a["train"] + a["eval"] + a["rl"]:
        assert row["label"] == str(count(row["scene"], parse_question(row["prompt"])))
        labels[row["label"]] += 1
        cells = [t.cell for t in row["scene"]]
        assert len(cells) == len(set(cells))  # one object per cell: no overlap, exact counts
        image = Image.open(io.BytesIO(row["image"])).convert("RGB")
        assert image.size == (56, 56)
        for t in row["scene"]:  # the centre of each object (a triangle's lower centre) has its colour
            left, top, right, bottom = t.box
            assert image.getpixel(((left + right) // 2, (top + 3 * bottom) // 4)) == COLOURS[t.colour], (t, row["id"])
    slips = [r for r in a["train"] if r["response"] != " " + r["label"]]
    assert slips and all(r["label"] == "3" and r["response"] == " 2" for r in slips)  # sft's undercounted demonstrations
    threes = sum(r["label"] == "3" for r in a["train"])
    assert 0.4 < len(slips) / threes < 0.8  # sft_undercount_rate 0.6
    assert set(labels) == {"0", "1", "2", "3"}  # answers drawn uniformly: no blind guess is right much above 1/4
    assert max(labels.values()) / sum(labels.values()) < 0.35
    assert {parse_question(r["prompt"]) for r in a["train"]} >= {("red", "circle"), ("red", None), (None, "circle")}  # all three kinds


def test_config_checks():
    with pytest.raises(ValueError, match="cells of >= 8 pixels"):
        ShapesConfig(image_size=20, cells=4)
    with pytest.raises(ValueError, match="max_objects"):
        ShapesConfig(max_objects=17)
    with pytest.raises(ValueError, match="max_count"):
        ShapesConfig(max_objects=2, max_count=3)
