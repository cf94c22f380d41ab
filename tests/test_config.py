from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional

import pytest

from rlhf_core.config import ConfigError, config_hash, config_to_dict, from_dict, load_config, parse_overrides

pytestmark = pytest.mark.unit


@dataclass(frozen=True, kw_only=True)
class Inner:
    coef: float = 0.1
    estimator: Literal["k1", "k2", "k3"] = "k1"


@dataclass(frozen=True, kw_only=True)
class Cfg:
    algo: Literal["ppo", "grpo"] = "ppo"
    max_steps: int = 10
    lr: float = 1e-5
    model_path: Optional[str] = None
    use_x: bool = False
    ops: tuple[str, ...] = ("+",)
    kl: Inner = field(default_factory=Inner)


def test_defaults_then_params_then_overrides(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("rl:\n  max_steps: 20\n  kl:\n    coef: 0.5\n")
    cfg = load_config(Cfg, "rl", params, ["rl.algo=grpo", "kl.estimator=k3", "rl.lr=3e-4", "rl.ops=[+, '-']"])
    assert cfg == Cfg(algo="grpo", max_steps=20, lr=3e-4, ops=("+", "-"), kl=Inner(coef=0.5, estimator="k3"))


def test_unknown_key_lists_valid_keys(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(Cfg, "rl", tmp_path / "none.yaml", ["rl.max_step=5"])
    msg = str(e.value)
    assert "rl.max_step" in msg and "rl.max_steps" in msg and "rl.kl.coef" in msg
    with pytest.raises(ConfigError, match="rl.kl.nope"):
        load_config(Cfg, "rl", tmp_path / "none.yaml", ["rl.kl.nope=1"])


@pytest.mark.parametrize("override, needle", [
    ("rl.max_steps=ten", "rl.max_steps: expected an integer"),
    ("rl.max_steps=2.5", "expected an integer"),
    ("rl.max_steps=true", "expected an integer"),
    ("rl.lr=fast", "rl.lr: expected a number"),
    ("rl.algo=dqn", "not one of ['ppo', 'grpo']"),
    ("rl.use_x=1", "expected true/false"),
    ("rl.kl=3", "expected a mapping"),
    ("rl.max_steps", "KEY=VALUE"),
])
def test_wrong_types(override, needle, tmp_path):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        load_config(Cfg, "rl", tmp_path / "none.yaml", [override])


def test_int_is_accepted_for_float_and_hash_is_stable():
    a = from_dict(Cfg, {"lr": 1})
    assert a.lr == 1.0 and isinstance(a.lr, float)
    assert config_hash(a) == config_hash(from_dict(Cfg, {"lr": 1.0}))
    assert config_hash(a) != config_hash(from_dict(Cfg, {"lr": 2.0}))
    assert config_to_dict(a)["ops"] == ["+"]


def test_parse_overrides_nests():
    assert parse_overrides(["rl.kl.coef=0.2", "algo=ppo"], "rl") == {"kl": {"coef": 0.2}, "algo": "ppo"}


@dataclass(frozen=True, kw_only=True)
class Moved:
    """A config whose settings moved: `coef` and `kl_estimator` into the `kl` section."""
    RENAMED: ClassVar[dict[str, str]] = {"coef": "kl.coef", "kl_estimator": "kl.estimator"}
    max_steps: int = 10
    output_dir: str = ""
    kl: Inner = field(default_factory=Inner)


def test_an_old_key_is_moved_to_its_new_place_with_a_warning(tmp_path, caplog):
    """`RENAMED` (old key -> new dotted key) works in each layer: params.yaml's section, a variant,
    `--set`; a layer's old key overrides an earlier layer's new one (the layers merge after the move)."""
    params = tmp_path / "params.yaml"
    params.write_text("rl:\n  coef: 0.5\n  max_steps: 3\nrl_variants:\n  v:\n    kl_estimator: k2\n")
    with caplog.at_level("WARNING", logger="rlhf.config"):
        cfg = load_config(Moved, "rl", params)
    assert cfg == Moved(max_steps=3, kl=Inner(coef=0.5))
    assert "rl.coef is now rl.kl.coef" in caplog.text
    assert load_config(Moved, "rl@v", params) == Moved(max_steps=3, output_dir="artifacts/rl@v", kl=Inner(coef=0.5, estimator="k2"))
    assert "rl_variants.v.kl_estimator is now rl_variants.v.kl.estimator" in caplog.text
    params.write_text("rl:\n  kl:\n    coef: 0.5\n")
    assert load_config(Moved, "rl", params, ["rl.coef=0.25"]).kl.coef == 0.25  # --set's old name beats the file's new one
    assert load_config(Moved, "rl", params, ["rl.kl.estimator=k3", "rl.coef=0.3"]).kl == Inner(coef=0.3, estimator="k3")
    assert from_dict(Moved, {"coef": 0.2, "kl": {"estimator": "k3"}}).kl == Inner(coef=0.2, estimator="k3")
    data = {"coef": 0.2}
    from_dict(Moved, data)
    assert data == {"coef": 0.2}  # the caller's dict is left as it was


def test_an_old_and_a_new_key_together_are_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"rl.coef and rl.kl.coef are both given"):
        load_config(Moved, "rl", tmp_path / "none.yaml", ["rl.coef=0.2", "rl.kl.coef=0.3"])
    with pytest.raises(ConfigError, match=r"coef and kl.coef are both given"):
        from_dict(Moved, {"coef": 0.2, "kl": {"coef": 0.3}})
    params = tmp_path / "params.yaml"
    params.write_text("rl:\n  kl_estimator: k2\n  kl:\n    estimator: k3\n")
    with pytest.raises(ConfigError, match=r"rl.kl_estimator and rl.kl.estimator are both given"):
        load_config(Moved, "rl", params)


# the rl stage's flat keys before its settings became sections: every one must still load
RL_FLAT_KEYS = {
    "rollout": "prompts_per_step n_samples max_new_tokens temperature engine mode max_staleness partial_rollout_tokens layout rollout_workers "
               "rollout_cpus rollout_gpus rollout_tensor_parallel weight_sync rollout_resource engine_sleep engine_sleep_level "
               "gpu_memory_utilization rollout_timeout agent agent_file max_turns env_timeout",
    "reward": "reward_file reward_model reward_url reward_token_file reward_url_protocol reward_file_weight reward_model_weight "
              "reward_url_weight env_reward_weight reward_url_timeout reward_url_retries max_invalid_ratio overlong_buffer overlong_penalty",
    "objective": "kl_coef kl_mode kl_estimator kl_clamp adaptive_kl kl_target kl_horizon loss_type clip_low clip_high dual_clip loss_agg_mode "
                 "entropy_coef gamma lam whiten_gae singleton_group reward_clip critic_lr value_clip is_correction is_low is_high "
                 "is_batch_normalize dynamic_sampling dynamic_sampling_rounds",
}


def test_the_rl_configs_old_flat_keys_load_into_their_sections(tmp_path, caplog):
    import dataclasses

    from stages.rl import Config

    old = {key: section for section, keys in RL_FLAT_KEYS.items() for key in keys.split()}
    assert set(Config.RENAMED) == set(old)
    from rlhf_core.rl.config import _renamed

    assert Config.RENAMED == _renamed()  # the flows' plain table (rl/renamed.py) is the sections' rule
    for key, new in Config.RENAMED.items():
        section, name = new.split(".")
        assert section == old[key] and name in {f.name for f in dataclasses.fields(getattr(Config(), section))}, key
    assert {k: v for k, v in Config.RENAMED.items() if k.split("_")[0] in ("rollout", "reward") or k == "env_reward_weight"} == {
        "rollout_workers": "rollout.workers", "rollout_cpus": "rollout.cpus", "rollout_gpus": "rollout.gpus",
        "rollout_tensor_parallel": "rollout.tensor_parallel", "rollout_resource": "rollout.resource", "rollout_timeout": "rollout.timeout",
        "reward_file": "reward.file", "reward_model": "reward.model", "reward_url": "reward.url", "reward_token_file": "reward.token_file",
        "reward_url_protocol": "reward.url_protocol", "reward_file_weight": "reward.file_weight", "reward_model_weight": "reward.model_weight",
        "reward_url_weight": "reward.url_weight", "env_reward_weight": "reward.env_weight", "reward_url_timeout": "reward.url_timeout",
        "reward_url_retries": "reward.url_retries", "reward_clip": "objective.reward_clip"}
    params = tmp_path / "params.yaml"
    params.write_text("rl:\n  kl_coef: 0.05\n  rollout_workers: 2\n  reward_url: http://h/score\n  temperature: 0.7\n"
                      "rl_variants:\n  v:\n    reward_model: artifacts/rm/model\n")
    with caplog.at_level("WARNING", logger="rlhf.config"):
        cfg = load_config(Config, "rl@v", params, ["rl.n_samples=4", "rl.rollout_gpus=0.5", "rl.global_batch_size=256"])
    assert (cfg.objective.kl_coef, cfg.rollout.workers, cfg.reward.url, cfg.rollout.temperature) == (0.05, 2, "http://h/score", 0.7)
    assert (cfg.reward.model, cfg.rollout.n_samples, cfg.rollout.gpus) == ("artifacts/rm/model", 4, 0.5)
    for said in ("rl.kl_coef is now rl.objective.kl_coef", "rl.rollout_workers is now rl.rollout.workers",
                 "rl_variants.v.reward_model is now rl_variants.v.reward.model", "rl.rollout_gpus is now rl.rollout.gpus"):
        assert said in caplog.text
    assert cfg == load_config(Config, "rl", tmp_path / "none.yaml", [
        "rl.objective.kl_coef=0.05", "rl.rollout.workers=2", "rl.reward.url=http://h/score", "rl.rollout.temperature=0.7",
        "rl.reward.model=artifacts/rm/model", "rl.rollout.n_samples=4", "rl.rollout.gpus=0.5", "rl.output_dir=artifacts/rl@v",
        "rl.global_batch_size=256"])
    with pytest.raises(ConfigError, match=r"rl.kl_coef and rl.objective.kl_coef are both given"):
        load_config(Config, "rl", tmp_path / "none.yaml", ["rl.kl_coef=0.1", "rl.objective.kl_coef=0.2"])


def test_the_readmes_renamed_rl_settings_table_is_config_renamed():
    """README's "Renamed rl settings" table is `Config.RENAMED`, rendered (regenerate it from here)."""
    from pathlib import Path

    from stages.rl import Config

    rows: dict[str, list[str]] = {}
    for old, new in Config.RENAMED.items():
        section, name = new.split(".")
        rows.setdefault(section, []).append(f"`{old}`" if old == name else f"`{old}` → `{name}`")
    table = "| section | its settings' old flat keys (`rl.KEY`; renamed ones: old → new name in the section) |\n|---|---|\n" + \
        "".join(f"| `rl.{section}.` | {', '.join(items)} |\n" for section, items in rows.items())
    assert table in (Path(__file__).resolve().parents[1] / "README.md").read_text()
