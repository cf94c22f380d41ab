"""Image rows: every kind of bad image is rejected with its reason (and counted), a good one is
accepted with its path resolved and its sha256 recorded, and bytes work like files."""
import hashlib
import io
import json

import pytest

from rlhf_core.data.images import ImageRules
from rlhf_core.data.io import DataError, load_rows

pytestmark = pytest.mark.unit


def png(mode="RGB", size=(28, 28), fmt="PNG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, 128 if mode in ("L", "I;16") else (200, 30, 30, 0)[: len(mode)]).save(buf, format=fmt)
    return buf.getvalue()


def test_bad_images_are_rejected_with_a_reason(tmp_path):
    good = png()
    files = {"good.png": good, "grey.png": png("L"), "corrupt.png": b"\x89PNG\r\n\x1a\n" + b"garbage" * 20,
             "truncated.png": good[: len(good) // 2], "cmyk.jpg": png("CMYK", fmt="JPEG"), "wide.png": png(size=(300, 200)),
             "text.png": b"not an image at all"}
    (tmp_path / "img").mkdir()
    for name, data in files.items():
        (tmp_path / "img" / name).write_bytes(data)
    q = "<image>How many red squares? A:"
    rows = [
        {"id": "good", "prompt": q, "label": "1", "images": ["img/good.png"], "image_sha256": [hashlib.sha256(good).hexdigest()]},
        {"id": "grey", "prompt": q, "label": "1", "images": "img/grey.png"},  # one path, not a list; L is converted to RGB
        {"id": "corrupt", "prompt": q, "label": "1", "images": ["img/corrupt.png"]},
        {"id": "truncated", "prompt": q, "label": "1", "images": ["img/truncated.png"]},
        {"id": "cmyk", "prompt": q, "label": "1", "images": ["img/cmyk.jpg"]},
        {"id": "oversized", "prompt": q, "label": "1", "images": ["img/wide.png"]},
        {"id": "text", "prompt": q, "label": "1", "images": ["img/text.png"]},
        {"id": "missing", "prompt": q, "label": "1", "images": ["img/nowhere.png"]},
        {"id": "changed", "prompt": q, "label": "1", "images": ["img/grey.png"], "image_sha256": [hashlib.sha256(good).hexdigest()]},
        {"id": "two_for_one", "prompt": q, "label": "1", "images": ["img/good.png", "img/grey.png"]},
        {"id": "not_a_ref", "prompt": q, "label": "1", "images": [7]},
    ]
    data = tmp_path / "rl.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rejects = tmp_path / "rejects.jsonl"
    with pytest.raises(DataError, match="9 of 11 rows"):
        load_rows(data, "rl", rejects_path=rejects, image_rules=ImageRules(max_pixels=200 * 200))
    reasons = {json.loads(json.loads(line)["row"])["id"]: json.loads(line)["reason"] for line in rejects.read_text().splitlines()}
    assert reasons.keys() == {r["id"] for r in rows} - {"good", "grey"}
    assert "corrupt image" in reasons["corrupt"] or "PIL can read" in reasons["corrupt"]
    assert "corrupt image" in reasons["truncated"]
    assert "mode CMYK" in reasons["cmyk"]
    assert "300x200 pixels, over max_image_pixels=40000" in reasons["oversized"]
    assert "PIL can read" in reasons["text"]
    assert "not found" in reasons["missing"]
    assert "differs from its image_sha256" in reasons["changed"]
    assert "2 image(s) but 1 <image> placeholder(s)" in reasons["two_for_one"]
    assert "must be a path or bytes" in reasons["not_a_ref"]

    result = load_rows(data, "rl", rejects_path=rejects, image_rules=ImageRules(max_pixels=200 * 200), max_reject_ratio=1.0)
    assert [r["id"] for r in result.rows] == ["good", "grey"] and result.num_rejected == 9
    good_row = result.rows[0]
    assert good_row["images"] == [str((tmp_path / "img" / "good.png").resolve())]
    assert good_row["image_sha256"] == [hashlib.sha256(good).hexdigest()]
    assert result.rows[1]["image_sha256"] == [hashlib.sha256(files["grey.png"]).hexdigest()]  # computed where not given


def test_image_bytes_in_parquet_and_the_size_limit(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    q = "<image>How many circles? A:"
    rows = [{"prompt": q, "label": "0", "images": [png()]}, {"prompt": q, "label": "0", "images": [png(size=(56, 56)) + b"\0" * 5000]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rl.parquet")
    result = load_rows(tmp_path / "rl.parquet", "rl", rejects_path=tmp_path / "rejects.jsonl", max_reject_ratio=1.0,
                       image_rules=ImageRules(max_bytes=4000))
    assert len(result.rows) == 1 and isinstance(result.rows[0]["images"][0], bytes)
    assert "bytes, over max_image_bytes=4000" in json.loads((tmp_path / "rejects.jsonl").read_text())["reason"]
