"""axis_index_groups: each group of indices is reduced on a ring of its own,
against lax.psum (and numpy where lax differs) in the same test."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxring
from jaxring._src.jax_compat import varying

from conftest import overlapped_and_plain

EVEN = [[0, 1], [2, 3]]
GROUPINGS = {
    "pairs": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "permuted": [[7, 0, 5, 2], [1, 6, 4, 3]],
    "uneven": [[0, 1, 2], [3], [4, 5, 6, 7]],
    "singletons": [[i] for i in range(8)],
    "one group": [list(range(8))],
}
OPS = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}


def pmapped(fn, x):
    return np.asarray(jax.pmap(fn, axis_name="i")(x))


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("grouping", sorted(GROUPINGS))
def test_integers_match_lax_bit_for_bit(grouping, op, algorithm):
    groups = GROUPINGS[grouping]
    x = np.random.default_rng(0).integers(-1000, 1000, (8, 301), dtype=np.int32)
    got = pmapped(
        lambda v: jaxring.allreduce(v, "i", op=op, axis_index_groups=groups, algorithm=algorithm), x
    )
    want = pmapped(lambda v: OPS[op](v, "i", axis_index_groups=groups), x)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("grouping", sorted(GROUPINGS))
def test_float_sums_and_means_match_numpy(grouping):
    groups = GROUPINGS[grouping]
    x = np.random.default_rng(1).standard_normal((8, 1000)).astype(np.float32)
    sums = pmapped(
        lambda v: jaxring.psum(v, "i", axis_index_groups=groups, rings=3, chunk_bytes=512), x
    )
    means = pmapped(lambda v: jaxring.pmean(v, "i", axis_index_groups=groups), x)
    for g in groups:
        for i in g:
            np.testing.assert_allclose(sums[i], x[g].sum(0), rtol=1e-5, atol=1e-5)
            # Each rank's mean is over its own group. lax.pmean divides by the
            # first group's size, which differs from this for uneven groups.
            np.testing.assert_allclose(means[i], x[g].mean(0), rtol=1e-5, atol=1e-5)
    if len({len(g) for g in groups}) == 1:
        lax_means = pmapped(lambda v: jax.lax.pmean(v, "i", axis_index_groups=groups), x)
        np.testing.assert_allclose(means, lax_means, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("check_vma", [False, True])
@pytest.mark.parametrize(
    "axes,groups",
    [
        ("a", [[0, 2], [1, 3]]),
        (("a", "b"), [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (("b", "a"), [[0, 2], [1, 3], [4, 5, 6, 7]]),
    ],
)
def test_shard_map_over_several_axes_matches_lax(axes, groups, check_vma):
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    spec = P(("a", "b"))
    x = jax.device_put(
        np.arange(8 * 3, dtype=np.float32).reshape(8 * 3) * 1.5, NamedSharding(mesh, spec)
    )

    def run(fn, vma):
        return np.asarray(
            jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=vma))(x)
        )

    got = run(lambda v: jaxring.psum(v, axes, axis_index_groups=groups), check_vma)
    # lax.psum takes axis_index_groups only with check_vma off.
    want = run(lambda v: jax.lax.psum(v, axes, axis_index_groups=groups), False)
    np.testing.assert_array_equal(got, want)


def test_result_still_varies_over_the_axes_under_check_vma():
    mesh = jax.make_mesh((8,), ("i",))

    def body(v):
        r = jaxring.psum(v, "i", axis_index_groups=GROUPINGS["pairs"])
        assert "i" in varying(jax.typeof(r))
        return r

    x = jax.device_put(np.arange(8.0, dtype=np.float32), NamedSharding(mesh, P("i")))
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))(x)


def test_gradient_matches_lax():
    x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)

    def grad_of(psum):
        def loss(v):
            return jnp.sum(psum(v * v, "i", axis_index_groups=GROUPINGS["uneven"]) ** 2)

        return pmapped(jax.grad(loss), x)

    np.testing.assert_allclose(grad_of(jaxring.psum), grad_of(jax.lax.psum), rtol=1e-6)


def test_groups_not_covering_every_index_once_raise_lax_message():
    x = np.ones((8, 2), np.float32)
    for bad in ([[0, 1], [1, 2, 3, 4, 5, 6, 7]], [[0, 1], [3, 4]], [[0], []]):
        with pytest.raises(
            ValueError, match="axis_index_groups must cover all indices exactly once"
        ):
            pmapped(lambda v: jaxring.psum(v, "i", axis_index_groups=bad), x)
    # Covers 0..3 exactly once, but the axis has 8 indices.
    with pytest.raises(ValueError, match="hold 4 indices, but the axes"):
        pmapped(lambda v: jaxring.psum(v, "i", axis_index_groups=EVEN), x)
    with pytest.raises(TypeError, match="list of lists of axis indices"):
        pmapped(lambda v: jaxring.psum(v, "i", axis_index_groups=[[0.5, 1]]), x)


def test_vmap_over_a_grouped_axis_is_refused_as_lax_refuses_it():
    x = np.ones((4, 2), np.float32)
    f = jax.vmap(lambda v: jaxring.psum(v, "i", axis_index_groups=EVEN), axis_name="i")
    with pytest.raises(
        NotImplementedError, match="axis_index_groups not supported in vmap collectives"
    ):
        f(x)


def test_vmap_over_another_axis_keeps_the_groups():
    x = np.random.default_rng(2).standard_normal((3, 8, 5)).astype(np.float32)

    def inner(psum):
        return jax.vmap(
            jax.pmap(lambda v: psum(v, "i", axis_index_groups=GROUPINGS["pairs"]), axis_name="i"),
            axis_name="j",
        )

    np.testing.assert_allclose(
        np.asarray(inner(jaxring.psum)(x)), np.asarray(inner(jax.lax.psum)(x)), rtol=1e-6
    )


def test_a_tiered_topology_with_uneven_groups_is_refused():
    x = np.ones((8, 2), np.float32)
    with pytest.raises(NotImplementedError, match="axis_index_groups of different sizes"):
        pmapped(
            lambda v: jaxring.psum(
                v, "i", axis_index_groups=GROUPINGS["uneven"], algorithm="ring", topology=(2, 2)
            ),
            x,
        )


def test_overlap_buckets_grouped_psums_with_their_own_group():
    mesh = jax.make_mesh((8,), ("batch",))
    spec = P("batch")

    def step(x):
        pairs = jax.lax.psum(x * 2.0, "batch", axis_index_groups=GROUPINGS["pairs"])
        uneven = jax.lax.psum(jnp.sin(x), "batch", axis_index_groups=GROUPINGS["uneven"])
        whole = jax.lax.psum(x + 1.0, "batch")
        return pairs + uneven, whole

    x = jax.device_put(np.arange(8 * 6, dtype=np.float32) / 7.0, NamedSharding(mesh, spec))

    def run(f):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))

    got, text, want = overlapped_and_plain(run, step, x, axis_name="batch")
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)
    assert "psum" not in text.replace("jaxring", "")
    assert text.count("jaxring_allreduce_start") == 3, text
