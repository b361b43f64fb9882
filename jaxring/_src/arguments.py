"""The axes and groups an allreduce is called with, checked at trace time.

Each check raises the error lax.psum raises for the same mistake (its own
wording first, so that code matching lax's message matches jaxring's), then
says what to do about it.
"""

from __future__ import annotations

import math
import operator
from typing import Any

from jaxring._src import jax_compat as compat


def axes_tuple(axis_name: Any) -> tuple:
    if isinstance(axis_name, (tuple, list)):
        axes = tuple(axis_name)
    else:
        axes = (axis_name,)
    if not axes:
        raise ValueError("jaxring.allreduce: axis_name must name at least one axis")
    for a in axes:
        if isinstance(a, int):
            raise TypeError(
                "jaxring.allreduce reduces over named axes only; got the "
                f"positional axis {a}. Use jnp.sum for positional reductions."
            )
    if len(set(axes)) != len(axes):
        raise ValueError(f"jaxring.allreduce: axis {axes} repeats a name")
    return axes


def groups_tuple(axis_index_groups) -> tuple | None:
    """axis_index_groups as a tuple of tuples of ints (None stays None),
    checked as lax.psum checks them: every index once."""
    if axis_index_groups is None:
        return None
    try:
        groups = tuple(tuple(int(operator.index(i)) for i in g) for g in axis_index_groups)
    except TypeError:
        raise TypeError(
            "jaxring.allreduce: axis_index_groups must be a list of lists of "
            f"axis indices, got {axis_index_groups!r}"
        ) from None
    indices = [i for g in groups for i in g]
    if not groups or any(not g for g in groups) or sorted(indices) != list(range(len(indices))):
        # lax.psum's own wording.
        raise ValueError(
            "axis_index_groups must cover all indices exactly once "
            f"(jaxring.allreduce got {axis_index_groups!r})"
        )
    return groups


def check_groups_cover(axes: tuple, groups: tuple | None) -> None:
    if groups is None:
        return
    size = math.prod(compat.axis_size(a) for a in axes)
    count = sum(len(g) for g in groups)
    if count != size:
        raise ValueError(
            f"axis_index_groups must cover all indices exactly once: they "
            f"hold {count} indices, but the axes {axes} have {size} "
            "(jaxring.allreduce)"
        )


def bound_axes_text(what: str = "") -> str:
    """The axes bound where the caller traces, as an error names them;
    what: how a name is passed (e.g. "as axis_name")."""
    names = compat.bound_axis_names()
    if not names:
        return "no axis is bound here (this is not inside jax.shard_map, jax.pmap or jax.vmap)"
    return (
        "the axes bound here are "
        + ", ".join(repr(n) for n in names)
        + ": pass one of those"
        + (f" {what}" if what else "")
    )


def check_bound(axes: tuple, overlap_axis_name: Any = None) -> None:
    """A NameError naming the first of axes that no enclosing map binds,
    and the axes that are bound. overlap_axis_name: the axis_name argument
    of jaxring.overlap, where the axes come from there."""
    # JAX's own wording first, so that code matching lax.psum's error
    # matches this one too; then what to do about it.
    for name in axes:
        if compat.axis_is_bound(name):
            continue
        jax_words = (
            f"Found an unbound axis name: {name}. To fix this, please "
            "call psum under `jax.shard_map`."
        )
        if overlap_axis_name is not None:
            raise NameError(
                f"{jax_words} jaxring.overlap(axis_name={overlap_axis_name!r}): "
                f"the decorator's axis_name argument names {name!r}, which no "
                "map around the decorated step binds; "
                f"{bound_axes_text('as axis_name')}. The decorated step runs "
                "inside jax.shard_map or jax.pmap over the axis it names."
            )
        raise NameError(
            f"{jax_words} jaxring.allreduce runs inside jax.shard_map, jax.pmap "
            "or jax.vmap over an axis of that name. It was asked to reduce over "
            f"{name!r}, which no enclosing map binds; {bound_axes_text()}."
        )
