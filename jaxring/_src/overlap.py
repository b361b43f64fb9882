"""jaxring.overlap: bucket the gradient psums of a step and overlap them.

What it rewrites. The decorated function is traced to a jaxpr inside the
enclosing ``shard_map``/``pmap``; nested ``jit`` calls are inlined. Every
top-level ``psum``/``pmean`` (and ``jaxring.allreduce`` with ``op="sum"`` or
``"mean"``) over ``axis_name`` is rewritten, gradients and metrics alike: an
elementwise sum gives the same result whichever bucket carries it, and a value
needed early (a BatchNorm statistic) gets a bucket that is done before its
first use. Reductions it cannot rewrite stay as they are and are reported, each
time the step is traced, by an :class:`OverlapWarning` that says why: those inside ``scan``, ``cond``,
``while``, ``remat`` or custom-derivative bodies, those with
``axis_index_groups``, over other axes, or of dtypes jaxring does not reduce.

How. Each reduced value is ready once the equation producing it has run and
needed at its first use. Values are grouped into buckets in the order they
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
from typing import Any, Callable

import jax
import numpy as np
from jax._src import core, source_info_util
from jax.sharding import NamedSharding, PartitionSpec

from jaxring._src import allreduce as _ar
from jaxring._src import bucketing, runtime, split_phase
from jaxring._src.config import config, validate

MiB = 1 << 20

# Primitives whose top-level equations overlap rewrites (when their axes match).
_PSUM_NAMES = ("psum", "psum_invariant")
_JIT_NAMES = ("jit", "pjit")


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


# ---- what overlap found and chose ------------------------------------------

@dataclasses.dataclass(frozen=True)
class Reduction:
    """One operand of one rewritten psum equation."""
    eqn: int
    operand: int
    axes: tuple
    shape: tuple
    dtype: np.dtype
    label: str


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

    def __str__(self):
        lines = [f"jaxring.overlap: {len(self.buckets)} bucket(s), "
                 f"{sum(b.nbytes for b in self.buckets) / MiB:.2f} MiB in all"]
        for b in self.buckets:
            lines.append(f"  bucket {b.index}: {b.nbytes / MiB:.3f} MiB, "
                         f"{len(b.leaves)} value(s)")
            lines.append(f"    issued after  {b.issued_after}")
            lines.append(f"    waited before {b.waited_before}")
            for leaf in b.leaves:
                lines.append(f"      {leaf}")
        for why in self.left_alone:
            lines.append(f"  left as is: {why}")
        return "\n".join(lines)


# ---- tracing ----------------------------------------------------------------

def _is_array_like(x) -> bool:
    # Python scalars stay static, as under jit's static arguments: a flag
    # such as train=True must stay usable in Python control flow.
    return isinstance(x, (jax.Array, core.Tracer, np.ndarray, np.generic))


def _trace(fn, args, kwargs):
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
    inlined = jax.make_jaxpr(
        lambda *a: _eval_inlining_jit(closed.jaxpr, closed.consts, a))(*dyn_vals)
    return inlined, dyn_vals, out_tree


def _bind_params(eqn):
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # older jax: (subfuns, params)
        subfuns, params = params
        return list(subfuns), params
    return [], params


def _bind(eqn, invals):
    subfuns, params = _bind_params(eqn)
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback,
                                       name_stack=name_stack), eqn.ctx.manager:
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _read(env, v):
    return v.val if isinstance(v, core.Literal) else env[v]


def _eval_inlining_jit(jaxpr, consts, args):
    env: dict = {}
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [_read(env, v) for v in eqn.invars]
        if eqn.primitive.name in _JIT_NAMES and "jaxpr" in eqn.params:
            inner = eqn.params["jaxpr"]
            outs = _eval_inlining_jit(inner.jaxpr, inner.consts, invals)
        else:
            outs = _bind(eqn, invals)
        env.update(zip(eqn.outvars, outs))
    return [_read(env, v) for v in jaxpr.outvars]


# ---- finding the reductions -------------------------------------------------

def _axes_of(eqn) -> tuple | None:
    """The axes an eqn sums over if it is a sum-allreduce, else None."""
    name = eqn.primitive.name
    if name in _PSUM_NAMES:
        return tuple(eqn.params["axes"])
    if name == _ar.allreduce_p.name and eqn.params["op"] == "sum":
        return tuple(eqn.params["axes"])
    return None


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
        for sub in core.jaxprs_in_params(eqn.params):
            if _nested_reductions(sub, want):
                return True
    return False


def _find_reductions(jaxpr, want) -> tuple[list[Reduction], list[str]]:
    found, left = [], []
    for i, eqn in enumerate(jaxpr.eqns):
        axes = _axes_of(eqn)
        if axes is None:
            if any(_nested_reductions(sub, want)
                   for sub in core.jaxprs_in_params(eqn.params)):
                left.append(
                    f"a psum over {_axes_text(want)} inside "
                    f"`{eqn.primitive.name}` ({_where(eqn)}): overlap rewrites "
                    "only reductions at the top level of the step, so it runs "
                    "where it is, without overlap")
            continue
        if not _matches(axes, want):
            if want is not None and set(axes) & set(want):
                left.append(f"{eqn.primitive.name} over {axes} ({_where(eqn)}): "
                            f"overlap(axis_name={want!r}) rewrites reductions over "
                            "exactly those axes")
            continue
        if eqn.params.get("axis_index_groups") is not None:
            left.append(f"{eqn.primitive.name} with axis_index_groups "
                        f"({_where(eqn)}): not supported by jaxring")
            continue
        bad = [v for v in eqn.invars
               if isinstance(v, core.Literal)
               or np.dtype(v.aval.dtype) not in _ar.SUPPORTED_DTYPES]
        if bad:
            left.append(f"{eqn.primitive.name} of "
                        f"{', '.join(str(v.aval) for v in bad)} ({_where(eqn)}): "
                        "jaxring does not reduce constants or this dtype")
            continue
        for j, v in enumerate(eqn.invars):
            found.append(Reduction(i, j, axes, tuple(v.aval.shape),
                                   np.dtype(v.aval.dtype), label=""))
    return found, left


def _axes_text(want) -> str:
    return "the mapped axes" if want is None else repr(want)


def _where(eqn) -> str:
    stack = str(eqn.source_info.name_stack)
    src = source_info_util.summarize(eqn.source_info)
    return f"{stack} at {src}" if stack else src


def _label(jaxpr, reductions, args, kwargs) -> list[Reduction]:
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
        sigs = [(tuple(np.shape(x)), str(getattr(x, "dtype", type(x).__name__)))
                for _, x in with_path]
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
        sigs = [(reductions[k].shape, str(reductions[k].dtype)) for k in members]
        paths = next((p for p, sg in subtrees if sg == sigs), None)
        if paths is not None:
            labels.update(zip(members, paths))
    producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    out = []
    for k, r in enumerate(reductions):
        if k not in labels:
            v = jaxpr.eqns[r.eqn].invars[r.operand]
            prod = producers.get(v)
            origin = _where(prod) if prod is not None else "an input"
            labels[k] = f"value from {origin}"
        out.append(dataclasses.replace(r, label=labels[k]))
    return out


def _children_with_keys(tree):
    try:
        children, _ = jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda t: t is not tree)
    except Exception:  # noqa: BLE001 (a leaf with odd flattening)
        return []
    return [(jax.tree_util.keystr(p), c) for p, c in children if c is not tree]


# ---- planning ---------------------------------------------------------------

def _uses(jaxpr):
    """first_use[v] and last_use[v] as equation indices (len(eqns) = output)."""
    n = len(jaxpr.eqns)
    first, last = {}, {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, core.Var):
                first.setdefault(v, i)
                last[v] = i
    for v in jaxpr.outvars:
        if isinstance(v, core.Var):
            first.setdefault(v, n)
            last[v] = n
    return first, last


def _plan(jaxpr, reductions, opts):
    producer_index = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
    rewritten = {r.eqn for r in reductions}
    first_use, _ = _uses(jaxpr)
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
        whole = bucketing.Item(key=(r.eqn, r.operand), dtype=r.dtype,
                               nbytes=math.prod(r.shape) * r.dtype.itemsize,
                               ready=ready, needed=needed)
        items += bucketing.split_item(whole, r.dtype.itemsize,
                                      int(opts.partition_mb * MiB))
    inflight = (None if opts.max_inflight_mb is None
                else int(opts.max_inflight_mb * MiB))
    return bucketing.plan_buckets(
        items, first_bucket_bytes=int(opts.first_bucket_mb * MiB),
        bucket_bytes=int(opts.bucket_mb * MiB), max_inflight_bytes=inflight)


def _slot_text(jaxpr, slot: int, after: bool) -> str:
    n = len(jaxpr.eqns)
    if after:
        if slot == 0:
            return "the start of the step (its values are inputs)"
        eqn = jaxpr.eqns[slot - 1]
        return f"eqn {slot - 1}/{n}: {eqn.primitive.name} in {_where(eqn)}"
    if slot >= n:
        return "the end of the step (its values are outputs)"
    eqn = jaxpr.eqns[slot]
    return f"eqn {slot}/{n}: {eqn.primitive.name} in {_where(eqn)}"


def _report(jaxpr, plan, reductions, left) -> OverlapReport:
    by_key = {(r.eqn, r.operand): r for r in reductions}
    buckets = []
    for b in plan.buckets:
        leaves = []
        for it in b.items:
            r = by_key[it.key]
            part = (f" [elements {it.offset}:{it.offset + it.count}]"
                    if it.count != math.prod(r.shape) else "")
            leaves.append(f"{r.label}: {r.dtype}{list(r.shape)}{part}")
        buckets.append(BucketReport(
            b.index, b.nbytes, leaves,
            issued_after=_slot_text(jaxpr, b.start_slot, after=True),
            waited_before=_slot_text(jaxpr, b.done_slot, after=False)))
    return OverlapReport(buckets, list(left))


# ---- emitting the rewritten step -------------------------------------------

def _vector_aval(aval, count: int):
    """aval reshaped to a vector of count elements, keeping its varying axes."""
    mesh = aval.sharding.mesh
    return aval.update(shape=(count,),
                       sharding=NamedSharding(mesh, PartitionSpec(None)))


class _Emitter:
    """Evaluates the jaxpr in the caller's trace, emitting starts and dones
    at the slots the plan chose."""

    def __init__(self, jaxpr, consts, args, plan, reductions, opts):
        self.jaxpr = jaxpr
        self.plan = plan
        self.opts = opts
        self.env: dict = {}
        self.env.update(zip(jaxpr.constvars, consts))
        self.env.update(zip(jaxpr.invars, args))
        _, self.last_use = _uses(jaxpr)
        self.red = {(r.eqn, r.operand): r for r in reductions}
        self.rewritten = {r.eqn for r in reductions}
        # Parts of split values, collected until all have arrived.
        self.parts_total: dict = {}
        for b in plan.buckets:
            for it in b.items:
                self.parts_total[it.key] = self.parts_total.get(it.key, 0) + 1
        self.parts: dict = {}
        self.produced_at: dict = {}  # var -> index of the eqn that made it
        self.unstarted_uses: dict = {}
        for r in reductions:
            v = jaxpr.eqns[r.eqn].invars[r.operand]
            self.unstarted_uses[v] = self.unstarted_uses.get(v, 0) + self.parts_total[(r.eqn, r.operand)]
        self.started: dict[int, list] = {}   # bucket -> [(handle, pair, items, avals)]
        self.results: dict[int, list] = {}   # bucket -> done outputs (for the window)

    def run(self):
        n = len(self.jaxpr.eqns)
        for s in range(n + 1):
            self._actions(s)
            if s == n:
                break
            eqn = self.jaxpr.eqns[s]
            if s not in self.rewritten:  # a rewritten one's outputs come from dones
                outs = _bind(eqn, [_read(self.env, v) for v in eqn.invars])
                self.env.update(zip(eqn.outvars, outs))
                for v in eqn.outvars:
                    self.produced_at[v] = s
            self._drop_dead(s)
        return [_read(self.env, v) for v in self.jaxpr.outvars]

    def _drop_dead(self, s):
        """Forgets values no later equation uses (outputs nobody reads too),
        so that dones do not take them as dependencies."""
        eqn = self.jaxpr.eqns[s]
        for v in list(eqn.invars) + list(eqn.outvars):
            if (isinstance(v, core.Var) and self.last_use.get(v, -1) <= s
                    and not self._pending_operand(v)):
                self.env.pop(v, None)

    def _pending_operand(self, v) -> bool:
        # An operand of a rewritten psum stays until its bucket has started.
        return self.unstarted_uses.get(v, 0) > 0

    def _frontier(self, bucket):
        """Values computed since the bucket started that are still needed:
        a done that takes them cannot run before the backward computation
        that produced them."""
        since = bucket.start_slot
        return [self.env[v] for v in self.env
                if self.produced_at.get(v, -1) >= since]

    def _actions(self, s):
        for kind, b in self.plan.actions.get(s, []):
            # Name each call after its bucket, under the scope of the
            # equation it follows (a start) or precedes (a done), so that
            # profiles and HLO dumps show where it sits.
            n = len(self.jaxpr.eqns)
            near = s - 1 if kind == "start" else s
            stack = source_info_util.current_name_stack()
            if 0 <= near < n:
                stack = stack + self.jaxpr.eqns[near].source_info.name_stack
            with source_info_util.user_context(
                    None, name_stack=stack.extend(f"jaxring_bucket{b}")):
                if kind == "start":
                    self._start(b)
                else:
                    self._done(b)

    def _operand(self, it):
        eqn = self.jaxpr.eqns[it.key[0]]
        x = _read(self.env, eqn.invars[it.key[1]])
        aval = eqn.outvars[it.key[1]].aval
        r = self.red[it.key]
        if it.count == math.prod(r.shape):
            return x, aval
        flat = jax.numpy.ravel(x)
        return (jax.lax.slice(flat, (it.offset,), (it.offset + it.count,)),
                _vector_aval(aval, it.count))

    def _start(self, b):
        bucket = self.plan.buckets[b]
        groups: dict = {}
        for it in bucket.items:
            r = self.red[it.key]
            groups.setdefault((r.axes, r.dtype), []).append(it)
        # The credit window: this start may only run once the buckets it
        # depends on are done.
        waited = [v for w in bucket.depends_on for v in self.results[w]]
        started = []
        for (axes, _), items in groups.items():
            operands, avals = zip(*(self._operand(it) for it in items))
            handle, pair = split_phase.start(
                list(operands), deps=waited, axes=axes, op="sum",
                label=f"bucket {b}", rings=self.opts.rings,
                chunk_bytes=self.opts.chunk_bytes, timeout_s=self.opts.timeout_s)
            started.append((handle, pair, items, avals))
        for it in bucket.items:
            v = self.jaxpr.eqns[it.key[0]].invars[it.key[1]]
            self.unstarted_uses[v] -= 1
        self.started[b] = started

    def _done(self, b):
        deps = self._frontier(self.plan.buckets[b])
        outs_all = []
        for handle, pair, items, avals in self.started[b]:
            outs = split_phase.done(handle, pair, avals, deps=deps)
            outs_all += outs
            for it, out in zip(items, outs):
                self._deliver(it, out)
        self.results[b] = outs_all

    def _deliver(self, it, value):
        eqn = self.jaxpr.eqns[it.key[0]]
        var_out = eqn.outvars[it.key[1]]
        if self.parts_total[it.key] == 1:
            self.env[var_out] = value
            return
        got = self.parts.setdefault(it.key, {})
        got[it.part] = value
        if len(got) == self.parts_total[it.key]:
            flat = jax.numpy.concatenate([got[p] for p in sorted(got)])
            self.env[var_out] = flat.reshape(var_out.aval.shape)


# ---- the decorator ----------------------------------------------------------

def _rewrite(fn, opts: OverlapOptions, args, kwargs, *, report: bool):
    runtime.register_ffi_targets()
    want = None if opts.axis_name is None else _ar._axes_tuple(opts.axis_name)
    if want is not None:
        _ar._check_bound(want)
    closed, dyn_vals, out_tree = _trace(fn, args, kwargs)
    jaxpr = closed.jaxpr
    reductions, left = _find_reductions(jaxpr, want)
    reductions = _label(jaxpr, reductions, args, kwargs)
    if not reductions:
        left = left + [f"no psum over {_axes_text(want)} at the top level of "
                       f"{getattr(fn, '__name__', 'the step')}: nothing to overlap"]
    plan = _plan(jaxpr, reductions, opts)
    rep = _report(jaxpr, plan, reductions, left)
    for why in left:
        warnings.warn(f"jaxring.overlap: {why}", OverlapWarning, stacklevel=4)
    if report:
        print(rep)
    outs = _Emitter(jaxpr, closed.consts, dyn_vals, plan, reductions, opts).run()
    return jax.tree_util.tree_unflatten(out_tree, outs), rep


def _options(axis_name, bucket_mb, first_bucket_mb, partition_mb,
             max_inflight_mb, rings, chunk_bytes, timeout_s) -> OverlapOptions:
    where = "jaxring.overlap"
    for name, v in (("bucket_mb", bucket_mb), ("first_bucket_mb", first_bucket_mb),
                    ("partition_mb", partition_mb)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise ValueError(f"{where}: {name} must be a positive number, got {v!r}")
    if max_inflight_mb is not None and (
            not isinstance(max_inflight_mb, (int, float)) or not max_inflight_mb > 0):
        raise ValueError(f"{where}: max_inflight_mb must be a positive number "
                         f"or None, got {max_inflight_mb!r}")
    if axis_name is not None:
        _ar._axes_tuple(axis_name)
    return OverlapOptions(
        axis_name=axis_name, bucket_mb=float(bucket_mb),
        first_bucket_mb=float(first_bucket_mb), partition_mb=float(partition_mb),
        max_inflight_mb=None if max_inflight_mb is None else float(max_inflight_mb),
        rings=validate("rings", config.rings if rings is None else rings, where),
        chunk_bytes=validate("chunk_bytes",
                             config.chunk_bytes if chunk_bytes is None else chunk_bytes,
                             where),
        timeout_s=validate("timeout_s",
                           config.timeout_s if timeout_s is None else timeout_s, where))


DEFAULT_BUCKET_MB = 1.0
DEFAULT_FIRST_BUCKET_MB = 0.25
DEFAULT_MAX_INFLIGHT_MB = 256.0


def overlap(fn: Callable | None = None, *, axis_name=None,
            bucket_mb: float = DEFAULT_BUCKET_MB,
            first_bucket_mb: float = DEFAULT_FIRST_BUCKET_MB,
            partition_mb: float | None = None,
            max_inflight_mb: float | None = DEFAULT_MAX_INFLIGHT_MB,
            rings: int | None = None, chunk_bytes: int | None = None,
            timeout_s: float | None = None, report: bool = False):
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
        that may travel in different buckets (default: ``bucket_mb``).
      max_inflight_mb: credit window: at most this many MiB of buckets in
        flight; ``None`` for no bound.
      rings, chunk_bytes, timeout_s: as for :func:`jaxring.allreduce`.
      report: print the buckets chosen each time the step is traced (see
        :func:`jaxring.explain` for the same as a value).
    """
    if fn is None:
        return functools.partial(
            overlap, axis_name=axis_name, bucket_mb=bucket_mb,
            first_bucket_mb=first_bucket_mb, partition_mb=partition_mb,
            max_inflight_mb=max_inflight_mb, rings=rings,
            chunk_bytes=chunk_bytes, timeout_s=timeout_s, report=report)
    if not callable(fn):
        raise TypeError(f"jaxring.overlap decorates a function, got {fn!r}; "
                        "did you mean overlap(axis_name=...)?")
    opts = _options(axis_name, bucket_mb, first_bucket_mb,
                    bucket_mb if partition_mb is None else partition_mb,
                    max_inflight_mb, rings, chunk_bytes, timeout_s)

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
        raise TypeError("jaxring.explain takes a function decorated with "
                        "jaxring.overlap")
    holder = {}

    def traced(*a, **k):
        out, holder["report"] = _rewrite(step.jaxring_wrapped, opts, a, k,
                                         report=False)
        return out

    jax.make_jaxpr(traced)(*args, **kwargs)
    return holder["report"]
