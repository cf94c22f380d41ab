"""RL step maths, collation alignment, reward validation and the episode runner (real engine)."""
import contextlib
import json
import math
import threading
from http.server import ThreadingHTTPServer

import pytest
import torch
from conftest import JsonHandler, make_batch

from rlhf_core.rl import collate as rl_collate
from rlhf_core.rl.advantages import compute_advantages
from rlhf_core.rollout import rewards as R
from rlhf_core.rollout.agents import LocalEnvironments, RetryArithmetic, SingleTurn, environments, run_episodes
from rlhf_core.rollout.engines import Completion

pytestmark = pytest.mark.unit


def sample(prompt_len, response, mask, group, score, **kw):
    n = len(response)
    return {"token_ids": list(range(1, prompt_len + 1)) + response, "prompt_len": prompt_len, "action_mask": mask, "group": group,
            "score": score, "old_logprobs": kw.get("old", [-1.0] * n), "ref_logprobs": kw.get("ref", [-1.0] * n),
            "engine_logprobs": [-1.0] * n, "old_values": kw.get("values", [0.0] * n)}


def test_collate_aligns_response_lists_with_next_token_logits():
    s = sample(3, [7, 8], [1, 1], 0, 1.0, old=[-0.5, -0.25])
    s2 = sample(2, [9, 9, 9], [1, 0, 1], 0, 0.0, old=[-1.0, 0.0, -2.0])
    b = rl_collate.RLCollate(pad_id=0, keys=("action_mask", "old_logprobs"))(make_batch([s, s2]))
    assert b["input_ids"].tolist() == [[1, 2, 3, 7, 8], [1, 2, 9, 9, 9]]
    # token at absolute position p is predicted by logits row p - 1
    assert b["action_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 0, 1]]
    assert b["old_logprobs"].tolist() == [[0, 0, -0.5, -0.25], [0, -1.0, 0.0, -2.0]]
    assert rl_collate._slices(b["old_logprobs"], b) == [[-0.5, -0.25], [-1.0, 0.0, -2.0]]


def test_grpo_advantages_broadcast_group_normalised_score():
    samples = make_batch([sample(2, [5, 6], [1, 1], 0, s) for s in (1.0, 0.0, 0.0, 1.0)] + [sample(2, [5], [1], 1, 0.5)])
    out, stats = compute_advantages(samples, "grpo", kl_coef=0.0, kl_in_reward=False, kl_estimator="k3", gamma=1.0, lam=1.0,
                                            whiten_gae=False, reward_clip=None)
    assert out.per_token("advantages", 0) == pytest.approx([0.86603, 0.86603], abs=1e-4)
    assert out.per_token("advantages", 1) == pytest.approx([-0.86603, -0.86603], abs=1e-4)
    assert out.per_token("advantages", 4) == [0.0]  # a group of one has no baseline
    verl_style, _ = compute_advantages(samples, "grpo", kl_coef=0.0, kl_in_reward=False, kl_estimator="k3", gamma=1.0, lam=1.0,
                                               whiten_gae=False, reward_clip=None, singleton_group="score")
    assert verl_style.per_token("advantages", 4) == [0.5]  # rl.objective.singleton_group=score: its raw score, as verl
    assert samples.advantages is None  # a new batch: the input is not mutated
    assert stats["kl"] == 0.0


def test_kl_in_reward_and_masked_env_tokens():
    s = sample(2, [5, 6, 7], [1, 0, 1], 0, 1.0, old=[-1.0, 0.0, -1.0], ref=[-2.0, 0.0, -2.0])
    out, _ = compute_advantages(make_batch([s]), "reinforce_pp", kl_coef=0.5, kl_in_reward=True, kl_estimator="k1", gamma=1.0,
                                        lam=1.0, whiten_gae=False, reward_clip=None)
    # k1 = 1 on each action token; rewards [-0.5, 0 (env), 1 - 0.5]; returns [0, _, 0.5]; env token stays 0
    assert out.per_token("returns", 0) == pytest.approx([0.0, 0.0, 0.5])
    assert out.per_token("kl", 0) == pytest.approx([1.0, 0.0, 1.0])


def test_kl_clamp_bounds_the_reward_side_kl():
    s = sample(2, [5, 6], [1, 1], 0, 1.0, old=[-1.0, 0.0], ref=[-13.0, -0.5])  # k1 = 12, 0.5
    for clamp, expected in ((None, [12.0, 0.5]), (10.0, [10.0, 0.5])):
        out, _ = compute_advantages(make_batch([s]), "reinforce_pp", kl_coef=0.5, kl_in_reward=True, kl_estimator="k1", gamma=1.0,
                                            lam=1.0, whiten_gae=False, reward_clip=None, kl_clamp=clamp)
        assert out.per_token("kl", 0) == pytest.approx(expected)


def test_reward_validation_never_turns_bad_values_into_zero():
    values, _, why = R._validate("f", [1.0, float("nan"), None, "x"], 4)
    assert values[0] == 1.0 and all(math.isnan(v) for v in values[1:])
    assert why[0] is None and all(w and "f returned" in w for w in why[1:])
    with pytest.raises(R.RewardError, match="returned 1 rewards for 2 samples"):
        R._validate("f", [1.0], 2)
    with pytest.raises(R.RewardError, match="without 'rewards'"):
        R._validate("f", {"scores": [1]}, 1)
    v, comps, _ = R._validate("f", {"rewards": [1, 2], "components": {"fmt": [0.5, 0.5]}}, 2)
    assert v == [1.0, 2.0] and comps == {"fmt": [0.5, 0.5]}


def test_a_nan_reward_component_makes_its_sample_invalid():
    """A component is part of the reward's output: NaN/None/garbage there is a broken reward for
    that sample, not a number to log (it used to pass unchecked)."""
    out = {"rewards": [1.0, 1.0, 1.0], "components": {"fmt": [0.5, float("nan"), None], "len": [1, 2, "x"]}}
    v, comps, why = R._validate("f", out, 3)
    assert v == [1.0, 1.0, 1.0] and why[0] is None
    assert why[1] == "f component 'fmt' returned nan" and why[2] == "f component 'fmt' returned None"
    assert comps["fmt"][0] == 0.5 and math.isnan(comps["len"][2])
    with pytest.raises(R.RewardError, match="component 'fmt' is not a list of 2 values"):
        R._validate("f", {"rewards": [1, 2], "components": {"fmt": 0.5}}, 2)


def test_vllm_output_without_logprobs_is_an_error_not_zero():
    """vLLM's CompletionOutput as `VLLMEngine.generate` reads it (the engine cannot be made to drop
    log-probs on demand): a missing log-prob used to become 0.0, i.e. probability 1."""
    from types import SimpleNamespace

    from rlhf_core.rollout.engines import vllm_completion

    lp = lambda v: SimpleNamespace(logprob=v)  # noqa: E731
    ok = vllm_completion(SimpleNamespace(token_ids=[5, 6], logprobs=[{5: lp(-0.1)}, {6: lp(-0.2), 9: lp(-3.0)}], finish_reason="length"))
    assert (ok.token_ids, ok.logprobs, ok.finish_reason) == ([5, 6], [-0.1, -0.2], "length")
    with pytest.raises(RuntimeError, match=r"no log-prob for every sampled token \(none\)"):
        vllm_completion(SimpleNamespace(token_ids=[5, 6], logprobs=None, finish_reason="stop"))
    with pytest.raises(RuntimeError, match=r"\(1 for 2 tokens\)"):
        vllm_completion(SimpleNamespace(token_ids=[5, 6], logprobs=[{5: lp(-0.1)}], finish_reason="stop"))
    with pytest.raises(RuntimeError, match="lack the sampled token 6"):
        vllm_completion(SimpleNamespace(token_ids=[5, 6], logprobs=[{5: lp(-0.1)}, {7: lp(-0.1)}], finish_reason="stop"))


def test_reward_file_loading_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        R.FunctionReward(str(tmp_path / "missing.py"))
    f = tmp_path / "r.py"
    f.write_text("def score(*a): return []\n")
    with pytest.raises(AttributeError, match="must define `def reward"):
        R.FunctionReward(str(f))


class _Handler(JsonHandler):
    calls = 0

    def do_POST(self):  # noqa: N802
        type(self).calls += 1
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.server.mode == "500":
            return self.reply(code=500)
        self.reply({"rewards": [float(len(r)) for r in body["responses"]]})


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.mode = "ok"
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()


def test_http_reward_ok_500_and_down(server):
    url = f"http://127.0.0.1:{server.server_address[1]}/score"
    samples = [{"prompt": "p", "response": "abc", "label": "x", "token_ids": [1, 2]}]
    assert R.HttpReward(url)(samples)[0] == [3.0]
    server.mode, _Handler.calls = "500", 0
    with pytest.raises(R.RewardError, match=f"reward server {url} failed after 3 attempt"):
        R.HttpReward(url, retries=2, backoff=0.01)(samples)
    assert _Handler.calls == 3  # bounded: 1 + 2 retries
    dead = "http://127.0.0.1:9/score"
    with pytest.raises(R.RewardError, match="reward server http://127.0.0.1:9/score failed"):
        R.HttpReward(dead, timeout=1, retries=1, backoff=0.01)(samples)


# --- the episode runner with a real engine (HF generate on the tiny base model) ----------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoTokenizer

    from rlhf_core.models.tiny import TinyModelConfig, build_model, build_tokenizer

    out = tmp_path_factory.mktemp("tiny")
    tok = build_tokenizer(["Q: 12+30= A: 42 wrong, try again."] * 10, vocab_size=300)
    tok.save_pretrained(out)
    build_model(TinyModelConfig(), tok, seed=0).save_pretrained(out)
    return out, AutoTokenizer.from_pretrained(out)


class ScriptedEngine:
    """Answers every turn with " 7" + EOS.  The runner's bookkeeping must hold for any tokens; a
    real engine cannot be made to end its turns (a random tiny model hardly ever samples EOS, so
    its episodes end at the token budget after one turn and a masking check on them is vacuous)."""

    def __init__(self, tok):
        self.ids = tok(" 7", add_special_tokens=False).input_ids + [tok.eos_token_id]

    def generate(self, prompts, max_tokens, temperature, seeds):
        return [Completion(self.ids[:m], [-0.5] * len(self.ids[:m]), "stop" if m >= len(self.ids) else "length") for m in max_tokens]


def test_multi_turn_episode_masks_environment_tokens(tiny):
    """Every turn is wrong: three turns, and exactly the two feedback blocks are masked out."""
    _, tok = tiny
    engine = ScriptedEngine(tok)
    eps = run_episodes(engine, tok, LocalEnvironments(RetryArithmetic), ["Q: 12+30= A:"] * 2, ["42"] * 2, [1, 2], max_new_tokens=3,
                       temperature=1.0, max_len=64)
    act, fb = engine.ids, tok(" wrong, try again. A:", add_special_tokens=False).input_ids
    prompt = tok("Q: 12+30= A:").input_ids
    for ep in eps:
        assert (ep.turns, ep.env_reward, ep.finish_reason) == (3, 0.0, "stop")
        assert ep.token_ids == prompt + act + fb + act + fb + act and ep.prompt_len == len(prompt)
        assert ep.action_mask == [1] * len(act) + [0] * len(fb) + [1] * len(act) + [0] * len(fb) + [1] * len(act)
        assert ep.engine_logprobs == [-0.5 if m else 0.0 for m in ep.action_mask]  # feedback tokens carry no engine log-prob


def test_episodes_are_a_function_of_weights_prompts_and_seeds(tiny):
    from rlhf_core.rollout.engines import HFEngine

    path, tok = tiny
    engine = HFEngine(str(path), max_model_len=64, seed=0)
    run = lambda: run_episodes(engine, tok, LocalEnvironments(RetryArithmetic), ["Q: 12+30= A:"] * 2, ["42"] * 2, [1, 2],  # noqa: E731
                               max_new_tokens=3, temperature=1.0, max_len=64)
    first = run()
    assert all(len(e.action_mask) == len(e.token_ids) - e.prompt_len == len(e.engine_logprobs) for e in first)
    assert [e.token_ids for e in first] == [e.token_ids for e in run()]


def test_hung_environment_times_out_and_stops_running(tiny, tmp_path):
    """A user environment whose step never returns: the call is an error after env_timeout, and it
    does not run on afterwards (a thread could not be stopped: it kept writing its heartbeat)."""
    import os
    import time

    beat = tmp_path / "heartbeat"
    env_file = tmp_path / "hung_env.py"
    env_file.write_text("import time\nclass Environment:\n    def reset(self, prompt, label):\n        return prompt\n"
                        f"    def step(self, action):\n        while True:\n            open({str(beat)!r}, 'a').write('.')\n"
                        "            time.sleep(0.05)\n")
    path, tok = tiny
    envs = environments("single_turn", str(env_file), timeout=1.0)
    with pytest.raises(TimeoutError, match=r"environment call step took longer than 1.0s \(env_timeout\); its process was killed"):
        run_episodes(ScriptedEngine(tok), tok, envs, ["Q: 1+1= A:"], ["2"], [0], 2, 1.0, 64)
    size = beat.stat().st_size
    assert size > 0  # it did run, and hang
    time.sleep(0.5)
    assert beat.stat().st_size == size and envs.proc is None
    # the next batch gets a fresh process; a raising environment is an error naming the call
    env_file.write_text("class Environment:\n    def reset(self, prompt, label):\n        print('noise on stdout')\n        return prompt\n"
                        "    def step(self, action):\n        raise KeyError('boom')\n")
    envs = environments("single_turn", str(env_file), timeout=5.0)
    with pytest.raises(RuntimeError, match="environment call step raised KeyError: 'boom'"):
        run_episodes(ScriptedEngine(tok), tok, envs, ["Q: 1+1= A:"], ["2"], [0], 2, 1.0, 64)
    pid = envs.proc.pid
    envs.close()
    assert envs.proc is None and not os.path.exists(f"/proc/{pid}")  # killed and reaped


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.5])
def test_trainer_logprobs_are_the_engines_at_the_sampling_temperature(tiny, temperature):
    """The engine reports the log-prob of the distribution it sampled from, softmax(logits / T);
    the trainer's old/reference log-probs must be of the same one (they ignored T: at T != 1 the
    PPO ratio started off-policy and the TIS weights were biased)."""
    from transformers import AutoModelForCausalLM

    from rlhf_core.rollout.engines import HFEngine

    path, tok = tiny
    prompt = tok("Q: 12+30= A:").input_ids
    out = HFEngine(str(path), max_model_len=64, seed=0).generate([prompt], [6], temperature, [7])[0]
    sample = {"token_ids": prompt + out.token_ids, "prompt_len": len(prompt), "action_mask": [1] * len(out.token_ids)}
    batch = rl_collate.RLCollate(pad_id=tok.pad_token_id, keys=("action_mask",))(make_batch([sample]))
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        trainer = rl_collate.logprobs_fn(model, batch, temperature=temperature)[0]
    assert trainer == pytest.approx(out.logprobs, abs=1e-5)


def test_partial_rollout_continues_under_the_weights_synced_between_pieces(tiny):
    """segment=2: each turn in pieces of 2 tokens; a sync applied before the second piece (the
    `version` callback stands where the rollout worker lets a waiting sync in) gives the later
    tokens version 1 and their log-probs the new weights'.  One piece = the unsegmented turn."""
    from rlhf_core.rollout.engines import HFEngine

    path, tok = tiny
    engine = HFEngine(str(path), max_model_len=64, seed=0)
    args = (tok, LocalEnvironments(SingleTurn), ["Q: 12+30= A:"] * 2, ["42"] * 2, [1, 2])
    whole = run_episodes(engine, *args, max_new_tokens=6, temperature=1.0, max_len=64)
    one_piece = run_episodes(engine, *args, max_new_tokens=6, temperature=1.0, max_len=64, segment=6)
    assert [e.token_ids for e in one_piece] == [e.token_ids for e in whole] and all(e.token_versions == [0] * 6 for e in whole)

    calls = []
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in engine.model.state_dict().items()}

    def version():  # the sync lands after the first piece
        calls.append(1)
        if len(calls) == 2:
            engine.update_weights(list(new.items()))
        return 0 if len(calls) < 2 else 1

    eps = run_episodes(engine, *args, max_new_tokens=6, temperature=1.0, max_len=64, segment=2, version=version)
    assert len(calls) == 3 and all(e.token_versions == [0, 0, 1, 1, 1, 1] for e in eps)
    for e in eps:  # the pieces after the sync were sampled by the new weights: their log-probs are its
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([e.token_ids])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1)[torch.arange(len(e.token_ids) - 1), torch.tensor(e.token_ids[1:])][e.prompt_len - 1:]
        assert torch.allclose(lp[2:], torch.tensor(e.engine_logprobs[2:]), atol=1e-4)
        assert not torch.allclose(lp[:2], torch.tensor(e.engine_logprobs[:2]), atol=1e-4)


def test_hf_engine_weight_update_is_in_place_and_checked(tiny):
    from rlhf_core.rollout.engines import HFEngine

    path, _ = tiny
    engine = HFEngine(str(path), max_model_len=64, seed=0)
    name = "model.layers.0.mlp.down_proj.weight"
    new = dict(engine.model.state_dict())
    new[name] = torch.full_like(new[name], 0.5)
    param = dict(engine.model.named_parameters())[name]
    engine.update_weights(list(new.items()))
    assert dict(engine.model.named_parameters())[name] is param and torch.all(param == 0.5)  # same tensor, new values
    with pytest.raises(RuntimeError, match="weight sync mismatch"):
        engine.update_weights([("nope", torch.zeros(1))])


def _episodes(n):
    return [{"prompt": "Q: 1+1= A:", "response": " 2", "label": "2", "token_ids": [1, 2, 3], "prompt_len": 2, "action_mask": [1], "turns": 1,
             "env_reward": None, "filter": "kept"} for _ in range(n)]


def test_reward_worker_failures_become_invalid_then_abort(tmp_path):
    """A raising reward marks every sample invalid (with the reason) and the step aborts above the
    threshold; a wrong count is an error; nothing becomes 0.0."""
    from rlhf_core.rl.config import Config
    from rlhf_core.rl.sampling import apply_rewards
    from rlhf_core.rollout.config import RewardConfig
    from rlhf_core.rollout.workers import RewardWorker

    def worker(body):
        f = tmp_path / f"r{abs(hash(body))}.py"
        f.write_text(body)
        return RewardWorker(sources={"reward_file": {"path": str(f)}}, weights={})

    cfg = Config(reward=RewardConfig(max_invalid_ratio=0.25))
    samples = make_batch(_episodes(4))
    scored = worker("def reward(p, r, l, **kw):\n    raise KeyError('oops')\n").score(samples.reward_inputs())
    assert all(math.isnan(x["score"]) and "reward_file raised KeyError" in x["invalid"] for x in scored)
    with pytest.raises(RuntimeError, match="4 of 4 samples have an invalid reward, above rl.reward.max_invalid_ratio=0.25"):
        apply_rewards(cfg, samples, scored)

    scored = worker("def reward(p, r, l, **kw):\n    return [None, 1, 1, 1]\n").score(samples.reward_inputs())
    out, invalid = apply_rewards(cfg, samples, scored)
    assert invalid == 1  # 1 of 4 = the threshold: counted, not fatal
    assert out.filter == ["invalid", "kept", "kept", "kept"] and math.isnan(out.score[0]) and out.score[1:] == [1.0, 1.0, 1.0]

    with pytest.raises(R.RewardError, match="returned 1 rewards for 4 samples"):
        worker("def reward(p, r, l, **kw):\n    return [1.0]\n").score(_episodes(4))
    with pytest.raises(R.RewardError, match="no reward source"):
        RewardWorker(sources={}, weights={}).score(_episodes(1))
    # the built-in default scores exact matches against the label
    assert [x["score"] for x in RewardWorker(sources={"exact_match": {}}, weights={}).score(_episodes(2))] == [1.0, 1.0]


def test_reward_sources_are_selected_from_the_registry(tmp_path):
    """`REWARD_SOURCES` is the one table: what a config turns on, with which keywords and weights,
    and which files a run depends on; every entry's weight and input settings are `rl.reward`
    settings (`RewardConfig` fields) and its keywords are its class's parameters."""
    import dataclasses
    import inspect

    from rlhf_core.rl.config import Config
    from rlhf_core.rollout.config import RewardConfig, RolloutConfig

    fields = {f.name for f in dataclasses.fields(RewardConfig)}
    for name, src in R.REWARD_SOURCES.items():
        assert src.weight and {src.weight, *src.inputs} <= fields, name
    assert {src.weight for src in R.REWARD_SOURCES.values()} | {"env_weight"} == {f for f in fields if f.endswith("_weight")}
    (tmp_path / "r.py").write_text("def reward(p, r, l, **kw):\n    return [1.0] * len(r)\n")
    cfg = Config(reward=RewardConfig(file=str(tmp_path / "r.py"), url="http://127.0.0.1:9/score", url_weight=0.5))
    chosen = R.selected_sources(cfg, pad_token_id=0)
    assert list(chosen) == ["reward_file", "reward_url"] and chosen["reward_url"]["timeout"] == cfg.reward.url_timeout
    for name, kwargs in chosen.items():
        assert set(kwargs) <= set(inspect.signature(R.REWARD_SOURCES[name].cls).parameters), name
    assert R.source_weights(cfg) == {"reward_file": 1.0, "reward_model": 1.0, "reward_url": 0.5, "env": 1.0}
    assert R.reward_inputs(cfg) == (str(tmp_path / "r.py"),)
    assert R.reward_inputs(Config(reward=RewardConfig(model="artifacts/rm/model"))) == ("artifacts/rm/model",)
    assert R.selected_sources(Config(), 0) == {"exact_match": {}}  # nothing configured: the exact match
    assert R.selected_sources(Config(rollout=RolloutConfig(agent="retry_arithmetic")), 0) == {}  # the environment rewards


def sequence_rm(tiny, name: str):
    """A sequence-classification reward model (random head) on the tiny model, saved as `name`."""
    from transformers import AutoModelForSequenceClassification

    path, tok = tiny
    rm_dir = path.parent / name
    AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).save_pretrained(rm_dir)
    tok.save_pretrained(rm_dir)
    return rm_dir


@contextlib.contextmanager
def serve_reward(rm_dir):
    """`rlhf serve-reward`'s server for `rm_dir` on a free port, in a thread; yields the server, its
    bearer token in the 0600 file `srv.token_file` (for `HttpReward(token_file=...)`)."""
    from rlhf_core.atomic import secret_file
    from rlhf_core.rollout.reward_server import make_server

    token_file = rm_dir.parent / f"{rm_dir.name}.token"
    srv = make_server(str(rm_dir), port=0, token=secret_file(token_file, lambda: f"test-token-{rm_dir.name}")[0])
    srv.token_file = str(token_file)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv
    finally:
        srv.shutdown()


def test_reward_model_served_over_http(tiny):
    """`rlhf serve-reward`'s server scores token ids with a reward model; HttpReward reads it."""
    tok = tiny[1]
    rm_dir = sequence_rm(tiny, "rm")
    with serve_reward(rm_dir) as srv:
        assert srv.server_address[0] == "127.0.0.1"  # loopback by default
        url = f"http://127.0.0.1:{srv.server_address[1]}/score"
        ids = [[1, 5, 6, 7, 2], [1, 5, 6, 8, 2]]
        samples = [{"prompt": "p", "response": "r", "label": "l", "token_ids": x} for x in ids]
        remote, _, why = R.HttpReward(url, token_file=srv.token_file)(samples)
        local, _, _ = R.ModelReward(str(rm_dir), pad_token_id=tok.pad_token_id)(samples)
        assert remote == pytest.approx(local) and why == [None, None] and remote[0] != remote[1]


class _OpenRLHFServer(JsonHandler):
    """A third-party server speaking OpenRLHF's protocol, as its examples do: a scalar extra log."""
    seen: list = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _OpenRLHFServer.seen.append((self.path, body))
        rewards = [float(q.endswith(" 2")) for q in body["query"]]
        out = {"rewards": rewards, "scores": [r * 0.5 for r in rewards], "extra_logs": {"accuracy": sum(rewards) / len(rewards)}}
        if self.path == "/old/get_reward":  # OpenRLHF's older serve_rm answers rewards only
            out = {"rewards": rewards}
        self.reply(out)


def test_openrlhf_reward_protocol_client_and_reward_func(tmp_path):
    """A /get_reward URL speaks OpenRLHF's protocol: query = prompt + response, prompts, labels in;
    rewards, scores and extra_logs out (scores and each log as components; a scalar log for every
    sample).  A reward file with OpenRLHF's `reward_func` (tensors out) works unchanged."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _OpenRLHFServer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    samples = _episodes(2)
    samples[1] = {**samples[1], "response": " 3"}
    try:
        base = f"http://127.0.0.1:{srv.server_address[1]}"
        client = R.HttpReward(f"{base}/get_reward")
        assert client.protocol == "openrlhf" and R.HttpReward(f"{base}/score").protocol == "rlhf"
        values, comps, why = client(samples)
        path, body = _OpenRLHFServer.seen[-1]
        assert path == "/get_reward" and body == {"query": ["Q: 1+1= A: 2", "Q: 1+1= A: 3"], "prompts": ["Q: 1+1= A:"] * 2,
                                                  "labels": ["2", "2"]}
        assert values == [1.0, 0.0] and why == [None, None]
        assert comps == {"score": [0.5, 0.0], "extra/accuracy": [0.5, 0.5]}
        assert R.HttpReward(f"{base}/old/get_reward")(samples)[:2] == ([1.0, 0.0], {})
        # the protocol can be forced for a server at another path
        assert R.HttpReward(f"{base}/rm", protocol="openrlhf")(samples)[0] == [1.0, 0.0]
    finally:
        srv.shutdown()
    f = tmp_path / "openrlhf_reward.py"
    f.write_text("import torch\n\ndef reward_func(queries, prompts, labels, **kw):\n"
                 "    r = torch.tensor([float(q[len(p):].strip() == l) for q, p, l in zip(queries, prompts, labels)])\n"
                 "    return {'rewards': r, 'scores': r, 'extra_logs': {'acc': r.mean()}}\n")
    values, comps, why = R.FunctionReward(str(f))(samples)
    assert values == [1.0, 0.0] and comps == {"score": [1.0, 0.0], "extra/acc": [0.5, 0.5]} and why == [None, None]


def test_reward_server_speaks_openrlhf_get_reward_like_score(tiny):
    """`rlhf serve-reward`'s /get_reward (OpenRLHF's clients) scores a sample as /score does."""
    tok = tiny[1]
    with serve_reward(sequence_rm(tiny, "rm_openrlhf")) as srv:
        base = f"http://127.0.0.1:{srv.server_address[1]}"
        samples = [{"prompt": "Q: 12+30= A:", "response": r, "label": "42"} for r in (" 42", " 41 wrong")]
        for s in samples:
            s["token_ids"] = tok(s["prompt"]).input_ids + tok(s["response"], add_special_tokens=False).input_ids + [tok.eos_token_id]
        ours, _, _ = R.HttpReward(f"{base}/score", token_file=srv.token_file)(samples)
        theirs, comps, why = R.HttpReward(f"{base}/get_reward", token_file=srv.token_file)(samples)
        assert theirs == pytest.approx(ours, abs=1e-6) and comps["score"] == pytest.approx(ours, abs=1e-6) and why == [None, None]
        assert ours[0] != ours[1]
        # a query ending in EOS text (as decoded sequences do) scores the same
        eos = [{**s, "response": s["response"] + tok.eos_token} for s in samples]
        assert R.HttpReward(f"{base}/get_reward", token_file=srv.token_file)(eos)[0] == pytest.approx(ours, abs=1e-6)


def test_token_level_reward_model_pools_over_the_response_locally_and_over_http(tiny):
    """A `response_sum` reward model: the score is the sum of its per-token logits after prompt_len."""
    import json

    import torch
    from transformers import AutoModelForTokenClassification

    path, tok = tiny
    rm_dir = path.parent / "rm_tokens"
    model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1)
    model.save_pretrained(rm_dir)
    tok.save_pretrained(rm_dir)
    (rm_dir / "reward_stats.json").write_text(json.dumps({"mean": 0.0, "std": 1.0, "pooling": "response_sum"}))
    ids = [[1, 5, 6, 7, 2], [1, 5, 6, 8]]
    samples = [{"prompt": "p", "response": "r", "label": "l", "token_ids": x, "prompt_len": 3} for x in ids]
    local, _, why = R.ModelReward(str(rm_dir), pad_token_id=tok.pad_token_id)(samples)
    with torch.no_grad():
        per_token = [model(input_ids=torch.tensor([x])).logits[0, :, 0] for x in ids]
    assert local == pytest.approx([float(per_token[0][3:].sum()), float(per_token[1][3:].sum())], abs=1e-5) and why == [None, None]
    with pytest.raises(R.RewardError, match="prompt_len"):
        R.ModelReward(str(rm_dir), pad_token_id=tok.pad_token_id)([{"token_ids": ids[0]}])
    with serve_reward(rm_dir) as srv:
        remote, _, _ = R.HttpReward(f"http://127.0.0.1:{srv.server_address[1]}/score", token_file=srv.token_file)(samples)
        assert remote == pytest.approx(local, abs=1e-5)


def test_likelihood_reward_model_scores_the_response_log_prob(tiny):
    """A `logprob` reward model: the score is the response's summed log-probability under the LM."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    path, tok = tiny
    rm_dir = path.parent / "rm_logprob"
    model = AutoModelForCausalLM.from_pretrained(path)
    model.save_pretrained(rm_dir)
    tok.save_pretrained(rm_dir)
    (rm_dir / "reward_stats.json").write_text(json.dumps({"mean": 0.0, "std": 1.0, "pooling": "logprob"}))
    ids = [[1, 5, 6, 7, 2], [1, 5, 6, 8]]
    samples = [{"prompt": "p", "response": "r", "label": "l", "token_ids": x, "prompt_len": 3} for x in ids]
    scores, _, _ = R.ModelReward(str(rm_dir), pad_token_id=tok.pad_token_id)(samples)
    with torch.no_grad():
        want = [float(model(input_ids=torch.tensor([x])).logits[0, :-1].log_softmax(-1)[torch.arange(2, len(x) - 1), torch.tensor(x[3:])].sum())
                for x in ids]
    assert scores == pytest.approx(want, abs=1e-4) and all(s < 0 for s in scores)


def test_user_environment_file(tmp_path):
    from rlhf_core.rollout.agents import load_environment

    f = tmp_path / "env.py"
    f.write_text("from rlhf_core.rollout.agents import Step\nclass Environment:\n    def reset(self, prompt, label):\n        return prompt\n"
                 "    def step(self, action):\n        return Step(reward=1.0)\n")
    env = load_environment("single_turn", str(f))()
    assert env.reset("q", "a") == "q" and env.step("x").reward == 1.0
    f.write_text("class Env: pass\n")
    with pytest.raises(AttributeError, match="must define `class Environment`"):
        load_environment("single_turn", str(f))
    with pytest.raises(ValueError, match="built-ins"):
        load_environment("chess", None)
