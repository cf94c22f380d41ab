"""The rl stage as a real Ray job: rollouts, rewards, updates, weight sync, exact resume."""
import base64
import json
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from conftest import JsonHandler, rlhf, run_stage
from safetensors.torch import load_file

from rlhf_core.artifacts.manifest import verify_manifest

pytestmark = pytest.mark.integration
# xdist groups: tests sharing fixtures run on one worker; the groups balance `make test`'s workers

# the 8-step sft model of the test project rarely answers right, so the tests reward a shape
# (the share of digit characters): it varies within every group, so every step really updates
DIGITS_REWARD = "def reward(prompts, responses, labels, **kw):\n    return [sum(c.isdigit() for c in r) / max(1, len(r)) for r in responses]\n"
SMALL = ["--set", "rl.max_steps=4", "--set", "rl.save_steps=2", "--set", "rl.eval_steps=0", "--set", "rl.rollout.prompts_per_step=4",
         "--set", "rl.rollout.n_samples=4", "--set", "rl.global_batch_size=8", "--set", "rl.rollout.max_new_tokens=4",
         "--set", "rl.eval_max_new_tokens=4",
         "--set", "rl.pass_k=2", "--set", "rl.sync_check_prompts=16", "--set", "rl.lr=1e-3"]


def reward_file(project: Path, name: str, body: str) -> str:
    path = project / name
    path.write_text(body)
    return str(path)


def table(out: Path, step: int) -> list[dict]:
    return pq.read_table(out / "rollouts" / f"step_{step:06d}.parquet").to_pylist()


@pytest.fixture(scope="module")
def grpo_reference(project, ray_head, sft_reference):
    rf = reward_file(project, "digits_reward.py", DIGITS_REWARD)
    # exercises the adaptive KL controller (its state must survive a resume), TIS and clip-higher,
    # at a sampling temperature != 1 (engine and trainer log-probs must both be tempered)
    args = [*SMALL, "--set", "rl.rollout.engine=hf", "--set", f"rl.reward.file={rf}", "--set", "rl.objective.adaptive_kl=true",
            "--set", "rl.objective.kl_target=0.01",
            "--set", "rl.objective.is_correction=tis", "--set", "rl.objective.clip_high=0.28", "--set", "rl.rollout.temperature=0.8"]
    proc = run_stage(project, ray_head, "rl", *args, "--set", "rl.output_dir=artifacts/rl_ref")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    (project / "rl_ref.log").write_text(proc.stdout)
    return project / "artifacts" / "rl_ref", args


@pytest.mark.xdist_group("rl_ref")
def test_grpo_outputs_rollouts_and_show(project, grpo_reference):
    out, _ = grpo_reference
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("eval/accuracy", "eval/accuracy_init", "eval/pass@2", "best/eval_accuracy", "train/reward_mean"):
        assert key in metrics, key
    assert metrics["eval/sync_greedy_match"] == 1.0  # engine greedy == trainer greedy after the syncs
    assert verify_manifest(out) == []
    assert any(i["path"].endswith("digits_reward.py") for i in json.loads((out / "manifest.json").read_text())["inputs"])
    rows = table(out, 3)
    assert len(rows) == 16 and {r["sample_index"] for r in rows} == {0, 1, 2, 3}
    assert {r["policy_version"] for r in rows} == {2}  # sampled by the weights after two updates
    r = rows[0]
    n = r["response_length"]
    assert len(r["engine_logprobs"]) == len(r["old_logprobs"]) == len(r["ref_logprobs"]) == len(r["advantages"]) == len(r["action_mask"]) == n
    assert r["engine_logprobs"] == pytest.approx(r["old_logprobs"], abs=1e-4)  # same weights and temperature (0.8) in engine and trainer
    assert json.loads(r["reward_components"]).keys() == {"reward_file", "gold"} and r["filter"] == "kept"
    # GRPO: each group's advantages are centred
    for g in {x["prompt_id"] for x in rows}:
        adv = [x["advantages"][0] for x in rows if x["prompt_id"] == g and x["advantages"]]
        assert abs(sum(adv)) < 1e-3
    updates = [json.loads(x) for x in (out / "train_history.jsonl").read_text().splitlines()]
    assert [u["step"] for u in updates] == [1, 2, 3, 4] and all("train/loss" in u for u in updates)
    assert len({u["rl/kl_coef"] for u in updates}) > 1  # the adaptive controller moved
    # TIS ran (its statistic; weights 1 here: the engine holds the trainer's weights) with the
    # clip-higher range; stages/test_rl_objective.py checks the numbers these settings produce
    assert all(u["train/is_truncated_frac"] == 0.0 and "train/clipfrac" in u for u in updates)
    assert "policy loss ppo: clip_low=0.2, clip_high=0.28, agg_mode=token-mean, temperature 0.8, is_correction tis" in \
        (project / "rl_ref.log").read_text()
    shown = rlhf("rollouts", "show", str(out / "rollouts"), cwd=project)
    assert shown.returncode == 0 and "reward" in shown.stdout and len(shown.stdout.splitlines()) >= 6, shown.stderr


@pytest.mark.xdist_group("rl_ref")
def test_rl_sigkill_then_resume_is_bit_identical(project, ray_head, grpo_reference):
    ref, args = grpo_reference
    out = project / "artifacts" / "rl_killed"
    killed = run_stage(project, ray_head, "rl", *args, "--set", f"rl.output_dir={out}", env={"RLHF_FAULT": "sigkill_after_step:3"})
    assert killed.returncode != 0
    assert (out / "checkpoints" / "latest").read_text() == "step_000002"
    resumed = run_stage(project, ray_head, "rl", *args, "--set", f"rl.output_dir={out}")
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert "resumed from step_000002" in resumed.stdout
    a, b = load_file(str(ref / "model" / "model.safetensors")), load_file(str(out / "model" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    for step in (3, 4):  # the replayed steps sampled exactly the same tokens
        assert [r["response_token_ids"] for r in table(ref, step)] == [r["response_token_ids"] for r in table(out, step)]


@pytest.mark.xdist_group("rl_ref")
def test_collective_weight_sync_gives_the_same_run(project, ray_head, grpo_reference):
    """rl.rollout.weight_sync=collective (trainer rank 0 broadcasts over a gloo group on CPU; NCCL on GPUs)
    moves the same weights as the object store: every step samples the same tokens, the same model."""
    ref, args = grpo_reference
    out = project / "artifacts" / "rl_collective"
    proc = run_stage(project, ray_head, "rl", *args, "--set", "rl.rollout.weight_sync=collective", "--set", f"rl.output_dir={out}")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "weight sync: trainer rank 0 broadcasts to 1 engine(s) over gloo" in proc.stdout
    for step in (1, 2, 3, 4):  # steps 2-4 sample with synced weights
        assert [r["response_token_ids"] for r in table(ref, step)] == [r["response_token_ids"] for r in table(out, step)]
    a, b = load_file(str(ref / "model" / "model.safetensors")), load_file(str(out / "model" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "metrics.json").read_text())["eval/sync_greedy_match"] == 1.0


@pytest.mark.xdist_group("rl_more")
def test_ppo_multi_turn_agent_on_vllm(project, ray_head, sft_reference):
    """PPO (critic + GAE) with the multi-turn retry environment on the vLLM engine."""
    out = project / "artifacts" / "rl_ppo"
    proc = run_stage(project, ray_head, "rl", *SMALL, "--set", "rl.max_steps=3", "--set", "rl.algo=ppo", "--set", "rl.rollout.agent=retry_arithmetic",
                     "--set", f"rl.output_dir={out}", "--set", "rl.max_len=48", "--set", "rl.rollout.max_new_tokens=6",
                     "--set", "rl.rollout.temperature=0.7")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["eval/sync_greedy_match"] == 1.0  # vLLM after in-place syncs == the trainer
    assert "eval/success_rate" in metrics and "eval/success_rate_init" in metrics
    assert (out / "checkpoints" / "step_000002" / "critic").is_dir()
    history = [json.loads(x) for x in (out / "train_history.jsonl").read_text().splitlines()]
    errors = [h["critic/value_error"] for h in history]
    print("critic value error per step", errors)
    assert errors[-1] < 0.5 * errors[0], errors  # the critic learns the returns
    rows = table(out, 2)
    for r in rows:  # vLLM's log-probs (processed: at temperature 0.7) are the trainer's, on the model's tokens
        acts = [i for i, m in enumerate(r["action_mask"]) if m]
        assert [r["engine_logprobs"][i] for i in acts] == pytest.approx([r["old_logprobs"][i] for i in acts], abs=2e-3)
    assert all(r["values"] and len(r["values"]) == r["response_length"] for r in rows)
    assert all(json.loads(r["reward_components"]).keys() == {"env", "gold"} for r in rows)
    multi = [r for r in rows if r["num_turns"] > 1]
    assert multi, "the 8-step sft model should fail some first turns"
    for r in multi:  # environment feedback is in the context but masked out of the loss
        assert 0 in r["action_mask"] and "wrong, try again" in r["response"]
        masked = [a for a, m in zip(r["advantages"], r["action_mask"]) if not m]
        assert all(a == 0.0 for a in masked)


@pytest.mark.xdist_group("rl_more")
def test_reward_failures_are_counted_or_fatal_never_zero(project, ray_head, sft_reference):
    flaky = reward_file(project, "flaky_reward.py", "import math\ndef reward(prompts, responses, labels, **kw):\n"
                        "    return [math.nan if i % 8 == 0 else 1.0 * (i % 2) for i in range(len(responses))]\n")
    out = project / "artifacts" / "rl_flaky"
    # separate placement: rollout, reference and reward actors on their own CPU slices
    base = [*SMALL, "--set", "rl.rollout.engine=hf", "--set", "rl.max_steps=1", "--set", "rl.pass_k=1", "--set", "rl.sync_check_prompts=0",
            "--set", "rl.rollout.layout=separate", "--set", "rl.rollout.cpus=0.5"]
    proc = run_stage(project, ray_head, "rl", *base, "--set", f"rl.reward.file={flaky}", "--set", f"rl.output_dir={out}",
                     "--set", "rl.reward.max_invalid_ratio=0.2")
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = table(out, 1)
    bad = [r for r in rows if r["filter"] == "invalid"]
    assert len(bad) == 2 and all(r["reward"] is None and "returned nan" in r["invalid_reason"] for r in bad)
    assert json.loads((out / "metrics.json").read_text())["train/invalid_rewards"] == 2



@pytest.mark.xdist_group("rl_more")
def test_hung_reward_call_times_out_instead_of_hanging(project, ray_head, sft_reference):
    """RLHF_FAULT=hang:reward wedges the reward actor's call for good: rl.rollout.timeout turns it
    into an error naming the call, the job fails (the actors die with it) and writes no checkpoint.
    Rollout, weight sync and engine calls go through the same bounded `Roles.get`."""
    out = project / "artifacts" / "rl_hang"
    proc = run_stage(project, ray_head, "rl", *SMALL, "--set", "rl.rollout.engine=hf", "--set", "rl.max_steps=1", "--set", "rl.pass_k=1",
                     "--set", "rl.sync_check_prompts=0", "--set", "rl.rollout.timeout=30", "--set", f"rl.output_dir={out}",
                     env={"RLHF_FAULT": "hang:reward"})
    assert proc.returncode != 0
    assert "reward took longer than rl.rollout.timeout=30.0s" in proc.stdout, proc.stdout[-4000:]
    assert not (out / "model").exists() and not (out / "checkpoints" / "latest").exists()


@pytest.mark.xdist_group("rl_more")
def test_rl_config_errors(project):
    proc = rlhf("stage", "run", "rl", "--params", "none.yaml", "--set", "rl.rollout.n_samples=1", cwd=project)
    assert proc.returncode == 2 and "needs rl.rollout.n_samples >= 2" in proc.stderr
    # the old flat key still reaches its section (with a warning naming the new one)
    proc = rlhf("stage", "run", "rl", "--params", "none.yaml", "--set", "rl.n_samples=1", cwd=project)
    assert proc.returncode == 2 and "needs rl.rollout.n_samples >= 2" in proc.stderr
    assert "rl.n_samples is now rl.rollout.n_samples" in proc.stdout + proc.stderr
    proc = rlhf("stage", "run", "rl", "--params", "none.yaml", "--set", "rl.n_samples=4", "--set", "rl.rollout.n_samples=4", cwd=project)
    assert proc.returncode == 2 and "rl.n_samples and rl.rollout.n_samples are both given" in proc.stderr
    proc = rlhf("stage", "run", "rl", "--params", "none.yaml", "--set", "rl.algo=ppo2", cwd=project)
    assert proc.returncode == 2 and "reinforce_pp_baseline" in proc.stderr


@pytest.mark.xdist_group("rl_ref")
def test_burst_of_10x_the_default_batch_keeps_memory_bounded(project, ray_head, grpo_reference):
    """160 prompts x 8 samples in one step (10x the default batch, 80x the reference run's):
    the rollout and reward path finishes, and the actors' peak memory stays at the small run's.
    The optimizer mini-batch stays the reference's (global_batch_size=8): the trainer's activations
    scale with it (rl has no gradient accumulation), not with the step's sample count."""
    rf = reward_file(project, "digits_reward.py", DIGITS_REWARD)
    out = project / "artifacts" / "rl_burst"
    proc = run_stage(project, ray_head, "rl", "--set", "rl.max_steps=1", "--set", "rl.rollout.prompts_per_step=160",
                     "--set", "rl.rollout.n_samples=8",
                     "--set", "rl.rollout.engine=hf", "--set", f"rl.reward.file={rf}", "--set", "rl.rollout.max_new_tokens=4",
                     "--set", "rl.eval_max_new_tokens=4",
                     "--set", "rl.pass_k=1", "--set", "rl.sync_check_prompts=0", "--set", "rl.global_batch_size=8",
                     "--set", f"rl.output_dir={out}")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert len(table(out, 1)) == 1280
    burst = json.loads((out / "metrics.json").read_text())
    small = json.loads((grpo_reference[0] / "metrics.json").read_text())
    peaks = {role: (small[f"mem/peak_mb_{role}"], burst[f"mem/peak_mb_{role}"]) for role in ("rollout", "reward", "reference", "policy", "driver")}
    print(peaks)
    for role, (small_mb, burst_mb) in peaks.items():
        assert burst_mb < small_mb + 256, (role, burst_mb, small_mb)


SECRET = "pa55-9f8e7d6c"


class _ScoringServer(JsonHandler):
    """A reward server behind basic auth: additions score a constant (a zero-variance group, which
    DAPO's dynamic sampling drops), subtractions the share of digits in the response."""

    def do_POST(self):  # noqa: N802
        if self.headers.get("Authorization") != "Basic " + base64.b64encode(f"rl:{SECRET}".encode()).decode():
            return self.reply(code=401)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        rewards = [1.0 if "+" in p else sum(c.isdigit() for c in r) / max(1, len(r)) for p, r in zip(body["prompts"], body["responses"])]
        self.reply({"rewards": rewards})


@pytest.mark.xdist_group("rl_more")
def test_gspo_with_dynamic_sampling_fills_every_batch_from_an_authenticated_reward_server(project, ray_head, sft_reference):
    """GSPO gets its own clip range and aggregation through the stage; DAPO dynamic sampling drops
    zero-variance groups and draws more prompts until every step trains on a full batch (it used
    to train on what was left).  The reward URL carries credentials: they reach the server and no
    file or log (issue 16, items 3 and 6)."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _ScoringServer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    out = project / "artifacts" / "rl_gspo_ds"
    try:
        url = f"http://rl:{SECRET}@127.0.0.1:{srv.server_address[1]}/score"
        proc = run_stage(project, ray_head, "rl", *SMALL, "--set", "rl.rollout.engine=hf", "--set", "rl.max_steps=2", "--set", "rl.pass_k=1",
                         "--set", "rl.sync_check_prompts=0", "--set", "rl.objective.loss_type=gspo", "--set", "rl.objective.dynamic_sampling=true",
                         "--set", "rl.objective.dynamic_sampling_rounds=8", "--set", f"rl.reward.url={url}", "--set", f"rl.output_dir={out}")
    finally:
        srv.shutdown()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "policy loss gspo: clip_low=0.0003, clip_high=0.0004, agg_mode=seq-mean-token-mean" in proc.stdout
    history = [json.loads(x) for x in (out / "train_history.jsonl").read_text().splitlines()]
    for step, h in enumerate(history, start=1):
        rows = table(out, step)
        kept = [r for r in rows if r["filter"] == "kept"]
        assert len(kept) == h["rl/kept"] == 4 * 4 and len({r["prompt_id"] for r in kept}) == 4, (step, h)  # a full batch
        assert h["rl/prompts_drawn"] == 4 * h["rl/sampling_rounds"] and len(rows) == 4 * h["rl/prompts_drawn"]
        assert all("+" not in r["prompt"] for r in kept)
    assert sum(h["rl/sampling_rounds"] for h in history) > len(history)  # it did have to draw more
    assert any(r["filter"] == "zero_variance_group" for step in (1, 2) for r in table(out, step))
    leaked = [p for p in out.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaked == [] and SECRET not in proc.stdout + proc.stderr
    assert json.loads((out / "config.resolved.json").read_text())["config"]["reward"]["url"].startswith("http://***@127.0.0.1:")


@pytest.mark.xdist_group("rl_more")
@pytest.mark.parametrize("fault, message", [
    ("hang:train_step", "policy train step 1 took longer than rl.rollout.timeout=30s"),
    ("kill_worker_at_step:1", "a training worker died during step 1: the stage stops"),
])
def test_a_hung_or_killed_policy_worker_fails_the_step_with_a_clear_error(project, ray_head, sft_reference, fault, message):
    """The policy's train step is bounded by rl.rollout.timeout like every other call (it waited
    forever), and `kill_worker_at_step` now fires in rl (the update never passed its step)."""
    out = project / "artifacts" / f"rl_{fault.split(':')[0]}"
    proc = run_stage(project, ray_head, "rl", *SMALL, "--set", "rl.rollout.engine=hf", "--set", "rl.max_steps=1", "--set", "rl.pass_k=1",
                     "--set", "rl.sync_check_prompts=0", "--set", "rl.rollout.timeout=30", "--set", f"rl.output_dir={out}",
                     env={"RLHF_FAULT": fault})
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-4000:]
    assert not (out / "model").exists() and not (out / "checkpoints" / "latest").exists()
