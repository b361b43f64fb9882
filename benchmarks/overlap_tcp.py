"""Training over a real (namespaced) network: jaxring.overlap vs lax.pmean on Gloo.

Usage (as root):
    python benchmarks/overlap_tcp.py [--processes 4] [--rate auto|RATE] [--rounds 5]
                                     [--plot overlap_tcp.png] [--json overlap_tcp.json]

The CNN train step of benchmarks/overlap_cnn.py runs on N processes, one CPU
device each, each in its own network namespace (benchmarks/netns.py) with
tbf-limited links. Side by side in one job, alternating each round, it times

* compute: the step with its gradient pmean removed (no communication);
* gloo: the step with `lax.pmean` of the gradients, i.e. JAX's own Gloo
  collectives across processes;
* overlap: the same step under `jaxring.overlap`, whose buckets go over
  jaxring's TCP transport while the backward pass runs;

and prints overlap/gloo (goal <= 0.6 where communication is about equal to
compute). With --rate auto, a first job on unlimited links measures the
compute step, and the rate is chosen so that a ring allreduce of the
gradients takes as long as its backward pass (2/3 of the step, as in
benchmarks/overlap_cnn.py). That is the regime the goal is about: the
first gradient exists only once the forward pass is over, so no schedule
can hide more communication than the backward pass lasts, and a perfect
overlap gives (compute) / (compute + backward) = 0.6.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netns


def worker(args) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jaxring
    from jaxring.demo import cnn_init, make_train_step

    devices = np.array(jax.devices())
    n = devices.size
    mesh = Mesh(devices, ("batch",))
    params, strides = cnn_init(args.layers, args.width)
    grad_bytes = sum(a.size * 4 for a in jax.tree.leaves(params))
    rng = np.random.default_rng(0)
    b = args.per_device_batch * n
    images = rng.normal(size=(b, args.image, args.image, 3)).astype(np.float32)
    labels = rng.integers(0, 10, b).astype(np.int32)
    batch = NamedSharding(mesh, P("batch"))
    replicated = NamedSharding(mesh, P())
    x = jax.make_array_from_callback(images.shape, batch, lambda i: images[i])
    y = jax.make_array_from_callback(labels.shape, batch, lambda i: labels[i])
    p0 = jax.tree.map(
        lambda a: jax.make_array_from_callback(
            a.shape, replicated, lambda i, a=np.asarray(a): a[i]
        ),
        params,
    )

    def sharded(fn):
        return jax.jit(
            jax.shard_map(
                fn,
                mesh=mesh,
                in_specs=(P(), P("batch"), P("batch")),
                out_specs=(P(), P()),
                check_vma=False,
            )
        )

    pmean = make_train_step(strides, lambda g: jax.lax.pmean(g, "batch"))
    variants = {
        "compute": sharded(make_train_step(strides, lambda g: g)),
        "gloo": sharded(pmean),
        "overlap": sharded(jaxring.overlap(pmean, axis_name="batch")),
    }

    def timed(f):
        t0 = time.perf_counter()
        jax.block_until_ready(f(p0, x, y))
        return time.perf_counter() - t0

    for f in variants.values():
        timed(f)
        timed(f)
    # Calibration builds and warms every variant too, so that the compute
    # step is timed in the same state of the process as in the real run.
    timing = ["compute"] if args.calibrate else list(variants)
    samples = {k: [] for k in timing}
    for _ in range(args.rounds):
        for k in timing:
            samples[k].append(timed(variants[k]))
    result = {k: statistics.median(v) for k, v in samples.items()}
    result.update(processes=n, grad_bytes=grad_bytes, samples=samples)
    if jax.process_index() == 0:
        with open(args.worker_json, "w") as f:
            json.dump(result, f)


def run_job(args, rate: str | None, calibrate: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp, netns.Network(args.processes, rate) as net:
        os.chmod(tmp, 0o755)
        out = os.path.join(tmp, "result.json")
        cmd = [
            sys.executable,
            "-m",
            "jaxring.launch",
            "-n",
            str(args.processes),
            "--devices-per-process",
            "1",
            "--coordinator",
            f"{net.address(0)}:29500",
            "--prefix-command",
            net.exec_prefix(),
            os.path.abspath(__file__),
            "--worker-json",
            out,
            "--rounds",
            str(args.rounds),
            "--layers",
            str(args.layers),
            "--width",
            str(args.width),
            "--image",
            str(args.image),
            "--per-device-batch",
            str(args.per_device_batch),
        ]
        if calibrate:
            cmd.append("--calibrate")
        r = subprocess.run(cmd, cwd=tmp)
        if r.returncode != 0:
            raise SystemExit(f"the job failed with status {r.returncode}")
        with open(out) as f:
            return json.load(f)


def plot(t: dict, path: str, title: str) -> None:
    """Each variant's step time: the median as a bar, every round as a dot,
    and the goal (0.6 x Gloo's) as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["compute", "gloo", "overlap"]
    labels = ["no communication", "lax.pmean (Gloo)", "jaxring.overlap"]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.bar(range(3), [t[k] * 1e3 for k in names], color=["0.7", "C1", "C0"])
    for i, k in enumerate(names):
        ax.plot([i] * len(t["samples"][k]), [v * 1e3 for v in t["samples"][k]], "k.")
    ax.axhline(0.6 * t["gloo"] * 1e3, color="C3", ls="--", label="goal: 0.6 x Gloo")
    ax.set_xticks(range(3), labels)
    ax.set_ylabel("step time (ms)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--rate", default="auto", help="tbf rate per link, or 'auto'")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--image", type=int, default=32)
    ap.add_argument("--per-device-batch", type=int, default=16)
    ap.add_argument("--plot", default=None, help="write the step times as a PNG (matplotlib)")
    ap.add_argument("--json", default=None, help="write the figures as JSON")
    ap.add_argument("--calibrate", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker_json:
        worker(args)
        return 0
    if os.geteuid() != 0:
        raise SystemExit("benchmarks/overlap_tcp.py needs root (network namespaces)")
    rate = args.rate
    if rate == "auto":
        base = run_job(args, None, calibrate=True)
        n = base["processes"]
        # Bytes each link carries for a ring allreduce of the gradients, sent
        # in the time of the backward pass (2/3 of the compute step).
        bytes_per_s = 2 * (n - 1) / n * base["grad_bytes"] / (2 / 3 * base["compute"])
        rate = f"{int(bytes_per_s * 8 / 1e6)}mbit"
        print(
            f"calibration: compute step {base['compute'] * 1e3:.1f} ms on "
            f"{n} processes, {base['grad_bytes'] / 2**20:.2f} MiB of gradients "
            f"-> links of {rate}"
        )
    t = run_job(args, rate, calibrate=False)
    print(
        f"\n{args.layers}-layer CNN on {t['processes']} processes (1 CPU device "
        f"each, {os.cpu_count()} cores), {t['grad_bytes'] / 2**20:.2f} MiB of "
        f"gradients, tbf links of {rate}, median of {args.rounds} alternating rounds"
    )
    for k in ("compute", "gloo", "overlap"):
        print(f"  {k:>8}: {t[k] * 1e3:8.1f} ms")
    print(f"  overlap / gloo = {t['overlap'] / t['gloo']:.3f}  (goal <= 0.6)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(t, rate=rate, layers=args.layers, cores=os.cpu_count()), f, indent=1)
    if args.plot:
        plot(
            t,
            args.plot,
            f"{args.layers}-layer CNN, {t['processes']} processes, "
            f"tbf links of {rate}: overlap / gloo = "
            f"{t['overlap'] / t['gloo']:.2f}",
        )
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
