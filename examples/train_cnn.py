"""Train a small ResNet (flax, with BatchNorm) on scikit-learn's digits,
upsampled to 16x16, under jax.pmap, flax-examples style, with jaxring.

    python examples/train_cnn.py                       # overlap, 8 devices
    python examples/train_cnn.py --mode psum           # plain lax.pmean
    python examples/train_cnn.py --link 1Gbit,50us --timeline trace.json
    python examples/train_cnn.py --compression powersgd --rank 2
    python examples/train_cnn.py --compression powersgd --warm-up-steps 50
    python examples/train_cnn.py --batch-norm local     # per-device statistics
    python -m jaxring.launch -n 2 --devices-per-process 4 examples/train_cnn.py

The train step is the usual flax one: gradients and BatchNorm statistics are
averaged with ``lax.pmean`` over the ``batch`` axis (--batch-norm local
keeps each device's BatchNorm statistics to itself, as PyTorch's
BatchNorm does under DDP: then only the gradients and the logged loss
cross devices). --mode picks how:
  overlap    the step, unchanged, under @jaxring.overlap
  allreduce  jaxring.pmean in place of lax.pmean (no overlap)
  psum       jax.lax.pmean (XLA's own allreduce)
flax's BatchNorm averages its batch statistics with lax.pmean itself: under
overlap those are rewritten too (each gets a bucket done before its use);
under allreduce they stay lax.pmean. For one seed the three modes give the
same loss curve, up to float rounding. --compression wire16|powersgd chains
jaxring.compression's transformation before SGD: it averages the local
gradients itself, in fewer bytes. The train state is replicated per device,
flax-style, so each device keeps its own error feedback. With
--warm-up-steps K, PowerSGD's first K steps average uncompressed: the loop
switches between two compiled steps (powersgd's warm_up argument), each
with one path, so overlap holds through the warm-up too.
"""

from __future__ import annotations

import sys
import time

import common  # examples/common.py: the options all examples share


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch", type=int, default=128, help="global batch size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--timeline", default=None, help="write a Perfetto trace of the last epoch")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="print the test accuracy every this many steps (its time "
        "left out of the training time)",
    )
    p.add_argument(
        "--target-accuracy",
        type=float,
        default=None,
        help="with --eval-every: stop once the test accuracy reaches this",
    )
    p.add_argument(
        "--batch-norm",
        choices=("sync", "local"),
        default="sync",
        help="sync: BatchNorm's statistics averaged over the devices "
        "(flax's examples); local: each device's own",
    )
    p.add_argument(
        "--warm-up-steps",
        type=int,
        default=0,
        help="with --compression powersgd: steps averaged uncompressed first",
    )
    args = p.parse_args(argv)
    if args.warm_up_steps and args.compression != "powersgd":
        p.error("--warm-up-steps is PowerSGD's warm-up: use it with --compression powersgd")
    if args.warm_up_steps < 0:
        p.error("--warm-up-steps must be at least 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    jaxring = common.start(args)  # before anything starts JAX's backend
    import contextlib
    import functools

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax.training import train_state
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from tqdm import tqdm

    n = args.devices

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)
    images = images.repeat(2, axis=1).repeat(2, axis=2)[..., None]  # 16x16x1
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=0.2, random_state=args.seed, stratify=digits.target
    )

    class Block(nn.Module):
        features: int
        stride: int

        @nn.compact
        def __call__(self, x, train):
            synced = train and args.batch_norm == "sync"
            norm = functools.partial(
                nn.BatchNorm,
                use_running_average=not train,
                momentum=0.9,
                axis_name="batch" if synced else None,
            )
            y = nn.Conv(self.features, (3, 3), self.stride, use_bias=False)(x)
            y = nn.relu(norm()(y))
            y = norm()(nn.Conv(self.features, (3, 3), use_bias=False)(y))
            if x.shape != y.shape:
                x = norm()(nn.Conv(self.features, (1, 1), self.stride, use_bias=False)(x))
            return nn.relu(x + y)

    class ResNet(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            x = nn.Conv(16, (3, 3))(x)
            for features, stride in ((16, 1), (32, 2), (64, 2)):
                x = Block(features, stride)(x, train)
            return nn.Dense(10)(x.mean(axis=(1, 2)))

    class State(train_state.TrainState):
        batch_stats: dict

    model = ResNet()
    tx = common.with_compression(args, optax.sgd(args.lr, momentum=0.9))

    # Compiled as one program: run op by op, flax's initializers and the
    # optimizer's compile about a hundred small programs, 10 s of start-up
    # on 2 cores.
    @jax.jit
    def new_state(key):
        variables = model.init(key, jnp.ones((1, 16, 16, 1)), train=False)
        return State.create(
            apply_fn=model.apply,
            params=variables["params"],
            batch_stats=variables["batch_stats"],
            tx=tx,
        )

    state = new_state(jax.random.key(args.seed))

    mean = {"overlap": jax.lax.pmean, "psum": jax.lax.pmean, "allreduce": jaxring.pmean}[args.mode]

    def train_step(state, images, labels, warm_up=None):
        def loss_fn(params):
            logits, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats},
                images,
                train=True,
                mutable=["batch_stats"],
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, (updates, (jnp.argmax(logits, -1) == labels).mean())

        (loss, (updates, accuracy)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        if args.compression == "none":
            grads = mean(grads, "batch")  # else the optimizer averages them
        state = common.apply_gradients(state, grads, warm_up, batch_stats=updates["batch_stats"])
        return state, mean(loss, "batch"), mean(accuracy, "batch")

    def compiled_step(warm_up):
        f = functools.partial(train_step, warm_up=warm_up)
        if args.mode == "overlap":
            f = jaxring.overlap(
                f, axis_name="batch", report=args.report, wire_dtype=common.overlap_wire_dtype(args)
            )
        return jax.pmap(f, axis_name="batch")

    # One compiled step per phase: during the warm-up, uncompressed.
    steps = (
        {w: compiled_step(w) for w in (True, False)}
        if args.warm_up_steps
        else {False: compiled_step(None)}
    )
    wire_bytes = common.gradient_wire_bytes(args, state.params, state.opt_state)
    # One copy of the state per local device (flax's replicate).
    local = jax.local_device_count()
    state = jax.tree.map(lambda v: np.stack([np.asarray(v)] * local), state)

    @jax.jit
    def predict(state, x):
        return state.apply_fn(
            {"params": state.params, "batch_stats": state.batch_stats}, x, train=False
        )

    def test_accuracy(state):
        # Device 0's parameters and running statistics (with --batch-norm
        # local each device has its own statistics; the parameters agree).
        # np.asarray first: indexing a jax array compiles a program per shape.
        logits = np.asarray(predict(jax.tree.map(lambda v: np.asarray(v)[0], state), x_test))
        return float((logits.argmax(-1) == y_test).mean())

    rng = np.random.default_rng(args.seed)
    mine = slice(
        jax.process_index() * jax.local_device_count(),
        (jax.process_index() + 1) * jax.local_device_count(),
    )
    if args.warm_up_steps:
        # Compile the compressed step now, on throwaway steps (twice: pmap
        # compiles for the state as given, then as it returns it), so that
        # the switch does not stall the timed run.
        xb = x_train[: args.batch].reshape(n, -1, 16, 16, 1)[mine]
        yb = y_train[: args.batch].reshape(n, -1)[mine]
        jax.block_until_ready(steps[False](steps[False](state, xb, yb)[0], xb, yb))
    if args.check_update:
        if args.batch_norm == "local":
            raise SystemExit(
                "--check-update: with --batch-norm local each device "
                "normalizes by its own statistics, not the whole batch's"
            )
        idx = rng.permutation(len(x_train))[: args.batch]

        def data_parallel(one_state, x, y):
            copies = jax.tree.map(lambda v: np.stack([np.asarray(v)] * local), one_state)
            out = steps[False](copies, x.reshape(n, -1, 16, 16, 1), y.reshape(n, -1))
            return jax.tree.map(lambda v: np.asarray(v)[0], out)

        common.check_update(
            args,
            data_parallel,
            functools.partial(train_step, warm_up=None),
            (
                jax.tree.map(lambda v: np.asarray(v)[0], state),
                x_train[idx].reshape(-1, 16, 16, 1),
                y_train[idx],
            ),
            params=lambda s: s.params,
        )
        return
    steps_per_epoch = len(x_train) // args.batch
    total = args.epochs * steps_per_epoch
    if args.max_steps is not None:
        total = min(total, args.max_steps)
    losses, n_done, t0, first, left_out, reached = [], 0, None, 0, 0.0, False
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
                # pmap takes this process's devices' rows (all of them in one process).
                xb = x_train[idx].reshape(n, -1, 16, 16, 1)[mine]
                yb = y_train[idx].reshape(n, -1)[mine]
                step = steps[bool(args.warm_up_steps) and n_done < args.warm_up_steps]
                state, loss, acc = step(state, xb, yb)
                loss = float(loss[0])
                losses.append(loss)
                n_done += 1
                if t0 is None and n_done == min(2, total):
                    # pmap compiles the step twice: for the state as given,
                    # then as it returns it.
                    t0, first = time.perf_counter(), n_done
                rate = (
                    0.0
                    if t0 is None
                    else (n_done - first) * args.batch / max(time.perf_counter() - t0, 1e-9)
                )
                bar.set_postfix(
                    epoch=epoch + 1,
                    loss=f"{loss:.4f}",
                    acc=f"{float(acc[0]):.3f}",
                    samples_per_s=f"{rate:.0f}",
                )
                bar.update()
                if args.eval_every and n_done % args.eval_every == 0:
                    paused = time.perf_counter()
                    t0 = paused if t0 is None else t0
                    accuracy = test_accuracy(state)
                    print(
                        f"eval step={n_done} "
                        f"seconds={paused - t0 - left_out:.3f} accuracy={accuracy:.4f}",
                        flush=True,
                    )
                    left_out += time.perf_counter() - paused
                    if args.target_accuracy is not None and accuracy >= args.target_accuracy:
                        reached = True
                        break
        if n_done == total or reached:
            break
    bar.close()

    elapsed = time.perf_counter() - t0 - left_out if t0 else 0.0
    test_acc = test_accuracy(state)
    print(
        f"mode={args.mode} compression={args.compression} batch-norm={args.batch_norm} "
        f"devices={n} steps={n_done} "
        f"final loss={losses[-1]:.4f} test accuracy={test_acc:.4f} "
        f"bytes/step={wire_bytes} time after compile={elapsed:.1f} s"
    )
    print("losses:", " ".join(f"{v:.6f}" for v in losses[:10]))
    common.write_result(
        args,
        losses,
        batch_norm=args.batch_norm,
        steps=n_done,
        test_accuracy=test_acc,
        bytes_per_step=wire_bytes,
        seconds=elapsed,
    )
    if args.timeline:
        print(f"timeline of the last epoch: {args.timeline}")
    return test_acc


if __name__ == "__main__":
    main()
    sys.exit(0)
