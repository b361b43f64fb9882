"""jaxring.compression.powersgd: low-rank gradient compression that sums on
the ring (PowerSGD, Vogels et al., NeurIPS 2019), with error feedback.

For each compressed leaf, viewed as a matrix M of rows x columns (every
axis but the last, by the last: a flax kernel's inputs by its outputs), one
step is:

    M = gradient + residual           (this rank's)
    P = mean over ranks of M @ Q      (an allreduce of rows x r)
    P = orthonormal columns of P      (Gram-Schmidt, the same on every rank)
    Q = mean over ranks of M^T @ P    (an allreduce of columns x r)
    update = P @ Q^T                  (the same on every rank)
    residual = M - update             (kept by this rank)

Q is kept for the next step (warm start) or drawn afresh each step. Leaves
with fewer than 2 axes, fewer than min_size elements, or where the factors
would not be smaller than the matrix go as they are (a plain mean).

With a wire_dtype, float32 factors and float32 leaves sent whole travel in
that 16-bit format (as PyTorch composes fp16_compress_wrapper with
powerSGD_hook). The factors need nothing more: the residual is taken
against the update built from the rounded means, so it keeps their
rounding too. Leaves sent whole keep a residual of their own, as wire16
does. Warm-up steps (start_step, warm_up=True) average every leaf in its
own dtype, uncompressed, wire_dtype or not.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxring._src import allreduce as _ar, wire_format
from jaxring._src.compress_common import (
    CompressionState,
    LeafPlan,
    axes_of,
    check_bound,
    check_float_leaves,
    check_local,
    check_structure,
    leaf_paths,
    mean_from_wire,
    per_rank_row,
    to_wire,
    wire_plan,
    world_size,
)

_HIGHEST = jax.lax.Precision.HIGHEST


@jax.tree_util.register_pytree_node_class
class PowerSGDState(CompressionState):
    """count: steps taken; q: per leaf its Q factor (columns x rank) or None;
    residual: per leaf this rank's error feedback (a row of one per rank) or
    None; key: the PRNG key Q factors are drawn from (the same on every rank)."""

    FIELDS = ("count", "q", "residual", "key")
    PER_RANK = ("residual",)


def compute_dtype(dtype) -> np.dtype:
    """The dtype a leaf's factors are computed and sent in."""
    return np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)


def _leaf_plan(path: str, leaf, rank: int, min_size: int, wire) -> LeafPlan:
    shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
    size = int(np.prod(shape))
    if len(shape) >= 2:
        rows, cols = int(np.prod(shape[:-1])), shape[-1]
        r = min(rank, rows, cols)
        if size >= min_size and (rows + cols) * r < rows * cols:
            factors = wire_format.travels_as(compute_dtype(dtype), wire)
            return LeafPlan(
                path,
                shape,
                str(dtype),
                "powersgd",
                wire_bytes=(rows + cols) * r * factors.itemsize,
                full_bytes=size * dtype.itemsize,
                matrix=(rows, cols),
                rank=r,
                factors=str(factors) if factors != compute_dtype(dtype) else "",
            )
    return wire_plan(path, leaf, wire)


def orthonormalize(p):
    """p's columns made orthonormal by modified Gram-Schmidt, in order; a
    column in the span of those before it becomes zero."""
    cols = []
    for i in range(p.shape[1]):
        c = p[:, i]
        for done in cols:
            c = c - jnp.dot(done, c, precision=_HIGHEST) * done
        norm = jnp.linalg.norm(c)
        cols.append(jnp.where(norm > 0, c / jnp.where(norm > 0, norm, 1), 0))
    return jnp.stack(cols, axis=1)


def _draw_q(key, index: int, lp: LeafPlan):
    return jax.random.normal(
        jax.random.fold_in(key, index), (lp.matrix[1], lp.rank), compute_dtype(lp.dtype)
    )


def _check_int(name: str, value, least: int, where: str) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < least:
        raise ValueError(f"{where}: {name} must be an int of at least {least}, got {value!r}")
    return int(value)


_WHERE = "jaxring.compression.powersgd"


class _Options(NamedTuple):
    """powersgd's arguments, checked."""

    axes: tuple
    rank: int
    start_step: int
    min_size: int
    warm_start: bool
    seed: int
    wire: Any


def powersgd(
    axis_name,
    rank: int = 4,
    start_step: int = 0,
    min_size: int = 512,
    warm_start: bool = True,
    seed: int = 0,
    wire_dtype=None,
) -> optax.GradientTransformation:
    """Averages local gradients over axis_name with PowerSGD compression.

    Chain it first and drop your own pmean of the gradients::

        tx = optax.chain(jaxring.compression.powersgd("batch", rank=4),
                         optax.adam(1e-3))

    Args:
      axis_name: the mapped axis (or tuple of axes) of the data-parallel ranks.
      rank: the factors' rank (capped by each matrix's shape).
      start_step: steps averaged uncompressed first (the warm-up). With
        start_step > 0 the step holds both paths under a ``lax.cond``, whose
        allreduces jaxring.overlap leaves in place; 0 keeps one path. To
        keep overlap through the warm-up, leave it 0 and pass ``warm_up``
        to ``update`` instead (below).
      min_size: leaves with fewer elements go uncompressed. Matrices from
        512 elements up are worth compressing wherever their factors are
        smaller: on the CNN trainer 4096 sent more than half of the bytes
        uncompressed, and its steps took longer (docs/compression.md).
      warm_start: reuse each Q factor from the step before (else draw anew).
      seed: the seed Q factors are drawn from; the same on every rank.
      wire_dtype: ``None`` (default), ``"bfloat16"`` or ``"float16"``: the
        float32 factors, and the float32 leaves sent whole (with error
        feedback of their own, as wire16 keeps), travel in that format.
        Warm-up steps send every leaf uncompressed in its own dtype.

    Its state holds per-rank leaves (see jaxring.compression.state_specs).

    The warm-up as the trainer's choice: ``update(grads, state, params,
    warm_up=True)`` averages uncompressed, ``warm_up=False`` compresses,
    each with one path in the program, so jaxring.overlap overlaps both.
    ``warm_up`` must be a Python bool (a static argument of the jitted step:
    one compiled step per value); optax.chain passes it on::

        def train_step(params, opt_state, batch, warm_up):
            grads = jax.grad(loss)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params,
                                           warm_up=warm_up)
            return optax.apply_updates(params, updates), opt_state

        steps = {w: jax.pmap(jaxring.overlap(
                        functools.partial(train_step, warm_up=w),
                        axis_name="batch"), axis_name="batch")
                 for w in (True, False)}
        # step k runs steps[k < warm_up_steps]
    """
    where = _WHERE
    axes = axes_of(axis_name, where)
    rank = _check_int("rank", rank, 1, where)
    start_step = _check_int("start_step", start_step, 0, where)
    min_size = _check_int("min_size", min_size, 0, where)
    seed = _check_int("seed", seed, 0, where)
    wire = wire_format.wire_dtype_of(wire_dtype, where)
    if not isinstance(warm_start, bool):
        raise TypeError(f"{where}: warm_start must be a bool, got {warm_start!r}")

    o = _Options(axes, rank, start_step, min_size, warm_start, seed, wire)

    def update(grads, state, params=None, *, warm_up=None, **extra_args):
        del params, extra_args  # optax.chain passes every extra argument on
        return _update(grads, state, o, warm_up)

    return optax.GradientTransformationExtraArgs(functools.partial(_init, o=o), update)


def _init(params, o: _Options):
    """The state for params: the plan of every leaf, Q factors drawn, zero
    residuals."""
    paths, leaves, treedef = leaf_paths(params)
    check_float_leaves(paths, leaves, _WHERE)
    plan = tuple(_leaf_plan(p, l, o.rank, o.min_size, o.wire) for p, l in zip(paths, leaves))
    key = jax.random.PRNGKey(o.seed)
    compressed = [(i, lp) for i, lp in enumerate(plan) if lp.how == "powersgd"]
    q = [None] * len(plan)
    residual = [None] * len(plan)
    for i, lp in compressed:
        q[i] = _draw_q(key, i, lp)
        residual[i] = jnp.zeros((1,) + lp.shape, compute_dtype(lp.dtype))
    for i, lp in enumerate(plan):
        if lp.how not in ("powersgd", "as is"):  # sent whole in the wire format
            residual[i] = jnp.zeros((1,) + lp.shape, wire_format.CARRIED)
    return PowerSGDState(
        plan,
        treedef,
        count=jnp.zeros((), jnp.int32),
        q=tuple(q),
        residual=tuple(residual),
        key=key,
    )


def _plain(leaves, state, o: _Options):
    """The warm-up: a plain mean of every leaf."""
    out = [_ar.allreduce(g, o.axes, op="mean") for g in leaves]
    return out, state.q, state.residual


def _compressed(leaves, state, o: _Options):
    """One PowerSGD step: the means of the compressed leaves as P @ Q^T, the
    others sent whole; the new Q factors and residuals."""
    step_key = jax.random.fold_in(state.key, state.count)
    out, qs, residuals = [], [], []
    # Every P first, with the leaves sent as they are, then every Q: each
    # of these allreduces can start as soon as its leaf's gradient
    # exists, and jaxring.overlap buckets them so.
    ms, ps, plain_means, wire_residuals = {}, {}, {}, {}
    for i, (lp, g, r, q) in enumerate(zip(state.plan, leaves, state.residual, state.q)):
        if lp.how == "as is":
            plain_means[i] = _ar.allreduce(g, o.axes, op="mean")
            continue
        if lp.how != "powersgd":  # sent whole, in the wire format
            sent, wire_residuals[i] = to_wire(g, r, o.axes, o.wire)
            plain_means[i] = _ar.allreduce(sent, o.axes, op="sum")  # a mean below
            continue
        ct = compute_dtype(lp.dtype)
        m = (g.astype(ct) + per_rank_row(r, o.axes)).reshape(lp.matrix)
        if not o.warm_start:
            q = _draw_q(step_key, i, lp)
        ms[i] = m
        ps[i] = _ar.allreduce(
            jnp.matmul(m, q, precision=_HIGHEST), o.axes, op="mean", wire_dtype=o.wire
        )
    # Then every Q in one allreduce: each waits for its P anyway, and a
    # Q whose mean is taken before the next one exists would cost an
    # allreduce of its own.
    p_hat, q_in = {}, {}
    for i in ps:
        p_hat[i] = orthonormalize(ps[i])
        q_in[i] = jnp.matmul(ms[i].T, p_hat[i], precision=_HIGHEST)
    q_means = _ar.allreduce(q_in, o.axes, op="mean", wire_dtype=o.wire) if q_in else {}
    for i, (lp, g) in enumerate(zip(state.plan, leaves)):
        if lp.how != "powersgd":
            out.append(
                plain_means[i]
                if lp.how == "as is"
                else mean_from_wire(plain_means[i], world_size(o.axes), g.dtype)
            )
            qs.append(state.q[i])
            residuals.append(wire_residuals.get(i, state.residual[i]))
            continue
        q = q_means[i]
        update = jnp.matmul(p_hat[i], q.T, precision=_HIGHEST)
        out.append(update.reshape(lp.shape).astype(g.dtype))
        qs.append(q)
        residuals.append((ms[i] - update).reshape((1,) + lp.shape))
    return out, tuple(qs), tuple(residuals)


def _update(grads, state, o: _Options, warm_up):
    """The averaged gradients and the next state; warm_up: None, or the
    trainer's choice of a plain mean (True) or a compressed one."""
    check_bound(o.axes, _WHERE)
    leaves = check_structure(state.treedef, grads, _WHERE)
    check_local(state.plan, leaves, o.axes, _WHERE)
    if warm_up is not None:
        if not isinstance(warm_up, (bool, np.bool_)):
            raise TypeError(
                f"{_WHERE}: warm_up must be a Python bool, got "
                f"{type(warm_up).__name__}; make it a static argument of the "
                "jitted step (one compiled step per value), or use start_step"
            )
        if o.start_step:
            raise ValueError(
                f"{_WHERE}: warm_up and start_step={o.start_step} both choose the "
                "warm-up steps; pass one (start_step=0 with warm_up)"
            )
        out, q, residual = (_plain if warm_up else _compressed)(leaves, state, o)
    elif o.start_step == 0:
        out, q, residual = _compressed(leaves, state, o)
    else:
        out, q, residual = jax.lax.cond(
            state.count >= o.start_step,
            functools.partial(_compressed, o=o),
            functools.partial(_plain, o=o),
            leaves,
            state,
        )
    new = state.replace(count=state.count + 1, q=q, residual=residual)
    return jax.tree_util.tree_unflatten(state.treedef, out), new
