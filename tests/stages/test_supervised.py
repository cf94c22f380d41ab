"""sft, rm and dpo as real Ray jobs on DeepSpeed workers: outputs, exact resume, bad input."""
import json
from pathlib import Path

import pytest
import torch
from conftest import SFT, SFT_CURVE, history, rlhf, run_stage
from safetensors.torch import load_file

from rlhf_core.artifacts.manifest import verify_manifest

pytestmark = pytest.mark.integration
# xdist groups: tests sharing fixtures run on one worker; the groups balance `make test`'s workers

def weights(path: Path) -> dict:
    return load_file(str(path / "model" / "model.safetensors"))


@pytest.mark.xdist_group("sft_later")
def test_sft_outputs(sft_reference):
    out = sft_reference
    for rel in ("model/model.safetensors", "model/tokenizer.json", "model/README.md", "metrics.json", "manifest.json",
                "checkpoints/latest", "tensorboard"):
        assert (out / rel).exists(), rel
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_000006", "step_000008"]  # keep=2
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("eval/accuracy", "eval/accuracy_init", "eval/loss", "eval/loss_init", "train/loss"):
        assert key in metrics, key
    assert metrics["eval/loss"] < metrics["eval/loss_init"]  # it learns something in 8 steps
    assert verify_manifest(out) == []
    # the checkpoints' hash record (outside checkpoints/) is part of the artifact, and lists the kept ones
    manifest = json.loads((out / "manifest.json").read_text())
    assert "checkpoint_hashes.json" in manifest["files"]
    assert sorted(json.loads((out / "checkpoint_hashes.json").read_text())) == ["step_000006", "step_000008"]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out / "model").config.model_type == "qwen3"  # prepare's default tiny model
    assert "Supervised fine-tuning" in (out / "model" / "README.md").read_text()


@pytest.mark.xdist_group("sft_faults")
def test_sigkill_then_resume_is_bit_identical(project, ray_head, sft_reference):
    out = "artifacts/sft_killed"
    args = [*SFT, "--set", f"sft.output_dir={out}"]
    killed = run_stage(project, ray_head, "sft", *args, env={"RLHF_FAULT": "sigkill_after_step:5"})
    assert killed.returncode != 0
    assert (project / out / "checkpoints" / "latest").read_text() == "step_000003"
    resumed = run_stage(project, ray_head, "sft", *args)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "resumed from step_000003" in resumed.stdout, resumed.stdout[-3000:]
    a, b = weights(sft_reference), weights(project / out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["train/loss"] for r in history(project / out)] == [r["train/loss"] for r in history(sft_reference)]

    # nothing left to train is an error, not a silent success
    again = run_stage(project, ray_head, "sft", *args)
    assert again.returncode != 0 and "nothing to train" in again.stdout + again.stderr

    # a corrupted newest checkpoint is detected and the previous complete one is used
    latest = project / out / "checkpoints" / "step_000008"
    victim = next(p for p in sorted(latest.rglob("*")) if p.is_file() and p.suffix == ".pt")
    blob = bytearray(victim.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    victim.write_bytes(bytes(blob))
    more = run_stage(project, ray_head, "sft", *args, "--set", "sft.max_steps=9")
    text = more.stdout + more.stderr
    assert more.returncode == 0, text[-3000:]
    assert "sha256 mismatch" in text and "resumed from step_000006" in text


# (workers, ZeRO stage, further settings): the same global batch of 16 as conftest's sft_loss_curve
LAYOUTS = {
    # data parallelism and sharding at once, each rank's 8 in 2 micro-batches of 4
    "2 workers, ZeRO-2, accumulation 2": (2, 2, ("sft.micro_batch_size=4",)),
    # 4 micro-batches of 2, parameters and optimizer states offloaded, activations recomputed
    "2 workers, ZeRO-3 + offload, accumulation 4, checkpointing": (
        2, 3, ("sft.micro_batch_size=2", "sft.offload=all", "sft.gradient_checkpointing=true")),
}


@pytest.mark.xdist_group("sft_faults")
def test_memory_layouts_give_the_same_loss_curve(project, ray_head, sft_loss_curve):
    """Gradient accumulation, ZeRO-2/3, CPU offload and gradient checkpointing change where memory
    goes, not the update: every layout's loss curve is the single worker's."""
    for i, (name, (n, zero, extra)) in enumerate(LAYOUTS.items()):
        out = f"artifacts/sft_layout{i}"
        sets = [a for kv in extra for a in ("--set", kv)]
        proc = run_stage(project, ray_head, "sft", *SFT_CURVE, "--set", f"sft.num_workers={n}", "--set", f"sft.zero_stage={zero}",
                         "--set", f"sft.output_dir={out}", *sets)
        assert proc.returncode == 0, f"{name}: {proc.stdout[-3000:]}"
        assert [r["train/loss"] for r in history(project / out)] == pytest.approx(sft_loss_curve, rel=1e-4), name


@pytest.mark.xdist_group("sft_faults")
def test_nan_loss_is_skipped_then_aborts_without_checkpoint(project, ray_head):
    out = "artifacts/sft_nan"
    proc = run_stage(project, ray_head, "sft", *SFT, "--set", f"sft.output_dir={out}", "--set", "sft.max_nan_steps=2",
                     env={"RLHF_FAULT": "nan_loss"})
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "non-finite loss, update skipped" in text and "2 consecutive steps with a non-finite loss" in text
    assert not list((project / out / "checkpoints").glob("step_*"))


@pytest.mark.xdist_group("sft_faults")
def test_bad_inputs_have_clear_errors(project, ray_head, tmp_path):
    proc = run_stage(project, ray_head, "sft", "--set", "sft.model_path=artifacts/nope", "--set", "sft.output_dir=artifacts/sft_bad")
    assert proc.returncode != 0 and "model_path 'artifacts/nope' does not exist" in proc.stdout + proc.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "Q: 1+1= A:"}\n' * 3 + '{"prompt": "Q: 1+1= A:", "response": " 2"}\n')
    proc = run_stage(project, ray_head, "sft", "--set", "sft.model_path=artifacts/base", "--set", f"sft.train_data={bad}",
                     "--set", "sft.output_dir=artifacts/sft_bad")
    assert proc.returncode != 0 and "3 of 4 rows (75.0%) rejected" in proc.stdout + proc.stderr
    proc = run_stage(project, ray_head, "sft", "--set", "sft.model_path=artifacts/base", "--set", "sft.max_len=5",
                     "--set", "sft.output_dir=artifacts/sft_bad")
    assert proc.returncode != 0 and "over max_len=5 tokens" in proc.stdout + proc.stderr
    proc = rlhf("stage", "run", "sft", "--params", "none.yaml", "--set", "sft.lrr=1", cwd=project)
    assert proc.returncode == 2 and "sft.lr," in proc.stderr


@pytest.mark.xdist_group("sft_later")
def test_rm_stage(project, ray_head, sft_reference):
    # under ZeRO-3 with parameters and optimizer states offloaded (every stage runs so)
    proc = run_stage(project, ray_head, "rm", "--set", "rm.max_steps=6", "--set", "rm.save_steps=3", "--set", "rm.global_batch_size=16",
                     "--set", "rm.zero_stage=3", "--set", "rm.offload=all")
    assert proc.returncode == 0, proc.stdout[-3000:]
    out = project / "artifacts" / "rm"
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0.0 <= metrics["eval/pair_accuracy"] <= 1.0 and "eval/pair_accuracy_init" in metrics
    stats = json.loads((out / "model" / "reward_stats.json").read_text())
    assert stats["std"] > 0
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(out / "model")
    assert model.config.num_labels == 1
    assert verify_manifest(out) == []


@pytest.fixture(scope="module")
def dpo_artifact(project, ray_head, sft_reference):
    """artifacts/dpo from the sft model (test_dpo_stage checks it, the lineage test walks it), under
    ZeRO-3 + offload with gradient accumulation (micro-batches of 4 pairs)."""
    proc = run_stage(project, ray_head, "dpo", "--set", "dpo.max_steps=4", "--set", "dpo.save_steps=2", "--set", "dpo.global_batch_size=16",
                     "--set", "dpo.eval_max_new_tokens=4", "--set", "dpo.zero_stage=3", "--set", "dpo.offload=all", "--set", "dpo.micro_batch_size=4")
    assert proc.returncode == 0, proc.stdout[-3000:]
    return project / "artifacts" / "dpo"


@pytest.mark.xdist_group("sft_later")
def test_dpo_stage(dpo_artifact, sft_reference):
    out = dpo_artifact
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy", "eval/accuracy", "eval/accuracy_init"):
        assert key in metrics, key
    # the reference is the sft model: dpo's starting accuracy is the sft model's accuracy
    assert metrics["eval/accuracy_init"] == json.loads((sft_reference / "metrics.json").read_text())["eval/accuracy"]
    cache = json.loads((out / "checkpoints" / "reference_logps.json").read_text())
    assert len(cache["logps"]) == 400
    # per held-out pair implicit rewards beta (log pi - log ref): one row per pair, the metrics summarise them
    rows = [json.loads(line) for line in (out / "eval_pair_rewards.jsonl").read_text().splitlines()]
    held_out = (out.parent.parent / "data" / "eval_prefs.jsonl").read_text().splitlines()
    assert len(rows) == len(held_out) > 0 and rows[0]["chosen"].startswith(rows[0]["rejected"][:6])
    assert any(r["chosen_reward"] != 0.0 for r in rows)  # 4 steps moved the policy away from its reference
    assert metrics["eval/rewards_accuracy"] == sum(r["chosen_reward"] > r["rejected_reward"] for r in rows) / len(rows)
    assert "eval_pair_rewards.jsonl" in json.loads((out / "manifest.json").read_text())["files"]
    assert verify_manifest(out) == []


@pytest.mark.xdist_group("sft_later")
def test_dpo_sigkill_at_an_epoch_boundary_then_resume_is_bit_identical(project, ray_head, sft_reference):
    """dpo on 32 pairs, 16 per step: an epoch is 2 steps.  Killed after step 3, it resumes from
    step 2 (exactly one epoch consumed) and crosses two more epoch boundaries; weights and the
    per-step losses equal the uninterrupted run's, so no sample was skipped or replayed."""
    small = project / "prefs_32.jsonl"  # not under data/: that directory's manifest lists exactly prepare's files
    small.write_text("".join((project / "data" / "prefs.jsonl").read_text().splitlines(keepends=True)[:32]))
    # a length-normalised loss (needs each response's length from the workers' forward) through the stage
    base = ["--set", f"dpo.train_data={small}", "--set", "dpo.max_steps=5", "--set", "dpo.save_steps=2",
            "--set", "dpo.global_batch_size=16", "--set", "dpo.eval_max_new_tokens=2", "--set", "dpo.loss_type=sigmoid_norm"]
    runs, outputs = {}, {}
    for name, fault in (("dpo_uninterrupted", None), ("dpo_killed", "sigkill_after_step:3")):
        args = [*base, "--set", f"dpo.output_dir=artifacts/{name}"]
        proc = run_stage(project, ray_head, "dpo", *args, env={"RLHF_FAULT": fault} if fault else None)
        runs[name] = args
        assert (proc.returncode != 0) == bool(fault), proc.stdout[-3000:]
        outputs[name] = proc.stdout[-3000:] + proc.stderr[-2000:]
    killed = project / "artifacts" / "dpo_killed"
    assert (killed / "checkpoints" / "latest").exists(), outputs["dpo_killed"]
    assert (killed / "checkpoints" / "latest").read_text() == "step_000002"
    resumed = run_stage(project, ray_head, "dpo", *runs["dpo_killed"])
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "resumed from step_000002 (step 2, 32 samples consumed)" in resumed.stdout + resumed.stderr
    a, b = weights(project / "artifacts" / "dpo_uninterrupted"), weights(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in history(killed)] == [1, 2, 3, 4, 5]
    assert [r["train/loss"] for r in history(killed)] == [r["train/loss"] for r in history(project / "artifacts" / "dpo_uninterrupted")]
    assert json.loads((killed / "config.resolved.json").read_text())["config"]["loss_type"] == "sigmoid_norm"


@pytest.mark.xdist_group("sft_later")
def test_kto_on_unpaired_rows_through_the_dpo_stage(project, ray_head, sft_reference):
    """dpo.loss_type=kto on `prompt, completion, label` rows (each preference pair split into a
    desirable and an undesirable completion, as users convert paired data); a bad label is rejected
    with its reason."""
    rows = [json.loads(line) for line in (project / "data" / "prefs.jsonl").read_text().splitlines()[:16]]
    unpaired = [{"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"} for r in rows for side in ("chosen", "rejected")]
    unpaired.append({"prompt": rows[0]["prompt"], "completion": "x", "label": "yes"})  # 1 of 33 rejected: under the 5% limit
    path = project / "kto.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in unpaired))
    proc = run_stage(project, ray_head, "dpo", "--set", f"dpo.train_data={path}", "--set", "dpo.loss_type=kto", "--set", "dpo.max_steps=3",
                     "--set", "dpo.save_steps=3", "--set", "dpo.global_batch_size=16", "--set", "dpo.eval_max_new_tokens=2",
                     "--set", "dpo.output_dir=artifacts/dpo_kto")
    assert proc.returncode == 0, proc.stdout[-3000:]
    out = project / "artifacts" / "dpo_kto"
    hist = history(out)
    assert len(hist) == 3 and all("kto/kl" in h and "rewards/chosen" in h for h in hist)
    assert hist[0]["kto/desirable_frac"] == pytest.approx(0.5, abs=0.2)
    rejects = (out / "rejects" / "train.jsonl").read_text()
    assert "'label' must be true (desirable) or false (undesirable)" in rejects
    assert verify_manifest(out) == []


@pytest.mark.xdist_group("sft_later")
def test_lineage_show_and_verify_chain(project, dpo_artifact):
    """dpo <- sft <- base <- data: the tree prints, verifies, and a flipped byte anywhere fails it."""
    shown = rlhf("lineage", "show", "artifacts/dpo/model", cwd=project)
    assert shown.returncode == 0, shown.stderr
    for stage in ("[dpo]", "[sft]", "[prepare]", "[prepare-data]"):
        assert stage in shown.stdout, (stage, shown.stdout)
    ok = rlhf("lineage", "verify", "artifacts/dpo/model", cwd=project)
    assert ok.returncode == 0 and "lineage intact" in ok.stdout, ok.stderr

    for victim, needle in ((project / "artifacts/sft/model/model.safetensors", "artifacts/sft/model/model.safetensors: sha256 mismatch"),
                           (project / "data/eval.jsonl", "data/eval.jsonl: sha256 mismatch"),
                           (project / "artifacts/base/manifest.json", "artifacts/base/manifest.json: changed since")):
        original = victim.read_bytes()
        blob = bytearray(original)
        blob[len(blob) // 2] ^= 0x01
        victim.write_bytes(bytes(blob))
        try:
            bad = rlhf("lineage", "verify", "artifacts/dpo/model", cwd=project)
            assert bad.returncode == 1 and needle in bad.stderr, (needle, bad.stderr)
        finally:
            victim.write_bytes(original)


@pytest.mark.xdist_group("sft_later")
def test_lora_sft_rm_dpo(project, ray_head, sft_reference):
    """lora_rank trains adapters over a frozen base in sft, rm and dpo: `model/` is the merged model
    (it differs from the base only by the adapters' low-rank updates), `model/adapter/` the adapter
    naming its base; rm and dpo start from the LoRA sft's merged model.  The sft run also logs to
    W&B (offline)."""
    lora = ["--set", "{0}.lora_rank=4", "--set", "{0}.lora_alpha=8", "--set", "{0}.max_steps=3", "--set", "{0}.save_steps=3",
            "--set", "{0}.global_batch_size=16", "--set", "{0}.eval_max_new_tokens=2"]
    args = lambda stage, out, start: [a.format(stage) for a in lora] + ["--set", f"{stage}.output_dir={out}",  # noqa: E731
                                                                       "--set", f"{stage}.model_path={start}"]
    # W&B beside TensorBoard, offline (the job gets WANDB_MODE through the environment allow-list)
    proc = run_stage(project, ray_head, "sft", *args("sft", "artifacts/sft_lora", "artifacts/base"), "--set", "sft.lr=1e-2",
                     "--set", "sft.report_to=tensorboard,wandb", env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert proc.returncode == 0, proc.stdout[-3000:]
    out = project / "artifacts" / "sft_lora"
    assert len(list((out / "wandb").glob("offline-run-*/*.wandb"))) == 1 and list((out / "tensorboard").iterdir())
    base = load_file(str(project / "artifacts" / "base" / "model.safetensors"))
    merged = weights(out)
    assert set(merged) == set(base)  # a plain HF model under the base's names
    delta = merged["model.layers.0.self_attn.q_proj.weight"] - base["model.layers.0.self_attn.q_proj.weight"]
    assert delta.abs().max() > 0 and torch.linalg.matrix_rank(delta).item() <= 4  # a rank-4 update
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])  # frozen: no adapter there
    adapter = json.loads((out / "model" / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["base_model_name_or_path"].endswith("base")
    assert verify_manifest(out) == []
    for stage, start in (("rm", "artifacts/sft_lora/model"), ("dpo", "artifacts/sft_lora/model")):
        proc = run_stage(project, ray_head, stage, *args(stage, f"artifacts/{stage}_lora", start))
        assert proc.returncode == 0, f"{stage}: {proc.stdout[-3000:]}"
        assert (project / "artifacts" / f"{stage}_lora" / "model" / "adapter" / "adapter_model.safetensors").exists()
