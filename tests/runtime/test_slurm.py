"""scripts/slurm/ray_cluster.sbatch, run as SLURM would run it on a two-node allocation -- here both
"nodes" are this machine: `scontrol` and `srun` are small stand-ins that name two hosts and run each
step locally, giving each host's `ray start` ports of its own (distinct hosts would not share them)
and the head a temp dir of its own.  The template's real `ray start` head and worker form the
cluster, and the submitted sft places one rank on each node."""
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rlhf_core.runtime.cluster import free_ports

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]

SRUN = '''#!/usr/bin/env bash
# srun stand-in: drop srun's own --flags, then run the step here.  `ray start` gets this host's
# ports (and the head a temp dir of its own), and SIGTERM ends the step as SLURM would: `ray start
# --block` gets SIGINT, on which it stops the daemons it started (its SIGINT is restored first: a
# background job of a script starts with SIGINT ignored)
node=""
while [[ "$1" == --* ]]; do [[ "$1" == --nodelist=* ]] && node="${1#--nodelist=}"; shift; done
[[ "$1" == ray && "$2" == start ]] || exec "$@"
extra=$(cat "$PORTS_DIR/$node")
[[ " $* " == *" --head "* ]] && extra="$extra --temp-dir=$PORTS_DIR/ray-$node"
# shellcheck disable=SC2086
python -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])' "$@" $extra &
child=$!
trap 'kill -INT $child; wait $child' TERM
wait $child
'''


# the command the template runs, before the stage: the cluster's token is private and required,
# and the job server listens on the head's address, not every interface
PROBE = '''#!/usr/bin/env python
import os, sys, urllib.error, urllib.request
import psutil
path = os.environ["RAY_AUTH_TOKEN_PATH"]
private = os.stat(path).st_mode & 0o777 == 0o600 and os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
try:
    urllib.request.urlopen(os.environ["RAY_ADDRESS"] + "/api/jobs/", timeout=10)
    code = 200
except urllib.error.HTTPError as e:
    code = e.code
port = int(os.environ["RAY_ADDRESS"].rsplit(":", 1)[1])
wild = [c for c in psutil.net_connections(kind="inet") if c.status == "LISTEN" and c.laddr.port == port and c.laddr.ip in ("0.0.0.0", "::")]
if private and code == 401 and not wild:
    print("token 0600 in a 0700 dir; without it: HTTP 401; dashboard on the head's address", flush=True)
os.execvp(sys.argv[1], sys.argv[1:])
'''


@pytest.fixture
def short_tmp():
    """Under /tmp with a short name: Ray's socket paths inside a temp dir are limited to 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.xdist_group("sft_faults")
def test_sbatch_template_starts_a_two_node_cluster_and_runs_a_stage(project, short_tmp):
    tmp_path = short_tmp
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "scontrol").write_text("#!/usr/bin/env bash\nprintf 'node-a\\nnode-b\\n'\n")
    (stubs / "srun").write_text(SRUN)
    for f in stubs.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    flags = ("node-manager-port", "object-manager-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
             "runtime-env-agent-port", "metrics-export-port")
    ports = free_ports(2 + 2 * len(flags))
    for i, node in enumerate(("node-a", "node-b")):
        mine = ports[2 + i * len(flags): 2 + (i + 1) * len(flags)]
        (tmp_path / node).write_text(" ".join(f"--{f}={p}" for f, p in zip(flags, mine)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "SLURM_"))}
    env.update(PATH=f"{stubs}:{Path(sys.executable).parent}:{env['PATH']}", PORTS_DIR=str(tmp_path), SLURM_JOB_NODELIST="node-[a-b]",
               SLURM_CPUS_ON_NODE="2", RAY_PORT=str(ports[0]), DASHBOARD_PORT=str(ports[1]), VENV=str(Path(sys.executable).parents[1]),
               RAY_USAGE_STATS_ENABLED="0", HOME=str(tmp_path))
    # a token left by any plain ray.init(), or one in the shell, must not lock the template out of
    # its own cluster (which has a token of its own)
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("0123456789abcdef" * 4)
    env["RAY_AUTH_TOKEN"] = "f" * 64
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    env.pop("RAY_AUTH_MODE", None)
    (stubs / "probe").write_text(PROBE)
    (stubs / "probe").chmod(0o755)
    cmd = ["bash", str(ROOT / "scripts" / "slurm" / "ray_cluster.sbatch"), "probe", "rlhf", "stage", "run", "sft", "--params", "none.yaml",
           "--set", "sft.model_path=artifacts/base", "--set", "sft.max_steps=2", "--set", "sft.global_batch_size=8",
           "--set", "sft.num_workers=2", "--set", "sft.placement_strategy=STRICT_SPREAD", "--set", "sft.eval_max_new_tokens=2",
           "--set", "sft.output_dir=artifacts/sft_slurm"]
    proc = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=600)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "ray cluster up: 2 node(s)" in text
    assert "token 0600 in a 0700 dir; without it: HTTP 401; dashboard on the head's address" in text, text[-3000:]
    assert not list((project / ".rlhf" / "ray").glob("auth_token-*"))  # the cluster's token went with it
    line = re.search(r"training: 2 rank\(s\) on (\d) node\(s\)", text)
    assert line and line.group(1) == "2", text[-3000:]
    assert (project / "artifacts" / "sft_slurm" / "model" / "model.safetensors").exists()
    # the template's exit stopped both nodes: no process of this cluster is left (they all carry
    # its temp dir in their command lines); `--` keeps pgrep from reading the pattern as an option
    left = subprocess.run(["pgrep", "-af", "--", str(tmp_path)], capture_output=True, text=True)
    assert left.returncode == 1 and left.stdout == "", left.stdout + left.stderr
