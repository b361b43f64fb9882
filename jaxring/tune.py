"""Autotuner: measures the cost model's parameters on this machine and picks,
per message size, the algorithm, ring count, chunk size and plan.

Usage:
    python -m jaxring.tune [--devices 8] [--min-bytes 256] [--max-bytes 64M]
                           [--quick] [--out PATH] [--load PATH]
    python -m jaxring.launch -n 4 -m jaxring.tune [--quick] ...

It times jaxring.allreduce for every candidate (ring counts x chunk sizes,
the direct algorithm in one process and across the processes of one host,
the exchange across processes) at
every size, fits the model's parameters to those times
(jaxring/_src/tuning.py), and prints, per size,
the model's predicted time next to the measured one for every candidate,
the model's choice and the measured best. The table is written to the cache
(~/.cache/jaxring/tuning.json, or --out), under a key for this topology,
where jaxring.allreduce finds it: settings left at their defaults then come
from it (jaxring.config.tuning).

In one process it runs on --devices virtual CPU devices. As a job of
several processes (jax.distributed initialized, as the launcher does) it
runs on every device of the job; where the ranks form several tiers
(devices of a process, processes of a host, hosts) each candidate is
measured both as a flat ring and as the tiered plan, and the model gets an
(alpha, beta) per tier. Process 0 fits and reports; every process gets the
same table, and every process writes it (to its own cache file, or the
same one: a write replaces the file whole, with the same content).

--load PATH reads the parameters from a tuning file instead of measuring,
and prints the choices they imply.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from jaxring._src import lib
from jaxring.bench import _fmt_bytes, _parse_bytes, _time_calls


def _gamma(nbytes: int = 16 << 20, repeats: int = 5) -> float:
    """Seconds per byte of the float32 sum kernel, on buffers past the caches."""
    import time

    import numpy as np

    a = np.ones(nbytes // 4, np.float32).tobytes()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        lib.cpu.reduce_bytes(lib.cpu.ELEM_TYPES["float32"], 0, a, a)
        times.append(time.perf_counter() - t0)
    # The binding also copies the result out once; a third of the traffic.
    return min(times) / nbytes * 2 / 3


def _in_job() -> bool:
    """Whether this process is one of several of a jax.distributed job."""
    from jaxring._src import jax_compat

    return jax_compat.distributed_client() is not None


def _agree(value, tag: str):
    """Process 0's value, on every process of the job (the same number of
    collective calls must run everywhere)."""
    import json

    from jaxring._src import jax_compat

    client = jax_compat.distributed_client()
    if client is None:
        return value
    key = f"jaxring/tune/{tag}"
    if jax_compat.distributed_state()[0] == 0:
        client.key_value_set(key, json.dumps(value))
    return json.loads(client.blocking_key_value_get(key, 600_000))


def job_tiers(devices) -> tuple:
    """The tiers the default topology finds for a ring over these devices
    (() for one tier)."""
    import numpy as np

    from jaxring._src import distributed, topology

    if len({d.process_index for d in devices}) > 1:
        distributed.ensure_tcp_transport(120.0, check_settings=False)
    rank_process = np.array([d.process_index for d in devices], np.int64)
    return topology.resolve("auto", len(devices), rank_process, distributed.process_hosts())


def measure(devices, sizes: list[int], choices, rounds: int, min_time: float):
    """(choice, bytes, median seconds per call) for every choice and size,
    the choices taking turns in each round."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jaxring

    n = len(devices)
    mesh = Mesh(np.array(devices), ("i",))

    def program(c):
        return jax.jit(
            jax.shard_map(
                lambda v: jaxring.allreduce(
                    v,
                    "i",
                    rings=c.rings,
                    chunk_bytes=c.chunk_bytes,
                    algorithm=c.algorithm,
                    topology=c.topology,
                ),
                mesh=mesh,
                in_specs=P("i"),
                out_specs=P("i"),
                check_vma=False,
            )
        )

    fns = [program(c) for c in choices]
    sharding = NamedSharding(mesh, P("i"))
    out = []
    for nbytes in sizes:
        count = nbytes // 4
        x = jax.make_array_from_callback(
            (n, count), sharding, lambda idx: np.ones((1, count), np.float32)
        )
        for f in fns:
            jax.block_until_ready(f(x))  # compile and warm up
        probe = max(_time_calls(f, x, 2) for f in fns)
        iters = _agree(
            int(min(200, max(2, min_time / rounds / max(probe, 1e-7)))), f"iters/{nbytes}"
        )
        samples = [[] for _ in fns]
        for _ in range(rounds):
            for i, f in enumerate(fns):
                samples[i].append(_time_calls(f, x, iters))
        for c, s in zip(choices, samples):
            out.append((c, nbytes, statistics.median(s)))
        if jax.process_index() == 0:
            print(f"# measured {_fmt_bytes(nbytes)}", file=sys.stderr, flush=True)
        del x
    return out


def _name(c) -> str:
    if c.algorithm in ("direct", "exchange"):
        return c.algorithm
    plan = "tiered" if c.topology == "auto" else "ring"
    return f"{plan} r={c.rings} c={_fmt_bytes(c.chunk_bytes).replace(' ', '')}"


def _describe(params) -> str:
    if not params.tiers:
        return f"alpha {params.alpha_s * 1e6:.2f} us, beta {params.beta_s_per_byte * 1e9:.3f} ns/B"
    return "; ".join(
        f"tier {i} ({size} ranks, link shared by {shared}): alpha {a * 1e6:.2f} us, "
        f"beta {b * 1e9:.3f} ns/B"
        for i, (size, a, b, shared) in enumerate(params.tiers)
    )


def report(params, measured, world: int, out=sys.stdout) -> dict:
    """Prints predicted vs measured per size and candidate; returns the
    figures (errors, choices) for the caller."""
    from jaxring._src import tuning

    by_size: dict[int, list] = {}
    for c, n, t in measured:
        by_size.setdefault(n, []).append((c, t))
    errors, regrets, rows = [], [], []
    print(
        f"# model: call {params.call_s * 1e6:.1f} us, {_describe(params)}, gamma "
        f"{params.gamma_s_per_byte * 1e9:.3f} ns/B; direct: call "
        f"{params.direct_call_s * 1e6:.1f} us, {params.direct_s_per_byte * 1e9:.3f} ns/B",
        file=out,
    )
    for n, entries in sorted(by_size.items()):
        print(f"\n{_fmt_bytes(n)} per device:", file=out)
        print(
            f"  {'candidate':<20} {'measured us':>12} {'predicted us':>13} {'error':>7}", file=out
        )
        for c, t in entries:
            p = tuning.predict(params, c, world, n)
            e = tuning.relative_error(p, t)
            errors.append(e)
            print(f"  {_name(c):<20} {t * 1e6:>12.1f} {p * 1e6:>13.1f} {e:>6.0%}", file=out)
        best_c, best_t = min(entries, key=lambda e: e[1])
        # The table's choice: the model's, a measurement breaking its ties.
        pick = tuning.select(params, [c for c, _ in entries], world, [n], measured)[n]
        chosen = next(e for e in entries if e[0] == pick)
        regret = chosen[1] / best_t - 1
        regrets.append(regret)
        rows.append(
            {
                "bytes": n,
                "model_choice": _name(chosen[0]),
                "model_choice_s": chosen[1],
                "best": _name(best_c),
                "best_s": best_t,
            }
        )
        print(
            f"  model's choice: {_name(chosen[0])} ({chosen[1] * 1e6:.1f} us measured); "
            f"measured best: {_name(best_c)} ({best_t * 1e6:.1f} us); "
            f"the choice is {regret:.0%} slower than the best",
            file=out,
        )
    within = sum(e <= 0.2 for e in errors) / len(errors)
    print(
        f"\n# prediction error: median {statistics.median(errors):.0%}, max "
        f"{max(errors):.0%}; {within:.0%} of the {len(errors)} points within 20%",
        file=out,
    )
    print(
        f"# the model's choices are, at the median, {statistics.median(regrets):.0%} "
        f"(at most {max(regrets):.0%}) slower than the measured best",
        file=out,
    )
    return {"errors": errors, "regrets": regrets, "rows": rows}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--devices", type=int, default=None, help="virtual CPU devices (one process; default 8)"
    )
    # From 256 B: the exchange may win below a few KiB on slow links
    # (BatchNorm statistics, losses), and the table's smallest size
    # decides for every message below it.
    ap.add_argument("--min-bytes", type=_parse_bytes, default=256)
    ap.add_argument("--max-bytes", type=_parse_bytes, default=64 << 20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--min-time", type=float, default=0.2, help="seconds of calls timed per size and candidate"
    )
    ap.add_argument(
        "--quick", action="store_true", help="fewer candidates (ring counts 1, 2; chunks 256K, 1M)"
    )
    ap.add_argument(
        "--out", default=None, help="tuning file to write (default: the cache jaxring reads)"
    )
    ap.add_argument(
        "--load",
        default=None,
        metavar="PATH",
        help="take the parameters from this tuning file, measure nothing",
    )
    return ap


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    in_job = _in_job()
    if in_job and args.devices is not None:
        ap.error(
            "--devices is for one process; a job tunes every device it has "
            "(jaxring.launch --devices-per-process sets them)"
        )
    if in_job and args.load:
        ap.error("--load reads a file: run it in one process")
    devices_n = 8 if args.devices is None else args.devices
    if not in_job and devices_n < 2:
        ap.error("--devices must be at least 2")
    sizes = []
    n = args.min_bytes
    while n <= args.max_bytes:
        sizes.append(max(4, n // 4 * 4))
        n *= 4
    if args.load:
        return _show_loaded(args, devices_n, sizes)
    return _tune(args, in_job, devices_n, sizes)


def _show_loaded(args, devices_n: int, sizes: list[int]) -> int:
    """The choices a tuning file's parameters give, without measuring."""
    from jaxring._src import tuning

    table_key = tuning.key("cpu", devices_n, 1)
    table = tuning.load(args.load).get(table_key)
    if table is None:
        raise SystemExit(f"{args.load} has no table for {table_key}")
    params = tuning.Params.from_dict(table["params"])
    choices = tuning.candidates(devices_n, in_one_process=True, quick=args.quick)
    for size, c in tuning.select(params, choices, devices_n, sizes).items():
        print(
            f"{_fmt_bytes(size):>10}: {_name(c)}, predicted "
            f"{tuning.predict(params, c, devices_n, size) * 1e6:.1f} us"
        )
    return 0


def _tune(args, in_job: bool, devices_n: int, sizes: list[int]) -> int:
    """Measures every candidate at every size, fits the model, writes the
    table (in every process of a job)."""
    from jaxring._src import runtime, tuning

    if not in_job:
        runtime.use_cpu_devices(devices_n)
    import jax

    devices = jax.devices() if in_job else jax.devices()[:devices_n]
    world, processes = len(devices), jax.process_count()
    if world < 2:
        raise SystemExit("jaxring.tune: the job has one device; an allreduce needs at least 2")
    dims = job_tiers(devices) if processes > 1 else ()
    host_direct = processes > 1 and _has_host_segment()
    choices = tuning.candidates(
        world,
        in_one_process=processes == 1,
        quick=args.quick,
        tiered=bool(dims),
        host_direct=host_direct,
    )
    measured = measure(devices, sizes, choices, args.rounds, args.min_time)
    table_key = tuning.key(jax.default_backend(), world, processes)
    me = jax.process_index()
    table_entry = None
    if me == 0:
        params = tuning.fit(measured, world, _gamma(), dims)
        where = (
            f"{world} virtual CPU devices"
            if processes == 1
            else f"{world} devices in {processes} processes, tiers "
            f"{'x'.join(map(str, dims)) if dims else 'flat (one tier)'}"
        )
        print(f"# {where}, float32, median of {args.rounds} alternating rounds per candidate")
        report(params, measured, world)
        selection = tuning.select(
            params, choices, world, sizes, measured, direct_everywhere_or_nowhere=host_direct
        )
        if selection != tuning.select(params, choices, world, sizes, measured):
            family = "direct" if selection[sizes[0]].algorithm == "direct" else "no direct"
            print(
                f"# the table holds {family} at every size: across processes of one "
                "host it takes direct at every size or at none, so that processes "
                "that reach one call site with different shapes fail with "
                "MismatchError rather than wait for each other"
            )
        table_entry = tuning.entry(params, selection)
    table_entry = _agree(table_entry, "table")
    path = args.out or tuning.cache_path()
    # Every process, not one per host: processes of one host may each have
    # a cache of their own (containers sharing the host's network and
    # /dev/shm but not a home), and one without the table would run the
    # defaults while the others ran the table.
    tuning.save(path, table_key, table_entry)
    if me == 0:
        print(
            f"# table for {table_key} written to {path}"
            + (" (by every process)" if processes > 1 else "")
        )
    return 0


def _has_host_segment() -> bool:
    """Whether direct can run across this job's processes: the transport's
    set-up (done here, before any allreduce) decides it alike in every
    process. The tuner measures every choice with explicit settings, so
    the processes' own settings and tables (which may differ: that may be
    why it runs) are not compared (job_tiers sets the transport up first,
    alike)."""
    from jaxring._src import distributed, host_segment
    from jaxring._src.config import config

    distributed.ensure_tcp_transport(config.timeout_s, check_settings=False)
    return host_segment.unavailable() is None


if __name__ == "__main__":
    sys.exit(main())
