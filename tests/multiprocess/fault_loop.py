"""Run by tests/test_multiprocess.py: a long sequence of allreduces that the
test interrupts by killing one process. Arguments: the timeout, the
element count, and the algorithm ("auto" unless given). Each survivor must raise a
jaxring.JaxringError; it reports "raised" with the wall-clock time, the
error's type, the peer it names and its message, then exits without waiting
for jax.distributed's shutdown (the job is broken). After 20 steps each
process reports "ready", with whether it runs direct over the host segment
and its shared-memory links."""

import os
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from report import report

import jaxring

timeout_s = float(sys.argv[1])
count = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 16
algorithm = sys.argv[3] if len(sys.argv) > 3 else "auto"
devices = np.array(jax.devices())
mesh = Mesh(devices, ("x",))
f = jax.jit(
    jax.shard_map(
        lambda v: jaxring.allreduce(v, "x", timeout_s=timeout_s, algorithm=algorithm),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x"),
        check_vma=False,
    )
)
x = np.ones((devices.size, count), np.float32)
arr = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("x")), lambda idx: x[idx])
steps = 0
try:
    with jaxring.translate_errors():
        while True:
            out = f(arr)
            out.block_until_ready()
            steps += 1
            if steps == 20:
                info = jaxring.transport_info()
                links = len(info["shm_outbound"])
                direct = info["host_direct"]["available"]
                report(
                    "ready",
                    pid=os.getpid(),
                    direct=direct,
                    shm_links=links,
                    job_id=info["job_id"],
                )
except Exception as e:  # what a training loop would see
    message = " ".join(str(e).split())
    report(
        "raised",
        at=time.time(),
        error=type(e).__name__,
        peer=getattr(e, "peer_process", None),
        message=message[:400],
    )
    if jax.process_index() == 0:
        # Process 0 hosts jax.distributed's coordination service; if it left
        # now, JAX would terminate the survivors that have not raised yet.
        time.sleep(5.0)
    os._exit(3)
