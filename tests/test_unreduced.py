"""Values typed *unreduced* (each device holds a part of a sum not yet
taken): jaxring sums them as lax.psum does, against lax in the same test."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxring
from jaxring._src import jax_compat as compat
from jaxring._src.jax_compat import varying


def mesh_8():
    return jax.make_mesh((8,), ("i",), axis_types=(AxisType.Explicit,))


def x_on(mesh):
    rng = np.random.default_rng(0)
    return jax.device_put(
        rng.standard_normal((8, 5)).astype(np.float32), NamedSharding(mesh, P("i"))
    )


def run(body, mesh, out_specs=P()):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=out_specs))


def unreduced(v):
    return jax.lax.pcast(v, "i", to="unreduced")


@pytest.mark.parametrize(
    "ours,theirs", [(jaxring.psum, jax.lax.psum), (jaxring.pmean, jax.lax.pmean)]
)
def test_sum_of_an_unreduced_value_matches_lax_and_is_typed_reduced(ours, theirs):
    mesh = mesh_8()
    types = {}

    def body(reduce, name):
        def f(v):
            r = reduce(unreduced(v * 3), "i")
            types[name] = jax.typeof(r)
            return r

        return f

    got = run(body(ours, "ours"), mesh)(x_on(mesh))
    want = run(body(theirs, "lax"), mesh)(x_on(mesh))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    for t in types.values():
        assert not compat.unreduced_axes(t) and "i" not in varying(t), types


def test_gradient_matches_lax():
    mesh = mesh_8()

    def grad_of(psum):
        def f(v):
            return jax.grad(lambda w: jnp.sum(jnp.sin(psum(unreduced(w * w), "i"))))(v)

        return np.asarray(run(f, mesh, out_specs=P("i"))(x_on(mesh)))

    np.testing.assert_allclose(grad_of(jaxring.psum), grad_of(jax.lax.psum), rtol=1e-6)


def test_unreduced_and_varying_leaves_of_one_tree():
    mesh = mesh_8()

    def body(psum):
        def f(v):
            out = psum({"u": unreduced(v), "v": v * 2}, "i")
            return out["u"] + out["v"]

        return f

    np.testing.assert_allclose(
        np.asarray(run(body(jaxring.psum), mesh)(x_on(mesh))),
        np.asarray(run(body(jax.lax.psum), mesh)(x_on(mesh))),
        rtol=1e-6,
    )


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda u: jaxring.allreduce(u, "i", op="max"), "can only be summed"),
        (
            lambda u: jaxring.psum(u, "i", axis_index_groups=[[0, 1, 2, 3], [4, 5, 6, 7]]),
            "without axis_index_groups",
        ),
    ],
)
def test_what_lax_psum_refuses_on_unreduced_values_is_refused(call, match):
    mesh = mesh_8()
    with pytest.raises(TypeError, match=match):
        run(lambda v: call(unreduced(v)), mesh)(x_on(mesh))


def test_unreduced_over_some_reduced_axes_only_is_refused():
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    x = jax.device_put(np.ones((8, 3), np.float32), NamedSharding(mesh, P(("a", "b"))))
    f = jax.jit(
        jax.shard_map(
            lambda v: jaxring.psum(jax.lax.pcast(v, "a", to="unreduced"), ("a", "b")),
            mesh=mesh,
            in_specs=P(("a", "b")),
            out_specs=P(),
        )
    )
    with pytest.raises(ValueError, match="unreduced over \\['a'\\] but not over"):
        f(x)


# lax.psum of an unreduced value is lax's unreduced_psum (jax 0.12), which
# overlap reports too.
@pytest.mark.parametrize("psum", [jaxring.psum, jax.lax.psum], ids=["jaxring", "lax"])
def test_overlap_leaves_an_unreduced_sum_where_it_is_with_a_warning(psum):
    mesh = mesh_8()

    def step(v):
        return psum(unreduced(v), "i") + jax.lax.psum(v, "i")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", jaxring.OverlapWarning)
        got = run(jaxring.overlap(step, axis_name="i"), mesh)(x_on(mesh))
    assert any("typed unreduced" in str(w.message) for w in caught), caught
    np.testing.assert_allclose(np.asarray(got), np.asarray(run(step, mesh)(x_on(mesh))), rtol=1e-6)


def mesh_4x2():
    return jax.make_mesh((4, 2), ("i", "j"), axis_types=(AxisType.Explicit,) * 2)


def x_on_4x2(mesh):
    rng = np.random.default_rng(1)
    return jax.device_put(
        rng.standard_normal((4, 2, 3)).astype(np.float32), NamedSharding(mesh, P("i", "j"))
    )


def test_sum_over_one_axis_of_a_value_unreduced_over_another_matches_lax():
    """psum over i of a value unreduced over j: alone, beside a varying leaf
    of one tree, and under overlap (which leaves it where it is, with a
    warning); each then summed over j, against lax."""
    mesh = mesh_4x2()

    def body(psum, tree):
        def f(v):
            u = jax.lax.pcast(v, "j", to="unreduced")
            if tree:
                out = psum({"u": u, "v": v * 2}, "i")
                return jax.lax.psum(out["u"], "j") + jax.lax.psum(out["v"], "j")
            return jax.lax.psum(psum(u, "i"), "j")

        return f

    def run2(f):
        return np.asarray(
            jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("i", "j"), out_specs=P()))(
                x_on_4x2(mesh)
            )
        )

    for tree in (False, True):
        want = run2(body(jax.lax.psum, tree))
        np.testing.assert_allclose(run2(body(jaxring.psum, tree)), want, rtol=1e-6)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", jaxring.OverlapWarning)
            got = run2(jaxring.overlap(body(jaxring.psum, tree), axis_name="i"))
        assert any("typed unreduced" in str(w.message) for w in caught), caught
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_max_not_yet_taken_over_another_axis_is_not_summed():
    """A value awaiting a max over j (jax 0.12 records the kind): a sum over
    i would mix the two reductions, and lax.psum refuses it too."""
    mesh = mesh_4x2()
    from jaxring._src.allreduce import _check_unreduced

    def f(v):
        aval = jax.typeof(jax.lax.pcast(v, "j", to="unreduced"))
        kinds = type(getattr(aval.mat, "unreduced_kind", None))
        if not hasattr(kinds, "max"):
            pytest.skip("this jax records no unreduced kind")
        awaiting_max = aval.update(manual_axis_type=aval.mat.update(unreduced_kind=kinds.max))
        with pytest.raises(TypeError, match="unreduced kind max"):
            _check_unreduced(awaiting_max, ("i",), None, "sum")
        return v

    jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("i", "j"), out_specs=P("i", "j")))(
        x_on_4x2(mesh)
    )
