"""Gradient compression: 16-bit wire formats (jaxring.allreduce's and
overlap's wire_dtype, jaxring.compression.wire16) and PowerSGD, each checked
against a reference computed in the same test (NumPy, lax.pmean)."""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxring
import jaxring.compression as jc
from jaxring._src import wire_format

N = 8
BF16 = np.dtype(jnp.bfloat16)


def mesh(world=N):
    return Mesh(np.array(jax.devices()[:world]), ("batch",))


def per_rank(rng, world, shape, scale=1.0):
    return (rng.normal(size=(world,) + shape) * scale).astype(np.float32)


def mapped(fn, world=N, in_specs=P("batch"), out_specs=P()):
    return jax.jit(jax.shard_map(fn, mesh=mesh(world), in_specs=in_specs, out_specs=out_specs))


# ---- jaxring.allreduce(wire_dtype=...) -------------------------------------


def test_wire_dtype_none_is_bit_identical_to_the_plain_allreduce():
    x = per_rank(np.random.default_rng(0), N, (1000,)).reshape(N * 1000)
    plain = mapped(lambda v: jaxring.allreduce(v, "batch"))(x)
    none = mapped(lambda v: jaxring.allreduce(v, "batch", wire_dtype=None))(x)
    assert np.asarray(plain).tobytes() == np.asarray(none).tobytes()


@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "algorithm,topology", [("ring", "flat"), ("direct", "flat"), ("ring", (4, 2))]
)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_wire_dtype_within_the_documented_bound(wire, algorithm, topology, op):
    rng = np.random.default_rng(1)
    count = 4099
    x = per_rank(rng, N, (count,))
    got = np.asarray(
        mapped(
            lambda v: jaxring.allreduce(
                v,
                "batch",
                op=op,
                wire_dtype=wire,
                algorithm=algorithm,
                topology=topology,
                rings=2,
                chunk_bytes=1024,
            )
        )(x.reshape(-1))
    )
    assert got.dtype == np.float32
    exact = x.astype(np.float64).sum(0)
    bound = wire_format.error_bound(
        np.dtype(jnp.dtype(wire)), N, np.abs(x.astype(np.float64)).sum(0)
    )
    if op == "mean":
        exact, bound = exact / N, bound / N
    err = np.abs(got - exact)
    assert np.all(err <= bound * (1 + 1e-6) + 1e-30), float((err - bound).max())
    # It did travel in 16 bits: float32 sums are far closer than that.
    f32 = np.asarray(
        mapped(
            lambda v: jaxring.allreduce(v, "batch", op=op, algorithm=algorithm, topology=topology)
        )(x.reshape(-1))
    )
    assert np.abs(f32 - exact).max() < err.max() / 16


def test_wire_dtype_is_the_sum_of_the_rounded_values_bit_for_bit():
    x = per_rank(np.random.default_rng(2), N, (777,)).reshape(-1)
    wired = mapped(lambda v: jaxring.allreduce(v, "batch", wire_dtype="bfloat16"))(x)
    by_hand = mapped(
        lambda v: jaxring.allreduce(v.astype(jnp.bfloat16), "batch").astype(jnp.float32)
    )(x)
    assert np.asarray(wired).tobytes() == np.asarray(by_hand).tobytes()


def test_wire_dtype_leaves_other_dtypes_as_they_are():
    x64 = np.arange(N * 5, dtype=np.float64) / 3
    xi = np.arange(N * 5, dtype=np.int32)

    def f(a, b):
        return jaxring.allreduce((a, b), "batch", wire_dtype="bfloat16")

    got = jax.jit(jax.shard_map(f, mesh=mesh(), in_specs=P("batch"), out_specs=P()))(x64, xi)
    want = jax.jit(
        jax.shard_map(
            lambda a, b: jax.lax.psum((a, b), "batch"),
            mesh=mesh(),
            in_specs=P("batch"),
            out_specs=P(),
        )
    )(x64, xi)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize(
    "kw,err,match",
    [
        (dict(wire_dtype="int8"), ValueError, "wire_dtype must be None"),
        (dict(wire_dtype="float8"), ValueError, "wire_dtype must be None"),
        (dict(wire_dtype="bfloat16", op="max"), ValueError, "applies to op='sum' or 'mean'"),
    ],
)
def test_wire_dtype_errors(kw, err, match):
    with pytest.raises(err, match=match):
        mapped(lambda v: jaxring.allreduce(v, "batch", **kw))(np.ones(N, np.float32))


# ---- overlap(wire_dtype=...) ------------------------------------------------


def _grad_step(params, x):
    def loss(p):
        h = x
        for w in p:
            h = jnp.tanh(h @ w)
        return jnp.sum(h**2)

    return jax.lax.psum(jax.grad(loss)(params), "batch")


def test_overlap_wire_dtype_sends_float32_as_bfloat16_within_the_bound():
    rng = np.random.default_rng(3)
    params = [jnp.asarray(rng.normal(0, 0.5, (32, 32)), jnp.float32) for _ in range(3)]
    x = rng.normal(size=(N * 4, 32)).astype(np.float32)
    # Without check_vma the gradient of replicated params is this rank's own.
    specs = dict(in_specs=(P(), P("batch")), out_specs=P(), check_vma=False)
    run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh(), **specs))
    wired = jaxring.overlap(_grad_step, axis_name="batch", bucket_mb=0.004, wire_dtype="bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxring.OverlapWarning)
        got = run(wired)(params, x)
    text = jax.make_jaxpr(run(wired))(params, x).pretty_print()
    assert "jaxring_allreduce_start" in text and " psum" not in text
    assert "new_dtype=bfloat16" in text

    # The reference: each rank's own gradient, summed exactly in float64.
    local = jax.jit(jax.vmap(jax.grad(lambda p, xb: jnp.sum(_fwd(p, xb) ** 2)), in_axes=(None, 0)))(
        params, x.reshape(N, 4, 32)
    )
    for g, per in zip(got, local):
        per = np.asarray(per, np.float64)
        bound = wire_format.error_bound(BF16, N, np.abs(per).sum(0))
        assert np.all(np.abs(np.asarray(g) - per.sum(0)) <= bound * (1 + 1e-6) + 1e-30)
        assert g.dtype == jnp.float32


def _fwd(p, h):
    for w in p:
        h = jnp.tanh(h @ w)
    return h


def test_overlap_wire_dtype_halves_the_bucket_bytes():
    params = [jnp.ones((64, 64), jnp.float32) for _ in range(2)]
    x = np.ones((N * 2, 64), np.float32)
    sizes = {}
    for wire in (None, "bfloat16"):
        step = jaxring.overlap(_grad_step, axis_name="batch", wire_dtype=wire)

        def body(p, xb, step=step):
            sizes[wire] = sum(b.nbytes for b in jaxring.explain(step, p, xb).buckets)
            return step(p, xb)

        jax.eval_shape(
            jax.shard_map(
                body, mesh=mesh(), in_specs=(P(), P("batch")), out_specs=P(), check_vma=False
            ),
            params,
            x,
        )
    assert sizes[None] == 2 * 64 * 64 * 4
    assert sizes["bfloat16"] == sizes[None] // 2


def test_overlap_wire_dtype_error():
    with pytest.raises(ValueError, match="jaxring.overlap: wire_dtype must be None"):
        jaxring.overlap(_grad_step, axis_name="batch", wire_dtype="float32")


# ---- jaxring.compression.wire16 ----------------------------------------------


def _apply(tx, grads_per_rank, steps=1, world=N):
    """Runs tx.update on each rank's gradients (a leading axis of world) for
    steps steps under shard_map; returns the updates of every step and the
    last state."""
    params = jax.tree_util.tree_map(lambda g: jnp.zeros(g.shape[1:], g.dtype), grads_per_rank)
    state = jc.for_ranks(tx.init(params), world)
    specs = jc.state_specs(state, "batch")

    def body(g, s):
        g = jax.tree_util.tree_map(lambda v: v[0], g)
        return tx.update(g, s)

    step = jax.jit(
        jax.shard_map(body, mesh=mesh(world), in_specs=(P("batch"), specs), out_specs=(P(), specs))
    )
    updates = []
    for _ in range(steps):
        u, state = step(grads_per_rank, state)
        updates.append(u)
    return updates, state


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_wire16_is_the_mean_within_the_bound(dtype):
    rng = np.random.default_rng(4)
    grads = {"w": per_rank(rng, N, (16, 8)), "b": per_rank(rng, N, (8,))}
    (got,), state = _apply(jc.wire16("batch", dtype=dtype), grads)
    wire = np.dtype(jnp.dtype(dtype))
    for k in grads:
        per = grads[k].astype(np.float64)
        bound = wire_format.error_bound(wire, N, np.abs(per).sum(0)) / N
        err = np.abs(np.asarray(got[k]) - per.mean(0))
        assert np.all(err <= bound * (1 + 1e-6)), k
        # The residual is each rank's own rounding error.
        r = np.asarray(state.residual[list(sorted(grads)).index(k)])
        np.testing.assert_array_equal(r, grads[k] - grads[k].astype(wire).astype(np.float32))


def test_wire16_error_feedback_keeps_the_applied_sum_bounded():
    # Two ranks hold the same gradient, so the ring's one addition of their
    # rounded values (x + x) is exact: what is left is the rounding each
    # rank makes, which error feedback carries over instead of dropping.
    g = np.random.default_rng(5).normal(size=(256,)).astype(np.float32)
    grads = np.broadcast_to(g, (2, 256)).copy()
    u = wire_format.UNIT_ROUNDOFF[BF16]
    for feedback in (True, False):
        steps = 64
        updates, _ = _apply(jc.wire16("batch", error_feedback=feedback), grads, steps, world=2)
        applied = np.cumsum([np.asarray(x, np.float64) for x in updates], axis=0)
        err = np.abs(applied - np.arange(1, steps + 1)[:, None] * g.astype(np.float64))
        if feedback:
            assert np.all(err <= 2 * u * np.abs(g)), "grows with the steps"
        else:  # the test can fail: without feedback the bias adds up
            assert err[-1].max() > 8 * u * np.abs(g).max()


# ---- jaxring.compression.powersgd: a NumPy reference ---------------------------


def _np_orthonormalize(p):
    cols = []
    for i in range(p.shape[1]):
        c = p[:, i].copy()
        for d in cols:
            c = c - (d @ c) * d
        n = np.linalg.norm(c)
        cols.append(c / n if n > 0 else c * 0)
    return np.stack(cols, axis=1)


def _np_powersgd(grads, q, residual, plan):
    """One PowerSGD step over ranks (grads[r] is rank r's), in float64."""
    world = len(grads)
    out, new_q, new_res = [], [], []
    for i, lp in enumerate(plan):
        per = [np.asarray(g[i], np.float64) for g in grads]
        if lp.how != "powersgd":
            out.append(np.mean(per, axis=0))
            new_q.append(None)
            new_res.append(None)
            continue
        ms = [(per[r] + residual[i][r]).reshape(lp.matrix) for r in range(world)]
        p = np.mean([m @ q[i] for m in ms], axis=0)
        p = _np_orthonormalize(p)
        qq = np.mean([m.T @ p for m in ms], axis=0)
        upd = p @ qq.T
        out.append(upd.reshape(lp.shape))
        new_q.append(qq)
        new_res.append([(m - upd).reshape(lp.shape) for m in ms])
    return out, new_q, new_res


@pytest.mark.parametrize("world,rank", [(2, 1), (4, 2), (8, 4)])
def test_powersgd_matches_a_numpy_reference_step_by_step(world, rank):
    rng = np.random.default_rng(6 + world)
    shapes = {"dense": (24, 16), "conv": (3, 3, 4, 8), "bias": (16,), "small": (4, 4)}
    tx = jc.powersgd("batch", rank=rank, min_size=64)
    params = {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}
    state0 = tx.init(params)
    plan = state0.plan
    assert [lp.how for lp in plan] == ["as is", "powersgd", "powersgd", "as is"]
    q = [None if x is None else np.asarray(x, np.float64) for x in state0.q]
    residual = [None if lp.how != "powersgd" else [np.zeros(lp.shape)] * world for lp in plan]
    state = jc.for_ranks(state0, world)
    specs = jc.state_specs(state, "batch")
    step = jax.jit(
        jax.shard_map(
            lambda g, s: tx.update(jax.tree_util.tree_map(lambda v: v[0], g), s),
            mesh=mesh(world),
            in_specs=(P("batch"), specs),
            out_specs=(P(), specs),
        )
    )
    for t in range(3):
        grads = {k: per_rank(rng, world, s) for k, s in shapes.items()}
        got, state = step(grads, state)
        leaves = [lp.path for lp in plan]
        per_rank_leaves = [[grads[k][r] for k in sorted(shapes)] for r in range(world)]
        want, q, residual = _np_powersgd(per_rank_leaves, q, residual, plan)
        for name, w in zip(sorted(shapes), want):
            np.testing.assert_allclose(
                np.asarray(got[name]), w, rtol=2e-4, atol=2e-5, err_msg=f"step {t} {name}"
            )
        for i, lp in enumerate(plan):
            if lp.how == "powersgd":
                np.testing.assert_allclose(np.asarray(state.q[i]), q[i], rtol=2e-4, atol=2e-5)
                np.testing.assert_allclose(
                    np.asarray(state.residual[i]), np.stack(residual[i]), rtol=2e-4, atol=2e-5
                )
        assert int(state.count) == t + 1
        assert leaves == [lp.path for lp in state.plan]


def test_powersgd_warm_up_is_the_plain_mean_then_compresses():
    rng = np.random.default_rng(7)
    grads = {"w": per_rank(rng, N, (32, 32))}
    updates, state = _apply(jc.powersgd("batch", rank=1, start_step=2, min_size=0), grads, steps=3)
    mean = grads["w"].mean(0)
    for u in updates[:2]:
        np.testing.assert_allclose(np.asarray(u["w"]), mean, rtol=1e-5, atol=1e-6)
    # Rank 1 of a random 32x32 mean is far from it.
    assert np.abs(np.asarray(updates[2]["w"]) - mean).max() > 0.1
    assert np.linalg.matrix_rank(np.asarray(updates[2]["w"]), tol=1e-4) == 1


def test_powersgd_without_warm_start_draws_new_factors_each_step():
    rng = np.random.default_rng(8)
    grads = {"w": per_rank(rng, N, (32, 32))}
    for warm in (True, False):
        _, state = _apply(jc.powersgd("batch", rank=2, warm_start=warm, min_size=0), grads, steps=2)
        assert int(state.count) == 2
    # Same seed, same first Q: the first update agrees either way.
    a, _ = _apply(jc.powersgd("batch", rank=2, warm_start=True, min_size=0), grads, 1)
    b, _ = _apply(jc.powersgd("batch", rank=2, warm_start=False, min_size=0), grads, 1)
    assert not np.array_equal(np.asarray(a[0]["w"]), np.asarray(b[0]["w"]))


@pytest.mark.parametrize("wire", [None, "bfloat16"])
def test_powersgd_error_feedback_recovers_a_constant_gradient(wire):
    # The mean residual is what the updates have left out so far: the
    # updates summed over T steps are T * mean - (mean residual), and the
    # residual stays bounded, so their error does not grow with T. With a
    # wire format too: the factors' rounding is in the update the residual
    # is taken against, so it is fed back with the rest.
    rng = np.random.default_rng(9)
    grads = {"w": per_rank(rng, 4, (16, 16))}
    steps = 80
    updates, state = _apply(
        jc.powersgd("batch", rank=2, min_size=0, wire_dtype=wire), grads, steps, world=4
    )
    mean = grads["w"].astype(np.float64).mean(0)
    applied = np.cumsum([np.asarray(u["w"], np.float64) for u in updates], axis=0)
    err = np.abs(applied - np.arange(1, steps + 1)[:, None, None] * mean).max(axis=(1, 2))
    residual = np.asarray(state.residual[0], np.float64).mean(0)
    np.testing.assert_allclose(applied[-1] - steps * mean, -residual, atol=1e-3)
    assert err[40:].max() <= 2 * err[:20].max(), err
    # Without the residual (one step's compression, repeated) it would grow.
    assert err[-1] < 0.2 * steps * err[0]


@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_powersgd_wire_dtype_sends_whole_leaves_as_wire16_does(wire):
    # A leaf PowerSGD sends whole travels as wire16 sends it: the same
    # update and the same residual, bit for bit, step after step.
    rng = np.random.default_rng(14)
    grads = {"w": per_rank(rng, N, (32, 16)), "b": per_rank(rng, N, (16,))}
    ours, ours_state = _apply(jc.powersgd("batch", rank=2, min_size=0, wire_dtype=wire), grads, 3)
    theirs, theirs_state = _apply(jc.wire16("batch", dtype=wire), {"b": grads["b"]}, 3)
    for u, v in zip(ours, theirs):
        assert np.asarray(u["b"]).tobytes() == np.asarray(v["b"]).tobytes()
    # The state's leaves are in path order: ['b'] then ['w'].
    assert (
        np.asarray(ours_state.residual[0]).tobytes()
        == np.asarray(theirs_state.residual[0]).tobytes()
    )
    assert np.any(np.asarray(ours_state.residual[0]) != 0)


def test_powersgd_wire_dtype_sends_its_factors_in_the_wire_format():
    rng = np.random.default_rng(15)
    grads = {"w": per_rank(rng, N, (32, 16)), "b": per_rank(rng, N, (16,))}
    tx = jc.powersgd("batch", rank=2, min_size=0, wire_dtype="bfloat16")
    params = jax.tree_util.tree_map(lambda g: jnp.zeros(g.shape[1:], g.dtype), grads)
    state = jc.for_ranks(tx.init(params), N)
    specs = jc.state_specs(state, "batch")
    step = jax.jit(
        jax.shard_map(
            lambda g, s: tx.update(jax.tree_util.tree_map(lambda v: v[0], g), s),
            mesh=mesh(N),
            in_specs=(P("batch"), specs),
            out_specs=(P(), specs),
        )
    )
    calls = [
        l
        for l in step.lower(grads, state).as_text().splitlines()
        if "jaxring_allreduce" in l and "custom_call" in l
    ]
    # P of w, then Q of w, then b: every operand in bfloat16.
    assert len(calls) == 3 and all("xbf16>" in c for c in calls), calls
    rep = jc.report(state)
    by_path = {l.path: l for l in rep.leaves}
    assert by_path["['w']"].wire_bytes == (32 + 16) * 2 * 2
    assert by_path["['b']"].wire_bytes == 16 * 2
    assert "powersgd rank 2 of 32x16 in bfloat16" in str(rep)


# ---- with optax, under pmap, under overlap --------------------------------------


def test_chained_with_adam_under_pmap_with_replicated_state():
    rng = np.random.default_rng(10)
    params = {
        "w": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
        "b": jnp.zeros((8,), jnp.float32),
    }
    x = rng.normal(size=(N, 4, 16)).astype(np.float32)
    y = rng.normal(size=(N, 4, 8)).astype(np.float32)
    tx = optax.chain(jc.powersgd("batch", rank=2, min_size=0), optax.sgd(0.1))

    def loss(p, xb, yb):
        return jnp.mean((xb @ p["w"] + p["b"] - yb) ** 2)

    def step(p, s, xb, yb):
        g = jax.grad(loss)(p, xb, yb)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    replicate = lambda t: jax.tree_util.tree_map(lambda v: np.stack([np.asarray(v)] * N), t)
    p, s = replicate(params), replicate(tx.init(params))
    pstep = jax.pmap(step, axis_name="batch")
    first = None
    for _ in range(30):
        p, s = pstep(p, s, x, y)
        full = float(
            jnp.mean(jax.vmap(loss, (None, 0, 0))(jax.tree_util.tree_map(lambda v: v[0], p), x, y))
        )
        first = first or full
    # Every device holds the same params; the loss went down.
    for leaf in jax.tree_util.tree_leaves(p):
        assert np.all(np.asarray(leaf) == np.asarray(leaf)[0])
    assert full < 0.7 * first


def test_overlap_buckets_the_compressed_allreduces():
    rng = np.random.default_rng(11)
    params = {f"l{i}": jnp.asarray(rng.normal(0, 0.3, (32, 32)), jnp.float32) for i in range(3)}
    x = rng.normal(size=(N * 4, 32)).astype(np.float32)
    tx = jc.powersgd("batch", rank=2, min_size=0)
    state = jc.for_ranks(tx.init(params), N)
    specs = jc.state_specs(state, "batch")

    def step(p, s, xb):
        def loss(p):
            h = xb
            for i in range(3):
                h = jnp.tanh(h @ p[f"l{i}"])
            return jnp.sum(h**2)

        return tx.update(jax.grad(loss)(p), s)

    # check_vma=False: the gradients of the replicated params stay local.
    run = lambda f: jax.jit(
        jax.shard_map(
            f,
            mesh=mesh(),
            in_specs=(P(), specs, P("batch")),
            out_specs=(P(), specs),
            check_vma=False,
        )
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxring.OverlapWarning)
        got, got_state = run(jaxring.overlap(step, axis_name="batch"))(params, state, x)
        text = jax.make_jaxpr(run(jaxring.overlap(step, axis_name="batch")))(
            params, state, x
        ).pretty_print()
    want, want_state = run(step)(params, state, x)
    # Every P and Q allreduce went into a bucket: none is left as it was.
    assert "jaxring_allreduce_start" in text and "jaxring_allreduce[" not in text
    for k in params:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-4, atol=1e-5)


def _overlap_starts(step, params, state, x):
    """How many bucket allreduces jaxring.overlap makes of the step under
    pmap (params and state replicated, flax-style; x split)."""
    rep = lambda t: jax.tree_util.tree_map(lambda v: jnp.stack([v] * N), t)
    f = jax.pmap(jaxring.overlap(step, axis_name="batch"), axis_name="batch")
    text = jax.make_jaxpr(f)(rep(params), rep(state), x.reshape(N, -1, x.shape[-1]))
    return text.pretty_print().count("jaxring_allreduce_start")


def test_powersgd_sends_its_qs_in_one_more_bucket_than_a_plain_pmean():
    # A Q's mean taken before the next Q exists would keep the two out of
    # one bucket (each an allreduce of its own, on a slow link a latency
    # each): PowerSGD makes as many buckets as a plain pmean of the same
    # gradients for its Ps and the leaves it sends as they are, and one
    # more for every Q, which wait for their Ps. (wire16's leaves: see
    # test_examples.py, where the CNN shows the same for it.)
    which = "powersgd"
    rng = np.random.default_rng(13)
    shapes = [(32, 64), (64,), (64, 64), (64,), (64, 10), (10,)]
    params = {
        f"p{i}": jnp.asarray(rng.normal(0, 0.1, s), jnp.float32) for i, s in enumerate(shapes)
    }
    x = rng.normal(size=(N * 8, 32)).astype(np.float32)

    def loss(p, xb):
        h = xb
        for i in range(0, 6, 2):
            h = jnp.tanh(h @ p[f"p{i}"] + p[f"p{i + 1}"])
        return jnp.sum(h**2)

    tx = jc.wire16("batch") if which == "wire16" else jc.powersgd("batch", rank=2, min_size=0)
    compressed = _overlap_starts(
        lambda p, s, xb: tx.update(jax.grad(loss)(p, xb), s), params, tx.init(params), x
    )
    plain = _overlap_starts(
        lambda p, s, xb: (jax.lax.pmean(jax.grad(loss)(p, xb), "batch"), s), params, {}, x
    )
    assert compressed == plain + (which == "powersgd"), (compressed, plain)


def test_powersgd_warm_up_chosen_by_the_trainer_keeps_one_overlapped_path():
    # warm_up=True/False, a static argument of the step that optax.chain
    # passes on: each compiled step holds one path (no cond), whose
    # allreduces jaxring.overlap buckets; True is the plain mean, False the
    # same compression as without warm_up, and both count the step.
    rng = np.random.default_rng(12)
    params = {f"l{i}": jnp.asarray(rng.normal(0, 0.3, (32, 32)), jnp.float32) for i in range(2)}
    x = rng.normal(size=(N * 4, 32)).astype(np.float32)
    tx = optax.chain(jc.powersgd("batch", rank=1, min_size=0), optax.sgd(1.0))
    state = jc.for_ranks(tx.init(params), N)
    specs = jc.state_specs(state, "batch")

    def loss(p, xb):
        h = xb
        for i in range(2):
            h = jnp.tanh(h @ p[f"l{i}"])
        return jnp.sum(h**2)

    def step(p, s, xb, warm_up=None):
        return tx.update(jax.grad(loss)(p, xb), s, p, warm_up=warm_up)

    def mean_step(p, s, xb):
        return jax.tree_util.tree_map(
            lambda g: -jax.lax.pmean(g, "batch"), jax.grad(loss)(p, xb)
        ), s

    # check_vma=False: the gradients of the replicated params stay local.
    run = lambda f: jax.jit(
        jax.shard_map(
            f,
            mesh=mesh(),
            in_specs=(P(), specs, P("batch")),
            out_specs=(P(), specs),
            check_vma=False,
        )
    )
    got = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxring.OverlapWarning)
        for w in (True, False):
            f = jaxring.overlap(functools.partial(step, warm_up=w), axis_name="batch")
            text = jax.make_jaxpr(run(f))(params, state, x).pretty_print()
            assert "cond[" not in text
            assert "jaxring_allreduce_start" in text and "jaxring_allreduce[" not in text
            got[w] = run(f)(params, state, x)
    plain, _ = run(mean_step)(params, state, x)
    compressed, _ = run(step)(params, state, x)
    for k in params:
        np.testing.assert_allclose(
            np.asarray(got[True][0][k]), np.asarray(plain[k]), rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(
            np.asarray(got[False][0][k]), np.asarray(compressed[k]), rtol=1e-4, atol=1e-5
        )
        # Rank 1 of the 32x32 mean is far from it: the two paths differ.
        assert np.abs(np.asarray(got[False][0][k]) - np.asarray(plain[k])).max() > 1e-3
    for w in (True, False):
        assert int(got[w][1][0].count) == 1


def test_powersgd_warm_up_must_be_static_and_alone():
    grads = {"w": jnp.ones((1, 8, 8), jnp.float32)}
    for tx, warm_up, err, match in [
        (
            jc.powersgd("batch", min_size=0),
            jnp.array(True),
            TypeError,
            "warm_up must be a Python bool",
        ),
        (
            jc.powersgd("batch", min_size=0, start_step=3),
            True,
            ValueError,
            "warm_up and start_step=3 both choose",
        ),
    ]:
        params = {"w": jnp.zeros((8, 8), jnp.float32)}
        state = jc.for_ranks(tx.init(params), N)
        specs = jc.state_specs(state, "batch")
        f = jax.jit(
            jax.shard_map(
                lambda g, s, tx=tx, w=warm_up: tx.update(
                    jax.tree_util.tree_map(lambda v: v[0], g), s, warm_up=w
                ),
                mesh=mesh(),
                in_specs=(P("batch"), specs),
                out_specs=(P(), specs),
            )
        )
        with pytest.raises(err, match=match):
            f(jax.tree_util.tree_map(lambda v: jnp.repeat(v, N, 0), grads), state)


@pytest.mark.parametrize(
    "make",
    [
        lambda: jc.powersgd("batch", rank=2, min_size=10**9),  # every leaf as is
        lambda: jc.wire16("batch"),  # float64 leaves as is
    ],
)
def test_leaves_left_as_they_are_get_the_plain_mean_bit_for_bit(make):
    rng = np.random.default_rng(12)
    grads = {"w": rng.normal(size=(N, 16, 8)), "b": rng.normal(size=(N, 8))}
    (got,), _ = _apply(make(), grads)
    want = mapped(lambda g: jax.tree_util.tree_map(lambda v: jaxring.pmean(v[0], "batch"), g))(
        grads
    )
    for k in grads:
        assert np.asarray(got[k]).tobytes() == np.asarray(want[k]).tobytes(), k


# ---- the report and the errors ----------------------------------------------------


def test_report_counts_the_bytes_per_leaf():
    params = {"w": jnp.zeros((64, 32), jnp.float32), "b": jnp.zeros((32,), jnp.float32)}
    s1 = optax.chain(jc.powersgd("batch", rank=4, min_size=0), optax.adam(1e-3)).init(params)
    rep = jc.report(s1)
    by_path = {l.path: l for l in rep.leaves}
    assert by_path["['w']"].wire_bytes == (64 + 32) * 4 * 4
    assert by_path["['b']"].wire_bytes == 32 * 4
    assert rep.full_bytes == (64 * 32 + 32) * 4
    assert rep.wire_bytes == (64 + 32) * 4 * 4 + 32 * 4
    assert "powersgd rank 4 of 64x32" in str(rep)
    rep16 = jc.report(jc.wire16("batch").init(params))
    assert rep16.wire_bytes * 2 == rep16.full_bytes


def test_powersgd_by_default_compresses_matrices_from_512_elements():
    """A CNN's small convolutions (3x3x16x16: 2,304 elements) go compressed
    by default; below 512 elements, and where the factors would not be
    smaller, a leaf goes whole."""
    params = {
        "conv": jnp.zeros((3, 3, 16, 16)),
        "shortcut": jnp.zeros((1, 1, 16, 32)),
        "stem": jnp.zeros((3, 3, 1, 16)),
        "wide": jnp.zeros((4, 200)),
    }
    how = {l.path: (l.how, l.matrix) for l in jc.report(jc.powersgd("batch").init(params)).leaves}
    assert how["['conv']"] == ("powersgd", (144, 16))
    assert how["['shortcut']"] == ("powersgd", (16, 32))
    assert how["['stem']"][0] == "as is"  # 144 elements
    assert how["['wide']"][0] == "as is"  # (4 + 200) x 4 factors >= 800


@pytest.mark.parametrize(
    "make,err,match",
    [
        (lambda: jc.powersgd("batch", rank=0), ValueError, "rank must be an int of at least 1"),
        (lambda: jc.powersgd("batch", start_step=-1), ValueError, "start_step must be"),
        (lambda: jc.powersgd("batch", warm_start=1), TypeError, "warm_start must be a bool"),
        (lambda: jc.wire16("batch", dtype="float32"), ValueError, "wire_dtype must be None"),
        (lambda: jc.wire16("batch", dtype=None), ValueError, "dtype must be 'bfloat16'"),
        (lambda: jc.wire16(3), TypeError, "named axes only"),
        (
            lambda: jc.powersgd("batch", wire_dtype="int8"),
            ValueError,
            "powersgd: wire_dtype must be None",
        ),
    ],
)
def test_bad_arguments(make, err, match):
    with pytest.raises(err, match=match):
        make()


def test_a_non_float_leaf_is_refused_at_init():
    with pytest.raises(TypeError, match=r"the leaf \['step'\] is int32"):
        jc.powersgd("batch").init({"w": jnp.zeros((4, 4)), "step": jnp.zeros((), jnp.int32)})


@pytest.mark.parametrize(
    "make", [lambda: jc.powersgd("batch", min_size=0), lambda: jc.wire16("batch")]
)
def test_update_outside_the_mapped_axis_is_refused(make):
    tx = make()
    params = {"w": jnp.zeros((8, 8), jnp.float32)}
    with pytest.raises(
        NameError,
        match=re.escape(
            "the axis 'batch' is not bound here. Call the optimizer's update inside "
            "the jax.shard_map or jax.pmap over 'batch', on each rank's local "
            "gradients (no axis is bound here (this is not inside jax.shard_map, "
            "jax.pmap or jax.vmap))."
        ),
    ):
        jax.jit(tx.update)(params, tx.init(params))


def test_a_misspelt_axis_name_names_the_axes_bound():
    tx = jc.wire16("bacth")
    params = {"w": jnp.zeros((8, 8), jnp.float32)}
    update = jax.jit(
        jax.shard_map(
            tx.update,
            mesh=mesh(),
            in_specs=(P("batch"), P()),
            out_specs=P("batch"),
            check_vma=False,
        )
    )
    with pytest.raises(
        NameError,
        match=re.escape(
            "the axis 'bacth' is not bound here. Call the optimizer's update inside "
            "the jax.shard_map or jax.pmap over 'bacth', on each rank's local "
            "gradients (the axes bound here are 'batch': pass one of those as the "
            "transform's axis_name)."
        ),
    ):
        update(params, tx.init(params))


@pytest.mark.parametrize(
    "make", [lambda: jc.powersgd("batch", rank=1, min_size=0), lambda: jc.wire16("batch")]
)
def test_a_state_not_split_over_the_ranks_is_refused(make):
    tx = make()
    params = {"w": jnp.zeros((8, 8), jnp.float32)}
    state = tx.init(params)
    grads = np.zeros((N, 8, 8), np.float32)
    # Passed replicated, as tx.init made it: under check_vma its residual is
    # not varying over the ranks.
    with pytest.raises(ValueError, match="was not split over the mapped axis"):
        jax.eval_shape(
            jax.shard_map(
                lambda g, s: tx.update({"w": g[0]}, s),
                mesh=mesh(),
                in_specs=(P("batch"), P()),
                out_specs=(P(), P()),
            ),
            grads,
            state,
        )
    # Split over the ranks without a row each: (8, 8) per rank, not (1, 8, 8).
    bad = jc.for_ranks(state, N)
    bad = bad.replace(
        residual=tuple(None if r is None else r.reshape((N * 8, 8)) for r in bad.residual)
    )
    specs = jc.state_specs(bad, "batch")
    with pytest.raises(ValueError, match="was not split over the mapped axis"):
        jax.eval_shape(
            jax.shard_map(
                lambda g, s: tx.update({"w": g[0]}, s),
                mesh=mesh(),
                in_specs=(P("batch"), specs),
                out_specs=(P(), specs),
            ),
            grads,
            bad,
        )


def test_gradients_of_other_params_are_refused():
    tx = jc.wire16("batch")
    state = tx.init({"w": jnp.zeros((4,), jnp.float32)})
    with pytest.raises(ValueError, match="differs from that of the params"):
        jax.eval_shape(
            jax.shard_map(
                lambda g, s: tx.update(g, s),
                mesh=mesh(),
                in_specs=(P(), P()),
                out_specs=(P(), P()),
                check_vma=False,
            ),
            {"v": jnp.zeros((4,))},
            state,
        )


def test_report_of_a_state_without_compression():
    with pytest.raises(ValueError, match="holds no jaxring.compression state"):
        jc.report(optax.adam(1e-3).init({"w": jnp.zeros(3)}))


def test_the_module_is_reachable_from_jaxring():
    assert jaxring.compression.powersgd is jc.powersgd


@pytest.mark.parametrize(
    "make",
    [lambda: jc.wire16("batch"), lambda: jc.powersgd("batch", rank=2, min_size=16)],
    ids=["wire16", "powersgd"],
)
def test_gradients_autodiff_already_reduced_are_refused(make):
    """Under check_vma=True autodiff sums replicated parameters' gradients
    before the optimizer sees them: compressing that sum would send nothing
    less, so the transform says so at trace time."""
    tx = optax.chain(make(), optax.sgd(0.1))
    params = {"w": jnp.ones((8, 8), jnp.float32)}
    state = jc.for_ranks(tx.init(params), N)
    specs = jc.state_specs(state, "batch")

    def step(p, s, x):
        grads = jax.grad(lambda q: jnp.mean(jnp.tanh(x @ q["w"]) ** 2))(p)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    x = np.ones((N * 2, 8), np.float32)
    for check_vma in (True, False):
        f = jax.shard_map(
            step,
            mesh=mesh(),
            in_specs=(P(), specs, P("batch")),
            out_specs=(P(), specs),
            check_vma=check_vma,
        )
        if check_vma:
            with pytest.raises(
                ValueError,
                match=r"gradient \['w'\] is already "
                r"reduced over \['batch'\].*check_vma=False",
            ):
                jax.eval_shape(f, params, state, x)
        else:
            jax.eval_shape(f, params, state, x)
