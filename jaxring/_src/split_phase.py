"""Split-phase allreduce: start and done primitives, and a fence that pins them.

``jaxring.overlap`` needs the compiler to see *when* an allreduce begins and
*when* its result is needed as two separate points of the program:

* ``jaxring_allreduce_start(*xs)`` hands the operands (one dtype) to the
  transport and returns at once with a scalar handle;
* ``jaxring_allreduce_done(handle)`` yields the reduced values, shaped like
  the operands, once the transfer has finished;
* ``jaxring_fence(*vals)`` is the identity, lowered to an HLO optimization
  barrier. Passing a start's handle through a fence together with the values
  the rest of the program needs forces the start to run before that rest;
  passing a handle through a fence before its done forces the done after
  what the fence holds. Unlike ``lax.optimization_barrier`` it accepts values
  with different varying axes under ``check_vma``.

These are internal: they are what ``overlap`` emits, not user API. Neither has
differentiation or batching rules; ``overlap`` rewrites a step after its
gradients have been traced.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jax._src import core, effects
from jax._src.interpreters import mlir
from jax._src.lib.mlir.dialects import hlo

from jaxring._src import allreduce as _ar

# Op ids of split-phase pairs are taken at trace time, so that a start and its
# done agree; they come from the same counter as the lowering-time ids of
# jaxring.allreduce, so the two kinds never collide in one module.
_op_ids = _ar._op_ids


class _MustFinishEffect(effects.Effect):
    """Keeps a done alive when its results are unused.

    A start pinned by a fence stays in the program even if its results are
    dropped; its done must stay too, or the transport would hold the
    operation's buffers forever.
    """

    def __str__(self):
        return "JaxringMustFinish"


must_finish_effect = _MustFinishEffect()
for _kind in (effects.lowerable_effects, effects.control_flow_allowed_effects,
              effects.remat_allowed_effects,
              effects.custom_derivatives_allowed_effects,
              effects.partial_eval_kept_effects):
    _kind.add_type(_MustFinishEffect)

HANDLE_DTYPE = np.int32


def new_op_id() -> int:
    return next(_op_ids)


# ---- start ------------------------------------------------------------------

start_p = core.Primitive("jaxring_allreduce_start")


def _start_abstract_eval(*avals, axes, op, rings, chunk_bytes, timeout_s, op_id):
    del op, rings, chunk_bytes, timeout_s, op_id
    _ar._check_bound(axes)
    dtypes = {a.dtype for a in avals}
    if len(dtypes) != 1:
        raise TypeError(f"jaxring allreduce start: operands mix dtypes {dtypes}")
    # The handle is a scalar placed like the operands, varying wherever any of
    # them varies (a fence mixes it with them).
    first = avals[0]
    handle = first.update(
        shape=(), dtype=np.dtype(HANDLE_DTYPE), weak_type=False,
        sharding=NamedSharding(first.sharding.mesh, PartitionSpec()))
    handle = _ar.with_varying(
        handle, frozenset().union(*(_ar.varying(a) for a in avals)))
    return handle, {core.NamedAxisEffect(a) for a in axes}


start_p.def_effectful_abstract_eval(_start_abstract_eval)


def _start_lowering(ctx, *xs, axes, op, rings, chunk_bytes, timeout_s, op_id):
    world, rank, group = _ar.ring_coordinates(ctx, axes)
    attrs = _ar.ring_attributes(world, op, rings, chunk_bytes, timeout_s)
    attrs["op_id"] = np.int64(op_id)
    call = jax.ffi.ffi_lowering("jaxring_allreduce_start_cpu")
    sub_ctx = ctx.replace(avals_in=[_ar.SCALAR_I32, _ar.SCALAR_I32, *ctx.avals_in])
    return call(sub_ctx, rank, group, *xs, **attrs)


mlir.register_lowering(start_p, _start_lowering, platform="cpu")


# ---- done -------------------------------------------------------------------

done_p = core.Primitive("jaxring_allreduce_done")
done_p.multiple_results = True


def _done_abstract_eval(handle, *, op_id, out_avals):
    del handle, op_id
    return list(out_avals), {must_finish_effect}


done_p.def_effectful_abstract_eval(_done_abstract_eval)


def _done_lowering(ctx, handle, *, op_id, out_avals):
    del out_avals
    # has_side_effect keeps XLA from removing a done whose results are unused
    # (its start would then never be finished).
    call = jax.ffi.ffi_lowering("jaxring_allreduce_done_cpu", has_side_effect=True)
    return call(ctx, handle, op_id=np.int64(op_id))


mlir.register_lowering(done_p, _done_lowering, platform="cpu")


# ---- fence ------------------------------------------------------------------

fence_p = core.Primitive("jaxring_fence")
fence_p.multiple_results = True
fence_p.def_abstract_eval(lambda *avals: list(avals))
fence_p.def_impl(lambda *vals: list(vals))


def _fence_lowering(ctx, *vals):
    del ctx
    return hlo.OptimizationBarrierOp(list(vals)).results


mlir.register_lowering(fence_p, _fence_lowering)


# ---- helpers used by overlap ------------------------------------------------

def start(xs, *, axes, op, rings, chunk_bytes, timeout_s):
    """Starts one allreduce over xs (one dtype). Returns (handle, op_id)."""
    op_id = new_op_id()
    handle = start_p.bind(*xs, axes=tuple(axes), op=op, rings=rings,
                          chunk_bytes=chunk_bytes, timeout_s=timeout_s,
                          op_id=op_id)
    return handle, op_id


def done(handle, op_id, out_avals):
    """Waits for the allreduce of op_id; returns values typed like out_avals."""
    return done_p.bind(handle, op_id=op_id, out_avals=tuple(out_avals))


def fence(vals):
    """Identity that the compiler cannot see through or reorder across."""
    vals = list(vals)
    if not vals:
        return []
    return fence_p.bind(*vals)
