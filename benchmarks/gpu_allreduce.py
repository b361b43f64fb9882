"""GPU benchmarks of the CUDA backend, on a machine with one GPU.

    python benchmarks/gpu_allreduce.py [--parts kernel busbw overlap]
                                       [--worlds 2 4] [--kernel-bytes N]

Prints, from one run:

1. The reduce kernel's bandwidth against a device-to-device copy of the
   same size, both timed with CUDA events in this run. The kernel reads two
   buffers and writes one (3 n bytes), the copy reads one and writes one
   (2 n bytes); the ratio compares bytes moved per second (goal >= 0.85).
2. busbw of jaxring's ring and of NCCL's allreduce on the same
   communicators, for worlds of several processes sharing the GPU, 1 MiB to
   256 MiB (goal: ring >= 0.9x NCCL from 16 MiB). On one GPU every rank
   shares its memory bandwidth, so these figures compare the two
   schedules on the same transport, not a network.
3. An MLP train step (8 layers of 2048 x 2048, 128 MiB of gradients) with
   jaxring.overlap (buckets of 25 and of 4 MiB) and with jaxring.pmean at
   the end, world 2 sharing the GPU, in alternating rounds.
4. (--parts sweep) busbw of the ring by rings (1, 2, 4) and chunk size
   (1, 4, 16 MiB) against NCCL's, world 2, 16 to 256 MiB.

With NCCL older than 2.30 the ranks sharing the GPU talk over loopback
sockets (tests/gpu/gpu_job.py, gpu_env), so busbw there measures NCCL's
socket transport, not NVLink. Each job runs benchmarks/gpu_bench_worker.py.
"""

import argparse
import sys

import gpu_bench_worker  # beside this script, on sys.path when run as one


def kernel_bandwidth(nbytes: int, iters: int) -> None:
    from jaxring import _jaxring, _jaxring_cuda

    print(
        f"reduce kernel vs device-to-device copy, {nbytes / 2**20:.0f} MiB, mean of {iters} calls"
    )
    print(f"{'dtype':>10} {'reduce GB/s':>12} {'copy GB/s':>10} {'ratio':>7}")
    for name in ("float32", "bfloat16", "float16", "float64", "int32", "int8"):
        reduce_s, copy_s = _jaxring_cuda.time_reduce_and_copy(
            _jaxring.ELEM_TYPES[name], nbytes, iters
        )
        reduce_bw, copy_bw = 3 * nbytes / reduce_s / 1e9, 2 * nbytes / copy_s / 1e9
        print(f"{name:>10} {reduce_bw:>12.0f} {copy_bw:>10.0f} {reduce_bw / copy_bw:>7.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["kernel", "busbw", "overlap"],
        choices=["kernel", "busbw", "overlap", "sweep"],
        help="which benchmarks to run (default kernel, busbw and "
        "overlap; sweep: busbw by rings and chunk size, world 2)",
    )
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--kernel-bytes", type=int, default=1 << 30)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    rc = 0
    if "kernel" in args.parts:
        kernel_bandwidth(args.kernel_bytes, args.iters)
    for world in args.worlds if "busbw" in args.parts else ():
        results = gpu_bench_worker.launch(world, "bench", timeout=300)
        print(results[0][1])
        if any(code != 0 for code, _ in results):
            rc = 1
            for _code, out in results[1:]:
                print(out[-2000:])
    if "sweep" in args.parts:
        results = gpu_bench_worker.launch(2, "bench_sweep", timeout=300)
        print(results[0][1])
        if any(code != 0 for code, _ in results):
            rc = 1
    if "overlap" in args.parts:
        results = gpu_bench_worker.launch(2, "overlap_bench", timeout=300)
        print(results[0][1])
        if any(code != 0 for code, _ in results):
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
