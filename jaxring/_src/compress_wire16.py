"""jaxring.compression.wire16: gradients averaged in a 16-bit wire format,
with error feedback.

Each float32 leaf is rounded to bfloat16 (or float16) on its rank and summed
in that format (jaxring.allreduce of a 16-bit value: each hop adds in
float32 and rounds once; see wire_format for the bound). With error
feedback, the rounding error of this rank's value is kept and added to its
next gradient, so that what each rank sends over T steps stays within one
rounding of T times its gradients, however large T. The ring's roundings
of partial sums (n - 1 per element and step, to nearest even) are not fed
back: no rank knows them. Leaves of other float dtypes travel as they are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxring._src import allreduce as _ar, wire_format
from jaxring._src.compress_common import (
    CompressionState,
    axes_of,
    check_bound,
    check_float_leaves,
    check_local,
    check_structure,
    leaf_paths,
    mean_from_wire,
    to_wire,
    wire_plan,
    world_size,
)


@jax.tree_util.register_pytree_node_class
class Wire16State(CompressionState):
    """residual: per leaf, this rank's rounding error not yet sent (a row of
    one per rank), or None for a leaf without one."""

    FIELDS = ("residual",)
    PER_RANK = ("residual",)


def wire16(
    axis_name, dtype="bfloat16", error_feedback: bool = True
) -> optax.GradientTransformation:
    """Averages local gradients over axis_name in a 16-bit wire format.

    Chain it first and drop your own pmean of the gradients::

        tx = optax.chain(jaxring.compression.wire16("batch"), optax.adam(1e-3))

    Args:
      axis_name: the mapped axis (or tuple of axes) of the data-parallel ranks.
      dtype: ``"bfloat16"`` or ``"float16"``: the format float32 leaves travel in.
      error_feedback: keep each rank's rounding error in the state and add
        it to its next gradient.

    Its state holds per-rank leaves (see jaxring.compression.state_specs).
    """
    where = "jaxring.compression.wire16"
    axes = axes_of(axis_name, where)
    wire = wire_format.wire_dtype_of(dtype, where)
    if wire is None:
        raise ValueError(f"{where}: dtype must be 'bfloat16' or 'float16', got None")
    if not isinstance(error_feedback, bool):
        raise TypeError(f"{where}: error_feedback must be a bool, got {error_feedback!r}")

    def init(params):
        paths, leaves, treedef = leaf_paths(params)
        check_float_leaves(paths, leaves, where)
        plan = tuple(wire_plan(p, l, wire) for p, l in zip(paths, leaves))
        residual = tuple(
            jnp.zeros((1,) + tuple(l.shape), wire_format.CARRIED)
            if error_feedback and lp.how != "as is"
            else None
            for lp, l in zip(plan, leaves)
        )
        return Wire16State(plan, treedef, residual=residual)

    def update(grads, state, params=None):
        del params
        check_bound(axes, where)
        leaves = check_structure(state.treedef, grads, where)
        check_local(state.plan, leaves, axes, where)
        world = world_size(axes)
        # Every value to send first, then every allreduce, then every use of
        # their results: a leaf's result used before the next leaf's value
        # exists would keep jaxring.overlap from putting the two in one
        # bucket (each leaf would cost an allreduce of its own).
        sent, residual = [], []
        for lp, g, r in zip(state.plan, leaves, state.residual):
            if lp.how == "as is":
                sent.append(g)
                residual.append(None)
                continue
            s, left_out = to_wire(g, r, axes, wire)
            sent.append(s)
            residual.append(left_out)
        totals = [
            _ar.allreduce(s, axes, op="mean" if lp.how == "as is" else "sum")
            for lp, s in zip(state.plan, sent)
        ]
        out = [
            t if lp.how == "as is" else mean_from_wire(t, world, g.dtype)
            for lp, g, t in zip(state.plan, leaves, totals)
        ]
        return (
            jax.tree_util.tree_unflatten(state.treedef, out),
            state.replace(residual=tuple(residual)),
        )

    return optax.GradientTransformation(init, update)
