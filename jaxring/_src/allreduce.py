"""jaxring.allreduce: a drop-in for lax.psum backed by jaxring's ring plan.

The public functions (allreduce, psum, pmean) check their arguments, reduce
locally what every rank already holds, fuse the rest by dtype and by the
axes it varies over, and bind the ``jaxring_allreduce`` primitive
(primitive.py) once per fused operation, with the settings the tuning
table gives its size (choice.py). Its lowering is lowering.py's.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax

from jaxring._src import (
    choice,
    jax_compat as compat,
    lowering,  # noqa: F401  (registers the primitive's lowerings)
    runtime,
    wire_format,
)
from jaxring._src.arguments import axes_tuple, check_bound, check_groups_cover, groups_tuple
from jaxring._src.call_attributes import link_param
from jaxring._src.config import config, validate
from jaxring._src.dtypes import check_dtype, check_op_dtype, to_ring_form, to_wire_form
from jaxring._src.primitive import allreduce_p

_PUBLIC_OPS = ("sum", "mean", "max", "min", "prod")


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
    if unreduced != set(axes) or compat.varying(aval) & set(axes):
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
        missing = tuple(a for a in axes if a not in compat.varying(compat.typeof(leaf)))
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
        ``jaxring.config.exchange_max_bytes``). On GPUs: ``"nccl"``
        (NCCL's own allreduce, in one call) or ``"ring"``; ``"auto"`` runs
        NCCL's, or the ring for 16-bit integers and named tiers.
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
    axes = axes_tuple(axis_name)
    groups = groups_tuple(axis_index_groups)
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
    check_bound(axes)
    check_groups_cover(axes, groups)
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
        check_op_dtype(leaf, ring_op)
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
    leaves, restore = zip(*(to_ring_form(leaf, ring_op) for leaf in leaves))
    if wire is not None:
        leaves, restore = zip(*(to_wire_form(l, r, wire) for l, r in zip(leaves, restore)))
    by_kind: dict[tuple[tuple, np.dtype], list[int]] = {}
    for i, leaf in enumerate(leaves):
        by_kind.setdefault((send_axes[i], check_dtype(leaf)), []).append(i)
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
    return not compat.varying(aval) & set(axes)


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
    over = tuple(a for a in axes if a in compat.varying(aval))
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
