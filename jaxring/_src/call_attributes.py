"""The attributes every allreduce custom call carries, on either backend
(RingAttrs in xla_ffi/ring_attrs.h): its op id, the Choice it runs, the
reduction, the rank tables, the timeout and the emulated links.

Op ids tell concurrent allreduces of one execution apart: each call site
gets its own at lowering, the same on every device and in every process
that lowers the same program (call_sites.call_ids, and call_sites for how
every call gets a lowering of its own).
"""

from __future__ import annotations

import math

import numpy as np

from jaxring._src import call_sites, lib, timeline
from jaxring._src.choice import Choice
from jaxring._src.config import config, parse_links


def link_param() -> tuple:
    """The emulated CPU links from jaxring.config, as (size, bytes/s,
    latency s) per tier (config.parse_links); () when off. Read at trace
    time, like every setting."""
    spec = config.cpu_link
    return () if spec is None else parse_links(spec)


def link_attributes(link: tuple, world: int, uneven_groups: bool) -> dict:
    """The custom calls' link emulation attributes: per tier, its bandwidth,
    latency and size (the last given as 0: the rest of the ranks)."""
    if len(link) > 1:
        if uneven_groups:
            raise NotImplementedError(
                "jaxring: cpu_link with tiers emulates one cluster per ring, "
                "which axis_index_groups of different sizes do not share; use "
                'one link ("10Gbit,20us") or groups of one size.'
            )
        inner = math.prod(size for size, _, _ in link[:-1])
        if world % inner:
            raise ValueError(
                f"jaxring: cpu_link's tiers put {inner} ranks in a group of the "
                f"last tier, which does not divide the {world} ranks of this "
                "allreduce; give tier sizes whose product divides the axis size."
            )
    return dict(
        link_bytes_per_s=np.asarray([bw for _, bw, _ in link], np.float64),
        link_latency_s=np.asarray([lat for _, _, lat in link], np.float64),
        link_tiers=np.asarray([size for size, _, _ in link[:-1]] + [0] * bool(link), np.int64),
    )


def _algorithm_id(algorithm: str) -> np.int64:
    """The custom calls' algorithm attribute, as the C++ side names its
    values for both backends (Algorithm in xla_ffi/algorithm.h)."""

    return np.int64(lib.cpu.ALGORITHMS[algorithm])


def _reduce_op_id(op: str) -> np.int64:
    """The custom calls' reduce_op attribute for op, as the C++ side names
    its values (ReduceOp in xla_ffi/reduce.h)."""

    return np.int64(lib.cpu.REDUCE_OPS[op])


def allreduce_label(op, axes, groups=None) -> str:
    """What the timeline calls a jaxring.allreduce."""
    over = ",".join(map(str, axes))
    if groups is not None:
        over += f" in groups {[list(g) for g in groups]}"
    return f"allreduce {op} over {over}"


def operands_text(ctx) -> str:
    return ",".join(f"{a.dtype}{list(a.shape)}" for a in ctx.avals_in)


def _call_ids(ctx, label: str, mesh_description) -> dict:
    """The op_id and slot_id attributes of the call being lowered, named
    `label` in the timeline."""
    operands = operands_text(ctx)
    op_id, slot_id = call_sites.call_ids(
        ctx.module_context, f"{label}|{mesh_description}|{operands}"
    )
    timeline.name_op(op_id, label)
    return dict(op_id=np.int64(op_id), slot_id=np.int64(slot_id))


def attributes(
    ctx,
    label: str,
    mesh_description,
    chosen: Choice,
    *,
    world: int,
    rank_process,
    uneven_sizes,
    op: str,
    timeout_s: float,
    link: tuple,
) -> dict:
    """The attributes of the call being lowered, named `label` in the
    timeline, with the op id of its place in the module; mesh_description
    tells calls of one call site on different meshes apart."""
    return dict(
        **_call_ids(ctx, label, mesh_description),
        world_size=np.int64(world),
        group_sizes=np.asarray(uneven_sizes, np.int64),
        algorithm=_algorithm_id(chosen.algorithm),
        topology=np.asarray(chosen.tiers, np.int64),
        rank_process=np.asarray(rank_process, np.int64),
        reduce_op=_reduce_op_id(op),
        num_rings=np.int64(chosen.rings),
        chunk_bytes=np.int64(chosen.chunk_bytes),
        timeout_s=np.float64(timeout_s),
        **link_attributes(link, world, bool(len(uneven_sizes))),
    )
