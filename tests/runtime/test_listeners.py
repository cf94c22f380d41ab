"""Nothing a stage starts listens beyond loopback on one node: the Ray head and its jobs (checked
in test_cluster.py), and what training opens on top -- DeepSpeed's rendezvous store and gloo's
connections between ranks, the weight-sync group's store, the vLLM engine (issue 34, item 3:
torch's TCPStore listened on every interface whatever host it was given)."""
import multiprocessing
import threading
import time

import psutil
import pytest
from conftest import SFT, run_stage

LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


class Listeners:
    """Every TCP socket in LISTEN state on this machine that was not there at the start, sampled
    every 0.2 s in a thread while the block runs: (address, port, pid)."""

    def __enter__(self):
        self.before = {(c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        self.seen: set[tuple] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self):
        while not self._stop.is_set():
            for c in psutil.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN and (c.laddr.ip, c.laddr.port) not in self.before:
                    self.seen.add((c.laddr.ip, c.laddr.port, c.pid))
            time.sleep(0.2)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def exposed(self) -> list[tuple]:
        return sorted(((ip, port, pid) for ip, port, pid in self.seen if ip not in LOOPBACK), key=str)


def _member(rank: int, port: int, queue) -> None:
    import torch

    from rlhf_core.runtime.weight_sync import WeightGroup

    group = WeightGroup("127.0.0.1", port, rank, 2, 30, "gloo")
    flat = torch.arange(4.0) if rank == 0 else torch.zeros(4)
    group.broadcast([flat])
    queue.put((rank, flat.tolist()))
    time.sleep(1.0)  # stay up while the sampler looks


@pytest.mark.unit
def test_a_rendezvous_store_and_gloo_listen_on_the_rendezvous_address_only():
    """Two processes form the weight-sync group on 127.0.0.1 (torch's own TCPStore bound `*:PORT`)."""
    from rlhf_core.runtime.cluster import free_port
    from rlhf_core.runtime.rendezvous import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("localhost") and not is_loopback("10.1.2.3")
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with Listeners() as seen:
        procs = [ctx.Process(target=_member, args=(rank, port, queue)) for rank in (0, 1)]
        for p in procs:
            p.start()
        got = dict(queue.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(30)
    assert got == {0: [0.0, 1.0, 2.0, 3.0], 1: [0.0, 1.0, 2.0, 3.0]}
    assert ("127.0.0.1", port) in {(ip, p) for ip, p, _ in seen.seen}  # the store was seen ...
    assert not seen.exposed, seen.exposed  # ... on loopback, and nothing else beyond it


@pytest.mark.integration
@pytest.mark.xdist_group("rl_more")
def test_nothing_listens_beyond_loopback_during_real_stage_runs(project, ray_head, sft_reference):
    """sft, rm and dpo on two DeepSpeed ranks, rl on the vLLM engine in the separate layout with the
    collective weight sync (two trainer ranks): every socket opened meanwhile is on loopback."""
    two = ["--set", "{s}.num_workers=2", "--set", "{s}.max_steps=2", "--set", "{s}.save_steps=2", "--set", "{s}.eval_max_new_tokens=2",
           "--set", "{s}.global_batch_size=8", "--set", "{s}.output_dir=artifacts/{s}_listeners"]
    sft_model = str(sft_reference / "model")
    with Listeners() as seen:
        proc = run_stage(project, ray_head, "sft", *SFT, *[a.format(s="sft") for a in two])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        proc = run_stage(project, ray_head, "rm", "--set", f"rm.model_path={sft_model}", *[a.format(s="rm") for a in two])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        proc = run_stage(project, ray_head, "dpo", "--set", f"dpo.model_path={sft_model}", *[a.format(s="dpo") for a in two])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        proc = run_stage(project, ray_head, "rl", *[a.format(s="rl") for a in two], "--set", f"rl.model_path={sft_model}",
                         "--set", "rl.rollout.engine=vllm", "--set", "rl.rollout.layout=separate", "--set", "rl.rollout.cpus=0.5",
                         "--set", "rl.cpus_per_worker=0.5",
                         "--set", "rl.rollout.weight_sync=collective", "--set", "rl.rollout.prompts_per_step=4", "--set", "rl.rollout.n_samples=2",
                         "--set", "rl.rollout.max_new_tokens=4", "--set", "rl.eval_steps=0", "--set", "rl.sync_check_prompts=0",
                         "--set", "rl.pass_k=1")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "over gloo" in proc.stdout  # the weight-sync group was formed
    assert len(seen.seen) >= 6, seen.seen  # stores, gloo pairs, workers: the sampler did see them
    assert not seen.exposed, seen.exposed
