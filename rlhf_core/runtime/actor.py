"""What every Ray actor of this project has, whichever package owns it (training's TrainWorker,
rollout's rollout / reward / reference workers)."""
from __future__ import annotations

import resource

from rlhf_core.runtime.cluster import free_port


class PeakMemory:
    """Every actor reports its process's peak resident memory (the burst check and rl metrics) and
    where it runs (the placement log line)."""

    def peak_rss_mb(self) -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux

    def device_id(self) -> str:
        """This actor's GPU (UUID) or "cpu": the weight-sync group picks its backend by them."""
        from rlhf_core.runtime.weight_sync import device_id  # heavy: torch, which the actor has and its drivers (worker_group) need not

        return device_id()

    def node(self) -> str:
        """`NODE_ID[:8]@IP` of the Ray node this actor runs on."""
        import ray

        return f"{ray.get_runtime_context().get_node_id()[:8]}@{ray.util.get_node_ip_address()}"


def _node_address() -> tuple[str, int]:
    import ray

    return ray.util.get_node_ip_address(), free_port()


def rendezvous_at(pg, bundle: int = 0) -> tuple[str, int]:
    """The address of the node holding `pg`'s `bundle` and a free port there (a task placed in the
    bundle finds them), for a process group whose rank 0 lives in it -- on a cluster the driver's
    node is not rank 0's."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
    return ray.get(ray.remote(_node_address).options(num_cpus=0, scheduling_strategy=strategy).remote())
