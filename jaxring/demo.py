"""Demo trainer: a CNN trained data-parallel on virtual CPU devices, once with
``jaxring.pmean`` at the end of the step and once with ``jaxring.overlap``,
over an emulated network link.

    jaxring-demo                     # 8 devices, 6 steps, calibrated link
    jaxring-demo --link 1Gbit,20us --steps 10 --timeline trace.json

It prints the buckets overlap chose, each step's loss under both versions
(they agree) and their step times, writes a Perfetto trace of one step of
each (open it at https://ui.perfetto.dev), and plots loss and step time per
step (``jaxring_demo.png``, with matplotlib installed).

The link is emulated (``jaxring.config.cpu_link``): each device's outgoing
transfers share one link of the given bandwidth and latency, and waiting on
it costs wall time but no CPU, so compute and communication compete as on a
real network. By default its bandwidth is chosen so that the gradients'
allreduce takes about as long as the backward pass.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

# ---- the model (also used by benchmarks/overlap_cnn.py) ---------------------


def cnn_init(layers: int = 12, width: int = 128, seed: int = 0):
    """Parameters and strides of a ResNet-shaped CNN: the image halves where
    the channels double, so every layer costs about the same compute while
    the parameters (the gradient bytes) grow toward the output."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    chans = [3] + [min(width, 16 * 2 ** (i // 2)) for i in range(layers)]
    strides = tuple(2 if i > 0 and chans[i + 1] > chans[i] else 1 for i in range(layers))
    params = {}
    for i in range(layers):
        fan_in = 9 * chans[i]
        params[f"conv{i}"] = {
            "w": jnp.asarray(
                rng.normal(0, (2 / fan_in) ** 0.5, (3, 3, chans[i], chans[i + 1])), jnp.float32
            ),
            "b": jnp.zeros((chans[i + 1],), jnp.float32),
        }
    params["head"] = {
        "w": jnp.asarray(rng.normal(0, 0.05, (chans[-1], 10)), jnp.float32),
        "b": jnp.zeros((10,), jnp.float32),
    }
    return params, strides


def cnn_apply(params, strides, x):
    import jax

    for i, s in enumerate(strides):
        with jax.named_scope(f"conv{i}"):
            p = params[f"conv{i}"]
            x = jax.lax.conv_general_dilated(
                x, p["w"], (s, s), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
            )
            x = jax.nn.relu(x + p["b"])
    return x.mean(axis=(1, 2)) @ params["head"]["w"] + params["head"]["b"]


def make_train_step(strides, reduce_grads, lr: float = 0.05):
    """An SGD step; reduce_grads(grads) is where the gradients are averaged."""
    import jax
    import jax.numpy as jnp

    def step(params, images, labels):
        def loss_fn(p):
            logits = cnn_apply(p, strides, images)
            return -jnp.mean(
                jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)
            )

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = reduce_grads(grads)
        params = jax.tree.map(lambda a, g: a - lr * g, params, grads)
        return params, jax.lax.pmean(loss, "batch")[None]

    return step


def calibrated_link(
    backward_s: float, grad_bytes: int, devices: int, latency_us: float = 20.0
) -> str:
    """A link on which a ring allreduce of grad_bytes takes backward_s."""
    rate = 2 * (devices - 1) / devices * grad_bytes / max(backward_s, 1e-4)
    return f"{rate * 8 / 1e6:.0f}Mbit,{latency_us:g}us"


# ---- the demo ---------------------------------------------------------------


def _parse(argv):
    p = argparse.ArgumentParser(description="jaxring overlap demo trainer")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--per-device-batch", type=int, default=16)
    p.add_argument(
        "--link", default=None, help='emulated link, e.g. "1Gbit,20us" (default: calibrated)'
    )
    p.add_argument(
        "--timeline", default="jaxring_timeline.json", help="where to write the trace ('' to skip)"
    )
    p.add_argument(
        "--plot",
        default="jaxring_demo.png",
        help="where to write the loss and step-time plot ('' to skip; needs matplotlib)",
    )
    return p.parse_args(argv)


def plot(path: str, losses: dict, times: dict) -> None:
    """Loss and step time per step, one line per version, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(10, 4))
    for (name, loss), style in zip(losses.items(), ("o-", "s--")):
        steps = range(1, len(loss) + 1)
        ax_loss.plot(steps, loss, style, label=name)
        ax_time.plot(steps, [t * 1e3 for t in times[name]], style, label=name)
    ax_loss.set(xlabel="step", ylabel="loss", title="loss (the versions agree)")
    ax_time.set(xlabel="step", ylabel="step time (ms)", title="step time")
    ax_time.set_ylim(bottom=0)
    for ax in (ax_loss, ax_time):
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = _parse(argv)
    from jaxring._src import runtime

    runtime.use_cpu_devices(args.devices)
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jaxring

    n = args.devices
    if len(jax.devices()) < n:
        raise SystemExit(
            f"jaxring-demo: asked for {n} devices, JAX has "
            f"{len(jax.devices())} (JAX started before the demo set XLA_FLAGS?)"
        )
    mesh = jax.make_mesh((n,), ("batch",))
    params, strides, images, labels = _inputs(mesh, args.per_device_batch * n)
    grad_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))

    def sharded(step):
        # check_vma=False: the step's pmean is the gradient reduction, as
        # under pmap.
        return jax.jit(
            jax.shard_map(
                step,
                mesh=mesh,
                in_specs=(P(), P("batch"), P("batch")),
                out_specs=(P(), P()),
                check_vma=False,
            )
        )

    link = args.link
    if link is None:
        # The backward pass does twice the forward's work: take it as 2/3 of
        # a step without communication.
        compute = sharded(make_train_step(strides, lambda g: g))
        for _ in range(2):
            _timed(compute, params, images, labels)
        t_step = statistics.median(_timed(compute, params, images, labels)[1] for _ in range(3))
        link = calibrated_link(2 / 3 * t_step, grad_bytes, n)
    jaxring.config.update("cpu_link", link)

    plain = sharded(make_train_step(strides, lambda g: jaxring.pmean(g, "batch")))
    overlapped_step = jaxring.overlap(
        make_train_step(strides, lambda g: jax.lax.pmean(g, "batch")), axis_name="batch"
    )

    print(
        f"jaxring demo: 12-layer CNN, {n} virtual CPU devices, "
        f"{grad_bytes / 2**20:.2f} MiB of gradients, emulated link {link}"
    )
    report = {}

    def explained(p, x, y):
        report["r"] = jaxring.explain(overlapped_step, p, x, y)
        return overlapped_step(p, x, y)

    overlapped = sharded(explained)
    jax.block_until_ready(plain(params, images, labels))  # compile both
    jax.block_until_ready(overlapped(params, images, labels))
    r = report["r"]
    print(
        f"overlap chose {len(r.buckets)} buckets: "
        + ", ".join(f"{b.nbytes / 2**20:.2f}" for b in r.buckets)
        + " MiB "
        "(jaxring.explain(step, ...) lists their leaves and placement)"
    )

    (p_plain, p_ov), losses, times = _side_by_side(
        plain, overlapped, params, images, labels, args.steps
    )
    times_plain, times_ov = times
    losses_plain, losses_ov = losses
    mp, mo = statistics.median(times_plain), statistics.median(times_ov)
    diff = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(p_plain), jax.tree.leaves(p_ov))
    )
    print(
        f"\nmedian step: pmean at end {mp * 1e3:.1f} ms, overlap {mo * 1e3:.1f} ms "
        f"(overlap / pmean at end = {mo / mp:.2f})"
    )
    print(
        f"largest parameter difference after {args.steps} steps: {diff:.2e} "
        "(rounding: the buckets sum in a different order)"
    )

    _write_extras(args, plain, overlapped, (p_plain, p_ov), images, labels, losses, times)
    jaxring.config.reset("cpu_link")
    return 0


def _inputs(mesh, batch: int):
    """The CNN's parameters, replicated on the mesh as the steps return them
    (so that the first step compiles what the others run), its layers'
    strides, and a batch of images and labels split over the mesh."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    params, strides = cnn_init()
    params = jax.device_put(params, NamedSharding(mesh, P()))
    rng = np.random.default_rng(1)
    on_devices = NamedSharding(mesh, P("batch"))
    images = jax.device_put(
        jnp.asarray(rng.normal(size=(batch, 32, 32, 3)), jnp.float32), on_devices
    )
    labels = jax.device_put(jnp.asarray(rng.integers(0, 10, batch)), on_devices)
    return params, strides, images, labels


def _timed(f, *a):
    import jax

    t0 = time.perf_counter()
    out = jax.block_until_ready(f(*a))
    return out, time.perf_counter() - t0


def _side_by_side(plain, overlapped, params, images, labels, steps: int):
    """Trains both steps from the same parameters in turn, printing each
    step's losses and times: (final parameters, losses, times), each a pair
    (pmean at end, overlap)."""
    print(
        f"\n{'step':>4}  {'loss, pmean at end':>18}  {'loss, overlap':>13}  "
        f"{'time, pmean at end':>18}  {'time, overlap':>13}"
    )
    p_plain, p_ov = params, params
    times_plain, times_ov, losses_plain, losses_ov = [], [], [], []
    for i in range(steps):
        (p_plain, loss_plain), t_plain = _timed(plain, p_plain, images, labels)
        (p_ov, loss_ov), t_ov = _timed(overlapped, p_ov, images, labels)
        times_plain.append(t_plain)
        times_ov.append(t_ov)
        losses_plain.append(float(loss_plain[0]))
        losses_ov.append(float(loss_ov[0]))
        print(
            f"{i + 1:>4}  {float(loss_plain[0]):>18.6f}  {float(loss_ov[0]):>13.6f}  "
            f"{t_plain * 1e3:>15.1f} ms  {t_ov * 1e3:>10.1f} ms"
        )
    return (p_plain, p_ov), (losses_plain, losses_ov), (times_plain, times_ov)


def _write_extras(args, plain, overlapped, final, images, labels, losses, times) -> None:
    """The timeline of one step of each (--timeline) and the plot (--plot)."""
    import jax

    import jaxring
    from jaxring._src.timeline import host_span

    p_plain, p_ov = final
    if args.timeline:
        with jaxring.timeline(args.timeline):
            for name, f, p in (("pmean at end", plain, p_plain), ("overlap", overlapped, p_ov)):
                with host_span(f"step, {name}"):
                    jax.block_until_ready(f(p, images, labels))
        print(f"timeline of one step of each: {args.timeline} (open in https://ui.perfetto.dev)")
    if args.plot:
        if importlib.util.find_spec("matplotlib") is None:
            print(
                f"no plot written to {args.plot}: matplotlib is not installed "
                "(pip install matplotlib, or jaxring[demo])"
            )
        else:
            plot(
                args.plot,
                {"pmean at end": losses[0], "overlap": losses[1]},
                {"pmean at end": times[0], "overlap": times[1]},
            )
            print(f"plot of loss and step time per step: {args.plot}")


if __name__ == "__main__":
    sys.exit(main())
