"""Allreduce across processes: jaxring over shared memory and over TCP vs
JAX's Gloo, beside the in-process bound.

Usage:
    python benchmarks/tcp_allreduce.py [--processes 2 4] [--min-bytes 4K]
        [--max-bytes 256M] [--transports auto tcp] [--no-direct] [--exchange]
        [--devices-per-process 1] [--cpu-bind none|cores] [--keep-freed-memory]
        [--plot tcp_allreduce.png] [--json results.json]

For each process count the script starts one job per transport with
`python -m jaxring.launch` (one CPU device per process, or
--devices-per-process):
JAXRING_TRANSPORT=auto (processes on this host exchange through
shared-memory rings) and JAXRING_TRANSPORT=tcp (TCP loopback). In each,
every process times `jaxring.allreduce` and `lax.psum` (JAX's cross-process
CPU collectives, `jax_cpu_collectives_implementation="gloo"`) on the same
arrays, in alternating rounds, and checks that they agree before timing;
Gloo, timed in both jobs, is the reference that ties them together. The
auto job also times `algorithm="direct"` over the host segment ("shm
direct", where the job has one: every process on this host), and the
tables give it against the ring over shared memory (xdir/ring), Gloo and
the in-process direct job (xdir/direct). A last
job runs the same sizes in one process with as many virtual devices,
`algorithm="direct"`: each byte is read and written once, in memory, which
no link between processes can beat (the physical bound). Process 0 reports
the median time per call; this script prints an nccl-tests-style table per
process count with the ratios and, with matplotlib installed, plots busbw
against size.

busbw = bytes * 2(n-1)/n / time: the rate each link must sustain for a ring
allreduce to take that long, comparable with the link's own rate.

jaxring runs with its defaults (across processes, algorithm "auto": on one
host over the host segment, direct at every size; the ring otherwise, or
the exchange up to JAXRING_EXCHANGE_MAX_BYTES where set). The auto job
also times `algorithm="ring"` ("shm ring": with several devices per
process, the tiered ring plan, devices of a process first). With
--exchange, the jobs across processes also time `algorithm="ring"` and
`algorithm="exchange"` (recursive doubling: fewer steps, each of the whole
buffer) in the same rounds, and the tables give one against the other on
each transport (busbw is then the same bytes over each one's time, so the
ratio is one of times).

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
import netns

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
    """One process of the job: time both implementations at every size.
    In the direct job (one process), "gloo" is XLA's in-process psum."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jaxring

    devices = np.array(jax.devices())
    n = devices.size
    mesh = Mesh(devices, ("i",))

    def program(reduce):
        return jax.jit(
            jax.shard_map(
                lambda v: reduce(v, "i"),
                mesh=mesh,
                in_specs=P("i"),
                out_specs=P("i"),
                check_vma=False,
            )
        )

    if args.worker_direct:
        fns = {
            "jaxring": program(lambda v, a: jaxring.allreduce(v, a, algorithm="direct")),
            "gloo": program(jax.lax.psum),
        }
    else:
        fns = {"jaxring": program(jaxring.allreduce), "gloo": program(jax.lax.psum)}
        names = ("ring", "exchange") if args.exchange else ()
        if os.environ.get("JAXRING_TRANSPORT") == "auto":
            # The direct algorithm over the host segment, where the job has
            # one (every process on this host, /dev/shm large enough), and
            # the ring over shared-memory links beside it.
            fns["host_direct"] = program(lambda v, a: jaxring.allreduce(v, a, algorithm="direct"))
            names = ("ring", "exchange") if args.exchange else ("ring",)
        for name in names:
            fns[name] = program(lambda v, a, name=name: jaxring.allreduce(v, a, algorithm=name))
    rows = []
    size = args.min_bytes
    while size <= args.max_bytes:
        count = size // 4
        local = np.stack(
            [
                np.full(count, d.process_index * len(jax.local_devices()) + k + 1, np.float32)
                for k, d in enumerate(jax.local_devices())
            ]
        )
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("i")), local, (n, count))
        if size == args.min_bytes and "host_direct" in fns:
            try:
                fns["host_direct"](x)
            except ValueError as e:  # no host segment: say why, time the rest
                if jax.process_index() == 0:
                    print(f"no direct column: {e}", flush=True)
                del fns["host_direct"]
        outs = {k: np.asarray(f(x).addressable_data(0)) for k, f in fns.items()}
        if not all(np.array_equal(outs[k], outs["gloo"]) for k in outs):
            raise SystemExit(f"jaxring and the reference disagree at {size} bytes")
        samples = alternating_rounds(fns, x, iterations(size), args.rounds)
        factor = 2 * (n - 1) / n
        row = {"bytes": size, "ranks": n, "processes": jax.process_count()}
        for k in fns:
            t = statistics.median(samples[k])
            row[f"{k}_s"] = t
            row[f"{k}_busbw"] = size * factor / t / 1e9
        rows.append(row)
        if jax.process_index() == 0:
            print(
                f"measured {fmt_bytes(size)}: jaxring {row['jaxring_busbw']:.3f} "
                f"GB/s, gloo {row['gloo_busbw']:.3f} GB/s",
                flush=True,
            )
        del x
        size *= 4
    if jax.process_index() == 0:
        with open(args.worker_json, "w") as f:
            json.dump(rows, f)


# Columns: (title, job, key) where job is a JAXRING_TRANSPORT value or
# "direct" (the one-process job).
COLUMNS = (
    ("shm", "auto", "jaxring"),
    ("tcp", "tcp", "jaxring"),
    ("gloo", "auto", "gloo"),
    ("gloo (tcp job)", "tcp", "gloo"),
    ("direct", "direct", "jaxring"),
    ("shm direct", "auto", "host_direct"),
    ("shm ring", "auto", "ring"),
    ("shm exchange", "auto", "exchange"),
    ("tcp ring", "tcp", "ring"),
    ("tcp exchange", "tcp", "exchange"),
)


def table(jobs: dict[str, list[dict]], n: int, launcher: str = "", devices: int = 1) -> str:
    """busbw (GB/s) of every job beside each other, and the ratios the
    benchmark's goals are stated in: each against a reference timed in the
    same job where there is one (shm/gloo in the auto job, tcp/gloo in the
    tcp job), across jobs run back to back otherwise."""
    cols = [(t, j, k) for t, j, k in COLUMNS if j in jobs and f"{k}_busbw" in jobs[j][0]]
    sizes = [r["bytes"] for r in next(iter(jobs.values()))]
    busbw = {(j, k): {r["bytes"]: r[f"{k}_busbw"] for r in jobs[j]} for _, j, k in cols}
    ratios = []
    if "auto" in jobs:
        ratios.append(("shm/gloo", ("auto", "jaxring"), ("auto", "gloo")))
    if "tcp" in jobs:
        ratios.append(("tcp/gloo", ("tcp", "jaxring"), ("tcp", "gloo")))
    if "auto" in jobs and "tcp" in jobs:
        ratios.append(("shm/tcp", ("auto", "jaxring"), ("tcp", "jaxring")))
    if "auto" in jobs and "direct" in jobs:
        ratios.append(("shm/direct", ("auto", "jaxring"), ("direct", "jaxring")))
    if ("shm direct", "auto", "host_direct") in cols:
        ratios.append(("xdir/ring", ("auto", "host_direct"), ("auto", "ring")))
        ratios.append(("xdir/gloo", ("auto", "host_direct"), ("auto", "gloo")))
        if "direct" in jobs:
            ratios.append(("xdir/direct", ("auto", "host_direct"), ("direct", "jaxring")))
    for title, job in (("shm", "auto"), ("tcp", "tcp")):
        if (title + " exchange", job, "exchange") in cols:
            ratios.append((f"{title} exch/ring", (job, "exchange"), (job, "ring")))
    head = (
        f"{'bytes':>10} | "
        + " ".join(f"{t:>14}" for t, _, _ in cols)
        + " | "
        + " ".join(f"{t:>10}" for t, _, _ in ratios)
    )
    each = "1 CPU device" if devices == 1 else f"{devices} CPU devices"
    lines = [
        f"# {n} processes, {each} each, float32, busbw GB/s, "
        f"median of alternating rounds (direct: 1 process, {n * devices} devices)"
        + (f"; jaxring.launch {launcher}" if launcher else ""),
        head,
        "-" * len(head),
    ]
    for size in sizes:
        lines.append(
            f"{fmt_bytes(size):>10} | "
            + " ".join(f"{busbw[(j, k)][size]:>14.3f}" for _, j, k in cols)
            + " | "
            + " ".join(f"{busbw[a][size] / busbw[b][size]:>9.2f}x" for _, a, b in ratios)
        )
    return "\n".join(lines)


def plot(results: dict[int, list[dict]], path: str, title: str) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        print(
            f"matplotlib is not installed: no plot written to {path} (pip install 'jaxring[bench]')"
        )
        return
    from jaxring.bench import plot_busbw

    lines = []
    names = {"auto": "jaxring, shared memory", "tcp": "jaxring, TCP", "direct": "in-process direct"}
    for n, jobs in sorted(results.items()):
        for job, rows in jobs.items():
            sizes = [r["bytes"] for r in rows]
            where = "as many devices in one process" if job == "direct" else f"{n} processes"
            lines.append((f"{names[job]}, {where}", sizes, [r["jaxring_busbw"] for r in rows]))
        rows = jobs.get("auto") or jobs.get("tcp")
        if rows:
            lines.append(
                (
                    f"Gloo (lax.psum), {n} processes",
                    [r["bytes"] for r in rows],
                    [r["gloo_busbw"] for r in rows],
                )
            )
    plot_busbw(lines, path, title, xlabel="bytes per rank")
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
    ap.add_argument(
        "--netns-rate",
        default=None,
        help="run over namespaces linked at this tbf rate (e.g. 1gbit)",
    )
    ap.add_argument(
        "--transports",
        nargs="+",
        default=["auto", "tcp"],
        choices=["auto", "tcp"],
        help="JAXRING_TRANSPORT of each job across processes",
    )
    ap.add_argument(
        "--devices-per-process",
        type=int,
        default=1,
        help="CPU devices in each process of the jobs across processes "
        '(with more than one, "shm ring" is the tiered ring plan)',
    )
    ap.add_argument(
        "--cpu-bind",
        choices=["none", "cores"],
        default="none",
        help="jaxring.launch --cpu-bind for the jobs across processes",
    )
    ap.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="jaxring.launch --keep-freed-memory for every job "
        "(glibc keeps freed buffers: no fresh pages per call)",
    )
    ap.add_argument(
        "--no-direct", action="store_true", help="skip the one-process job (the in-process bound)"
    )
    ap.add_argument(
        "--exchange",
        action="store_true",
        help='also time algorithm="ring" and "exchange" in the jobs across processes',
    )
    ap.add_argument("--worker-json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-direct", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker_json:
        worker(args)
        return 0
    results = {}
    for n in args.processes:
        jobs = list(args.transports)
        if not args.no_direct and args.netns_rate is None:
            jobs.append("direct")
        results[n] = {}
        for job in jobs:
            rows = run_job(args, n, job)
            if rows is None:
                return 1
            results[n][job] = rows
        print(table(results[n], n, launcher_settings(args), args.devices_per_process))
        print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        plot(results, args.plot, args.title)
    return 0


def launcher_settings(args) -> str:
    """The launcher options other than the defaults, for the tables."""
    words = [] if args.cpu_bind == "none" else [f"--cpu-bind {args.cpu_bind}"]
    if args.keep_freed_memory:
        words.append("--keep-freed-memory")
    return " ".join(words)


def run_job(args, n: int, job: str) -> list[dict] | None:
    """One job's rows: n processes of --devices-per-process devices under
    JAXRING_TRANSPORT=job, or one process of as many devices for "direct".
    None if it failed."""
    env = dict(os.environ)
    if job != "direct":
        env["JAXRING_TRANSPORT"] = job
    with (
        tempfile.TemporaryDirectory() as tmp,
        network(args.netns_rate if job != "direct" else None, n) as net,
    ):
        out = os.path.join(tmp, "rows.json")
        if job == "direct":
            cmd = [
                sys.executable,
                "-m",
                "jaxring.launch",
                "-n",
                "1",
                "--devices-per-process",
                str(n * args.devices_per_process),
            ]
        else:
            cmd = [
                sys.executable,
                "-m",
                "jaxring.launch",
                "-n",
                str(n),
                "--devices-per-process",
                str(args.devices_per_process),
                "--cpu-bind",
                args.cpu_bind,
            ]
        if args.keep_freed_memory:
            cmd.append("--keep-freed-memory")
        if net is not None:
            cmd += [
                "--coordinator",
                f"{net.address(0)}:29500",
                "--prefix-command",
                net.exec_prefix(),
            ]
            rate = netns.check_rate(net)
            print(
                f"# network: {n} namespaces, tbf {args.netns_rate} per link; "
                f"one TCP stream measures {rate / 1e9:.3f} GB/s"
            )
        cmd += [
            os.path.abspath(__file__),
            "--min-bytes",
            str(args.min_bytes),
            "--max-bytes",
            str(args.max_bytes),
            "--rounds",
            str(args.rounds),
            "--worker-json",
            out,
        ]
        if job == "direct":
            cmd.append("--worker-direct")
        elif args.exchange:
            cmd.append("--exchange")
        os.chmod(tmp, 0o755)
        print(f"# job: {n} processes, {job}", flush=True)
        r = subprocess.run(cmd, cwd=tmp, env=env)
        if r.returncode != 0:
            print(f"the {n}-process {job} job failed with status {r.returncode}")
            return None
        with open(out) as f:
            return json.load(f)


if __name__ == "__main__":
    sys.exit(main())
