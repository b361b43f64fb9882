"""jaxring.overlap: bucket the gradient psums of a step and overlap them.

What it rewrites. The decorated function is traced to a jaxpr inside the
enclosing ``shard_map``/``pmap``; nested ``jit`` calls are inlined. Every
top-level ``psum``/``pmean`` (and ``jaxring.allreduce`` with ``op="sum"`` or
``"mean"``) over ``axis_name`` is rewritten, gradients and metrics alike: an
elementwise sum gives the same result whichever bucket carries it. Two kinds
stay out of the buckets: a value waited for at once whose reduction later
reduced values depend on (a BatchNorm statistic) runs where it is, as
written, and a value
already reduced (a gradient autodiff summed under ``check_vma``) is
computed locally (:mod:`jaxring._src.reduced_twice`). Reductions it cannot
rewrite stay as they are and are reported, each
time the step is traced, by an :class:`OverlapWarning` that says why: those
inside ``scan``, ``cond``, ``while``, ``remat`` or custom-derivative bodies,
those over other axes, of dtypes its buckets do not carry, or of values typed
unreduced. Complex values travel as float lanes, in the buckets of that float
type.
Reductions within ``axis_index_groups`` are bucketed with the others of the
same groups.

How. First the equations that compute the reduced values move up to just
after their inputs exist (:mod:`jaxring._src.step_order`): a gradient that an
optimizer transformation casts or projects before its psum is then ready
where the backward pass makes it, not after the whole pass. Each reduced
value is ready once the equation producing it has run and needed at its
first use. Values are grouped into buckets in the order they
become ready (see :mod:`jaxring._src.bucketing`); each bucket becomes a
split-phase allreduce whose *start* is issued right after its last value is
produced and whose *done* is placed right before its first use. The done
takes, as extra operands that it ignores, the values computed since its start
that are still needed, so the compiler cannot hoist it next to its start; the
transfer runs while the rest of the backward pass computes (see
:mod:`jaxring._src.split_phase`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxring._src import (
    arguments,
    bucketing,
    jax_compat as compat,
    reduced_twice,
    runtime,
    step_order,
    wire_format,
)
from jaxring._src.config import config, validate
from jaxring._src.dtypes import SUPPORTED_DTYPES
from jaxring._src.jax_compat import source_info_util
from jaxring._src.overlap_emit import Emitter
from jaxring._src.overlap_report import (
    MiB,
    OverlapReport,
    Reduction,
    build_report,
    label_reductions,
)
from jaxring._src.primitive import allreduce_p
from jaxring._src.step_trace import retrace_in_order, trace_step, uses, where

# Primitives whose top-level equations overlap rewrites (when their axes match).
_PSUM_NAMES = ("psum", "psum_invariant")
# lax.psum of a value typed unreduced (jax 0.12): found, to be reported as
# left where it is.
_UNREDUCED_PSUM_NAMES = ("unreduced_psum",)


class OverlapWarning(UserWarning):
    """A reduction that jaxring.overlap left as it was, and why."""


@dataclasses.dataclass(frozen=True)
class OverlapOptions:
    axis_name: Any
    bucket_mb: float
    first_bucket_mb: float
    partition_mb: float
    max_inflight_mb: float | None
    rings: int
    chunk_bytes: int
    timeout_s: float
    wire_dtype: np.dtype | None = None
    # rings is the configured default (neither passed nor set), which adapts
    # to a crowded job across processes (crowding.py).
    rings_from_default: bool = False


# ---- finding the reductions -------------------------------------------------


def _axes_of(eqn) -> tuple | None:
    """The axes an eqn sums over if it is a sum-allreduce, else None."""
    name = eqn.primitive.name
    if name in _PSUM_NAMES or name in _UNREDUCED_PSUM_NAMES:
        return tuple(eqn.params["axes"])
    if name == allreduce_p.name and eqn.params["op"] == "sum":
        return tuple(eqn.params["axes"])
    return None


def _typed_unreduced(aval) -> bool:
    """Whether aval is unreduced over any axis, manual or (in its sharding,
    jax 0.12.1's high type) not."""
    return bool(compat.unreduced_axes(aval)) or bool(getattr(aval, "is_high", False))


def _matches(axes: tuple, want: tuple | None) -> bool:
    named = tuple(a for a in axes if not isinstance(a, int))
    if want is None:
        return bool(named) and len(named) == len(axes)
    return set(axes) == set(want)


def _nested_reductions(jaxpr, want) -> bool:
    for eqn in jaxpr.eqns:
        axes = _axes_of(eqn)
        if axes is not None and _matches(axes, want):
            return True
        for sub in compat.jaxprs_in_params(eqn.params):
            if _nested_reductions(sub, want):
                return True
    return False


def _find_reductions(jaxpr, want, wire=None) -> tuple[list[Reduction], list[str]]:
    found, left = [], []
    for i, eqn in enumerate(jaxpr.eqns):
        axes = _axes_of(eqn)
        if axes is None:
            if any(_nested_reductions(sub, want) for sub in compat.jaxprs_in_params(eqn.params)):
                left.append(
                    f"a psum over {_axes_text(want)} inside "
                    f"`{eqn.primitive.name}` ({where(eqn)}): overlap rewrites "
                    "only reductions at the top level of the step, so it runs "
                    "where it is, without overlap"
                )
            continue
        if not _matches(axes, want):
            if want is not None and set(axes) & set(want):
                left.append(
                    f"{eqn.primitive.name} over {axes} ({where(eqn)}): "
                    f"overlap(axis_name={want!r}) rewrites reductions over "
                    "exactly those axes"
                )
            continue
        if eqn.params.get("unreduced") or any(
            _typed_unreduced(v.aval) for v in eqn.invars if not isinstance(v, compat.Literal)
        ):
            # Over the summed axes or others: a bucket is one buffer of one
            # type, and a split-phase start takes varying values only.
            left.append(
                f"a sum of a value typed unreduced ({where(eqn)}): "
                "jaxring.overlap's buckets do not carry unreduced values"
            )
            continue
        bad = [
            v
            for v in eqn.invars
            if isinstance(v, compat.Literal)
            or _lanes_of(np.dtype(v.aval.dtype)) not in SUPPORTED_DTYPES
        ]
        if bad:
            left.append(
                f"{eqn.primitive.name} of "
                f"{', '.join(str(v.aval) for v in bad)} ({where(eqn)}): "
                "jaxring.overlap does not bucket constants or this dtype"
            )
            continue
        groups = eqn.params.get("axis_index_groups", eqn.params.get("groups"))
        for j, v in enumerate(eqn.invars):
            dtype = np.dtype(v.aval.dtype)
            lanes = dtype.kind == "c"
            carried = _lanes_of(dtype)
            travels = wire_format.travels_as(carried, wire)
            found.append(
                Reduction(
                    i,
                    j,
                    axes,
                    tuple(v.aval.shape) + ((2,) if lanes else ()),
                    travels,
                    label="",
                    groups=None if groups is None else tuple(map(tuple, groups)),
                    complex_lanes=lanes,
                    carried=None if travels == carried else carried,
                )
            )
    return found, left


def _lanes_of(dtype: np.dtype) -> np.dtype:
    """The dtype a value travels in: a complex one as float lanes (a sum of
    complex numbers is the sum of their parts), any other as it is."""
    if dtype.kind == "c":
        return np.dtype(np.float32 if dtype == np.complex64 else np.float64)
    return dtype


def _axes_text(want) -> str:
    return "the mapped axes" if want is None else repr(want)


# ---- planning ---------------------------------------------------------------

# A reduction whose result is used within this many equations of its value
# being produced is waited for at once. Measured: a synchronized BatchNorm
# statistic or cotangent sum is used by the next equation; PowerSGD's P
# factors, whose Q depends on them too, 7 or more equations later.
URGENT_WITHIN_EQNS = 4


def _split_urgent(jaxpr, reductions):
    """(the reductions to bucket, the psum equations to leave as written).

    A reduction that is waited for within a few equations and whose result
    later reduced values depend on (a synchronized BatchNorm statistic in
    the forward pass, its cotangent's sum in the backward pass) is on the
    critical path: in a bucket it would wait for the gradients beside it,
    and as a bucket of its own it gains nothing from the split phase, whose
    start and done then sit side by side. So it runs where it is, as written
    (ByteScheduler's lesson: the urgent transfer first, alone). Gradients,
    whose results only the optimizer reads, and metrics are bucketed; so are
    values used soon that nothing reduced later depends on (the last
    gradients of a backward pass)."""
    eqns = sorted({r.eqn for r in reductions})
    bit = {e: 1 << k for k, e in enumerate(eqns)}
    depends: dict = {}  # var -> bits of the reductions its value depends on
    feeds = 0  # bits of the reductions some reduction's input depends on
    for i, eqn in enumerate(jaxpr.eqns):
        dep = 0
        for v in eqn.invars:
            if isinstance(v, compat.Var):
                dep |= depends.get(v, 0)
        if i in bit:
            feeds |= dep
            dep |= bit[i]
        if dep:
            for v in eqn.outvars:
                depends[v] = dep
    producer_index = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
    first_use, _ = uses(jaxpr)
    n = len(jaxpr.eqns)
    urgent = set()
    for r in reductions:
        eqn = jaxpr.eqns[r.eqn]
        ready = producer_index.get(eqn.invars[r.operand], -1) + 1
        needed = first_use.get(eqn.outvars[r.operand], n)
        if feeds & bit[r.eqn] and needed - ready <= URGENT_WITHIN_EQNS:
            urgent.add(r.eqn)
    return [r for r in reductions if r.eqn not in urgent], urgent


def _urgent_text(jaxpr, urgent: set) -> list[str]:
    if not urgent:
        return []
    sources = sorted({source_info_util.summarize(jaxpr.eqns[i].source_info) for i in urgent})
    shown = ", ".join(sources[:3]) + (f" and {len(sources) - 3} more" if len(sources) > 3 else "")
    return [
        f"{len(urgent)} reduction(s) waited for at once, whose results "
        f"later reduced values depend on (at {shown}): run where they are, "
        "as written, outside the buckets"
    ]


def _plan(jaxpr, reductions, opts):
    producer_index = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
    rewritten = {r.eqn for r in reductions}
    first_use, _ = uses(jaxpr)
    n = len(jaxpr.eqns)
    items = []
    for r in reductions:
        eqn = jaxpr.eqns[r.eqn]
        var_in, var_out = eqn.invars[r.operand], eqn.outvars[r.operand]
        producer = producer_index.get(var_in, -1)
        if producer in rewritten:
            # The result of another rewritten psum exists only once its
            # bucket is done, which is by that value's first use.
            ready = first_use[var_in] + 1
        else:
            ready = producer + 1
        needed = first_use.get(var_out, n)
        whole = bucketing.Item(
            key=(r.eqn, r.operand),
            dtype=r.dtype,
            nbytes=math.prod(r.shape) * r.dtype.itemsize,
            ready=ready,
            needed=needed,
        )
        items += bucketing.split_item(whole, r.dtype.itemsize, int(opts.partition_mb * MiB))
    inflight = None if opts.max_inflight_mb is None else int(opts.max_inflight_mb * MiB)
    return bucketing.plan_buckets(
        items,
        first_bucket_bytes=int(opts.first_bucket_mb * MiB),
        bucket_bytes=int(opts.bucket_mb * MiB),
        max_inflight_bytes=inflight,
    )


# ---- the decorator ----------------------------------------------------------


def _rewrite(fn, opts: OverlapOptions, args, kwargs, *, report: bool):
    runtime.register_ffi_targets()
    want = None if opts.axis_name is None else arguments.axes_tuple(opts.axis_name)
    if want is not None:
        arguments.check_bound(want, overlap_axis_name=opts.axis_name)
    closed, dyn_vals, out_tree = trace_step(fn, args, kwargs)
    twice = reduced_twice.find(closed.jaxpr, lambda axes: _matches(axes, want))
    made_local = []
    if twice:
        made_local = _reduced_twice_texts(closed.jaxpr, twice, args, kwargs)
        closed = reduced_twice.made_local(closed, twice, dyn_vals)
    reductions, _ = _find_reductions(closed.jaxpr, want, opts.wire_dtype)
    order = step_order.hoisted_order(closed.jaxpr, {r.eqn for r in reductions})
    if order != sorted(order):
        closed = retrace_in_order(closed, order, dyn_vals)
    jaxpr = closed.jaxpr
    reductions, left = _find_reductions(jaxpr, want, opts.wire_dtype)
    reductions = label_reductions(jaxpr, reductions, args, kwargs)
    reductions, urgent = _split_urgent(jaxpr, reductions)
    if not reductions and not urgent:
        left = left + [
            f"no psum over {_axes_text(want)} at the top level of "
            f"{getattr(fn, '__name__', 'the step')}: nothing to overlap"
        ]
    plan = _plan(jaxpr, reductions, opts)
    rep = build_report(jaxpr, plan, reductions, left, made_local, _urgent_text(jaxpr, urgent))
    for why in made_local + left:
        warnings.warn(f"jaxring.overlap: {why}", OverlapWarning, stacklevel=4)
    if report:
        print(rep.listing() if report == "full" else rep)
    outs = Emitter(jaxpr, closed.consts, dyn_vals, plan, reductions, opts).run()
    return jax.tree_util.tree_unflatten(out_tree, outs), rep


def _reduced_twice_texts(jaxpr, twice, args, kwargs) -> list[str]:
    """One warning text per call (source line) that reduces values already
    reduced, naming them by their pytree paths."""
    as_reductions = []
    for r in twice:
        aval = jaxpr.eqns[r.eqn].invars[r.operand].aval
        as_reductions.append(
            Reduction(r.eqn, r.operand, r.axes, tuple(aval.shape), np.dtype(aval.dtype), label="")
        )
    by_call: dict[tuple, list[str]] = {}
    for r in label_reductions(jaxpr, as_reductions, args, kwargs):
        source = source_info_util.summarize(jaxpr.eqns[r.eqn].source_info)
        by_call.setdefault((source, r.axes), []).append(r.label)
    return [
        reduced_twice.warning_text(
            labels, source, axes, math.prod(compat.axis_size(a) for a in axes)
        )
        for (source, axes), labels in by_call.items()
    ]


def _options(
    axis_name,
    bucket_mb,
    first_bucket_mb,
    partition_mb,
    max_inflight_mb,
    rings,
    chunk_bytes,
    timeout_s,
    wire_dtype=None,
) -> OverlapOptions:
    where = "jaxring.overlap"
    for name, v in (
        ("bucket_mb", bucket_mb),
        ("first_bucket_mb", first_bucket_mb),
        ("partition_mb", partition_mb),
    ):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise ValueError(f"{where}: {name} must be a positive number, got {v!r}")
    if max_inflight_mb is not None and (
        not isinstance(max_inflight_mb, (int, float)) or not max_inflight_mb > 0
    ):
        raise ValueError(
            f"{where}: max_inflight_mb must be a positive number or None, got {max_inflight_mb!r}"
        )
    if axis_name is not None:
        arguments.axes_tuple(axis_name)
    return OverlapOptions(
        axis_name=axis_name,
        bucket_mb=float(bucket_mb),
        first_bucket_mb=float(first_bucket_mb),
        partition_mb=float(partition_mb),
        max_inflight_mb=None if max_inflight_mb is None else float(max_inflight_mb),
        rings=validate("rings", config.rings if rings is None else rings, where),
        chunk_bytes=validate(
            "chunk_bytes", config.chunk_bytes if chunk_bytes is None else chunk_bytes, where
        ),
        timeout_s=validate(
            "timeout_s", config.timeout_s if timeout_s is None else timeout_s, where
        ),
        wire_dtype=wire_format.wire_dtype_of(wire_dtype, where),
        rings_from_default=rings is None and not config.is_explicit("rings"),
    )


DEFAULT_BUCKET_MB = 1.0
DEFAULT_FIRST_BUCKET_MB = 0.25
DEFAULT_MAX_INFLIGHT_MB = 256.0
# Cutting a value costs a copy of it into its parts and one back out: on a
# ResNet-18 step parts of 1 MiB made overlap slower than the plain step,
# whole values up to 64 MiB did not (benchmarks/results/overlap_history.md).
DEFAULT_PARTITION_MB = 64.0


def overlap(
    fn: Callable | None = None,
    *,
    axis_name=None,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    first_bucket_mb: float = DEFAULT_FIRST_BUCKET_MB,
    partition_mb: float | None = None,
    max_inflight_mb: float | None = DEFAULT_MAX_INFLIGHT_MB,
    rings: int | None = None,
    chunk_bytes: int | None = None,
    timeout_s: float | None = None,
    report: bool = False,
    wire_dtype: Any = None,
):
    """Overlaps a step's psums with the computation that follows them.

    Use inside ``jax.shard_map`` or ``jax.pmap``, on a function written with
    ``lax.psum``/``lax.pmean`` (or ``jaxring.allreduce``)::

        @jax.jit
        @functools.partial(jax.shard_map, mesh=mesh, in_specs=..., out_specs=...)
        @jaxring.overlap(axis_name="batch")
        def train_step(params, batch): ...

    The step computes the same values; its reductions over ``axis_name`` run
    as bucketed jaxring allreduces, each started as soon as its values exist
    and waited for where they are first used.

    Args:
      fn: the step (``@jaxring.overlap`` also works bare).
      axis_name: the mapped axis (or tuple of axes) whose reductions to
        rewrite; ``None`` rewrites reductions over any mapped axes.
      bucket_mb: bucket size cap in MiB.
      first_bucket_mb: cap of the first bucket, smaller so that communication
        starts early.
      partition_mb: values larger than this are split into parts of this size
        that may travel in different buckets (default: the larger of
        ``bucket_mb`` and 64: the parts' copies cost more than they save
        on a CPU step, see docs/overlap.md).
      max_inflight_mb: credit window: at most this many MiB of buckets in
        flight; ``None`` for no bound.
      rings, chunk_bytes, timeout_s: as for :func:`jaxring.allreduce`.
      report: each time the step is traced, print a summary of the buckets
        chosen (``True``) or every bucket with its values and placement
        (``"full"``); :func:`jaxring.explain` returns the same as a value.
      wire_dtype: ``None``, ``"bfloat16"`` or ``"float16"``: every float32
        value the buckets carry (metrics too) travels in that format, as
        with :func:`jaxring.allreduce`'s ``wire_dtype``.
    """
    if report not in (False, True, "full"):
        raise ValueError(f"jaxring.overlap: report must be False, True or 'full', got {report!r}")
    if fn is None:
        return functools.partial(
            overlap,
            axis_name=axis_name,
            bucket_mb=bucket_mb,
            first_bucket_mb=first_bucket_mb,
            partition_mb=partition_mb,
            max_inflight_mb=max_inflight_mb,
            rings=rings,
            chunk_bytes=chunk_bytes,
            timeout_s=timeout_s,
            report=report,
            wire_dtype=wire_dtype,
        )
    if not callable(fn):
        raise TypeError(
            f"jaxring.overlap decorates a function, got {fn!r}; "
            "did you mean overlap(axis_name=...)?"
        )
    opts = _options(
        axis_name,
        bucket_mb,
        first_bucket_mb,
        (max(bucket_mb, DEFAULT_PARTITION_MB) if partition_mb is None else partition_mb),
        max_inflight_mb,
        rings,
        chunk_bytes,
        timeout_s,
        wire_dtype,
    )

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        out, _ = _rewrite(fn, opts, args, kwargs, report=report)
        return out

    wrapped.jaxring_overlap_options = opts
    wrapped.jaxring_wrapped = fn
    return wrapped


def explain(step: Callable, *args, **kwargs) -> OverlapReport:
    """The buckets ``step`` (decorated with :func:`overlap`) would use for args.

    Call it where the step runs: inside the ``shard_map``/``pmap`` body, or
    through ``jax.eval_shape`` of the mapped function.
    """
    opts = getattr(step, "jaxring_overlap_options", None)
    if opts is None:
        raise TypeError("jaxring.explain takes a function decorated with jaxring.overlap")
    holder = {}

    def traced(*a, **k):
        out, holder["report"] = _rewrite(step.jaxring_wrapped, opts, a, k, report=False)
        return out

    jax.make_jaxpr(traced)(*args, **kwargs)
    return holder["report"]
