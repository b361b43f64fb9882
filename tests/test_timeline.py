"""The timeline trace and the demo trainer that writes one."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxring

N = 8


def overlapped_step():
    def step(params, x):
        grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w1"]) @ p["w2"]))(params)
        return jax.lax.pmean(grads, "batch")

    mesh = jax.make_mesh((N,), ("batch",))
    f = jax.jit(
        jax.shard_map(
            jaxring.overlap(
                step,
                axis_name="batch",
                bucket_mb=32 * 8 * 4 / 2**20,
                first_bucket_mb=32 * 8 * 4 / 2**20,
            ),
            mesh=mesh,
            in_specs=(P(), P("batch")),
            out_specs=P(),
            check_vma=False,
        )
    )
    params = {"w1": jnp.ones((16, 32), jnp.float32), "w2": jnp.ones((32, 8), jnp.float32)}
    x = jax.device_put(jnp.ones((N * 2, 16), jnp.float32), NamedSharding(mesh, P("batch")))
    return f, params, x


def test_timeline_has_a_span_per_bucket_and_device(tmp_path):
    f, params, x = overlapped_step()
    jax.block_until_ready(f(params, x))  # compile outside the recording
    path = tmp_path / "trace.json"
    with jaxring.timeline(path):
        jax.block_until_ready(f(params, x))
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert tracks == {f"device {d}" for d in range(N)}
    buckets = {e["name"] for e in spans}
    assert len(buckets) >= 2 and all(b.startswith("bucket ") for b in buckets)
    for b in buckets:
        per_device = [e for e in spans if e["name"] == b]
        assert sorted(e["tid"] for e in per_device) == list(range(N))
        assert all(e["dur"] >= 0 and e["args"]["bytes"] > 0 for e in per_device)
    # Every gradient byte travels in exactly one bucket.
    grad_bytes = sum(np.asarray(v).nbytes for v in jax.tree.leaves(params))
    device0 = [e for e in spans if e["tid"] == 0]
    assert sum(e["args"]["bytes"] for e in device0) == grad_bytes


def test_spans_say_how_long_a_device_waited_for_the_others(tmp_path):
    """Device 0 computes for a while before its allreduce, the others do
    not, so the devices start it at different times (in which order is
    XLA's thread pool's choice). Each span's waiting_for_peers_ms runs from
    its own start to the last device's start: the same instant for all,
    zero for the last."""
    mesh = jax.make_mesh((4,), ("i",))

    def step(x):
        first = jax.lax.axis_index("i") == 0
        slow = lambda v: jax.lax.fori_loop(0, 300, lambda _, a: jnp.tanh(a @ a) / 64, v)
        x = jax.lax.cond(first, slow, lambda v: v, x[0])
        return jaxring.allreduce(x, "i")[None]

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False))
    x = jax.device_put(jnp.ones((4, 64, 64), jnp.float32), NamedSharding(mesh, P("i")))
    jax.block_until_ready(f(x))
    path = tmp_path / "skew.json"
    with jaxring.timeline(path):
        jax.block_until_ready(f(x))
    spans = {e["tid"]: e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"}
    assert sorted(spans) == [0, 1, 2, 3]
    last_start = max(e["ts"] for e in spans.values())  # microseconds
    for e in spans.values():
        args = e["args"]
        whole = args["waiting_for_peers_ms"] + args["after_last_join_ms"]
        assert args["waiting_for_peers_ms"] >= 0 and args["after_last_join_ms"] >= 0
        assert abs(whole - e["dur"] / 1e3) < 0.01, e
        assert abs(e["ts"] + 1e3 * args["waiting_for_peers_ms"] - last_start) < 1, spans
    waits = sorted(e["args"]["waiting_for_peers_ms"] for e in spans.values())
    assert waits[0] == 0 and waits[-1] > 0, waits


def test_nothing_is_recorded_outside_the_block(tmp_path):
    f, params, x = overlapped_step()
    jax.block_until_ready(f(params, x))
    with jaxring.timeline(tmp_path / "a.json"):
        pass
    events = json.loads((tmp_path / "a.json").read_text())["traceEvents"]
    assert events == []


def test_environment_variable_writes_the_trace_at_exit(script, tmp_path):
    path = tmp_path / "env.json"
    res = script(
        """
        import jaxring, jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        mesh = jax.make_mesh((4,), ("i",))
        f = jax.jit(jax.shard_map(lambda v: jaxring.psum(v, "i"), mesh=mesh,
                                  in_specs=P("i"), out_specs=P("i")))
        x = jax.device_put(jnp.ones((4, 1000)), NamedSharding(mesh, P("i")))
        jax.block_until_ready(f(x))
    """,
        devices=4,
        env={"JAXRING_TIMELINE": str(path)},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    spans = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["tid"] for e in spans) == [0, 1, 2, 3]
    assert all(e["name"] == "allreduce sum over i" for e in spans)
    res = script(
        "import jaxring",
        devices=4,
        env={"JAXRING_TIMELINE": str(tmp_path / "missing" / "env.json")},
    )
    assert res.returncode != 0
    assert "JAXRING_TIMELINE=" in res.stderr and "does not exist" in res.stderr


def test_a_path_that_cannot_be_written_fails_before_recording(tmp_path):
    missing = tmp_path / "no-such-dir" / "trace.json"
    ran = []
    with pytest.raises(
        FileNotFoundError,
        match=re.escape(
            f"jaxring.timeline('{missing}'): cannot write the timeline to "
            f"'{missing}': the directory '{missing.parent}' does not exist. Name a "
            "file in a directory that exists"
        ),
    ):
        with jaxring.timeline(missing):
            ran.append(True)
    assert not ran  # the block's work is not done in vain
    with pytest.raises(
        IsADirectoryError,
        match=re.escape(f"cannot write the timeline to '{tmp_path}': Is a directory"),
    ):
        with jaxring.timeline(tmp_path):
            ran.append(True)
    assert not ran
    # The check leaves no file behind; a good path records as before.
    with jaxring.timeline(tmp_path / "ok.json"):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.json"]


def test_a_bad_environment_path_fails_at_import(monkeypatch, tmp_path):
    """The variable is checked where it is read (at import), not when the
    trace is written at exit."""
    from jaxring._src import timeline

    missing = tmp_path / "no-such-dir" / "trace.json"
    monkeypatch.setenv("JAXRING_TIMELINE", str(missing))
    with pytest.raises(
        FileNotFoundError,
        match=re.escape(
            f"JAXRING_TIMELINE='{missing}': cannot write the timeline to "
            f"'{missing}': the directory '{missing.parent}' does not exist"
        ),
    ):
        timeline.start_from_environment()
    assert not timeline._recording


@pytest.mark.examples
def test_demo_trainer_runs_and_losses_agree(script, tmp_path):
    path, png = tmp_path / "demo.json", tmp_path / "demo.png"
    res = script(
        f"""
        import sys
        from jaxring import demo
        sys.exit(demo.main(["--devices", "4", "--steps", "2", "--per-device-batch", "4",
                            "--timeline", {str(path)!r}, "--plot", {str(png)!r}]))
    """,
        devices=4,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "overlap chose" in out and "median step" in out, out
    rows = [
        line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and "ms" in line
    ]
    assert len(rows) == 2, out
    for row in rows:  # step, loss (pmean at end), loss (overlap), ...
        assert abs(float(row[1]) - float(row[2])) < 1e-4, row
    spans = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert any(e["name"].startswith("bucket") for e in spans)
    assert any(e["name"].startswith("step, overlap") for e in spans)
    assert f"plot of loss and step time per step: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
