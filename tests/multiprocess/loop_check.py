"""Run by tests/test_multiprocess.py: allreduces in a loop's body (scan,
fori_loop) across processes, under each algorithm. XLA gives such a call
one key for the whole run, so each iteration must still meet the same
iteration on every rank. Compares every iteration's result with numpy
(integer-valued floats, so every summation order gives the same bits) and
reports "loop" per algorithm with whether every one matched, then "done"."""

import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from report import report

import jaxring

iterations, count = int(sys.argv[1]), int(sys.argv[2])
devices = np.array(jax.devices())
world = devices.size
mesh = Mesh(devices, ("x",))
rows = np.random.default_rng(0).integers(-8, 9, (world, count)).astype(np.float32)
x = jax.make_array_from_callback(rows.shape, NamedSharding(mesh, P("x")), lambda idx: rows[idx])
steps = np.arange(iterations, dtype=np.float32)
# Iteration i reduces rows * (i + 1) + i.
expected = steps[:, None] * (rows.sum(0) + world) + rows.sum(0)


def scanned(algorithm):
    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=P("x"), out_specs=P(None, "x"), check_vma=False)
    def f(v):
        def body(carry, i):
            y = jaxring.allreduce(v * (i + 1) + i, "x", algorithm=algorithm)
            return carry + 1, y

        _, ys = jax.lax.scan(body, 0, jnp.asarray(steps))
        return ys

    return f


def looped(algorithm):
    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    def f(v):
        def body(i, total):
            fi = i.astype(jnp.float32)
            return total + jaxring.allreduce(v * (fi + 1) + fi, "x", algorithm=algorithm)

        return jax.lax.fori_loop(0, iterations, body, jnp.zeros_like(v))

    return f


for algorithm in sys.argv[3].split(","):
    ok = True
    for _ in range(3):  # the same run id scheme every call: repeated runs too
        ys = scanned(algorithm)(x)
        for shard in ys.addressable_shards:
            got = np.asarray(shard.data)  # (iterations, 1, count): one device's
            ok &= bool(np.array_equal(got[:, 0], expected))
        total = looped(algorithm)(x)
        for shard in total.addressable_shards:
            ok &= bool(np.array_equal(np.asarray(shard.data)[0], expected.sum(0)))
    report("loop", algorithm=algorithm, ok=ok)
report("done")
