"""RolloutBatch: columns stay aligned through select / slice / concat, new columns come as new
batches, and the step's Parquet file is derived from it (every field stored or named as not)."""
from dataclasses import fields

import pyarrow.parquet as pq
import pytest
import torch
from conftest import make_batch

from rlhf_core.rollout import parquet
from rlhf_core.rollout.batch import RolloutBatch

pytestmark = pytest.mark.unit


def three():
    """Responses of 2, 4 and 1 tokens."""
    return make_batch([{"token_ids": [1, 2] + r, "prompt_len": 2, "action_mask": [1] * len(r), "group": g, "sample_index": k}
                       for r, g, k in (([5, 6], 0, 0), ([5, 6, 7, 8], 0, 1), ([9], 1, 0))])


def test_select_and_slices_keep_columns_aligned_and_trim_the_width():
    b = three().with_columns(old_logprobs=[[-1.0, -2.0], [-3.0, -4.0, -5.0, -6.0], [-7.0]])
    assert b.width == 4 and b.old_logprobs[2].tolist() == [-7.0, 0.0, 0.0, 0.0]
    sub = b.select([2, 0])
    assert sub.group == [1, 0] and sub.width == 2 and sub.old_logprobs.tolist() == [[-7.0, 0.0], [-1.0, -2.0]]
    assert b[1::2].token_ids == [[1, 2, 5, 6, 7, 8]] and len(b[0:2]) == 2
    assert b.per_token("old_logprobs", 1) == [-3.0, -4.0, -5.0, -6.0]
    assert len(b.select([])) == 0


def test_concat_pads_to_the_widest_and_refuses_half_set_columns():
    a, b = three().select([2]), three().select([1])
    both = RolloutBatch.concat([a, b])
    assert both.width == 4 and both.action_mask.tolist() == [[1, 0, 0, 0], [1, 1, 1, 1]] and both.sample_index == [0, 1]
    with pytest.raises(ValueError, match="column score is set in some batches only"):
        RolloutBatch.concat([a.with_columns(score=[1.0]), b])


def test_with_columns_is_a_new_batch_and_checks_lengths():
    b = three()
    c = b.with_columns(score=[1.0, 0.0, 0.5])
    assert b.score is None and c.score == [1.0, 0.0, 0.5]
    with pytest.raises(ValueError, match="column score has 2 rows, the batch 3"):
        b.with_columns(score=[1.0, 0.0])
    with pytest.raises(ValueError, match="narrower"):
        b.with_columns(advantages=torch.zeros(3, 2))


def test_parquet_records_are_derived_from_the_batch(tmp_path):
    """Every Parquet column is a batch field or derived; every batch field is stored or named as
    not stored; a step's records round-trip through the file."""
    names = {f.name for f in fields(RolloutBatch)}
    columns = set(parquet.SCHEMA.names)
    assert columns - names <= parquet.DERIVED and names - columns - {"old_values"} == parquet.NOT_STORED
    b = three().with_columns(score=[1.0, float("nan"), 0.5], reward=[1.0, float("nan"), 0.5], invalid=[None, "bad", None],
                             components=[{"a": 1.0}, {}, {"a": 0.5}], filter=["kept", "invalid", "kept"])
    rows = parquet.records(b, "run-1", 3)
    kept = b.select([0, 2]).with_columns(old_logprobs=[[-1.0, -2.0], [-0.5]], kl=[[0.25, 0.5], [1.0]])
    for i, row in zip([0, 2], parquet.records(kept, "run-1", 3)):
        rows[i] = row
    path = parquet.write_step(tmp_path, 3, rows)
    back = pq.read_table(path).to_pylist()
    assert [r["filter"] for r in back] == ["kept", "invalid", "kept"] and back[1]["invalid_reason"] == "bad"
    assert back[1]["score"] is None and back[1]["old_logprobs"] is None and back[0]["old_logprobs"] == [-1.0, -2.0]
    assert back[0]["kl"] == pytest.approx(0.75) and back[1]["response_token_ids"] == [5, 6, 7, 8] and back[2]["action_mask"] == [1]
    assert "step" in parquet.summarize(str(tmp_path))
