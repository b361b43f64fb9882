"""Run by tests/test_hostile_peers.py: a job that keeps allreducing, checks
every result against numpy, and reports what it holds, while the test
attacks its TCP transport from outside.

Reports "ready" with the transport's address and job id and this process's
threads, open descriptors and RSS once the transport is up; loops until a
file named `stop` appears in its working directory (the test makes it after
the attacks and the handshake deadline); then reports "after" with the same
counts and what the transport holds, and "done" with the number of steps
and of wrong results. A jaxring error ends it with "failed": the same
counts, the operations pending and the error.
"""

import os
import pathlib
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from report import report

import jaxring


def resources() -> dict:
    status = pathlib.Path("/proc/self/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    threads = int(fields["Threads"])
    rss_kib = int(fields["VmRSS"].split()[0])
    fds = len(os.listdir("/proc/self/fd"))
    return {"threads": threads, "fds": fds, "rss_mib": rss_kib / 1024}


limit_s = float(sys.argv[1])
devices = np.array(jax.devices())
mesh = Mesh(devices, ("x",))
f = jax.jit(
    jax.shard_map(
        # The ring: its frames cross the transport the attacks aim at ("auto"
        # would run direct over the host segment, and the sockets would carry
        # no data of the job's own).
        lambda v: jaxring.psum(v, "x", timeout_s=60.0, algorithm="ring"),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x"),
        check_vma=False,
    )
)
rng = np.random.default_rng(0)  # the same data in every process
steps = wrong = 0
started = time.monotonic()


def step():
    """One allreduce, checked; returns whether every process wants to stop."""
    global steps, wrong
    # Integers in float32: the sum is exact, so any change shows. The last
    # column carries each process's wish to stop, so that all stop after the
    # same step.
    x = rng.integers(-1000, 1000, (devices.size, 4097)).astype(np.float32)
    x[:, -1] = float(pathlib.Path("stop").exists() or time.monotonic() - started > limit_s)
    arr = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("x")), lambda idx: x[idx])
    out = f(arr)
    want = x[:, :-1].sum(0)
    stop = False
    for shard in out.addressable_shards:
        got = np.asarray(shard.data)
        wrong += int((got[:, :-1] != want).any())
        stop = bool(got[0, -1] > 0)
    steps += 1
    if steps == 3:
        info = jaxring.transport_info()
        report("ready", address=info["address"], job_id=info["job_id"], **resources())
    return stop


try:
    with jaxring.translate_errors():
        while not step():
            pass
except jaxring.JaxringError as e:
    # What a broken job must end in: a clear error, with what it holds.
    info = jaxring.transport_info()
    report(
        "failed",
        **resources(),
        pending=info["pending_ops"],
        error=type(e).__name__,
        message=" ".join(str(e).split())[:400],
    )
    if jax.process_index() == 0:
        time.sleep(5.0)  # it hosts the coordination service: leave last
    os._exit(3)
info = jaxring.transport_info()
report(
    "after",
    **resources(),
    refused=info["refused_connections"],
    pending=info["pending_ops"],
    lost=info["lost_processes"],
    shm_links=len(info["shm_outbound"]),
)
report("done", steps=steps, wrong=wrong)
