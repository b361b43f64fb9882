"""The ``jaxring_allreduce`` primitive and its rules, mirroring lax.psum's.

One primitive carries an elementwise reduction over named mesh axes. Its
rules are lax.psum's, so that it composes the same way:

* abstract eval: under ``check_vma`` the result is invariant over the reduced
  axes (like ``psum_invariant``); otherwise the aval is unchanged;
* JVP: linear for ``op="sum"``; the other ops, like lax.pmax, have none;
* transpose: ``pvary`` under ``check_vma``, the allreduce itself otherwise
  (psum is psum + pbroadcast in that mode);
* batching: a vmapped axis that is reduced over is reduced locally, the rest
  of the axes go to the ring.

Its lowering is lowering.py's.
"""

from __future__ import annotations

from jax import lax

from jaxring._src import jax_compat as compat
from jaxring._src.arguments import check_bound, check_groups_cover
from jaxring._src.jax_compat import ad, batching

allreduce_p = compat.Primitive("jaxring_allreduce")


def _abstract_eval(
    aval,
    *,
    axes,
    groups,
    op,
    rings,
    rings_from_default,
    chunk_bytes,
    timeout_s,
    link,
    algorithm,
    topology,
    invariant,
    unreduced,
):
    del op, rings, rings_from_default, chunk_bytes, timeout_s, link, algorithm, topology
    check_bound(axes)
    check_groups_cover(axes, groups)
    if unreduced:
        # A sum of the parts an unreduced value's devices hold: the result is
        # the reduced value, as lax.psum's unreduced path types it.
        out = compat.without_unreduced(aval, axes)
    elif invariant:
        out = compat.with_varying(aval, compat.varying(aval) - frozenset(axes))
    else:
        out = aval
    return out, {compat.NamedAxisEffect(a) for a in axes}


allreduce_p.def_effectful_abstract_eval(_abstract_eval)


def _impl(x, **params):
    raise NameError(
        "jaxring.allreduce must be called inside jax.shard_map or jax.pmap "
        "(it was called eagerly, outside any mapped axis)."
    )


allreduce_p.def_impl(_impl)


def _jvp(primals, tangents, **params):
    (x,), (t,) = primals, tangents
    y = allreduce_p.bind(x, **params)
    t = ad.instantiate_zeros(t)
    if params["op"] != "sum":
        raise TypeError(
            f"jaxring.allreduce(op={params['op']!r}) is not differentiable "
            "(neither are lax.pmax/pmin); only op='sum' and op='mean' are."
        )
    return y, allreduce_p.bind(t, **params)


ad.primitive_jvps[allreduce_p] = _jvp


def _transpose(ct, x, **params):
    assert ad.is_undefined_primal(x)
    if params["op"] != "sum":
        raise TypeError(f"jaxring.allreduce(op={params['op']!r}) is not linear")
    if type(ct) is ad.Zero:
        return (ad.Zero(x.aval),)
    if params["unreduced"]:
        # lax.psum's rule for an unreduced operand: the cotangent is typed
        # reduced, with no communication.
        return (compat.preduced(ct, params["axes"]),)
    if params["invariant"]:
        # An invariant result's cotangent is broadcast back to every rank:
        # the transpose of psum_invariant is pvary, no communication.
        return (compat.pvary(ct, params["axes"]),)
    return (allreduce_p.bind(ct, **params),)


ad.primitive_transposes[allreduce_p] = _transpose


def _to_low(x, **params):
    """The sum of a value of a high type (jax >= 0.12.1: one typed unreduced)
    as a sum of its low form, which holds each device's part typed varying
    over the same axes: summed to an invariant result, that is the reduced
    value the high equation types."""
    aval = compat.typeof(x)
    low = compat.low_value(x)
    if compat.typeof(low).shape != aval.shape:
        # An operand unreduced over a mesh axis outside the manual ones has
        # its parts stacked along new leading dimensions in its low form.
        raise NotImplementedError(
            f"jaxring.allreduce over {params['axes']}: the value "
            f"({aval.str_short(True)}) is unreduced over mesh axes outside "
            "the shard_map's manual axes, which jaxring cannot sum; reduce "
            "it with lax.psum or jax.sharding.reshard first."
        )
    out_aval, _ = _abstract_eval(aval, **params)
    # The low form is varying where the high one was unreduced, so a sum of
    # an unreduced operand gives an invariant result, as its high type says.
    summed = allreduce_p.bind(
        low,
        **{**params, "unreduced": False, "invariant": params["invariant"] or params["unreduced"]},
    )
    return compat.high_value(out_aval, summed)


compat.define_high_rule(allreduce_p, _to_low)


def _local_reduce(op: str, x, dim: int):
    return {
        "sum": lax.reduce_sum,
        "prod": lax.reduce_prod,
        "min": lax.reduce_min,
        "max": lax.reduce_max,
    }[op](x, (dim,))


def _batch(axis_data, vals, dims, *, axes, groups, op, **params):
    (x,), (d,) = vals, dims
    if axis_data.name not in axes:
        return allreduce_p.bind(x, axes=axes, groups=groups, op=op, **params), d
    if params["unreduced"]:
        raise NotImplementedError(
            "jaxring.allreduce of a value typed unreduced cannot be vmapped "
            f"over the reduced axis {axis_data.name!r} (nor can lax.psum's)."
        )
    if groups is not None:
        # lax.psum's batcher refuses this too: the groups index the reduced
        # axes jointly, and vmap would split them into a local and a ring part.
        raise NotImplementedError(
            "axis_index_groups not supported in vmap collectives: "
            f"jaxring.allreduce over {axes} with axis_index_groups cannot be "
            f"vmapped over the reduced axis {axis_data.name!r}."
        )
    rest = tuple(a for a in axes if a != axis_data.name)
    if d is None:
        # Every member of the vmapped axis holds the same x.
        n = axis_data.size
        if op == "sum":
            y = x * lax.full_like(x, n)
        elif op == "prod":
            y = lax.integer_pow(x, n)
        else:
            y = x
    else:
        y = _local_reduce(op, x, d)
    if rest:
        y = allreduce_p.bind(y, axes=rest, groups=None, op=op, **params)
    return y, None


batching.fancy_primitive_batchers[allreduce_p] = _batch
