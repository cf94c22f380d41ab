"""Model references are local unless they say `hf://`: a typo is a FileNotFoundError before any hub
call, and `hf://ORG/NAME@REV` reaches transformers (and vLLM) as ORG/NAME with revision REV."""
import json
import sys
import types

import pytest

from rlhf_core.models import load

pytestmark = pytest.mark.unit

LOADERS = ("AutoTokenizer", "AutoConfig", "AutoProcessor", "AutoModelForCausalLM", "AutoModelForImageTextToText",
           "AutoModelForSequenceClassification", "AutoModelForTokenClassification")


@pytest.fixture
def calls(monkeypatch):
    """Every transformers `from_pretrained` recorded as (class, name, kwargs) instead of run: no
    hub call can happen; the config answers "no vision tower"."""
    import transformers

    seen = []
    for cls in LOADERS:
        def fake(name, _cls=cls, **kwargs):
            seen.append((_cls, name, kwargs))
            return types.SimpleNamespace(pad_token_id=0)  # a tokenizer with a pad token; a config without vision_config
        monkeypatch.setattr(getattr(transformers, cls), "from_pretrained", fake)
    return seen


@pytest.mark.parametrize("typo", ["artifact/sft/model", "my-org/missing", "missing-model", "./nowhere", "/no/such/model"])
def test_a_missing_local_path_is_an_error_not_a_hub_download(typo, calls, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for loader in (load.load_tokenizer, load.load_model, load.load_processor, load.is_vision_model):
        with pytest.raises(FileNotFoundError, match=rf"{typo!r} does not exist locally.*hf://ORG/NAME"):
            loader(typo)
    assert calls == []  # nothing reached transformers, so nothing reached the hub


@pytest.mark.parametrize("ref, name, revision", [("hf://org/name@rev", "org/name", "rev"), ("hf://Org/model-1.5B", "Org/model-1.5B", None),
                                                 ("hf://org/name@refs/pr/3", "org/name", "refs/pr/3")])
def test_hub_ids_are_stripped_and_carry_their_revision(ref, name, revision, calls, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load.resolve_model_ref(ref) == (name, revision, True)
    load.load_tokenizer(ref)
    load.load_processor(ref)
    assert load.is_vision_model(ref) is False
    load.load_model(ref, "reward", dtype=None)
    load.load_model(ref, "causal_lm")
    pins = {} if revision is None else {"revision": revision}
    assert [(cls, n, {k: v for k, v in kw.items() if k == "revision"}) for cls, n, kw in calls] == [
        (cls, name, pins) for cls in ("AutoTokenizer", "AutoProcessor", "AutoConfig", "AutoModelForSequenceClassification",
                                      "AutoConfig", "AutoModelForCausalLM")]


@pytest.mark.parametrize("bad", ["hf://name-without-org", "hf://../etc/passwd", "hf:///abs/path", "hf://./org/name", "hf://org/name@",
                                 "hf://org/a/b", "hf://org/name@../../x", "hf://org/na me"])
def test_malformed_hub_ids_are_refused(bad, calls):
    with pytest.raises(ValueError, match="not a hub id"):
        load.load_tokenizer(bad)
    assert calls == []


def test_a_hub_id_that_is_also_a_local_path_is_refused(calls, tmp_path, monkeypatch):
    """transformers would quietly load the local directory instead of the hub model asked for."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    with pytest.raises(ValueError, match="also a local path"):
        load.load_tokenizer("hf://org/name")
    assert calls == []


def test_an_existing_local_path_loads_as_is(calls, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llava", "vision_config": {}}))
    assert load.resolve_model_ref(str(model)) == (str(model), None, False)
    assert load.is_vision_model(str(model)) is True  # read from config.json, no transformers call
    load.load_tokenizer(str(model))
    assert calls == [("AutoTokenizer", str(model), {"trust_remote_code": False})]  # no revision keyword for a local path


def test_the_vllm_engine_gets_the_stripped_hub_id_and_never_a_typo(tmp_path, monkeypatch):
    from rlhf_core.rollout.engines import VLLMEngine

    made = []
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=lambda **kw: made.append(kw)))
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE"):  # the engine sets them: undone after the test
        monkeypatch.setenv(var, "0")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="hf://ORG/NAME"):
        VLLMEngine("my-org/missing", max_model_len=64, seed=0)
    assert made == []
    VLLMEngine("hf://org/name@v1", max_model_len=64, seed=0)
    assert (made[0]["model"], made[0]["revision"], made[0]["tokenizer_revision"]) == ("org/name", "v1", "v1")


def test_a_hub_input_is_recorded_by_name_in_the_manifest_and_lineage(tmp_path, monkeypatch):
    """A stage started from `hf://ORG/NAME@REV` names it in its manifest (nothing local to hash):
    `lineage show` lists it, flags an unpinned one, and `lineage verify` does not call it missing."""
    from rlhf_core.artifacts.lineage import render, verify_chain
    from rlhf_core.training import results
    from rlhf_core.training.config import TrainConfig

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "response": "2"}\n')
    for name, ref in (("pinned", "hf://org/name@v1"), ("floating", "hf://org/name")):
        out = tmp_path / name
        out.mkdir()
        results.finish(out, "sft", TrainConfig(model_path=ref, train_data="train.jsonl", eval_data=""), {"eval/accuracy": 0.5})
        inputs = json.loads((out / "manifest.json").read_text())["inputs"]
        assert {"path": ref, "kind": "hub"} in inputs and any(i["kind"] == "data" for i in inputs)
        assert verify_chain(out) == []
        shown = render(out)
        assert f"hub {ref}" in shown and (("no revision pinned" in shown) == (name == "floating"))
