"""Run by tests/test_multiprocess.py: allreduces within axis_index_groups
whose groups span processes (over TCP) or stay in one, of one size and of
different sizes, split-phase under jaxring.overlap too, against numpy. A
process reports one "check" per grouping, then "ok", or "raised" with the
error."""

import os
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from report import report

import jaxring

devices = np.array(jax.devices())
world = devices.size
mesh = Mesh(devices, ("x",))
spec = P("x")
# Ranks 0..world-1 run on processes in blocks (the launcher's layout).
GROUPINGS = {
    "across": [list(range(i, world, 2)) for i in range(2)],  # every other rank
    "uneven": [[0], list(range(1, world - 1)), [world - 1]],
    "reversed": [list(range(world))[::-1]],
}
x = np.random.default_rng(7).integers(-50, 50, (world, 4099)).astype(np.float32)
arr = jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])


def run(fn):
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    out = f(arr)
    return {s.index[0].start: np.asarray(s.data)[0] for s in out.addressable_shards}


try:
    with jaxring.translate_errors():
        for name, groups in GROUPINGS.items():
            sums = run(
                lambda v: jaxring.psum(
                    v, "x", axis_index_groups=groups, algorithm="ring", chunk_bytes=4096
                )
            )
            means = run(lambda v: jaxring.pmean(v, "x", axis_index_groups=groups))
            overlapped = run(
                jaxring.overlap(
                    lambda v: jax.lax.psum(v * 2, "x", axis_index_groups=groups), axis_name="x"
                )
            )
            for g in groups:
                for rank in set(g) & set(sums):
                    # Small integers in float32: every order sums exactly.
                    assert np.array_equal(sums[rank], x[g].sum(0)), (name, rank)
                    assert np.allclose(means[rank], x[g].mean(0), rtol=1e-6), (name, rank)
                    assert np.array_equal(overlapped[rank], 2 * x[g].sum(0)), (name, rank)
            report("check", grouping=name)
    report("ok")
except Exception as e:
    report("raised", error=type(e).__name__, message=" ".join(str(e).split())[:400])
if jax.process_index() == 0:
    time.sleep(2.0)  # it hosts the coordination service: leave last
os._exit(0)
