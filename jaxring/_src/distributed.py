"""Across processes: which process runs each rank, and the TCP transport's
set-up through jax.distributed's key-value store.

Under multi-controller JAX (``jax.distributed.initialize``) every process
lowers the same program. When a ring's ranks live in different processes the
custom call carries a table of the process of each rank, and the C++ side
moves that ring's chunks over TCP. Each process opens a listening socket,
publishes ``host:port`` under a jaxring key of the coordinator's key-value
store and reads everyone else's: there is nothing for users to configure.
The first cross-process lowering does this, so it works whether jaxring was
imported before or after ``jax.distributed.initialize``.
"""

from __future__ import annotations

import os
import socket
import threading

import numpy as np

_KEY = "jaxring/tcp/v1/{}"
_lock = threading.Lock()
_ready = False
_hosts: dict[int, str] = {}


def device_assignment(axis_ctx) -> tuple | None:
    """The devices of a lowering in partition-id order, if known."""
    devices = getattr(axis_ctx, "device_assignment", None)
    if devices:
        return tuple(devices)
    mesh_devices = getattr(getattr(axis_ctx, "mesh", None), "devices", None)
    if mesh_devices is None:
        return None
    return tuple(np.asarray(mesh_devices).flat)


def process_table(devices, rank_table: np.ndarray, group_table: np.ndarray,
                  world: int) -> np.ndarray:
    """process_of[group * world + rank] for every (group, rank) of the rings.

    rank_table and group_table map a partition id to its rank and group.
    """
    groups = int(group_table.max()) + 1 if len(group_table) else 1
    table = np.zeros(groups * world, np.int64)
    for pid, dev in enumerate(devices):
        table[int(group_table[pid]) * world + int(rank_table[pid])] = \
            dev.process_index
    return table


def spans_processes(table: np.ndarray) -> bool:
    return bool(len(table)) and bool((table != table[0]).any())


def _local_host(coordinator: str | None) -> str:
    """The address peers should use to reach this process.

    JAXRING_TCP_HOST wins; otherwise the local address of the route to the
    coordinator (no packet is sent: connecting a UDP socket only picks the
    route), which is the interface the job already uses.
    """
    explicit = os.environ.get("JAXRING_TCP_HOST")
    if explicit:
        return explicit
    if coordinator:
        host = coordinator.rsplit(":", 1)[0].strip("[]")
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((host, 9))
                return s.getsockname()[0]
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


def ensure_tcp_transport(timeout_s: float) -> None:
    """Sets up the TCP transport once per process (blocks until every
    process has published its address, at most timeout_s)."""
    global _ready
    with _lock:
        if _ready:
            return
        from jaxring import _jaxring
        from jaxring._src import jax_compat

        client = jax_compat.distributed_client()
        if client is None:
            raise RuntimeError(
                "jaxring.allreduce: the ring's devices belong to several "
                "processes but jax.distributed is not initialized in this one; "
                "call jax.distributed.initialize() first (or start the job "
                "with `python -m jaxring.launch`).")
        me, n, coordinator = jax_compat.distributed_state()
        host = _local_host(coordinator)
        port = _jaxring.tcp_listen(host)
        address = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        client.key_value_set(_KEY.format(me), address)
        timeout_ms = int(timeout_s * 1000)
        addresses = []
        for q in range(n):
            try:
                addresses.append(client.blocking_key_value_get(
                    _KEY.format(q), timeout_ms))
            except Exception as e:  # the client raises its own error types
                raise RuntimeError(
                    f"jaxring: process {q} did not publish its TCP address "
                    f"within {timeout_s} s (is it running the same program?): "
                    f"{e}") from e
        _jaxring.tcp_set_peers(me, addresses)
        for q, a in enumerate(addresses):
            _hosts[q] = a.rsplit(":", 1)[0].strip("[]")
        _ready = True


def process_hosts() -> dict[int, str]:
    """The host address of every process, once the TCP transport is set up
    (processes that share one are on one host); empty before."""
    with _lock:
        return dict(_hosts)
