"""The allreduce primitive's lowering: one path for both backends, each
backend's difference in its call function (BACKENDS: lowering_cpu.py,
lowering_cuda.py), which returns the custom call's attributes and its extra
operands. split_phase.py lowers its start through the same table.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxring._src import call_sites, distributed, jax_compat as compat
from jaxring._src.call_attributes import allreduce_label
from jaxring._src.jax_compat import mlir
from jaxring._src.lowering_cpu import cpu_call
from jaxring._src.lowering_cuda import cuda_call
from jaxring._src.mesh_tables import automatic_axes, enclosing_devices
from jaxring._src.primitive import allreduce_p

BACKENDS = {"cpu": cpu_call, "cuda": cuda_call}

# The type of a rank operand (lowering_cpu.py).
SCALAR_I32 = compat.ShapedArray((), np.int32)


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
    with enclosing_devices(distributed.device_assignment(ctx.module_context.axis_context)):
        return mlir.lower_fun(reduce_parts, multiple_results=False)(ctx, x)


def _in_manual_region(lowering):
    """The allreduce's lowering, entering a region manual over every mesh
    axis first where the shard_map being lowered left some automatic."""

    def lower(ctx, x, **params):
        auto = automatic_axes(ctx)
        if auto:
            return _lower_in_manual_region(ctx, x, auto, params)
        return lowering(ctx, x, **params)

    return lower


def _spec_axes(entry) -> tuple:
    """The mesh axes one entry of a PartitionSpec names."""
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


for _platform in BACKENDS:
    call_sites.register_lowering(
        allreduce_p,
        _in_manual_region(functools.partial(_lowering, platform=_platform)),
        platform=_platform,
    )
