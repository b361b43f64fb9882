"""Every JAX name jaxring uses beyond ``jax``/``jax.lax``/``jax.ffi``, in one place.

jaxring supports the JAX releases in ``SUPPORTED_JAX`` and is tested on each.
The rest of the package imports JAX's internals only from here, so a JAX
release that moves one is fixed in this file alone.

Public homes come first: ``jax.extend.core`` (jaxprs, primitives),
``jax.extend.source_info_util``, ``jax.interpreters.{ad,batching,mlir}``
(rule tables and lowering registration) and ``jaxlib.mlir`` (the StableHLO
builders every lowering uses). Each private name below says why jaxring needs
it and on which versions it was checked.
"""

from __future__ import annotations

import warnings

import jax

# Private modules: each name taken from them below says why.
from jax._src import (
    config as _config,
    core as _core,
    distributed as _distributed,
    xla_bridge as _xla_bridge,
)
from jax.extend import (
    core as _extend_core,
    source_info_util,  # noqa: F401  (re-exported)
)
from jax.interpreters import ad, batching, mlir  # noqa: F401  (re-exported)
from jaxlib.mlir import ir  # noqa: F401  (re-exported)
from jaxlib.mlir.dialects import stablehlo as hlo  # noqa: F401  (re-exported)

# The releases jaxring is tested on, as (lowest, first untested): pyproject.toml
# declares the same range for pip.
SUPPORTED_JAX = ((0, 10), (0, 13))
SUPPORTED_JAX_TEXT = "jax and jaxlib >= 0.10, < 0.13"

# ---- public -----------------------------------------------------------------

Primitive = _extend_core.Primitive
Var = _extend_core.Var
Literal = _extend_core.Literal
Jaxpr = _extend_core.Jaxpr
# jax 0.12 merged ClosedJaxpr into Jaxpr; jax.extend.core keeps the old name
# as an alias there, so isinstance checks against both work on every version.
ClosedJaxpr = _extend_core.ClosedJaxpr
jaxprs_in_params = _extend_core.jaxprs_in_params
ShapedArray = jax.core.ShapedArray


def typeof(x):
    """The abstract value of x (with its varying axes under check_vma)."""
    return jax.typeof(x)


def pvary(x, axes: tuple):
    """x made varying over axes (what jax's internal pvary does), through
    the public lax.pcast."""
    return jax.lax.pcast(x, tuple(axes), to="varying")


def preduced(x, axes: tuple):
    """x typed *reduced* over axes (the transpose of a psum of an unreduced
    value, as lax's), through the public lax.pcast."""
    return jax.lax.pcast(x, tuple(axes), to="reduced")


def varying(aval) -> frozenset:
    """The axes aval varies over under check_vma: in its manual axis type
    (``mat``) where the aval has one, else in ``vma``."""
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def with_varying(aval, varying: frozenset):
    """aval typed as varying over the axes `varying` (see varying)."""
    if getattr(aval, "mat", None) is not None:
        return aval.update(manual_axis_type=aval.mat.update(varying=varying))
    return aval.update(vma=varying)


def unreduced_axes(aval) -> frozenset:
    """The axes over which aval is typed *unreduced* (each device holds a
    part of a sum not yet taken); empty on avals without that type."""
    mat = getattr(aval, "mat", None)
    return frozenset(getattr(mat, "unreduced", None) or ())


def unreduced_kind(aval) -> str | None:
    """Which reduction an unreduced aval awaits ("sum", "max", ...), where
    JAX records it (0.12); None where it does not (every unreduced value is
    a sum there)."""
    kind = getattr(getattr(aval, "mat", None), "unreduced_kind", None)
    return None if kind is None else getattr(kind, "name", str(kind))


def without_unreduced(aval, axes: tuple):
    """aval once reduced over axes: no longer unreduced over them."""
    mat = aval.mat
    left = frozenset(mat.unreduced) - frozenset(axes)
    changes = dict(unreduced=left)
    if not left and hasattr(mat, "unreduced_kind"):
        changes["unreduced_kind"] = None
    return aval.update(manual_axis_type=mat.update(**changes))


def axis_is_bound(name) -> bool:
    """Whether a mapped axis of this name is in scope at trace time."""
    try:
        jax.lax.axis_size(name)
    except NameError:
        return False
    return True


def axis_size(name) -> int:
    return jax.lax.axis_size(name)


def bound_axis_names() -> tuple:
    """The names of the mapped axes in scope at trace time (a shard_map's
    mesh axes, pmap's and vmap's axis names), for an error that names the
    axes a misspelt name could have meant. No public accessor lists them;
    ``core.unsafe_get_axis_names`` does on jax 0.10.2 and 0.12.1 (checked
    there). Empty where it is missing: the message then names none."""
    names = getattr(_core, "unsafe_get_axis_names", None)
    if names is None:
        return ()
    return tuple(names())


def closed_parts(closed) -> tuple:
    """(jaxpr, consts) of a closed jaxpr; on jax 0.12, where a Jaxpr carries
    its consts, jaxpr is the object itself."""
    return closed.jaxpr, closed.consts


# ---- private, each checked on jax 0.10.2, 0.11.2, 0.12.0.1 and 0.12.1 -------


def define_high_rule(primitive, to_low) -> None:
    """Give primitive the rule JAX needs where its operand has a *high* type.

    From jax 0.12.1 a value typed unreduced over a manual axis is a high type:
    before compiling, JAX rewrites each equation that takes one through the
    primitive's ``to_lojax`` rule, into equations on the value's low form (the
    same array, typed varying over those axes). Earlier releases never find a
    high operand, so the rule is unused there. ``Primitive.is_high`` and
    ``to_lojax`` exist, with these signatures, on all four; neither is
    documented."""
    primitive.is_high = lambda *avals, **params: any(getattr(a, "is_high", False) for a in avals)
    primitive.to_lojax = to_low


def low_value(x):
    """The low form of a value of a high type (see define_high_rule)."""
    (low,) = typeof(x).lower_val(x)
    return low


def high_value(aval, low):
    """The value of type aval whose low form is low; low itself where aval
    is not a high type."""
    return aval.raise_val(low)


# A primitive that communicates over named axes declares the effect, as
# lax.psum does, so that JAX keeps it inside the map that binds the axes.
# No public constructor exists.
NamedAxisEffect = _core.NamedAxisEffect


def check_vma_enabled() -> bool:
    """Whether the enclosing shard_map checks varying manual axes: a psum's
    result is then typed invariant. Read from the trace-time config state
    shard_map sets; there is no public accessor."""
    return bool(_config._check_vma.value)


def auto_pcast_enabled() -> bool:
    """Whether JAX inserts pvary for a psum of an invariant value (as
    lax.psum does) rather than raising; a private config state."""
    return bool(_config.auto_pcast.value)


def backends_are_initialized() -> bool:
    """Whether a JAX backend exists yet (PJRT_NPROC is read when the CPU
    client starts, so it must be set before); asking the public API would
    start one."""
    return _xla_bridge.backends_are_initialized()


def distributed_client():
    """jax.distributed's key-value store client, or None outside a
    multi-process job; jaxring exchanges its addresses and NCCL ids there.
    No public accessor exposes the client."""
    return _distributed.global_state.client


def distributed_state():
    """(process id, process count, coordinator address) of the job."""
    state = _distributed.global_state
    return state.process_id, state.num_processes, state.coordinator_address


# Lowering caches of one module that call_sites makes refuse jaxring ops
# (their names on every supported version). call_sites wraps the public
# mlir.ModuleContext.__init__ to install them; the same patch works on
# 0.10.2, 0.11.2, 0.12.0.1 and 0.12.1, which tests/test_allreduce.py
# (test_every_call_gets_its_own_op_id) checks on each.
MODULE_CONTEXT_CACHES = ("cached_primitive_lowerings", "lowering_cache")


def _version_tuple(text: str) -> tuple:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


_warned = False


def untested_versions() -> list[str]:
    """The running jax and jaxlib that lie outside SUPPORTED_JAX, as text."""
    import jaxlib

    lo, hi = SUPPORTED_JAX
    return [
        f"{name} {v}"
        for name, v in (("jax", jax.__version__), ("jaxlib", jaxlib.__version__))
        if not lo <= _version_tuple(v) < hi
    ]


def in_tested_range() -> bool:
    return not untested_versions()


def warn_if_untested() -> None:
    """Warns once when the running jax or jaxlib is outside SUPPORTED_JAX."""
    global _warned
    if _warned:
        return
    outside = untested_versions()
    if outside:
        _warned = True
        warnings.warn(
            f"jaxring is tested with {SUPPORTED_JAX_TEXT}; this process runs "
            f"{', '.join(outside)}. It may work, but nothing has checked it: "
            "install a tested version, or report what fails.",
            RuntimeWarning,
            stacklevel=3,
        )
