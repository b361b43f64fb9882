"""Train a flax MLP on scikit-learn's digits with a plain jax.jit step, the
gradient average overlapped by jaxring.value_and_grad.

    python examples/train_jit.py                       # 8 devices, jaxring
    python examples/train_jit.py --mode psum           # jax.value_and_grad, XLA's all-reduce
    python examples/train_jit.py --check-update        # one step against one device's

No shard_map in sight: the parameters are replicated, the batch is placed
with a NamedSharding over the "batch" axis, and the step is jitted as it
is. --mode picks the one line that differs:
  overlap  jaxring.value_and_grad (bucketed allreduces, issued during the
           backward pass)
  psum     jax.value_and_grad (XLA partitions the step and inserts its
           all-reduce of the gradients)
For one seed the two give the same loss curve, up to float rounding.
--check-update compares, before training, the first step's update with the
same step computed from the whole batch on one device, and prints both.
"""

from __future__ import annotations

import argparse
import sys
import time

import common  # examples/common.py: the run's summary as JSON (--result)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument(
        "--mode",
        choices=("overlap", "psum"),
        default="overlap",
        help="overlap: jaxring.value_and_grad; psum: jax.value_and_grad (XLA's all-reduce)",
    )
    p.add_argument("--devices", type=int, default=8, help="virtual CPU devices")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=128, help="global batch size")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=None,
        help="jaxring.overlap's bucket_mb (default: jaxring's)",
    )
    p.add_argument(
        "--wire-dtype",
        choices=("bfloat16", "float16"),
        default=None,
        help="float32 gradients travel in this format (--mode overlap)",
    )
    p.add_argument("--link", default=None, help='emulated link, e.g. "1Gbit,50us"')
    p.add_argument(
        "--check-update",
        action="store_true",
        help="print how far the first step's update is from the one "
        "computed from the whole batch on one device",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--result",
        default=None,
        metavar="PATH",
        help="also write the run's summary (losses, metrics, the update "
        "check's figures) to PATH as one JSON object",
    )
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.batch % args.devices:
        raise SystemExit(f"--batch {args.batch} must be a multiple of --devices {args.devices}")
    if args.mode != "overlap" and (args.wire_dtype or args.bucket_mb):
        raise SystemExit(
            "--wire-dtype and --bucket-mb are options of "
            "jaxring.value_and_grad: use them with --mode overlap"
        )
    import jaxring

    jaxring.use_cpu_devices(args.devices)  # before anything starts JAX's backend
    if args.link:
        jaxring.config.update("cpu_link", args.link)

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from tqdm import tqdm

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.2, random_state=args.seed, stratify=digits.target
    )

    class MLP(nn.Module):
        hidden: int

        @nn.compact
        def __call__(self, images):
            h = nn.relu(nn.Dense(self.hidden)(images))
            h = nn.relu(nn.Dense(self.hidden)(h))
            return nn.Dense(10)(h)

    model = MLP(args.hidden)
    params = model.init(jax.random.key(args.seed), x_train[:1])["params"]
    optimizer = optax.adam(args.lr)

    def loss_fn(params, images, labels):
        logits = model.apply({"params": params}, images)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, (jnp.argmax(logits, -1) == labels).mean()

    # Auto axes: XLA places the shardings inside the step, as in most jit
    # code. (Explicit axes also work with jaxring, but jax 0.11's explicit
    # sharding cannot differentiate optax's integer-label cross entropy.)
    mesh = jax.make_mesh((args.devices,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    options = {
        k: v
        for k, v in (("bucket_mb", args.bucket_mb), ("wire_dtype", args.wire_dtype))
        if v is not None
    }

    def make_step(grad_fn):
        @jax.jit
        def train_step(params, opt_state, images, labels):
            # With jaxring, the accuracy comes back one per shard; the mean
            # of those is the whole batch's, the shards being equal.
            (loss, accuracy), grads = grad_fn(params, images, labels)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state, loss, jnp.mean(accuracy))

        return train_step

    if args.mode == "overlap":
        step = make_step(
            jaxring.value_and_grad(loss_fn, mesh=mesh, axis_name="batch", has_aux=True, **options)
        )
    else:
        step = make_step(jax.value_and_grad(loss_fn, has_aux=True))

    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("batch"))
    rng = np.random.default_rng(args.seed)
    order, at = rng.permutation(len(x_train)), 0

    def next_batch():
        nonlocal order, at
        if at + args.batch > len(order):
            order, at = rng.permutation(len(x_train)), 0
        idx = order[at : at + args.batch]
        at += args.batch
        return x_train[idx], y_train[idx]

    opt_state = optimizer.init(params)
    update_check = None
    if args.check_update:
        images, labels = x_train[: args.batch], y_train[: args.batch]
        # Uncommitted arrays: the reference runs on one device.
        ref_params, ref_state, *_ = make_step(jax.value_and_grad(loss_fn, has_aux=True))(
            params, opt_state, images, labels
        )
        got_params, got_state, *_ = step(
            jax.device_put(params, replicated),
            jax.device_put(opt_state, replicated),
            jax.device_put(images, sharded),
            jax.device_put(labels, sharded),
        )

        def largest(tree):
            return max(float(np.max(np.abs(np.asarray(v)))) for v in jax.tree.leaves(tree))

        diff = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), got_params, ref_params)
        update = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), ref_params, params)
        # Adam's first update is about lr * sign(gradient) whatever the
        # gradients' scale; its first moment is the averaged gradient itself.
        mu_diff = jax.tree.map(
            lambda a, b: np.asarray(a) - np.asarray(b), got_state[0].mu, ref_state[0].mu
        )
        update_check = {
            "params_diff": largest(diff),
            "update": largest(update),
            "mu_diff": largest(mu_diff),
            "mu": largest(ref_state[0].mu),
        }
        print("update check: " + " ".join(f"{k}={v:.3e}" for k, v in update_check.items()))

    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(opt_state, replicated)
    losses, t0 = [], None
    bar = tqdm(total=args.steps, disable=args.quiet, unit="step")
    for i in range(args.steps):
        images, labels = (jax.device_put(a, sharded) for a in next_batch())
        params, opt_state, loss, acc = step(params, opt_state, images, labels)
        losses.append(float(loss))
        if t0 is None:
            t0 = time.perf_counter()  # after compiling
        rate = i * args.batch / max(time.perf_counter() - t0, 1e-9)
        bar.set_postfix(
            loss=f"{losses[-1]:.4f}", acc=f"{float(acc):.3f}", samples_per_s=f"{rate:.0f}"
        )
        bar.update()
    bar.close()

    logits = np.asarray(jax.jit(model.apply)({"params": jax.device_get(params)}, x_test))
    test_acc = float((logits.argmax(-1) == y_test).mean())
    elapsed = time.perf_counter() - t0 if t0 else 0.0
    print(
        f"mode={args.mode} devices={args.devices} steps={args.steps} "
        f"final loss={losses[-1]:.4f} test accuracy={test_acc:.4f} "
        f"time after compile={elapsed:.1f} s"
    )
    print("losses:", " ".join(f"{v:.6f}" for v in losses[:10]))
    common.write_result(
        args,
        losses,
        steps=args.steps,
        test_accuracy=test_acc,
        seconds=elapsed,
        update_check=update_check,
    )
    return test_acc


if __name__ == "__main__":
    main()
    sys.exit(0)
