"""jaxring between processes of one host against mpi4jax on Open MPI, timed
in the same processes.

Usage:
    python benchmarks/mpi4jax_compare.py [--processes 2 4] [--min-bytes 64K]
        [--max-bytes 256M] [--mpi-btl vader] [--json results.json]

For each process count the script starts one job with `mpirun -n N` (one
CPU device per process). Each process joins jax.distributed (process 0's
coordinator address travels over MPI) and times, in alternating rounds on
the same values, `jaxring.allreduce` over a mesh of the N processes (with
JAXRING_TRANSPORT as set: `auto`, the default, exchanges through shared
memory; JAXRING_ALGORITHM=direct runs the direct algorithm over the host
segment) and `mpi4jax.allreduce` on Open MPI with the byte transfer layer
`--mpi-btl` (`vader`, Open MPI 4's shared memory; `sm` on Open MPI 5;
`tcp` for loopback). Both results are checked against the exact sum before
timing. Process 0 prints busbw for both and jaxring/mpi4jax per size.

Needs Open MPI and mpi4jax (`apt-get install openmpi-bin libopenmpi-dev`,
`pip install mpi4py mpi4jax`); without them the script says what is
missing and exits with status 0, timing nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tcp_allreduce import alternating_rounds, fmt_bytes, iterations, parse_bytes


def missing() -> str | None:
    """What this machine lacks to run the comparison, or None."""
    if shutil.which("mpirun") is None:
        return "mpirun (apt-get install openmpi-bin libopenmpi-dev)"
    for module in ("mpi4py", "mpi4jax"):
        if importlib.util.find_spec(module) is None:
            return f"the Python package {module} (pip install mpi4py mpi4jax)"
    return None


def worker(args) -> None:
    """One process of the MPI job."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    port = None
    if rank == 0:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)

    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=size, process_id=rank)
    import jax.numpy as jnp
    import mpi4jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jaxring

    mesh = Mesh(np.array(jax.devices()), ("i",))
    ring = jax.jit(
        jax.shard_map(
            lambda v: jaxring.allreduce(v, "i"),
            mesh=mesh,
            in_specs=P("i"),
            out_specs=P("i"),
            check_vma=False,
        )
    )

    def mpi_sum(v):
        out = mpi4jax.allreduce(v, op=MPI.SUM, comm=comm)
        return out[0] if isinstance(out, tuple) else out  # older: (value, token)

    mpi = jax.jit(mpi_sum)
    rows = []
    nbytes = args.min_bytes
    while nbytes <= args.max_bytes:
        count = nbytes // 4
        local = np.full((1, count), rank + 1, np.float32)
        sharded = jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("i")), local, (size, count)
        )
        plain = jnp.asarray(local[0])
        want = np.full(count, size * (size + 1) // 2, np.float32)
        got_ring = np.asarray(ring(sharded).addressable_data(0))[0]
        got_mpi = np.asarray(mpi(plain))
        if not (np.array_equal(got_ring, want) and np.array_equal(got_mpi, want)):
            raise SystemExit(f"a result is not the exact sum at {nbytes} bytes")
        # The two take turns within a round (they take different inputs:
        # a global array for jaxring, the local one for mpi4jax), each
        # started from a barrier.
        times = {"jaxring": [], "mpi4jax": []}
        iters = iterations(nbytes)
        for _ in range(args.rounds):
            for name, fn, x in (("jaxring", ring, sharded), ("mpi4jax", mpi, plain)):
                comm.Barrier()
                times[name].append(alternating_rounds({name: fn}, x, iters, 1)[name][0])
        factor = 2 * (size - 1) / size
        row = {"bytes": nbytes, "processes": size}
        for name, ts in times.items():
            row[f"{name}_s"] = statistics.median(ts)
            row[f"{name}_busbw"] = nbytes * factor / row[f"{name}_s"] / 1e9
        rows.append(row)
        if rank == 0:
            print(
                f"measured {fmt_bytes(nbytes)}: jaxring {row['jaxring_busbw']:.3f} GB/s, "
                f"mpi4jax {row['mpi4jax_busbw']:.3f} GB/s",
                flush=True,
            )
        nbytes *= 4
    if rank == 0:
        with open(args.worker_json, "w") as f:
            json.dump(rows, f)


def table(rows: list[dict], btl: str, transport: str) -> str:
    n = rows[0]["processes"]
    head = f"{'bytes':>10} | {'jaxring GB/s':>12} | {'mpi4jax GB/s':>12} | {'jaxring/mpi4jax':>15}"
    lines = [
        f"# {n} processes, 1 CPU device each, float32, busbw, median of "
        f"alternating rounds; jaxring JAXRING_TRANSPORT={transport}, "
        f"JAXRING_ALGORITHM={os.environ.get('JAXRING_ALGORITHM', 'auto')}, "
        f"Open MPI btl self,{btl}",
        head,
        "-" * len(head),
    ]
    for r in rows:
        lines.append(
            f"{fmt_bytes(r['bytes']):>10} | {r['jaxring_busbw']:>12.3f} | "
            f"{r['mpi4jax_busbw']:>12.3f} | "
            f"{r['jaxring_busbw'] / r['mpi4jax_busbw']:>14.2f}x"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("64K"))
    ap.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("256M"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--mpi-btl",
        default="vader",
        help="Open MPI's transfer layer beside self: vader (Open MPI 4's "
        "shared memory), sm (Open MPI 5's) or tcp",
    )
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--worker-json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker_json:
        worker(args)
        return 0
    lack = missing()
    if lack:
        print(f"mpi4jax_compare: skipped, this machine lacks {lack}")
        return 0
    transport = os.environ.get("JAXRING_TRANSPORT", "auto")
    env = dict(
        os.environ,
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        JAX_PLATFORMS="cpu",
    )
    results = {}
    for n in args.processes:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            cmd = [
                "mpirun",
                "-n",
                str(n),
                "--oversubscribe",
                "--mca",
                "btl",
                f"self,{args.mpi_btl}",
                sys.executable,
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
            r = subprocess.run(cmd, cwd=tmp, env=env)
            if r.returncode != 0:
                print(f"the {n}-process MPI job failed with status {r.returncode}")
                return r.returncode
            with open(out) as f:
                results[n] = json.load(f)
        print(table(results[n], args.mpi_btl, transport))
        print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
