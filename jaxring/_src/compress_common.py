"""What the gradient compression transforms share: the per-leaf plan made at
init, the state's per-rank leaves, the checks, and the wire-bytes report.

A compression transform's state has two kinds of leaves:

* leaves every rank holds alike (the step count, PowerSGD's Q factors,
  which are allreduced, so equal on every rank);
* per-rank leaves, the error-feedback residuals: what this rank's
  compressed gradient left out, added back into its next gradient. They
  differ from rank to rank by design. Inside the mapped step a per-rank
  leaf has a leading axis of 1 (this rank's row); outside it, the state
  holds one row per rank (``for_ranks``), split over the mapped axis
  (``state_specs`` for ``shard_map``; under ``pmap`` the whole state is
  replicated per device, flax-style, and the rows come from that).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from jaxring._src import arguments, jax_compat as compat, wire_format


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """How one gradient leaf travels, fixed at init from the params."""

    path: str
    shape: tuple
    dtype: str
    how: str  # "powersgd", a wire dtype's name, or "as is"
    wire_bytes: int  # bytes this rank sends into the allreduces per step
    full_bytes: int  # the same leaf, uncompressed
    matrix: tuple = ()  # PowerSGD: (rows, columns) of the 2-D view
    rank: int = 0  # PowerSGD: the rank used (at most rows, columns)
    factors: str = ""  # PowerSGD: the wire dtype its factors travel in, if any


class CompressionState:
    """Base of the transforms' states: a pytree whose children are named by
    FIELDS (those in PER_RANK per-rank) and whose static part holds the
    per-leaf plan and the params' treedef, so that report() and the checks
    need no arrays. Subclasses are registered as pytree node classes."""

    FIELDS: tuple = ()
    PER_RANK: tuple = ()

    def __init__(self, plan: tuple, treedef, **children):
        self.plan, self.treedef = plan, treedef
        for name in self.FIELDS:
            setattr(self, name, children[name])

    def tree_flatten(self):
        return tuple(getattr(self, n) for n in self.FIELDS), (self.plan, self.treedef)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*aux, **dict(zip(cls.FIELDS, children)))

    def replace(self, **children):
        now = {n: getattr(self, n) for n in self.FIELDS}
        return type(self)(self.plan, self.treedef, **{**now, **children})

    def per_rank_mask(self):
        """The state with True at its per-rank leaves, False elsewhere."""
        return self.replace(
            **{
                n: jax.tree_util.tree_map(lambda _, per=n in self.PER_RANK: per, getattr(self, n))
                for n in self.FIELDS
            }
        )

    def __repr__(self):
        inner = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.FIELDS)
        return f"{type(self).__name__}({inner})"


def axes_of(axis_name, where: str) -> tuple:
    """axis_name as a tuple of names, or a clear error."""
    try:
        return arguments.axes_tuple(axis_name)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None


def check_bound(axes: tuple, where: str) -> None:
    """A clear error where the update runs outside the map over axes."""
    for name in axes:
        if not compat.axis_is_bound(name):
            bound = arguments.bound_axes_text("as the transform's axis_name")
            raise NameError(
                f"{where}: the axis {name!r} is not bound here. Call the "
                "optimizer's update inside the jax.shard_map or jax.pmap over "
                f"{name!r}, on each rank's local gradients ({bound})."
            )


def world_size(axes: tuple) -> int:
    return math.prod(compat.axis_size(a) for a in axes)


def leaf_paths(tree) -> tuple[list[str], list, Any]:
    """(paths, leaves, treedef) of a pytree."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return (
        [jax.tree_util.keystr(p) for p, _ in with_path],
        [leaf for _, leaf in with_path],
        treedef,
    )


def check_float_leaves(paths, leaves, where: str) -> None:
    for path, leaf in zip(paths, leaves):
        dtype = np.dtype(jax.numpy.result_type(leaf))
        if not np.issubdtype(dtype, np.floating):
            raise TypeError(
                f"{where}: the leaf {path or '<root>'} is {dtype}; gradient "
                "compression takes float leaves only (keep integer state out "
                "of the params the optimizer sees)"
            )


def check_structure(treedef, grads, where: str):
    """grads' leaves, or a clear error where grads do not match the params
    the state was made for."""
    leaves, got = jax.tree_util.tree_flatten(grads)
    if got != treedef:
        raise ValueError(
            f"{where}: the gradients' structure {got} differs from that of the "
            f"params the state was made for ({treedef})"
        )
    return leaves


def check_local(plan, leaves, axes: tuple, where: str) -> None:
    """A clear error where a gradient arrives already summed over axes.

    Under shard_map's default check_vma=True, autodiff sums the gradients of
    parameters passed with P() over the axis before the optimizer sees
    them: they crossed the network uncompressed already, and compressing
    the sum would add a second reduction's error for nothing."""
    if not compat.check_vma_enabled():
        return
    for lp, g in zip(plan, leaves):
        missing = set(axes) - compat.varying(compat.typeof(g))
        if missing:
            raise ValueError(
                f"{where}: the gradient {lp.path or '<root>'} is already "
                f"reduced over {sorted(missing, key=str)} "
                f"({compat.typeof(g).str_short(True)} does not vary over it): "
                "under jax.shard_map's default check_vma=True, autodiff sums "
                "the gradients of parameters passed with P(), so they were "
                "sent uncompressed before this transform saw them. Pass "
                "check_vma=False to jax.shard_map so that the step's "
                "gradients stay local, and take no pmean of them: the "
                "transform averages them (docs/compression.md)."
            )


def wire_plan(path: str, leaf, wire: np.dtype) -> LeafPlan:
    """A leaf sent whole: in the wire format where it carries the leaf's
    dtype (float32), else as it is."""
    dtype = np.dtype(leaf.dtype)
    size = int(np.prod(leaf.shape))
    travels = wire_format.travels_as(dtype, wire)
    return LeafPlan(
        path,
        tuple(leaf.shape),
        str(dtype),
        how=str(travels) if travels != dtype else "as is",
        wire_bytes=size * travels.itemsize,
        full_bytes=size * dtype.itemsize,
    )


def to_wire(g, residual, axes: tuple, wire: np.dtype):
    """What this rank sends of gradient leaf g in the wire format, with its
    error feedback: (the value to sum, the new residual: what the rounding
    left out, or None without a residual)."""
    value = g.astype(wire_format.CARRIED)
    if residual is not None:
        value = value + per_rank_row(residual, axes)
    sent = value.astype(wire)
    left_out = None if residual is None else (value - sent.astype(wire_format.CARRIED))[None]
    return sent, left_out


def mean_from_wire(total, world: int, dtype):
    """The mean of a sum taken in the wire format, divided in float32."""
    return (total.astype(wire_format.CARRIED) / world).astype(dtype)


def per_rank_row(leaf, axes: tuple):
    """A per-rank leaf as this rank's value (without its leading axis of 1),
    with a clear error where the state was not split over the ranks: a
    leaf without one row per rank, or (where shard_map checks varying axes)
    one typed the same on every rank, which would leave every rank's
    residual but one's behind."""
    replicated = compat.check_vma_enabled() and not set(axes) <= compat.varying(compat.typeof(leaf))
    if leaf.shape[:1] != (1,) or replicated:
        raise ValueError(
            "jaxring.compression: a per-rank state leaf is "
            f"{compat.typeof(leaf).str_short(True)} inside the mapped step, "
            "not one row (1, ...) varying over the ranks: the state was not "
            "split over the mapped axis. Under shard_map pass "
            "jaxring.compression.for_ranks(state, world) with "
            "in_specs/out_specs jaxring.compression.state_specs(state, "
            "axis_name); under pmap replicate the whole state per device."
        )
    return leaf[0]


# ---- per-rank leaves, outside the map ----------------------------------------


def _is_state(x) -> bool:
    return isinstance(x, CompressionState)


def rank_mask(opt_state):
    """opt_state with True at per-rank leaves (error-feedback residuals) and
    False at every other leaf."""
    return jax.tree_util.tree_map(
        lambda x: x.per_rank_mask() if _is_state(x) else False, opt_state, is_leaf=_is_state
    )


def state_specs(opt_state, axis_name):
    """shard_map in_specs/out_specs for opt_state: its per-rank leaves split
    over axis_name (one row per rank), every other leaf replicated."""
    return jax.tree_util.tree_map(
        lambda per_rank: PartitionSpec(axis_name) if per_rank else PartitionSpec(),
        rank_mask(opt_state),
    )


def for_ranks(opt_state, world: int):
    """opt_state with one row per rank in each per-rank leaf (init makes one
    row), for a shard_map over world ranks. Those leaves come back as NumPy
    arrays, which jit places as their specs ask, on a mesh of any axis type."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(
            f"jaxring.compression.for_ranks: world must be a positive int, got {world!r}"
        )
    return jax.tree_util.tree_map(
        lambda leaf, per_rank: np.repeat(np.asarray(leaf), world, axis=0) if per_rank else leaf,
        opt_state,
        rank_mask(opt_state),
    )


# ---- the report ---------------------------------------------------------------


@dataclasses.dataclass
class CompressionReport:
    """Bytes each rank sends into the allreduces per step, per leaf and in
    all, against the same gradients uncompressed (after any warm-up)."""

    leaves: list[LeafPlan]

    @property
    def wire_bytes(self) -> int:
        return sum(l.wire_bytes for l in self.leaves)

    @property
    def full_bytes(self) -> int:
        return sum(l.full_bytes for l in self.leaves)

    @property
    def ratio(self) -> float:
        """Uncompressed bytes over compressed bytes."""
        return self.full_bytes / max(self.wire_bytes, 1)

    def __str__(self):
        lines = [
            f"jaxring.compression: {self.wire_bytes:,} bytes per step on the "
            f"wire against {self.full_bytes:,} uncompressed "
            f"({self.ratio:.1f}x smaller)"
        ]
        for l in self.leaves:
            how = (
                f"powersgd rank {l.rank} of {l.matrix[0]}x{l.matrix[1]}"
                + (f" in {l.factors}" if l.factors else "")
                if l.how == "powersgd"
                else l.how
            )
            lines.append(
                f"  {l.path or '<root>'} {l.dtype}{list(l.shape)}: "
                f"{how}, {l.wire_bytes:,} of {l.full_bytes:,} bytes"
            )
        return "\n".join(lines)


def report(opt_state) -> CompressionReport:
    """The wire bytes of every compression transform in opt_state (an optax
    state, a chain of them, or a train state holding one)."""
    states = [x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=_is_state) if _is_state(x)]
    if not states:
        raise ValueError(
            "jaxring.compression.report: opt_state holds no "
            "jaxring.compression state (chain wire16 or powersgd "
            "into the optimizer first)"
        )
    return CompressionReport([l for s in states for l in s.plan])
