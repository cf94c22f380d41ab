from dataclasses import dataclass, field
from typing import Literal, Optional

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
