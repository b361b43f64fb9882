"""Re-emitting a step with its reductions as bucketed split-phase allreduces.

The Emitter evaluates the step's jaxpr in the caller's trace, equation by
equation, and at each slot the plan names it emits the bucket starts and
dones (see :mod:`jaxring._src.bucketing` for slots and actions).
"""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxring._src import jax_compat as compat, split_phase
from jaxring._src.jax_compat import source_info_util
from jaxring._src.step_trace import bind_eqn, read_atom, uses


def _vector_aval(aval, count: int):
    """aval reshaped to a vector of count elements, keeping its varying axes."""
    mesh = aval.sharding.mesh
    return aval.update(shape=(count,), sharding=NamedSharding(mesh, PartitionSpec(None)))


class Emitter:
    """Evaluates the jaxpr in the caller's trace, emitting starts and dones
    at the slots the plan chose."""

    def __init__(self, jaxpr, consts, args, plan, reductions, opts):
        self.jaxpr = jaxpr
        self.plan = plan
        self.opts = opts
        self.env: dict = {}
        self.env.update(zip(jaxpr.constvars, consts))
        self.env.update(zip(jaxpr.invars, args))
        _, self.last_use = uses(jaxpr)
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
            parts = self.parts_total[(r.eqn, r.operand)]
            self.unstarted_uses[v] = self.unstarted_uses.get(v, 0) + parts
        self.started: dict[int, list] = {}  # bucket -> [(handle, items, avals)]
        self.results: dict[int, list] = {}  # bucket -> done outputs (for the window)

    def run(self):
        n = len(self.jaxpr.eqns)
        for s in range(n + 1):
            self._actions(s)
            if s == n:
                break
            eqn = self.jaxpr.eqns[s]
            if s not in self.rewritten:  # a rewritten one's outputs come from dones
                outs = bind_eqn(eqn, [read_atom(self.env, v) for v in eqn.invars])
                self.env.update(zip(eqn.outvars, outs))
                for v in eqn.outvars:
                    self.produced_at[v] = s
            self._drop_dead(s)
        return [read_atom(self.env, v) for v in self.jaxpr.outvars]

    def _drop_dead(self, s):
        """Forgets values no later equation uses (outputs nobody reads too),
        so that dones do not take them as dependencies."""
        eqn = self.jaxpr.eqns[s]
        for v in list(eqn.invars) + list(eqn.outvars):
            if (
                isinstance(v, compat.Var)
                and self.last_use.get(v, -1) <= s
                and not self._pending_operand(v)
            ):
                self.env.pop(v, None)

    def _pending_operand(self, v) -> bool:
        # An operand of a rewritten psum stays until its bucket has started.
        return self.unstarted_uses.get(v, 0) > 0

    def _frontier(self, bucket):
        """The value computed last since the bucket started: a done that
        takes it cannot run before the backward computation that produced
        it, which in a backward pass follows from the rest. One value, not
        all of those still live: each operand of the done stays allocated
        until the done runs, and on CPU a larger temporary buffer of XLA's
        is mapped and zeroed afresh every step (measured on a ResNet-18
        step: 52.6 MiB per device with all of them, 14.2 MiB with one)."""
        since = bucket.start_slot
        latest = [
            (self.produced_at[v], i, v)
            for i, v in enumerate(self.env)
            if self.produced_at.get(v, -1) >= since
        ]
        return [self.env[max(latest)[2]]] if latest else []

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
            with source_info_util.user_context(None, name_stack=stack.extend(f"jaxring_bucket{b}")):
                if kind == "start":
                    self._start(b)
                else:
                    self._done(b)

    def _operand(self, it):
        eqn = self.jaxpr.eqns[it.key[0]]
        x = read_atom(self.env, eqn.invars[it.key[1]])
        aval = eqn.outvars[it.key[1]].aval
        r = self.red[it.key]
        if r.complex_lanes:
            x = jax.numpy.stack([jax.numpy.real(x), jax.numpy.imag(x)], axis=-1)
            aval = aval.update(
                shape=r.shape,
                dtype=r.dtype,
                sharding=NamedSharding(aval.sharding.mesh, PartitionSpec(*[None] * len(r.shape))),
            )
        if r.carried is not None:
            # Rounded once here; the ring adds in float32 (wire_format).
            x = x.astype(r.dtype)
            aval = aval.update(dtype=r.dtype)
        if it.count == math.prod(r.shape):
            return x, aval
        flat = jax.numpy.ravel(x)
        return (
            jax.lax.slice(flat, (it.offset,), (it.offset + it.count,)),
            _vector_aval(aval, it.count),
        )

    def _start(self, b):
        bucket = self.plan.buckets[b]
        groups: dict = {}
        for it in bucket.items:
            r = self.red[it.key]
            groups.setdefault((r.axes, r.groups, r.dtype), []).append(it)
        # The credit window: this start may only run once the buckets it
        # depends on are done.
        waited = [v for w in bucket.depends_on for v in self.results[w]]
        started = []
        for (axes, index_groups, _), items in groups.items():
            operands, avals = zip(*(self._operand(it) for it in items))
            handle = split_phase.start(
                list(operands),
                deps=waited,
                axes=axes,
                groups=index_groups,
                op="sum",
                label=f"bucket {b}",
                rings=self.opts.rings,
                rings_from_default=self.opts.rings_from_default,
                chunk_bytes=self.opts.chunk_bytes,
                timeout_s=self.opts.timeout_s,
            )
            started.append((handle, items, avals))
        for it in bucket.items:
            v = self.jaxpr.eqns[it.key[0]].invars[it.key[1]]
            self.unstarted_uses[v] -= 1
        self.started[b] = started

    def _done(self, b):
        deps = self._frontier(self.plan.buckets[b])
        outs_all = []
        for handle, items, avals in self.started[b]:
            outs = split_phase.done(handle, avals, deps=deps)
            outs_all += outs
            for it, out in zip(items, outs):
                self._deliver(it, out)
        self.results[b] = outs_all

    def _deliver(self, it, value):
        eqn = self.jaxpr.eqns[it.key[0]]
        var_out = eqn.outvars[it.key[1]]
        r = self.red[it.key]
        if self.parts_total[it.key] > 1:
            got = self.parts.setdefault(it.key, {})
            got[it.part] = value
            if len(got) < self.parts_total[it.key]:
                return
            value = jax.numpy.concatenate([got[p] for p in sorted(got)]).reshape(r.shape)
        if r.carried is not None:
            value = value.astype(r.carried)
        if r.complex_lanes:
            value = jax.lax.complex(value[..., 0], value[..., 1])
        self.env[var_out] = value
