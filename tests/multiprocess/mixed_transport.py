"""Run by tests/test_multiprocess.py under `python -m jaxring.launch`: the
last process sets JAXRING_TRANSPORT=tcp for itself before its first
allreduce, the others keep "auto". The processes must settle on one
answer (no host segment, so "auto" runs the ring everywhere) without
waiting out a timeout: each reports "result" with what it was told of the
host segment, the lowered algorithm, how long the first allreduce took,
and whether the result is right."""

import os
import re
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from report import report

import jaxring
from jaxring import _jaxring

if jax.process_index() == jax.process_count() - 1:
    os.environ["JAXRING_TRANSPORT"] = "tcp"
devices = np.array(jax.devices())
mesh = Mesh(devices, ("x",))
f = jax.jit(
    jax.shard_map(
        lambda v: jaxring.allreduce(v, "x", timeout_s=30.0),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x"),
        check_vma=False,
    )
)
x = np.arange(devices.size * 1024, dtype=np.float32).reshape(devices.size, 1024)
arr = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("x")), lambda i: x[i])
started = time.monotonic()
out = f(arr)
out.block_until_ready()
took = time.monotonic() - started
info = jaxring.transport_info()["host_direct"]
names = {v: k for k, v in _jaxring.ALGORITHMS.items()}
number = int(re.search(r"algorithm = (\d+)", f.lower(arr).as_text()).group(1))
want = x.sum(0)
report(
    "result",
    host_direct=info["available"],
    host_direct_unavailable=info["unavailable"],
    algorithm=names[number],
    took_s=took,
    correct=all(np.array_equal(np.asarray(s.data)[0], want) for s in out.addressable_shards),
)
