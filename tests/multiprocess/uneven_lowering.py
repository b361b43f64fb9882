"""Run by tests/test_multiprocess.py: process 0 lowers and runs jaxring
functions of its own (an evaluation over its local devices) before the step
every process runs. The step's allreduces must still pair up across the
processes (op ids do not count what a process lowered before) and match
numpy; a process reports "ok" (or "wrong"), or "raised" with the error."""

import os
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from report import report

import jaxring

timeout_s = float(sys.argv[1])
if jax.process_index() == 0:
    local = Mesh(np.array(jax.local_devices()), ("l",))
    for scale in (1.0, 2.0):  # two lowerings of a function nobody else has
        evaluate = jax.jit(
            jax.shard_map(
                lambda v, s=scale: jaxring.psum(v * s, "l", timeout_s=timeout_s),
                mesh=local,
                in_specs=P("l"),
                out_specs=P("l"),
                check_vma=False,
            )
        )
        y = np.ones((local.size, 8), np.float32)
        np.asarray(evaluate(jax.device_put(y, NamedSharding(local, P("l")))))

devices = np.array(jax.devices())
mesh = Mesh(devices, ("x",))
step = jax.jit(
    jax.shard_map(
        lambda v: (
            jaxring.psum(v, "x", timeout_s=timeout_s)
            + jaxring.pmean(2 * v, "x", timeout_s=timeout_s)
        ),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x"),
        check_vma=False,
    )
)
x = np.arange(devices.size * 16, dtype=np.float32).reshape(devices.size, 16)
arr = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("x")), lambda idx: x[idx])
want = x.sum(0) + 2 * x.mean(0)
start = time.time()
try:
    with jaxring.translate_errors():
        out = step(arr)
        good = all(np.allclose(np.asarray(s.data), want, rtol=1e-6) for s in out.addressable_shards)
    report("ok" if good else "wrong")
except Exception as e:
    report(
        "raised",
        took_s=time.time() - start,
        error=type(e).__name__,
        message=" ".join(str(e).split())[:400],
    )
if jax.process_index() == 0:
    time.sleep(2.0)  # it hosts the coordination service: leave last
os._exit(0)
