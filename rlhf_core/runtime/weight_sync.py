"""Policy weights from trainer rank 0 to the rollout engines over a collective (`rl.rollout.weight_sync=
collective`) instead of through Ray's object store: one process group spanning trainer rank 0
(group rank 0) and every rollout worker (ranks 1..n) in which rank 0 broadcasts the weights as one
flat buffer per dtype -- NCCL between GPU buffers when every member has a GPU of its own
(`backend_for`), else gloo between CPU buffers (NCCL cannot join two ranks on one GPU).

The group is standalone (its own TCPStore and process-group object), apart from the trainers'
DeepSpeed group: the engines are not DeepSpeed ranks, and a torch `new_group` would need every
member of the default group.  `Layout` is the order and shape of the weights, fixed at the first
sync and sent to the engines once; each sync then moves only the flat buffers.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlhf_core.runtime.rendezvous import tcp_store


@dataclass(frozen=True)
class Layout:
    """(name, shape) of every weight, grouped by dtype in broadcast order."""
    groups: tuple[tuple[str, tuple[tuple[str, tuple[int, ...]], ...]], ...]

    @classmethod
    def of(cls, named: list[tuple[str, torch.Tensor]]) -> "Layout":
        by_dtype: dict[str, list] = {}
        for name, t in named:
            by_dtype.setdefault(str(t.dtype).removeprefix("torch."), []).append((name, tuple(t.shape)))
        return cls(tuple((dtype, tuple(items)) for dtype, items in sorted(by_dtype.items())))


def flatten(named: list[tuple[str, torch.Tensor]], layout: Layout) -> list[torch.Tensor]:
    """One contiguous buffer per dtype, in `layout` order."""
    tensors = dict(named)
    return [torch.cat([tensors[name].reshape(-1) for name, _ in items]) for _, items in layout.groups]


def unflatten(flats: list[torch.Tensor], layout: Layout) -> list[tuple[str, torch.Tensor]]:
    """The inverse of `flatten`: views into the buffers, under their names."""
    out = []
    for flat, (_, items) in zip(flats, layout.groups):
        offset = 0
        for name, shape in items:
            n = int(torch.Size(shape).numel())
            out.append((name, flat[offset:offset + n].view(shape)))
            offset += n
    return out


def empty_buffers(layout: Layout, device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(sum(int(torch.Size(s).numel()) for _, s in items), dtype=getattr(torch, dtype), device=device)
            for dtype, items in layout.groups]


def device_id() -> str:
    """This process's GPU (its UUID), or "cpu"."""
    return str(torch.cuda.get_device_properties(0).uuid) if torch.cuda.is_available() else "cpu"


def backend_for(device_ids: list[str]) -> str:
    """nccl when every member has a GPU and no two share one; gloo (CPU buffers) otherwise."""
    return "nccl" if "cpu" not in device_ids and len(set(device_ids)) == len(device_ids) else "gloo"


class WeightGroup:
    """This process's membership of the weight-sync group (rank 0: the trainer)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float, backend: str):
        timeout = datetime.timedelta(seconds=timeout_s)
        store = tcp_store(host, port, world_size, is_master=rank == 0, timeout=timeout)  # on `host` only
        prefixed = dist.PrefixStore("rlhf-weight-sync", store)
        if backend == "nccl":
            self.pg, self.device = dist.ProcessGroupNCCL(prefixed, rank, world_size, dist.ProcessGroupNCCL.Options()), torch.device("cuda")
        else:
            self.pg, self.device = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout), torch.device("cpu")
        self.store, self.rank = store, rank  # the store lives as long as the group

    def broadcast(self, flats: list[torch.Tensor]) -> None:
        """Rank 0 sends `flats`; every other rank receives into its `flats` (same sizes, on
        `self.device`)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for flat in flats:
            self.pg.broadcast([flat.to(self.device) if self.rank == 0 else flat], opts).wait()
