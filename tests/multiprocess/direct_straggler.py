"""Run by tests/test_multiprocess.py: 4 processes of one device, a 2x2 mesh,
direct allreduces over axis "a" (two groups of this call site, each across
two processes) while the processes of one group arrive a few seconds late.
Both groups must still give numpy's sums: a group waiting for its
stragglers is not a process in another program. Reports "ok", or "raised"
with the error."""

import os
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from report import report

import jaxring

delay_s = float(sys.argv[1])
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
spec = P(("a", "b"))
f = jax.jit(
    jax.shard_map(
        lambda v: jaxring.psum(v, "a", algorithm="direct", timeout_s=60),
        mesh=mesh,
        in_specs=spec,
        out_specs=spec,
        check_vma=False,
    )
)
x = np.arange(4 * 1024, dtype=np.float32).reshape(4, 1024)
arr = jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])
# Rows (a, b) = (0, b) and (1, b) are summed: row r pairs with row r ^ 2.
want = x + x[[2, 3, 0, 1]]
me = jax.process_index()
try:
    with jaxring.translate_errors():
        f(arr).block_until_ready()
        if me in (2, 3):
            time.sleep(delay_s)
        out = f(arr)
        for shard in out.addressable_shards:
            row = shard.index[0].start
            if not np.array_equal(np.asarray(shard.data)[0], want[row]):
                raise SystemExit(f"MISMATCH in row {row}")
    report("ok")
except Exception as e:  # what a training loop would see
    report("raised", error=type(e).__name__, message=" ".join(str(e).split())[:400])
time.sleep(1.0 if me else 3.0)  # process 0 hosts the coordination service
os._exit(0)
