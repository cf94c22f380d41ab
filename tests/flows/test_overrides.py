"""The flow's override allow-list (`flows/overrides.py`): a deployment's flow run (anyone with
Prefect API access can start one) may not point the pipeline at code, URLs or paths outside the
repository unless `rlhf serve --allow-override` says so; no caller may write credentials into
params.yaml.  A refusal comes before anything is written."""
import os
import types

import pytest
import yaml

from flows.overrides import ALLOW_ENV, REPO_ENV, OverrideRefused, allowed_from_env, check_overrides, check_repo

pytestmark = pytest.mark.unit

PASSWORD = "hunter2-Pq7x"


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    (root / "artifacts").mkdir(parents=True)
    (root / "params.yaml").write_text("rl:\n  max_steps: 2  # a comment\n")
    (root / "artifacts" / "elsewhere").symlink_to(tmp_path)  # inside by name, outside in fact
    return root


@pytest.mark.parametrize("item", [
    "rl.reward.file=/tmp/evil.py", "rl.reward.file=rewards/mine.py", "rl.rollout.agent_file=env.py", "rl.reward.token_file=/etc/shadow",
    "rl_variants.rlhf.reward_file=x.py", "rl.trust_remote_code=true", "rl.reward.url=http://127.0.0.1:9/score",
    "rl.model_path=/opt/models/m", "rl.reward.model=../outside/rm", "sft.output_dir=/tmp/out", "rl.train_data=/etc/passwd",
    "rm.eval_random_data=../x.jsonl", "prepare.data_dir=~/data", "dpo.eval_pairs=/x.jsonl", "rl.model_path=artifacts/elsewhere/m",
    "rl_variants.rlhf={reward_file: x.py}", "rl_variants.rlhf={algo: ppo, agent_file: /opt/e.py}",
    "rl_variants.rlhf={reward: {model: /opt/rm}}", "rl.reward={url: http://127.0.0.1:9/score}",
    # the old flat names of the rl settings (`rl.reward_file` is now `rl.reward.file`) still load, so are refused alike
    "rl.reward_file=/tmp/evil.py", "rl.reward_url=http://127.0.0.1:9/score", "rl.reward_model=../outside/rm", "rl.agent_file=env.py",
])
def test_a_deployment_run_refuses_code_urls_and_outside_paths(repo, item):
    key = item.partition("=")[0]
    with pytest.raises(OverrideRefused) as e:
        check_overrides([item], repo, from_deployment=True)
    message = str(e.value)
    assert message.startswith(f"override {key}") and "refused for a flow run from a deployment" in message and "--allow-override" in message
    check_overrides([item], repo, from_deployment=False)  # the CLI's caller is the repo's owner: allowed


def test_the_message_names_the_key_and_the_opt_in(repo):
    with pytest.raises(OverrideRefused, match=r"override rl\.reward\.file refused .* `rlhf serve --allow-override rl\.reward\.file`"):
        check_overrides(["rl.max_steps=3", "rl.reward.file=/tmp/evil.py"], repo, from_deployment=True)
    with pytest.raises(OverrideRefused, match=r"rl_variants\.rlhf\.reward_model .* outside the repository"):
        check_overrides(["rl_variants.rlhf={algo: ppo, reward_model: /opt/rm}"], repo, from_deployment=True)


@pytest.mark.parametrize("item", [
    "rl.max_steps=3", "rl_variants.rlvr.max_steps=3", "rl.model_path=artifacts/sft/model", "rl.reward.model={repo}/artifacts/rm/model",
    "sft.output_dir=artifacts/sft2", "rl.train_data=data/rl.jsonl", "rl.reward.file=null", "rl.reward.url=", "rl.rollout.agent=retry_arithmetic",
    "rl_variants.rlhf={algo: ppo, reward_model: artifacts/rm/model}", "rl.objective.kl_coef=0.02",
])
def test_a_deployment_run_may_tune_and_use_paths_inside_the_repo(repo, item):
    check_overrides([item.replace("{repo}", str(repo))], repo, from_deployment=True)


def test_serve_can_allow_a_key_by_dotted_name_or_by_name(repo, monkeypatch):
    check_overrides(["rl.reward.file=/opt/r.py"], repo, True, {"rl.reward.file"})
    check_overrides(["rl_variants.rlhf.reward_file=/opt/r.py", "rl.reward.file=x.py"], repo, True, {"reward_file"})
    with pytest.raises(OverrideRefused, match="rl.rollout.agent_file"):  # one key's opt-in is not another's
        check_overrides(["rl.rollout.agent_file=/opt/e.py"], repo, True, {"rl.reward.file"})
    with pytest.raises(OverrideRefused, match="rl_variants.rlhf.reward_file"):
        check_overrides(["rl_variants.rlhf.reward_file=/opt/r.py"], repo, True, {"rl.reward.file"})
    monkeypatch.setenv(ALLOW_ENV, "rl.reward.file, reward_url,,")
    assert allowed_from_env() == {"rl.reward.file", "reward_url"}
    monkeypatch.delenv(ALLOW_ENV)
    assert allowed_from_env() == set()


@pytest.mark.parametrize("from_deployment", [False, True])
@pytest.mark.parametrize("item", [f"rl.reward.url=https://user:{PASSWORD}@host/score", f"rl.reward.url=http://h/score?token={PASSWORD}",
                                  f"rl_variants.rlhf={{reward_url: 'https://u:{PASSWORD}@h/score'}}"])
def test_credentials_are_never_written_into_params_yaml(repo, item, from_deployment):
    """For every caller, the CLI's `--set` included, and even where the key is allowed."""
    with pytest.raises(OverrideRefused) as e:
        check_overrides([item], repo, from_deployment, {"reward_url"})
    message = str(e.value)
    assert "carries credentials" in message and "rl.reward.token_file=PATH" in message and "rlhf stage run rl --set" in message
    assert PASSWORD not in message and "***" in message


def test_a_malformed_override_is_refused_without_quoting_its_value(repo):
    with pytest.raises(OverrideRefused, match="SECTION.KEY=VALUE"):
        check_overrides([f"reward_url=https://u:{PASSWORD}@h"], repo, False)
    with pytest.raises(OverrideRefused, match="not valid YAML") as e:
        check_overrides([f"rl.reward.url=[{PASSWORD}"], repo, False)
    assert PASSWORD not in str(e.value)


def test_a_deployment_run_works_on_the_served_repo_only(repo, tmp_path):
    env = {REPO_ENV: str(repo)}
    check_repo(repo, True, env)
    check_repo(tmp_path / "other", False, env)  # the CLI names its repo
    with pytest.raises(OverrideRefused, match="refused for a flow run from a deployment"):
        check_repo(tmp_path / "other", True, env)


@pytest.mark.parametrize("deployment_id, item", [("dep-1", "rl.reward.file=/tmp/evil.py"),
                                                 (None, f"rl.reward.url=https://u:{PASSWORD}@h/score")])
def test_the_flow_refuses_before_anything_is_written(repo, monkeypatch, deployment_id, item):
    """The flow itself: a refused override fails the run with params.yaml untouched, no lock taken."""
    import flows.pipeline as P

    monkeypatch.setattr(P, "deployment", types.SimpleNamespace(id=deployment_id))
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    monkeypatch.delenv(REPO_ENV, raising=False)
    before = (repo / "params.yaml").read_bytes()
    listing = lambda: sorted((d, sorted(f)) for d, _, f in os.walk(repo))  # noqa: E731
    files = listing()
    with pytest.raises(OverrideRefused):
        P.alignment_pipeline.fn(overrides=["rl.max_steps=3", item], repo=str(repo), push=False)
    assert (repo / "params.yaml").read_bytes() == before and listing() == files
    # the same overrides, allowed, do reach params.yaml through the flow's own writer
    if deployment_id:
        monkeypatch.setenv(ALLOW_ENV, "rl.reward.file")
        P.check_overrides(["rl.max_steps=3", item], repo, True, P.allowed_from_env())
        P.apply_overrides(repo, ["rl.max_steps=3", item])
        assert "reward:\n    file: /tmp/evil.py" in (repo / "params.yaml").read_text() and "# a comment" in (repo / "params.yaml").read_text()


def test_pipeline_run_refuses_credentials_before_prefect_sees_them(tmp_path, capsys):
    """`rlhf pipeline run --set` with a credential fails before the flow starts: Prefect stores a
    flow run's parameters when the run is created, before its body could refuse them."""
    from rlhf_core.cli import main

    (tmp_path / "params.yaml").write_text("rl:\n  max_steps: 3\n")
    code = main(["pipeline", "run", "--repo", str(tmp_path), "--set", "rl.reward.url=https://u:pa55w0rd@h/score"])
    err = capsys.readouterr().err
    assert code == 2 and "carries credentials" in err and "pa55w0rd" not in err
    assert (tmp_path / "params.yaml").read_text() == "rl:\n  max_steps: 3\n" and not (tmp_path / ".prefect").exists()


def test_an_old_rl_key_is_written_under_its_new_name(tmp_path, caplog):
    """`rlhf pipeline run --set rl.kl_coef=...` beside a params.yaml holding the new key: written
    under the old name, the stage would see both and refuse; the flow writes the new key."""
    import flows.pipeline as P

    (tmp_path / "params.yaml").write_text("rl:\n  objective:\n    kl_coef: 0.01\nrl_variants:\n  rlhf:\n    reward:\n      model: a\n")
    P.apply_overrides(tmp_path, ["rl.kl_coef=0.2", "rl_variants.rlhf.reward_model=b", "rl.max_steps=3", "sft.kl_coef=1"])
    data = yaml.safe_load((tmp_path / "params.yaml").read_text())
    assert data["rl"] == {"objective": {"kl_coef": 0.2}, "max_steps": 3} and data["rl_variants"]["rlhf"] == {"reward": {"model": "b"}}
    assert data["sft"] == {"kl_coef": 1}  # another stage's key of the same name is its own
    assert "rl.kl_coef is now rl.objective.kl_coef" in caplog.text


def test_an_opt_in_under_a_settings_old_name_lets_its_new_name_through(tmp_path):
    """`rlhf serve --allow-override rl.reward_file` (the old dotted name) allows `rl.reward.file`,
    and the new dotted name allows the old; another setting stays refused."""
    check_overrides(["rl.reward.file=/tmp/r.py"], tmp_path, True, {"rl.reward_file"})
    check_overrides(["rl.reward_file=/tmp/r.py"], tmp_path, True, {"rl.reward.file"})
    with pytest.raises(OverrideRefused, match="rl.reward.token_file"):
        check_overrides(["rl.reward.token_file=/tmp/t"], tmp_path, True, {"rl.reward_file"})
