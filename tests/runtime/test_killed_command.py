"""A killed `rlhf stage run` takes its work along (issue 22), as a user sees it.

The command's whole process group gets SIGKILL mid-training (a scheduler's kill, the OOM killer,
a crashed Prefect worker): within seconds no process of its embedded Ray head -- or of its job
on a cluster -- is left and nothing writes to the output directory; the rerun resumes to weights
bit-identical to an uninterrupted run.  One writer per output directory: a second run is refused
naming the holder.  `--detach` is the way to leave a job running.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from conftest import SFT, run_stage
from safetensors.torch import load_file

from rlhf_core.artifacts.manifest import hash_tree
from rlhf_core.runtime import stage_lock
from rlhf_core.runtime.watchdog import descendants

pytestmark = pytest.mark.e2e


def wait_for(cond, timeout: float, poll: float = 0.05) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(poll)
    return bool(cond())


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return "?"


def processes_of_job(job_id: str) -> list[int]:
    """Every live process of a Ray job: the driver and its actors all carry RLHF_RAY_JOB_ID."""
    needle = f"RLHF_RAY_JOB_ID={job_id}\0".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if needle in Path(f"/proc/{entry}/environ").read_bytes() and alive(int(entry)):
                    found.append(int(entry))
            except OSError:
                pass
    return found


def snapshot(out: Path) -> dict:
    return {str(p.relative_to(out)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(out.rglob("*")) if p.is_file()}


def start(project: Path, args: list[str], log: Path, env: dict) -> subprocess.Popen:
    """`rlhf ...` in a process group of its own, as a scheduler or a Prefect worker starts it."""
    return subprocess.Popen([sys.executable, "-m", "rlhf_core.cli", *args], cwd=project, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)


def wait_for_checkpoint(cmd: subprocess.Popen, log: Path, ckpts: Path, name: str) -> None:
    def reached():
        if cmd.poll() is not None:
            raise AssertionError(f"the run ended before {name} ({cmd.returncode}):\n{log.read_text()[-3000:]}")
        return (ckpts / "latest").is_file() and (ckpts / "latest").read_text() == name
    assert wait_for(reached, 600), log.read_text()[-3000:]


def job_id_in(text: str, stage: str) -> str:
    return re.search(rf"submitted {stage} as Ray job (\S+)", text).group(1)


def weights(out: Path) -> dict:
    return load_file(str(out / "model" / "model.safetensors"))


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def losses(out: Path) -> list[float]:
    return [json.loads(line)["train/loss"] for line in (out / "train_history.jsonl").read_text().splitlines()]


def break_loading(ckpt: Path) -> None:
    """A checkpoint that passes its checksums but does not load (as one written by other code of
    ours): a parameter missing from the engine's model state, CHECKSUMS and the hash record beside
    checkpoints/ resealed (otherwise it is refused before loading, as tampering)."""
    f = ckpt / "engine" / "state" / "mp_rank_00_model_states.pt"
    state = torch.load(f, weights_only=False)
    state["module"].pop("model.norm.weight")
    torch.save(state, f)
    sums = hash_tree(ckpt, exclude=("CHECKSUMS.json",))
    (ckpt / "CHECKSUMS.json").write_text(json.dumps(sums, indent=2, sort_keys=True))
    record = ckpt.parent.parent / "checkpoint_hashes.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), ckpt.name: sums}))


@pytest.mark.xdist_group("sft_faults")
def test_sigkill_of_the_command_takes_its_embedded_head_along_then_resume_is_bit_identical(project, ray_head, sft_reference):
    out = project / "artifacts" / "sft_pgkill"
    args = ["stage", "run", "sft", "--params", "none.yaml", *SFT, "--set", f"sft.output_dir={out}"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # the command starts its own Ray head
    log = project / "sft_pgkill.log"  # a file, not a pipe: a full pipe would stall the run
    cmd = start(project, args, log, {**env, "RLHF_FAULT": "slow_steps:0.5"})  # 8 steps take > 4 s: room to act mid-run
    wait_for_checkpoint(cmd, log, out / "checkpoints", "step_000003")
    text = log.read_text()
    job_id, temp_dir = job_id_in(text, "sft"), re.search(r"temp dir (\S+)\)", text).group(1)
    token_dir = re.search(r"token dir (\S+),", text).group(1)
    tree = descendants(cmd.pid)  # watchdog, ray start, GCS, raylet, dashboard, workers, job driver, ...
    job = processes_of_job(job_id)
    assert job and set(job) <= set(tree), (job, tree)
    assert (out / ".lock").exists() and stage_lock.holder(out)["ray_job_id"] == job_id

    os.killpg(cmd.pid, signal.SIGKILL)  # the whole process group of the command, mid-training
    cmd.wait()
    t0 = time.time()
    assert wait_for(lambda: not any(alive(p) for p in tree), 10), [(p, cmdline(p)) for p in tree if alive(p)]
    print(f"{len(tree)} processes of the head (job: {len(job)}) gone {time.time() - t0:.2f} s after the kill")
    assert not processes_of_job(job_id)
    assert not os.path.exists(temp_dir) and not os.path.exists(token_dir)  # the head's session files and token went with it
    before = snapshot(out)
    time.sleep(2)
    assert snapshot(out) == before, "something still writes to the output directory"
    assert stage_lock.holder(out) is None  # the dead job's lock is free
    assert len(losses(out)) < 8, "the kill came after training ended"

    resumed = run_stage(project, ray_head, "sft", *SFT, "--set", f"sft.output_dir={out}")
    text = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, text[-3000:]
    assert f"taking over a stale lock on {out}: its holder Ray job {job_id}" in text
    assert re.search(r"resumed from step_00000[36]", text), text[-3000:]
    assert same_weights(sft_reference, out) and losses(out) == losses(sft_reference)

    # a checkpoint that verifies but fails to load: named, with why, and the previous one is used
    break_loading(out / "checkpoints" / "step_000008")
    more = run_stage(project, ray_head, "sft", *SFT, "--set", f"sft.output_dir={out}", "--set", "sft.max_steps=9")
    text = more.stdout + more.stderr
    assert more.returncode == 0, text[-3000:]
    assert (f"checkpoint step_000008 could not be loaded, trying the previous complete one: checkpoint "
            f"{out}/checkpoints/step_000008 could not be loaded (rank 0): RuntimeError: Error(s) in loading state_dict") in text, text[-3000:]
    assert "resumed from step_000006" in text


@pytest.mark.xdist_group("sft_later")
def test_two_runs_at_once_on_one_output_dir_the_second_is_refused(project, ray_head, sft_reference):
    out = project / "artifacts" / "sft_twice"
    args = ["stage", "run", "sft", "--params", "none.yaml", *SFT, "--set", f"sft.output_dir={out}"]
    env = {**os.environ, "RAY_ADDRESS": ray_head}
    logs = [project / f"sft_twice_{i}.log" for i in (0, 1)]
    cmds = [start(project, args, log, env) for log in logs]
    codes = [c.wait(timeout=600) for c in cmds]
    texts = [log.read_text() for log in logs]
    assert sorted(code == 0 for code in codes) == [False, True], (codes, [t[-2000:] for t in texts])
    winner, loser = (0, 1) if codes[0] == 0 else (1, 0)
    assert f"is being written by another run: Ray job {job_id_in(texts[winner], 'sft')}" in texts[loser], texts[loser][-3000:]
    assert same_weights(sft_reference, out) and losses(out) == losses(sft_reference)  # the refused run touched nothing


@pytest.mark.xdist_group("sft_later")
def test_a_detached_job_runs_on_and_holds_its_output_dir(project, ray_head, sft_reference):
    from rlhf_core.runtime.cluster import job_client

    out = project / "artifacts" / "sft_detached"
    args = ["stage", "run", "sft", "--params", "none.yaml", *SFT, "--set", "sft.max_steps=3", "--set", "sft.save_steps=3",
            "--set", "sft.eval_max_new_tokens=2", "--set", f"sft.output_dir={out}"]  # later --set win
    env = {**os.environ, "RAY_ADDRESS": ray_head}
    t0 = time.time()
    detached = subprocess.run([sys.executable, "-m", "rlhf_core.cli", *args, "--detach"], cwd=project, capture_output=True, text=True,
                              env=env, timeout=120)
    assert detached.returncode == 0, detached.stderr[-3000:]
    job_id = re.search(r"Ray job (\S+) \(detached", detached.stdout).group(1)
    assert f"ray job logs --address {ray_head} --follow {job_id}" in detached.stdout
    print(f"--detach returned in {time.time() - t0:.1f} s")
    assert wait_for(lambda: (stage_lock.holder(out) or {}).get("ray_job_id") == job_id, 300, poll=0.2)

    config = out / "config.resolved.json"
    written = config.stat().st_mtime_ns
    t0 = time.time()
    second = subprocess.run([sys.executable, "-m", "rlhf_core.cli", *args], cwd=project, capture_output=True, text=True, env=env, timeout=120)
    assert second.returncode == 3, second.stdout[-2000:] + second.stderr[-2000:]
    assert f"is being written by another run: Ray job {job_id} (pid" in second.stderr and f"ray job stop {job_id}" in second.stderr
    assert config.stat().st_mtime_ns == written  # refused before writing anything
    print(f"the second run was refused in {time.time() - t0:.1f} s")

    client = job_client(ray_head)  # the command that submitted it is long gone; the job is not
    assert wait_for(lambda: str(client.get_job_status(job_id).value) in ("SUCCEEDED", "FAILED", "STOPPED"), 600, poll=1)
    assert str(client.get_job_status(job_id).value) == "SUCCEEDED", client.get_job_logs(job_id)[-3000:]
    assert (out / "model" / "model.safetensors").exists() and stage_lock.holder(out) is None


@pytest.mark.xdist_group("sft_later")
def test_the_job_stops_when_the_reader_of_the_command_output_dies(project, ray_head):
    """A crashed Prefect worker (or a closed ssh session): the pipe the command writes its logs to
    loses its reader.  The command dies at its next write, and its guard stops the job."""
    from rlhf_core.runtime.cluster import job_client

    out = project / "artifacts" / "sft_orphan"
    args = ["stage", "run", "sft", "--params", "none.yaml", *SFT, "--set", f"sft.output_dir={out}"]
    cmd = subprocess.Popen([sys.executable, "-m", "rlhf_core.cli", *args], cwd=project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True, env={**os.environ, "RAY_ADDRESS": ray_head, "RLHF_FAULT": "slow_steps:0.5"})
    seen = []
    for line in cmd.stdout:  # until the job holds its output directory
        seen.append(line)
        if m := re.search(r"holding \S+ for Ray job (\S+)", line):
            job_id = m.group(1)
            break
    else:
        raise AssertionError("".join(seen)[-3000:])
    cmd.stdout.close()  # the reader is gone
    assert cmd.wait(timeout=120) != 0
    client = job_client(ray_head)
    assert wait_for(lambda: str(client.get_job_status(job_id).value) == "STOPPED", 60, poll=0.2), client.get_job_status(job_id)
    assert wait_for(lambda: not processes_of_job(job_id), 30)
    assert stage_lock.holder(out) is None


# rl on the vLLM engine, submitted to a cluster (RAY_ADDRESS): the command's guard stops the job
DIGITS_REWARD = "def reward(prompts, responses, labels, **kw):\n    return [sum(c.isdigit() for c in r) / max(1, len(r)) for r in responses]\n"
RL = ["--set", "rl.max_steps=4", "--set", "rl.save_steps=2", "--set", "rl.eval_steps=0", "--set", "rl.rollout.prompts_per_step=4",
      "--set", "rl.rollout.n_samples=4", "--set", "rl.global_batch_size=8", "--set", "rl.rollout.max_new_tokens=4",
      "--set", "rl.eval_max_new_tokens=4",
      "--set", "rl.pass_k=1", "--set", "rl.sync_check_prompts=8", "--set", "rl.lr=1e-3", "--set", "rl.rollout.engine=vllm"]


@pytest.mark.xdist_group("rl_more")
def test_sigkill_of_the_command_stops_its_rl_job_on_a_cluster_then_resume_is_bit_identical(project, ray_head, sft_reference):
    from rlhf_core.runtime.cluster import job_client

    reward = project / "digits_reward_vllm.py"
    reward.write_text(DIGITS_REWARD)
    base = [*RL, "--set", f"rl.reward.file={reward}"]
    ref, out = project / "artifacts" / "rl_vllm_ref", project / "artifacts" / "rl_vllm_pgkill"
    proc = run_stage(project, ray_head, "rl", *base, "--set", f"rl.output_dir={ref}")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]

    log = project / "rl_pgkill.log"
    cmd = start(project, ["stage", "run", "rl", "--params", "none.yaml", *base, "--set", f"rl.output_dir={out}"], log,
                {**os.environ, "RAY_ADDRESS": ray_head, "RLHF_FAULT": "slow_steps:0.5"})  # room to act mid-run
    wait_for_checkpoint(cmd, log, out / "checkpoints", "step_000002")
    job_id = job_id_in(log.read_text(), "rl")
    job = processes_of_job(job_id)  # driver, policy/reference trainers, the vLLM rollout and reward actors
    assert len(job) >= 3, [(p, cmdline(p)) for p in job]
    os.killpg(cmd.pid, signal.SIGKILL)
    cmd.wait()
    t0 = time.time()
    client = job_client(ray_head)
    assert wait_for(lambda: str(client.get_job_status(job_id).value) == "STOPPED", 30, poll=0.2), client.get_job_status(job_id)
    assert wait_for(lambda: not any(alive(p) for p in job), 30), [(p, cmdline(p)) for p in job if alive(p)]
    print(f"job {job_id} stopped and its {len(job)} processes gone {time.time() - t0:.2f} s after the kill")
    before = snapshot(out)
    time.sleep(2)
    assert snapshot(out) == before, "something still writes to the output directory"
    assert stage_lock.holder(out) is None
    assert len((out / "train_history.jsonl").read_text().splitlines()) < 4, "the kill came after training ended"

    resumed = run_stage(project, ray_head, "rl", *base, "--set", f"rl.output_dir={out}")
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-2000:]
    assert "resumed from step_000002" in resumed.stdout
    assert same_weights(ref, out)
    for step in (3, 4):  # the replayed steps sampled exactly the same tokens on vLLM
        rows = [pq.read_table(d / "rollouts" / f"step_{step:06d}.parquet").column("response_token_ids").to_pylist() for d in (ref, out)]
        assert rows[0] == rows[1]
