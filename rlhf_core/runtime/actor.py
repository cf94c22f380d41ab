"""What every Ray actor of this project has, whichever package owns it (training's TrainWorker,
rollout's rollout / reward / reference workers)."""
from __future__ import annotations

import resource


class PeakMemory:
    """Every actor reports its process's peak resident memory (the burst check and rl metrics) and
    where it runs (the placement log line)."""

    def peak_rss_mb(self) -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux

    def device_id(self) -> str:
        """This actor's GPU (UUID) or "cpu": the weight-sync group picks its backend by them."""
        from rlhf_core.runtime.weight_sync import device_id

        return device_id()

    def node(self) -> str:
        """`NODE_ID[:8]@IP` of the Ray node this actor runs on."""
        import ray

        return f"{ray.get_runtime_context().get_node_id()[:8]}@{ray.util.get_node_ip_address()}"


def rendezvous() -> tuple[str, int]:
    """Run on rank 0's node (a task in its bundle): the address and a free port there, for every
    rank's process group -- on a cluster the driver's node is not rank 0's."""
    import ray

    from rlhf_core.runtime.cluster import free_port

    return ray.util.get_node_ip_address(), free_port()
