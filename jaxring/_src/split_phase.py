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
import itertools

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxring._src import allreduce as _ar
from jaxring._src import call_sites
from jaxring._src import jax_compat as compat
from jaxring._src.config import config

# A start and its done share a *pair* number, taken at trace time. The op id
# the transport matches ranks by is taken when the start is lowered, as
# jaxring.allreduce takes it (call_sites.call_ids), and the done lowered
# after it looks it up.
# So a traced step that is lowered twice into one module (a scan unrolled by
# JAX, the same jaxpr evaluated twice) gets an op id per copy.
_pairs = itertools.count(1)
_op_id_of_pair: dict[int, int] = {}


HANDLE_DTYPE = np.int32




# ---- start ------------------------------------------------------------------

start_p = compat.Primitive("jaxring_allreduce_start")


def _start_abstract_eval(*avals, axes, groups, op, rings, chunk_bytes, timeout_s,
                         link, algorithm, topology, pair, label, num_deps):
    del op, rings, chunk_bytes, timeout_s, link, algorithm, topology, pair, label
    _ar._check_bound(axes)
    _ar._check_groups_cover(axes, groups)
    avals = avals[num_deps:]
    dtypes = {a.dtype for a in avals}
    if len(dtypes) != 1:
        raise TypeError(f"jaxring allreduce start: operands mix dtypes {dtypes}")
    # The handle is a scalar placed like the operands, varying wherever any of
    # them varies.
    first = avals[0]
    handle = first.update(
        shape=(), dtype=np.dtype(HANDLE_DTYPE), weak_type=False,
        sharding=NamedSharding(first.sharding.mesh, PartitionSpec()))
    handle = _ar.with_varying(
        handle, frozenset().union(*(_ar.varying(a) for a in avals)))
    return handle, {compat.NamedAxisEffect(a) for a in axes}


start_p.def_effectful_abstract_eval(_start_abstract_eval)


def _start_lowering(ctx, *xs, axes, groups, op, rings, chunk_bytes, timeout_s,
                    link, algorithm, topology, pair, label, num_deps):
    ring = _ar.ring_coordinates(ctx, axes, groups, timeout_s, link)
    attrs = _ar.ring_attributes(ctx, label, ring, op, rings, chunk_bytes, timeout_s,
                                link, algorithm, topology)
    _op_id_of_pair[pair] = int(attrs["op_id"])
    attrs["num_deps"] = np.int64(num_deps)
    attrs["gang"] = bool(config.cpu_gang_start)
    call = jax.ffi.ffi_lowering("jaxring_allreduce_start_cpu")
    sub_ctx = ctx.replace(avals_in=[_ar.SCALAR_I32, _ar.SCALAR_I32, *ctx.avals_in])
    return call(sub_ctx, ring.rank, ring.group, *xs, **attrs)


call_sites.register_lowering(start_p, _start_lowering, platform="cpu")


# ---- done -------------------------------------------------------------------

done_p = compat.Primitive("jaxring_allreduce_done")
done_p.multiple_results = True


def _done_abstract_eval(handle, *deps, pair, out_avals):
    # No effect and no side effect: a start's only user is its done, so when
    # a done's results are unused the compiler drops both together.
    del handle, deps, pair
    return list(out_avals)


done_p.def_abstract_eval(_done_abstract_eval)


def _done_lowering(ctx, handle, *deps, pair, out_avals,
                   target="jaxring_allreduce_done_cpu"):
    del out_avals
    op_id = _op_id_of_pair.get(pair)
    if op_id is None:  # a done is lowered after its start: its operand
        raise RuntimeError(f"jaxring: allreduce done of pair {pair} lowered "
                           "before its start")
    call = jax.ffi.ffi_lowering(target)
    return call(ctx, handle, *deps, op_id=np.int64(op_id))


call_sites.register_lowering(done_p, _done_lowering, platform="cpu")


def _start_cuda_lowering(ctx, *xs, axes, groups, op, rings, chunk_bytes,
                         timeout_s, link, algorithm, topology, pair, label,
                         num_deps):
    attrs = _ar.cuda_attributes(ctx, label, axes, groups, op, rings, chunk_bytes,
                                timeout_s, link, algorithm, topology,
                                ctx.avals_in[num_deps].dtype)
    _op_id_of_pair[pair] = int(attrs["op_id"])
    attrs["num_deps"] = np.int64(num_deps)
    return jax.ffi.ffi_lowering("jaxring_allreduce_start_cuda")(ctx, *xs, **attrs)


call_sites.register_lowering(start_p, _start_cuda_lowering, platform="cuda")
call_sites.register_lowering(
    done_p, functools.partial(_done_lowering, target="jaxring_allreduce_done_cuda"),
    platform="cuda")


# ---- helpers used by overlap ------------------------------------------------

def start(xs, *, deps=(), axes, groups=None, op, rings, chunk_bytes, timeout_s,
          label):
    """Starts one allreduce over xs (one dtype) once deps exist, within
    axis_index_groups `groups` when given.

    Returns (handle, pair); label names its spans in the timeline."""
    pair = next(_pairs)
    deps = list(deps)
    handle = start_p.bind(*deps, *xs, axes=tuple(axes), groups=groups, op=op,
                          rings=rings,
                          chunk_bytes=chunk_bytes, timeout_s=timeout_s,
                          link=_ar.link_param(), algorithm=config.algorithm,
                          topology=config.topology,
                          pair=pair, label=str(label),
                          num_deps=len(deps))
    return handle, pair


def done(handle, pair, out_avals, *, deps=()):
    """Waits for the allreduce started as pair, not before deps exist;
    returns values typed like out_avals."""
    return done_p.bind(handle, *deps, pair=pair, out_avals=tuple(out_avals))
