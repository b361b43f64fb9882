"""Run by tests/test_multiprocess.py: two processes on one host that stop
in the host segment's set-up (jaxring/_src/host_segment.py), to check what
each way out leaves in /dev/shm. Arguments: the timeout and the mode.

Process 1 waits until process 0 has published the segment's name, reports
"saw" with the name and whether /dev/shm holds it, and then, by mode:
  hold        waits until the test ends it (the test stops process 0);
  exit        exits with status 1, as a process that crashed in set-up
              (under the launcher, which then stops process 0);
  raise       maps the segment as usual; process 0 raises in its set-up
              once process 1 said whether it mapped it.
  run         maps the segment as usual: the set-up ends, and both run one
              allreduce with algorithm="direct", then report "done" with
              whether direct runs across the processes (host_direct).
"""

import json
import os
import signal
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from report import report

import jaxring
from jaxring._src import host_segment

# SIGINT as an interactive run has it: a test run started in the background
# of a shell without job control starts this process with SIGINT ignored,
# which jaxring leaves ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)

timeout_s = float(sys.argv[1])
mode = sys.argv[2]
me = jax.process_index()
set_up = host_segment.set_up
decide = host_segment._decide


def name_published(client) -> str:
    record = json.loads(
        client.blocking_key_value_get(host_segment._NAME_KEY, int(timeout_s * 1000))
    )
    name = record["name"]
    report("saw", name=name, exists=os.path.exists("/dev/shm" + name))
    return name


def process_1_set_up(client, me, *args, **kwargs):
    name_published(client)
    if mode == "hold":
        while True:
            time.sleep(3600)
    if mode == "exit":
        sys.stdout.flush()
        os._exit(1)
    return set_up(client, me, *args, **kwargs)


def process_0_decide(client, *args, **kwargs):
    mine = decide(client, *args, **kwargs)
    raise RuntimeError(f"injected failure after the decision {mine!r}")


if me == 1 and mode != "run":
    host_segment.set_up = process_1_set_up
if me == 0 and mode == "raise":
    host_segment._decide = process_0_decide

mesh = Mesh(np.array(jax.devices()), ("x",))
f = jax.jit(
    jax.shard_map(
        lambda v: jaxring.allreduce(v, "x", timeout_s=timeout_s, algorithm="direct"),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x"),
        check_vma=False,
    )
)
x = np.ones((mesh.size, 1024), np.float32)
arr = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("x")), lambda idx: x[idx])
out = np.asarray(jax.device_get(f(arr).addressable_data(0)))
assert (out == mesh.size).all(), out
report("done", host_direct=jaxring.transport_info()["host_direct"]["available"])
