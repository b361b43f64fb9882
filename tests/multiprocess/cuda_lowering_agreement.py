"""Run by tests/test_cuda_backend.py under jaxring.launch: lowers an
allreduce for the CUDA platform (no GPU needed) over the devices of every
process, with process 1's operand argv[1] times longer than the others'
(1: the same program everywhere, lowered for two shapes in turn; 0:
process 0 lowers nothing, and stays up for 10 s). Reports "lowered" with
the number of CUDA custom calls per lowering, or "raised" with the time it
took, the error's type and its message."""

import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from report import report

import jaxring

longer = int(sys.argv[1])
if longer == 0 and jax.process_index() == 0:
    time.sleep(10)  # hosts the coordination service: stays up, lowers nothing
    sys.exit(0)
devices = np.array(jax.devices())
mesh = Mesh(devices, ("x",))
n = 1024 * (max(longer, 1) if jax.process_index() == 1 else 1)
f = jax.jit(
    jax.shard_map(
        lambda v: jaxring.allreduce(v, "x", timeout_s=3.0 if longer == 0 else 20.0),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x"),
        check_vma=False,
    )
)
# The same call site again with another shape (a new batch size) must
# lower again in every process, compared with its own counterpart.
for length in (n, 3 * n) if longer == 1 else (n,):
    x = jax.ShapeDtypeStruct(
        (devices.size, length), np.float32, sharding=NamedSharding(mesh, P("x"))
    )
    start = time.time()
    try:
        text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
        report("lowered", calls=text.count("@jaxring_allreduce_cuda"))
    except Exception as e:
        message = " ".join(str(e).split())
        report(
            "raised",
            took_s=time.time() - start,
            error=type(e).__name__,
            message=message[:600],
        )
