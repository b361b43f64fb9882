"""Flat ring vs tiered plan on an emulated two-tier cluster, in one process.

Usage:
    python benchmarks/emulated_two_tier.py [--size 64M] [--hosts 2]
        [--per-host 4] [--intra 100Gbit,2us] [--inter 1Gbit,20us]
        [--rings 4] [--rounds 3] [--json out.json]

Runs on hosts x per-host virtual CPU devices with link emulation of one link
per tier (jaxring.config.cpu_link = "PER_HOST:INTRA;INTER"): each device has
its own intra-host link, and the devices of a host share one inter-host
link, as they would share a NIC. Times jaxring.allreduce with
topology="flat" and with topology=(per_host, hosts) on the same array, in
alternating rounds, after checking that both match lax.psum computed in the
same run. Prints each one's time and busbw (bytes * 2(n-1)/n / time) and
the tiered/flat ratio, next to the cost model's prediction
(jaxring/_src/cost_model.py) for the same links: the model counts link
time only, so where the measured ratio falls short of it, the difference
is the CPU work of moving the data (measured here too, without emulation).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tcp_allreduce import alternating_rounds, fmt_bytes, parse_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="64M", help="bytes per device (float32)")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--per-host", type=int, default=4)
    ap.add_argument("--intra", default="100Gbit,2us", help="link inside a host")
    ap.add_argument("--inter", default="1Gbit,20us", help="a host's link to the others")
    ap.add_argument("--rings", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    n = args.hosts * args.per_host
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
    )

    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxring
    from jaxring._src import cost_model
    from jaxring._src.config import parse_links

    nbytes = parse_bytes(args.size)
    mesh = jax.make_mesh((n,), ("i",), devices=jax.devices()[:n])
    rng = np.random.default_rng(0)
    x = jax.device_put(
        rng.standard_normal((n, nbytes // 4)).astype(np.float32), NamedSharding(mesh, P("i"))
    )

    def program(reduce):
        return jax.jit(
            jax.shard_map(reduce, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False)
        )

    plans = {"flat": "flat", "tiered": (args.per_host, args.hosts)}

    def programs():
        # Settings are read at trace time: new functions for each setting.
        return {
            name: program(
                lambda v, t=topo: jaxring.allreduce(
                    v, "i", topology=t, rings=args.rings, algorithm="ring"
                )
            )
            for name, topo in plans.items()
        }

    want = np.asarray(program(lambda v: jax.lax.psum(v, "i"))(x))
    # Without emulation first: the CPU time of moving the data.
    cpu = alternating_rounds(programs(), x, 2, args.rounds)
    link = f"{args.per_host}:{args.intra};{args.inter}"
    jaxring.config.update("cpu_link", link)
    fns = programs()
    for name, f in fns.items():
        got = np.asarray(f(x))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
    samples = alternating_rounds(fns, x, 1, args.rounds)
    jaxring.config.reset("cpu_link")

    (_, intra_bw, intra_lat), (_, inter_bw, inter_lat) = parse_links(link)
    machine = cost_model.Machine(
        tiers=(
            cost_model.Tier(args.per_host, intra_lat, 1 / intra_bw),
            cost_model.Tier(args.hosts, inter_lat, 1 / inter_bw, shared_by=args.per_host),
        )
    )
    chunk = jaxring.config.chunk_bytes
    predicted = {
        "flat": cost_model.flat_ring_time(machine, nbytes, args.rings, chunk),
        "tiered": cost_model.tiered_time(machine, nbytes, args.rings, chunk),
    }
    factor = 2 * (n - 1) / n * nbytes
    print(
        f"{n} devices as {args.hosts} emulated hosts x {args.per_host} "
        f"(cpu_link {link!r}), {fmt_bytes(nbytes)} per device, "
        f"{args.rings} rings, median of {args.rounds} rounds"
    )
    print(f"{'plan':8} {'measured':>10} {'busbw':>12} {'model':>10} {'no-link CPU':>12}")
    result = {
        "devices": n,
        "hosts": args.hosts,
        "per_host": args.per_host,
        "link": link,
        "bytes": nbytes,
        "rings": args.rings,
        "plans": {},
    }
    for name in fns:
        t = statistics.median(samples[name])
        c = statistics.median(cpu[name])
        print(
            f"{name:8} {1e3 * t:8.1f} ms {factor / t / 1e9:8.3f} GB/s "
            f"{1e3 * predicted[name]:8.1f} ms {1e3 * c:9.1f} ms"
        )
        result["plans"][name] = {
            "seconds": t,
            "samples": samples[name],
            "busbw_gbs": factor / t / 1e9,
            "model_seconds": predicted[name],
            "cpu_seconds_without_link": c,
        }
    measured = statistics.median(samples["flat"]) / statistics.median(samples["tiered"])
    model = predicted["flat"] / predicted["tiered"]
    print(f"tiered / flat busbw: measured {measured:.2f}x, model {model:.2f}x")
    result.update(measured_ratio=measured, model_ratio=model)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
