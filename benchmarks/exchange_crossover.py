"""Ring against exchange under an emulated link: where the measured times
cross, beside where cost_model predicts they cross (what algorithm="auto"
follows under a cpu_link of one link).

    python benchmarks/exchange_crossover.py --links 41Mbit,50us 1Gbit,20us

One process of --devices virtual CPU devices; each size is a jax.jit of one
jaxring.psum per algorithm, the median of --calls calls after a warm-up,
the two algorithms alternating in rounds.
"""

import argparse
import json
import os
import sys
import time


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--links",
        nargs="+",
        default=["41Mbit,50us", "1Gbit,20us", "100Gbit"],
        help="cpu_link settings to measure, each as in jaxring.config",
    )
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument(
        "--sizes",
        nargs="+",
        default=["256", "1K", "2K", "4K", "8K", "16K", "64K"],
        help="bytes per device (K, M suffixes)",
    )
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the rows here")
    return ap.parse_args()


def parse_size(text: str) -> int:
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:].upper(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def size_text(n: int) -> str:
    return f"{n >> 10} KiB" if n >= 1024 else f"{n} B"


def main():
    args = parse_args()
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    )
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxring
    from jaxring._src import cost_model
    from jaxring._src.choice import resolve_algorithm
    from jaxring._src.config import parse_links

    mesh = jax.make_mesh((args.devices,), ("i",))
    sizes = [parse_size(s) for s in args.sizes]
    rings, chunk = jaxring.config.rings, jaxring.config.chunk_bytes

    def call(algorithm, nbytes):
        f = jax.jit(
            jax.shard_map(
                lambda v: jaxring.psum(v, "i", algorithm=algorithm),
                mesh=mesh,
                in_specs=P("i"),
                out_specs=P("i"),
            )
        )
        x = jax.device_put(
            np.ones(args.devices * (nbytes // 4), np.float32), NamedSharding(mesh, P("i"))
        )
        f(x).block_until_ready()
        return lambda: f(x).block_until_ready()

    def median_ms(run):
        times = []
        for _ in range(args.calls):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
        return float(np.median(times)) * 1e3

    rows = []
    print(
        f"# {args.devices} devices in one process, float32, ms per call "
        f"(median of {args.calls}, best of {args.rounds} rounds); rings {rings}"
    )
    for link in args.links:
        jaxring.config.update("cpu_link", link)
        machine = cost_model.emulated_machine(parse_links(link), args.devices)
        print(f"\n## cpu_link {link}")
        print(
            f"{'bytes':>9} | {'ring':>8} {'exchange':>9} | {'ring/exch':>9} | "
            f"{'model ring/exch':>15} | auto picks"
        )
        for nbytes in sizes:
            runs = {a: call(a, nbytes) for a in ("ring", "exchange")}
            best = {a: float("inf") for a in runs}
            for _ in range(args.rounds):
                for a in runs:
                    best[a] = min(best[a], median_ms(runs[a]))
            model = (
                cost_model.flat_ring_time(machine, nbytes, rings, chunk)
                / cost_model.exchange_time(machine, nbytes, rings, chunk)
                if machine is not None
                else float("nan")
            )
            picks = resolve_algorithm(
                "auto",
                parse_links(link),
                np.zeros(args.devices, np.int64),
                nbytes=nbytes,
                world=args.devices,
                rings=rings,
                chunk_bytes=chunk,
            )
            rows.append(
                dict(
                    link=link,
                    bytes=nbytes,
                    ring_ms=best["ring"],
                    exchange_ms=best["exchange"],
                    model_ring_over_exchange=model,
                    auto_picks=picks,
                )
            )
            print(
                f"{size_text(nbytes):>9} | {best['ring']:8.3f} {best['exchange']:9.3f} | "
                f"{best['ring'] / best['exchange']:8.2f}x | {model:14.2f}x | {picks}",
                flush=True,
            )
    jaxring.config.reset("cpu_link")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
