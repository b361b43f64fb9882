"""A world of one GPU, run by tests/gpu/test_gpu.py and, under a debugger,
by device_checks.py when that test fails. Prints each stage before it runs
(so that a crash's log shows where), and "OK" last.

    python world_of_one.py [ring|nccl ...]
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxring

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_worker


def stage(text: str) -> None:
    print(text, flush=True)


def main(algorithms) -> None:
    mesh = jax.make_mesh((1,), ("i",))
    x = jax.device_put(jnp.arange(100003, dtype=jnp.float32), NamedSharding(mesh, P("i")))
    for algorithm in algorithms:
        f = jax.jit(
            jax.shard_map(
                lambda v: jaxring.allreduce(v, "i", algorithm=algorithm, rings=3, chunk_bytes=4096),
                mesh=mesh,
                in_specs=P("i"),
                out_specs=P("i"),
            )
        )
        stage(f"{algorithm}: lowering")
        assert "jaxring_allreduce_cuda" in f.lower(x).as_text()
        # XLA may capture a custom call into a CUDA graph (a command buffer)
        # only if it was registered as compatible; jaxring's handlers are
        # not, and must stay outside.
        stage(f"{algorithm}: compiling")
        comps = gpu_worker.hlo_computations(f.lower(x).compile().as_text())
        home = [
            n
            for n, lines in comps.items()
            if any("jaxring_allreduce_cuda" in line for line in lines)
        ]
        stage(
            f"{algorithm}: custom call in {home}; command buffers: "
            f"{[n for n in comps if 'command_buffer' in n]}"
        )
        assert home and not any("command_buffer" in n for n in home), home
        for i in range(3):
            stage(f"{algorithm}: call {i}")
            y = f(x)
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
        stage(f"{algorithm}: pmean under pmap and grad")
        g = jax.pmap(
            lambda v: jax.grad(lambda w: jaxring.pmean(jnp.sum(w * v), "b"))(v), axis_name="b"
        )(jnp.ones((1, 5)))
        np.testing.assert_array_equal(np.asarray(g), np.ones((1, 5)))
    from jaxring import _jaxring_cuda

    assert _jaxring_cuda.communicator_count() >= 3
    print("OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["ring", "nccl"])
