"""What jaxring.overlap found and chose: the reductions, their names, and
the report that explain() returns."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jaxring._src.jax_compat import source_info_util
from jaxring._src.step_trace import where

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Reduction:
    """One operand of one rewritten psum equation."""

    eqn: int
    operand: int
    axes: tuple
    shape: tuple
    dtype: np.dtype
    label: str
    groups: tuple | None = None  # its axis_index_groups
    # A complex operand travels as float lanes (real, imaginary): shape and
    # dtype are then those of the lanes, shape + (2,) of the float type.
    complex_lanes: bool = False
    # Under overlap(wire_dtype=...) a float32 value travels in the wire
    # format: dtype is then the wire's, and carried the dtype it returns to.
    carried: np.dtype | None = None


def _operand_signature(jaxpr, r: Reduction) -> tuple:
    aval = jaxpr.eqns[r.eqn].invars[r.operand].aval
    return tuple(aval.shape), str(np.dtype(aval.dtype))


@dataclasses.dataclass
class BucketReport:
    index: int
    nbytes: int
    leaves: list[str]
    issued_after: str
    waited_before: str


@dataclasses.dataclass
class OverlapReport:
    """The buckets jaxring.overlap chose for one trace of a step."""

    buckets: list[BucketReport]
    left_alone: list[str]
    # Reductions of values already reduced (under check_vma), computed
    # where they are instead of sent.
    computed_locally: list[str] = dataclasses.field(default_factory=list)
    # Reductions the step needs before its gradients are ready (BatchNorm
    # statistics), left as written.
    run_at_once: list[str] = dataclasses.field(default_factory=list)

    def __str__(self):
        """The summary: buckets, bytes and values in all, and what was not
        bucketed (a step of a large model has hundreds of values)."""
        sizes = [b.nbytes / MiB for b in self.buckets]
        values = sum(len(b.leaves) for b in self.buckets)
        head = (
            f"jaxring.overlap: {len(self.buckets)} bucket(s), "
            f"{sum(sizes):.2f} MiB in all, {values} value(s)"
        )
        if sizes:
            head += f", {min(sizes):.3f}-{max(sizes):.3f} MiB per bucket"
        return "\n".join([head] + self._not_bucketed())

    def listing(self) -> str:
        """Every bucket: its size, where it is issued and waited for (with
        the source lines), and its values by pytree path."""
        lines = [
            f"jaxring.overlap: {len(self.buckets)} bucket(s), "
            f"{sum(b.nbytes for b in self.buckets) / MiB:.2f} MiB in all"
        ]
        for b in self.buckets:
            lines.append(f"  bucket {b.index}: {b.nbytes / MiB:.3f} MiB, {len(b.leaves)} value(s)")
            lines.append(f"    issued after  {b.issued_after}")
            lines.append(f"    waited before {b.waited_before}")
            for leaf in b.leaves:
                lines.append(f"      {leaf}")
        return "\n".join(lines + self._not_bucketed())

    def _not_bucketed(self) -> list[str]:
        return (
            [f"  computed locally: {why}" for why in self.computed_locally]
            + [f"  not bucketed: {why}" for why in self.run_at_once]
            + [f"  left as is: {why}" for why in self.left_alone]
        )


def label_reductions(jaxpr, reductions, args, kwargs) -> list[Reduction]:
    """Names each reduced value by the pytree path of the argument leaf it
    matches. The psums of one ``pmean(grads)`` call share a source line; when
    their operand shapes equal, in order, the leaves of an argument subtree
    (``state.params``), they get that subtree's paths. Otherwise a value is
    named by its type and producer."""
    subtrees: list[tuple[list[str], list[tuple]]] = []

    def walk(prefix, tree):
        with_path, _ = jax.tree_util.tree_flatten_with_path(tree)
        if not with_path:
            return
        paths = [prefix + jax.tree_util.keystr(p) for p, _ in with_path]
        sigs = [
            (tuple(np.shape(x)), str(getattr(x, "dtype", type(x).__name__))) for _, x in with_path
        ]
        subtrees.append((paths, sigs))
        for key, child in _children_with_keys(tree):
            walk(prefix + key, child)

    walk("args", tuple(args))
    if kwargs:
        walk("kwargs", dict(kwargs))
    subtrees.sort(key=lambda t: -len(t[0]))

    calls: dict[tuple, list[int]] = {}
    for k, r in enumerate(reductions):
        src = source_info_util.summarize(jaxpr.eqns[r.eqn].source_info)
        calls.setdefault((src, r.axes), []).append(k)
    labels: dict[int, str] = {}
    for members in calls.values():
        sigs = [_operand_signature(jaxpr, reductions[k]) for k in members]
        paths = next((p for p, sg in subtrees if sg == sigs), None)
        if paths is not None:
            labels.update(zip(members, paths))
    producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    out = []
    for k, r in enumerate(reductions):
        if k not in labels:
            v = jaxpr.eqns[r.eqn].invars[r.operand]
            prod = producers.get(v)
            origin = where(prod) if prod is not None else "an input"
            labels[k] = f"value from {origin}"
        out.append(dataclasses.replace(r, label=labels[k]))
    return out


def _children_with_keys(tree):
    try:
        children, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda t: t is not tree)
    except Exception:
        return []
    return [(jax.tree_util.keystr(p), c) for p, c in children if c is not tree]


def slot_text(jaxpr, slot: int, after: bool) -> str:
    n = len(jaxpr.eqns)
    if after:
        if slot == 0:
            return "the start of the step (its values are inputs)"
        eqn = jaxpr.eqns[slot - 1]
        return f"eqn {slot - 1}/{n}: {eqn.primitive.name} in {where(eqn)}"
    if slot >= n:
        return "the end of the step (its values are outputs)"
    eqn = jaxpr.eqns[slot]
    return f"eqn {slot}/{n}: {eqn.primitive.name} in {where(eqn)}"


def build_report(
    jaxpr, plan, reductions, left, computed_locally=(), run_at_once=()
) -> OverlapReport:
    by_key = {(r.eqn, r.operand): r for r in reductions}
    buckets = []
    for b in plan.buckets:
        leaves = []
        for it in b.items:
            r = by_key[it.key]
            part = (
                f" [elements {it.offset}:{it.offset + it.count}]"
                if it.count != math.prod(r.shape)
                else ""
            )
            leaves.append(f"{r.label}: {r.dtype}{list(r.shape)}{part}")
        buckets.append(
            BucketReport(
                b.index,
                b.nbytes,
                leaves,
                issued_after=slot_text(jaxpr, b.start_slot, after=True),
                waited_before=slot_text(jaxpr, b.done_slot, after=False),
            )
        )
    return OverlapReport(buckets, list(left), list(computed_locally), list(run_at_once))
