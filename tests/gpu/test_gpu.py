"""The CUDA backend on a real GPU. Skipped where jaxring's CUDA backend is
not built or no GPU is visible; tests/gpu/run_device_checks.sh runs these
on a machine with one GPU.

Several ranks share the one GPU as separate processes, each with a slice of
its memory, so worlds of 2 and 4 run without a multi-GPU machine (with
NCCL_MULTI_RANK_GPU_ENABLE=1 from NCCL 2.30 on, as separate "hosts" over
loopback before; see gpu_worker.gpu_env). tests/test_gpu_harness.py checks
the launcher and the comparisons on CPU.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxring._src import cuda_backend

sys.path.insert(0, os.path.dirname(__file__))
import gpu_worker  # noqa: E402


def _gpus() -> int:
    if cuda_backend.status() != "built":
        return 0
    from jaxring import _jaxring_cuda
    return _jaxring_cuda.device_count()


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    _gpus() == 0, reason=f"no GPU visible (CUDA backend {cuda_backend.status()})")]


def run_workers(processes: int, mode: str, timeout: float = 240) -> list[str]:
    results = gpu_worker.launch(processes, mode, timeout)
    for rc, out in results:
        print(out[-3000:])
        assert rc == 0 and out.rstrip().endswith("OK"), out[-3000:]
    return [out for _, out in results]


def test_reduce_kernel_matches_cpu_bitwise():
    from jaxring import _jaxring, _jaxring_cuda
    rng = np.random.default_rng(0)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, 65504, 3.4e38])
    failures = []
    for name, t in _jaxring.ELEM_TYPES.items():
        dtype = {"bfloat16": "uint16", "float16": "float16"}.get(name, name)
        for op in range(4):
            for n in (1, 7, 8, 33, 4099, 1 << 20):
                if name in ("float16", "float32", "float64"):
                    a = rng.normal(0, 100, n).astype(dtype)
                    b = rng.normal(0, 100, n).astype(dtype)
                    k = min(n, len(specials))
                    a[:k] = specials[:k].astype(dtype)
                    b[:k] = specials[::-1][:k].astype(dtype)
                else:
                    # Random bits: every integer and bfloat16 pattern.
                    itemsize = np.dtype(dtype).itemsize
                    a = np.frombuffer(rng.bytes(n * itemsize), dtype)
                    b = np.frombuffer(rng.bytes(n * itemsize), dtype)
                want = _jaxring.reduce_bytes(t, op, a.tobytes(), b.tobytes())
                got = _jaxring_cuda.reduce_on_device(t, op, a.tobytes(), b.tobytes())
                bad = gpu_worker.differing_elements(got, want, name)
                if len(bad):
                    g, w = np.frombuffer(got, dtype), np.frombuffer(want, dtype)
                    failures.append(f"{name} op {op} n={n}: {len(bad)} differ, first at "
                                    f"{bad[0]}: {a[bad[0]]} ? {b[bad[0]]} -> {g[bad[0]]}, "
                                    f"CPU {w[bad[0]]}")
    # Every type and op is checked before failing, so one run shows them all.
    assert not failures, "\n".join(failures)


def test_world_of_one_gpu():
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import gpu_worker
        import jaxring, jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        mesh = jax.make_mesh((1,), ("i",))
        x = jax.device_put(jnp.arange(100003, dtype=jnp.float32), NamedSharding(mesh, P("i")))
        for algorithm in ("ring", "nccl"):
            f = jax.jit(jax.shard_map(lambda v: jaxring.allreduce(v, "i", algorithm=algorithm,
                        rings=3, chunk_bytes=4096), mesh=mesh, in_specs=P("i"), out_specs=P("i")))
            assert "jaxring_allreduce_cuda" in f.lower(x).as_text()
            # XLA may capture a custom call into a CUDA graph (a command
            # buffer) only if it was registered as compatible; jaxring's
            # handlers are not, and must stay outside.
            comps = gpu_worker.hlo_computations(f.lower(x).compile().as_text())
            home = [n for n, lines in comps.items()
                    if any("jaxring_allreduce_cuda" in l for l in lines)]
            print(algorithm, "custom call in", home, "; command buffers:",
                  [n for n in comps if "command_buffer" in n])
            assert home and not any("command_buffer" in n for n in home), home
            for _ in range(3):
                y = f(x)
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
            # pmean under pmap, and under grad.
            g = jax.pmap(lambda v: jax.grad(lambda w: jaxring.pmean(jnp.sum(w * v), "b"))(v),
                         axis_name="b")(jnp.ones((1, 5)))
            np.testing.assert_array_equal(np.asarray(g), np.ones((1, 5)))
        from jaxring import _jaxring_cuda
        assert _jaxring_cuda.communicator_count() >= 3
        print("OK")
    """)
    env = gpu_worker.gpu_env(1)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=env, timeout=240)
    print(r.stdout[-2000:])
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.parametrize("processes", [2, 4])
def test_processes_sharing_the_gpu_match_numpy(processes):
    run_workers(processes, "correctness")


def test_overlap_step_matches_pmean_at_the_end():
    run_workers(2, "overlap")


def test_missing_peer_times_out_then_fails_fast():
    outs = run_workers(2, "peer_missing", timeout=120)
    assert "timed out" in outs[0] and "aborted" in outs[0]


def test_peer_dying_mid_job_raises_instead_of_hanging():
    (rc0, out0), (rc1, _) = gpu_worker.launch(2, "peer_dies", timeout=120)
    print(out0[-3000:])
    assert rc0 == 0 and rc1 == 0, out0[-3000:]
    # The watchdog's reason reaches stderr (merged into the output).
    assert "the communicator was aborted" in out0
