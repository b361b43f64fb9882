"""jaxring.allreduce: a drop-in for lax.psum backed by jaxring's ring plan.

One primitive, ``jaxring_allreduce``, carries an elementwise reduction over
named mesh axes. Its rules mirror lax.psum's so that it composes the same way:

* abstract eval: under ``check_vma`` the result is invariant over the reduced
  axes (like ``psum_invariant``); otherwise the aval is unchanged;
* JVP: linear for ``op="sum"``; the other ops, like lax.pmax, have none;
* transpose: ``pvary`` under ``check_vma``, the allreduce itself otherwise
  (psum is psum + pbroadcast in that mode);
* batching: a vmapped axis that is reduced over is reduced locally, the rest
  of the axes go to the ring;
* lowering: each device's rank in its ring and its ring's group number come
  from partition-id through constant tables, then an FFI custom call runs the
  chunked multi-ring allreduce.
"""

from __future__ import annotations

import contextvars
import functools
import math
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxring._src import (
    call_sites,
    choice,
    cuda_agreement,
    cuda_backend,
    distributed,
    jax_compat as compat,
    lib,
    runtime,
    timeline,
    topology as _topology,
    wire_format,
)
from jaxring._src.config import config, parse_links, validate
from jaxring._src.jax_compat import ad, batching, hlo, ir, mlir

_PUBLIC_OPS = ("sum", "mean", "max", "min", "prod")
SUPPORTED_DTYPES = tuple(
    np.dtype(d)
    for d in (
        jax.numpy.float16,
        jax.numpy.bfloat16,
        np.float32,
        np.float64,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
    )
)

# Op ids tell concurrent allreduces of one execution apart: each call site
# gets its own at lowering, the same on every device and in every process
# that lowers the same program (call_sites.call_ids, and call_sites for how
# every call gets a lowering of its own).


def _axes_tuple(axis_name: Any) -> tuple:
    if isinstance(axis_name, (tuple, list)):
        axes = tuple(axis_name)
    else:
        axes = (axis_name,)
    if not axes:
        raise ValueError("jaxring.allreduce: axis_name must name at least one axis")
    for a in axes:
        if isinstance(a, int):
            raise TypeError(
                "jaxring.allreduce reduces over named axes only; got the "
                f"positional axis {a}. Use jnp.sum for positional reductions."
            )
    if len(set(axes)) != len(axes):
        raise ValueError(f"jaxring.allreduce: axis {axes} repeats a name")
    return axes


def _groups_tuple(axis_index_groups) -> tuple | None:
    """axis_index_groups as a tuple of tuples of ints (None stays None),
    checked as lax.psum checks them: every index once."""
    if axis_index_groups is None:
        return None
    try:
        groups = tuple(tuple(int(operator.index(i)) for i in g) for g in axis_index_groups)
    except TypeError:
        raise TypeError(
            "jaxring.allreduce: axis_index_groups must be a list of lists of "
            f"axis indices, got {axis_index_groups!r}"
        ) from None
    indices = [i for g in groups for i in g]
    if not groups or any(not g for g in groups) or sorted(indices) != list(range(len(indices))):
        # lax.psum's own wording.
        raise ValueError(
            "axis_index_groups must cover all indices exactly once "
            f"(jaxring.allreduce got {axis_index_groups!r})"
        )
    return groups


def _check_groups_cover(axes: tuple, groups: tuple | None) -> None:
    if groups is None:
        return
    size = math.prod(compat.axis_size(a) for a in axes)
    count = sum(len(g) for g in groups)
    if count != size:
        raise ValueError(
            f"axis_index_groups must cover all indices exactly once: they "
            f"hold {count} indices, but the axes {axes} have {size} "
            "(jaxring.allreduce)"
        )


def bound_axes_text(what: str = "") -> str:
    """The axes bound where the caller traces, as an error names them;
    what: how a name is passed (e.g. "as axis_name")."""
    names = compat.bound_axis_names()
    if not names:
        return "no axis is bound here (this is not inside jax.shard_map, jax.pmap or jax.vmap)"
    return (
        "the axes bound here are "
        + ", ".join(repr(n) for n in names)
        + ": pass one of those"
        + (f" {what}" if what else "")
    )


def _check_bound(axes: tuple, overlap_axis_name: Any = None) -> None:
    """A NameError naming the first of axes that no enclosing map binds,
    and the axes that are bound. overlap_axis_name: the axis_name argument
    of jaxring.overlap, where the axes come from there."""
    # JAX's own wording first, so that code matching lax.psum's error
    # matches this one too; then what to do about it.
    for name in axes:
        if compat.axis_is_bound(name):
            continue
        jax_words = (
            f"Found an unbound axis name: {name}. To fix this, please "
            "call psum under `jax.shard_map`."
        )
        if overlap_axis_name is not None:
            raise NameError(
                f"{jax_words} jaxring.overlap(axis_name={overlap_axis_name!r}): "
                f"the decorator's axis_name argument names {name!r}, which no "
                "map around the decorated step binds; "
                f"{bound_axes_text('as axis_name')}. The decorated step runs "
                "inside jax.shard_map or jax.pmap over the axis it names."
            )
        raise NameError(
            f"{jax_words} jaxring.allreduce runs inside jax.shard_map, jax.pmap "
            "or jax.vmap over an axis of that name. It was asked to reduce over "
            f"{name!r}, which no enclosing map binds; {bound_axes_text()}."
        )


# ---- varying-manual-axes (check_vma) helpers, across jax versions ----------


def varying(aval) -> frozenset:
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def with_varying(aval, varying: frozenset):
    if getattr(aval, "mat", None) is not None:
        return aval.update(manual_axis_type=aval.mat.update(varying=varying))
    return aval.update(vma=varying)


# ---- the primitive ----------------------------------------------------------

allreduce_p = compat.Primitive("jaxring_allreduce")


def _abstract_eval(
    aval,
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
    invariant,
    unreduced,
):
    del op, rings, rings_from_default, chunk_bytes, timeout_s, link, algorithm, topology
    _check_bound(axes)
    _check_groups_cover(axes, groups)
    if unreduced:
        # A sum of the parts an unreduced value's devices hold: the result is
        # the reduced value, as lax.psum's unreduced path types it.
        out = compat.without_unreduced(aval, axes)
    elif invariant:
        out = with_varying(aval, varying(aval) - frozenset(axes))
    else:
        out = aval
    return out, {compat.NamedAxisEffect(a) for a in axes}


allreduce_p.def_effectful_abstract_eval(_abstract_eval)


def _impl(x, **params):
    raise NameError(
        "jaxring.allreduce must be called inside jax.shard_map or jax.pmap "
        "(it was called eagerly, outside any mapped axis)."
    )


allreduce_p.def_impl(_impl)


def _jvp(primals, tangents, **params):
    (x,), (t,) = primals, tangents
    y = allreduce_p.bind(x, **params)
    t = ad.instantiate_zeros(t)
    if params["op"] != "sum":
        raise TypeError(
            f"jaxring.allreduce(op={params['op']!r}) is not differentiable "
            "(neither are lax.pmax/pmin); only op='sum' and op='mean' are."
        )
    return y, allreduce_p.bind(t, **params)


ad.primitive_jvps[allreduce_p] = _jvp


def _transpose(ct, x, **params):
    assert ad.is_undefined_primal(x)
    if params["op"] != "sum":
        raise TypeError(f"jaxring.allreduce(op={params['op']!r}) is not linear")
    if type(ct) is ad.Zero:
        return (ad.Zero(x.aval),)
    if params["unreduced"]:
        # lax.psum's rule for an unreduced operand: the cotangent is typed
        # reduced, with no communication.
        return (compat.preduced(ct, params["axes"]),)
    if params["invariant"]:
        # An invariant result's cotangent is broadcast back to every rank:
        # the transpose of psum_invariant is pvary, no communication.
        return (compat.pvary(ct, params["axes"]),)
    return (allreduce_p.bind(ct, **params),)


ad.primitive_transposes[allreduce_p] = _transpose


def _to_low(x, **params):
    """The sum of a value of a high type (jax >= 0.12.1: one typed unreduced)
    as a sum of its low form, which holds each device's part typed varying
    over the same axes: summed to an invariant result, that is the reduced
    value the high equation types."""
    aval = compat.typeof(x)
    low = compat.low_value(x)
    if compat.typeof(low).shape != aval.shape:
        # An operand unreduced over a mesh axis outside the manual ones has
        # its parts stacked along new leading dimensions in its low form.
        raise NotImplementedError(
            f"jaxring.allreduce over {params['axes']}: the value "
            f"({aval.str_short(True)}) is unreduced over mesh axes outside "
            "the shard_map's manual axes, which jaxring cannot sum; reduce "
            "it with lax.psum or jax.sharding.reshard first."
        )
    out_aval, _ = _abstract_eval(aval, **params)
    # The low form is varying where the high one was unreduced, so a sum of
    # an unreduced operand gives an invariant result, as its high type says.
    summed = allreduce_p.bind(
        low,
        **{**params, "unreduced": False, "invariant": params["invariant"] or params["unreduced"]},
    )
    return compat.high_value(out_aval, summed)


compat.define_high_rule(allreduce_p, _to_low)


def _local_reduce(op: str, x, dim: int):
    return {
        "sum": lax.reduce_sum,
        "prod": lax.reduce_prod,
        "min": lax.reduce_min,
        "max": lax.reduce_max,
    }[op](x, (dim,))


def _batch(axis_data, vals, dims, *, axes, groups, op, **params):
    (x,), (d,) = vals, dims
    if axis_data.name not in axes:
        return allreduce_p.bind(x, axes=axes, groups=groups, op=op, **params), d
    if params["unreduced"]:
        raise NotImplementedError(
            "jaxring.allreduce of a value typed unreduced cannot be vmapped "
            f"over the reduced axis {axis_data.name!r} (nor can lax.psum's)."
        )
    if groups is not None:
        # lax.psum's batcher refuses this too: the groups index the reduced
        # axes jointly, and vmap would split them into a local and a ring part.
        raise NotImplementedError(
            "axis_index_groups not supported in vmap collectives: "
            f"jaxring.allreduce over {axes} with axis_index_groups cannot be "
            f"vmapped over the reduced axis {axis_data.name!r}."
        )
    rest = tuple(a for a in axes if a != axis_data.name)
    if d is None:
        # Every member of the vmapped axis holds the same x.
        n = axis_data.size
        if op == "sum":
            y = x * lax.full_like(x, n)
        elif op == "prod":
            y = lax.integer_pow(x, n)
        else:
            y = x
    else:
        y = _local_reduce(op, x, d)
    if rest:
        y = allreduce_p.bind(y, axes=rest, groups=None, op=op, **params)
    return y, None


batching.fancy_primitive_batchers[allreduce_p] = _batch


def _rank_tables(
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


def _lookup(table: np.ndarray, index):
    """table[index] as a scalar int32, index a scalar int32 value."""
    const = mlir.ir_constant(table)
    sliced = hlo.dynamic_slice(const, [index], ir.DenseI64ArrayAttr.get([1]))
    return hlo.reshape(ir.RankedTensorType.get([], ir.IntegerType.get_signless(32)), sliced)


def automatic_axes(ctx) -> tuple:
    """The mesh axes (of size > 1) a shard_map being lowered left automatic."""
    axis_ctx = ctx.module_context.axis_context
    mesh = getattr(axis_ctx, "mesh", None)
    if mesh is None:
        return ()
    manual = getattr(axis_ctx, "manual_axes", frozenset(mesh.axis_names))
    return tuple(n for n, s in zip(mesh.axis_names, mesh.axis_sizes) if n not in manual and s > 1)


def _lower_in_manual_region(ctx, x, auto: tuple, params: dict):
    """Lowers the allreduce inside a shard_map that is manual over every axis.

    In a shard_map that leaves some mesh axes automatic, XLA's partitioner
    refuses partition-id (it cannot tell whether the instruction or the data
    is replicated over those axes), and the ring needs it to find each
    device's rank. So, as lax.axis_index does there, the call is lowered in
    a nested shard_map manual over the automatic axes too. Each device
    reduces the part of the operand it holds there: split as the operand's
    type says it is split over explicit axes, whole (gathered by XLA) over
    the others. It meets the devices holding the same part, since the rank
    tables count the automatic axes among those that tell rings apart.
    """
    (aval,) = ctx.avals_in
    sharding = getattr(aval, "sharding", None)
    spec = getattr(sharding, "spec", None) or P()
    spec = P(*(d if d is not None and set(_spec_axes(d)) <= set(auto) else None for d in spec))
    reduce_parts = jax.shard_map(
        lambda u: allreduce_p.bind(u, **params),
        in_specs=spec,
        out_specs=spec,
        axis_names=frozenset(auto),
        check_vma=False,
    )
    # The nested shard_map lowers over the abstract mesh, which has no
    # devices; its partition ids are the enclosing lowering's.
    token = _enclosing_devices.set(distributed.device_assignment(ctx.module_context.axis_context))
    try:
        return mlir.lower_fun(reduce_parts, multiple_results=False)(ctx, x)
    finally:
        _enclosing_devices.reset(token)


def _in_manual_region(lowering):
    """The allreduce's lowering, entering a region manual over every mesh
    axis first where the shard_map being lowered left some automatic."""

    def lower(ctx, x, **params):
        auto = automatic_axes(ctx)
        if auto:
            return _lower_in_manual_region(ctx, x, auto, params)
        return lowering(ctx, x, **params)

    return lower


# The devices of the lowering that entered a nested manual region, for the
# lowerings inside it (_lower_in_manual_region).
_enclosing_devices: contextvars.ContextVar = contextvars.ContextVar(
    "jaxring_enclosing_devices", default=None
)


def _spec_axes(entry) -> tuple:
    """The mesh axes one entry of a PartitionSpec names."""
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


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
        # (_lower_in_manual_region); a split-phase start cannot.
        raise NotImplementedError(
            f"jaxring.overlap inside a shard_map that leaves mesh axes {list(auto)} "
            "automatic is not supported; make every mesh axis manual there "
            "(jaxring.allreduce itself works in such a shard_map)."
        )
    world = math.prod(sizes[names.index(a)] for a in axes)
    if groups is not None:
        world = max(len(g) for g in groups)
    rank_table, group_table = _rank_tables(names, sizes, axes, groups)
    devices = distributed.device_assignment(axis_ctx) or _enclosing_devices.get()
    return world, rank_table, group_table, devices


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


def _operands_text(ctx) -> str:
    return ",".join(f"{a.dtype}{list(a.shape)}" for a in ctx.avals_in)


def _call_ids(ctx, label: str, mesh_description) -> dict:
    """The op_id and slot_id attributes of the call being lowered, named
    `label` in the timeline."""
    operands = _operands_text(ctx)
    op_id, slot_id = call_sites.call_ids(
        ctx.module_context, f"{label}|{mesh_description}|{operands}"
    )
    timeline.name_op(op_id, label)
    return dict(op_id=np.int64(op_id), slot_id=np.int64(slot_id))


def _attribute_dict(
    ctx,
    label,
    mesh_description,
    *,
    world,
    rank_process,
    uneven_sizes,
    tiers,
    algorithm,
    op,
    rings,
    chunk_bytes,
    timeout_s,
    link,
) -> dict:
    """The attributes every allreduce custom call carries on either backend
    (RingAttrs in xla_ffi/ring_attrs.h), with the op id of its place in the
    module being lowered."""
    return dict(
        **_call_ids(ctx, label, mesh_description),
        world_size=np.int64(world),
        group_sizes=np.asarray(uneven_sizes, np.int64),
        algorithm=_algorithm_id(algorithm),
        topology=np.asarray(tiers, np.int64),
        rank_process=np.asarray(rank_process, np.int64),
        reduce_op=_reduce_op_id(op),
        num_rings=np.int64(rings),
        chunk_bytes=np.int64(chunk_bytes),
        timeout_s=np.float64(timeout_s),
        **link_attributes(link, world, bool(len(uneven_sizes))),
    )


def ring_attributes(
    ctx,
    label,
    ring: RingCoordinates,
    op,
    rings,
    chunk_bytes,
    timeout_s,
    link,
    algorithm,
    topology,
    rings_from_default=False,
) -> dict:
    """The CPU ring operation's attributes. A ring count left to the default
    adapts to the job's cores where the ring spans processes (crowding.py);
    ring_coordinates has set the transport up, whose records say how many."""
    world, rank_process = ring.world, ring.rank_process
    if rings_from_default and _topology.spans_processes(rank_process):
        rings = distributed.default_rings_across_processes(rings)
    if (
        len(ring.group_sizes)
        and topology not in ("auto", "flat")
        and _topology.normalized(tuple(topology))
    ):
        raise NotImplementedError(
            f"jaxring: topology {tuple(topology)} asks for a tiered plan, but "
            "axis_index_groups of different sizes make rings of different "
            "sizes, which run as flat rings; use topology='flat' or 'auto'."
        )
    tiers = (
        ()
        if len(ring.group_sizes)
        else _topology.resolve(topology, world, rank_process, distributed.process_hosts())
    )
    if algorithm in ("exchange", "direct") and topology == "auto":
        tiers = ()  # the tiers "auto" finds are the ring plan's
    # Every operand: a split-phase start reduces a bucket of them as one.
    nbytes = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in ctx.avals_in)
    chosen = choice.resolve_algorithm(
        algorithm,
        link,
        rank_process,
        tiered=bool(tiers),
        nbytes=nbytes,
        topology=topology,
        world=world,
        rings=rings,
        chunk_bytes=chunk_bytes,
    )
    if chosen in ("exchange", "direct"):
        tiers = ()
    mesh = (world, tuple(rank_process), tuple(ring.group_sizes))
    return _attribute_dict(
        ctx,
        label,
        mesh,
        world=world,
        rank_process=rank_process,
        uneven_sizes=ring.group_sizes,
        tiers=tiers,
        algorithm=chosen,
        op=op,
        rings=rings,
        chunk_bytes=chunk_bytes,
        timeout_s=timeout_s,
        link=link,
    )


SCALAR_I32 = compat.ShapedArray((), np.int32)


# ---- lowering: one path, each backend's difference in one function ----------


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
    rank and group, looked up from its partition id (the handler has no
    other way to know them)."""
    del dtype
    ring = ring_coordinates(ctx, axes, groups, timeout_s, link)
    attrs = ring_attributes(
        ctx,
        label,
        ring,
        op,
        rings,
        chunk_bytes,
        timeout_s,
        link,
        algorithm,
        topology,
        rings_from_default,
    )
    return attrs, [ring.rank, ring.group]


def cuda_call(ctx, label, dtype, **params) -> tuple[dict, list]:
    """The CUDA backend's attributes; no rank operands: the handler finds
    its device in the rank tables (rank_process, rank_device)."""
    return cuda_attributes(ctx, label, dtype=dtype, **params), []


BACKENDS = {"cpu": cpu_call, "cuda": cuda_call}


def _lowering(ctx, x, *, platform, axes, groups, op, invariant, unreduced, **params):
    del invariant, unreduced
    (aval,) = ctx.avals_in
    attrs, ranks = BACKENDS[platform](
        ctx,
        allreduce_label(op, axes, groups),
        aval.dtype,
        axes=axes,
        groups=groups,
        op=op,
        **params,
    )
    call = jax.ffi.ffi_lowering(f"jaxring_allreduce_{platform}")
    sub_ctx = ctx.replace(avals_in=[aval] + [SCALAR_I32] * len(ranks))
    return call(sub_ctx, x, *ranks, **attrs)


for _platform in BACKENDS:
    call_sites.register_lowering(
        allreduce_p,
        _in_manual_region(functools.partial(_lowering, platform=_platform)),
        platform=_platform,
    )


# ---- what the CUDA backend adds ---------------------------------------------

# Element types NCCL's own allreduce has (the ring moves bytes and reduces
# with jaxring's kernels, so it has every supported type).
_NCCL_DTYPES = tuple(
    d for d in SUPPORTED_DTYPES if d not in (np.dtype(np.int16), np.dtype(np.uint16))
)


def resolve_cuda_algorithm(algorithm: str, dtype) -> str:
    """ "ring" or "nccl" on the CUDA backend; "auto" takes the ring."""
    if algorithm in ("auto", "ring"):
        return "ring"
    if algorithm == "direct":
        raise ValueError(
            "jaxring: algorithm='direct' reads peers' host memory and exists on "
            "the CPU backend only; on GPU use 'ring', 'nccl' or 'auto'."
        )
    if algorithm == "exchange":
        raise ValueError(
            "jaxring: algorithm='exchange' runs on the CPU transports only; on "
            "GPU use 'ring', 'nccl' (NCCL picks its own small-message "
            "algorithms) or 'auto'."
        )
    if np.dtype(dtype) not in _NCCL_DTYPES:
        raise TypeError(
            f"jaxring: algorithm='nccl' cannot reduce {np.dtype(dtype)} (NCCL "
            "has no 16-bit integer types); use algorithm='ring'."
        )
    return "nccl"


def cuda_tiers(topology, world: int, rank_process, algorithm: str) -> tuple:
    """The tiers of a CUDA ring's plan: those an explicit topology names
    (checked as on CPU); none for "flat" and, on GPUs, for "auto" too,
    which stays one flat ring until a GPU run has checked derived tiers."""
    if topology in ("auto", "flat"):
        return ()
    tiers = _topology.resolve(topology, world, rank_process, distributed.process_hosts())
    if tiers and algorithm == "nccl":
        raise ValueError(
            f"jaxring: algorithm='nccl' runs NCCL's own allreduce, which has no "
            f"tiers, but topology {tuple(topology)} asks for a tiered plan; use "
            "algorithm='ring' with it, or topology='flat'."
        )
    return tiers


def _ring_members(
    devices, rank_table: np.ndarray, group_table: np.ndarray, world: int
) -> list[list]:
    """The lowering's devices as rings of ranks: members[group][rank]."""
    n_groups = int(group_table.max()) + 1 if len(group_table) else 1
    members = [[None] * world for _ in range(n_groups)]
    for pid, dev in enumerate(devices):
        members[int(group_table[pid])][int(rank_table[pid])] = dev
    return members


def cuda_attributes(
    ctx,
    label,
    *,
    axes,
    groups,
    op,
    rings,
    chunk_bytes,
    timeout_s,
    link,
    algorithm,
    topology,
    dtype,
    rings_from_default=False,
) -> dict:
    """The CUDA ring operation's attributes (CudaAttrs in
    xla_ffi/ring_attrs.h); registers the CUDA targets first (or raises why
    there are none). The ring count is taken as it is: each ring is an NCCL
    communicator driven from the GPU, not threads on the host's cores."""
    del rings_from_default
    cuda_backend.register()
    if link:
        raise ValueError(
            "jaxring: cpu_link emulates links of the CPU backend; unset "
            "jaxring.config.cpu_link / JAXRING_CPU_LINK on GPUs."
        )
    if groups is not None and len({len(g) for g in groups}) > 1:
        raise NotImplementedError(
            "jaxring: axis_index_groups of different sizes are not supported "
            "on the CUDA backend yet (its communicators are made for one ring "
            "size); use groups of one size, or the CPU backend."
        )
    world, rank_table, group_table, devices = mesh_layout(ctx, axes, groups)
    if devices is None:
        raise NotImplementedError(
            "jaxring.allreduce: cannot tell which GPU runs each rank of this "
            "lowering (no device assignment)."
        )
    chosen = resolve_cuda_algorithm(algorithm, dtype)
    rank_process = distributed.process_table(devices, rank_table, group_table, world)
    tiers = cuda_tiers(topology, world, rank_process, chosen)
    members = _ring_members(devices, rank_table, group_table, world)
    attrs = _attribute_dict(
        ctx,
        label,
        (members, tiers),
        world=world,
        rank_process=rank_process,
        uneven_sizes=(),
        tiers=tiers,
        algorithm=chosen,
        op=op,
        rings=rings,
        chunk_bytes=chunk_bytes,
        timeout_s=timeout_s,
        link=(),
    )
    # What every process of the ring must lower at this place alike (NCCL
    # would not notice a difference: cuda_agreement.py).
    cuda_agreement.check_same_call(
        int(attrs["slot_id"]),
        f"{label} of {_operands_text(ctx)} over {world} ranks, {rings} ring(s) of "
        f"{chunk_bytes}-byte chunks, algorithm {chosen}, tiers {list(tiers) or 'none'}",
        owner=int(rank_process[0]),
        processes=set(map(int, rank_process)),
        timeout_s=timeout_s,
    )
    return dict(
        attrs,
        rank_device=cuda_backend.rank_devices(members),
        nccl_ids=cuda_backend.unique_ids(members, rings, timeout_s),
    )


# ---- public functions -------------------------------------------------------


def _check_dtype(leaf) -> np.dtype:
    dtype = np.dtype(jax.numpy.result_type(leaf))
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"jaxring.allreduce: unsupported dtype {dtype}; supported: "
            + ", ".join(str(d) for d in (*SUPPORTED_DTYPES, *_LANE_DTYPES))
        )
    return dtype


# Dtypes the ring has no reduction for, carried in one it has.
_LANE_DTYPES = (np.dtype(np.complex64), np.dtype(np.complex128), np.dtype(np.bool_))


def _to_ring_form(leaf, op: str):
    """(a value of a dtype the ring reduces, the function that makes the
    reduced value the result lax would give).

    A complex sum is the sum of its real and imaginary parts, so they travel
    as two float lanes of one operation. A bool sum counts the True values
    in int32, as lax.psum does; max, min and prod of bools are or, and, and
    and again, which uint8 0/1 lanes compute exactly.
    """
    _check_op_dtype(leaf, op)
    dtype = np.dtype(leaf.dtype)
    if dtype.kind == "c":
        lanes = jax.numpy.stack([jax.numpy.real(leaf), jax.numpy.imag(leaf)], axis=-1)
        return lanes, lambda r: lax.complex(r[..., 0], r[..., 1])
    if dtype == np.bool_:
        if op == "sum":
            return leaf.astype(np.int32), lambda r: r
        return leaf.astype(np.uint8), lambda r: r.astype(np.bool_)
    return leaf, lambda r: r


def _check_op_dtype(leaf, op: str) -> None:
    """Raises where op is not defined for leaf's dtype (op as the ring
    runs it: "sum" for a mean)."""
    dtype = np.dtype(leaf.dtype)
    if dtype.kind == "c":
        if op != "sum":
            raise TypeError(
                f"jaxring.allreduce: op={op!r} is not defined for {dtype} "
                "(complex numbers have no order, and a product does not act "
                "on the real and imaginary parts apart); use op='sum' or 'mean'."
            )
    elif dtype != np.bool_:
        _check_dtype(leaf)


def _to_wire_form(leaf, restore, wire: np.dtype):
    """leaf in the dtype it travels in under the wire format, and the
    function that makes its reduced value the result in leaf's dtype."""
    dtype = np.dtype(leaf.dtype)
    if wire_format.travels_as(dtype, wire) == dtype:
        return leaf, restore
    return leaf.astype(wire), lambda r: restore(r.astype(dtype))


def _check_unreduced(aval, axes: tuple, groups, op: str) -> bool:
    """Whether aval is typed unreduced over axes, which jaxring then sums as
    lax.psum does; raises where lax.psum would not take it."""
    kind = compat.unreduced_kind(aval)
    if compat.unreduced_axes(aval) and kind not in (None, "sum"):
        # A part of a max (or min) not yet taken, over these axes or others:
        # a sum over any axis would mix the two reductions.
        _refuse_unreduced(aval, op, groups, kind)
    unreduced = compat.unreduced_axes(aval) & set(axes)
    if not unreduced:
        return False
    if unreduced != set(axes) or varying(aval) & set(axes):
        raise ValueError(
            f"jaxring.allreduce over {axes}: the value is unreduced over "
            f"{sorted(unreduced, key=str)} but not over the other axes "
            f"({aval.str_short(True)}); reduce each kind of axis apart, as "
            "lax.psum requires."
        )
    if op != "sum" or groups is not None:
        _refuse_unreduced(aval, op, groups, kind)
    return True


def _refuse_unreduced(aval, op: str, groups, kind):
    raise TypeError(
        f"jaxring.allreduce: an unreduced value ({aval.str_short(True)}) "
        "can only be summed over its unreduced axes, without "
        f"axis_index_groups (got op={op!r}"
        + (f", axis_index_groups={[list(g) for g in groups]}" if groups else "")
        + (f", unreduced kind {kind}" if kind not in (None, "sum") else "")
        + "), as with lax.psum."
    )


def _reduce_leaf_group(
    leaves,
    axes,
    groups,
    op,
    rings,
    chunk_bytes,
    timeout_s,
    algorithm,
    topology,
    rings_from_default=False,
):
    """The allreduce of leaves of one dtype: one fused operation, and one
    more for each value typed unreduced."""
    check_vma = compat.check_vma_enabled()
    # A reduction within axis_index_groups differs from group to group, so
    # its result still varies over the axes.
    invariant = check_vma and groups is None
    params = dict(
        axes=axes,
        groups=groups,
        op=op,
        rings=rings,
        rings_from_default=rings_from_default,
        chunk_bytes=chunk_bytes,
        timeout_s=timeout_s,
        link=link_param(),
        algorithm=algorithm,
        topology=topology,
        invariant=invariant,
        unreduced=False,
    )
    if not check_vma:
        return _fused_allreduce(leaves, params)
    # Mirror lax.psum: a value not varying over an axis is first made varying
    # (psum of it is then size * x), if JAX allows that. A value typed
    # unreduced is summed as it is, in an operation of its own: its result
    # and its transpose are typed apart from the others'.
    out: list[Any] = [None] * len(leaves)
    fused = []
    for i, leaf in enumerate(leaves):
        if _check_unreduced(compat.typeof(leaf), axes, groups, op):
            out[i] = allreduce_p.bind(leaf, **{**params, "unreduced": True})
            continue
        missing = tuple(a for a in axes if a not in varying(compat.typeof(leaf)))
        if missing:
            if not compat.auto_pcast_enabled():
                _refuse_without_pcast(axes, missing)
            leaf = compat.pvary(leaf, missing)
        if compat.unreduced_axes(compat.typeof(leaf)):
            # Unreduced over other axes: an operation of its own, as a
            # fused buffer has one type.
            out[i] = _fused_allreduce([leaf], params)[0]
            continue
        fused.append((i, leaf))
    if fused:
        idx, fused_leaves = zip(*fused)
        for i, r in zip(idx, _fused_allreduce(list(fused_leaves), params)):
            out[i] = r
    return out


def _fused_allreduce(leaves: list, params: dict) -> list:
    """One allreduce for leaves of one dtype: ravel, concatenate, split."""
    if len(leaves) == 1:
        return [allreduce_p.bind(leaves[0], **params)]
    flat = jax.numpy.concatenate([jax.numpy.ravel(l) for l in leaves])
    out = allreduce_p.bind(flat, **params)
    pieces, start = [], 0
    for leaf in leaves:
        n = math.prod(leaf.shape)
        pieces.append(out[start : start + n].reshape(leaf.shape))
        start += n
    return pieces


def allreduce(
    x,
    axis_name,
    *,
    op: str = "sum",
    axis_index_groups=None,
    rings: int | None = None,
    chunk_bytes: int | None = None,
    timeout_s: float | None = None,
    algorithm: str | None = None,
    topology: Any = None,
    wire_dtype: Any = None,
):
    """Reduces ``x`` over the mapped axis ``axis_name``, like ``lax.psum``.

    Runs a chunked multi-ring allreduce: the buffer is split into ``rings``
    parts, each reduce-scattered and all-gathered around its own ring, in
    chunks of ``chunk_bytes``. Between the devices of one process the default
    is the direct algorithm instead (see ``algorithm``). The leaves of the
    pytree ``x`` of one dtype under 1 MiB are fused into one operation; each
    larger leaf is reduced in one of its own, with no copy.

    Args:
      x: an array or pytree of arrays: floats (16 to 64 bit), integers (8 to
        64 bit), complex (``op="sum"``/``"mean"``: the real and imaginary
        parts travel as float lanes) or bool (as ``lax.psum``: a sum counts
        the True values in int32; max/min/prod are or/and/and).
      axis_name: a mesh axis name (from ``shard_map`` or ``pmap``) or a tuple
        of them.
      op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"prod"``.
      axis_index_groups: as for ``lax.psum``: lists of indices over
        ``axis_name`` (row-major over its axes) that together cover every
        index once; each group is reduced on its own ring. A mean divides by
        each rank's own group size.
      rings: rings per operation (default ``jaxring.config.rings``; left at
        the default, one across processes where a machine has fewer than 2
        cores per rank: docs/multiprocess.md).
      chunk_bytes: pipelining unit (default ``jaxring.config.chunk_bytes``).
      timeout_s: seconds to wait for peers before failing
        (default ``jaxring.config.timeout_s``).
      algorithm: ``"ring"``, ``"direct"`` (all ranks in one process, or
        in processes of one host, over shared memory they all map),
        ``"exchange"`` (recursive doubling: fewer, larger steps, for small
        buffers; CPU) or ``"auto"`` (default ``jaxring.config.algorithm``,
        itself ``"auto"``: direct in one process without ``cpu_link``, and
        across the processes of one host over shared memory (with the
        topology left to ``"auto"``); otherwise the
        exchange for small buffers, the ring for the rest; see
        ``jaxring.config.exchange_max_bytes``).
      topology: the ring plan's tiers across processes, tightest first, e.g.
        ``(4, 2)`` for 4 devices in each of 2 processes; ``"flat"`` for one
        ring; ``"auto"`` (default ``jaxring.config.topology``) derives them
        from where the ranks run. See docs/allreduce.md#tiered-plans.
      wire_dtype: ``None`` (default), ``"bfloat16"`` or ``"float16"``: with
        ``op="sum"``/``"mean"``, float32 values travel the ring in that
        16-bit format, each hop adding in float32 and rounding once; the
        result is float32 again, within ``n * u * sum|x_i|`` of the exact sum
        over n ranks (u = 2**-8 for bfloat16, 2**-11 for float16). Other
        dtypes travel as they are. See docs/allreduce.md#16-bit-wire-formats.

    Returns:
      The reduction, with the structure of ``x``; under ``check_vma`` it is
      invariant over the reduced axes (without ``axis_index_groups``).

    Example:
        >>> mesh = jax.make_mesh((8,), ("batch",))
        >>> f = jax.shard_map(lambda v: jaxring.allreduce(v, "batch"),
        ...                   mesh=mesh, in_specs=P("batch"), out_specs=P())
        >>> f(jnp.arange(8.0))   # Array([28.], dtype=float32)
    """
    if op not in _PUBLIC_OPS:
        raise ValueError(f"jaxring.allreduce: op must be one of {_PUBLIC_OPS}, got {op!r}")
    wire = wire_format.wire_dtype_of(wire_dtype, "jaxring.allreduce")
    if wire is not None and op not in ("sum", "mean"):
        raise ValueError(
            f"jaxring.allreduce: wire_dtype applies to op='sum' or 'mean' "
            f"(a wire format rounds partial sums), got op={op!r}"
        )
    axes = _axes_tuple(axis_name)
    groups = _groups_tuple(axis_index_groups)
    settings = _Settings.of(
        rings=rings,
        chunk_bytes=chunk_bytes,
        timeout_s=timeout_s,
        algorithm=algorithm,
        topology=topology,
    )
    runtime.register_ffi_targets()
    leaves, treedef = jax.tree_util.tree_flatten(x)
    if not leaves:
        return x
    _check_bound(axes)
    _check_groups_cover(axes, groups)
    leaves = [jax.numpy.asarray(l) for l in leaves]
    return jax.tree_util.tree_unflatten(
        treedef, _reduce_leaves(leaves, axes, groups, op, wire, settings)
    )


class _Settings(NamedTuple):
    """One call's settings: its arguments, config's values for those left
    out, and which of them a tuning table may fill in."""

    rings: int
    chunk_bytes: int
    timeout_s: float
    algorithm: str
    topology: Any
    tunable: frozenset

    @classmethod
    def of(cls, **passed) -> _Settings:
        tunable = frozenset(
            choice.tunable_settings(
                **{k: passed[k] for k in ("rings", "chunk_bytes", "algorithm", "topology")}
            )
        )
        if isinstance(passed["topology"], list):
            passed["topology"] = tuple(passed["topology"])
        values = {
            name: validate(name, getattr(config, name) if arg is None else arg, "jaxring.allreduce")
            for name, arg in passed.items()
        }
        return cls(**values, tunable=tunable)


def _reduce_leaves(leaves: list, axes: tuple, groups, op: str, wire, settings: _Settings):
    """The reduction of each leaf. A value every rank already holds
    (invariant over the axes, e.g. a gradient autodiff summed under
    check_vma) is reduced where it is, to lax's result: sending it would
    only move copies of one value."""
    out: list[Any] = [None] * len(leaves)
    ring_op = "sum" if op == "mean" else op
    sent = []
    for i, leaf in enumerate(leaves):
        _check_op_dtype(leaf, ring_op)
        if already_reduced(leaf, axes, groups):
            out[i] = _reduce_invariant(leaf, op, axes)
        else:
            sent.append(i)
    if not sent:
        return out
    reduced = _send([leaves[i] for i in sent], axes, groups, ring_op, wire, settings)
    if op == "mean":
        n = _mean_divisor(axes, groups)
        reduced = [v / n for v in reduced]
    for i, v in zip(sent, reduced):
        out[i] = v
    return out


def _send(leaves: list, axes: tuple, groups, ring_op: str, wire, settings: _Settings) -> list:
    """The ring reductions of leaves that vary over some of the axes: fused
    by the axes they travel over and their dtype (_operations), each
    operation with the settings the tuning table gives its size."""
    # A value that varies over only some of the axes travels only over
    # those: what the others would add is copies of it, counted locally.
    send_axes = [axes_to_send(leaf, axes, groups) for leaf in leaves]
    leaves, restore = zip(*(_to_ring_form(leaf, ring_op) for leaf in leaves))
    if wire is not None:
        leaves, restore = zip(*(_to_wire_form(l, r, wire) for l, r in zip(leaves, restore)))
    by_kind: dict[tuple[tuple, np.dtype], list[int]] = {}
    for i, leaf in enumerate(leaves):
        by_kind.setdefault((send_axes[i], _check_dtype(leaf)), []).append(i)
    out: list[Any] = [None] * len(leaves)
    for (over, dtype), group in by_kind.items():
        for idx in _operations(group, leaves, dtype):
            world = (
                math.prod(compat.axis_size(a) for a in over)
                if groups is None
                else max(len(g) for g in groups)
            )
            nbytes = sum(math.prod(leaves[i].shape) for i in idx) * dtype.itemsize
            rings, chunk, algorithm, topology, tabled = choice.tuned_settings(
                settings.tunable,
                world,
                nbytes,
                settings.rings,
                settings.chunk_bytes,
                settings.algorithm,
                settings.topology,
            )
            reduced = _reduce_leaf_group(
                [leaves[i] for i in idx],
                over,
                groups,
                ring_op,
                rings,
                chunk,
                settings.timeout_s,
                algorithm,
                topology,
                rings_from_default="rings" in settings.tunable and not tabled,
            )
            held = tuple(a for a in axes if a not in over)
            for i, r in zip(idx, reduced):
                out[i] = restore[i](r)
                if held:
                    out[i] = _reduce_invariant(out[i], ring_op, held)
    return out


def already_reduced(leaf, axes: tuple, groups) -> bool:
    """Whether leaf holds one value on every rank of the reduction: under
    check_vma, invariant over every reduced axis (and not typed unreduced).
    Within axis_index_groups it is still sent, as the result varies."""
    if groups is not None or not compat.check_vma_enabled():
        return False
    aval = compat.typeof(leaf)
    if compat.unreduced_axes(aval) or getattr(aval, "is_high", False):
        return False
    return not varying(aval) & set(axes)


# A leaf of this many bytes or more is reduced in an operation of its own
# rather than fused: fusing copies it into and out of one buffer the size of
# its group, and on CPU XLA maps a temporary buffer that large afresh every
# step (above glibc's mmap threshold), so its pages fault and are zeroed each
# time. Below it, fusion saves an operation's fixed cost per leaf.
ALONE_BYTES = 1 << 20


def _operations(group: list, leaves: list, dtype: np.dtype) -> list[list]:
    """The operations that reduce the leaves group indexes (one kind): the
    small leaves fused into one, each large leaf alone."""
    small, alone = [], []
    for i in group:
        if math.prod(leaves[i].shape) * dtype.itemsize >= ALONE_BYTES:
            alone.append([i])
        else:
            small.append(i)
    return ([small] if small else []) + alone


def axes_to_send(leaf, axes: tuple, groups) -> tuple:
    """The axes a reduction over axes must send leaf over: under check_vma,
    those it varies over (all of them within axis_index_groups, whose
    groups mix the axes, and for a value typed unreduced). Over the others
    every rank holds a copy, which _reduce_invariant counts locally."""
    if groups is not None or not compat.check_vma_enabled():
        return axes
    aval = compat.typeof(leaf)
    if compat.unreduced_axes(aval) or getattr(aval, "is_high", False):
        return axes
    over = tuple(a for a in axes if a in varying(aval))
    if over != axes and not compat.auto_pcast_enabled():
        _refuse_without_pcast(axes, tuple(a for a in axes if a not in over))
    return over


def _refuse_without_pcast(axes: tuple, missing: tuple):
    raise ValueError(
        f"jaxring.allreduce over {axes}: the value is not varying "
        f"over {missing} (see jax.typeof(x).vma); apply "
        "jax.lax.pcast(x, axes, to='varying') first."
    )


def _reduce_invariant(leaf, op: str, axes: tuple):
    """What lax gives for a reduction over axes of a value every rank holds:
    n copies summed (a bool sum counts in int32, as lax.psum does), the
    value itself for max and min, its n-th power for a product."""
    n = math.prod(compat.axis_size(a) for a in axes)
    dtype = np.dtype(leaf.dtype)
    if dtype == np.bool_:
        if op in ("sum", "mean"):
            total = leaf.astype(np.int32) * n
            return total / n if op == "mean" else total
        return leaf
    if op in ("max", "min"):
        return leaf
    if op == "prod":
        return lax.integer_pow(leaf, n)
    total = leaf * np.asarray(n, dtype)
    return total / n if op == "mean" else total


def _mean_divisor(axes: tuple, groups: tuple | None):
    """How many values each rank's mean is over: the size of the axes, or
    of the rank's own axis_index_group. (lax.pmean divides by the first
    group's size even where groups differ in size.)"""
    if groups is None:
        return math.prod(compat.axis_size(a) for a in axes)
    sizes = {len(g) for g in groups}
    if len(sizes) == 1:
        return sizes.pop()
    size_of_index = np.zeros(sum(len(g) for g in groups), np.int32)
    for g in groups:
        size_of_index[list(g)] = len(g)
    return jax.numpy.asarray(size_of_index)[lax.axis_index(axes)]


def pmean(x, axis_name, **kwargs):
    """Mean over ``axis_name``, like ``lax.pmean``: ``allreduce(op="mean")``."""
    return allreduce(x, axis_name, op="mean", **kwargs)


def psum(x, axis_name, **kwargs):
    """Alias of ``allreduce(op="sum")``, named like ``lax.psum``."""
    return allreduce(x, axis_name, op="sum", **kwargs)
