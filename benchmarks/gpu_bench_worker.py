"""One process of a GPU benchmark job, for benchmarks/gpu_allreduce.py.

    python gpu_bench_worker.py PROCESS NUM_PROCESSES PORT MODE

The job itself (launch, the environment by NCCL version, Job) is
tests/gpu/gpu_job.py, shared with the checks there. MODE:

* ``bench``: busbw of jaxring's ring and of NCCL's allreduce on the same
  communicators, 1 MiB to 256 MiB, in alternating rounds; prints a table.
* ``bench_sweep``: the ring's busbw by rings and chunk size against
  NCCL's, 16 to 256 MiB.
* ``overlap_bench``: step time of an MLP train step with and without
  ``jaxring.overlap``, in alternating rounds.
"""

import pathlib
import sys

import numpy as np

# The job harness lives with the GPU checks, which share it.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "gpu"))
import gpu_job
from gpu_job import Job, median_seconds, mlp_inputs, mlp_step, serve


def launch(
    processes: int, mode: str, timeout: float = 240, log_dir: str | None = None
) -> list[tuple[int, str]]:
    """A job of this worker (gpu_job.launch)."""
    return gpu_job.launch(__file__, processes, mode, timeout, log_dir)


def bench(job: Job) -> int:
    sizes = [1 << s for s in range(20, 29, 2)]  # 1 MiB .. 256 MiB
    rounds, iters = 5, 10
    rows = []
    for nbytes in sizes:
        x = job.global_array(np.ones(nbytes // 4, np.float32))
        fns = {
            a: job.allreduce_fn(algorithm=a, chunk_bytes=max(1 << 20, nbytes // 8))
            for a in ("ring", "nccl")
        }
        seconds = median_seconds(job, fns, (x,), rounds, iters)
        busbw = {
            a: 2 * (job.nprocs - 1) / job.nprocs * nbytes / s / 1e9 for a, s in seconds.items()
        }
        rows.append((nbytes, busbw["ring"], busbw["nccl"]))
    if job.pid == 0:
        print(
            f"world {job.nprocs} on one GPU: busbw GB/s, float32 sum "
            f"(median of {rounds} rounds of {iters} calls)"
        )
        print(f"{'bytes':>12} {'ring':>10} {'nccl':>10} {'ring/nccl':>10}")
        for nbytes, ring, nccl in rows:
            print(f"{nbytes:>12} {ring:>10.2f} {nccl:>10.2f} {ring / nccl:>10.3f}")
    return 0


def bench_sweep(job: Job) -> int:
    """busbw of the ring by rings and chunk size against NCCL's allreduce,
    16 to 256 MiB: which of the ring's parameters its gap to NCCL depends
    on."""
    rounds, iters = 3, 5
    configs = [("nccl", 2, 1 << 22)] + [
        ("ring", r, c) for r in (1, 2, 4) for c in (1 << 20, 1 << 22, 1 << 24)
    ]
    results = {}
    for nbytes in (1 << 24, 1 << 26, 1 << 28):
        x = job.global_array(np.ones(nbytes // 4, np.float32))
        fns = {
            cfg: job.allreduce_fn(algorithm=cfg[0], rings=cfg[1], chunk_bytes=cfg[2])
            for cfg in configs
        }
        for cfg, s in median_seconds(job, fns, (x,), rounds, iters).items():
            results[(nbytes, cfg)] = 2 * (job.nprocs - 1) / job.nprocs * nbytes / s / 1e9
    if job.pid == 0:
        print(
            f"world {job.nprocs} on one GPU: busbw GB/s by configuration, float32 sum "
            f"(median of {rounds} rounds of {iters} calls); ratio to nccl in brackets"
        )
        sizes = sorted({n for n, _ in results})
        print(f"{'algorithm rings chunk':>24} " + " ".join(f"{n >> 20:>9} MiB" for n in sizes))
        for cfg in configs:
            cells = []
            for n in sizes:
                bw = results[(n, cfg)]
                cells.append(f"{bw:6.2f} ({bw / results[(n, configs[0])]:.2f})")
            print(
                f"{cfg[0]:>10} {cfg[1]:>5} {cfg[2] >> 10:>6}K "
                + " ".join(f"{c:>13}" for c in cells)
            )
    return 0


def overlap_bench(job: Job) -> int:
    ws, x = mlp_inputs(job, 2048, 8, 512)
    # Buckets of 25 MiB (PyTorch DDP's default) and of 4 MiB: every bucket
    # is an allreduce of its own, with its own per-step costs.
    fns = {
        "pmean at end": mlp_step(job, False),
        "overlap 25 MiB": mlp_step(job, True, bucket_mb=25.0),
        "overlap 4 MiB": mlp_step(job, True, bucket_mb=4.0),
    }
    med = median_seconds(job, fns, (ws, x), rounds=5, iters=5)
    if job.pid == 0:
        print(
            f"overlap on GPU, world {job.nprocs}, 8x2048^2 MLP (128 MiB of "
            f"gradients), median of 5 rounds of 5 steps: "
            + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in med.items())
            + "; overlap/plain = "
            + ", ".join(
                f"{med[k] / med['pmean at end']:.3f} ({k})" for k in med if k != "pmean at end"
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    serve({"bench": bench, "bench_sweep": bench_sweep, "overlap_bench": overlap_bench})
