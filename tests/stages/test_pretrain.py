"""The pretrain stage as a real Ray job: packing, learning, resume, a user's own text corpus."""
import json

import pytest
from conftest import run_stage

from rlhf_core.artifacts.manifest import verify_manifest
from rlhf_core.data.corpus import check_corpus, expressions
from rlhf_core.data.tokenize import pack_documents

pytestmark = pytest.mark.xdist_group("pretrain")
PT = ["--set", "pretrain.max_steps=40", "--set", "pretrain.save_steps=20", "--set", "pretrain.log_steps=20",
      "--set", "pretrain.warmup_steps=5", "--set", "pretrain.eval_max_new_tokens=3"]


@pytest.mark.unit
def test_pack_documents_is_a_seeded_cut_of_the_concatenation():
    docs = [[1, 10, 11, 2], [1, 20, 2], [1, 30, 31, 32, 2]]
    windows, dropped = pack_documents(docs, 4, seed=0)
    flat = [t for w in windows for t in w["input_ids"]]
    assert len(windows) == 3 and dropped == 0 and all(w["loss_mask"] == [1] * 4 for w in windows)
    assert sorted(flat) == sorted(t for d in docs for t in d)  # every token once
    assert pack_documents(docs, 4, seed=0) == (windows, 0)  # deterministic
    assert pack_documents(docs, 5, seed=0)[1] == 2  # the tail that does not fill a window


@pytest.mark.unit
def test_corpus_leak_check():
    assert expressions("Q: 07+52= A: 58\nVerdict: wrong") == {"07+52"}
    check_corpus([{"id": "a", "text": "17+52=69"}], {"07+52"})  # 17+52 is not 07+52
    with pytest.raises(ValueError, match="leaked"):
        check_corpus([{"id": "b", "text": "x 07+52=59"}], {"07+52"})


@pytest.mark.integration
def test_pretrain_learns_the_corpus_and_resumes(project, ray_head):
    corpus = [json.loads(x)["text"] for x in (project / "data" / "pretrain.jsonl").read_text().splitlines()]
    assert any("Verdict: wrong" in t for t in corpus) and any(t.startswith("Q: ") and "\n" not in t for t in corpus)
    held = {json.loads(x)["prompt"][3:-4] for f in ("eval.jsonl", "eval_prefs.jsonl") for x in (project / "data" / f).read_text().splitlines()}
    assert not any(expressions(t) & held for t in corpus)

    proc = run_stage(project, ray_head, "pretrain", *PT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    out = project / "artifacts" / "pretrain"
    m = json.loads((out / "metrics.json").read_text())
    # a learning check, not a smoke test: from ~log(vocab) = 5.6 nats to well under half in 40 steps
    assert m["eval/loss_init"] > 5.0 and m["train/loss"] < 2.5 and m["eval/loss"] < m["eval/loss_init"] - 2.5, m
    assert m["train/tokens"] == 40 * 16 * 128
    assert verify_manifest(out) == []
    manifest = json.loads((out / "manifest.json").read_text())
    assert {i["path"] for i in manifest["inputs"]} == {"data", "artifacts/base"}, manifest["inputs"]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out / "model").config.model_type == "qwen3"

    more = run_stage(project, ray_head, "pretrain", *PT, "--set", "pretrain.max_steps=45")
    assert more.returncode == 0 and "resumed from step_000040" in more.stdout, more.stdout[-3000:]


@pytest.mark.integration
def test_continued_pretraining_on_a_users_parquet_text(project, ray_head, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"note {i}: the sum of {i} and {i} is {2 * i}." for i in range(300)] + [""]  # one empty row: rejected
    pq.write_table(pa.table({"text": texts}), tmp_path / "corpus.parquet")
    out = "artifacts/pretrain_user"
    proc = run_stage(project, ray_head, "pretrain", "--set", f"pretrain.train_data={tmp_path / 'corpus.parquet'}",
                     "--set", f"pretrain.output_dir={out}", "--set", "pretrain.max_steps=6", "--set", "pretrain.max_len=64",
                     "--set", "pretrain.global_batch_size=8", "--set", "pretrain.eval_max_new_tokens=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rejects = (project / out / "rejects" / "train.jsonl").read_text().splitlines()
    assert len(rejects) == 1 and "empty 'text'" in rejects[0]
    assert json.loads((project / out / "metrics.json").read_text())["train/steps"] == 6
