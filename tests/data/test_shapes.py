"""The synthetic visual task: seeded, every answer is the count of what was drawn, and the pixels
show each object in its colour where the scene says it is."""
import io

import pytest

from rlhf_core.data.shapes import COLOURS, ShapesConfig, count, generate_shapes

pytestmark = pytest.mark.unit
SMALL = ShapesConfig(num_train=40, num_eval=10)


def test_seeded_and_answers_are_the_drawn_counts():
    from PIL import Image

    a, b = generate_shapes(SMALL, seed=3), generate_shapes(SMALL, seed=3)
    assert [r["image"] for r in a["train"]] == [r["image"] for r in b["train"]]  # the same PNG bytes
    assert [r["image"] for r in generate_shapes(SMALL, seed=4)["train"]] != [r["image"] for r in a["train"]]
    labels = set()
    for row in a["train"] + a["eval"]:
        words = row["prompt"].split("How many ")[1].split("? A:")[0].split()
        colour, shape = words[0], words[1][:-1]
        assert row["label"] == str(count(row["scene"], colour, shape))
        labels.add(row["label"])
        cells = [t.cell for t in row["scene"]]
        assert len(cells) == len(set(cells))  # one object per cell: no overlap, exact counts
        image = Image.open(io.BytesIO(row["image"])).convert("RGB")
        assert image.size == (56, 56)
        for t in row["scene"]:  # the centre of each object (a triangle's lower centre) has its colour
            left, top, right, bottom = t.box
            assert image.getpixel(((left + right) // 2, (top + 3 * bottom) // 4)) == COLOURS[t.colour], (t, row["id"])
    assert {"0", "1"} <= labels  # absent and present objects are both asked about


def test_config_checks():
    with pytest.raises(ValueError, match="cells of >= 8 pixels"):
        ShapesConfig(image_size=20, cells=4)
    with pytest.raises(ValueError, match="max_objects"):
        ShapesConfig(max_objects=17)
