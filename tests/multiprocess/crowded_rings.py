"""Run by tests/test_multiprocess.py: lowers allreduces across processes with
the ring count left to the default, passed, and set, and a step under
jaxring.overlap; prints the num_rings each custom call carries (RINGS lines)
and the job's cores per rank, checks the sums against numpy, prints DONE.

The test starts the job on fewer cores than ranks, where the default is one
ring (jaxring/_src/crowding.py)."""

import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

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


print("RINGS default", rings_of(lambda v: jaxring.allreduce(v, "i")), flush=True)
print("RINGS passed", rings_of(lambda v: jaxring.allreduce(v, "i", rings=2)), flush=True)
print(
    "RINGS overlap",
    rings_of(jaxring.overlap(lambda v: jax.lax.psum(v, "i"), axis_name="i")),
    flush=True,
)
jaxring.config.update("rings", 2)
print("RINGS set", rings_of(lambda v: jaxring.allreduce(v, "i")), flush=True)
print(
    "RINGS overlap-set",
    rings_of(jaxring.overlap(lambda v: jax.lax.psum(v, "i"), axis_name="i")),
    flush=True,
)
print("CORES", jaxring.transport_info()["cores_per_rank"], flush=True)
print("DONE", flush=True)
