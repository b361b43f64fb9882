"""Split-phase allreduce: start and done primitives for jaxring.overlap.

``jaxring.overlap`` needs the compiler to see *when* an allreduce begins and
*when* its result is needed as two separate points of the program:

* ``jaxring_allreduce_start(*deps, *xs)`` hands the operands ``xs`` (one
  dtype) to the transport and returns at once with a scalar handle;
* ``jaxring_allreduce_done(handle, *deps)`` yields the reduced values, shaped
  like the operands, once the transfer has finished.

Placement is pinned by data dependencies, not by hints: ``deps`` are extra
operands the handlers ignore, so XLA must compute them first. A done takes as
deps the values the backward pass produced after the start, so it cannot be
hoisted next to its start; a start behind a credit window takes the results
of the buckets it waits for. (``lax.optimization_barrier`` would not do: XLA's
CPU pipeline removes barriers before it schedules.) A start needs no pin: the
CPU executor runs thunks as their inputs become ready, so a start runs as
soon as its last operand exists.

These are internal: they are what ``overlap`` emits, not user API. Neither has
differentiation or batching rules; ``overlap`` rewrites a step after its
gradients have been traced.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxring._src import call_sites, jax_compat as compat, lowering
from jaxring._src.arguments import check_bound, check_groups_cover
from jaxring._src.call_attributes import link_param
from jaxring._src.config import config
from jaxring._src.jax_compat import ir

# The op id the transport matches ranks by is taken when the start is
# lowered, as jaxring.allreduce takes it (call_sites.call_ids). The done reads
# it from the start's custom call, the op that defines its handle
# (_op_id_of_start), so a traced step that is lowered twice into one module
# (a scan unrolled by JAX, the same jaxpr evaluated twice) pairs each done
# with its own start.

HANDLE_DTYPE = np.int32


# ---- start ------------------------------------------------------------------

start_p = compat.Primitive("jaxring_allreduce_start")


def _start_abstract_eval(
    *avals,
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
    label,
    num_deps,
):
    del op, rings, rings_from_default, chunk_bytes, timeout_s, link, algorithm
    del topology, label
    check_bound(axes)
    check_groups_cover(axes, groups)
    avals = avals[num_deps:]
    dtypes = {a.dtype for a in avals}
    if len(dtypes) != 1:
        raise TypeError(f"jaxring allreduce start: operands mix dtypes {dtypes}")
    # The handle is a scalar placed like the operands, varying wherever any of
    # them varies.
    first = avals[0]
    handle = first.update(
        shape=(),
        dtype=np.dtype(HANDLE_DTYPE),
        weak_type=False,
        sharding=NamedSharding(first.sharding.mesh, PartitionSpec()),
    )
    handle = compat.with_varying(handle, frozenset().union(*(compat.varying(a) for a in avals)))
    return handle, {compat.NamedAxisEffect(a) for a in axes}


start_p.def_effectful_abstract_eval(_start_abstract_eval)


def _start_lowering(ctx, *xs, platform, label, num_deps, **params):
    # The backend's attributes and rank operands, as for jaxring.allreduce
    # (lowering.BACKENDS); the start adds how it starts.
    # The backend sees the operands it reduces, not the dependencies that
    # come first: it sizes the operation (the exchange's limit) and names it
    # by them.
    data_ctx = ctx.replace(avals_in=list(ctx.avals_in[num_deps:]))
    attrs, ranks = lowering.BACKENDS[platform](
        data_ctx, label, ctx.avals_in[num_deps].dtype, **params
    )
    attrs["num_deps"] = np.int64(num_deps)
    if platform == "cpu":
        # Waiting for the in-process peers is the CPU backend's (CUDA's
        # streams order the rings).
        attrs["gang"] = bool(config.cpu_gang_start)
    call = jax.ffi.ffi_lowering(f"jaxring_allreduce_start_{platform}")
    sub_ctx = ctx.replace(avals_in=[lowering.SCALAR_I32] * len(ranks) + list(ctx.avals_in))
    return call(sub_ctx, *ranks, *xs, **attrs)


# ---- done -------------------------------------------------------------------

done_p = compat.Primitive("jaxring_allreduce_done")
done_p.multiple_results = True


def _done_abstract_eval(handle, *deps, out_avals):
    # No effect and no side effect: a start's only user is its done, so when
    # a done's results are unused the compiler drops both together.
    del handle, deps
    return list(out_avals)


done_p.def_abstract_eval(_done_abstract_eval)


def _op_id_of_start(handle) -> int:
    """The op id of the start whose custom call defines handle."""
    owner = getattr(handle.owner, "operation", handle.owner)
    config = None
    if isinstance(owner, ir.Operation) and owner.name == "stablehlo.custom_call":
        attrs = owner.attributes
        if "mhlo.backend_config" in attrs:
            config = ir.DictAttr(attrs["mhlo.backend_config"])
    if config is None or "op_id" not in config:
        # start() and done() are emitted in one trace, so the handle reaches
        # the done straight from the start's custom call.
        raise RuntimeError(
            "jaxring: internal error: an allreduce done's handle does not come "
            f"from an allreduce start (it comes from {owner})"
        )
    return ir.IntegerAttr(config["op_id"]).value


def _done_lowering(ctx, handle, *deps, out_avals, platform):
    del out_avals
    call = jax.ffi.ffi_lowering(f"jaxring_allreduce_done_{platform}")
    return call(ctx, handle, *deps, op_id=np.int64(_op_id_of_start(handle)))


for _platform in lowering.BACKENDS:
    call_sites.register_lowering(
        start_p, functools.partial(_start_lowering, platform=_platform), platform=_platform
    )
    call_sites.register_lowering(
        done_p, functools.partial(_done_lowering, platform=_platform), platform=_platform
    )


# ---- helpers used by overlap ------------------------------------------------


def start(
    xs,
    *,
    deps=(),
    axes,
    groups=None,
    op,
    rings,
    chunk_bytes,
    timeout_s,
    label,
    rings_from_default=False,
):
    """Starts one allreduce over xs (one dtype) once deps exist, within
    axis_index_groups `groups` when given. rings_from_default: the ring
    count is the configured default, which adapts to a crowded job across
    processes (crowding.py).

    Returns its handle, for done(); label names its spans in the timeline."""
    deps = list(deps)
    handle = start_p.bind(
        *deps,
        *xs,
        axes=tuple(axes),
        groups=groups,
        op=op,
        rings=rings,
        rings_from_default=bool(rings_from_default),
        chunk_bytes=chunk_bytes,
        timeout_s=timeout_s,
        link=link_param(),
        algorithm=config.algorithm,
        topology=config.topology,
        label=str(label),
        num_deps=len(deps),
    )
    return handle


def done(handle, out_avals, *, deps=()):
    """Waits for the allreduce whose start gave handle, not before deps
    exist; returns values typed like out_avals."""
    return done_p.bind(handle, *deps, out_avals=tuple(out_avals))
