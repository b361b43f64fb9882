"""jaxring.value_and_grad: overlapped gradient averaging for a plain jit step.

Why. Most JAX training code never writes a ``shard_map``: the parameters are
replicated, the batch is placed with a ``NamedSharding`` over a mesh axis,
and inside ``jax.jit`` XLA partitions the step and inserts the gradient
all-reduce itself, after the backward pass. :func:`jaxring.overlap` cannot
decorate such a step: it rewrites ``psum``s over a *bound* axis, and a plain
jit step has no axis and no psum (calling it there raises JAX's unbound-axis
error). This module gives that code the one call it needs to change,
``jax.value_and_grad`` becoming ``jaxring.value_and_grad``: the loss and its
gradients are computed per shard inside a ``shard_map`` over the mesh, and
averaged by ``lax.pmean`` under :func:`jaxring.overlap`, so the reduction is
bucketed and each bucket starts while the rest of the backward pass runs.

Why ``check_vma=False``. With ``check_vma=True`` JAX's autodiff already sums
the gradient of a replicated (``P()``) parameter over the batch axis; the
``pmean`` after it would reduce values already reduced (an update ``n`` times
too large) and send every gradient twice. Under ``check_vma=False`` the
gradients are local and the ``pmean`` is the one reduction.

Why the arguments are placed first. On a mesh whose axes are *explicit*
(``jax.make_mesh``'s default from jax 0.10 on) the abstract values inside
jit carry their sharding, and ``shard_map`` refuses an argument whose
sharding differs from its ``in_specs`` rather than moving it; each argument
is therefore ``jax.sharding.reshard``-ed to its spec over the explicit axes.
Over *auto* axes ``shard_map`` moves the arguments itself.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxring._src import jax_compat as compat
from jaxring._src.overlap import overlap

# Every keyword of jaxring.overlap but the function and the axis, which
# value_and_grad sets itself.
OVERLAP_OPTIONS = tuple(
    name for name in inspect.signature(overlap).parameters if name not in ("fn", "axis_name")
)


def _axes_of(axis_name) -> tuple:
    if isinstance(axis_name, str):
        return (axis_name,)
    if (
        isinstance(axis_name, tuple)
        and axis_name
        and all(isinstance(a, str) for a in axis_name)
        and len(set(axis_name)) == len(axis_name)
    ):
        return axis_name
    raise TypeError(
        "jaxring.value_and_grad: axis_name must be a mesh axis name "
        f"or a tuple of distinct names, got {axis_name!r}"
    )


def _spec_axes(spec) -> set:
    """The mesh axis names a PartitionSpec shards over."""
    names = set()
    for entry in spec or ():
        if isinstance(entry, str):
            names.add(entry)
        elif isinstance(entry, (tuple, list)):
            names.update(e for e in entry if isinstance(e, str))
    return names


def _known_sharding_axes(x) -> set:
    """The axes x is known to be split over: from a concrete array's
    sharding, or from the abstract value's (explicit mesh axes inside jit).
    Over auto axes inside jit the placement is not known at trace time."""
    names = set()
    try:
        names |= _spec_axes(getattr(x.sharding, "spec", None))
    except AttributeError:  # a tracer, or not a jax.Array
        pass
    try:
        names |= _spec_axes(jax.typeof(x).sharding.spec)
    except (AttributeError, TypeError):
        pass
    return names


def _placed(x, mesh: Mesh, spec: P, explicit: frozenset):
    """x resharded to spec over the mesh's explicit axes (see the module's
    docstring); unchanged on a mesh without explicit axes."""
    if not explicit:
        return x
    kept = []
    for entry in spec:
        names = entry if isinstance(entry, tuple) else (entry,)
        names = tuple(a for a in names if a in explicit)
        kept.append(names if len(names) > 1 else (names[0] if names else None))
    return jax.sharding.reshard(x, NamedSharding(mesh, P(*kept)))


def _check_arguments(loss_fn, mesh, axis_name, overlap_options: dict) -> tuple:
    """The axes value_and_grad's arguments name, once they are checked."""
    if not callable(loss_fn):
        raise TypeError(f"jaxring.value_and_grad takes the loss function first, got {loss_fn!r}")
    if not isinstance(mesh, Mesh):
        raise TypeError(
            "jaxring.value_and_grad: mesh must be a jax.sharding.Mesh "
            f"(e.g. jax.make_mesh((8,), ('batch',))), got {type(mesh).__name__}"
        )
    axes = _axes_of(axis_name)
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"jaxring.value_and_grad: axis_name {axis_name!r} is not an "
            f"axis of the mesh, whose axes are {tuple(mesh.axis_names)}; "
            "name the mesh axis the batch is split over"
        )
    unknown = sorted(set(overlap_options) - set(OVERLAP_OPTIONS))
    if unknown:
        raise TypeError(
            f"jaxring.value_and_grad got unexpected keyword argument(s) "
            f"{', '.join(unknown)}; the options it passes on to "
            f"jaxring.overlap are {', '.join(OVERLAP_OPTIONS)}"
        )
    return axes


def _check_call(params, batch: tuple, kwargs: dict, axes: tuple, axis_name, n: int) -> None:
    """Raises where a call of value_and_grad's function cannot be right:
    keywords, no batch, inside a map of the axis, params split over it, or a
    batch that does not split into n equal shards."""
    if kwargs:
        raise TypeError(
            "jaxring.value_and_grad: the function it returns takes "
            f"(params, *batch_args) only, got keyword(s) "
            f"{', '.join(sorted(kwargs))}; pass batch arrays "
            "positionally, and close over anything else"
        )
    if not batch:
        raise ValueError(
            "jaxring.value_and_grad needs at least one batch argument "
            "after params, split over the axis: call it as "
            "f(params, *batch_args) (for a loss of params alone use "
            "jax.value_and_grad)"
        )
    bound = [a for a in axes if compat.axis_is_bound(a)]
    if bound:
        raise ValueError(
            f"jaxring.value_and_grad was called inside a shard_map or "
            f"pmap that already maps {bound[0]!r}; there, take "
            "jax.value_and_grad and lax.pmean of the gradients under "
            "@jaxring.overlap instead"
        )
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if _known_sharding_axes(leaf) & set(axes):
            raise ValueError(
                f"jaxring.value_and_grad: params{jax.tree_util.keystr(path)} is split "
                f"over {axis_name!r}, the batch axis; params must be "
                "replicated over it: place them with NamedSharding(mesh, P()) "
                "(jax.device_put), and only the batch with P(axis_name)"
            )
    for i, arg in enumerate(batch, start=1):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            shape = jnp.shape(leaf)
            if not shape or shape[0] % n:
                raise ValueError(
                    f"jaxring.value_and_grad: batch argument {i}"
                    f"{jax.tree_util.keystr(path)} has shape "
                    f"{tuple(shape)}; every batch array needs a leading "
                    f"dimension divisible by the size of {axis_name!r} ({n}): "
                    "pad or drop examples so that the batch splits evenly"
                )


def value_and_grad(
    loss_fn: Callable, *, mesh: Mesh, axis_name, has_aux: bool = False, **overlap_options: Any
) -> Callable:
    """``jax.value_and_grad`` whose gradient average overlaps the backward pass.

    For a plain ``jax.jit`` step (parameters replicated, batch split over a
    mesh axis)::

        @jax.jit
        def train_step(params, opt_state, x, y):
            loss, grads = jaxring.value_and_grad(
                loss_fn, mesh=mesh, axis_name="batch")(params, x, y)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

    The returned function takes ``(params, *batch_args)``: ``params`` (a
    pytree, the argument differentiated) replicated over the mesh, and each
    batch argument (a pytree of arrays) split over ``axis_name`` along its
    leading dimension. On each shard it computes
    ``jax.value_and_grad(loss_fn)(params, *local_batch)``; the loss and the
    gradients are averaged over the shards by ``lax.pmean`` under
    :func:`jaxring.overlap`, and returned replicated. The result equals
    ``jax.value_and_grad(loss_fn)(params, *batch_args)`` on the whole batch
    when the loss is a mean over examples: the global loss is the mean of the
    per-shard losses, which is the full-batch mean because the shards are
    equal-sized (the leading dimension must divide evenly). A loss that is a
    sum over examples comes out divided by the number of shards.

    Args:
      loss_fn: ``loss_fn(params, *batch_args)`` returning a scalar loss, or
        ``(loss, aux)`` with ``has_aux=True``.
      mesh: the ``jax.sharding.Mesh`` the batch is split over. Its other
        axes, if any, repeat the computation.
      axis_name: the mesh axis (or tuple of axes) the batch is split over.
      has_aux: ``loss_fn`` returns ``(loss, aux)``. The returned function then
        returns ``((loss, aux), grads)`` like ``jax.value_and_grad``, with
        every leaf of ``aux`` stacked over the shards: a leaf of shape ``s``
        comes back with shape ``(n, *s)``, row ``i`` computed on shard ``i``
        (``n`` the size of ``axis_name``). ``aux.mean(0)`` of a per-example
        mean is its full-batch mean; per-example outputs of local shape
        ``(b, ...)`` come back as ``(n, b, ...)``, in batch order once
        reshaped to ``(n * b, ...)``.
      **overlap_options: :func:`jaxring.overlap`'s ``bucket_mb``,
        ``first_bucket_mb``, ``partition_mb``, ``max_inflight_mb``,
        ``rings``, ``chunk_bytes``, ``timeout_s``, ``report`` and
        ``wire_dtype``.

    Call it inside ``jax.jit`` (called outside, the function it returns
    compiles on its first call, so keep it and call it again). Inside jit,
    the placement of ``params`` can be checked only on a mesh whose axes are
    explicit; over auto axes, parameters split over ``axis_name`` are
    gathered by XLA before the step, at the cost of a transfer.
    """
    axes = _check_arguments(loss_fn, mesh, axis_name, overlap_options)
    n = math.prod(mesh.shape[a] for a in axes)
    batch_spec = P(axis_name)
    explicit = frozenset(
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types)
        if kind == jax.sharding.AxisType.Explicit
    )

    def local(params, *batch):
        if has_aux:
            (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, *batch)
        else:
            loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        loss, grads = jax.lax.pmean((loss, grads), axis_name)
        if has_aux:
            return (loss, jax.tree.map(lambda a: jnp.asarray(a)[None], aux)), grads
        return loss, grads

    # Built here so that bad options fail where value_and_grad is called.
    overlapped = overlap(local, axis_name=axis_name, **overlap_options)
    out_specs = ((P(), batch_spec), P()) if has_aux else (P(), P())

    def mapped(params, *batch):
        params = jax.tree.map(lambda x: _placed(x, mesh, P(), explicit), params)
        batch = jax.tree.map(lambda x: _placed(x, mesh, batch_spec, explicit), batch)
        return jax.shard_map(
            overlapped,
            mesh=mesh,
            in_specs=(P(),) + (batch_spec,) * len(batch),
            out_specs=out_specs,
            check_vma=False,
        )(params, *batch)

    # One jit per batch arity: outside jit, a second call reuses the first's
    # compilation; inside, it is inlined.
    compiled = {}

    @functools.wraps(loss_fn)
    def value_and_grad_fn(params, *batch, **kwargs):
        _check_call(params, batch, kwargs, axes, axis_name, n)
        if len(batch) not in compiled:
            compiled[len(batch)] = jax.jit(mapped)
        return compiled[len(batch)](params, *batch)

    value_and_grad_fn.jaxring_overlap_options = overlapped.jaxring_overlap_options
    return value_and_grad_fn
