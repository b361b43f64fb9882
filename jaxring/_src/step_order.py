"""The order of a step's equations that lets its reductions start early.

A value to be reduced is often computed by a few equations that sit, in
program order, after the whole backward pass: an optimizer transformation
that scales, casts or projects each gradient before its psum (a
compression transform, gradient clipping per leaf). Buckets start at the
equation that makes their last value, so such a psum could not overlap the
backward pass at all. This moves every equation that feeds a reduction's
operand to just after its inputs exist (list scheduling, as soon as
possible), so the reduction is ready when its data is.

What moves: the equations in the backward slice of the reductions'
operands, but none that depends on a reduction's result (those wait for
their bucket, and moving them up would move the wait up too) and none with
effects. The reductions stay where they are (a bucket starts after its
values' producers, wherever its psum sits; and the psums of one call keep
the order that names their values). Everything else keeps its place and
relative order. Pure equations on the values they already read:
the step computes the same values.
"""

from __future__ import annotations

import heapq

from jaxring._src import jax_compat as compat


def _vars(atoms):
    return [v for v in atoms if isinstance(v, compat.Var)]


def movable_equations(jaxpr, reductions: set[int]) -> set[int]:
    """Indices of the equations that may move up: those the reductions'
    operands depend on, minus any that reads a reduction's result
    (transitively) or has effects."""
    eqns = jaxpr.eqns
    after_reduction: set[int] = set()
    reduced_vars: set = set()
    for i, eqn in enumerate(eqns):
        if any(v in reduced_vars for v in _vars(eqn.invars)):
            after_reduction.add(i)
            reduced_vars.update(eqn.outvars)
        elif i in reductions:
            reduced_vars.update(eqn.outvars)
    needed: set = set()
    movable: set[int] = set()
    for i in range(len(eqns) - 1, -1, -1):
        eqn = eqns[i]
        if i in reductions:
            if i not in after_reduction:
                needed.update(_vars(eqn.invars))
            continue
        if i in after_reduction or eqn.effects or not any(v in needed for v in eqn.outvars):
            continue
        movable.add(i)
        needed.update(_vars(eqn.invars))
    return movable


def hoisted_order(jaxpr, reductions: set[int]) -> list[int]:
    """A topological order of the equations in which each movable one runs
    as soon as its inputs exist (those that became ready first go first,
    ties in program order); the others keep their program order."""
    eqns = jaxpr.eqns
    movable = movable_equations(jaxpr, reductions)
    if not movable:
        return list(range(len(eqns)))
    producer = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars}
    waiting_on: dict[int, int] = {}
    consumers: dict[int, list[int]] = {}
    for i in movable:
        inputs = {producer[v] for v in _vars(eqns[i].invars) if v in producer}
        waiting_on[i] = len(inputs)
        for p in inputs:
            consumers.setdefault(p, []).append(i)
    order: list[int] = []
    done: set[int] = set()
    # (when it became ready, program position) of each ready movable one.
    ready = [(0, i) for i in movable if waiting_on[i] == 0]
    heapq.heapify(ready)

    def emit(i):
        order.append(i)
        done.add(i)
        for c in consumers.get(i, ()):
            waiting_on[c] -= 1
            if waiting_on[c] == 0:
                heapq.heappush(ready, (len(order), c))

    def drain():
        while ready:
            _, j = heapq.heappop(ready)
            if j not in done:
                emit(j)

    drain()
    for i in range(len(eqns)):
        if i in done:
            continue
        # A movable equation's inputs all come from equations before it in
        # program order, so it has been emitted by now.
        assert i not in movable, i
        emit(i)
        drain()
    return order
