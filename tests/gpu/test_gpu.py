"""The CUDA backend on a real GPU. Skipped where jaxring's CUDA backend is
not built or no GPU is visible; tests/gpu/run_device_checks.sh runs these
on a machine with one GPU.

Several ranks share the one GPU as separate processes, each with a slice of
its memory, so worlds of 2 and 4 run without a multi-GPU machine (with
NCCL_MULTI_RANK_GPU_ENABLE=1 from NCCL 2.30 on, as separate "hosts" over
loopback before; see gpu_env in tests/gpu/gpu_job.py). tests/test_gpu_harness.py checks
the launcher and the comparisons on CPU.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from jaxring._src import cuda_backend

sys.path.insert(0, os.path.dirname(__file__))
import gpu_worker


def _gpus() -> int:
    if cuda_backend.status() != "built":
        return 0
    from jaxring import _jaxring_cuda

    return _jaxring_cuda.device_count()


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        _gpus() == 0, reason=f"no GPU visible (CUDA backend {cuda_backend.status()})"
    ),
]


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
                    failures.append(
                        f"{name} op {op} n={n}: {len(bad)} differ, first at "
                        f"{bad[0]}: {a[bad[0]]} ? {b[bad[0]]} -> {g[bad[0]]}, "
                        f"CPU {w[bad[0]]}"
                    )
    # Every type and op is checked before failing, so one run shows them all.
    assert not failures, "\n".join(failures)


def test_world_of_one_gpu():
    env = gpu_worker.gpu_env(1)
    r = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(__file__), "world_of_one.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    print(r.stdout[-3000:])
    assert r.returncode == 0 and r.stdout.rstrip().endswith("OK"), (
        r.stdout[-2000:] + r.stderr[-4000:]
    )


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
