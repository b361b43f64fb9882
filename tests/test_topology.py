"""Which tiers an allreduce runs on: discovery from where ranks run, explicit
topologies, their errors, and the setting."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxring
from jaxring._src import topology


@pytest.mark.parametrize(
    "procs,hosts,want",
    [
        # 2 devices in each of 2 processes of one host.
        ([0, 0, 1, 1], {0: "10.0.0.1", 1: "10.0.0.1"}, (2, 2, 1)),
        # Hosts not known: each process counts as its own.
        ([0, 0, 1, 1], None, (2, 1, 2)),
        # ...on two hosts.
        ([0, 0, 1, 1], {0: "10.0.0.1", 1: "10.0.0.2"}, (2, 1, 2)),
        # 2 devices x 2 processes per host x 2 hosts.
        ([0, 0, 1, 1, 2, 2, 3, 3], {0: "a", 1: "a", 2: "b", 3: "b"}, (2, 2, 2)),
        # One device per process.
        ([0, 1, 2, 3], {0: "a", 1: "a", 2: "b", 3: "b"}, (1, 2, 2)),
        # Ranks of a process not consecutive, or blocks of different sizes.
        ([0, 1, 0, 1], None, ()),
        ([0, 0, 0, 1], None, ()),
        # Hosts not in consecutive blocks of processes: one tier of processes.
        ([0, 1, 2, 3], {0: "a", 1: "b", 2: "a", 3: "b"}, (1, 4)),
    ],
)
def test_discover(procs, hosts, want):
    assert topology.discover(np.array(procs), hosts) == want


def test_resolve_auto_flat_and_explicit():
    across = np.array([0, 0, 1, 1], np.int64)
    one = np.zeros(4, np.int64)
    assert topology.resolve("auto", 4, across) == (2, 2)
    assert topology.resolve("auto", 4, one) == ()
    assert topology.resolve("flat", 4, across) == ()
    # Tiers of one rank are dropped; one tier left is the flat ring.
    assert topology.resolve((2, 1, 2), 4, across) == (2, 2)
    assert topology.resolve((1, 4), 4, across) == ()
    assert topology.resolve((4,), 4, one) == ()
    # Every group of a mesh must find the same tiers, or the ring is flat.
    two_groups = np.array([0, 0, 1, 1, 2, 3, 2, 3], np.int64)
    assert topology.resolve("auto", 4, two_groups) == ()


def test_resolve_refuses_bad_topologies():
    across = np.array([0, 0, 1, 1], np.int64)
    with pytest.raises(ValueError, match="has 6 ranks but the allreduce runs over 4"):
        topology.resolve((2, 3), 4, across)
    # Tiers among the devices of one process are a plan like any other.
    assert topology.resolve((2, 2), 4, np.zeros(4, np.int64)) == (2, 2)
    assert topology.resolve("auto", 4, np.zeros(4, np.int64)) == ()


def test_topology_settings_in_one_process_at_trace_time():
    mesh = jax.make_mesh((4,), ("i",), devices=jax.devices()[:4])
    x = jax.device_put(np.ones(16, np.float32), NamedSharding(mesh, P("i")))

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

    assert "topology = dense<> : tensor<0xi64>" in lowered()
    assert "topology = dense<> : tensor<0xi64>" in lowered(topology=[4])
    assert "topology = dense<2> : tensor<2xi64>" in lowered(topology=(2, 2))
    assert "algorithm = 0 : i64" in lowered(topology=(2, 2))  # ring, not direct
    with pytest.raises(ValueError, match="'direct' has no tiers"):
        lowered(topology=(2, 2), algorithm="direct")
    with pytest.raises(ValueError, match="must multiply to the size"):
        lowered(topology=(3,))
    with pytest.raises(ValueError, match="topology must be"):
        lowered(topology=(0, 4))
    with pytest.raises(ValueError, match="topology must be"):
        lowered(topology="ring")


def test_topology_setting():
    assert jaxring.config.topology == "auto"
    jaxring.config.update("topology", (2, 4))
    try:
        assert jaxring.config.topology == (2, 4)
    finally:
        jaxring.config.reset("topology")
    for bad in [(), (2, 0), (1, 2, 3, 4, 5), (70000,), [2, 2], "2x2"]:
        with pytest.raises(ValueError, match="topology must be"):
            jaxring.config.update("topology", bad)
    assert topology.parse("auto") == "auto"
    assert topology.parse(" 4x2X8 ") == (4, 2, 8)


@pytest.mark.jax_independent  # processes and jaxring's own parsing
def test_topology_from_the_environment(script):
    res = script("import jaxring; print(jaxring.config.topology)", env={"JAXRING_TOPOLOGY": "4x2"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["(4,", "2)"]
    res = script("import jaxring", env={"JAXRING_TOPOLOGY": "four"})
    assert res.returncode != 0 and "JAXRING_TOPOLOGY='four': expected" in res.stderr
