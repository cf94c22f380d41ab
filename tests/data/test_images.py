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


def test_image_paths_are_confined_to_the_data_directory(tmp_path):
    """An image path that resolves outside the data file's directory -- `..`, an absolute path, a
    symlink pointing out -- is rejected with its reason and counted, never read; inside ones load."""
    outside = tmp_path / "outside.png"
    outside.write_bytes(png())
    data_dir = tmp_path / "data"
    (data_dir / "images").mkdir(parents=True)
    (data_dir / "images" / "in.png").write_bytes(png())
    (data_dir / "images" / "link_out.png").symlink_to(outside)
    (data_dir / "images" / "link_in.png").symlink_to(data_dir / "images" / "in.png")
    (data_dir / "linked_dir").symlink_to(tmp_path, target_is_directory=True)
    q = "<image>How many? A:"
    refs = {"inside": "images/in.png", "inside_absolute": str(data_dir / "images" / "in.png"), "inside_dotdot": "images/../images/in.png",
            "link_in": "images/link_in.png", "dotdot": "../outside.png", "absolute": str(outside), "link_out": "images/link_out.png",
            "dir_link_out": "linked_dir/outside.png", "system_file": "/etc/hostname"}
    data = data_dir / "rl.jsonl"
    data.write_text("".join(json.dumps({"id": k, "prompt": q, "label": "1", "images": [ref]}) + "\n" for k, ref in refs.items()))
    rejects = data_dir / "rejects.jsonl"
    result = load_rows(data, "rl", rejects_path=rejects, max_reject_ratio=1.0)
    inside = str((data_dir / "images" / "in.png").resolve())
    assert {r["id"]: r["images"] for r in result.rows} == {k: [inside] for k in ("inside", "inside_absolute", "inside_dotdot", "link_in")}
    reasons = {json.loads(json.loads(line)["row"])["id"]: json.loads(line)["reason"] for line in rejects.read_text().splitlines()}
    assert reasons.keys() == {"dotdot", "absolute", "link_out", "dir_link_out", "system_file"} and result.num_rejected == 5
    for key, reason in reasons.items():
        assert reason.startswith(f"images[0]: image {refs[key]!r} is outside the data file's directory"), reason


def test_image_root_widens_the_allowed_directory(tmp_path):
    """`image_root` (TrainConfig.image_root) is the allowed root instead of the data's directory:
    a shared picture store beside several data dirs; outside it stays rejected."""
    (tmp_path / "pictures").mkdir()
    (tmp_path / "pictures" / "a.png").write_bytes(png())
    (tmp_path / "secret.png").write_bytes(png())
    (tmp_path / "data").mkdir()
    data = tmp_path / "data" / "rl.jsonl"
    data.write_text("".join(json.dumps({"id": ref, "prompt": "<image>n? A:", "label": "1", "images": [ref]}) + "\n"
                            for ref in ("../pictures/a.png", "../secret.png")))
    rejects = tmp_path / "rejects.jsonl"
    with pytest.raises(DataError, match="no valid rl rows"):  # by default the data's directory only
        load_rows(data, "rl", rejects_path=rejects, max_reject_ratio=1.0)
    result = load_rows(data, "rl", rejects_path=rejects, max_reject_ratio=1.0, image_rules=ImageRules(image_root=str(tmp_path / "pictures")))
    assert [r["id"] for r in result.rows] == ["../pictures/a.png"]
    assert "'../secret.png' is outside image_root" in json.loads(rejects.read_text())["reason"]


def test_train_config_has_image_root():
    from rlhf_core.training.config import TrainConfig

    assert TrainConfig().image_root == "" and TrainConfig(image_root="/srv/pictures").image_root == "/srv/pictures"


def test_hub_dataset_image_paths_need_image_root(tmp_path, monkeypatch):
    """A hub dataset (`hf://NAME`) has no directory of its own: its image paths are rejected unless
    `image_root` is set, and are then relative to it and confined to it."""
    import datasets

    (tmp_path / "a.png").write_bytes(png())
    rows = [{"id": ref, "prompt": "<image>n? A:", "label": "1", "images": [ref]} for ref in ("a.png", "../a.png")]
    monkeypatch.setattr(datasets, "load_dataset", lambda name, **kw: rows)
    rejects = tmp_path / "rejects.jsonl"
    with pytest.raises(DataError, match="no valid rl rows"):
        load_rows("hf://org/pictures", "rl", rejects_path=rejects, max_reject_ratio=1.0)
    assert "needs image_root" in rejects.read_text()
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "a.png").write_bytes(png())
    rules = ImageRules(image_root=str(tmp_path / "root"))
    result = load_rows("hf://org/pictures", "rl", rejects_path=rejects, max_reject_ratio=1.0, image_rules=rules)
    assert [r["images"] for r in result.rows] == [[str((tmp_path / "root" / "a.png").resolve())]]
    assert "'../a.png' is outside image_root" in json.loads(rejects.read_text())["reason"]


def test_load_data_passes_image_root(tmp_path):
    """A stage's `image_root` reaches the image rules: a picture outside the data dir but under the root loads."""
    from rlhf_core.training.config import TrainConfig
    from rlhf_core.training.inputs import load_data

    (tmp_path / "pictures").mkdir()
    (tmp_path / "pictures" / "a.png").write_bytes(png())
    (tmp_path / "data").mkdir()
    data = tmp_path / "data" / "rl.jsonl"
    data.write_text(json.dumps({"prompt": "<image>n? A:", "label": "1", "images": ["../pictures/a.png"]}) + "\n")
    rows = load_data(str(data), "rl", TrainConfig(image_root=str(tmp_path / "pictures")), tmp_path / "rejects.jsonl")
    assert rows[0]["images"] == [str((tmp_path / "pictures" / "a.png").resolve())]
