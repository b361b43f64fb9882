"""Autotuner: measures the cost model's parameters on this machine and picks,
per message size, the algorithm, ring count and chunk size.

Usage:
    python -m jaxring.tune [--devices 8] [--min-bytes 4K] [--max-bytes 64M]
                           [--quick] [--out PATH] [--load PATH]

It times jaxring.allreduce on the virtual CPU devices of this process for
every candidate (ring counts x chunk sizes, and the direct algorithm) at
every size, fits the model's parameters to those times (jaxring/_src/
tuning.py), and prints, per size, the model's predicted time next to the
measured one for every candidate, the model's choice and the measured best.
The table is written to the cache (~/.cache/jaxring/tuning.json, or --out),
under a key for this topology, where jaxring.allreduce finds it: settings
left at their defaults then come from it (jaxring.config.tuning).

--load PATH reads the parameters from a tuning file instead of measuring,
and prints the choices they imply.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from jaxring.bench import _fmt_bytes, _parse_bytes, _time_calls


def _gamma(nbytes: int = 16 << 20, repeats: int = 5) -> float:
    """Seconds per byte of the float32 sum kernel, on buffers past the caches."""
    import time

    import numpy as np

    from jaxring import _jaxring
    a = np.ones(nbytes // 4, np.float32).tobytes()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _jaxring.reduce_bytes(_jaxring.ELEM_TYPES["float32"], 0, a, a)
        times.append(time.perf_counter() - t0)
    # The binding also copies the result out once; a third of the traffic.
    return min(times) / nbytes * 2 / 3


def measure(devices: int, sizes: list[int], choices, rounds: int, min_time: float):
    """(choice, bytes, median seconds per call) for every choice and size,
    the choices taking turns in each round."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxring

    mesh = jax.make_mesh((devices,), ("i",), devices=jax.devices()[:devices])

    def program(c):
        return jax.jit(jax.shard_map(
            lambda v: jaxring.allreduce(v, "i", rings=c.rings, chunk_bytes=c.chunk_bytes,
                                        algorithm=c.algorithm),
            mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False))

    fns = [program(c) for c in choices]
    out = []
    for nbytes in sizes:
        x = jax.device_put(np.ones((devices, nbytes // 4), np.float32),
                           NamedSharding(mesh, P("i")))
        for f in fns:
            jax.block_until_ready(f(x))  # compile and warm up
        probe = max(_time_calls(f, x, 2) for f in fns)
        iters = int(min(200, max(2, min_time / rounds / max(probe, 1e-7))))
        samples = [[] for _ in fns]
        for _ in range(rounds):
            for i, f in enumerate(fns):
                samples[i].append(_time_calls(f, x, iters))
        for c, s in zip(choices, samples):
            out.append((c, nbytes, statistics.median(s)))
        print(f"# measured {_fmt_bytes(nbytes)}", file=sys.stderr, flush=True)
        del x
    return out


def _name(c) -> str:
    if c.algorithm == "direct":
        return "direct"
    return f"ring r={c.rings} c={_fmt_bytes(c.chunk_bytes).replace(' ', '')}"


def report(params, measured, world: int, out=sys.stdout) -> dict:
    """Prints predicted vs measured per size and candidate; returns the
    figures (errors, choices) for the caller."""
    from jaxring._src import tuning
    by_size: dict[int, list] = {}
    for c, n, t in measured:
        by_size.setdefault(n, []).append((c, t))
    errors, regrets, rows = [], [], []
    print(f"# model: call {params.call_s * 1e6:.1f} us, alpha {params.alpha_s * 1e6:.2f} us, "
          f"beta {params.beta_s_per_byte * 1e9:.3f} ns/B, gamma "
          f"{params.gamma_s_per_byte * 1e9:.3f} ns/B; direct: call "
          f"{params.direct_call_s * 1e6:.1f} us, {params.direct_s_per_byte * 1e9:.3f} ns/B",
          file=out)
    for n, entries in sorted(by_size.items()):
        print(f"\n{_fmt_bytes(n)} per device:", file=out)
        print(f"  {'candidate':<20} {'measured us':>12} {'predicted us':>13} {'error':>7}",
              file=out)
        for c, t in entries:
            p = tuning.predict(params, c, world, n)
            e = tuning.relative_error(p, t)
            errors.append(e)
            print(f"  {_name(c):<20} {t * 1e6:>12.1f} {p * 1e6:>13.1f} {e:>6.0%}", file=out)
        best_c, best_t = min(entries, key=lambda e: e[1])
        chosen = min(entries, key=lambda e: tuning.predict(params, e[0], world, n))
        regret = chosen[1] / best_t - 1
        regrets.append(regret)
        rows.append({"bytes": n, "model_choice": _name(chosen[0]), "model_choice_s": chosen[1],
                     "best": _name(best_c), "best_s": best_t})
        print(f"  model's choice: {_name(chosen[0])} ({chosen[1] * 1e6:.1f} us measured); "
              f"measured best: {_name(best_c)} ({best_t * 1e6:.1f} us); "
              f"the choice is {regret:.0%} slower than the best", file=out)
    within = sum(e <= 0.2 for e in errors) / len(errors)
    print(f"\n# prediction error: median {statistics.median(errors):.0%}, max "
          f"{max(errors):.0%}; {within:.0%} of the {len(errors)} points within 20%", file=out)
    print(f"# the model's choices are, at the median, {statistics.median(regrets):.0%} "
          f"(at most {max(regrets):.0%}) slower than the measured best", file=out)
    return {"errors": errors, "regrets": regrets, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=8, help="virtual CPU devices")
    ap.add_argument("--min-bytes", type=_parse_bytes, default=4 << 10)
    ap.add_argument("--max-bytes", type=_parse_bytes, default=64 << 20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-time", type=float, default=0.2,
                    help="seconds of calls timed per size and candidate")
    ap.add_argument("--quick", action="store_true",
                    help="fewer candidates (ring counts 1, 2; chunks 256K, 1M)")
    ap.add_argument("--out", default=None,
                    help="tuning file to write (default: the cache jaxring reads)")
    ap.add_argument("--load", default=None, metavar="PATH",
                    help="take the parameters from this tuning file, measure nothing")
    args = ap.parse_args(argv)
    from jaxring._src import runtime, tuning
    if args.devices < 2:
        ap.error("--devices must be at least 2")
    sizes = []
    n = args.min_bytes
    while n <= args.max_bytes:
        sizes.append(max(4, n // 4 * 4))
        n *= 4
    choices = tuning.candidates(args.devices, in_one_process=True, quick=args.quick)
    table_key = tuning.key("cpu", args.devices, 1)
    if args.load:
        table = tuning.load(args.load).get(table_key)
        if table is None:
            raise SystemExit(f"{args.load} has no table for {table_key}")
        params = tuning.Params(**table["params"])
        for size, c in tuning.select(params, choices, args.devices, sizes).items():
            print(f"{_fmt_bytes(size):>10}: {_name(c)}, predicted "
                  f"{tuning.predict(params, c, args.devices, size) * 1e6:.1f} us")
        return 0
    runtime.use_cpu_devices(args.devices)
    measured = measure(args.devices, sizes, choices, args.rounds, args.min_time)
    params = tuning.fit(measured, args.devices, _gamma())
    print(f"# {args.devices} virtual CPU devices, float32, median of {args.rounds} "
          "alternating rounds per candidate")
    report(params, measured, args.devices)
    selection = tuning.select(params, choices, args.devices, sizes)
    path = args.out or tuning.cache_path()
    tuning.save(path, table_key, tuning.entry(params, selection))
    print(f"# table for {table_key} written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
