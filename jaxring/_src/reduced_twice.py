"""Reductions of values already reduced, found in a traced step and made local.

Under ``jax.shard_map``'s default ``check_vma=True``, parameters passed with
``P()`` are invariant over the batch axis, and autodiff sums their gradients
over it: the transpose of the implicit ``pvary`` is a ``psum``. A step that
then writes ``pmean(grads)`` reduces values every device already holds. In
the jaxpr that second reduction is a ``psum`` of a ``pvary`` of an invariant
value; its result (lax's) is that value times the axis size, which needs
no transfer. jaxring.overlap would otherwise bucket it and send the gradients
twice (and the step, as written, trains with n times the gradient).

So before bucketing, each such reduction is replaced by its local value, and
the caller is told where it is and what to write instead.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jaxring._src import jax_compat as compat
from jaxring._src.step_trace import bind_eqn, read_atom

# The primitives that make an invariant value varying (lax.pcast to varying).
_PVARY_NAMES = ("pvary", "pbroadcast")
_SUM_NAMES = ("psum", "psum_invariant")


@dataclasses.dataclass(frozen=True)
class ReducedTwice:
    """One operand of a sum whose value was already reduced over its axes."""

    eqn: int
    operand: int
    axes: tuple


def find(jaxpr, matches) -> list[ReducedTwice]:
    """The operands of top-level sums over axes that matches(axes) accepts
    which are a pvary, over exactly those axes, of a value invariant over
    them."""
    producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    found = []
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name not in _SUM_NAMES:
            continue
        axes = tuple(eqn.params["axes"])
        if not matches(axes) or eqn.params.get("axis_index_groups") is not None:
            continue
        for j, v in enumerate(eqn.invars):
            src = producer.get(v) if isinstance(v, compat.Var) else None
            if src is None or src.primitive.name not in _PVARY_NAMES:
                continue
            u = src.invars[0]
            if set(src.params.get("axes", ())) != set(axes):
                continue
            if isinstance(u, compat.Literal) or compat.varying(u.aval) & set(axes):
                continue
            found.append(ReducedTwice(i, j, axes))
    return found


def made_local(closed, found: list[ReducedTwice], dyn_vals):
    """closed traced again with each found operand's sum computed locally
    (the invariant value times the size of the axes), as lax.psum defines it
    for such a value; the other operands of those sums are reduced as
    before."""
    jaxpr, consts = compat.closed_parts(closed)
    producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    local = {}
    for r in found:
        local.setdefault(r.eqn, {})[r.operand] = r.axes

    def run(*args):
        env: dict = {}
        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for i, eqn in enumerate(jaxpr.eqns):
            invals = [read_atom(env, v) for v in eqn.invars]
            if i not in local:
                env.update(zip(eqn.outvars, bind_eqn(eqn, invals)))
                continue
            kept = [k for k in range(len(invals)) if k not in local[i]]
            if kept:
                reduced = bind_eqn(_with_invars(eqn, kept), [invals[k] for k in kept])
                env.update(zip([eqn.outvars[k] for k in kept], reduced))
            for k, axes in local[i].items():
                value = env[producer[eqn.invars[k]].invars[0]]
                n = math.prod(compat.axis_size(a) for a in axes)
                env[eqn.outvars[k]] = value * np.asarray(n, value.dtype)
        return [read_atom(env, v) for v in jaxpr.outvars]

    return jax.make_jaxpr(run)(*dyn_vals)


def _with_invars(eqn, kept: list[int]):
    return eqn.replace(invars=[eqn.invars[k] for k in kept], outvars=[eqn.outvars[k] for k in kept])


def warning_text(labels: list[str], source: str, axes: tuple, n: int) -> str:
    """What jaxring.overlap tells the user about the reductions of one call
    (one source line) whose values were already reduced."""
    shown = ", ".join(labels[:4]) + (f" and {len(labels) - 4} more" if len(labels) > 4 else "")
    axes_text = repr(axes[0]) if len(axes) == 1 else repr(axes)
    return (
        f"the psum/pmean at {source} reduces over {axes_text} values that are "
        f"already reduced over it ({shown}): under jax.shard_map's default "
        "check_vma=True, autodiff sums the gradients of parameters passed "
        "with P() over the batch axis. Such a reduction's result is the "
        f"value times {n}, which jaxring computes without sending anything; "
        "for a loss averaged over each device's batch the step trains with "
        f"{n}x the full-batch gradient. Either pass check_vma=False to "
        "shard_map and keep the pmean of the local gradients, or keep "
        "check_vma=True, average the loss with lax.pmean inside the loss "
        "function and drop the pmean of the gradients (docs/overlap.md, "
        '"Gradients under check_vma").'
    )
