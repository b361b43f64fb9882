"""Train a small character-level transformer on the Python standard library's
own source files (present wherever Python is), data-parallel under
jax.shard_map, with jaxring.

    python examples/train_lm.py                        # overlap, 8 devices
    python examples/train_lm.py --mode psum            # plain lax.pmean
    python examples/train_lm.py --link 1Gbit,50us --timeline trace.json
    python examples/train_lm.py --compression powersgd --rank 4
    python examples/train_lm.py --eval-every 20 --target-loss 2.0
    python -m jaxring.launch -n 2 --devices-per-process 4 examples/train_lm.py

--mode picks how the gradients are averaged:
  overlap    the step, unchanged, under @jaxring.overlap
  allreduce  jaxring.pmean at the end of the step (no overlap)
  psum       jax.lax.pmean (XLA's own allreduce)
For one seed the three give the same loss curve, up to float rounding.
--compression wire16|powersgd chains jaxring.compression's transformation
before AdamW: it averages the local gradients itself, in fewer bytes.
"""

from __future__ import annotations

import pathlib
import sys
import sysconfig
import time

import common  # examples/common.py: the options all examples share


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=64, help="global batch of sequences")
    p.add_argument("--context", type=int, default=64, help="characters per sequence")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--corpus-mb", type=float, default=2.0, help="MB of standard-library source to read"
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="print the validation loss every this many steps (0: at the end only)",
    )
    p.add_argument(
        "--target-loss",
        type=float,
        default=None,
        help="with --eval-every: stop once the validation loss is this low",
    )
    p.add_argument("--timeline", default=None, help="write a Perfetto trace of the last 10 steps")
    return p.parse_args(argv)


def read_corpus(limit_bytes: int) -> bytes:
    """The standard library's .py files, in a fixed order, up to limit_bytes."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    out, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        out.append(data)
        size += len(data)
        if size >= limit_bytes:
            break
    return b"".join(out)[:limit_bytes]


def main(argv=None):
    args = parse_args(argv)
    jaxring = common.start(args)  # before anything starts JAX's backend
    import contextlib

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from tqdm import tqdm

    n = args.devices
    if args.width % args.heads:
        raise SystemExit("--width must be a multiple of --heads")

    text = np.frombuffer(read_corpus(int(args.corpus_mb * 1e6)), np.uint8)
    split = int(0.95 * len(text))
    train_text, valid_text = text[:split], text[split:]
    vocab = 256

    rng = np.random.default_rng(args.seed)
    # The validation batch is drawn once, from a generator of its own, so
    # that evaluating does not change the training batches.
    valid_rng = np.random.default_rng(args.seed + 1)

    def init(shape, scale):
        return jnp.asarray(rng.normal(0, scale, shape), jnp.float32)

    w, c = args.width, args.context
    params = {
        "embed": init((vocab, w), 0.02),
        "pos": init((c, w), 0.02),
        "out": init((w, vocab), w**-0.5),
    }
    for i in range(args.layers):
        params[f"block{i}"] = {
            "qkv": init((w, 3 * w), w**-0.5),
            "proj": init((w, w), w**-0.5),
            "up": init((w, 4 * w), w**-0.5),
            "down": init((4 * w, w), (4 * w) ** -0.5),
        }

    def norm(h):
        return (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)

    def model(p, tokens):
        b, t = tokens.shape
        h = p["embed"][tokens] + p["pos"][:t]
        mask = jnp.tril(jnp.ones((t, t), bool))
        for i in range(args.layers):
            with jax.named_scope(f"block{i}"):
                q, k, v = jnp.split(norm(h) @ p[f"block{i}"]["qkv"], 3, axis=-1)
                heads = lambda x: x.reshape(b, t, args.heads, -1).transpose(0, 2, 1, 3)
                q, k, v = heads(q), heads(k), heads(v)
                att = jnp.where(mask, q @ k.transpose(0, 1, 3, 2) / (q.shape[-1] ** 0.5), -1e9)
                y = (jax.nn.softmax(att, -1) @ v).transpose(0, 2, 1, 3).reshape(b, t, w)
                h = h + y @ p[f"block{i}"]["proj"]
                h = h + jax.nn.gelu(norm(h) @ p[f"block{i}"]["up"]) @ p[f"block{i}"]["down"]
        return norm(h) @ p["out"]

    def loss_of(p, seqs):
        logits = model(p, seqs[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, seqs[:, 1:]).mean()

    # SGD for --check-update: Adam's update hardly changes with the
    # gradient's scale.
    optimizer = common.with_compression(
        args, optax.sgd(args.lr) if args.check_update else optax.adamw(args.lr, weight_decay=0.01)
    )
    mean = {"overlap": jax.lax.pmean, "psum": jax.lax.pmean, "allreduce": jaxring.pmean}[args.mode]

    def train_step(params, opt_state, seqs):
        loss, grads = jax.value_and_grad(loss_of)(params, seqs)
        if args.compression == "none":
            grads = mean(grads, "batch")  # else the optimizer averages them
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, mean(loss, "batch")

    plain_step = train_step
    if args.mode == "overlap":
        train_step = jaxring.overlap(
            train_step,
            axis_name="batch",
            report=args.report,
            wire_dtype=common.overlap_wire_dtype(args),
        )

    mesh = jax.make_mesh((n,), ("batch",))
    opt_state, opt_specs = common.optimizer_state_on(mesh, optimizer, params)
    step = jax.jit(
        jax.shard_map(
            train_step,
            mesh=mesh,
            in_specs=(P(), opt_specs, P("batch")),
            out_specs=(P(), opt_specs, P()),
            check_vma=False,
        )
    )
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("batch"))
    params = jax.device_put(params, replicated)

    def sample(source, count, gen=rng):
        starts = gen.integers(0, len(source) - c - 1, count)
        return np.stack([source[s : s + c + 1] for s in starts]).astype(np.int32)

    if args.check_update:
        common.check_update(
            args,
            step,
            plain_step,
            (params, opt_state, jax.device_put(sample(train_text, args.batch), sharded)),
        )
        return

    valid_batch = sample(valid_text, 256, valid_rng)
    valid_loss = jax.jit(loss_of)
    wire_bytes = common.gradient_wire_bytes(args, params, opt_state)

    def validation_loss() -> float:
        return float(valid_loss(common.on_host(params), valid_batch))

    losses, t0, first, left_out, steps_done = [], None, 0, 0.0, 0
    # The timeline spans the last 10 steps (after the compiling one): it
    # opens before step `trace_from` and closes when the loop ends.
    trace_from = max(1, args.steps - 10) if args.timeline else None
    bar = tqdm(total=args.steps, disable=args.quiet, unit="step")
    with contextlib.ExitStack() as tracing:  # closed however the loop ends
        for i in range(args.steps):
            if i == trace_from:
                tracing.enter_context(jaxring.timeline(args.timeline))
            seqs = jax.device_put(sample(train_text, args.batch), sharded)
            params, opt_state, loss = step(params, opt_state, seqs)
            loss = float(loss)
            losses.append(loss)
            steps_done = i + 1
            if t0 is None:
                t0, first = time.perf_counter(), i + 1  # after compiling
            rate = (i + 1 - first) * args.batch * c / max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix(loss=f"{loss:.4f}", chars_per_s=f"{rate:.0f}")
            bar.update()
            if args.eval_every and steps_done % args.eval_every == 0:
                # Evaluation time is left out of the training time.
                paused = time.perf_counter()
                value = validation_loss()
                print(
                    f"eval step={steps_done} seconds={paused - t0 - left_out:.3f} loss={value:.4f}",
                    flush=True,
                )
                left_out += time.perf_counter() - paused
                if args.target_loss is not None and value <= args.target_loss:
                    break
    bar.close()

    elapsed = time.perf_counter() - t0 - left_out if t0 else 0.0
    valid = validation_loss()
    print(
        f"mode={args.mode} compression={args.compression} devices={n} "
        f"steps={steps_done} final loss={losses[-1]:.4f} "
        f"validation loss={valid:.4f} bits/char={valid / np.log(2):.3f} "
        f"bytes/step={wire_bytes} time after compile={elapsed:.1f} s"
    )
    print("losses:", " ".join(f"{v:.6f}" for v in losses[:10]))
    traced = bool(args.timeline) and steps_done > trace_from
    common.write_result(
        args,
        losses,
        steps=steps_done,
        validation_loss=valid,
        bits_per_char=valid / np.log(2),
        bytes_per_step=wire_bytes,
        seconds=elapsed,
        timeline_steps=[trace_from + 1, steps_done] if traced else None,
    )
    if traced:
        print(f"timeline of steps {trace_from + 1} to {steps_done}: {args.timeline}")
    elif args.timeline:
        print(
            f"no timeline: the run ended at step {steps_done}, before step "
            f"{trace_from + 1} where the trace would start"
        )
    return valid


if __name__ == "__main__":
    main()
    sys.exit(0)
