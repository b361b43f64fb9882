"""Allreduce across processes: jaxring's TCP transport vs JAX's Gloo.

Usage:
    python benchmarks/tcp_allreduce.py [--processes 2 4] [--min-bytes 4K]
        [--max-bytes 256M] [--plot tcp_allreduce.png] [--json results.json]

For each process count the script starts a job with `python -m
jaxring.launch` (one CPU device per process) in which every process times
`jaxring.allreduce` and `lax.psum` (JAX's cross-process CPU collectives,
`jax_cpu_collectives_implementation="gloo"`) on the same arrays, in
alternating rounds, and checks that they agree before timing. Process 0
reports the median time per call; this script prints an nccl-tests-style
table per process count and, with matplotlib installed, plots busbw against
size.

busbw = bytes * 2(n-1)/n / time: the rate each link must sustain for a ring
allreduce to take that long, comparable with the link's own rate.

With --netns-rate (as root), each job runs on a network of namespaces built
by benchmarks/netns.py instead of loopback: one namespace and address per
process, every link limited to that rate with tbf. The link's measured TCP
rate is printed with the tables, to compare busbw against.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netns  # noqa: E402  (benchmarks/netns.py)

SIZES_DEFAULT = ("4K", "256M")


def parse_bytes(s: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    num, unit = (s[:-1], s[-1]) if s and s[-1] in units else (s, "")
    return int(num) * units[unit]


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def iterations(nbytes: int) -> int:
    # The same on every process (the calls are collectives): about 256 MiB
    # per timing, between 5 and 200 calls.
    return max(5, min(200, (256 << 20) // max(nbytes, 1)))


def alternating_rounds(fns: dict, x, iters: int, rounds: int) -> dict:
    """Seconds per call of each function in each round. The functions take
    turns within a round, so a drift of the machine hits them alike."""
    samples = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                f(x).block_until_ready()
            samples[k].append((time.perf_counter() - t0) / iters)
    return samples


def worker(args) -> None:
    """One process of the job: time both implementations at every size."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jaxring

    devices = np.array(jax.devices())
    n = devices.size
    mesh = Mesh(devices, ("i",))

    def program(reduce):
        return jax.jit(jax.shard_map(lambda v: reduce(v, "i"), mesh=mesh,
                                     in_specs=P("i"), out_specs=P("i"),
                                     check_vma=False))

    fns = {"jaxring": program(jaxring.allreduce), "gloo": program(jax.lax.psum)}
    rows = []
    size = args.min_bytes
    while size <= args.max_bytes:
        count = size // 4
        local = np.full((1, count), jax.process_index() + 1, np.float32)
        x = jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("i")), local, (n, count))
        outs = {k: np.asarray(f(x).addressable_data(0)) for k, f in fns.items()}
        if not np.array_equal(outs["jaxring"], outs["gloo"]):
            raise SystemExit(f"jaxring and Gloo disagree at {size} bytes")
        samples = alternating_rounds(fns, x, iterations(size), args.rounds)
        factor = 2 * (n - 1) / n
        row = {"bytes": size, "processes": n}
        for k in fns:
            t = statistics.median(samples[k])
            row[f"{k}_s"] = t
            row[f"{k}_busbw"] = size * factor / t / 1e9
        rows.append(row)
        if jax.process_index() == 0:
            print(f"measured {fmt_bytes(size)}: jaxring {row['jaxring_busbw']:.3f} "
                  f"GB/s, gloo {row['gloo_busbw']:.3f} GB/s", flush=True)
        del x
        size *= 4
    if jax.process_index() == 0:
        with open(args.worker_json, "w") as f:
            json.dump(rows, f)


def table(rows: list[dict]) -> str:
    n = rows[0]["processes"]
    head = (f"{'bytes':>10} | {'jaxring us':>11} {'busbw GB/s':>10} | "
            f"{'gloo us':>11} {'busbw GB/s':>10} | {'jaxring/gloo':>12}")
    lines = [f"# {n} processes, 1 CPU device each, float32, "
             f"median of alternating rounds", head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{fmt_bytes(r['bytes']):>10} | {r['jaxring_s'] * 1e6:>11.1f} "
            f"{r['jaxring_busbw']:>10.3f} | {r['gloo_s'] * 1e6:>11.1f} "
            f"{r['gloo_busbw']:>10.3f} | {r['jaxring_busbw'] / r['gloo_busbw']:>11.2f}x")
    return "\n".join(lines)


def plot(results: dict[int, list[dict]], path: str, title: str) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        print(f"matplotlib is not installed: no plot written to {path} "
              "(pip install 'jaxring[bench]')")
        return
    from jaxring.bench import plot_busbw
    lines = []
    for n, rows in sorted(results.items()):
        sizes = [r["bytes"] for r in rows]
        lines.append((f"jaxring, {n} processes", sizes, [r["jaxring_busbw"] for r in rows]))
        lines.append((f"Gloo (lax.psum), {n} processes", sizes,
                      [r["gloo_busbw"] for r in rows]))
    plot_busbw(lines, path, title, xlabel="bytes per process")
    print(f"plot written to {path}")


@contextlib.contextmanager
def network(rate: str | None, nodes: int):
    """A namespace network from benchmarks/netns.py, or None for loopback."""
    if rate is None:
        yield None
        return
    with netns.Network(nodes, rate) as net:
        yield net


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes(SIZES_DEFAULT[0]))
    ap.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes(SIZES_DEFAULT[1]))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--plot", default="tcp_allreduce.png", help="PNG path ('' for none)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--title", default="allreduce over loopback TCP")
    ap.add_argument("--netns-rate", default=None,
                    help="run over namespaces linked at this tbf rate (e.g. 1gbit)")
    ap.add_argument("--worker-json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker_json:
        worker(args)
        return 0
    results = {}
    for n in args.processes:
        with tempfile.TemporaryDirectory() as tmp, network(args.netns_rate, n) as net:
            out = os.path.join(tmp, "rows.json")
            cmd = [sys.executable, "-m", "jaxring.launch", "-n", str(n),
                   "--devices-per-process", "1"]
            if net is not None:
                cmd += ["--coordinator", f"{net.address(0)}:29500",
                        "--prefix-command", net.exec_prefix()]
                rate = netns.check_rate(net)
                print(f"# network: {n} namespaces, tbf {args.netns_rate} per link; "
                      f"one TCP stream measures {rate / 1e9:.3f} GB/s")
            cmd += [os.path.abspath(__file__),
                    "--min-bytes", str(args.min_bytes), "--max-bytes", str(args.max_bytes),
                    "--rounds", str(args.rounds), "--worker-json", out]
            os.chmod(tmp, 0o755)
            r = subprocess.run(cmd, cwd=tmp)
            if r.returncode != 0:
                print(f"the {n}-process job failed with status {r.returncode}")
                return r.returncode
            with open(out) as f:
                results[n] = json.load(f)
        print(table(results[n]))
        print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        plot(results, args.plot, args.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
