"""Train an MLP classifier on scikit-learn's digits, data-parallel over
virtual CPU devices, with jaxring.

    python examples/train_mlp.py                       # overlap, 8 devices
    python examples/train_mlp.py --mode psum           # plain lax.pmean
    python examples/train_mlp.py --link 1Gbit,50us --timeline trace.json
    python examples/train_mlp.py --compression powersgd --rank 4
    python -m jaxring.launch -n 2 --devices-per-process 4 examples/train_mlp.py

--mode picks how the gradients are averaged:
  overlap    the step below, unchanged, under @jaxring.overlap
  allreduce  jaxring.pmean at the end of the step (no overlap)
  psum       jax.lax.pmean (XLA's own allreduce)
For one seed the three give the same loss curve, up to float rounding.
--compression wire16|powersgd chains jaxring.compression's transformation
before Adam: it averages the local gradients itself, in fewer bytes.
"""

from __future__ import annotations

import sys
import time

import common  # examples/common.py: the options all examples share


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch", type=int, default=128, help="global batch size")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--timeline", default=None, help="write a Perfetto trace of the last epoch")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    jaxring = common.start(args)  # before anything starts JAX's backend
    import contextlib

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from tqdm import tqdm

    # Data: 1797 8x8 images of digits, bundled with scikit-learn.
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.2, random_state=args.seed, stratify=digits.target
    )

    rng = np.random.default_rng(args.seed)

    def dense(n_in, n_out):
        return {
            "w": jnp.asarray(rng.normal(0, (2 / n_in) ** 0.5, (n_in, n_out)), jnp.float32),
            "b": jnp.zeros((n_out,), jnp.float32),
        }

    params = {
        "hidden1": dense(64, args.hidden),
        "hidden2": dense(args.hidden, args.hidden),
        "out": dense(args.hidden, 10),
    }

    def model(p, images):
        h = jax.nn.relu(images @ p["hidden1"]["w"] + p["hidden1"]["b"])
        h = jax.nn.relu(h @ p["hidden2"]["w"] + p["hidden2"]["b"])
        return h @ p["out"]["w"] + p["out"]["b"]

    # SGD for the check: Adam's update hardly changes with the gradient's scale.
    optimizer = common.with_compression(
        args, optax.sgd(args.lr) if args.check_update else optax.adam(args.lr)
    )
    mean = {"overlap": jax.lax.pmean, "psum": jax.lax.pmean, "allreduce": jaxring.pmean}[args.mode]

    def train_step(params, opt_state, images, labels):
        def loss_fn(p):
            logits = model(p, images)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, (jnp.argmax(logits, -1) == labels).mean()

        (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        if args.compression == "none":
            grads = mean(grads, "batch")  # else the optimizer averages them
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (
            optax.apply_updates(params, updates),
            opt_state,
            mean(loss, "batch"),
            mean(accuracy, "batch"),
        )

    plain_step = train_step
    if args.mode == "overlap":
        train_step = jaxring.overlap(
            train_step,
            axis_name="batch",
            report=args.report,
            wire_dtype=common.overlap_wire_dtype(args),
        )

    mesh = jax.make_mesh((args.devices,), ("batch",))
    opt_state, opt_specs = common.optimizer_state_on(mesh, optimizer, params)
    step = jax.jit(
        jax.shard_map(
            train_step,
            mesh=mesh,
            in_specs=(P(), opt_specs, P("batch"), P("batch")),
            out_specs=(P(), opt_specs, P(), P()),
            check_vma=False,
        )
    )
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("batch"))
    params = jax.device_put(params, replicated)

    if args.check_update:
        idx = rng.permutation(len(x_train))[: args.batch]
        common.check_update(
            args,
            step,
            plain_step,
            (
                params,
                opt_state,
                jax.device_put(x_train[idx], sharded),
                jax.device_put(y_train[idx], sharded),
            ),
        )
        return

    steps_per_epoch = len(x_train) // args.batch
    total = args.epochs * steps_per_epoch
    if args.max_steps is not None:
        total = min(total, args.max_steps)
    losses, n_done, t0 = [], 0, None
    bar = tqdm(total=total, disable=args.quiet, unit="step")
    for epoch in range(args.epochs):
        last = epoch == args.epochs - 1 or n_done + steps_per_epoch >= total
        trace = (
            jaxring.timeline(args.timeline) if args.timeline and last else contextlib.nullcontext()
        )
        order = rng.permutation(len(x_train))
        with trace:
            for i in range(steps_per_epoch):
                if n_done == total:
                    break
                idx = order[i * args.batch : (i + 1) * args.batch]
                images = jax.device_put(x_train[idx], sharded)
                labels = jax.device_put(y_train[idx], sharded)
                params, opt_state, loss, acc = step(params, opt_state, images, labels)
                loss = float(loss)
                losses.append(loss)
                n_done += 1
                if t0 is None:
                    t0 = time.perf_counter()  # after compiling
                    first = n_done
                rate = (n_done - first) * args.batch / max(time.perf_counter() - t0, 1e-9)
                bar.set_postfix(
                    epoch=epoch + 1,
                    loss=f"{loss:.4f}",
                    acc=f"{float(acc):.3f}",
                    samples_per_s=f"{rate:.0f}",
                )
                bar.update()
        if n_done == total:
            break
    bar.close()

    predict = jax.jit(model)
    logits = np.asarray(predict(common.on_host(params), x_test))
    test_acc = float((logits.argmax(-1) == y_test).mean())
    elapsed = time.perf_counter() - t0 if t0 else 0.0
    print(
        f"mode={args.mode} compression={args.compression} devices={args.devices} steps={n_done} "
        f"final loss={losses[-1]:.4f} test accuracy={test_acc:.4f} "
        f"time after compile={elapsed:.1f} s"
    )
    print("losses:", " ".join(f"{v:.6f}" for v in losses[:10]))
    common.write_result(args, losses, steps=n_done, test_accuracy=test_acc, seconds=elapsed)
    if args.timeline:
        print(f"timeline of the last epoch: {args.timeline}")
    return test_acc


if __name__ == "__main__":
    main()
    sys.exit(0)
