"""Run by tests/test_multiprocess.py: process 1 changes a setting that
chooses between direct and the ring (argv[1]: "algorithm" or "tuning")
before the first allreduce; every process must raise a clear error at that
allreduce's lowering, not wait until the timeout."""

import json
import os
import sys
import tempfile
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxring

setting, timeout_s = sys.argv[1], float(sys.argv[2])
if jax.process_index() == 1:
    if setting == "algorithm":
        jaxring.config.update("algorithm", "ring")
    else:  # a tuning file of its own, with no table for this job
        from jaxring._src import tuning
        fd, path = tempfile.mkstemp(suffix=".json")
        os.write(fd, json.dumps({"version": tuning.VERSION, "tables": {}}).encode())
        os.close(fd)
        jaxring.config.update("tuning", path)
devices = np.array(jax.devices())
mesh = Mesh(devices, ("x",))
f = jax.jit(jax.shard_map(
    lambda v: jaxring.allreduce(v, "x", timeout_s=timeout_s),
    mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
x = np.ones((devices.size, 1024), np.float32)
arr = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("x")),
                                   lambda idx: x[idx])
start = time.time()
try:
    f(arr).block_until_ready()
    print("NO ERROR", flush=True)
except Exception as e:
    message = " ".join(str(e).split())
    print(f"RAISED {time.time() - start:.3f} {type(e).__name__} {message[:600]}",
          flush=True)
os._exit(0)
