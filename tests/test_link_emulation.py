"""JAXRING_CPU_LINK: the in-process transport paced like a network link."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxring
from jaxring._src.config import parse_link, parse_links

N = 8


@pytest.fixture
def link():
    def set_link(spec):
        jaxring.config.update("cpu_link", spec)

    yield set_link
    jaxring.config.reset("cpu_link")


def test_parse_link_units():
    assert parse_link("10Gbit,20us") == pytest.approx((1.25e9, 20e-6))
    assert parse_link("100Mbit") == pytest.approx((12.5e6, 0.0))
    assert parse_link("2GB, 1ms") == pytest.approx((2e9, 1e-3))
    assert parse_link("800kbit,0s") == pytest.approx((1e5, 0.0))
    # "Gb" could mean bits or bytes: refused.
    # Not a number, or no network at all: NaN, infinite, slower than a byte
    # a second, or a latency beyond a minute.
    for bad in (
        "fast",
        "10Gbit,20",
        "0Gbit",
        "-1MB",
        "1MB,2ms,3",
        "1Gb",
        "5mb",
        "nanGbit",
        "infGbit",
        "10Gbit,infus",
        "10Gbit,nanms",
        "1e-300Gbit",
        "4bit",
        "10Gbit,61s",
    ):
        with pytest.raises(ValueError):
            parse_link(bad)


def test_parse_links_per_tier():
    def flat(spec):
        return [v for tier in parse_links(spec) for v in tier]

    assert flat("10Gbit,20us") == pytest.approx([0, 1.25e9, 20e-6])
    assert flat("4:100Gbit,2us;1Gbit,20us") == pytest.approx([4, 12.5e9, 2e-6, 0, 1.25e8, 20e-6])
    assert flat("2:1GB;4:10MB,1ms;1MB") == pytest.approx([2, 1e9, 0.0, 4, 1e7, 1e-3, 0, 1e6, 0.0])
    # A size on every tier but the last, at most 4 tiers, each a valid link.
    for bad in (
        "4:10Gbit",
        "10Gbit;1Gbit",
        "4:10Gbit;2:1Gbit",
        "0:10Gbit;1Gbit",
        "x:10Gbit;1Gbit",
        "2:1GB;2:1GB;2:1GB;2:1GB;1GB",
        "4:fast;1Gbit",
        "4:10Gbit;",
    ):
        with pytest.raises(ValueError):
            parse_links(bad)
    jaxring.config.update("cpu_link", "4:100Gbit,2us;1Gbit,20us")
    jaxring.config.reset("cpu_link")
    with pytest.raises(ValueError, match="one link per tier"):
        jaxring.config.update("cpu_link", "10Gbit;1Gbit")


def test_config_rejects_a_bad_link():
    with pytest.raises(ValueError, match="10Gbit,20us"):
        jaxring.config.update("cpu_link", "ten gigabit")


def allreduce_timed(n_floats):
    mesh = jax.make_mesh((N,), ("i",))
    x = jax.device_put(
        (jnp.arange(N * n_floats) % 7).astype(jnp.float32).reshape(N, n_floats),
        NamedSharding(mesh, P("i")),
    )
    f = jax.jit(
        jax.shard_map(lambda v: jaxring.psum(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    )
    f(x).block_until_ready()  # compile
    wall, cpu = time.perf_counter(), time.process_time()
    out = f(x).block_until_ready()
    return (
        np.asarray(out),
        np.asarray(x).sum(0),
        time.perf_counter() - wall,
        time.process_time() - cpu,
    )


def test_emulated_link_costs_wall_time_not_cpu(link):
    n = 1 << 20  # 4 MiB per device
    # Slow enough that the link's time dwarfs the CPU the data movement
    # itself takes (about 0.3 s on a loaded 2-core machine, seen failing a
    # 0.5 ratio against a 0.6 s link of 200 Mbit).
    link("100Mbit,100us")
    out, ref, wall, cpu = allreduce_timed(n)
    np.testing.assert_array_equal(out, np.broadcast_to(ref, out.shape))
    # Each device sends 2(p-1)/p of its buffer over its own link.
    link_time = 2 * (N - 1) / N * 4 * n / 12.5e6
    assert wall >= 0.95 * link_time, (wall, link_time)
    # Waiting on the link sleeps: the process uses far less CPU than that
    # (a thread spinning through the wait alone would use all of it).
    assert cpu < 0.5 * wall, (cpu, wall)


def test_link_setting_is_read_at_trace_time(link):
    n = 1 << 18
    link("100Mbit")
    _, _, slow, _ = allreduce_timed(n)
    link(None)
    _, _, fast, _ = allreduce_timed(n)
    assert fast < slow / 4, (fast, slow)
