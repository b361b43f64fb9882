"""Run by tests/test_multiprocess.py: lowers allreduces across processes with
the ring count left to the default, passed, and set, and a step under
jaxring.overlap; reports the num_rings each custom call carries ("rings",
per setting), checks the sums against numpy, and reports "done" with the
job's cores per rank.

The test starts the job on fewer cores than ranks, where the default is one
ring (jaxring/_src/crowding.py)."""

import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from report import report

import jaxring

devices = np.array(jax.devices())
n = devices.size
mesh = Mesh(devices, ("i",))
x = jax.make_array_from_callback(
    (n, 4096),
    NamedSharding(mesh, P("i")),
    lambda idx: np.full((1, 4096), idx[0].start + 1, np.float32),
)


def rings_of(fn):
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False))
    hlo = f.lower(x).as_text()
    found = sorted({int(v) for v in re.findall(r"num_rings = (\d+)", hlo)})
    out = f(x)
    for shard in out.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), np.full((1, 4096), n * (n + 1) / 2))
    return found


report("rings", setting="default", rings=rings_of(lambda v: jaxring.allreduce(v, "i")))
report("rings", setting="passed", rings=rings_of(lambda v: jaxring.allreduce(v, "i", rings=2)))
report(
    "rings",
    setting="overlap",
    rings=rings_of(jaxring.overlap(lambda v: jax.lax.psum(v, "i"), axis_name="i")),
)
jaxring.config.update("rings", 2)
report("rings", setting="set", rings=rings_of(lambda v: jaxring.allreduce(v, "i")))
report(
    "rings",
    setting="overlap-set",
    rings=rings_of(jaxring.overlap(lambda v: jax.lax.psum(v, "i"), axis_name="i")),
)
report("done", cores_per_rank=jaxring.transport_info()["cores_per_rank"])
