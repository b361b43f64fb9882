"""The CUDA backend on a machine without a GPU: that it was built and links,
and what its lowering puts into the HLO (custom call, rank tables, NCCL
ids), lowered for the CUDA platform from the CPU. The GPU runs themselves
are in tests/gpu/.

JAXRING_REQUIRE_CUDA_BUILD=1 (set by CI) turns "not built" into a failure,
so that a broken CUDA build cannot pass as a skip.
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from reports import REPORT_SOURCE, reports, reports_by_rank

import jaxring
from jaxring._src import cuda_backend

_REQUIRED = os.environ.get("JAXRING_REQUIRE_CUDA_BUILD") == "1"


def _built() -> bool:
    return cuda_backend.status() == "built"


needs_cuda_build = pytest.mark.skipif(
    not _built() and not _REQUIRED, reason=f"CUDA backend {cuda_backend.status()}"
)


def test_required_build_is_present():
    if not _REQUIRED:
        pytest.skip("JAXRING_REQUIRE_CUDA_BUILD is not set")
    assert _built(), cuda_backend.status()


@needs_cuda_build
def test_module_links_and_reports_versions():
    from jaxring import _jaxring_cuda as cu

    info = jaxring.build_info()
    assert info["backends"]["cuda"] is True and info["cuda"] == "built"
    # The NCCL found at run time is the one the module was compiled against.
    assert info["nccl"] == info["nccl_headers"]
    assert re.fullmatch(r"2\.\d+\.\d+", info["nccl"])
    assert info["cuda_runtime"] >= 12000
    assert cu.device_count() >= 0
    assert "jaxring_allreduce_cuda" in cu.registrations()
    # The "algorithm" attribute's values are named once, by the core module,
    # for both backends.
    from jaxring import _jaxring

    assert set(_jaxring.ALGORITHMS) == {"ring", "direct", "nccl", "exchange"}
    assert len(set(_jaxring.ALGORITHMS.values())) == 4
    assert not hasattr(cu, "ALGORITHMS")


@needs_cuda_build
def test_unique_ids_need_no_gpu_and_differ():
    from jaxring import _jaxring_cuda as cu

    a, b = cu.new_unique_id(), cu.new_unique_id()
    assert len(a) == len(b) == cu.UNIQUE_ID_BYTES == 128
    assert a != b


def _lower_for_cuda(fn, mesh, x, in_spec, out_spec):
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=False))
    x = jax.device_put(x, NamedSharding(mesh, in_spec))
    return f.trace(x).lower(lowering_platforms=("cuda",)).as_text()


def _custom_calls(text: str) -> list[str]:
    return [l for l in text.splitlines() if "stablehlo.custom_call" in l]


def _attr(line: str, name: str) -> str:
    m = re.search(name + r" = (dense<\[?[^>]*\]?>|[-\w.+]+)", line)
    assert m, f"no {name} in {line}"
    return m.group(1)


def _ints(dense: str) -> list[int]:
    return [int(v) for v in re.findall(r"-?\d+", dense.split(":")[0])]


def _array(line: str, name: str) -> list:
    """An array attribute's values; MLIR prints an array of one repeated
    value as that value (a splat)."""
    m = re.search(name + r" = dense<([^>]*)> : tensor<(\d+)x", line)
    assert m, f"no array {name} in {line}"
    values = [
        int(v) if re.fullmatch(r"-?\d+", v) else float(v)
        for v in re.findall(r"-?[\d.]+(?:e[-+]?\d+)?", m.group(1))
    ]
    n = int(m.group(2))
    return values * n if len(values) == 1 else values


@needs_cuda_build
def test_lowering_carries_devices_and_one_id_per_group_and_ring():
    mesh = jax.make_mesh((2, 4), ("g", "i"))
    text = _lower_for_cuda(
        lambda v: jaxring.allreduce(v, "i", algorithm="ring", rings=3),
        mesh,
        jnp.arange(64.0).reshape(8, 8),
        P(("g", "i")),
        P("g"),
    )
    (call,) = _custom_calls(text)
    assert "@jaxring_allreduce_cuda" in call
    assert _attr(call, "world_size") == "4"
    assert _attr(call, "num_rings") == "3"
    from jaxring import _jaxring

    assert int(_attr(call, "algorithm")) == _jaxring.ALGORITHMS["ring"]
    # The process and the local device of each rank, group by group: the
    # groups are the rows of the mesh, the ranks its columns.
    processes = np.asarray(_array(call, "rank_process")).reshape(2, 4)
    ordinals = np.asarray(_array(call, "rank_device")).reshape(2, 4)
    devices = np.asarray(mesh.devices)
    for g in range(2):
        for r in range(4):
            d = devices[g, r]
            assert (processes[g, r], ordinals[g, r]) == (d.process_index, d.local_hardware_id)
    # The attributes every allreduce carries on the CPU too (RingAttrs), for
    # a flat ring of one size without emulated links.
    for name in ("op_id", "slot_id", "reduce_op", "chunk_bytes", "timeout_s"):
        _attr(call, name)
    for name in ("topology", "group_sizes", "link_bytes_per_s", "link_latency_s", "link_tiers"):
        assert _array(call, name) == [], name
    ids = np.asarray(_array(call, "nccl_ids")).reshape(2, 3, 16)
    flat = {ids[g, r].tobytes() for g in range(2) for r in range(3)}
    assert len(flat) == 6  # every (group, ring) has its own communicator


@needs_cuda_build
def test_same_devices_reuse_their_communicator_ids():
    mesh = jax.make_mesh((4,), ("i",))
    x = jnp.arange(16.0)

    def ids_of(fn):
        (call,) = _custom_calls(_lower_for_cuda(fn, mesh, x, P("i"), P()))
        return _array(call, "nccl_ids")

    first = ids_of(lambda v: jaxring.allreduce(v, "i", algorithm="ring", rings=2))
    again = ids_of(lambda v: jaxring.allreduce(v * 2, "i", op="max", algorithm="ring", rings=2))
    assert first == again
    # Ring 0's id is shared with a one-ring call over the same devices, and
    # with NCCL's allreduce there.
    assert ids_of(lambda v: jaxring.allreduce(v, "i", algorithm="ring", rings=1)) == first[:16]
    assert ids_of(lambda v: jaxring.allreduce(v, "i", algorithm="nccl")) == first[:16]


@needs_cuda_build
def test_nccl_algorithm_attribute():
    mesh = jax.make_mesh((4,), ("i",))
    text = _lower_for_cuda(
        lambda v: jaxring.allreduce(v, "i", algorithm="nccl"), mesh, jnp.arange(16.0), P("i"), P()
    )
    (call,) = _custom_calls(text)
    from jaxring import _jaxring

    assert int(_attr(call, "algorithm")) == _jaxring.ALGORITHMS["nccl"]


@needs_cuda_build
@pytest.mark.parametrize(
    "kwargs, dtype, algorithm",
    [
        # "auto" runs NCCL's allreduce, as one call on one communicator
        # whatever the ring count...
        (dict(), jnp.float32, "nccl"),
        (dict(rings=3, topology="flat"), jnp.bfloat16, "nccl"),
        (dict(algorithm="nccl", rings=3), jnp.float32, "nccl"),
        # ...and the ring where NCCL cannot: 16-bit integers, named tiers.
        (dict(rings=3), jnp.int16, "ring"),
        (dict(rings=3, topology=(2, 2)), jnp.float32, "ring"),
    ],
)
def test_auto_runs_nccl_unless_nccl_cannot(kwargs, dtype, algorithm):
    mesh = jax.make_mesh((4,), ("i",))
    text = _lower_for_cuda(
        lambda v: jaxring.allreduce(v, "i", **kwargs),
        mesh,
        jnp.arange(16).astype(dtype),
        P("i"),
        P(),
    )
    (call,) = _custom_calls(text)
    from jaxring import _jaxring

    assert int(_attr(call, "algorithm")) == _jaxring.ALGORITHMS[algorithm]
    rings = 1 if algorithm == "nccl" else 3
    assert _attr(call, "num_rings") == str(rings)
    assert len(_array(call, "nccl_ids")) == rings * 16


@needs_cuda_build
@pytest.mark.parametrize(
    "kwargs, dtype, error, match",
    [
        (dict(algorithm="nccl"), jnp.int16, TypeError, "no 16-bit integer"),
        (dict(algorithm="direct"), jnp.float32, ValueError, "CPU backend only"),
        (dict(algorithm="exchange"), jnp.float32, ValueError, "CPU transports only"),
        (
            dict(topology=(2, 2), algorithm="nccl"),
            jnp.float32,
            ValueError,
            "NCCL's own allreduce, which has no tiers",
        ),
        (dict(topology=(2, 3)), jnp.float32, ValueError, "must multiply"),
    ],
)
def test_cuda_lowering_refuses_what_it_cannot_run(kwargs, dtype, error, match):
    mesh = jax.make_mesh((4,), ("i",))
    with pytest.raises(error, match=match):
        _lower_for_cuda(
            lambda v: jaxring.allreduce(v, "i", **kwargs),
            mesh,
            jnp.arange(16).astype(dtype),
            P("i"),
            P(),
        )


@needs_cuda_build
@pytest.mark.parametrize(
    "topology, tiers",
    [
        ((2, 2), [2, 2]),
        ((1, 4), []),
        ("flat", []),
        # On GPUs "auto" stays one flat ring (tiers are run only when named).
        ("auto", []),
    ],
)
def test_lowering_carries_the_tiers_a_topology_names(topology, tiers):
    mesh = jax.make_mesh((4,), ("i",))
    text = _lower_for_cuda(
        lambda v: jaxring.allreduce(v, "i", algorithm="ring", rings=2, topology=topology),
        mesh,
        jnp.arange(16.0),
        P("i"),
        P(),
    )
    (call,) = _custom_calls(text)
    assert _array(call, "topology") == tiers
    # The ring's communicators serve every tier: still one id per ring.
    assert len(_array(call, "nccl_ids")) == 2 * 16


@needs_cuda_build
def test_overlap_buckets_carry_the_tiers():
    mesh = jax.make_mesh((4,), ("i",))
    step = jaxring.overlap(lambda x: jax.lax.psum(x * 2, "i"), axis_name="i")
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("i"), out_specs=P(), check_vma=False))
    jaxring.config.update("topology", (2, 2))
    try:
        x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("i")))
        calls = _custom_calls(f.trace(x).lower(lowering_platforms=("cuda",)).as_text())
    finally:
        jaxring.config.reset("topology")
    starts = [c for c in calls if "@jaxring_allreduce_start_cuda" in c]
    assert starts and all(_array(c, "topology") == [2, 2] for c in starts), calls


@needs_cuda_build
@pytest.mark.multiprocess
def test_processes_that_lower_different_calls_are_told_at_lowering():
    # NCCL's sends and receives carry no description, so the processes of a
    # ring compare theirs at lowering: process 1 reduces a longer vector.
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    script = Path(__file__).parent / "multiprocess" / "cuda_lowering_agreement.py"

    def run(longer):
        with tempfile.TemporaryDirectory() as cwd:
            r = subprocess.run(
                [sys.executable, "-m", "jaxring.launch", "-n", "2", str(script), str(longer)],
                capture_output=True,
                text=True,
                timeout=120,
                cwd=cwd,
            )
        # The ranks that reported, and what each did (every report is a
        # lowering or an error).
        return {rank: said for rank, said in reports_by_rank(r.stdout).items() if said}

    lowered = {"kind": "lowered", "calls": 1}
    # Twice each: the second shape re-lowers the same slot.
    assert run(1) == {0: [lowered] * 2, 1: [lowered] * 2}
    said = run(2)
    assert sorted(said) == [0, 1] and len(said[0]) == len(said[1]) == 1, said
    (owner,), (other,) = said[0], said[1]
    # Process 0 publishes its call; process 1 finds it differs, at once.
    assert owner == lowered, owner
    assert other["kind"] == "raised" and other["error"] == "MismatchError", other
    assert "float32[1, 1024]" in other["message"] and "float32[1, 2048]" in other["message"], other
    assert other["took_s"] < 10, other
    # Process 0 never lowers it: process 1 gives up after the call's timeout.
    said = run(0)
    assert list(said) == [1] and len(said[1]) == 1, said
    (late,) = said[1]
    assert late["kind"] == "raised" and late["error"] == "CollectiveTimeoutError", late
    assert "process 0 did not lower the allreduce" in late["message"], late


@needs_cuda_build
def test_cpu_link_is_refused_on_cuda():
    mesh = jax.make_mesh((4,), ("i",))
    jaxring.config.update("cpu_link", "1Gbit,10us")
    try:
        with pytest.raises(ValueError, match="cpu_link"):
            _lower_for_cuda(
                lambda v: jaxring.allreduce(v, "i"), mesh, jnp.arange(16.0), P("i"), P()
            )
    finally:
        jaxring.config.reset("cpu_link")


@needs_cuda_build
def test_overlap_lowers_to_cuda_start_and_done_pairs():
    mesh = jax.make_mesh((4,), ("i",))

    @jaxring.overlap(axis_name="i", bucket_mb=0.001, first_bucket_mb=0.001)
    def step(ws, x):
        def loss(ws):
            h = x
            for w in ws:
                h = jnp.tanh(h @ w)
            return jnp.sum(h**2)

        return jax.lax.pmean(jax.grad(loss)(ws), "i")

    f = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), P("i")), out_specs=P(), check_vma=False)
    )
    ws = [jnp.ones((16, 16)) * 0.1 for _ in range(3)]
    x = jax.device_put(jnp.ones((16, 16)), NamedSharding(mesh, P("i")))
    calls = _custom_calls(f.trace(ws, x).lower(lowering_platforms=("cuda",)).as_text())
    starts = [c for c in calls if "@jaxring_allreduce_start_cuda" in c]
    dones = [c for c in calls if "@jaxring_allreduce_done_cuda" in c]
    assert len(starts) == len(dones) >= 2, calls
    # Each done names its start's op id; each start carries the ring's
    # devices and ids like the plain allreduce.
    assert sorted(_attr(c, "op_id") for c in starts) == sorted(_attr(c, "op_id") for c in dones)
    for c in starts:
        assert _attr(c, "world_size") == "4"
        assert len(_array(c, "rank_device")) == 4
        assert len(_array(c, "rank_process")) == 4
        assert _ints(_attr(c, "num_deps")) and "gang" not in c


def test_unbuilt_backend_says_why(monkeypatch):
    monkeypatch.setattr(cuda_backend, "_module", lambda: None)
    monkeypatch.setattr(cuda_backend, "_registered", False)
    mesh = jax.make_mesh((4,), ("i",))
    with pytest.raises(NotImplementedError, match="needs jaxring's CUDA backend"):
        _lower_for_cuda(lambda v: jaxring.allreduce(v, "i"), mesh, jnp.arange(16.0), P("i"), P())


def test_nccl_algorithm_is_refused_on_cpu():
    mesh = jax.make_mesh((4,), ("i",))
    f = jax.jit(
        jax.shard_map(
            lambda v: jaxring.allreduce(v, "i", algorithm="nccl"),
            mesh=mesh,
            in_specs=P("i"),
            out_specs=P(),
            check_vma=False,
        )
    )
    with pytest.raises(ValueError, match="CUDA backend only"):
        f(jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("i"))))


def test_rank_devices_has_minus_one_for_devices_other_processes_own():
    """A device of another process has no readable local_hardware_id (None
    in a multi-process job); the table says -1 there and keeps this
    process's own ordinals, which are all the handler looks for."""

    class Device:
        def __init__(self, process_index, local_hardware_id):
            self.process_index, self.local_hardware_id = process_index, local_hardware_id

    table = cuda_backend.rank_devices(
        [[Device(0, 0), Device(1, None)], [Device(0, 1), Device(1, None)]]
    )
    assert table.tolist() == [0, -1, 1, -1]


class _StoreThatFails:
    """A key-value client whose blocking get raises what it is given."""

    def __init__(self, error):
        self.error = error

    def key_value_set(self, key, value):
        raise AssertionError("only the owner publishes")

    def blocking_key_value_get(self, key, timeout_ms):
        raise self.error


def _check_as_process_1(monkeypatch, client):
    from jaxring._src import cuda_agreement, jax_compat

    monkeypatch.setattr(cuda_backend, "job_client", lambda: client)
    monkeypatch.setattr(jax_compat, "distributed_state", lambda: (1, 2, "x:1"))
    cuda_agreement.check_same_call(0xABC, "f32[8] sum", owner=0, processes=[0, 1], timeout_s=0.2)


def test_agreement_tells_a_late_owner_from_a_failed_store(monkeypatch, tmp_path):
    """The owner not publishing in time is a CollectiveTimeoutError; the
    store failing (its coordinator gone) is a JaxringError of its own,
    never reported as a timeout. The first message is the one
    jax.distributed's client gives, got from a real one-process job in a
    subprocess."""
    import subprocess
    import sys

    probe = REPORT_SOURCE + (
        "import socket, jax\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "jax.distributed.initialize(f'127.0.0.1:{port}', 1, 0)\n"
        "from jaxring._src import jax_compat\n"
        "try:\n"
        "    jax_compat.distributed_client().blocking_key_value_get('absent', 100)\n"
        "except Exception as e:\n"
        "    report('message', message=str(e).splitlines()[0])\n"
    )
    # Run outside the checkout, so that the installed jaxring is imported.
    res = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    said = reports(res.stdout)
    timeout_message = said[0]["message"] if said else None
    assert timeout_message, res.stdout[-2000:] + res.stderr[-2000:]

    with pytest.raises(jaxring.CollectiveTimeoutError, match="did not lower") as info:
        _check_as_process_1(monkeypatch, _StoreThatFails(RuntimeError(timeout_message)))
    assert info.value.peer_process == 0

    with pytest.raises(jaxring.JaxringError, match="key-value store failed") as info:
        _check_as_process_1(
            monkeypatch,
            _StoreThatFails(RuntimeError("UNAVAILABLE: failed to connect to all addresses")),
        )
    assert not isinstance(info.value, jaxring.CollectiveTimeoutError)
    assert "UNAVAILABLE" in str(info.value) and info.value.peer_process == 0
