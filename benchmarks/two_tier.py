"""Flat ring vs tiered plan on two "hosts" of two processes each.

Usage (as root):
    python benchmarks/two_tier.py [--rate 1gbit] [--min-bytes 1M]
        [--max-bytes 256M] [--plot two_tier.png] [--json two_tier.json]

Builds a network of namespaces with benchmarks/netns.py: one namespace per
host, each on a tbf-limited link to a bridge, and runs two processes (one
CPU device each) in each namespace. The processes of a host share its
address, so their traffic goes over the namespace's loopback, unthrottled,
and jaxring's topology discovery finds the tiers (2 processes per host, 2
hosts) by itself. Every process times `jaxring.allreduce` with
topology="flat" and with the default ("auto", which here is the tiered
plan (2, 2)) on the same arrays, in alternating rounds, after checking
that both give the same sums (integer-valued floats, so exactly equal).

busbw = bytes * 2(n-1)/n / time for both, so their ratio is the time ratio.
What each host's link must carry, per allreduce of n bytes per process:
the flat ring over ranks 0..3 crosses between the hosts at two of its four
hops, 1.5 n each way through each host's link; the tiered plan
reduce-scatters inside the host first and sends only the half-shards
across, n per host. So where the host link is the bottleneck the tiered
plan should be about 1.5x faster; the per-rank formula 2(d-1)/d * n/d0
(0.5 n against a flat ring's 1.5 n) gives 3x only when every hop of the
flat ring crosses the slow link.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netns  # noqa: E402  (benchmarks/netns.py)
from tcp_allreduce import alternating_rounds, fmt_bytes, parse_bytes  # noqa: E402

HOSTS, PER_HOST = 2, 2


def iterations(nbytes: int) -> int:
    # The same on every process (the calls are collectives): about 64 MiB
    # per timing, between 2 and 50 calls.
    return max(2, min(50, (64 << 20) // max(nbytes, 1)))


def worker(args) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jaxring

    devices = np.array(jax.devices())
    n = devices.size
    mesh = Mesh(devices, ("i",))

    def program(topology):
        return jax.jit(jax.shard_map(
            lambda v: jaxring.allreduce(v, "i", topology=topology), mesh=mesh,
            in_specs=P("i"), out_specs=P("i"), check_vma=False))

    fns = {"flat": program("flat"), "tiered": program("auto")}
    rows = []
    size = args.min_bytes
    while size <= args.max_bytes:
        count = size // 4
        local = np.full((1, count), jax.process_index() + 1, np.float32)
        x = jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("i")), local, (n, count))
        if size == args.min_bytes:
            # Lowered on every process: lowering assigns the op ids, which
            # must agree across processes.
            text = fns["tiered"].lower(x).as_text()
            tiers = text.split("topology = ", 1)[1].split(">", 1)[0] + ">"
            if jax.process_index() == 0:
                print(f"the default lowers with topology = {tiers} "
                      "(a splat dense<2> is [2, 2])", flush=True)
        outs = {k: np.asarray(f(x).addressable_data(0)) for k, f in fns.items()}
        want = n * (n + 1) / 2
        for k, got in outs.items():
            if not np.all(got == want):
                raise SystemExit(f"{k} gives a wrong sum at {size} bytes")
        samples = alternating_rounds(fns, x, iterations(size), args.rounds)
        factor = 2 * (n - 1) / n
        row = {"bytes": size, "processes": n}
        for k in fns:
            t = statistics.median(samples[k])
            row[f"{k}_s"] = t
            row[f"{k}_busbw"] = size * factor / t / 1e9
            row[f"{k}_rounds_s"] = samples[k]
        rows.append(row)
        if jax.process_index() == 0:
            print(f"measured {fmt_bytes(size)}: flat {row['flat_busbw']:.3f} GB/s, "
                  f"tiered {row['tiered_busbw']:.3f} GB/s", flush=True)
        del x
        size *= 4
    if jax.process_index() == 0:
        with open(args.worker_json, "w") as f:
            json.dump(rows, f)


def table(rows: list[dict], rate: str, measured: float) -> str:
    head = (f"{'bytes':>10} | {'flat ms':>9} {'busbw GB/s':>10} | "
            f"{'tiered ms':>9} {'busbw GB/s':>10} | {'tiered/flat':>11}")
    lines = [f"# {HOSTS} hosts x {PER_HOST} processes, 1 CPU device each, "
             f"float32; host links tbf {rate} (one TCP stream: "
             f"{measured / 1e9:.3f} GB/s); median of alternating rounds",
             head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{fmt_bytes(r['bytes']):>10} | {r['flat_s'] * 1e3:>9.1f} "
            f"{r['flat_busbw']:>10.3f} | {r['tiered_s'] * 1e3:>9.1f} "
            f"{r['tiered_busbw']:>10.3f} | {r['tiered_busbw'] / r['flat_busbw']:>10.2f}x")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        print(f"matplotlib is not installed: no plot written to {path}")
        return
    from jaxring.bench import plot_busbw
    sizes = [r["bytes"] for r in rows]
    plot_busbw([("flat ring", sizes, [r["flat_busbw"] for r in rows]),
                ("tiered plan (2, 2)", sizes, [r["tiered_busbw"] for r in rows])],
               path, title, xlabel="bytes per process")
    print(f"plot written to {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit", help="tbf rate of each host's link")
    ap.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("1M"))
    ap.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("256M"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--plot", default="two_tier.png", help="PNG path ('' for none)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--worker-json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker_json:
        worker(args)
        return 0
    if os.geteuid() != 0:
        raise SystemExit("benchmarks/two_tier.py needs root (network namespaces)")
    with tempfile.TemporaryDirectory() as tmp, netns.Network(HOSTS, args.rate) as net:
        measured = netns.check_rate(net)
        out = os.path.join(tmp, "rows.json")
        # Process r runs in host r // PER_HOST's namespace.
        node = f"{net.tag}n$(({{rank}} / {PER_HOST}))"
        prefix = "sh -c " + shlex.quote(f'exec ip netns exec {node} "$@"') + " _"
        cmd = [sys.executable, "-m", "jaxring.launch", "-n", str(HOSTS * PER_HOST),
               "--devices-per-process", "1",
               "--coordinator", f"{net.address(0)}:29500",
               "--prefix-command", prefix, os.path.abspath(__file__),
               "--min-bytes", str(args.min_bytes), "--max-bytes", str(args.max_bytes),
               "--rounds", str(args.rounds), "--worker-json", out]
        os.chmod(tmp, 0o755)
        r = subprocess.run(cmd, cwd=tmp)
        if r.returncode != 0:
            print(f"the job failed with status {r.returncode}")
            return r.returncode
        with open(out) as f:
            rows = json.load(f)
    print(table(rows, args.rate, measured))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rate": args.rate, "measured_bytes_per_s": measured,
                       "rows": rows}, f, indent=1)
    if args.plot:
        plot(rows, args.plot, f"flat ring vs tiered plan, {HOSTS} hosts x "
             f"{PER_HOST} processes, host links {args.rate}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
