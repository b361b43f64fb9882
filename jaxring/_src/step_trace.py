"""Tracing a step for jaxring.overlap, and re-evaluating its equations.

Pure jaxpr utilities: no bucketing, no communication.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxring._src import jax_compat as compat
from jaxring._src.jax_compat import source_info_util

_JIT_NAMES = ("jit", "pjit")


def _is_array_like(x) -> bool:
    # Python scalars stay static, as under jit's static arguments: a flag
    # such as train=True must stay usable in Python control flow.
    return isinstance(x, (jax.Array, jax.core.Tracer, np.ndarray, np.generic))


def trace_step(fn, args, kwargs):
    """Closed jaxpr of fn over the array leaves of (args, kwargs).

    Leaves that are not arrays (Python scalars, strings, callables) are kept
    static.
    """
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [i for i, leaf in enumerate(leaves) if _is_array_like(leaf)]

    def flat_fn(*dyn):
        full = list(leaves)
        for i, v in zip(dynamic, dyn):
            full[i] = v
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        return fn(*a, **k)

    dyn_vals = [leaves[i] for i in dynamic]
    closed, out_shapes = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn_vals)
    out_tree = jax.tree_util.tree_structure(out_shapes)
    # Re-trace through an evaluator that inlines nested jit calls, so that the
    # psums and the backward pass of an inner jit are visible at top level.
    inlined = jax.make_jaxpr(lambda *a: _eval_inlining_jit(*compat.closed_parts(closed), a))(
        *dyn_vals
    )
    return inlined, dyn_vals, out_tree


def _bind_params(eqn):
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # older jax: (subfuns, params)
        subfuns, params = params
        return list(subfuns), params
    return [], params


def bind_eqn(eqn, invals):
    subfuns, params = _bind_params(eqn)
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (
        source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
        eqn.ctx.manager,
    ):
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def read_atom(env, v):
    return v.val if isinstance(v, compat.Literal) else env[v]


def retrace_in_order(closed, order: list[int], dyn_vals):
    """closed's jaxpr traced again with its equations bound in order (a
    topological order of them)."""
    jaxpr, consts = compat.closed_parts(closed)

    def run(*args):
        env: dict = {}
        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for i in order:
            eqn = jaxpr.eqns[i]
            env.update(zip(eqn.outvars, bind_eqn(eqn, [read_atom(env, v) for v in eqn.invars])))
        return [read_atom(env, v) for v in jaxpr.outvars]

    return jax.make_jaxpr(run)(*dyn_vals)


def _eval_inlining_jit(jaxpr, consts, args):
    env: dict = {}
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [read_atom(env, v) for v in eqn.invars]
        if eqn.primitive.name in _JIT_NAMES and "jaxpr" in eqn.params:
            inner = eqn.params["jaxpr"]
            outs = _eval_inlining_jit(*compat.closed_parts(inner), invals)
        else:
            outs = bind_eqn(eqn, invals)
        env.update(zip(eqn.outvars, outs))
    return [read_atom(env, v) for v in jaxpr.outvars]


def uses(jaxpr):
    """first_use[v] and last_use[v] as equation indices (len(eqns) = output)."""
    n = len(jaxpr.eqns)
    first, last = {}, {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, compat.Var):
                first.setdefault(v, i)
                last[v] = i
    for v in jaxpr.outvars:
        if isinstance(v, compat.Var):
            first.setdefault(v, n)
            last[v] = n
    return first, last


def where(eqn) -> str:
    stack = str(eqn.source_info.name_stack)
    src = source_info_util.summarize(eqn.source_info)
    return f"{stack} at {src}" if stack else src
