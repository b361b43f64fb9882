"""One lowering, and so one op id, per jaxring call in a program.

A jaxring op's identity is a constant attribute chosen at lowering
(``next_op_id``): a hash of the module's name, the op's place among the
jaxring ops of that module and its label (what the timeline calls it, e.g.
"bucket 3"; two programs of one name that differ there get different ids,
so their spans keep their own names). Every process of a job lowers the same program
the same way, so they agree on it, whatever else each process lowered
before (a function only process 0 runs does not shift the ids of the
others). Operations of different programs are told apart by XLA's run id,
which derives from the compiled program's fingerprint. JAX reuses lowerings
in two ways, and either would give two calls one op id inside one run:

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

import functools
import hashlib
import itertools
import weakref

from jaxring._src import jax_compat as compat
from jaxring._src.jax_compat import mlir

_primitives: set = set()
_contains_memo: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


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
    found = any(eqn.primitive in _primitives
                or any(contains_jaxring_op(sub)
                       for sub in compat.jaxprs_in_params(eqn.params))
                for eqn in jaxpr.eqns)
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
    also counts the module's jaxring ops."""

    def __init__(self, *args):
        super().__init__(*args)
        self.op_ordinals = itertools.count(1)

    def __setitem__(self, key, value):
        if not _has_jaxring_op(key):
            super().__setitem__(key, value)


def next_op_id(module_context, label: str) -> int:
    """The op id of the next jaxring op lowered into this module, labelled
    `label`: the same in every process that lowers the same program, and a
    positive int64."""
    cache = getattr(module_context, compat.MODULE_CONTEXT_CACHES[-1])
    if not isinstance(cache, _FunctionCache):
        raise RuntimeError("jaxring: internal error: a module context without "
                           "jaxring's lowering cache (call_sites._install)")
    name = str(module_context.module.operation.attributes["sym_name"])
    ordinal = next(cache.op_ordinals)
    digest = hashlib.blake2b(f"{name}\0{ordinal}\0{label}".encode(),
                             digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 2) or 1


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
