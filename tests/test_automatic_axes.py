"""jaxring.allreduce inside a shard_map that leaves some mesh axes automatic
(manual over the reduced axes only), against lax.psum in the same test."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxring

LAX = {"sum": jax.lax.psum, "mean": jax.lax.pmean, "max": jax.lax.pmax}
OURS = {
    "sum": jaxring.psum,
    "mean": jaxring.pmean,
    "max": functools.partial(jaxring.allreduce, op="max"),
}


def mesh_4x2(axis_type):
    return jax.make_mesh((4, 2), ("a", "b"), axis_types=(axis_type, axis_type))


def partly_manual(fn, mesh, check_vma):
    return jax.jit(
        jax.shard_map(
            fn, mesh=mesh, in_specs=P("a"), out_specs=P(), axis_names={"a"}, check_vma=check_vma
        )
    )


@pytest.mark.parametrize("check_vma", [False, True])
@pytest.mark.parametrize("op", sorted(LAX))
@pytest.mark.parametrize("layout", [P("a", "b"), P("a", None)])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_reduction_over_the_manual_axis_matches_lax(axis_type, layout, op, check_vma):
    mesh = mesh_4x2(axis_type)
    x = np.random.default_rng(0).integers(-9, 9, (8, 6)).astype(np.float32)
    x = jax.device_put(x, NamedSharding(mesh, layout))
    got = partly_manual(lambda v: OURS[op](v * 2, "a"), mesh, check_vma)(x)
    want = partly_manual(lambda v: LAX[op](v * 2, "a"), mesh, check_vma)(x)
    if axis_type == AxisType.Explicit:
        # Over Auto axes the layout is XLA's choice; over Explicit ones it is
        # part of the type.
        assert got.sharding.is_equivalent_to(want.sharding, 2)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_each_device_reduces_only_its_part_over_an_explicit_axis():
    mesh = mesh_4x2(AxisType.Explicit)
    x = jax.device_put(np.ones((8, 6), np.float32), NamedSharding(mesh, P("a", "b")))
    hlo = partly_manual(lambda v: jaxring.psum(v, "a"), mesh, False).lower(x).as_text()
    # Split over "b" as the operand is: every device reduces 2 x 3 values.
    assert "custom_call @jaxring_allreduce_cpu" in hlo
    call = next(l for l in hlo.splitlines() if "custom_call @jaxring_allreduce_cpu" in l)
    assert "tensor<2x3xf32>" in call, call


def test_gradient_matches_lax():
    mesh = mesh_4x2(AxisType.Explicit)
    x = jax.device_put(
        np.arange(48, dtype=np.float32).reshape(8, 6) / 10, NamedSharding(mesh, P("a", "b"))
    )

    def grad_of(psum):
        def loss(v):
            return jnp.sum(jnp.sin(psum(v * v, "a")))

        return partly_manual(lambda v: jax.grad(loss)(v).sum(0, keepdims=True), mesh, False)(x)

    np.testing.assert_allclose(
        np.asarray(grad_of(jaxring.psum)), np.asarray(grad_of(jax.lax.psum)), rtol=1e-6
    )


def test_vmap_of_a_partly_manual_shard_map_matches_lax():
    # JAX's test_vmap_shmap_psum, with both reductions side by side.
    mesh = mesh_4x2(AxisType.Auto)

    def run(psum):
        f = jax.shard_map(
            lambda v: psum(v, "a"),
            mesh=mesh,
            in_specs=P("a"),
            out_specs=P(),
            axis_names={"a"},
            check_vma=False,
        )
        return np.asarray(jax.jit(jax.vmap(f))(jnp.arange(3 * 8 * 2.0).reshape(3, 8, 2)))

    np.testing.assert_array_equal(run(jaxring.psum), run(jax.lax.psum))


def test_axis_index_groups_with_an_automatic_axis():
    mesh = mesh_4x2(AxisType.Explicit)
    x = jax.device_put(
        np.arange(48, dtype=np.float32).reshape(8, 6), NamedSharding(mesh, P("a", "b"))
    )
    groups = [[0, 3], [1, 2]]

    def run(psum):
        f = jax.shard_map(
            lambda v: psum(v, "a", axis_index_groups=groups),
            mesh=mesh,
            in_specs=P("a"),
            out_specs=P("a"),
            axis_names={"a"},
            check_vma=False,
        )
        return np.asarray(jax.jit(f)(x))

    np.testing.assert_array_equal(run(jaxring.psum), run(jax.lax.psum))


def test_overlap_in_a_partly_manual_shard_map_says_it_is_not_supported():
    mesh = mesh_4x2(AxisType.Explicit)
    x = jax.device_put(np.ones((8, 6), np.float32), NamedSharding(mesh, P("a", "b")))
    step = jaxring.overlap(lambda v: jax.lax.psum(v * 2, "a"), axis_name="a")
    with pytest.raises(
        NotImplementedError, match="jaxring.overlap inside a shard_map that leaves mesh axes"
    ):
        partly_manual(step, mesh, False)(x)
