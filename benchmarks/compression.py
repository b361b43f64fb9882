"""Time to accuracy with gradient compression, side by side.

    python benchmarks/compression.py [--model cnn|lm] [--rounds 2] [--target T]
                                     [--settings slow fast network] [--link auto|LINK]
                                     [--processes 4] [--rate auto|RATE]
                                     [--batch-norm sync|local]
                                     [--plot compression.png] [--json compression.json]

A trainer (8 virtual devices, under jaxring.overlap) trains until it
reaches --target, once per configuration, the configurations alternating
in each round. --model picks it:

  cnn  examples/train_cnn.py on digits, to a test accuracy (default 0.95);
  lm   examples/train_lm.py, the character-level transformer, to a
       validation loss (default 2.0 nats per character), evaluated on a
       fixed held-out batch.

The configurations:

  fp32         float32 gradients
  bf16-wire    overlap(wire_dtype="bfloat16"): float32 values sent as bfloat16
  wire16       jaxring.compression.wire16, with error feedback
  powersgd-r1, powersgd-r2, powersgd-r4
               jaxring.compression.powersgd of rank 1, 2, 4
  powersgd-r4-bf16
               rank 4 with wire_dtype="bfloat16": its factors and the leaves
               it sends whole travel in bfloat16
  powersgd-r8 (only when named in --configs)
               rank 8
  powersgd-r4-min4096 (only when named in --configs)
               rank 4 with min_size=4096 (the default was 4096 before it
               was 512): matrices of fewer elements go whole
  powersgd-r2-warm, powersgd-r4-warm (cnn, only when named in --configs)
               the same after --warm-up-steps uncompressed steps, the
               trainer switching between two compiled steps

in two settings:

  slow  an emulated link (jaxring.config.cpu_link) on which a ring allreduce
        of the float32 gradients takes about twice the compute step,
        calibrated from a first run without it (--link overrides);
  fast  no link emulation (the in-process transport);
  network (as root) --processes processes of one CPU device each, each in
        its own network namespace on tbf-limited links (benchmarks/netns.py),
        the rate calibrated the same way from a first run on unlimited links
        (--rate overrides); jaxring's TCP transport carries the buckets.

--batch-norm local (cnn) keeps each device's BatchNorm statistics to
itself (PyTorch DDP's default) instead of averaging them over the devices
(flax's examples, the default here): the step then makes no allreduce
that its own computation waits for, only the gradients' (and the logged
loss's).

Steps to the target move with the trajectory: the order in which the
allreduces add changes the low bits, and a few steps later the evaluation
at which the target is first reached. --seed-per-round trains round k with
seed k-1, so the medians cover that spread rather than one trajectory.

It prints, per setting and configuration (medians over the rounds): steps
and training seconds to the target (compilation and evaluation left out),
milliseconds per step, gradient bytes each rank sends per step, the final
test accuracy or validation loss, and the time to target relative to fp32
and to bf16-wire in the same run. --plot draws the metric against training
time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
NETNS = os.path.join(HERE, "netns.py")


class Model:
    """A trainer the benchmark runs, and how it is told when to stop."""

    def __init__(
        self,
        script,
        metric,
        default_target,
        higher_is_better,
        stop_flag,
        limit_flag,
        summary_key,
        untimed_steps,
    ):
        self.trainer = os.path.join(HERE, "..", "examples", script)
        self.metric = metric  # what the trainer's eval lines give
        self.default_target = default_target
        self.higher_is_better = higher_is_better
        self.stop_flag = stop_flag  # stop at the target
        self.limit_flag = limit_flag  # most steps a run may take
        self.summary_key = summary_key  # the final value in its summary line
        # Steps before its clock starts (they compile): its training time
        # covers steps - untimed_steps steps.
        self.untimed_steps = untimed_steps

    def timed_steps(self, run: dict) -> int:
        return max(run["steps"] - self.untimed_steps, 1)

    def reached(self, value: float, target: float) -> bool:
        return value >= target if self.higher_is_better else value <= target


MODELS = {
    # pmap compiles the CNN's step twice (the state as given, then as it
    # returns it); the LM's jit once.
    "cnn": Model(
        "train_cnn.py",
        "accuracy",
        0.95,
        True,
        "--target-accuracy",
        "--max-steps",
        "test accuracy=",
        untimed_steps=2,
    ),
    "lm": Model(
        "train_lm.py",
        "loss",
        2.0,
        False,
        "--target-loss",
        "--steps",
        "validation loss=",
        untimed_steps=1,
    ),
}

CONFIGS = {
    "fp32": [],
    "bf16-wire": ["--wire-dtype", "bfloat16"],
    "wire16": ["--compression", "wire16"],
    "powersgd-r1": ["--compression", "powersgd", "--rank", "1"],
    "powersgd-r2": ["--compression", "powersgd", "--rank", "2"],
    "powersgd-r4": ["--compression", "powersgd", "--rank", "4"],
    "powersgd-r8": ["--compression", "powersgd", "--rank", "8"],
    "powersgd-r4-min4096": ["--compression", "powersgd", "--rank", "4", "--min-size", "4096"],
    "powersgd-r4-bf16": ["--compression", "powersgd", "--rank", "4", "--wire-dtype", "bfloat16"],
    "powersgd-r2-warm": ["--compression", "powersgd", "--rank", "2", "--warm-up-steps"],
    "powersgd-r4-warm": ["--compression", "powersgd", "--rank", "4", "--warm-up-steps"],
}
# Run unless --configs names others (the warm-up ones need the CNN trainer).
OPT_IN = ("-warm", "-min4096", "-r8")
DEFAULT_CONFIGS = [c for c in CONFIGS if not c.endswith(OPT_IN)]

_EVAL = re.compile(r"^eval step=(\d+) seconds=([\d.]+) (?:accuracy|loss)=([\d.]+)$")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(MODELS), default="cnn")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--seed-per-round",
        action="store_true",
        help="round k trains with seed k-1 (data split, shuffling, "
        "initialisation), so the medians cover how steps to "
        "the target vary between trajectories, not only timing",
    )
    p.add_argument(
        "--target",
        type=float,
        default=None,
        help="test accuracy (cnn, default 0.95) or validation loss (lm, default 2.0) to reach",
    )
    p.add_argument("--epochs", type=int, default=40, help="cnn: most epochs a run may take")
    p.add_argument("--max-steps", type=int, default=800, help="lm: most steps a run may take")
    p.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="steps between evaluations (default: cnn 4, lm 20)",
    )
    p.add_argument(
        "--settings", nargs="+", default=["slow", "fast"], choices=["slow", "fast", "network"]
    )
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    p.add_argument(
        "--warm-up-steps", type=int, default=16, help="the -warm configurations' uncompressed steps"
    )
    p.add_argument(
        "--link",
        default="auto",
        help='the slow setting\'s link, e.g. "50Mbit,50us" (default: calibrated)',
    )
    p.add_argument("--latency-us", type=float, default=50.0, help="latency of the calibrated link")
    p.add_argument("--processes", type=int, default=4, help="processes of the network setting")
    p.add_argument(
        "--rate",
        default="auto",
        help='the network setting\'s tbf rate, e.g. "40mbit" (default: calibrated)',
    )
    p.add_argument(
        "--batch-norm",
        choices=("sync", "local"),
        default="sync",
        help="cnn: BatchNorm statistics averaged over the devices (sync) "
        "or each device's own (local)",
    )
    p.add_argument("--plot", default=None, help="accuracy against time, as a PNG")
    p.add_argument("--json", default=None, help="every run's evaluations, as JSON")
    args = p.parse_args(argv)
    args.spec = MODELS[args.model]
    if args.model != "cnn" and any(c.endswith("-warm") for c in args.configs):
        p.error("the -warm configurations train the CNN (--model cnn)")
    if args.model != "cnn" and args.batch_norm != "sync":
        p.error("--batch-norm is the CNN's (--model cnn): the transformer has no BatchNorm")
    if args.target is None:
        args.target = args.spec.default_target
    if args.eval_every is None:
        args.eval_every = 4 if args.model == "cnn" else 20
    return args


def train(
    args,
    config: str,
    link: str | None,
    max_steps: int | None = None,
    rate: str | None = None,
    network: bool = False,
    seed: int = 0,
) -> dict:
    """One run of the trainer: its evaluations, steps, bytes per step and
    final accuracy. In the network setting it runs over namespaces (at
    rate, or unlimited) and process 0's lines are read."""
    spec = args.spec
    budget = (
        ["--epochs", str(args.epochs)] if args.model == "cnn" else ["--steps", str(args.max_steps)]
    )
    flags = CONFIGS[config]
    if config.endswith("-warm"):
        flags = flags + [str(args.warm_up_steps)]
    if args.model == "cnn":
        flags = flags + ["--batch-norm", args.batch_norm]
    cmd = [
        sys.executable,
        spec.trainer,
        "--quiet",
        "--mode",
        "overlap",
        "--seed",
        str(seed),
        *budget,
        *flags,
    ]
    if network:
        cmd = [
            sys.executable,
            NETNS,
            "--nodes",
            str(args.processes),
            *(["--rate", rate] if rate else []),
            "--",
            *cmd[1:],
        ]
    else:
        cmd += ["--devices", "8"]
    if max_steps is None:
        cmd += ["--eval-every", str(args.eval_every), spec.stop_flag, str(args.target)]
    else:
        cmd += [spec.limit_flag, str(max_steps)]
    if link:
        cmd += ["--link", link]
    with tempfile.TemporaryDirectory() as cwd:  # the installed jaxring, not the checkout
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(f"{config} failed:\n{res.stderr[-3000:]}")
    lines = res.stdout.splitlines()
    if network:  # the launcher prefixes each process's lines with [rank]
        lines = [l[4:] for l in lines if l.startswith("[0] ")]
    evals = [tuple(float(g) for g in m.groups()) for m in map(_EVAL.match, lines) if m]
    summary = next(l for l in lines if l.startswith("mode="))
    fields = dict(f.split("=", 1) for f in summary.split() if "=" in f)
    final = float(summary.split(spec.summary_key)[1].split()[0])
    return {
        "config": config,
        "evals": evals,
        "steps": int(fields["steps"]),
        "bytes_per_step": int(fields["bytes/step"]),
        "final": final,
        "seconds": float(summary.split("time after compile=")[1].split()[0]),
    }


def to_target(run: dict, target: float, spec: Model) -> tuple[float, float] | None:
    """(steps, seconds) at the first evaluation that reached target."""
    for step, seconds, value in run["evals"]:
        if spec.reached(value, target):
            return step, seconds
    return None


def calibrated_link(args) -> str:
    """A link on which a ring allreduce of the float32 gradients takes about
    twice the compute step, measured here without emulation."""
    from jaxring.demo import calibrated_link as link_for

    probe = train(args, "fp32", None, max_steps=40)
    step_s = probe["seconds"] / args.spec.timed_steps(probe)
    return link_for(2 * step_s, probe["bytes_per_step"], 8, args.latency_us)


def calibrated_rate(args) -> str:
    """A tbf rate on which a ring allreduce of the float32 gradients over
    the processes takes about twice their compute step, measured on
    unlimited links."""
    probe = train(args, "fp32", None, max_steps=40, network=True)
    step_s = probe["seconds"] / args.spec.timed_steps(probe)
    n = args.processes
    per_link = 2 * (n - 1) / n * probe["bytes_per_step"] / (2 * step_s)
    return f"{max(1, round(per_link * 8 / 1e6))}mbit"


def report(setting: str, link: str | None, runs: dict, target: float, spec: Model) -> dict:
    what = "test accuracy" if spec.metric == "accuracy" else "validation loss"
    print(
        f"\n== {setting}: {link or 'no link emulation'}, "
        f"target {what} {target:.2f}, medians over "
        f"{len(next(iter(runs.values())))} round(s)"
    )
    final = "final acc" if spec.metric == "accuracy" else "val loss"
    print(
        f"{'config':>16} {'steps':>6} {'s to target':>12} {'ms/step':>8} "
        f"{'bytes/step':>11} {final:>9} {'vs fp32':>8} {'vs bf16':>8}"
    )
    rows = {}
    for config, rs in runs.items():
        reached = [to_target(r, target, spec) for r in rs]
        ok = [x for x in reached if x is not None]
        rows[config] = {
            "steps": statistics.median(s for s, _ in ok) if len(ok) == len(rs) else None,
            "seconds": statistics.median(t for _, t in ok) if len(ok) == len(rs) else None,
            "ms_per_step": statistics.median(1e3 * r["seconds"] / spec.timed_steps(r) for r in rs),
            "bytes_per_step": rs[0]["bytes_per_step"],
            "final": statistics.median(r["final"] for r in rs),
        }
    for config, row in rows.items():

        def ratio(base):
            b = rows.get(base, {}).get("seconds")
            return f"{row['seconds'] / b:.2f}" if row["seconds"] and b else "-"

        steps = f"{row['steps']:.0f}" if row["steps"] else "not reached"
        secs = f"{row['seconds']:.2f}" if row["seconds"] else "-"
        print(
            f"{config:>16} {steps:>6} {secs:>12} {row['ms_per_step']:>8.1f} "
            f"{row['bytes_per_step']:>11,} {row['final']:>9.4f} "
            f"{ratio('fp32'):>8} {ratio('bf16-wire'):>8}"
        )
    return rows


def plot(path: str, results: dict, spec: Model) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (setting, data) in zip(axes[0], results.items()):
        for config, rs in data["runs"].items():
            r = rs[0]
            ax.plot(
                [e[1] for e in r["evals"]], [e[2] for e in r["evals"]], label=config, marker="."
            )
        ax.set_title(f"{setting}: {data['link'] or 'no link emulation'}")
        ax.set_xlabel("training seconds (round 1)")
        ax.set_ylabel("test accuracy" if spec.metric == "accuracy" else "validation loss")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    results = {}
    for setting in args.settings:
        link = rate = None
        if setting == "slow":
            link = calibrated_link(args) if args.link == "auto" else args.link
        if setting == "network":
            if os.geteuid() != 0:
                raise SystemExit("the network setting needs root (network namespaces)")
            rate = calibrated_rate(args) if args.rate == "auto" else args.rate
        runs = {c: [] for c in args.configs}
        for round_ in range(args.rounds):
            for config in args.configs:
                r = train(
                    args,
                    config,
                    link,
                    rate=rate,
                    network=setting == "network",
                    seed=round_ if args.seed_per_round else 0,
                )
                runs[config].append(r)
                print(
                    f"[{setting} round {round_ + 1}] {config}: {r['steps']} steps, "
                    f"{r['seconds']:.2f} s, {args.spec.metric} {r['final']:.4f}",
                    flush=True,
                )
        where = (
            f"emulated link {link}"
            if link
            else f"{args.processes} processes, tbf {rate}"
            if rate
            else None
        )
        if args.model == "cnn" and args.batch_norm == "local":
            where = f"{where or 'no link emulation'}, BatchNorm statistics per device"
        results[setting] = {
            "link": where,
            "runs": runs,
            "rows": report(setting, where, runs, args.target, args.spec),
        }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        plot(args.plot, results, args.spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
