"""One lowering, and so one op id, per jaxring call in a program.

A jaxring call's identity is chosen at lowering (``call_ids``) from its
*slot* (the module's name and the call's place among the module's jaxring
calls), its *description* (label, mesh, operand types) and how many times
this process lowered that slot with that description before. It gets two
constant attributes:

* ``op_id``, a hash of all three, by which ranks find each other. Every
  process that lowers the same program gives its calls the same op ids,
  whatever else it lowered before (an evaluation only process 0 runs, under
  another name or over other shapes, shifts nothing). Within a process no
  two lowerings share one: a fresh ``jax.jit`` of the same function (which
  XLA gives the same run ids) counts one more.
* ``slot_id``, a hash of the slot and the count only. Processes that call
  one slot with different shapes, dtypes or ops get different op ids but
  the same slot id, so the transport sees both descriptions at one slot and
  raises a mismatch instead of waiting out the timeout.

What still shifts ids: one process lowering a call of the *same* slot and
description an extra time (an extra lowering of the step function itself).

JAX reuses lowerings in two ways, and either would give two calls one op id
inside one run:

* every equation's lowering is cached by (primitive, params, avals), so two
  allreduces of same-shaped values in one function would share one;
* a function called from several places (a nested ``jax.jit``, a ``remat``
  or ``custom_vjp`` body) is lowered once per module and called from each.

XLA's CPU executor runs independent thunks concurrently, so devices can reach
two such calls in different orders, and a shared id would then pair one
call's data on one device with the other call's data on another: a wrong sum
and no error. So jaxring's lowerings are registered uncacheable, and the
module's function cache keeps no function whose jaxpr contains a jaxring op:
every call site lowers its own copy, with fresh op ids. That costs compile
time for those functions only; XLA inlines the calls anyway.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import itertools
import threading
import weakref

from jaxring._src import jax_compat as compat
from jaxring._src.jax_compat import mlir

_primitives: set = set()
_slot_lowerings: collections.Counter = collections.Counter()
_slot_lock = threading.Lock()
_contains_memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register_lowering(primitive, rule, platform: str) -> None:
    """Registers a jaxring op's lowering so that every call gets its own."""
    mlir.register_lowering(primitive, rule, platform=platform, cacheable=False)
    _primitives.add(primitive)
    _install()


def contains_jaxring_op(jaxpr) -> bool:
    """Whether jaxpr (a Jaxpr or ClosedJaxpr), or one nested in it, has a jaxring op."""
    if isinstance(jaxpr, compat.ClosedJaxpr):
        jaxpr, _ = compat.closed_parts(jaxpr)
    try:
        return _contains_memo[jaxpr]
    except (KeyError, TypeError):
        pass
    found = any(
        eqn.primitive in _primitives
        or any(contains_jaxring_op(sub) for sub in compat.jaxprs_in_params(eqn.params))
        for eqn in jaxpr.eqns
    )
    try:
        _contains_memo[jaxpr] = found
    except TypeError:  # not weak-referenceable: no memo
        pass
    return found


def _has_jaxring_op(value, depth: int = 0) -> bool:
    """Whether a cache key, or a jaxpr inside it, holds a jaxring op."""
    if isinstance(value, (compat.Jaxpr, compat.ClosedJaxpr)):
        return contains_jaxring_op(value)
    if depth > 4:
        return False
    if hasattr(value, "primitive") and hasattr(value, "params"):  # an equation's key
        return value.primitive in _primitives or _has_jaxring_op(value.params, depth + 1)
    if isinstance(value, (tuple, list)):
        return any(_has_jaxring_op(v, depth + 1) for v in value)
    return False


class _FunctionCache(dict):
    """A ModuleContext cache that refuses lowerings holding a jaxring op.

    JAX's lowering looks a function or an equation up by a key holding its
    jaxpr (or params) and stores it after lowering; refusing the store makes
    the next call site lower it again. One module's contexts share it, so it
    also numbers the module's jaxring calls."""

    def __init__(self, *args):
        super().__init__(*args)
        self.call_ordinals = itertools.count(1)

    def __setitem__(self, key, value):
        if not _has_jaxring_op(key):
            super().__setitem__(key, value)


def _hash(*parts) -> int:
    """A positive int64 from parts."""
    text = "\0".join(map(str, parts)).encode()
    digest = hashlib.blake2b(text, digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 2) or 1


def call_ids(module_context, description: str) -> tuple[int, int]:
    """(op_id, slot_id) of the next jaxring call lowered into module_context
    (see the module's docstring).

    description: what a process calling this slot differently would change
    (label, mesh, operand types)."""
    cache = getattr(module_context, compat.MODULE_CONTEXT_CACHES[-1])
    if not isinstance(cache, _FunctionCache):
        raise RuntimeError(
            "jaxring: internal error: a module context without "
            "jaxring's lowering cache (call_sites._install)"
        )
    name = str(module_context.module.operation.attributes["sym_name"])
    ordinal = next(cache.call_ordinals)
    with _slot_lock:
        _slot_lowerings[name, ordinal, description] += 1
        count = _slot_lowerings[name, ordinal, description]
    return (_hash("op", name, ordinal, description, count), _hash("slot", name, ordinal, count))


def _install() -> None:
    init = mlir.ModuleContext.__init__
    if getattr(init, "_jaxring_unshared", False):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        # A fresh module's caches are empty; a replaced context shares the
        # wrapped ones and keeps them.
        for name in compat.MODULE_CONTEXT_CACHES:
            cache = getattr(self, name)
            if not isinstance(cache, _FunctionCache):
                setattr(self, name, _FunctionCache(cache))

    __init__._jaxring_unshared = True
    mlir.ModuleContext.__init__ = __init__
