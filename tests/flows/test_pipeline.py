"""The Prefect flow over the DVC pipeline, for real: a served deployment on a local Prefect server,
DVC in a temporary git repository, every stage a Ray job."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SMALL_TASK, rlhf

pytestmark = pytest.mark.e2e
# xdist groups: tests sharing fixtures run on one worker; the groups balance `make test`'s workers

REPO = Path(__file__).resolve().parents[2]
BIN = str(Path(sys.executable).parent)
TINY_PARAMS = {
    "prepare": {"seed": 0, "task": {k.split(".")[-1]: int(v) for k, v in (s.split("=") for s in SMALL_TASK)}},
    "pretrain": {"max_steps": 4, "save_steps": 2, "global_batch_size": 8, "max_len": 64, "eval_max_new_tokens": 4},
    "sft": {"max_steps": 4, "save_steps": 2, "global_batch_size": 16, "eval_max_new_tokens": 4},
    "rm": {"max_steps": 2, "global_batch_size": 16, "pooling": "response_sum"},
    "dpo": {"max_steps": 2, "global_batch_size": 16, "eval_max_new_tokens": 4},
    "rl": {"max_steps": 2, "global_batch_size": 16, "pass_k": 1, "sync_check_prompts": 0, "eval_max_new_tokens": 4,
           "rollout": {"prompts_per_step": 4, "n_samples": 4, "engine": "hf", "max_new_tokens": 4}},
    "rl_variants": {"rlhf": {"algo": "ppo", "reward": {"model": "artifacts/rm/model"}}, "rlvr": {"algo": "grpo"}},
}


SECRET = "sk-test-9f8e7d6c5b4a39281706"


def sh(*cmd, cwd, env=None, timeout=600):
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def repo(tmp_path_factory, ray_head):
    """A copy of the project (code, dvc.yaml, .dvc/) in a fresh git repo, with tiny params."""
    import yaml

    root = tmp_path_factory.mktemp("pipeline_repo")
    files = sh("git", "ls-files", cwd=REPO).stdout.split()
    for f in files:
        if f.startswith(("tests/", "docs/", "bench/")) or not (REPO / f).is_file():
            continue
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, root / f)
    (root / "dvc.lock").unlink(missing_ok=True)
    (root / "params.yaml").write_text(yaml.safe_dump(TINY_PARAMS))
    # a secret-looking variable in the environment of every run: it must never reach an artifact
    env = {"PATH": f"{BIN}:{os.environ['PATH']}", "RAY_ADDRESS": ray_head, "RLHF_TEST_API_KEY": SECRET, "HF_TOKEN": SECRET,
           "DVC_SITE_CACHE_DIR": str(root / ".dvc" / "tmp" / "site"),
           "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "init"]):
        assert sh(*cmd, cwd=root, env=env).returncode == 0
    return root, env


@pytest.fixture(scope="module")
def flow_env(repo):
    """`repo` plus one Prefect server for the module's `rlhf pipeline run`s: without it each run
    starts (and waits for) a temporary server of its own, ~15-30 s apiece on this machine."""
    from flows.serve import LocalPrefectServer
    from rlhf_core.runtime.cluster import free_port

    root, env = repo
    server = LocalPrefectServer(root / ".prefect_tests", port=free_port()).start(timeout=180)
    yield root, {**env, "PREFECT_API_URL": server.url}
    server.stop()


def wait_for(fn, timeout=120, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = fn()
        if out:
            return out
        time.sleep(1)
    raise TimeoutError(what)


@pytest.mark.xdist_group("flows_served")
def test_served_deployment_then_skip_rerun_promote_and_fail(repo, flow_env):
    root, env = repo
    flow = flow_env[1]  # for the `rlhf pipeline run`s after the served run
    from rlhf_core.runtime.cluster import free_port

    port = free_port()
    api = {"PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
    auth_file = root / ".prefect" / "api-auth"  # `rlhf serve`'s API needs basic auth: the string it keeps here (0600)
    server = subprocess.Popen([sys.executable, "-m", "rlhf_core.cli", "serve", "--repo", str(root), "--port", str(port)], cwd=root,
                              stdout=open(root / "serve.log", "w"), stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True)
    try:
        def deployed():
            auth = {"PREFECT_API_AUTH_STRING": auth_file.read_text().strip()} if auth_file.exists() else {}
            p = sh(sys.executable, "-m", "prefect", "deployment", "ls", cwd=root, env={**env, **api, **auth})
            return p.returncode == 0 and "alignment-pipeline/full" in p.stdout and "alignment-pipeline/nightly" in p.stdout

        wait_for(deployed, 180, "deployments registered")
        api["PREFECT_API_AUTH_STRING"] = auth_file.read_text().strip()
        assert auth_file.stat().st_mode & 0o077 == 0 and api["PREFECT_API_AUTH_STRING"] not in (root / "serve.log").read_text()
        assert sh(sys.executable, "-m", "prefect", "deployment", "ls", cwd=root, env={**env, "PREFECT_API_URL": api["PREFECT_API_URL"]}).returncode
        # the Prefect UI is served beside the API, and `rlhf serve` says where
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as page:
            assert page.status == 200 and "<!DOCTYPE html>" in page.read(4000).decode()
        assert f"Prefect UI:  http://127.0.0.1:{port}" in (root / "serve.log").read_text()
        run = sh(sys.executable, "-m", "prefect", "deployment", "run", "alignment-pipeline/full", "--watch", cwd=root, env={**env, **api},
                 timeout=840)
        log = (root / "serve.log").read_text()
        assert run.returncode == 0, run.stdout[-3000:] + log[-6000:]
        for stage in ("pretrain", "sft", "rm", "dpo", "rl@rlhf", "rl@rlvr"):
            manifest = json.loads((root / "artifacts" / stage / "manifest.json").read_text())
            assert manifest["run_ids"].get("prefect_flow_run_id") and manifest["run_ids"].get("prefect_task_run_id"), stage
            assert manifest["run_ids"].get("ray_job_id"), stage
        champion = json.loads((root / "artifacts" / "champion" / "champion.json").read_text())
        accuracy = lambda st: json.loads((root / "artifacts" / st / "metrics.json").read_text())["eval/accuracy"]  # noqa: E731
        best = max(("sft", "dpo", "rl@rlhf", "rl@rlvr"), key=accuracy)
        assert champion["source"] in {f"artifacts/{st}" for st in ("sft", "dpo", "rl@rlhf", "rl@rlvr")}, champion
        assert json.loads((root / champion["source"] / "metrics.json").read_text())["eval/accuracy"] == \
            json.loads((root / "artifacts" / best / "metrics.json").read_text())["eval/accuracy"]  # the best candidate by gold accuracy
        assert (root / "artifacts" / "champion" / "model" / "model.safetensors").exists()
        assert sh("dvc", "status", cwd=root, env=env).stdout.strip().endswith("up to date.")
        assert list((root / ".dvc" / "remote").rglob("*")), "outputs pushed to the local DVC remote"
        nightly = sh(sys.executable, "-m", "prefect", "deployment", "inspect", "alignment-pipeline/nightly", cwd=root, env={**env, **api})
        assert "0 2 * * *" in nightly.stdout and "concurrency_limit" in nightly.stdout
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)

    # nothing changed: every stage is skipped; the champion is unchanged
    again = rlhf("pipeline", "run", "--repo", str(root), cwd=root, env=flow)
    assert again.returncode == 0, again.stderr[-3000:]
    result = json.loads(again.stdout[again.stdout.index("{"):])
    assert all(v["ran"] is False for v in result["stages"].values() if v), result
    assert result["promotion"]["decision"] == "unchanged"

    # a changed param of one RL variant reruns only that variant (upstream and the other untouched)
    sft_lock = (root / "artifacts" / "sft" / "manifest.json").read_text()
    rlhf_manifest = (root / "artifacts" / "rl@rlhf" / "manifest.json").read_text()
    one = rlhf("pipeline", "run", "--repo", str(root), "--stages", "rl@rlvr", "--set", "rl_variants.rlvr.max_steps=3", "--margin", "1.0",
               cwd=root, env=flow)
    assert one.returncode == 0, one.stderr[-3000:]
    result = json.loads(one.stdout[one.stdout.index("{"):])
    assert result["stages"]["rl@rlvr"]["ran"] is True and result["promotion"]["decision"] in ("promoted", "unchanged")
    assert (root / "artifacts" / "sft" / "manifest.json").read_text() == sft_lock
    assert (root / "artifacts" / "rl@rlhf" / "manifest.json").read_text() == rlhf_manifest
    assert json.loads((root / "artifacts" / "rl@rlvr" / "metrics.json").read_text())["train/steps"] == 3
    assert sh("dvc", "params", "diff", cwd=root, env=env).stdout.count("rl_variants.rlvr.max_steps") == 1
    history = [json.loads(x) for x in (root / "artifacts" / "rl@rlhf" / "train_history.jsonl").read_text().splitlines()]
    assert all("train/reward_gold" in r and "train/reward_proxy" in r for r in history)  # the over-optimisation curve

    # the gate refuses a candidate worse than the champion by more than the margin
    pointer = root / "artifacts" / "champion" / "champion.json"
    pointer.write_text(json.dumps({**json.loads(pointer.read_text()), "eval/accuracy": 2.0, "manifest_sha256": "x"}))
    refused = rlhf("pipeline", "run", "--repo", str(root), "--stages", "rl@rlvr", cwd=root, env=flow)
    assert refused.returncode == 0
    assert json.loads(refused.stdout[refused.stdout.index("{"):])["promotion"]["decision"] == "refused"
    decisions = [json.loads(x) for x in (root / "artifacts" / "champion" / "decisions.jsonl").read_text().splitlines()]
    assert [d["decision"] for d in decisions][:2] == ["promoted", "unchanged"] and decisions[-1]["decision"] == "refused"
    assert "champion kept" in decisions[-1]["reason"]

    # the static report: every stage of the DAG trained, a chart per logged curve, the champion's lineage
    report = rlhf("pipeline", "report", "--repo", str(root), cwd=root, env=env)
    assert report.returncode == 0, report.stderr
    page = (root / "reports" / "pipeline.html").read_text()
    assert page.count(">trained<") == 7 and "not run" not in page
    curves = [st for st in ("pretrain", "sft", "rm", "dpo", "rl@rlhf", "rl@rlvr")
              if len((root / "artifacts" / st / "train_history.jsonl").read_text().splitlines()) >= 2]
    assert curves and page.count("<svg") >= len(curves)
    # each trained stage's dvc plots page, linked from its Prefect summary artifact
    assert all((root / "reports" / "plots" / st.replace("@", "-") / "index.html").exists() for st in curves), list((root / "reports").rglob("*"))
    assert (root / "reports" / "plots" / "rl-rlhf-rlhf-gold-vs-proxy" / "index.html").exists()
    lineage = page[page.index("<h3>lineage</h3>"):]
    source = json.loads((root / "artifacts" / "champion" / "champion.json").read_text())["source"].split("/")[-1].split("@")[0]
    assert f"[{source}]" in lineage and "[sft]" in lineage and "lineage unavailable" not in lineage, lineage[:2000]

    # a failing stage fails the run and the command
    bad = rlhf("pipeline", "run", "--repo", str(root), "--stages", "rl@rlvr", "--set", "rl.reward.file=missing_reward.py", "--retries", "0",
               cwd=root, env=flow)
    assert bad.returncode == 1 and "stage rl@rlvr failed" in bad.stderr

    # lineage of the promoted chain verifies against dvc.lock
    ok = rlhf("lineage", "verify", "artifacts/dpo/model", cwd=root, env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr


    # no secret from the environment in any artifact, manifest, model card, log or rollout
    secrets = (SECRET.encode(), api["PREFECT_API_AUTH_STRING"].encode())  # ... nor the Prefect API's auth string
    leaked = [p for p in (root / "artifacts").rglob("*") if p.is_file() and any(s in p.read_bytes() for s in secrets)]
    assert leaked == []


@pytest.mark.xdist_group("flows_served")
def test_second_pipeline_run_on_a_repo_is_refused(tmp_path):
    """Never two writers: while one run holds the repository lock, another is refused clearly."""
    import fcntl

    (tmp_path / ".dvc" / "tmp").mkdir(parents=True)
    with open(tmp_path / ".dvc" / "tmp" / "pipeline.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        f.write("pid 1 flow run first\n")
        f.flush()
        proc = rlhf("pipeline", "run", "--repo", str(tmp_path), "--no-push", cwd=tmp_path)
    assert proc.returncode == 1 and "another pipeline run holds" in proc.stderr and "pid 1 flow run first" in proc.stderr


def ensure_sft(root: Path, env: dict) -> int:
    """The repo's sft steps so far; builds sft first when this test runs before the served one (xdist)."""
    if not (root / "artifacts" / "sft" / "model").exists():
        first = rlhf("pipeline", "run", "--repo", str(root), "--stages", "prepare,pretrain,sft", "--no-promote", "--no-push", cwd=root, env=env)
        assert first.returncode == 0, first.stderr[-3000:]
    return json.loads((root / "artifacts" / "sft" / "metrics.json").read_text())["train/steps"]


@pytest.mark.xdist_group("flows_faults")
def test_sigterm_of_a_flow_run_stops_the_stage_then_resumes(flow_env):
    """SIGTERM to `rlhf pipeline run` mid-stage: the command ends, the stage's Ray job is stopped,
    no stage process is left; the next run resumes the stage from its last checkpoint."""
    root, env = flow_env
    ensure_sft(root, env)
    args = ["pipeline", "run", "--repo", str(root), "--stages", "sft", "--set", "sft.max_steps=40", "--no-promote", "--no-push", "--retries", "0"]
    log = root / "sigterm_run.log"  # a file, not a pipe: a full pipe would stall the run
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_core.cli", *args], cwd=root, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, **env})
    ckpts = root / "artifacts" / "sft" / "checkpoints"
    def progressed():
        if proc.poll() is not None:  # ended before we could interrupt it: show why
            raise AssertionError(f"pipeline run exited early ({proc.returncode}): {log.read_text()[-3000:]}")
        return any(int(p.name.split("_")[1]) > 4 for p in ckpts.glob("step_*"))

    wait_for(progressed, 600, "a checkpoint of the new run")
    proc.terminate()
    proc.wait(timeout=120)
    assert proc.returncode != 0, log.read_text()[-3000:]
    from rlhf_core.runtime.cluster import job_client

    client = job_client(env["RAY_ADDRESS"])
    last = lambda: max((j for j in client.list_jobs() if (j.metadata or {}).get("stage") == "sft"), key=lambda j: j.start_time or 0)  # noqa: E731
    assert wait_for(lambda: str(last().status.value) == "STOPPED", 60, "the sft Ray job stopped")
    left = sh("pgrep", "-f", f"stages.sft --config {root}", cwd=root)
    assert left.stdout.strip() == "", f"orphan stage processes: {left.stdout}"
    again = rlhf(*args, cwd=root, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((root / "artifacts" / "sft" / "metrics.json").read_text())["train/steps"] == 40
    history = [json.loads(x)["step"] for x in (root / "artifacts" / "sft" / "train_history.jsonl").read_text().splitlines()]
    assert history == list(range(1, 41))  # resumed: every step once, none skipped or repeated


@pytest.mark.xdist_group("flows_faults")
def test_worker_killed_mid_step_then_the_prefect_retry_resumes(flow_env):
    """A training worker actor dies during a step (`ray.kill`, as an OOM kill would): the Ray job
    fails with a clear error, only complete checkpoints exist, and the Prefect task's retry resumes
    the stage to completion, every step exactly once."""
    root, env = flow_env
    done = ensure_sft(root, env)  # an even number of steps: sft saves every 2 steps here
    once = root / "fault.once"
    fault = {"RLHF_FAULT": f"kill_worker_at_step:{done + 3}", "RLHF_FAULT_ONCE": str(once)}
    proc = rlhf("pipeline", "run", "--repo", str(root), "--stages", "sft", "--set", f"sft.max_steps={done + 4}", "--no-promote", "--no-push",
                "--retries", "1", cwd=root, env={**env, **fault})
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert once.exists() and f"a training worker died during step {done + 3}" in text, text[-4000:]
    assert f"resumed from step_{done + 2:06d}" in text, text[-4000:]
    history = [json.loads(x)["step"] for x in (root / "artifacts" / "sft" / "train_history.jsonl").read_text().splitlines()]
    assert history == list(range(1, done + 5))


@pytest.mark.xdist_group("flows_faults")
def test_prefect_server_restarted_mid_run_then_the_run_completes(flow_env):
    """The Prefect server dies mid-stage and comes back on the same port and database: the
    flow's client retries its API calls (Prefect's bounded backoff, ~60 s in all), the stage
    (a Ray job, not a Prefect process) keeps running, and the run ends Completed in the server."""
    root, env = flow_env
    from flows.serve import LocalPrefectServer
    from rlhf_core.runtime.cluster import free_port

    done = ensure_sft(root, env)
    env = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}  # this run talks to the server restarted below
    server = LocalPrefectServer(root / ".prefect_restart", port=free_port()).start(timeout=180)
    api = {"PREFECT_API_URL": server.url}
    log = root / "restart_run.log"
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_core.cli", "pipeline", "run", "--repo", str(root), "--stages", "sft",
                             "--set", f"sft.max_steps={done + 16}", "--no-promote", "--no-push", "--retries", "0"],
                            cwd=root, stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**os.environ, **env, **api})
    try:
        ckpts = root / "artifacts" / "sft" / "checkpoints"
        def progressed():
            if proc.poll() is not None:
                raise AssertionError(f"pipeline run exited early ({proc.returncode}): {log.read_text()[-3000:]}")
            return any(int(p.name.split("_")[1]) > done for p in ckpts.glob("step_*"))

        wait_for(progressed, 600, "a checkpoint of the new run")
        server.stop()  # the server goes away mid-stage ...
        time.sleep(3)
        server.start(timeout=180)  # ... and comes back on the same port, with the same database
        assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        # a wide table: the state column shows
        runs = sh(sys.executable, "-m", "prefect", "flow-run", "ls", cwd=root, env={**env, **api, "COLUMNS": "300"})
        server.stop()
    assert json.loads((root / "artifacts" / "sft" / "metrics.json").read_text())["train/steps"] == done + 16
    assert "COMPLETED" in runs.stdout and "RUNNING" not in runs.stdout, runs.stdout


def _browser():
    """Headless Chromium through Selenium, or a skip saying what is missing (`make test-ui` installs both)."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed: `make test-ui` installs it")
    chromium, driver = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("no chromium / chromedriver on PATH: `make test-ui` installs Debian's chromium and chromium-driver")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


@pytest.mark.ui
@pytest.mark.xdist_group("flows_served")
def test_the_prefect_ui_and_the_report_in_a_real_browser(flow_env):
    """As a user looks: run a two-stage slice, open its flow run in the Prefect UI (both task runs
    Completed), the artifacts page (each stage's summary), then the HTML report (one chart per
    logged curve).  Screenshots go to build/ui-screenshots/ (or $RLHF_UI_SCREENSHOTS)."""
    import re

    driver = _browser()  # first: it skips the test where selenium or the browser is missing
    from selenium.webdriver.common.by import By

    root, env = flow_env
    shots = Path(os.environ.get("RLHF_UI_SCREENSHOTS", REPO / "build" / "ui-screenshots"))
    shots.mkdir(parents=True, exist_ok=True)
    ui = env["PREFECT_API_URL"].removesuffix("/api")
    try:
        run = rlhf("pipeline", "run", "--repo", str(root), "--stages", "prepare,pretrain", "--no-promote", "--no-push", cwd=root, env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        flow_run_id = re.search(r"/runs/flow-run/([0-9a-f-]{36})", run.stdout + run.stderr).group(1)

        def page_text(url: str, needles: tuple[str, ...], shot: str) -> str:
            driver.get(url)

            def shown():  # the UI renders after load: poll until every needle is on the page
                t = driver.find_element(By.TAG_NAME, "body").text
                return t if all(n in t for n in needles) else None

            text = wait_for(shown, 60, f"{needles} on {url}")
            driver.save_screenshot(str(shots / f"{shot}.png"))
            return text

        page_text(f"{ui}/runs", ("alignment-pipeline", "Completed"), "runs")
        page_text(f"{ui}/runs/flow-run/{flow_run_id}", ("alignment-pipeline", "Completed", "2 Task runs"), "flow_run")
        driver.find_elements(By.XPATH, "//*[normalize-space(.)='Task Runs']")[-1].click()  # the tab listing the task runs (innermost)
        tasks = wait_for(lambda: (lambda t: t if "Finished in state" not in t and t.count("Completed") >= 3 else None)(
            driver.find_element(By.TAG_NAME, "body").text), 60, "the Task Runs tab")
        driver.save_screenshot(str(shots / "task_runs.png"))
        assert "(2 Completed)" in tasks and "prepare" in tasks and "pretrain" in tasks, tasks[:3000]
        page_text(f"{ui}/artifacts", ("prepare-summary", "pretrain-summary"), "artifacts")

        assert rlhf("pipeline", "report", "--repo", str(root), cwd=root, env=env).returncode == 0
        driver.get((root / "reports" / "pipeline.html").as_uri())
        charts = driver.find_elements(By.CSS_SELECTOR, "section#pretrain svg.chart")
        rows = len((root / "artifacts" / "pretrain" / "train_history.jsonl").read_text().splitlines())
        assert len(charts) == (1 if rows >= 2 else 0)  # pretrain logs train/loss only
        assert driver.find_element(By.CSS_SELECTOR, "section#pretrain .state").text == "trained"
        driver.save_screenshot(str(shots / "report.png"))
    finally:
        driver.quit()
