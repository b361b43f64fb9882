"""What the example trainers share: the options every one of them takes,
and starting JAX and jaxring with them."""

from __future__ import annotations

import argparse

MODES = ("overlap", "allreduce", "psum")


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser described by the first paragraph of doc, with the
    options every example takes."""
    p = argparse.ArgumentParser(description=" ".join(doc.split("\n\n")[0].split()))
    p.add_argument(
        "--mode",
        choices=MODES,
        default="overlap",
        help="overlap: @jaxring.overlap; allreduce: jaxring.pmean; psum: jax.lax.pmean",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="virtual CPU devices (default 8; under python -m jaxring.launch, "
        "every process's devices)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--link", default=None, help='emulated link, e.g. "1Gbit,50us"')
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--compression",
        choices=COMPRESSIONS,
        default="none",
        help="gradient compression (jaxring.compression), which then "
        "averages the gradients itself: wire16 (bfloat16 with error "
        "feedback) or powersgd (rank --rank)",
    )
    p.add_argument("--rank", type=int, default=4, help="PowerSGD's rank")
    p.add_argument(
        "--min-size",
        type=int,
        default=None,
        help="PowerSGD's min_size: matrices of fewer elements go "
        "uncompressed (default: jaxring.compression.powersgd's)",
    )
    p.add_argument(
        "--wire-dtype",
        choices=("bfloat16", "float16"),
        default=None,
        help="float32 values travel in this format: with --compression, "
        "the transformation's (wire16's format; PowerSGD's factors "
        "and whole leaves); without, jaxring.overlap's (--mode overlap)",
    )
    p.add_argument(
        "--report",
        action="store_true",
        help="print jaxring.overlap's bucket summary when the step is traced (--mode overlap)",
    )
    p.add_argument(
        "--result",
        default=None,
        metavar="PATH",
        help="also write the run's summary (its settings, losses and final "
        "metrics) to PATH as one JSON object; under python -m "
        "jaxring.launch, {process} in PATH becomes the process index",
    )
    p.add_argument(
        "--check-update",
        action="store_true",
        help="run one step with SGD, compare its update with the one "
        "computed from the whole batch on one device, and exit "
        "(non-zero if they differ)",
    )
    return p


COMPRESSIONS = ("none", "wire16", "powersgd")


def check_update(args, step, plain_step, inputs, params=lambda state: state, rtol=1e-3) -> None:
    """Runs step (the data-parallel step; its first input and output hold
    the params, which `params` takes out) once on inputs, and plain_step
    (the same step without jaxring.overlap) on one device with the whole
    batch, where every pmean over "batch" is over one rank; prints how far
    the two updates differ and exits non-zero beyond rtol of the update's
    size. A step that reduced the gradients twice, or not at all, is off by
    a factor of the device count."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    if jax.process_count() > 1 or args.compression != "none":
        raise SystemExit(
            "--check-update runs in one process, without --compression "
            "(which approximates the full-batch update by design)"
        )
    one = Mesh(np.array(jax.devices()[:1]), ("batch",))
    whole = jax.jit(
        jax.shard_map(plain_step, mesh=one, in_specs=P(), out_specs=P(), check_vma=False)
    )
    before = jax.tree.map(np.asarray, params(inputs[0]))
    want = jax.tree.map(
        lambda new, old: np.asarray(new) - old,
        params(whole(*jax.tree.map(np.asarray, inputs))[0]),
        before,
    )
    got = jax.tree.map(lambda new, old: np.asarray(new) - old, params(step(*inputs)[0]), before)
    scale = max(float(np.max(np.abs(w))) for w in jax.tree.leaves(want))
    diff = max(
        float(np.max(np.abs(g - w))) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))
    )
    print(
        f"update check: max |update - whole-batch update| = {diff:.3g}, "
        f"max |whole-batch update| = {scale:.3g}"
    )
    if not diff <= rtol * scale:
        raise SystemExit(
            "update check failed: the step's update differs from the "
            "one computed from the whole batch on one device"
        )


def write_result(args, losses, **metrics) -> None:
    """Writes the run's summary to --result (nothing without it): the
    options that shape the curve, every step's loss, and the trainer's
    final metrics, for scripts to read instead of parsing the printed
    summary."""
    if not args.result:
        return
    import json

    import jax

    summary = {
        "mode": args.mode,
        "compression": getattr(args, "compression", "none"),
        "devices": args.devices,
        "process": jax.process_index(),
        "losses": [float(v) for v in losses],
        **metrics,
    }
    path = args.result.replace("{process}", str(jax.process_index()))
    with open(path, "w") as f:
        json.dump(summary, f)


def with_compression(args, optimizer):
    """optimizer, after the compression --compression names. With one, the
    optimizer takes each rank's local gradients and averages them itself,
    and its state holds per-rank rows (jaxring.compression.for_ranks)."""
    if args.compression == "none":
        return optimizer
    import optax

    import jaxring.compression as jc

    first = (
        jc.wire16("batch", dtype=args.wire_dtype or "bfloat16")
        if args.compression == "wire16"
        else jc.powersgd(
            "batch",
            rank=args.rank,
            wire_dtype=args.wire_dtype,
            **({} if args.min_size is None else {"min_size": args.min_size}),
        )
    )
    return optax.chain(first, optimizer)


def start(args):
    """Sets up the devices and returns the jaxring module.

    In one process, asks JAX for --devices virtual devices (before it starts
    its backend). Under ``python -m jaxring.launch`` the launcher has set up
    jax.distributed and each process's devices; the job's devices are all of
    them, and only process 0 shows a progress bar and writes the timeline.
    Every process draws the same batches from the same seed, and
    ``jax.device_put`` keeps each process's own rows."""
    import jaxring
    from jaxring.launch import launched_process_count

    processes = launched_process_count()
    if processes == 1:
        args.devices = args.devices or 8
        jaxring.use_cpu_devices(args.devices)
    import jax

    if processes > 1:
        if args.devices not in (None, jax.device_count()):
            raise SystemExit(
                f"--devices {args.devices}: the job has {jax.device_count()} "
                "devices (set them with the launcher's --devices-per-process)"
            )
        if args.link:
            raise SystemExit(
                "--link emulates the links inside one process; across "
                "processes the traffic crosses a real network"
            )
        args.devices = jax.device_count()
        if jax.process_index() > 0:
            args.quiet, args.timeline = True, None
    if args.wire_dtype and args.mode != "overlap" and args.compression == "none":
        raise SystemExit(
            "--wire-dtype without --compression is an option of "
            "jaxring.overlap: use it with --mode overlap (or with "
            "--compression wire16|powersgd in any mode)"
        )
    if args.batch % args.devices:
        raise SystemExit(f"--batch {args.batch} must be a multiple of --devices {args.devices}")
    if args.link:
        jaxring.config.update("cpu_link", args.link)
    return jaxring


def apply_gradients(state, grads, warm_up=None, **changes):
    """flax's TrainState.apply_gradients, passing warm_up (a Python bool,
    or None for none) on to a compressing optimizer: PowerSGD's warm-up
    chosen by the training loop (jaxring.compression.powersgd)."""
    import optax

    extra = {} if warm_up is None else {"warm_up": warm_up}
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params, **extra)
    return state.replace(
        step=state.step + 1,
        params=optax.apply_updates(state.params, updates),
        opt_state=opt_state,
        **changes,
    )


def optimizer_state_on(mesh, optimizer, params):
    """(the optimizer's state placed on mesh, its shard_map specs): replicated,
    but for a compressing optimizer's per-rank rows (its error feedback),
    which are split over the "batch" axis."""
    import jax
    from jax.sharding import NamedSharding

    import jaxring.compression as jc

    state = jc.for_ranks(optimizer.init(params), mesh.shape["batch"])
    specs = jc.state_specs(state, "batch")
    return jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)), specs


def overlap_wire_dtype(args):
    """jaxring.overlap's wire_dtype: --wire-dtype, unless a compression
    transformation takes it."""
    return args.wire_dtype if args.compression == "none" else None


def gradient_wire_bytes(args, params, opt_state) -> int:
    """Bytes of gradients each rank sends into the allreduces per step."""
    import jax
    import numpy as np

    import jaxring.compression as jc

    if args.compression != "none":
        return jc.report(opt_state).wire_bytes
    return sum(
        v.size * (2 if args.wire_dtype and v.dtype == np.float32 else v.dtype.itemsize)
        for v in jax.tree.leaves(params)
    )


def on_host(tree):
    """A replicated result as numpy arrays, e.g. to evaluate outside the mesh
    (in a job of several processes, jit cannot mix such arrays with local ones)."""
    import jax
    import numpy as np

    return jax.tree.map(np.asarray, tree)
