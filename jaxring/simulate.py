"""Predicted allreduce time and data-parallel scaling efficiency at cluster
scale, from jaxring's cost model (jaxring/_src/cost_model.py), its plans and
the overlap transform's bucket schedule.

Usage:
    python -m jaxring.simulate [--preset issue|ddl|horovod] [--gpus 8 16 ... 4096]
        [--plot scaling.png] [--json scaling.json] [overrides, see --help]

For each cluster size it predicts, for a ResNet-50-sized model (the
layers' parameter counts and FLOPs of ResNet-50 at 224x224, about 25.6M
parameters, 102 MB of fp32 gradients):

* the time of one allreduce of all the gradients with a flat ring and with
  the tiered plan over (GPUs per host, hosts);
* the training step with overlap: the backward pass produces the layers'
  gradients last layer first, in times proportional to their FLOPs; they
  are grouped into buckets by jaxring.overlap's planner, and each bucket's
  allreduce starts once its gradients exist and the previous bucket's
  allreduce is done (one link, first come first served). The step ends when
  both the backward pass and the last allreduce are done;
* scaling efficiency = single-GPU step time / predicted step time.

These are predictions of a model, not measurements: the parameters printed
with the table are all it knows about the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys

from jaxring._src import bucketing, cost_model

# Published scaling efficiencies (ResNet-50 / Inception-class models, images
# per second at N GPUs over N times one GPU), to put the predictions next to.
PUBLISHED = [
    ("PowerAI DDL (Cho et al. 2017), ResNet-50, 256 P100, 100 Gbit/s IB", 256, 0.95),
    ("Horovod (Sergeev & Del Balso 2018), ResNet-101, 128 P100, 25 Gbit/s RoCE", 128, 0.88),
]


@dataclasses.dataclass(frozen=True)
class Preset:
    gpus_per_host: int
    intra_gbyte_s: float  # per GPU, each direction
    intra_alpha_us: float
    inter_gbit_s: float  # per NIC
    inter_alpha_us: float
    nics_per_host: int
    step_ms: float  # forward + backward of one GPU, no communication
    note: str


PRESETS = {
    "issue": Preset(
        8,
        150.0,
        2.0,
        400.0,
        5.0,
        1,
        150.0,
        "8 GPUs per host on NVLink-class links, hosts on one 400 Gbit/s "
        "link each; 150 ms of compute per step (ResNet-50, batch 32 "
        "on a P100-class GPU)",
    ),
    "ddl": Preset(
        4,
        20.0,
        5.0,
        100.0,
        5.0,
        1,
        150.0,
        "PowerAI DDL's cluster: 4 P100 per host on NVLink 1.0, hosts on "
        "100 Gbit/s InfiniBand; ResNet-50 at batch 32",
    ),
    "horovod": Preset(
        4,
        10.0,
        10.0,
        25.0,
        20.0,
        1,
        300.0,
        "Horovod's cluster: 4 P100 per host on PCIe, hosts on 25 Gbit/s RoCE; batch 64",
    ),
}


def resnet50_layers() -> list[tuple[str, int, float]]:
    """(name, parameters, forward FLOPs) of ResNet-50's layers at 224x224,
    in forward order; batch norms carry their scale and offset."""
    layers = []

    def conv(name, k, cin, cout, out_hw):
        params = k * k * cin * cout
        layers.append((name, params, 2.0 * params * out_hw * out_hw))
        layers.append((name + "/bn", 2 * cout, 4.0 * cout * out_hw * out_hw))

    conv("conv1", 7, 3, 64, 112)
    hw, cin = 56, 64
    for stage, (blocks, width, stride) in enumerate(
        [(3, 64, 1), (4, 128, 2), (6, 256, 2), (3, 512, 2)]
    ):
        for b in range(blocks):
            s = stride if b == 0 else 1
            out_hw = hw // s
            name = f"stage{stage + 1}/block{b + 1}"
            conv(name + "/conv1", 1, cin, width, hw)
            conv(name + "/conv2", 3, width, width, out_hw)
            conv(name + "/conv3", 1, width, 4 * width, out_hw)
            if b == 0:
                conv(name + "/downsample", 1, cin, 4 * width, out_hw)
            cin, hw = 4 * width, out_hw
    layers.append(("fc", 2048 * 1000 + 1000, 2.0 * 2048 * 1000))
    return layers


def machine_for(gpus: int, p: Preset, gamma: float) -> cost_model.Machine:
    per_host = min(gpus, p.gpus_per_host)
    hosts = gpus // per_host
    intra = cost_model.Tier(per_host, p.intra_alpha_us * 1e-6, 1 / (p.intra_gbyte_s * 1e9))
    inter = cost_model.Tier(
        hosts,
        p.inter_alpha_us * 1e-6,
        1 / (p.inter_gbit_s * 1e9 / 8),
        shared_by=max(1, per_host // p.nics_per_host),
    )
    return cost_model.Machine((intra, inter), gamma)


def step_time(
    layers, machine, allreduce, compute_s: float, bucket_mb: float, first_bucket_mb: float
) -> float:
    """The step with overlap: buckets from jaxring.overlap's planner, each
    allreduce after its gradients exist and after the previous one."""
    total_flops = sum(f for _, _, f in layers)
    forward_s = compute_s / 3
    backward = list(reversed(layers))  # gradients come last layer first
    # Slot s is the point after s layers of the backward pass.
    ready_at = [forward_s]
    for _, _, flops in backward:
        ready_at.append(ready_at[-1] + (2 * compute_s / 3) * flops / total_flops)
    items = [
        bucketing.Item(
            key=name, nbytes=4 * params, dtype="float32", ready=s + 1, needed=len(backward)
        )
        for s, (name, params, _) in enumerate(backward)
    ]
    plan = bucketing.plan_buckets(
        items,
        first_bucket_bytes=int(first_bucket_mb * 2**20),
        bucket_bytes=int(bucket_mb * 2**20),
        max_inflight_bytes=None,
    )
    link_free = 0.0
    for b in plan.buckets:
        begin = max(ready_at[b.start_slot], link_free)
        link_free = begin + allreduce(machine, b.nbytes)
    return max(ready_at[-1], link_free)


def simulate(
    preset: Preset,
    gpus_list,
    rings: int,
    chunk_bytes: int,
    bucket_mb: float,
    first_bucket_mb: float,
    gamma: float,
) -> list[dict]:
    layers = resnet50_layers()
    grad_bytes = 4 * sum(p for _, p, _ in layers)
    compute_s = preset.step_ms / 1e3
    rows = []
    for gpus in gpus_list:
        m = machine_for(gpus, preset, gamma)
        plans = {
            "flat": lambda mm, n: cost_model.flat_ring_time(mm, n, rings, chunk_bytes),
            "tiered": lambda mm, n: cost_model.tiered_time(mm, n, rings, chunk_bytes),
        }
        row = {
            "gpus": gpus,
            "hosts": m.tiers[1].size,
            "gpus_per_host": m.tiers[0].size,
            "grad_bytes": grad_bytes,
        }
        for name, f in plans.items():
            row[f"{name}_allreduce_s"] = f(m, grad_bytes) if gpus > 1 else 0.0
            t = (
                step_time(layers, m, f, compute_s, bucket_mb, first_bucket_mb)
                if gpus > 1
                else compute_s
            )
            row[f"{name}_step_s"] = t
            row[f"{name}_efficiency"] = compute_s / t
        rows.append(row)
    return rows


def table(rows, preset: Preset, args) -> str:
    lines = [
        "# PREDICTIONS of jaxring's cost model, not measurements.",
        f"# machine: {preset.note}",
        f"# parameters: intra-host {preset.intra_gbyte_s:g} GB/s per GPU, alpha "
        f"{preset.intra_alpha_us:g} us; inter-host {preset.inter_gbit_s:g} Gbit/s x "
        f"{preset.nics_per_host} NIC(s) per host, alpha {preset.inter_alpha_us:g} us; "
        f"gamma {args.gamma_ns_per_kb:g} ns/KB; rings {args.rings}, chunk "
        f"{args.chunk_bytes} B; buckets {args.bucket_mb:g} MiB (first "
        f"{args.first_bucket_mb:g}); compute {preset.step_ms:g} ms/step",
        f"# model: ResNet-50, {rows[0]['grad_bytes'] / 1e6:.1f} MB of fp32 gradients",
        f"{'GPUs':>5} {'hosts':>5} | {'flat AR ms':>10} {'tiered AR ms':>12} | "
        f"{'flat step ms':>12} {'eff':>6} | {'tiered step ms':>14} {'eff':>6}",
    ]
    lines.append("-" * len(lines[-1]))
    for r in rows:
        lines.append(
            f"{r['gpus']:>5} {r['hosts']:>5} | {r['flat_allreduce_s'] * 1e3:>10.1f} "
            f"{r['tiered_allreduce_s'] * 1e3:>12.1f} | {r['flat_step_s'] * 1e3:>12.1f} "
            f"{r['flat_efficiency']:>6.1%} | {r['tiered_step_s'] * 1e3:>14.1f} "
            f"{r['tiered_efficiency']:>6.1%}"
        )
    lines.append("# published, for comparison (measured on their clusters):")
    for name, gpus, eff in PUBLISHED:
        lines.append(f"#   {eff:.0%} at {gpus} GPUs: {name}")
    return "\n".join(lines)


def plot(rows, path: str, title: str) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        print(f"matplotlib is not installed: no plot written to {path}")
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    gpus = [r["gpus"] for r in rows]
    for name, style in (("flat", "o--"), ("tiered", "s-")):
        ax.plot(
            gpus,
            [100 * r[f"{name}_efficiency"] for r in rows],
            style,
            label=f"predicted, {name} plan",
        )
    for name, n, eff in PUBLISHED:
        ax.plot([n], [100 * eff], "k*", markersize=11)
        ax.annotate(
            name.split(" (")[0] + f" {eff:.0%} (published)",
            (n, 100 * eff),
            textcoords="offset points",
            xytext=(6, -12),
            fontsize=8,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("scaling efficiency (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="issue")
    ap.add_argument(
        "--gpus", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    )
    ap.add_argument("--gpus-per-host", type=int)
    ap.add_argument("--intra-gbyte-s", type=float)
    ap.add_argument("--inter-gbit-s", type=float)
    ap.add_argument("--nics-per-host", type=int)
    ap.add_argument("--step-ms", type=float)
    ap.add_argument("--rings", type=int, default=2)
    ap.add_argument("--chunk-bytes", type=int, default=1 << 20)
    ap.add_argument(
        "--bucket-mb",
        type=float,
        default=25.0,
        help="bucket cap (MiB); PyTorch DDP's default, larger than "
        "jaxring.overlap's 1 MiB, which suits small clusters",
    )
    ap.add_argument("--first-bucket-mb", type=float, default=1.0)
    ap.add_argument(
        "--gamma-ns-per-kb",
        type=float,
        default=3.0,
        help="reduction cost; 3 ns/KB is about 1 TB/s of HBM reading two operands and writing one",
    )
    ap.add_argument("--plot", default="", help="write a PNG here")
    ap.add_argument("--json", default="", help="write the rows here")
    args = ap.parse_args(argv)
    preset = PRESETS[args.preset]
    overrides = {
        k: getattr(args, k)
        for k in ("gpus_per_host", "intra_gbyte_s", "inter_gbit_s", "nics_per_host", "step_ms")
        if getattr(args, k) is not None
    }
    preset = dataclasses.replace(preset, **overrides)
    for g in args.gpus:
        per_host = min(g, preset.gpus_per_host)
        if g < 1 or g % per_host:
            ap.error(f"{g} GPUs do not fill hosts of {preset.gpus_per_host}")
    rows = simulate(
        preset,
        args.gpus,
        args.rings,
        args.chunk_bytes,
        args.bucket_mb,
        args.first_bucket_mb,
        args.gamma_ns_per_kb * 1e-9 / 1024,
    )
    print(table(rows, preset, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": dataclasses.asdict(preset), "rows": rows}, f, indent=1)
    if args.plot:
        plot(rows, args.plot, f"ResNet-50 data parallel, predicted ({args.preset} preset)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
