"""Flat ring vs tiered plan on two "hosts" of two processes each.

Usage (as root):
    python benchmarks/two_tier.py [--rate 1gbit] [--min-bytes 1M]
        [--max-bytes 256M] [--tune-max-bytes 64M] [--no-tune]
        [--plot two_tier.png] [--json two_tier.json]

Builds a network of namespaces with benchmarks/netns.py: one namespace per
host, each on a tbf-limited link to a bridge, and runs two processes (one
CPU device each) in each namespace. The processes of a host share its
address, so their traffic goes over the namespace's loopback, unthrottled,
and jaxring's topology discovery finds the tiers (2 processes per host, 2
hosts) by itself. Every process times `jaxring.allreduce` with
topology="flat" and with the default ("auto", which here is the tiered
plan (2, 2)) on the same arrays, in alternating rounds, after checking
that both give the same sums (integer-valued floats, so exactly equal).

Before that, in the same network, the autotuner runs across the four
processes (`python -m jaxring.launch -n 4 -m jaxring.tune --quick`): it
measures its candidates (1 or 2 rings x 256 KiB or 1 MiB chunks, each flat
and tiered) up to --tune-max-bytes and prints, per size, the model's choice
next to the measured best. The benchmark then times a third variant,
"tuned": jaxring.allreduce with nothing set, taking rings, chunk size and
plan from that table, and reports it against the better of the two fixed
choices (flat and tiered at the default rings and chunk size).

busbw = bytes * 2(n-1)/n / time for all, so their ratio is the time ratio.
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
import netns
from tcp_allreduce import alternating_rounds, fmt_bytes, parse_bytes

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

    # The fixed choices pass jaxring's default rings and chunk size, so a
    # tuning table cannot change them; "tuned" passes nothing.
    fixed = {"rings": jaxring.config.rings, "chunk_bytes": jaxring.config.chunk_bytes}
    variants = {"flat": dict(fixed, topology="flat"), "tiered": dict(fixed, topology="auto")}
    if args.tuning:
        variants["tuned"] = {}

    def compiled(x, kwargs, tuning):
        # The table is read when the step is traced, so compile here, with
        # the setting this variant needs. Every process lowers in the same
        # order: lowering assigns the op ids, which must agree.
        jaxring.config.update("tuning", tuning)
        try:
            f = jax.jit(
                jax.shard_map(
                    lambda v: jaxring.allreduce(v, "i", **kwargs),
                    mesh=mesh,
                    in_specs=P("i"),
                    out_specs=P("i"),
                    check_vma=False,
                )
            )
            lowered = f.lower(x)
            return lowered.compile(), lowered.as_text()
        finally:
            jaxring.config.reset("tuning")

    rows = []
    size = args.min_bytes
    while size <= args.max_bytes:
        count = size // 4
        local = np.full((1, count), jax.process_index() + 1, np.float32)
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("i")), local, (n, count))
        fns, lowered_as = {}, {}
        for k, kwargs in variants.items():
            fns[k], text = compiled(x, kwargs, args.tuning if k == "tuned" else "off")
            tiers = text.split("topology = ", 1)[1].split(">", 1)[0] + ">"
            rings = text.split("num_rings = ", 1)[1].split(" ", 1)[0]
            chunk = text.split("chunk_bytes = ", 1)[1].split(" ", 1)[0]
            plan = "flat" if tiers == "dense<>" else "tiered"
            lowered_as[k] = f"{plan} r={rings} c={fmt_bytes(int(chunk))}"
        if jax.process_index() == 0:
            print(
                f"{fmt_bytes(size)}: " + "; ".join(f"{k} runs {v}" for k, v in lowered_as.items()),
                flush=True,
            )
        outs = {k: np.asarray(f(x).addressable_data(0)) for k, f in fns.items()}
        want = n * (n + 1) / 2
        for k, got in outs.items():
            if not np.all(got == want):
                raise SystemExit(f"{k} gives a wrong sum at {size} bytes")
        samples = alternating_rounds(fns, x, iterations(size), args.rounds)
        factor = 2 * (n - 1) / n
        row = {"bytes": size, "processes": n, "lowered": lowered_as}
        for k in fns:
            t = statistics.median(samples[k])
            row[f"{k}_s"] = t
            row[f"{k}_busbw"] = size * factor / t / 1e9
            row[f"{k}_rounds_s"] = samples[k]
        rows.append(row)
        if jax.process_index() == 0:
            print(
                f"measured {fmt_bytes(size)}: "
                + ", ".join(f"{k} {row[f'{k}_busbw']:.3f} GB/s" for k in fns),
                flush=True,
            )
        del x
        size *= 4
    if jax.process_index() == 0:
        with open(args.worker_json, "w") as f:
            json.dump(rows, f)


def table(rows: list[dict], rate: str, measured: float) -> str:
    tuned = "tuned_s" in rows[0]
    head = (
        f"{'bytes':>10} | {'flat ms':>9} {'busbw GB/s':>10} | "
        f"{'tiered ms':>9} {'busbw GB/s':>10} | {'tiered/flat':>11}"
    )
    if tuned:
        head += f" | {'tuned ms':>9} {'busbw GB/s':>10} | {'tuned/best fixed':>16}"
    lines = [
        f"# {HOSTS} hosts x {PER_HOST} processes, 1 CPU device each, "
        f"float32; host links tbf {rate} (one TCP stream: "
        f"{measured / 1e9:.3f} GB/s); median of alternating rounds",
        head,
        "-" * len(head),
    ]
    for r in rows:
        line = (
            f"{fmt_bytes(r['bytes']):>10} | {r['flat_s'] * 1e3:>9.1f} "
            f"{r['flat_busbw']:>10.3f} | {r['tiered_s'] * 1e3:>9.1f} "
            f"{r['tiered_busbw']:>10.3f} | {r['tiered_busbw'] / r['flat_busbw']:>10.2f}x"
        )
        if tuned:
            # busbw ratio: above 1 the table's choice beat both fixed ones.
            best = max(r["flat_busbw"], r["tiered_busbw"])
            line += (
                f" | {r['tuned_s'] * 1e3:>9.1f} {r['tuned_busbw']:>10.3f} | "
                f"{r['tuned_busbw'] / best:>15.2f}x"
            )
        lines.append(line)
    if tuned:
        lines.append(
            "# tuned runs, per size: "
            + "; ".join(f"{fmt_bytes(r['bytes'])} {r['lowered']['tuned']}" for r in rows)
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        print(f"matplotlib is not installed: no plot written to {path}")
        return
    from jaxring.bench import plot_busbw

    sizes = [r["bytes"] for r in rows]
    series = [
        ("flat ring", sizes, [r["flat_busbw"] for r in rows]),
        ("tiered plan (2, 2)", sizes, [r["tiered_busbw"] for r in rows]),
    ]
    if "tuned_busbw" in rows[0]:
        series.append(("autotuned", sizes, [r["tuned_busbw"] for r in rows]))
    plot_busbw(series, path, title, xlabel="bytes per process")
    print(f"plot written to {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit", help="tbf rate of each host's link")
    ap.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("1M"))
    ap.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("256M"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--tune-max-bytes",
        type=parse_bytes,
        default=parse_bytes("64M"),
        help="largest size the autotuner measures (larger messages take its choice for this size)",
    )
    ap.add_argument(
        "--no-tune", action="store_true", help="skip the autotuner and the tuned variant"
    )
    ap.add_argument("--tuning", default=None, help=argparse.SUPPRESS)
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
        # The processes of a host share memory, those of different hosts
        # only the tbf-limited links.
        prefix = (
            "sh -c "
            + shlex.quote(f'exec ip netns exec {node} env JAXRING_HOST_ID={node} "$@"')
            + " _"
        )
        launch = [
            sys.executable,
            "-m",
            "jaxring.launch",
            "-n",
            str(HOSTS * PER_HOST),
            "--devices-per-process",
            "1",
            "--coordinator",
            f"{net.address(0)}:29500",
            "--prefix-command",
            prefix,
        ]
        os.chmod(tmp, 0o755)
        tuning = []
        if not args.no_tune:
            path = os.path.join(tmp, "tuning.json")
            print("autotuner, across the four processes:", flush=True)
            r = subprocess.run(
                [
                    *launch,
                    "-m",
                    "jaxring.tune",
                    "--quick",
                    "--min-bytes",
                    str(args.min_bytes),
                    "--max-bytes",
                    str(min(args.max_bytes, args.tune_max_bytes)),
                    "--out",
                    path,
                ],
                cwd=tmp,
            )
            if r.returncode != 0:
                print(f"the autotuner failed with status {r.returncode}")
                return r.returncode
            tuning = ["--tuning", path]
        cmd = [
            *launch,
            os.path.abspath(__file__),
            "--min-bytes",
            str(args.min_bytes),
            "--max-bytes",
            str(args.max_bytes),
            "--rounds",
            str(args.rounds),
            "--worker-json",
            out,
            *tuning,
        ]
        r = subprocess.run(cmd, cwd=tmp)
        if r.returncode != 0:
            print(f"the job failed with status {r.returncode}")
            return r.returncode
        with open(out) as f:
            rows = json.load(f)
    print(table(rows, args.rate, measured))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"rate": args.rate, "measured_bytes_per_s": measured, "rows": rows}, f, indent=1
            )
    if args.plot:
        plot(
            rows,
            args.plot,
            f"flat ring vs tiered plan, {HOSTS} hosts x "
            f"{PER_HOST} processes, host links {args.rate}",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
