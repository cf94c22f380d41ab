import json

import pytest

from rlhf_core.data.io import DataError, load_rows

pytestmark = pytest.mark.unit

GOOD = {"prompt": "Q: 1+1= A:", "response": " 2"}


def _write(path, lines):
    with open(path, "wb") as f:
        for line in lines:
            f.write((json.dumps(line) if isinstance(line, dict) else line).encode() if not isinstance(line, bytes) else line)
            f.write(b"\n")
    return path


def test_each_malformed_row_rejected_with_reason(tmp_path):
    path = _write(tmp_path / "sft.jsonl", [
        GOOD,
        {"prompt": "Q: 1+2= A:"},                                  # missing key
        {"prompt": "", "response": " 3"},                          # empty
        {"prompt": "Q:", "response": 3},                           # wrong type
        b'{"prompt": "Q: \xff\xfe", "response": " 1"}',            # non-UTF-8 bytes
        '{"prompt": "\\ud800", "response": " 1"}',                 # lone surrogate
        {"prompt": "x" * 50, "response": " 1"},                    # over max_chars
        "{not json",
        "[1, 2]",
        {"id": 7, **GOOD},
        {"id": 7, **GOOD},                                         # duplicate id
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"messages": [{"role": "user", "content": "hi"}]},         # no assistant turn
    ])
    rejects = tmp_path / "rejects.jsonl"
    res = load_rows(path, "sft", rejects_path=rejects, max_chars=40, max_reject_ratio=1.0)
    assert res.num_total == 13 and len(res.rows) == 3 and res.num_rejected == 10
    reasons = [json.loads(line)["reason"] for line in rejects.read_text().splitlines()]
    lines = [json.loads(line)["line"] for line in rejects.read_text().splitlines()]
    assert lines == [2, 3, 4, 5, 6, 7, 8, 9, 11, 13]
    expected = ["missing key 'response'", "empty 'prompt'", "'response' must be a string", "not valid UTF-8",
                "lone surrogate", "over max_chars=40", "invalid JSON", "not a JSON object", "duplicate id 7", "no assistant turn"]
    for needle, reason in zip(expected, reasons):
        assert needle in reason, (needle, reason)


def test_reject_ratio_fails_loudly(tmp_path):
    path = _write(tmp_path / "d.jsonl", [GOOD] * 8 + [{"prompt": "a"}] * 2)
    with pytest.raises(DataError, match=r"2 of 10 rows \(20.0%\) rejected.*missing key"):
        load_rows(path, "sft", rejects_path=tmp_path / "r.jsonl", max_reject_ratio=0.1)
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 2  # rejects kept for inspection
    assert len(load_rows(path, "sft", rejects_path=tmp_path / "r.jsonl", max_reject_ratio=0.2).rows) == 8


def test_pref_and_rl_rules(tmp_path):
    path = _write(tmp_path / "p.jsonl", [{"prompt": "p", "chosen": " 1", "rejected": " 2"}, {"prompt": "p", "chosen": " 1", "rejected": " 1"}])
    res = load_rows(path, "pref", rejects_path=tmp_path / "r.jsonl", max_reject_ratio=1.0)
    assert len(res.rows) == 1 and "chosen == rejected" in next(iter(res.reasons))
    path = _write(tmp_path / "rl.jsonl", [{"prompt": "p", "label": 5}, {"prompt": "p", "label": [5]}])
    res = load_rows(path, "rl", rejects_path=tmp_path / "r.jsonl", max_reject_ratio=1.0)
    assert res.rows[0]["label"] == "5" and res.num_rejected == 1


def test_parquet_and_hf_dataset_dir(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    rows = [GOOD, {"prompt": "Q: 2+2= A:", "response": " 4"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert load_rows(tmp_path / "d.parquet", "sft", rejects_path=tmp_path / "r.jsonl").rows == rows
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    assert load_rows(tmp_path / "hf", "sft", rejects_path=tmp_path / "r.jsonl").rows == rows


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_rows(tmp_path / "nope.jsonl", "sft", rejects_path=tmp_path / "r.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported data format"):
        load_rows(tmp_path / "x.csv", "sft", rejects_path=tmp_path / "r.jsonl")


def test_key_mapping_reads_openrlhf_style_columns(tmp_path):
    """input_key / label_key / chosen_key / rejected_key name the file's columns (OpenRLHF's flags);
    a row with neither that column nor ours is rejected with a reason naming it."""
    from rlhf_core.training.config import TrainConfig
    from rlhf_core.training.inputs import load_data

    f = tmp_path / "math.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [{"question": "1+1=", "answer": 2}, {"question": "2+2=", "answer": "4"},
                                                  {"prompt": "3+3=", "answer": "6"}, {"q": "4+4=", "answer": "8"}]) + "\n")
    cfg = TrainConfig(input_key="question", label_key="answer", max_reject_ratio=0.5)
    rows = load_data(str(f), "rl", cfg, tmp_path / "rejects.jsonl")
    # a row with our own column name instead reads as is (the task's own eval data beside a user's)
    assert [(r["prompt"], r["label"]) for r in rows] == [("1+1=", "2"), ("2+2=", "4"), ("3+3=", "6")]
    reject = json.loads((tmp_path / "rejects.jsonl").read_text())
    assert reject["line"] == 4 and reject["reason"] == "missing key 'question' (the prompt column, set by its *_key setting)"
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"q": "hi", "good": "hello", "bad": "go away"}) + "\n")
    cfg = TrainConfig(input_key="q", chosen_key="good", rejected_key="bad")
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in load_data(str(pairs), "pref", cfg, tmp_path / "r2.jsonl")] == [
        ("hi", "hello", "go away")]
    with pytest.raises(DataError, match="missing key 'good '"):  # a typo in the setting
        load_data(str(pairs), "pref", TrainConfig(input_key="q", chosen_key="good ", rejected_key="bad"), tmp_path / "r3.jsonl")


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    """`load_dataset`'s cache in the test's directory, not the user's."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")


def test_hub_dataset_path_loads_through_load_dataset_with_its_split(tmp_path, datasets_cache):
    """`hf://NAME[:SPLIT]` is `datasets.load_dataset(NAME, split=SPLIT)` (default `train`); here
    NAME is a local directory of JSONL files, which load_dataset reads offline.  Rows are validated
    like any file's."""
    hub = tmp_path / "hubdata"
    hub.mkdir()
    _write(hub / "train.jsonl", [GOOD, {"prompt": "Q: 2+2= A:", "response": " 4"}, {"prompt": "Q: 3+3= A:", "response": ""}])
    _write(hub / "test.jsonl", [{"prompt": "Q: 5+5= A:", "response": " 10"}])
    rejects = tmp_path / "r.jsonl"
    res = load_rows(f"hf://{hub}", "sft", rejects_path=rejects, max_reject_ratio=0.5)
    assert [r["response"] for r in res.rows] == [" 2", " 4"] and res.num_rejected == 1
    assert json.loads(rejects.read_text())["reason"] == "empty 'response'" and json.loads(rejects.read_text())["source"] == f"hf://{hub}"
    assert [r["response"] for r in load_rows(f"hf://{hub}:test", "sft", rejects_path=rejects).rows] == [" 10"]
    with pytest.raises(DataError, match=r"load_dataset\(.*split='validation'.*failed"):
        load_rows(f"hf://{hub}:validation", "sft", rejects_path=rejects)


def test_hub_dataset_name_split_and_revision_reach_load_dataset(tmp_path, monkeypatch):
    import datasets

    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda name, **kw: calls.append((name, kw)) or [GOOD])
    for path in ("hf://org/data", "hf://org/data:test[:10]", "hf://org/data@v2:validation"):
        assert load_rows(path, "sft", rejects_path=tmp_path / "r.jsonl").rows == [GOOD]
    assert calls == [("org/data", {"split": "train", "revision": None}), ("org/data", {"split": "test[:10]", "revision": None}),
                     ("org/data", {"split": "validation", "revision": "v2"})]
    with pytest.raises(DataError, match="not a hub dataset"):
        load_rows("hf://org/data@:test", "sft", rejects_path=tmp_path / "r.jsonl")


@pytest.mark.parametrize("typo", ["my-org/missing", "artifact/data/sft.jsonl", "org/data:train"])
def test_a_missing_local_data_path_is_never_a_hub_lookup(typo, tmp_path, monkeypatch):
    import datasets

    def refuse(*args, **kwargs):
        raise AssertionError(f"load_dataset called for {args}")
    monkeypatch.setattr(datasets, "load_dataset", refuse)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r"no such file or directory \(a local path; a hub dataset is written hf://NAME"):
        load_rows(typo, "sft", rejects_path=tmp_path / "r.jsonl")
