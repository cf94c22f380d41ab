"""`rlhf prepare` end to end on a small task: data, base model, manifests, HF and vLLM loading."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import SMALL_TASK
from conftest import rlhf as _rlhf

from rlhf_core.artifacts.manifest import verify_manifest

pytestmark = pytest.mark.xdist_group("prepare")  # one project fixture for the file


@pytest.fixture(scope="module")
def prepared(project):
    return project


@pytest.mark.e2e
def test_outputs_and_manifests(prepared):
    data, base = prepared / "data", prepared / "artifacts" / "base"
    for name in ("sft.jsonl", "prefs.jsonl", "rl.jsonl", "eval.jsonl", "eval_prefs.jsonl", "manifest.json"):
        assert (data / name).is_file(), name
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md", "metrics.json", "manifest.json"):
        assert (base / name).is_file(), name
    assert len((data / "sft.jsonl").read_text().splitlines()) == 600
    manifest = json.loads((base / "manifest.json").read_text())
    assert manifest["stage"] == "prepare" and manifest["inputs"][0]["kind"] == "artifact"
    assert manifest["config"]["task"]["num_sft"] == 600 and len(manifest["config_sha256"]) == 64
    assert verify_manifest(base) == [] and verify_manifest(data) == []
    # a flipped byte in the weights is detected
    weights = base / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 1
    weights.write_bytes(bytes(blob))
    try:
        assert verify_manifest(base) == [f"{weights}: sha256 mismatch"]
    finally:
        blob[-1] ^= 1
        weights.write_bytes(bytes(blob))


@pytest.mark.e2e
def test_deterministic(prepared, tmp_path):
    args = [a for s in SMALL_TASK for a in ("--set", s)]
    assert _rlhf("prepare", "--params", "none.yaml", *args, cwd=tmp_path).returncode == 0
    for rel in ("data/sft.jsonl", "data/eval.jsonl", "artifacts/base/model.safetensors", "artifacts/base/tokenizer.json"):
        assert (tmp_path / rel).read_bytes() == (prepared / rel).read_bytes(), rel


@pytest.mark.integration
def test_transformers_loads_and_generates(prepared):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = prepared / "artifacts" / "base"
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    # Qwen3: Llama plus per-head RMSNorm on q and k (QK-norm), loaded natively by transformers and vLLM
    assert model.config.head_dim == 64 and model.config.model_type == "qwen3"
    assert hasattr(model.model.layers[0].self_attn, "q_norm")
    ids = tok("Q: 12+30= A:", return_tensors="pt").input_ids
    assert ids[0, 0].item() == tok.bos_token_id
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    assert tok.decode(tok("Q: 12+30= A: 42").input_ids, skip_special_tokens=True) == "Q: 12+30= A: 42"
    # digits are single tokens so arithmetic is learnable
    assert [tok.decode([i]) for i in tok(" 9517", add_special_tokens=False).input_ids][-4:] == ["9", "5", "1", "7"]
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


VLLM_SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=128, gpu_memory_utilization=0.05, enforce_eager=True, seed=0)
    prompts = ["Q: 12+30= A:", "Q: 7-3= A:"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, logprobs=0))
    print("RESULT" + json.dumps([[list(o.prompt_token_ids), list(o.outputs[0].token_ids)] for o in outs]))
""")


@pytest.mark.integration
def test_vllm_cpu_loads_and_matches_transformers_greedy(prepared, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    base = prepared / "artifacts" / "base"
    script = tmp_path / "gen.py"
    script.write_text(VLLM_SCRIPT)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, str(script), str(base)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))[6:])
    model = AutoModelForCausalLM.from_pretrained(base)
    for prompt_ids, vllm_ids in results:
        hf = model.generate(torch.tensor([prompt_ids]), max_new_tokens=6, do_sample=False)[0, len(prompt_ids):].tolist()
        assert vllm_ids == hf[: len(vllm_ids)] and len(vllm_ids) > 0


@pytest.mark.e2e
def test_cli_config_errors(tmp_path):
    proc = _rlhf("prepare", "--params", "none.yaml", "--set", "prepare.task.num_sfts=5", cwd=tmp_path)
    assert proc.returncode == 2
    assert "unknown config key prepare.task.num_sfts" in proc.stderr and "prepare.task.num_sft" in proc.stderr
    proc = _rlhf("prepare", "--params", "none.yaml", "--set", "prepare.model.num_heads=8", cwd=tmp_path)
    assert proc.returncode == 2 and "must be 64" in proc.stderr
    proc = _rlhf("config", "show", "prepare", "--set", "prepare.seed=3", "--params", "none.yaml", cwd=tmp_path)
    assert proc.returncode == 0 and json.loads(proc.stdout)["config"]["seed"] == 3


@pytest.mark.e2e
def test_cli_data_check(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "p", "response": "r"}\n{"prompt": "p"}\n')
    proc = _rlhf("data", "check", str(path), "--kind", "sft", cwd=tmp_path)
    assert proc.returncode == 1 and "1 of 2 rows (50.0%) rejected" in proc.stderr
    proc = _rlhf("data", "check", str(path), "--kind", "sft", "--max-reject-ratio", "0.5", cwd=tmp_path)
    assert proc.returncode == 0 and "1 valid / 2 rows" in proc.stdout
    assert "missing key 'response'" in Path(f"{path}.rejects.jsonl").read_text()
