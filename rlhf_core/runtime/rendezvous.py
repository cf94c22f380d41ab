"""Where torch.distributed groups meet: a TCPStore that listens on the rendezvous address only.

torch's TCPStore server listens on every interface whatever host it is given (`*:PORT`), with no
authentication: during training anyone who reaches the machine could talk to it.  Rank 0 here
binds the socket itself -- to the address the other ranks are told (127.0.0.1 on one node, the
node's own address on a cluster) -- and hands it to the store (`master_listen_fd`).  Gloo's
connections between ranks listen on the interface its host name resolves to; on one node (a
loopback rendezvous) they are kept on `lo` too (GLOO_SOCKET_IFNAME, and NCCL_SOCKET_IFNAME for
NCCL's bootstrap).  Used by the trainers' process group (training/deepspeed_engine.py) and the weight-sync
group (runtime/weight_sync.py).
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import socket


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout: datetime.timedelta):
    """The group's TCPStore at (host, port): rank 0 serves it on `host` only, the others connect."""
    import torch.distributed as dist

    if is_loopback(host):  # before any group of this process opens its sockets
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    # the store owns the descriptor from here (detach: Python must not close it when `sock` goes)
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=sock.detach(), use_libuv=True)
