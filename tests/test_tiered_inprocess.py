"""Tiered plans among the virtual devices of one process.

The plan executor runs them with every rank local, every unit moving in
memory (under cpu_link, the emulated path moves each plan's data at once
and models the links); each result is checked against lax.psum (or numpy)
computed in the same run. tests/test_multiprocess.py checks that the same plan gives the
same bits when some of its units cross processes over TCP.
"""

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxring
from jaxring import _jaxring

from conftest import overlapped_and_plain

TOPOLOGIES = [(2, 4), (4, 2), (2, 2, 2)]


def mesh8():
    return jax.make_mesh((8,), ("i",), devices=jax.devices()[:8])


def ones8():
    return jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh8(), P("i")))


def sharded_call(fn, mesh, spec=P("i")):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


def lowered_topology(f, x) -> str:
    return re.search(r"topology = (dense<[^>]*> : tensor<\d+xi64>)", f.lower(x).as_text()).group(1)


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("rings,chunk_bytes", [(1, 1 << 20), (2, 256), (3, 4096)])
def test_float_sums_match_psum(topology, rings, chunk_bytes):
    mesh = mesh8()
    rng = np.random.default_rng(sum(topology) * 10 + rings)
    x = rng.standard_normal((8, 5003)).astype(np.float32)
    xs = jax.device_put(x, NamedSharding(mesh, P("i")))
    f = sharded_call(
        lambda v: jaxring.allreduce(
            v, "i", topology=topology, rings=rings, chunk_bytes=chunk_bytes
        ),
        mesh,
    )
    want = np.asarray(sharded_call(lambda v: jax.lax.psum(v, "i"), mesh)(xs))
    tiers = lowered_topology(f, xs)  # e.g. dense<[2, 4]> : tensor<2xi64>
    assert tiers.endswith(f"tensor<{len(topology)}xi64>"), tiers  # not flat
    got = np.asarray(f(xs))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Every rank holds the same bits: the all-gathers copy finished chunks.
    assert all(np.array_equal(got[0], got[k]) for k in range(8))


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
@pytest.mark.parametrize("count", [1, 7, 17, 1000])
def test_integer_reductions_are_exact(topology, op, count):
    mesh = mesh8()
    rng = np.random.default_rng(count)
    x = rng.integers(-3, 4, size=(8, count)).astype(np.int32)
    xs = jax.device_put(x, NamedSharding(mesh, P("i")))
    got = np.asarray(
        sharded_call(
            lambda v: jaxring.allreduce(v, "i", op=op, topology=topology, rings=2, chunk_bytes=8),
            mesh,
        )(xs)
    )
    f = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}[op]
    want = f(x, axis=0, keepdims=True).astype(np.int32)
    assert np.array_equal(got, np.broadcast_to(want, got.shape))


def test_tiers_over_two_mesh_axes_and_within_groups():
    # A 2x4 mesh reduced over both axes as 4x2 tiers, and the groups
    # {0..3}, {4..7} of a flat 8-device axis each reduced as 2x2 tiers.
    devices = np.array(jax.devices()[:8])
    mesh = jax.make_mesh((2, 4), ("a", "b"), devices=devices)
    x = np.arange(8 * 6, dtype=np.int64).reshape(2, 4, 6) ** 2
    xs = jax.device_put(x, NamedSharding(mesh, P("a", "b")))
    got = sharded_call(lambda v: jaxring.psum(v, ("a", "b"), topology=(4, 2)), mesh, P("a", "b"))(
        xs
    )
    want = sharded_call(lambda v: jax.lax.psum(v, ("a", "b")), mesh, P("a", "b"))(xs)
    assert np.array_equal(np.asarray(got), np.asarray(want))

    mesh = mesh8()
    y = np.arange(8 * 5, dtype=np.int32).reshape(8, 5)
    ys = jax.device_put(y, NamedSharding(mesh, P("i")))
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    got = sharded_call(
        lambda v: jaxring.psum(v, "i", axis_index_groups=groups, topology=(2, 2)), mesh
    )(ys)
    want = np.concatenate(
        [np.broadcast_to(y[:4].sum(0), (4, 5)), np.broadcast_to(y[4:].sum(0), (4, 5))]
    )
    assert np.array_equal(np.asarray(got), want)


def test_overlap_with_a_tiered_topology_matches_the_plain_step():
    mesh = mesh8()
    jaxring.config.update("topology", (2, 4))
    try:

        def step(w, x):
            def loss(w):
                h = jnp.tanh(x @ w["a"])
                return jnp.sum((h @ w["b"]) ** 2)

            g = jax.grad(loss)(w)
            return jax.tree.map(lambda t: jax.lax.pmean(t, "i"), g)

        rng = np.random.default_rng(3)
        w = {
            "a": jnp.asarray(rng.standard_normal((16, 32)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal((32, 4)), jnp.float32),
        }
        x = jax.device_put(
            rng.standard_normal((8 * 4, 16)).astype(np.float32), NamedSharding(mesh, P("i"))
        )

        def run(f):
            return jax.jit(
                jax.shard_map(
                    lambda xb: f(w, xb), mesh=mesh, in_specs=P("i"), out_specs=P(), check_vma=False
                )
            )

        # 400 bytes: smaller than either gradient (512 and 2048 bytes), so
        # each is a bucket of its own.
        got, text, want = overlapped_and_plain(run, step, x, bucket_mb=0.0004)
        hlo = run(jaxring.overlap(step, bucket_mb=0.0004)).lower(x).as_text()
        # Several buckets, each started on the tiered plan.
        assert hlo.count("topology = dense<[2, 4]>") >= 2, hlo
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
    finally:
        jaxring.config.reset("topology")
    assert _jaxring.testing.inprocess_pending_ops() == 0


def test_direct_algorithm_is_refused_with_tiers():
    mesh, xs = mesh8(), ones8()
    with pytest.raises(ValueError, match="'direct' has no tiers"):
        sharded_call(
            lambda v: jaxring.allreduce(v, "i", topology=(2, 4), algorithm="direct"), mesh
        ).lower(xs)


def timed(f, x):
    f(x).block_until_ready()  # compile
    start = time.perf_counter()
    out = np.asarray(f(x))
    return out, time.perf_counter() - start


def test_emulated_two_tier_cluster_paces_each_tier_on_its_own_link():
    # 2 hosts of 4 devices: 8 Gbit inside a host, one 400 Mbit link per host
    # shared by its devices. The emulation's floor for each plan is what
    # the busiest host link carries: a flat ring crosses between the hosts
    # at 2 of its 8 hops, 2 (n-1)/n * S through each host's link; the tiered
    # plan sends each device's half of its quarter shard across, S per host.
    mesh = mesh8()
    size = 2 << 20
    x = np.random.default_rng(5).standard_normal((8, size // 4)).astype(np.float32)
    xs = jax.device_put(x, NamedSharding(mesh, P("i")))
    want = np.asarray(sharded_call(lambda v: jax.lax.psum(v, "i"), mesh)(xs))
    host_link = 400e6 / 8
    floors = {"flat": 2 * 7 / 8 * size / host_link, (4, 2): size / host_link}
    jaxring.config.update("cpu_link", "4:8Gbit,1us;400Mbit,10us")
    try:
        took = {}
        for topology, floor in floors.items():
            got, took[topology] = timed(
                sharded_call(lambda v: jaxring.allreduce(v, "i", topology=topology, rings=2), mesh),
                xs,
            )
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            assert took[topology] >= 0.95 * floor, (topology, took[topology], floor)
    finally:
        jaxring.config.reset("cpu_link")
    assert _jaxring.testing.inprocess_pending_ops() == 0


def test_emulated_tiers_must_divide_the_ring():
    mesh, xs = mesh8(), ones8()
    jaxring.config.update("cpu_link", "3:8Gbit;1Gbit")
    try:
        with pytest.raises(ValueError, match="does not divide the 8 ranks"):
            sharded_call(lambda v: jaxring.allreduce(v, "i"), mesh).lower(xs)
        with pytest.raises(NotImplementedError, match="one cluster per ring"):
            sharded_call(
                lambda v: jaxring.allreduce(v, "i", axis_index_groups=[[0, 1, 2], [3, 4, 5, 6, 7]]),
                mesh,
            ).lower(xs)
    finally:
        jaxring.config.reset("cpu_link")


EMULATED_PLANS = {  # id: (devices, the allreduce's arguments)
    "2x4": (8, dict(topology=(2, 4))),
    "2x2x2,rings2,chunks256": (8, dict(topology=(2, 2, 2), rings=2, chunk_bytes=256)),
    "exchange": (8, dict(algorithm="exchange")),
    "exchange,rings3,chunks4096": (8, dict(algorithm="exchange", rings=3, chunk_bytes=4096)),
    "exchange,6 devices": (6, dict(algorithm="exchange", rings=2)),  # tiers 2, 3
}


@pytest.mark.parametrize("devices,plan", EMULATED_PLANS.values(), ids=EMULATED_PLANS.keys())
@pytest.mark.parametrize(
    "dtype,op", [(np.float32, "sum"), (np.float16, "sum"), (np.float32, "min"), (np.int32, "sum")]
)
def test_emulated_plans_give_the_executors_bits(plan, dtype, op, devices):
    # Under link emulation a plan's data moves at once, ring by ring on one
    # thread (inprocess_emulation.cc); without it the plan executor moves it
    # unit by unit on a worker per device. The same operands in the same
    # order: the same bits, signed zeros and all.
    mesh = jax.make_mesh((devices,), ("i",), devices=jax.devices()[:devices])
    rng = np.random.default_rng(devices + len(plan))
    x = rng.standard_normal((devices, 3001)) * 50
    x[:, ::7] = 0.0
    x[::2, ::7] = -0.0  # min(+0, -0) depends on the operand order
    xs = jax.device_put(x.astype(dtype), NamedSharding(mesh, P("i")))
    f = sharded_call(lambda v: jaxring.allreduce(v, "i", op=op, **plan), mesh)
    plain = np.asarray(f(xs))
    jaxring.config.update("cpu_link", "100Gbit,1us")
    try:
        emulated = np.asarray(
            sharded_call(lambda v: jaxring.allreduce(v, "i", op=op, **plan), mesh)(xs)
        )
    finally:
        jaxring.config.reset("cpu_link")
    assert plain.tobytes() == emulated.tobytes()
    reference = {"sum": np.sum, "min": np.min}[op](x.astype(dtype), axis=0)
    tolerance = dict(rtol=2e-2, atol=1.0) if dtype == np.float16 else dict(rtol=1e-5, atol=1e-3)
    for k in range(devices):
        np.testing.assert_allclose(
            emulated[k].astype(np.float64), reference.astype(np.float64), **tolerance
        )
    assert _jaxring.testing.inprocess_pending_ops() == 0


def test_emulated_exchange_takes_fewer_hops_than_the_ring():
    # On a link whose latency dwarfs the bytes, a flat ring of 8 waits for
    # 14 hops one after the other; the exchange for 3 (tiers 2, 2, 2). The
    # ceiling is loose (three times the exchange's 30 ms, still under half
    # the ring's 140): it checks the hops, not the speed of this machine.
    mesh, xs = mesh8(), ones8()
    latency = 10e-3
    jaxring.config.update("cpu_link", "100Gbit,10ms")
    try:
        took = {}
        for algorithm in ("ring", "exchange"):
            got, took[algorithm] = timed(
                sharded_call(lambda v: jaxring.allreduce(v, "i", algorithm=algorithm), mesh), xs
            )
            np.testing.assert_array_equal(got, np.full((8, 4), 8.0, np.float32))
    finally:
        jaxring.config.reset("cpu_link")
    assert took["ring"] >= 0.95 * 14 * latency, took
    assert 0.95 * 3 * latency <= took["exchange"] < 9 * latency, took
    assert _jaxring.testing.inprocess_pending_ops() == 0


def test_the_exchange_limit_weighs_a_whole_bucket():
    # An overlapped bucket reduces several leaves as one operation: "auto"
    # must weigh all of them against exchange_max_bytes, not the last one
    # (which once sent 148 KB buckets through the exchange).
    mesh = mesh8()

    def step(w):
        return jax.tree.map(lambda t: jax.lax.psum(t, "i"), w)

    w = {"a_big": jnp.ones((2048,), jnp.float32), "b_small": jnp.ones((4,), jnp.float32)}
    exchange = _jaxring.ALGORITHMS["exchange"]
    jaxring.config.update("cpu_link", "1Gbit")
    try:
        for limit, whole_bucket_exchanged in [(64, False), (2052 * 4, True)]:
            jaxring.config.update("exchange_max_bytes", limit)
            f = jax.jit(
                jax.shard_map(
                    jaxring.overlap(step, bucket_mb=1),
                    mesh=mesh,
                    in_specs=P(),
                    out_specs=P(),
                    check_vma=False,
                )
            )
            hlo = f.lower(w).as_text()
            starts = re.findall(r"jaxring_allreduce_start_cpu.*", hlo)
            assert len(starts) == 1, hlo  # one bucket of both leaves
            assert (f"algorithm = {exchange} " in starts[0]) == whole_bucket_exchanged, starts
            got = f(w)
            np.testing.assert_array_equal(got["a_big"], np.full(2048, 8.0, np.float32))
    finally:
        jaxring.config.reset("exchange_max_bytes")
        jaxring.config.reset("cpu_link")
