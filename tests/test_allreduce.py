"""jaxring.allreduce against lax.psum and numpy, computed in the same test."""

import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P
from reports import REPORT_SOURCE, reports

import jaxring
from jaxring import _jaxring

FLOATS = [jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64]
INTS = [jnp.int8, jnp.int16, jnp.int32, jnp.int64, jnp.uint8, jnp.uint16, jnp.uint32, jnp.uint64]
# In one process "auto" picks direct; the ring is asked for by name.
ALGORITHMS = ["ring", "direct", "exchange"]
LAX = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin, "mean": jax.lax.pmean}


def mesh_of(*shape, names=("i",)):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, devices=jax.devices()[:n])


def put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def per_rank(fn, mesh, x, axes="i", check_vma=False, **kw):
    """Runs fn(v, axes) per device; returns every device's result stacked."""
    spec = P(*mesh.axis_names)
    f = jax.jit(
        jax.shard_map(
            lambda v: fn(v, axes, **kw),
            mesh=mesh,
            in_specs=spec,
            out_specs=spec,
            check_vma=check_vma,
        )
    )
    out = f(put(x, mesh, spec))
    if out.size == 0:
        # jax 0.10 cannot fetch a sharded array with no elements; its shape
        # is all there is to compare.
        return np.zeros(out.shape, out.dtype)
    return np.asarray(out)


def lax_prod(v, axes):
    # lax has no pprod: gather and multiply in order, exactly like numpy.
    g = jax.lax.all_gather(v, axes)
    return jnp.prod(g, axis=0, dtype=v.dtype)


def inputs(dtype, shape, seed=0, small=False):
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        lo, hi = (0, 3) if small else (info.min, info.max)
        return rng.integers(lo, hi, shape, dtype=dt, endpoint=True)
    if small:
        return rng.integers(-4, 5, shape).astype(dt)
    return rng.standard_normal(shape).astype(dt)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", INTS)
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
def test_integers_bit_identical_to_lax(dtype, op, algorithm):
    mesh = mesh_of(8)
    x = inputs(dtype, (8, 1003), small=(op == "prod"))
    ref = lax_prod if op == "prod" else LAX[op]
    got = per_rank(functools.partial(jaxring.allreduce, op=op, algorithm=algorithm), mesh, x)
    want = per_rank(ref, mesh, x)
    assert got.dtype == want.dtype
    assert np.array_equal(got, want)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", ["sum", "max", "min", "mean", "prod"])
def test_floats_match_lax_within_rounding(dtype, op, algorithm):
    mesh = mesh_of(8)
    x = inputs(dtype, (8, 2049), seed=3)
    if op == "prod":
        x = (1 + 0.1 * x.astype(np.float32)).astype(x.dtype)
    ref = lax_prod if op == "prod" else LAX[op]
    got = per_rank(functools.partial(jaxring.allreduce, op=op, algorithm=algorithm), mesh, x)
    want = per_rank(ref, mesh, x)
    exact64 = np.prod(x.astype(np.float64), axis=0) if op == "prod" else None
    if op in ("max", "min"):
        assert np.array_equal(got, want)
        return
    g, w = got.astype(np.float64), want.astype(np.float64)
    # Each of the p-1 reduce-scatter hops (direct: each of the p-1 additions)
    # rounds once to the element type.
    eps = float(jnp.finfo(dtype).eps)
    hops = 7
    scale = np.abs(x.astype(np.float64)).sum(0) if op != "prod" else np.abs(exact64)
    if op == "mean":
        scale = scale / 8
    bound = (hops + 1) * eps * scale + 1e-30
    assert (np.abs(g - w) <= 2 * bound).all()
    if exact64 is not None:
        assert (np.abs(g[0] - exact64) <= bound).all()


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_exact_small_integers_in_floats_bit_identical(dtype):
    mesh = mesh_of(8)
    x = inputs(dtype, (8, 500), small=True)
    got = per_rank(jaxring.allreduce, mesh, x)
    assert np.array_equal(got, per_rank(jax.lax.psum, mesh, x))
    assert np.array_equal(got[0], x.astype(np.float64).sum(0).astype(x.dtype))


@settings(max_examples=40, deadline=None)
@given(
    world=st.integers(1, 8),
    rings=st.integers(1, 4),
    chunk_bytes=st.sampled_from([1, 4, 64, 1000, 4096, 1 << 20]),
    count=st.one_of(st.integers(0, 40), st.integers(0, 100_000)),
    dtype=st.sampled_from(FLOATS + INTS),
    op=st.sampled_from(["sum", "max"]),
    algorithm=st.sampled_from(ALGORITHMS),
)
def test_any_world_rings_chunk_and_count(world, rings, chunk_bytes, count, dtype, op, algorithm):
    mesh = mesh_of(world)
    x = inputs(dtype, (world, count), seed=count, small=True)
    got = per_rank(
        functools.partial(
            jaxring.allreduce, op=op, rings=rings, chunk_bytes=chunk_bytes, algorithm=algorithm
        ),
        mesh,
        x,
    )
    want = per_rank(LAX[op], mesh, x)
    assert np.array_equal(got, want)
    # Every rank holds bit-identical results.
    assert all(np.array_equal(got[0].view(np.uint8), g.view(np.uint8)) for g in got)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("op", ["min", "max", "sum"])
def test_ranks_agree_bitwise_on_signed_zeros_and_nan_payloads(algorithm, op):
    """min(+0, -0) and the payload of NaN + NaN depend on the operands'
    order: every rank must still get the same bits (the exchange's partners
    order them alike)."""
    rng = np.random.default_rng(7)
    # +0, -0, 1, and (rarely, so most elements have none) three NaNs.
    bits = rng.choice(
        np.array(
            [0x00000000, 0x80000000, 0x3F800000, 0x7FC00001, 0x7FC12345, 0xFFC00007], np.uint32
        ),
        size=(8, 4096),
        p=[0.33, 0.33, 0.32, 0.01, 0.005, 0.005],
    )
    x = bits.view(np.float32)
    got = per_rank(functools.partial(jaxring.allreduce, op=op, algorithm=algorithm), mesh_of(8), x)
    assert all(np.array_equal(got[0].view(np.uint32), g.view(np.uint32)) for g in got)
    want = {"min": np.min, "max": np.max, "sum": np.sum}[op](x, axis=0)  # NaN wins
    assert np.array_equal(np.isnan(got[0]), np.isnan(want))
    assert np.array_equal(got[0][~np.isnan(want)], want[~np.isnan(want)])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_large_count_and_ranks_agree_bitwise_and_runs_repeat(algorithm):
    mesh = mesh_of(8)
    x = inputs(np.float32, (8, 1_000_003), seed=5)
    reduce = functools.partial(jaxring.allreduce, rings=3, chunk_bytes=65536, algorithm=algorithm)
    a = per_rank(reduce, mesh, x)
    b = per_rank(reduce, mesh, x)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert all(np.array_equal(a[0].view(np.uint32), r.view(np.uint32)) for r in a)
    np.testing.assert_allclose(a[0], x.astype(np.float64).sum(0), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("axes", ["x", "y", ("x", "y"), ("y", "x")])
def test_two_dimensional_mesh_one_ring_per_group(axes):
    mesh = mesh_of(4, 2, names=("x", "y"))
    x = inputs(np.int32, (4, 2, 301), seed=7)
    got = per_rank(jaxring.allreduce, mesh, x, axes=axes)
    assert np.array_equal(got, per_rank(jax.lax.psum, mesh, x, axes=axes))


def test_pytree_leaves_fused_and_mean():
    mesh = mesh_of(8)
    tree = {
        "w": np.ones((8, 3, 4), np.float32),
        "b": np.arange(8 * 5, dtype=np.int32).reshape(8, 5),
        "s": np.linspace(0, 1, 8).astype(np.float64).reshape(8, 1),
    }
    spec = P("i")

    def step(t, fn):
        return fn(t, "i")

    f = lambda fn: jax.jit(
        jax.shard_map(
            functools.partial(step, fn=fn),
            mesh=mesh,
            in_specs=spec,
            out_specs=spec,
            check_vma=False,
        )
    )
    dev = jax.tree.map(lambda a: put(a, mesh, spec), tree)
    for ours, theirs in [(jaxring.allreduce, jax.lax.psum), (jaxring.pmean, jax.lax.pmean)]:
        got, want = f(ours)(dev), f(theirs)(dev)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert g.dtype == w.dtype
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)


def test_check_vma_result_is_invariant_like_psum():
    mesh = mesh_of(8)
    x = put(np.arange(16.0).reshape(8, 2), mesh, P("i"))
    # out_specs=P() requires an invariant result: accepted for psum and for us.
    ours = jax.jit(
        jax.shard_map(
            lambda v: jaxring.allreduce(v, "i"),
            mesh=mesh,
            in_specs=P("i"),
            out_specs=P(),
            check_vma=True,
        )
    )
    theirs = jax.jit(
        jax.shard_map(
            lambda v: jax.lax.psum(v, "i"),
            mesh=mesh,
            in_specs=P("i"),
            out_specs=P(),
            check_vma=True,
        )
    )
    assert np.array_equal(ours(x), theirs(x))
    # And a plain varying value is still rejected there, as for psum.
    with pytest.raises(Exception, match="(?i)vary|invariant|out_specs"):
        jax.jit(
            jax.shard_map(
                lambda v: v * 2, mesh=mesh, in_specs=P("i"), out_specs=P(), check_vma=True
            )
        )(x)


def test_pmap():
    x = inputs(np.float32, (8, 33), seed=9, small=True)
    got = jax.pmap(lambda v: jaxring.allreduce(v, "b"), axis_name="b")(x)
    want = jax.pmap(lambda v: jax.lax.psum(v, "b"), axis_name="b")(x)
    assert np.array_equal(np.asarray(got), np.asarray(want))
    got = jax.pmap(lambda v: jaxring.pmean(v, "b"), axis_name="b")(x)
    want = jax.pmap(lambda v: jax.lax.pmean(v, "b"), axis_name="b")(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
def test_vmap_axis_reduced_locally(op):
    x = inputs(np.int32, (5, 7), seed=11, small=True)
    ref = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}.get(op)
    got = jax.vmap(lambda v: jaxring.allreduce(v, "v", op=op), axis_name="v")(x)
    want = (
        jax.vmap(lambda v: ref(v, "v"), axis_name="v")(x)
        if ref
        else np.broadcast_to(np.prod(x, 0, dtype=np.int32), x.shape)
    )
    assert np.array_equal(np.asarray(got), np.asarray(want))


def test_vmap_inside_shard_map_with_mixed_axes():
    mesh = mesh_of(4)
    x = inputs(np.float32, (4, 3, 6), seed=12, small=True)

    def body(fn):
        def f(v):  # v: (1, 3, 6)
            return jax.vmap(lambda u: fn(u, ("i", "v")), axis_name="v", in_axes=1, out_axes=1)(v)

        return jax.jit(
            jax.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False)
        )

    xs = put(x, mesh, P("i"))
    assert np.array_equal(
        np.asarray(body(jaxring.allreduce)(xs)), np.asarray(body(jax.lax.psum)(xs))
    )

    # vmapped over an axis that is not reduced: elementwise per batch member.
    def g(fn):
        return jax.jit(
            jax.shard_map(
                lambda v: jax.vmap(lambda u: fn(u, "i"), in_axes=1, out_axes=1)(v),
                mesh=mesh,
                in_specs=P("i"),
                out_specs=P("i"),
                check_vma=False,
            )
        )

    assert np.array_equal(np.asarray(g(jaxring.allreduce)(xs)), np.asarray(g(jax.lax.psum)(xs)))


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("reducer", ["sum", "mean"])
def test_grad_matches_psum(check_vma, reducer):
    mesh = mesh_of(8)
    w = np.linspace(-1, 1, 6).astype(np.float32)
    x = inputs(np.float32, (8, 6), seed=13)
    ours = jaxring.allreduce if reducer == "sum" else jaxring.pmean
    theirs = jax.lax.psum if reducer == "sum" else jax.lax.pmean

    def make(red):
        def loss(w, xb):
            return jnp.sum(red(jnp.tanh(xb * w), "i") ** 2)

        def step(w, xb):
            l, g = jax.value_and_grad(loss)(w, xb)
            return l[None], g[None]

        return jax.jit(
            jax.shard_map(
                step,
                mesh=mesh,
                in_specs=(P(), P("i")),
                out_specs=(P("i"), P("i")),
                check_vma=check_vma,
            )
        )

    xs = put(x, mesh, P("i"))
    (l1, g1), (l2, g2) = make(ours)(w, xs), make(theirs)(w, xs)
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), rtol=1e-5, atol=1e-6)


def test_grad_under_pmap_matches_psum():
    x = inputs(np.float32, (8, 4), seed=14)

    def make(red):
        return jax.pmap(jax.grad(lambda v: jnp.sum(red(v, "b") * v)), axis_name="b")

    np.testing.assert_allclose(
        np.asarray(make(jaxring.allreduce)(x)),
        np.asarray(make(jax.lax.psum)(x)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_jvp_and_linear_transpose():
    mesh = mesh_of(8)
    x = put(inputs(np.float32, (8, 5), seed=15), mesh, P("i"))
    t = put(inputs(np.float32, (8, 5), seed=16), mesh, P("i"))

    def jvp_of(red):
        f = lambda v, tv: jax.jvp(lambda u: red(u, "i") * 2.0, (v,), (tv,))
        return jax.jit(
            jax.shard_map(
                f, mesh=mesh, in_specs=(P("i"), P("i")), out_specs=(P("i"), P("i")), check_vma=False
            )
        )

    (p1, t1), (p2, t2) = jvp_of(jaxring.allreduce)(x, t), jvp_of(jax.lax.psum)(x, t)
    np.testing.assert_allclose(np.asarray(p1), np.asarray(p2), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(t1), np.asarray(t2), rtol=1e-5, atol=1e-5)

    def transpose_of(red):
        def f(v, ct):
            lin = jax.linear_transpose(lambda u: red(u, "i"), v)
            return lin(ct)[0]

        return jax.jit(
            jax.shard_map(
                f, mesh=mesh, in_specs=(P("i"), P("i")), out_specs=P("i"), check_vma=False
            )
        )

    np.testing.assert_allclose(
        np.asarray(transpose_of(jaxring.allreduce)(x, t)),
        np.asarray(transpose_of(jax.lax.psum)(x, t)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_max_is_not_differentiable_with_a_clear_error():
    mesh = mesh_of(8)
    x = put(np.ones((8, 2), np.float32), mesh, P("i"))
    f = jax.jit(
        jax.shard_map(
            jax.grad(lambda v: jnp.sum(jaxring.allreduce(v, "i", op="max"))),
            mesh=mesh,
            in_specs=P("i"),
            out_specs=P("i"),
            check_vma=False,
        )
    )
    with pytest.raises(TypeError, match="not differentiable"):
        f(x)


def test_nested_jit_inside_shard_map():
    mesh = mesh_of(8)
    inner = jax.jit(lambda v: jaxring.allreduce(v * 2, "i") + 1)
    x = put(np.arange(8.0).reshape(8, 1), mesh, P("i"))
    f = jax.jit(jax.shard_map(inner, mesh=mesh, in_specs=P("i"), out_specs=P(), check_vma=True))
    assert float(np.asarray(f(x)).ravel()[0]) == 2 * 28 + 1


# ---- errors -----------------------------------------------------------------


def _in_mesh(fn, x=None, check_vma=False):
    mesh = mesh_of(8)
    x = put(np.ones((8, 4), np.float32) if x is None else x, mesh, P("i"))
    return jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=check_vma)
    )(x)


def _error_of(fn):
    try:
        fn()
    except Exception as e:
        return e
    raise AssertionError("no error raised")


def test_unknown_axis_name_reads_like_jax():
    """Code that matches lax.psum's message matches jaxring's."""
    ours = _error_of(lambda: _in_mesh(lambda v: jaxring.allreduce(v, "nope")))
    theirs = _error_of(lambda: _in_mesh(lambda v: jax.lax.psum(v, "nope")))
    assert type(ours) is type(theirs) is NameError
    assert str(theirs) in str(ours) and "unbound axis name: nope" in str(ours)


def test_outside_any_mapped_context():
    with pytest.raises(NameError, match="unbound axis name: i"):
        jax.jit(lambda v: jaxring.allreduce(v, "i"))(jnp.ones(3))
    with pytest.raises(NameError, match="unbound axis name: i"):
        jaxring.allreduce(jnp.ones(3), "i")
    with pytest.raises(
        NameError,
        match=r"over 'i', which no enclosing map binds; "
        r"no axis is bound here \(this is not inside "
        r"jax\.shard_map, jax\.pmap or jax\.vmap\)",
    ):
        jax.jit(lambda v: jaxring.allreduce(v, "i"))(jnp.ones(3))


def test_a_misspelt_axis_name_names_the_axes_bound():
    with pytest.raises(
        NameError,
        match=r"asked to reduce over 'bacth', which no "
        r"enclosing map binds; the axes bound here "
        r"are 'i': pass one of those",
    ):
        _in_mesh(lambda v: jaxring.allreduce(v, "bacth"))
    # A tuple names the axis of it that is not bound; under vmap inside
    # shard_map both maps' axes are listed.
    with pytest.raises(
        NameError,
        match=r"over 'j', which no enclosing map binds; "
        r"the axes bound here are 'i', 'k'",
    ):
        _in_mesh(lambda v: jax.vmap(lambda r: jaxring.allreduce(r, ("i", "j")), axis_name="k")(v))


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
@pytest.mark.parametrize("reducer", [jaxring.psum, jaxring.pmean])
def test_complex_matches_lax(dtype, reducer):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((8, 5)) + 1j * rng.standard_normal((8, 5))).astype(dtype)
    lax_reducer = {jaxring.psum: jax.lax.psum, jaxring.pmean: jax.lax.pmean}[reducer]
    # A complex leaf and a float leaf of the same width share one operation.
    got = _in_mesh(lambda v: reducer({"c": v, "r": v.real}, "i"), x=x)
    want = _in_mesh(lambda v: lax_reducer({"c": v, "r": v.real}, "i"), x=x)
    for k in ("c", "r"):
        assert got[k].dtype == want[k].dtype
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5)


def test_complex_gradient_matches_lax():
    x = (np.arange(8 * 3) + 0.5j * np.arange(8 * 3)).astype(np.complex64).reshape(8, 3)

    def grad_of(reducer):
        def loss(v):
            return jnp.sum(jnp.abs(reducer(v * v, "i")) ** 2)

        return _in_mesh(lambda v: jax.grad(loss)(v), x=x)

    np.testing.assert_allclose(
        np.asarray(grad_of(jaxring.psum)), np.asarray(grad_of(jax.lax.psum)), rtol=1e-5
    )


@pytest.mark.parametrize("op", ["max", "min", "prod"])
def test_complex_without_an_order_is_refused(op):
    x = np.ones((8, 4), np.complex64)
    with pytest.raises(TypeError, match=f"op='{op}' is not defined for complex64"):
        _in_mesh(lambda v: jaxring.allreduce(v, "i", op=op), x=x)


def test_bool_matches_lax():
    x = np.random.default_rng(4).random((8, 6)) < 0.5
    x[:, 0], x[:, 1] = True, False  # all and none
    cases = {
        "sum": (jaxring.psum, jax.lax.psum),
        "mean": (jaxring.pmean, jax.lax.pmean),
        "max": (lambda v, a: jaxring.allreduce(v, a, op="max"), jax.lax.pmax),
        "min": (lambda v, a: jaxring.allreduce(v, a, op="min"), jax.lax.pmin),
    }
    for name, (ours, theirs) in cases.items():
        got, want = (_in_mesh(lambda v: f(v, "i"), x=x) for f in (ours, theirs))
        assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    prod = _in_mesh(lambda v: jaxring.allreduce(v, "i", op="prod"), x=x)
    np.testing.assert_array_equal(
        np.asarray(prod), np.asarray(_in_mesh(lambda v: jax.lax.pmin(v, "i"), x=x))
    )


def test_unsupported_dtype():
    x = np.ones((8, 4), np.float32)
    with pytest.raises(TypeError, match="unsupported dtype"):
        _in_mesh(lambda v: jaxring.allreduce(v.astype(jnp.float8_e4m3fn), "i"), x=x)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"op": "avg"}, "op must be one of"),
        ({"rings": 0}, "rings must be"),
        ({"rings": 1.5}, "rings must be"),
        # Beyond what the handlers can hold:
        # refused, never narrowed or wrapped.
        ({"rings": 2**31}, "rings must be an int from 1 to 64"),
        ({"rings": 2**32 + 1}, "rings must be"),
        ({"rings": 65}, "rings must be"),
        ({"chunk_bytes": -4}, "chunk_bytes must be"),
        ({"chunk_bytes": 2**64}, "chunk_bytes must be"),
        ({"timeout_s": 0}, "timeout_s must be"),
        ({"timeout_s": float("inf")}, "timeout_s must be a finite"),
        ({"timeout_s": float("nan")}, "timeout_s must be"),
        ({"timeout_s": 1e10}, "at most 604800"),
    ],
)
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        _in_mesh(lambda v: jaxring.allreduce(v, "i", **kw))


def test_positional_axis_rejected():
    with pytest.raises(TypeError, match="named axes only"):
        _in_mesh(lambda v: jaxring.allreduce(v, 0))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_missing_rank_times_out_with_its_name(algorithm):
    """Only rank 0 calls the allreduce: it must fail, naming ranks 1..7."""
    mesh = mesh_of(8)
    x = put(np.ones((8, 4), np.float32), mesh, P("i"))

    def f(v):
        return jax.lax.cond(
            jax.lax.axis_index("i") == 0,
            lambda u: jaxring.allreduce(u, "i", timeout_s=1.0, algorithm=algorithm),
            lambda u: u,
            v,
        )

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False))
    # The exchange plan runs on the plan executor, which names the partner
    # rank 0 waits for.
    missing = (
        r"timed out after 1 s on rank 0: ring 0 \(exchange along tier 0\) "
        r"waits for rank 1 \(process 0\): 0 of 1 chunks arrived"
        if algorithm == "exchange"
        else r"timed out after 1 s: rank\(s\) 1, 2, 3, 4, 5, 6, 7 of 8 never arrived"
    )
    with pytest.raises(jaxring.CollectiveTimeoutError, match=missing) as e:
        with jaxring.translate_errors():
            np.asarray(g(x))
    # XLA's own exception is kept as the cause; the operation is named.
    assert e.value.__cause__ is not None and not isinstance(e.value.__cause__, jaxring.JaxringError)
    assert re.fullmatch(r"op \d+, group 0, run -?\d+", e.value.operation), e.value.operation
    assert e.value.peer_process is None  # one process: no peer to blame
    # The transport keeps the failed op only until its grace period ends, and
    # later operations still work.
    assert np.array_equal(
        np.asarray(_in_mesh(lambda v: jaxring.allreduce(v, "i"))), np.full((8, 4), 8.0, np.float32)
    )


def test_the_failure_tag_alone_picks_the_exception_and_the_peer():
    from jaxring._src.errors import translate

    # What a handler returns, as XLA reports it: its status, then the tag.
    lost = translate(
        RuntimeError(
            "UNAVAILABLE: [jaxring kind=peer_lost peer=2] jaxring allreduce (op 4, "
            "group 0, run 9, 8 x float32): process 2 (h:1) is unreachable: gone"
        )
    )
    assert type(lost) is jaxring.PeerLostError
    assert (lost.operation, lost.peer_process) == ("op 4, group 0, run 9", 2)
    # A peer's words come after the tag: whatever they say chooses nothing.
    reported = translate(
        RuntimeError(
            "FAILED_PRECONDITION: [jaxring kind=mismatch peer=1] jaxring allreduce "
            "(op 5, group 0, run 9): process 3 (h:1) is unreachable: timed out after "
            "[jaxring kind=peer_lost peer=3] [reported by process 1]"
        )
    )
    assert type(reported) is jaxring.MismatchError and reported.peer_process == 1
    timeout = translate(
        RuntimeError(
            "DEADLINE_EXCEEDED: [jaxring kind=timeout peer=-1] jaxring allreduce "
            "(op 6, group 0, run 9) timed out after 1 s: rank(s) 1 never arrived"
        )
    )
    assert type(timeout) is jaxring.CollectiveTimeoutError and timeout.peer_process is None
    resource = translate(
        RuntimeError(
            "RESOURCE_EXHAUSTED: [jaxring kind=resource peer=0] jaxring allreduce "
            "(op 7, group 0, run 9): process 0 holds 4096 operations"
        )
    )
    assert type(resource) is jaxring.JaxringError and resource.peer_process == 0
    # Untagged: a jaxring message without a kind, or not jaxring's at all.
    assert type(translate(RuntimeError("jaxring allreduce (op 1): ?"))) is jaxring.JaxringError
    assert translate(RuntimeError("something else")) is None


def test_translate_errors_passes_other_exceptions_through():
    with pytest.raises(ValueError, match="not jaxring's") as e:
        with jaxring.translate_errors():
            raise ValueError("not jaxring's")
    assert type(e.value) is ValueError

    @jaxring.translate_errors()
    def fails():
        raise KeyError("k")

    with pytest.raises(KeyError):
        fails()


def test_transport_holds_nothing_after_operations():
    _in_mesh(lambda v: jaxring.allreduce(v, "i"))
    # Failed ops from other tests may linger for their grace period only;
    # successful ones are dropped as soon as every rank has joined.
    before = _jaxring.testing.inprocess_pending_ops()
    for _ in range(5):
        _in_mesh(lambda v: jaxring.allreduce(v, "i"))
    # An operation is held only while its ranks are still joining; one that
    # an earlier test dispatched and did not wait for may be in that window
    # just now, so the count is given a moment to settle (a leak would not).
    deadline = time.monotonic() + 5.0
    while _jaxring.testing.inprocess_pending_ops() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _jaxring.testing.inprocess_pending_ops() <= before


# ---- configuration ----------------------------------------------------------


def test_config_update_and_validation():
    assert jaxring.config.rings >= 1
    jaxring.config.update("rings", 3)
    try:
        assert jaxring.config.rings == 3
        got = _in_mesh(lambda v: jaxring.allreduce(v, "i"))
        assert np.array_equal(np.asarray(got), np.full((8, 4), 8.0, np.float32))
    finally:
        jaxring.config.reset("rings")
    with pytest.raises(ValueError, match="rings must be an int from 1 to 64"):
        jaxring.config.update("rings", 0)
    with pytest.raises(AttributeError, match="no setting"):
        jaxring.config.update("ringz", 2)
    with pytest.raises(AttributeError):
        jaxring.config.rings = 2


@pytest.mark.jax_independent  # the settings' parsing, in new processes
def test_environment_variables(script):
    res = script(
        REPORT_SOURCE
        + "import jaxring\n"
        + "c = jaxring.config\n"
        + "report('config', rings=c.rings, chunk_bytes=c.chunk_bytes, timeout_s=c.timeout_s,\n"
        + "       algorithm=c.algorithm)\n",
        env={
            "JAXRING_RINGS": "4",
            "JAXRING_CHUNK_BYTES": "4096",
            "JAXRING_TIMEOUT_S": "7.5",
            "JAXRING_ALGORITHM": "ring",
        },
    )
    assert res.returncode == 0, res.stderr
    # The one line on stdout: each setting with its type.
    assert len(res.stdout.splitlines()) == 1, res.stdout
    (said,) = reports(res.stdout)
    assert said == {
        "kind": "config",
        "rings": 4,
        "chunk_bytes": 4096,
        "timeout_s": 7.5,
        "algorithm": "ring",
    }, said
    assert [type(said[k]) for k in ("rings", "chunk_bytes", "timeout_s")] == [int, int, float]
    res = script("import jaxring", env={"JAXRING_RINGS": "zero"})
    assert res.returncode != 0 and "JAXRING_RINGS='zero': expected an int from 1" in res.stderr
    res = script("import jaxring", env={"JAXRING_RINGS": "2147483648"})
    assert res.returncode != 0 and "JAXRING_RINGS='2147483648': expected" in res.stderr
    res = script("import jaxring", env={"JAXRING_TIMEOUT_S": "inf"})
    assert res.returncode != 0 and "JAXRING_TIMEOUT_S='inf': expected a finite" in res.stderr
    res = script("import jaxring", env={"JAXRING_CPU_THREADS": "abc"})
    assert (
        res.returncode != 0 and "JAXRING_CPU_THREADS='abc': expected a thread count" in res.stderr
    )
    res = script("import jaxring", env={"JAXRING_ALGORITHM": "tree"})
    assert res.returncode != 0 and "JAXRING_ALGORITHM='tree': expected one of" in res.stderr
    res = script("import jaxring", env={"JAXRING_HUGE_PAGES": "yes"})
    assert res.returncode != 0 and "JAXRING_HUGE_PAGES='yes': expected 1" in res.stderr
    res = script("import jaxring", env={"JAXRING_CPU_GANG_START": "maybe"})
    assert (
        res.returncode != 0
        and (
            "JAXRING_CPU_GANG_START='maybe': expected True or "
            "False (in the environment: 1, true, yes or on; "
            "0, false, no or off)"
        )
        in res.stderr
    )


@pytest.mark.parametrize("raw", ["yes", "no", "true", "off", " 0", "2"])
def test_huge_pages_takes_1_or_0_only(monkeypatch, raw):
    """The C++ side reads any value but "0" as 1 ("no" would ask for huge
    pages), so everything but 1 and 0 is refused before it is read."""
    from jaxring._src import runtime

    monkeypatch.setenv("JAXRING_HUGE_PAGES", raw)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"JAXRING_HUGE_PAGES={raw!r}: expected 1 (ask for transparent huge pages "
            "on CPU results of 4 MiB or more) or 0 (do not)"
        ),
    ):
        runtime.check_huge_pages_setting()


@pytest.mark.parametrize("raw", ["1", "0", ""])
def test_huge_pages_settings_that_are_accepted(monkeypatch, raw):
    from jaxring._src import runtime

    monkeypatch.setenv("JAXRING_HUGE_PAGES", raw)
    runtime.check_huge_pages_setting()


def _op_ids_in(lowered_text, attribute="op_id"):
    return [
        int(m)
        for m in re.findall(
            r"custom_call @jaxring_allreduce(?:_start)?_cpu\(.*?" + attribute + r" = (\d+)",
            lowered_text,
        )
    ]


def test_every_call_gets_its_own_op_id():
    """Two same-shaped allreduces, a jitted helper called twice and a remat
    body called twice: JAX would reuse one lowering (and so one op id) for
    each pair, and devices reaching the pair in different orders would then
    add one call's data to the other's."""
    mesh = mesh_of(4)

    def step(red):
        helper = jax.jit(lambda v: red(v, "i"))
        rematted = jax.checkpoint(lambda v: jnp.sin(red(v, "i")))

        def f(v):
            return (
                red(v, "i")
                + 10 * red(v * 3.0, "i")
                + 100 * helper(v + 1.0)
                + 1000 * helper(v * v)
                + rematted(v)
                + rematted(2 * v)
            )

        return jax.jit(
            jax.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False)
        )

    x = put(np.linspace(-1, 1, 4 * 64, dtype=np.float32), mesh, P("i"))
    ids = _op_ids_in(step(jaxring.allreduce).lower(x).as_text())
    assert len(ids) == 6 and len(set(ids)) == 6, ids
    np.testing.assert_allclose(
        np.asarray(step(jaxring.allreduce)(x)), np.asarray(step(jax.lax.psum)(x)), rtol=1e-5
    )


def test_op_ids_depend_on_the_call_slot_not_on_other_lowerings():
    """Every process must give a call the same op id, even when one of them
    lowered other jaxring functions first (an evaluation only process 0
    runs); a second lowering of the same program in one process gets new ids
    (XLA gives identical programs the same run ids); and a slot called with
    other shapes gets other op ids but keeps its slot ids, so processes that
    differ there meet at one slot and are told they differ."""
    mesh = mesh_of(4)
    x = put(np.ones((4, 8), np.float32), mesh, P("i"))
    wide = put(np.ones((4, 16), np.float32), mesh, P("i"))

    def step(scale):
        def train_step(v):
            return jaxring.psum(v, "i") + jaxring.pmean(scale * v, "i")

        return jax.jit(
            jax.shard_map(train_step, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False)
        )

    def ids(f, arg):
        text = f.lower(arg).as_text()
        return _op_ids_in(text), _op_ids_in(text, "slot_id")

    first, first_slots = ids(step(2.0), x)
    other = jax.jit(
        jax.shard_map(
            lambda v: jaxring.psum(v, "i") * 3,
            mesh=mesh,
            in_specs=P("i"),
            out_specs=P("i"),
            check_vma=False,
        )
    )
    others, other_slots = ids(other, x)
    wider, wider_slots = ids(step(2.0), wide)
    again, again_slots = ids(step(2.0), x)
    assert len(first) == 2 and len(set(first)) == 2, first
    assert len(first_slots) == 2 and len(set(first_slots)) == 2, first_slots
    assert not set(others) & set(first) and not set(other_slots) & set(first_slots)
    # Other shapes: the same slots, other op ids.
    assert wider_slots == first_slots and not set(wider) & set(first), (first, wider)
    # The same description again: the slot's second lowering, new ids of both kinds.
    assert len(again) == 2 and not set(again) & set(first + wider), (first, again)
    assert not set(again_slots) & set(first_slots)
    all_ids = first + others + wider + again + first_slots + again_slots
    assert all(0 < i < 2**63 for i in all_ids)


def test_inside_scan_and_while_loops():
    """One lowered call site runs once per iteration under one run id."""
    mesh = mesh_of(8)
    x = put(np.arange(8.0, dtype=np.float32).reshape(8, 1), mesh, P("i"))

    def scanned(red):
        def body(c, _):
            return red(c, "i") / 8.0 + 1.0, None

        def f(v):
            out, _ = jax.lax.scan(body, v, None, length=25)
            out = jax.lax.fori_loop(0, 5, lambda i, c: red(c, "i") / 8.0, out)
            return out

        return jax.jit(
            jax.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False)
        )

    np.testing.assert_allclose(
        np.asarray(scanned(jaxring.allreduce)(x)), np.asarray(scanned(jax.lax.psum)(x)), rtol=1e-6
    )


def _algorithm_ids_in(lowered_text):
    return [
        int(m)
        for m in re.findall(
            r"custom_call @jaxring_allreduce(?:_start)?_cpu\(.*?algorithm = (\d+)", lowered_text
        )
    ]


def test_auto_algorithm_is_direct_in_one_process_and_modelled_under_link_emulation():
    mesh = mesh_of(4)
    x = put(np.ones(4 * 8, np.float32), mesh, P("i"))
    large = put(np.ones(4 * 16384, np.float32), mesh, P("i"))  # 64 KiB per device

    def lowered(operand=x, **kw):
        f = jax.jit(
            jax.shard_map(
                lambda v: jaxring.allreduce(v, "i", **kw),
                mesh=mesh,
                in_specs=P("i"),
                out_specs=P("i"),
                check_vma=False,
            )
        )
        return f.lower(operand).as_text()

    assert _algorithm_ids_in(lowered()) == [1]  # direct
    assert _algorithm_ids_in(lowered(algorithm="ring")) == [0]
    jaxring.config.update("cpu_link", "10Gbit,1us")
    try:
        # The ring, or the exchange up to exchange_max_bytes (512 B) and
        # where the link's model predicts it faster (about 10 KiB here).
        assert _algorithm_ids_in(lowered(large)) == [0]
        assert _algorithm_ids_in(lowered()) == [3]
        with pytest.raises(ValueError, match="no transfers for cpu_link to emulate"):
            lowered(algorithm="direct")
    finally:
        jaxring.config.reset("cpu_link")
    jaxring.config.update("algorithm", "ring")
    try:
        assert _algorithm_ids_in(lowered()) == [0]
    finally:
        jaxring.config.reset("algorithm")
    with pytest.raises(ValueError, match="algorithm must be one of"):
        lowered(algorithm="tree")


def test_exchange_takes_no_explicit_tiers_and_lowers_as_exchange():
    mesh = mesh_of(4)
    x = put(np.ones((4, 8), np.float32), mesh, P("i"))

    def lowered(**kw):
        f = jax.jit(
            jax.shard_map(
                lambda v: jaxring.allreduce(v, "i", **kw),
                mesh=mesh,
                in_specs=P("i"),
                out_specs=P("i"),
                check_vma=False,
            )
        )
        return f.lower(x).as_text()

    assert _algorithm_ids_in(lowered(algorithm="exchange")) == [_jaxring.ALGORITHMS["exchange"]]
    assert _algorithm_ids_in(lowered(algorithm="exchange", topology="flat")) == [
        _jaxring.ALGORITHMS["exchange"]
    ]
    with pytest.raises(ValueError, match="picks its own tiers"):
        lowered(algorithm="exchange", topology=(2, 2))


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
def test_a_value_every_rank_holds_is_reduced_where_it_is(op):
    """Under check_vma a value invariant over the axis (a gradient autodiff
    already summed) gives lax's result with nothing sent: no custom call."""
    mesh = jax.make_mesh((8,), ("batch",))
    x = jnp.asarray([0.5, -1.25, 2.0], jnp.float32)
    lax_op = {
        "sum": jax.lax.psum,
        "mean": jax.lax.pmean,
        "max": jax.lax.pmax,
        "min": jax.lax.pmin,
        "prod": lambda v, a: v**8,
    }[op]

    def run(f):
        g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P()))
        return g(x), g.lower(x).as_text()

    got, text = run(lambda v: jaxring.allreduce(v, "batch", op=op))
    want, _ = run(lambda v: lax_op(v, "batch"))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert "jaxring" not in text
    # A bool sum counts in int32, as lax.psum does.
    if op == "sum":
        got, _ = run(lambda v: jaxring.psum(v > 0, "batch"))
        np.testing.assert_array_equal(np.asarray(got), [8, 0, 8])
    # Varying values in the same call are still sent.
    mixed = jax.jit(
        jax.shard_map(
            lambda v, w: jaxring.allreduce((v, w), "batch", op=op),
            mesh=mesh,
            in_specs=(P(), P("batch")),
            out_specs=P(),
        )
    )
    w = jax.device_put(jnp.ones(8, jnp.float32), NamedSharding(mesh, P("batch")))
    assert "jaxring_allreduce" in mixed.lower(x, w).as_text()


def test_large_leaves_are_reduced_alone_and_small_ones_fused():
    """A leaf of a MiB or more is not copied into a fused buffer (on CPU a
    large one is mapped afresh each step): it is an operation of its own,
    with the leaf's own shape; the small leaves share one."""
    mesh = mesh_of(4)
    rng = np.random.default_rng(0)
    big = put(rng.standard_normal((4 * 512, 512)).astype(np.float32), mesh, P("i"))
    small = [put(rng.standard_normal((4, 16)).astype(np.float32), mesh, P("i")) for _ in range(2)]

    def run(reduce):
        f = jax.jit(
            jax.shard_map(
                lambda *v: reduce(list(v), "i"),
                mesh=mesh,
                in_specs=P("i"),
                out_specs=P(),
                check_vma=False,
            )
        )
        return f(big, *small), f.lower(big, *small).as_text()

    got, text = run(jaxring.pmean)
    want, _ = run(jax.lax.pmean)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    operands = sorted(
        line.rsplit("} : (", 1)[1].split(",")[0]
        for line in text.splitlines()
        if "jaxring_allreduce_cpu(" in line
    )
    assert operands == ["tensor<32xf32>", "tensor<512x512xf32>"], operands


def _world_sizes_sent(text: str) -> list[int]:
    """The world size of every jaxring allreduce a lowered module sends."""
    return sorted(int(m) for m in re.findall(r"jaxring_allreduce_cpu\(.*?world_size = (\d+)", text))


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
def test_a_value_varying_over_some_axes_is_sent_over_those_only(op):
    """Under check_vma, a reduction over ("a", "b") of a value that varies
    over "a" alone sends it over "a" (4 ranks, not 8) and counts the copies
    "b" holds locally. lax refuses such a value unless it is first made
    varying over "b" (pcast); jaxring gives that result."""
    mesh = mesh_of(4, 2, names=("a", "b"))
    rng = np.random.default_rng(3)
    # Values near 1: a product over 8 ranks stays in range, and lax's
    # reference for it takes logarithms.
    x = put((1 + 0.1 * rng.standard_normal((8, 3))).astype(np.float32), mesh, P("a"))
    y = put((1 + 0.1 * rng.standard_normal((8, 3))).astype(np.float32), mesh, P(("a", "b")))
    lax_op = {**LAX, "prod": lambda v, a: jnp.exp(jax.lax.psum(jnp.log(v), a))}[op]

    def varying_over_b(v):
        return jax.lax.pcast(v, "b", to="varying")

    def run(f):
        g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("a"), P(("a", "b"))), out_specs=P()))
        return g(x, y), g.lower(x, y).as_text()

    got, text = run(lambda v, w: jaxring.allreduce((v, w), ("a", "b"), op=op))
    want, _ = run(lambda v, w: (lax_op(varying_over_b(v), ("a", "b")), lax_op(w, ("a", "b"))))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    # One operation over the 4 ranks of "a", one over all 8 for the value
    # that varies over both.
    assert _world_sizes_sent(text) == [4, 8], text
    if op == "sum":
        # A bool sum counts in int32; its gradient is lax's.
        got, _ = run(lambda v, w: jaxring.psum(v > 1, ("a", "b")))
        want, _ = run(lambda v, w: jax.lax.psum(varying_over_b(v > 1), ("a", "b")))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

        def grads(reduce):
            return jax.jit(
                jax.shard_map(
                    jax.grad(lambda v: reduce(v * v, ("a", "b")).sum()),
                    mesh=mesh,
                    in_specs=P("a"),
                    out_specs=P("a"),
                )
            )(x)

        np.testing.assert_allclose(
            np.asarray(grads(jaxring.psum)),
            np.asarray(grads(lambda v, a: jax.lax.psum(varying_over_b(v), a))),
            rtol=1e-6,
        )
