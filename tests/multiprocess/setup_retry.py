"""Run by tests/test_multiprocess.py: process 1 never reaches an allreduce,
so process 0's TCP set-up times out; its second try must raise the first
failure again, not trip over keys the first try published. Process 0
reports each "attempt" ("first", "second"): whether it raised, and the
error's message."""

import time

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from report import report

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
    for attempt in ("first", "second"):
        try:
            f.lower(jax.ShapeDtypeStruct((mesh.size, 4), np.float32))
            report("attempt", attempt=attempt, raised=False)
        except RuntimeError as e:
            report("attempt", attempt=attempt, raised=True, message=" ".join(str(e).split()))
else:
    time.sleep(4)  # alive, but never joins
