"""Run by tests/test_multiprocess.py: process 1 reduces a longer vector than
the others ("count"), or as many elements in another shape ("shape"), as if
its program were built from different shapes. Every process must raise a
clear error well before the timeout: it reports "raised" with the time it
took, the error's type and its message (or "no_error")."""

import os
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from report import report

import jaxring

timeout_s = float(sys.argv[1])
differ = sys.argv[2] if len(sys.argv) > 2 else "count"
devices = np.array(jax.devices())
mesh = Mesh(devices, ("x",))
other = jax.process_index() == 1
shape = {"count": (2048,) if other else (1024,), "shape": (32, 32) if other else (1024,)}[differ]
f = jax.jit(
    jax.shard_map(
        lambda v: jaxring.allreduce(v, "x", timeout_s=timeout_s),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x"),
        check_vma=False,
    )
)
x = np.ones((devices.size, *shape), np.float32)
arr = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("x")), lambda idx: x[idx])
start = time.time()
try:
    with jaxring.translate_errors():
        f(arr).block_until_ready()
    report("no_error")
except Exception as e:
    message = " ".join(str(e).split())
    report("raised", took_s=time.time() - start, error=type(e).__name__, message=message[:600])
# The abort that tells the other process why is written by a sender thread;
# exiting at once can close the connection before it is, and the other
# process then sees a lost peer instead of the mismatch. Give it time.
time.sleep(3)
os._exit(0)
