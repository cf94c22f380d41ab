"""Two Ray nodes on this machine -- the embedded head and a node joined to it with `ray start
--address`, as a cluster's worker node joins -- with work placed across them: sft's ranks one per
node (STRICT_SPREAD), and rl's rollout engine on the node that has the custom resource."""
import json
import re
import urllib.request

import pytest
from conftest import SFT_CURVE, history, run_stage

from rlhf_core.runtime.cluster import LocalRayHead, auth_headers, use_head

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def two_nodes():
    with LocalRayHead(num_cpus=2, multi_node=True) as head, use_head(head):  # its token for the commands meanwhile
        head.add_node(2, {"nodeb": 2})
        yield head.job_address


def node_with(address: str, resource: str) -> str:
    """The id (first 8 characters, as the placement lines show it) of the node holding `resource`."""
    with urllib.request.urlopen(urllib.request.Request(f"{address}/nodes?view=summary", headers=auth_headers()), timeout=10) as r:
        nodes = json.loads(r.read())["data"]["summary"]
    return next(n["raylet"]["nodeId"][:8] for n in nodes if resource in n["raylet"]["resourcesTotal"])


def placement(text: str, role: str) -> list[str]:
    """The nodes a role's ranks ran on, from the job's log line."""
    line = re.search(rf"{role}: \d+ rank\(s\) on \d+ node\(s\): (.*)", text)
    assert line, f"no placement line for {role}"
    return re.findall(r"rank \d+ on (\S+)", line.group(1))


@pytest.mark.xdist_group("sft_faults")
def test_sft_ranks_on_two_nodes_same_loss_curve(project, two_nodes, sft_loss_curve):
    proc = run_stage(project, two_nodes, "sft", *SFT_CURVE, "--set", "sft.num_workers=2", "--set", "sft.placement_strategy=STRICT_SPREAD",
                     "--set", "sft.output_dir=artifacts/sft_two_nodes")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    nodes = placement(text, "training")
    assert len(nodes) == 2 and nodes[0] != nodes[1], nodes
    assert [r["train/loss"] for r in history(project / "artifacts" / "sft_two_nodes")] == pytest.approx(sft_loss_curve, rel=1e-4)


@pytest.mark.xdist_group("sft_faults")
def test_rl_rollout_engine_on_the_other_node(project, two_nodes, sft_reference):
    out = "artifacts/rl_two_nodes"
    proc = run_stage(project, two_nodes, "rl", "--set", "rl.max_steps=1", "--set", "rl.rollout.prompts_per_step=4", "--set", "rl.rollout.n_samples=4",
                     "--set", "rl.global_batch_size=16", "--set", "rl.rollout.max_new_tokens=4", "--set", "rl.eval_max_new_tokens=4",
                     "--set", "rl.pass_k=2", "--set", "rl.sync_check_prompts=8", "--set", "rl.rollout.layout=separate",
                     "--set", "rl.rollout.resource=nodeb", "--set", f"rl.output_dir={out}",
                     # and the policy under ZeRO-3 + offload, accumulating over micro-batches of 4
                     "--set", "rl.zero_stage=3", "--set", "rl.offload=all", "--set", "rl.micro_batch_size=4")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    engines = re.search(r"rollout engines on (\S+)", text).group(1)
    assert engines.split("@")[0] == node_with(two_nodes, "nodeb"), engines  # not the head, where the driver runs
    assert placement(text, "policy")  # the policy says where it ran too
    assert [r["step"] for r in history(project / out)] == [1]
