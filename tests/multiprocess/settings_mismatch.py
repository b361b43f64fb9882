"""Run by tests/test_multiprocess.py: process 1 changes its settings
before the first allreduce, per argv[1]: "ring" (algorithm "ring") or
"tuning" (a tuning table of its own that takes the ring) make it choose
the ring while process 0 runs direct, and every process must raise a clear
error at that allreduce's lowering, not wait until the timeout; "direct"
(algorithm "direct", which "auto" runs anyway) must change nothing. Each
process reports "raised" with the time it took, the error's type and its
message, or "no_error"."""

import os
import sys
import tempfile
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from report import report

import jaxring

setting, timeout_s = sys.argv[1], float(sys.argv[2])
# The defaults in every process, whatever the environment (a setting that
# is set is not the table's to choose).
for name in ("algorithm", "topology", "rings", "chunk_bytes"):
    jaxring.config.reset(name)
if jax.process_index() == 1:
    if setting == "tuning":
        from jaxring._src import tuning

        path = os.path.join(tempfile.mkdtemp(), "tuning.json")
        ring = {"algorithm": "ring", "rings": 1, "chunk_bytes": 1 << 20, "topology": "flat"}
        tuning.save(
            path,
            tuning.key("cpu", jax.device_count(), jax.process_count()),
            {"params": {}, "choices": {str(1 << 20): ring}},
        )
        jaxring.config.update("tuning", path)
    else:
        jaxring.config.update("algorithm", setting)
devices = np.array(jax.devices())
mesh = Mesh(devices, ("x",))
f = jax.jit(
    jax.shard_map(
        lambda v: jaxring.allreduce(v, "x", timeout_s=timeout_s),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x"),
        check_vma=False,
    )
)
x = np.ones((devices.size, 1024), np.float32)
arr = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("x")), lambda idx: x[idx])
start = time.time()
try:
    out = f(arr).block_until_ready()
    assert np.all(np.asarray(out.addressable_shards[0].data) == devices.size)
    report("no_error")
except Exception as e:
    message = " ".join(str(e).split())
    report("raised", took_s=time.time() - start, error=type(e).__name__, message=message[:600])
# A process that exits while another still reads the records from the
# key-value store can break that read: give them time.
time.sleep(3)
os._exit(0)
