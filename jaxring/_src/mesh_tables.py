"""Where each device of a lowering sits: its rank in its ring and its ring's
number, as tables indexed by partition id, and the lowering's devices.

A lowered module serves every device; the tables let each find its own
place from partition-id (lowering_cpu.py) or its device (lowering_cuda.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Sequence

import numpy as np

from jaxring._src import distributed


def rank_tables(
    axis_names: Sequence, axis_sizes: Sequence[int], axes: tuple, groups: tuple | None = None
):
    """Rank in its ring and ring number, per partition id (row-major mesh).

    A device's index over `axes` is row-major in the order `axes` are given
    (as lax.psum counts it). Without `groups` that index is its rank, and the
    ring is numbered by the device's place on the other axes. With
    axis_index_groups each group of indices is a ring of its own: the rank is
    the place of the index within its group, and the ring number counts the
    groups within each place on the other axes.
    """
    sizes = dict(zip(axis_names, axis_sizes))
    coords = np.indices(tuple(axis_sizes)).reshape(len(axis_sizes), -1)
    coord = dict(zip(axis_names, coords))
    rank = np.zeros(coords.shape[1], np.int64)
    for a in axes:
        rank = rank * sizes[a] + coord[a]
    group = np.zeros(coords.shape[1], np.int64)
    for a in axis_names:
        if a not in axes:
            group = group * sizes[a] + coord[a]
    if groups is not None:
        group_of_index = np.empty(len(rank) and int(rank.max()) + 1, np.int64)
        place_of_index = np.empty_like(group_of_index)
        for g, members in enumerate(groups):
            for place, index in enumerate(members):
                group_of_index[index] = g
                place_of_index[index] = place
        group = group * len(groups) + group_of_index[rank]
        rank = place_of_index[rank]
    return rank.astype(np.int32), group.astype(np.int32)


def group_sizes(groups: tuple | None, group_table: np.ndarray) -> np.ndarray:
    """The size of every ring, by ring number: empty when they are all one
    size (the world size), as without axis_index_groups."""
    if groups is None or len({len(g) for g in groups}) == 1:
        return np.zeros(0, np.int64)
    rings = int(group_table.max()) + 1 if len(group_table) else 1
    return np.asarray([len(groups[r % len(groups)]) for r in range(rings)], np.int64)


def automatic_axes(ctx) -> tuple:
    """The mesh axes (of size > 1) a shard_map being lowered left automatic."""
    axis_ctx = ctx.module_context.axis_context
    mesh = getattr(axis_ctx, "mesh", None)
    if mesh is None:
        return ()
    manual = getattr(axis_ctx, "manual_axes", frozenset(mesh.axis_names))
    return tuple(n for n, s in zip(mesh.axis_names, mesh.axis_sizes) if n not in manual and s > 1)


# The devices of the lowering that entered a nested manual region, for the
# lowerings inside it (lowering._lower_in_manual_region), whose abstract mesh has
# no devices.
_enclosing_devices: contextvars.ContextVar = contextvars.ContextVar(
    "jaxring_enclosing_devices", default=None
)


@contextlib.contextmanager
def enclosing_devices(devices):
    """Lowerings inside this block take `devices` as theirs where JAX names
    none (mesh_layout)."""
    token = _enclosing_devices.set(devices)
    try:
        yield
    finally:
        _enclosing_devices.reset(token)


def mesh_layout(ctx, axes: tuple, groups: tuple | None = None):
    """(world size, rank table, group table, devices) of a lowering over axes.

    The tables map a partition id to its rank in its ring and to its ring's
    group; devices are the lowering's devices in partition-id order (None
    when JAX does not say). With uneven axis_index_groups the world size is
    the largest ring's (see group_sizes).
    """
    axis_ctx = ctx.module_context.axis_context
    mesh = getattr(axis_ctx, "mesh", None)
    if mesh is None:
        raise NotImplementedError(
            "jaxring.allreduce lowers only inside jax.shard_map or jax.pmap "
            f"(found the axis context {type(axis_ctx).__name__})."
        )
    names, sizes = tuple(mesh.axis_names), tuple(mesh.axis_sizes)
    auto = automatic_axes(ctx)
    if auto:
        # The allreduce's own lowering enters a manual region first
        # (lowering._lower_in_manual_region); a split-phase start cannot.
        raise NotImplementedError(
            f"jaxring.overlap inside a shard_map that leaves mesh axes {list(auto)} "
            "automatic is not supported; make every mesh axis manual there "
            "(jaxring.allreduce itself works in such a shard_map)."
        )
    world = math.prod(sizes[names.index(a)] for a in axes)
    if groups is not None:
        world = max(len(g) for g in groups)
    rank_table, group_table = rank_tables(names, sizes, axes, groups)
    devices = distributed.device_assignment(axis_ctx) or _enclosing_devices.get()
    return world, rank_table, group_table, devices
