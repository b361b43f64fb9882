"""The CPU backend's allreduce call: each device finds its rank and its
ring's number from partition-id, as operands of the call (the handler has
no other way to know them); a ring across processes sets up the TCP
transport first; the Choice is choice.for_cpu's.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxring._src import choice, distributed, topology as _topology
from jaxring._src.call_attributes import attributes
from jaxring._src.jax_compat import hlo, ir, mlir
from jaxring._src.mesh_tables import group_sizes, mesh_layout


def _lookup(table: np.ndarray, index):
    """table[index] as a scalar int32, index a scalar int32 value."""
    const = mlir.ir_constant(table)
    sliced = hlo.dynamic_slice(const, [index], ir.DenseI64ArrayAttr.get([1]))
    return hlo.reshape(ir.RankedTensorType.get([], ir.IntegerType.get_signless(32)), sliced)


class RingCoordinates(NamedTuple):
    """Where this device's ring is, for a lowering over some axes.

    rank and group are scalar int32 IR values computed from partition-id, so
    one lowered module serves every device. rank_process holds the process of
    every (group, rank), one row of `world` per group; group_sizes the size
    of every group when they differ (uneven axis_index_groups; rows are then
    padded to the largest), else nothing.
    """

    world: int
    rank: Any
    group: Any
    rank_process: np.ndarray
    group_sizes: np.ndarray


def ring_coordinates(
    ctx, axes: tuple, groups: tuple | None, timeout_s: float, link
) -> RingCoordinates:
    """This device's RingCoordinates for a ring over axes (within its
    axis_index_group); when a ring spans processes this also sets up the TCP
    transport."""
    world, rank_table, group_table, devices = mesh_layout(ctx, axes, groups)
    if devices is None:
        if jax.process_count() > 1:
            raise NotImplementedError(
                "jaxring.allreduce: cannot tell which process runs each device "
                "of this lowering (no device assignment)."
            )
        rank_process = np.zeros(world * (int(group_table.max()) + 1), np.int64)
    else:
        rank_process = distributed.process_table(devices, rank_table, group_table, world)
    if _topology.spans_processes(rank_process):
        if link:
            raise NotImplementedError(
                "jaxring: cpu_link emulates links between the devices of one "
                "process; this ring spans processes, whose traffic crosses a "
                "real network. Unset jaxring.config.cpu_link / JAXRING_CPU_LINK."
            )
        distributed.ensure_tcp_transport(timeout_s)
    pid = hlo.convert(
        ir.RankedTensorType.get([], ir.IntegerType.get_signless(32)), hlo.partition_id()
    )
    return RingCoordinates(
        world,
        _lookup(rank_table, pid),
        _lookup(group_table, pid),
        rank_process,
        group_sizes(groups, group_table),
    )


def cpu_call(
    ctx,
    label,
    dtype,
    *,
    axes,
    groups,
    op,
    rings,
    rings_from_default,
    chunk_bytes,
    timeout_s,
    link,
    algorithm,
    topology,
) -> tuple[dict, list]:
    """The CPU backend's attributes, and its rank operands: the device's
    rank and group, looked up from its partition id. A ring count left to
    the default adapts to the job's cores where the ring spans processes
    (crowding.py); ring_coordinates has set the transport up, whose records
    say how many."""
    del dtype
    ring = ring_coordinates(ctx, axes, groups, timeout_s, link)
    world, rank_process = ring.world, ring.rank_process
    if rings_from_default and _topology.spans_processes(rank_process):
        rings = distributed.default_rings_across_processes(rings)
    chosen = choice.for_cpu(
        algorithm=algorithm,
        topology=topology,
        link=link,
        rank_process=rank_process,
        hosts=distributed.process_hosts(),
        world=world,
        # Every operand: a split-phase start reduces a bucket of them as one.
        nbytes=sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in ctx.avals_in),
        rings=rings,
        chunk_bytes=chunk_bytes,
        uneven_groups=bool(len(ring.group_sizes)),
    )
    attrs = attributes(
        ctx,
        label,
        (world, tuple(rank_process), tuple(ring.group_sizes)),
        chosen,
        world=world,
        rank_process=rank_process,
        uneven_sizes=ring.group_sizes,
        op=op,
        timeout_s=timeout_s,
        link=link,
    )
    return attrs, [ring.rank, ring.group]
