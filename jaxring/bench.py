"""Allreduce benchmark: jaxring.allreduce vs lax.psum, nccl-tests style.

Usage:
    python -m jaxring.bench [--devices 8] [--min-bytes 4K] [--max-bytes 64M]
                            [--dtype float32] [--rings R] [--chunk-bytes C]
                            [--algorithm auto|ring|direct] [--plot busbw.png]
                            [--json rows.json]

Both implementations run in the same process on the same virtual CPU
devices, one size at a time, each timed over back-to-back calls. As in a
training loop, each call's result is dropped once the next call is
dispatched, so the allocator can reuse its memory. Columns
follow nccl-tests: ``algbw = bytes / time`` and ``busbw = algbw * 2(n-1)/n``
(the bandwidth each link would need for a ring allreduce in that time).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import time


def _parse_bytes(s: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG]?)i?B?", s.strip(), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {s!r} (use e.g. 4K, 64M)")
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()]


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def _time_calls(f, x, iters: int) -> float:
    """Seconds per call: `iters` calls dispatched back to back, then waited for.

    Only the last result is kept: an earlier one is freed once its call has
    run, like a step's gradients, rather than every call faulting in fresh
    pages for an output nobody reads."""
    import jax

    t0 = time.perf_counter()
    out = None
    for _ in range(iters):
        out = f(x)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def _compare(fns, x, min_time: float, rounds: int) -> list[float]:
    """Median seconds per call of each fn, measured in alternating rounds.

    The machine's load drifts, so the implementations take turns: each round
    times every fn once, over the same number of calls, and the median over
    rounds is reported.
    """
    import statistics

    import jax

    for f in fns:
        jax.block_until_ready(f(x))  # compile and warm up
    # Calls per round: enough for min_time / rounds with the slowest fn.
    probe = max(_time_calls(f, x, 2) for f in fns)
    iters = int(min(500, max(2, min_time / rounds / max(probe, 1e-7))))
    samples = [[] for _ in fns]
    for _ in range(rounds):
        for i, f in enumerate(fns):
            samples[i].append(_time_calls(f, x, iters))
    return [statistics.median(s) for s in samples]


def run(
    devices: int,
    min_bytes: int,
    max_bytes: int,
    dtype: str,
    rings: int | None,
    chunk_bytes: int | None,
    min_time: float,
    rounds: int = 5,
    out=sys.stdout,
    algorithm: str | None = None,
) -> list[dict]:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxring

    if len(jax.devices()) < devices:
        raise SystemExit(f"asked for {devices} devices, JAX has {len(jax.devices())}")
    mesh = jax.make_mesh((devices,), ("i",), devices=jax.devices()[:devices])
    spec = P("i")

    def program(reduce):
        return jax.jit(
            jax.shard_map(
                lambda v: reduce(v, "i"), mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False
            )
        )

    ours = program(
        lambda v, a: jaxring.allreduce(
            v, a, rings=rings, chunk_bytes=chunk_bytes, algorithm=algorithm
        )
    )
    theirs = program(jax.lax.psum)
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    factor = 2 * (devices - 1) / devices
    rows = []
    print(
        f"# median of {rounds} alternating rounds per size; speedup = psum time / jaxring time",
        file=out,
    )
    print(
        f"# jaxring.allreduce vs lax.psum on {devices} virtual CPU devices "
        f"({os.cpu_count()} cores), dtype {dtype}, rings="
        f"{rings or jaxring.config.rings}, chunk_bytes="
        f"{chunk_bytes or jaxring.config.chunk_bytes}, algorithm="
        f"{algorithm or jaxring.config.algorithm}",
        file=out,
    )
    header = (
        f"{'bytes/device':>14} {'count':>10} | {'jaxring us':>11} {'algbw GB/s':>10} "
        f"{'busbw GB/s':>10} | {'psum us':>11} {'algbw GB/s':>10} {'busbw GB/s':>10} "
        f"| {'speedup':>7}"
    )
    print(header, file=out)
    print("-" * len(header), file=out)
    size = min_bytes
    while size <= max_bytes:
        count = max(1, size // np_dtype.itemsize)
        x = jax.device_put(np.ones((devices, count), np_dtype), NamedSharding(mesh, spec))
        # Correctness first: the table means nothing if the sums differ.
        if not np.array_equal(np.asarray(ours(x)), np.asarray(theirs(x))):
            raise SystemExit(f"jaxring and psum disagree at {size} bytes")
        t_ours, t_lax = _compare([ours, theirs], x, min_time, rounds)
        nbytes = count * np_dtype.itemsize
        row = dict(
            bytes=nbytes,
            count=count,
            jaxring_s=t_ours,
            psum_s=t_lax,
            jaxring_busbw=nbytes / t_ours * factor / 1e9,
            psum_busbw=nbytes / t_lax * factor / 1e9,
            speedup=t_lax / t_ours,
        )
        rows.append(row)
        print(
            f"{_fmt_bytes(nbytes):>14} {count:>10} | {t_ours * 1e6:>11.1f} "
            f"{nbytes / t_ours / 1e9:>10.3f} {row['jaxring_busbw']:>10.3f} | "
            f"{t_lax * 1e6:>11.1f} {nbytes / t_lax / 1e9:>10.3f} "
            f"{row['psum_busbw']:>10.3f} | {row['speedup']:>6.2f}x",
            file=out,
        )
        out.flush()
        del x
        size *= 4
    return rows


def plot_busbw(
    lines: list[tuple[str, list[int], list[float]]],
    path: str,
    title: str,
    xlabel: str = "bytes per device",
) -> None:
    """A PNG of busbw against message size: one (label, sizes, busbw) line
    each, alternating solid and dashed. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, sizes, busbw) in enumerate(lines):
        ax.plot(sizes, busbw, "s--" if i % 2 else "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(rows: list[dict], path: str, title: str) -> None:
    """busbw against message size, one line per implementation."""
    sizes = [r["bytes"] for r in rows]
    plot_busbw(
        [
            ("jaxring.allreduce", sizes, [r["jaxring_busbw"] for r in rows]),
            ("lax.psum", sizes, [r["psum_busbw"] for r in rows]),
        ],
        path,
        title,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=8, help="virtual CPU devices")
    ap.add_argument("--min-bytes", type=_parse_bytes, default=4 << 10)
    ap.add_argument("--max-bytes", type=_parse_bytes, default=64 << 20)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rings", type=int, default=None)
    ap.add_argument("--chunk-bytes", type=_parse_bytes, default=None)
    ap.add_argument(
        "--algorithm",
        choices=["auto", "ring", "direct"],
        default=None,
        help="jaxring's algorithm (default: jaxring.config.algorithm, "
        "auto = direct between the devices of one process)",
    )
    ap.add_argument(
        "--min-time",
        type=float,
        default=0.5,
        help="seconds of calls timed per size and implementation",
    )
    ap.add_argument(
        "--rounds", type=int, default=5, help="alternating timing rounds per size (median reported)"
    )
    ap.add_argument(
        "--plot",
        metavar="PATH",
        default=None,
        help="also write busbw against size as a PNG (needs matplotlib)",
    )
    ap.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="also write the rows (times in seconds, busbw in GB/s) to PATH as JSON",
    )
    args = ap.parse_args(argv)
    # Fail before the long run, not after it.
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib (or jaxring[bench])")
    # The device count must be fixed before JAX starts its CPU backend.
    from jaxring._src import runtime

    runtime.use_cpu_devices(args.devices)
    rows = run(
        args.devices,
        args.min_bytes,
        args.max_bytes,
        args.dtype,
        args.rings,
        args.chunk_bytes,
        args.min_time,
        args.rounds,
        algorithm=args.algorithm,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(
            rows,
            args.plot,
            f"allreduce on {args.devices} virtual CPU devices "
            f"({os.cpu_count()} cores), {args.dtype}",
        )
        print(f"# plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
