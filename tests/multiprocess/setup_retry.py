"""Run by tests/test_multiprocess.py: process 1 never reaches an allreduce,
so process 0's TCP set-up times out; its second try must raise the first
failure again, not trip over keys the first try published."""

import time

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import jaxring

mesh = Mesh(np.array(jax.devices()), ("x",))
if jax.process_index() == 0:
    f = jax.jit(
        jax.shard_map(
            lambda v: jaxring.allreduce(v, "x", timeout_s=2.0),
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P("x"),
            check_vma=False,
        )
    )
    for attempt in ("FIRST", "SECOND"):
        try:
            f.lower(jax.ShapeDtypeStruct((mesh.size, 4), np.float32))
            print(attempt, "NO ERROR", flush=True)
        except RuntimeError as e:
            print(attempt, " ".join(str(e).split()), flush=True)
else:
    time.sleep(4)  # alive, but never joins
