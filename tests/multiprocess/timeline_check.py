"""Run by tests/test_multiprocess.py: a timeline across processes. One
allreduce, then three in a scan's body (which run under one key; the
transports tell the iterations apart by an op id of their own), under
algorithm argv[1]. Each process records a timeline and reports the names
of its spans ("spans"), per local device, then "done": every iteration must
have its span, named as its call site ("allreduce sum over x" before the
loop, "allreduce max over x" in it)."""

import json
import os
import sys
import tempfile
from functools import partial

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from report import report

import jaxring

algorithm = sys.argv[1]
devices = np.array(jax.devices())
mesh = Mesh(devices, ("x",))
x = jax.make_array_from_callback(
    (devices.size, 4096), NamedSharding(mesh, P("x")), lambda idx: np.ones((1, 4096), np.float32)
)


@jax.jit
@partial(jax.shard_map, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
def step(v):
    v = jaxring.allreduce(v, "x", algorithm=algorithm)

    def body(carry, _):
        return jaxring.allreduce(carry + 1, "x", op="max", algorithm=algorithm), None

    v, _ = jax.lax.scan(body, v, None, length=3)
    return v


jax.block_until_ready(step(x))  # compiled outside the recording
path = os.path.join(tempfile.mkdtemp(), "trace.json")
with jaxring.timeline(path):
    out = jax.block_until_ready(step(x))
assert float(np.asarray(out.addressable_shards[0].data).ravel()[0]) == devices.size + 3
spans = [e for e in json.load(open(path))["traceEvents"] if e["ph"] == "X"]
for d in sorted({e["tid"] for e in spans}):
    report("spans", device=d, names=sorted(e["name"] for e in spans if e["tid"] == d))
report("done")
