"""Real training steps, timed as written, under jaxring.overlap, and with
jaxring.pmean.

Two models, written in flax.linen:

* resnet18: ResNet-18 as flax's ImageNet example defines it (stage widths
  64-128-256-512, BasicBlock x [2, 2, 2, 2], 7x7 stem stride 2 and 3x3 max
  pool, synchronized BatchNorm over "batch" with momentum 0.9 and epsilon
  1e-5, 1000 classes), trained with that example's train_step: a flax
  TrainState with batch_stats, SGD with Nesterov momentum 0.9, softmax
  cross-entropy plus its L2 penalty, ``lax.pmean`` of the gradients and of
  the metrics, under ``jax.pmap(axis_name="batch")``;
* transformer: the pre-norm character transformer of examples/train_lm.py
  (width 128, 2 blocks, 4 heads, context 64, AdamW) under
  ``jax.shard_map(check_vma=False)`` with ``pmean`` of the local gradients.

Variants, timed side by side (each round runs every variant for --steps
steps, dispatched back to back; medians over --rounds rounds):

  plain          the step as written (lax.pmean: XLA's all-reduce)
  overlap        the same step under @jaxring.overlap(axis_name="batch")
  jaxring-pmean  every lax.pmean replaced by jaxring.pmean, no overlap
  overlap-nogang overlap with jaxring.config cpu_gang_start off
  jaxring-bn     only BatchNorm's statistics through jaxring.pmean (resnet18)
  jaxring-grads  only the gradients through jaxring.pmean
  jaxring-per-leaf  jaxring.pmean everywhere, one call per gradient leaf
                 (jaxring.pmean of the whole tree fuses its leaves under
                 1 MiB into one buffer)
  compute        no gradient reduction (metrics and BatchNorm as written)
  comm           the gradients' jaxring.pmean alone

The variants that reduce the gradients start from the same state and run
the same steps; their parameters must agree, after the first step and at
the end, or the run prints FAILED and exits with 1.

Before timing, the script counts the step's reductions by kind (BatchNorm
statistics, their sums in the backward pass, gradients, metrics) and how
jaxring.overlap buckets them, and prints the temporary buffer XLA allocates
per device for each variant. Beside each variant's time the table gives the
process's CPU time per step (user, system) and its minor page faults: on
CPU a step whose temporary buffer exceeds glibc's mmap threshold (32 MiB at
most) maps it afresh every run, and its pages fault and are zeroed every
step (see docs/benchmarking.md, "Keeping freed memory").

Under --link (jaxring's emulated link) lax.pmean is not emulated, so plain
is no reference there: compare overlap with jaxring-pmean and with
max(compute, comm), no schedule beating the latter (as
benchmarks/overlap_cnn.py does).

    python benchmarks/real_step.py                        # resnet18, 8 devices
    python benchmarks/real_step.py --model transformer
    python benchmarks/real_step.py --link 300Mbit,50us
    python benchmarks/real_step.py \\
        --variants plain,overlap,overlap-nogang,jaxring-bn,jaxring-grads,jaxring-per-leaf
    python benchmarks/real_step.py --partition-mb 64 --report
    JAXRING_CPU_THREADS=8 python benchmarks/real_step.py
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import sys
import time

DEFAULT_VARIANTS = ("plain", "overlap", "jaxring-pmean")
LINK_VARIANTS = DEFAULT_VARIANTS + ("compute", "comm")
ALL_VARIANTS = (
    "plain",
    "overlap",
    "jaxring-pmean",
    "overlap-nogang",
    "jaxring-bn",
    "jaxring-grads",
    "jaxring-per-leaf",
    "compute",
    "comm",
)
# Variants whose parameters must match plain's after the timed steps.
REDUCING = {
    "plain",
    "overlap",
    "jaxring-pmean",
    "overlap-nogang",
    "jaxring-bn",
    "jaxring-grads",
    "jaxring-per-leaf",
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("resnet18", "transformer", "both"), default="resnet18")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument(
        "--per-device",
        type=int,
        default=None,
        help="examples per device (default: 4 images for resnet18, "
        "8 sequences for the transformer)",
    )
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds before the timed ones")
    p.add_argument(
        "--wait-each-step",
        action="store_true",
        help="wait for every step before dispatching the next (default: "
        "back to back, as a training loop runs)",
    )
    p.add_argument(
        "--variants",
        default=None,
        help=f"comma-separated, from {', '.join(ALL_VARIANTS)} (default: "
        f"{','.join(DEFAULT_VARIANTS)}; with --link also compute,comm)",
    )
    p.add_argument(
        "--link",
        default=None,
        help='emulated link of jaxring\'s in-process transport, e.g. "300Mbit,50us"',
    )
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=None,
        help="jaxring.overlap's bucket_mb (default: jaxring's)",
    )
    p.add_argument(
        "--partition-mb",
        type=float,
        default=None,
        help="jaxring.overlap's partition_mb (default: jaxring's)",
    )
    p.add_argument(
        "--report", action="store_true", help="also print jaxring.overlap's report of every bucket"
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=1e-2,
        help="largest accepted max |params - plain's params| after one "
        "step, relative to the largest change plain's step made "
        "(a ring's rounding reaches 1e-3 under AdamW; a gradient "
        "reduced twice or not at all is off by about 1 under SGD)",
    )
    p.add_argument(
        "--drift-tolerance",
        type=float,
        default=5e-2,
        help="the same after all the steps: float rounding (a ring sums "
        "in another order than XLA) grows from step to step",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write each model's figures (census, ms/step, agreement) to PATH",
    )
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--rounds and --steps must be at least 1, --warmup at least 0")
    names = (
        args.variants.split(",")
        if args.variants
        else LINK_VARIANTS
        if args.link
        else DEFAULT_VARIANTS
    )
    names = [v.strip() for v in names if v.strip()]
    bad = [v for v in names if v not in ALL_VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {bad}; choose from {list(ALL_VARIANTS)}")
    args.variants = names
    return args


# ---- models -----------------------------------------------------------------


def build_models():
    """The flax modules; defined once flax may be imported (after the device
    count is set)."""
    from collections.abc import Callable, Sequence

    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class SyncBatchNorm(nn.Module):
        """BatchNorm whose statistics are averaged over `axis_name` by
        `reduce` (lax.pmean in the ImageNet example), so the same module can
        send them through jaxring instead."""

        reduce: Callable = jax.lax.pmean
        axis_name: str = "batch"
        momentum: float = 0.9
        epsilon: float = 1e-5
        scale_init: Callable = nn.initializers.ones
        use_running_average: bool = False

        @nn.compact
        def __call__(self, x):
            features = x.shape[-1]
            ra_mean = self.variable("batch_stats", "mean", jnp.zeros, (features,), jnp.float32)
            ra_var = self.variable("batch_stats", "var", jnp.ones, (features,), jnp.float32)
            scale = self.param("scale", self.scale_init, (features,), jnp.float32)
            bias = self.param("bias", nn.initializers.zeros, (features,), jnp.float32)
            if self.use_running_average:
                mean, var = ra_mean.value, ra_var.value
            else:
                axes = tuple(range(x.ndim - 1))
                # Both moments in one reduction, as flax's BatchNorm sends
                # them: one latency per layer instead of two.
                moments = jnp.concatenate([jnp.mean(x, axes), jnp.mean(x * x, axes)])
                if not self.is_initializing():  # init runs outside the map
                    moments = self.reduce(moments, self.axis_name)
                mean, mean_sq = jnp.split(moments, 2)
                var = jnp.maximum(0.0, mean_sq - mean * mean)
                if not self.is_initializing():
                    m = self.momentum
                    ra_mean.value = m * ra_mean.value + (1 - m) * mean
                    ra_var.value = m * ra_var.value + (1 - m) * var
            mul = jax.lax.rsqrt(var + self.epsilon) * scale
            return (x - mean) * mul + bias

    class BasicBlock(nn.Module):
        filters: int
        strides: tuple
        norm: Callable

        @nn.compact
        def __call__(self, x):
            conv = functools.partial(nn.Conv, use_bias=False)
            y = conv(self.filters, (3, 3), self.strides)(x)
            y = nn.relu(self.norm()(y))
            y = conv(self.filters, (3, 3))(y)
            # The last norm of a block starts at zero, so each block starts
            # as the identity (as in the ImageNet example).
            y = self.norm(scale_init=nn.initializers.zeros)(y)
            if x.shape != y.shape:
                x = conv(self.filters, (1, 1), self.strides, name="conv_proj")(x)
                x = self.norm(name="norm_proj")(x)
            return nn.relu(x + y)

    class ResNet(nn.Module):
        stage_sizes: Sequence[int] = (2, 2, 2, 2)
        num_filters: int = 64
        num_classes: int = 1000
        bn_reduce: Callable = jax.lax.pmean

        @nn.compact
        def __call__(self, x, train: bool = True):
            norm = functools.partial(
                SyncBatchNorm, reduce=self.bn_reduce, use_running_average=not train
            )
            x = nn.Conv(
                self.num_filters,
                (7, 7),
                (2, 2),
                padding=[(3, 3), (3, 3)],
                use_bias=False,
                name="conv_init",
            )(x)
            x = nn.relu(norm(name="bn_init")(x))
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
            for i, blocks in enumerate(self.stage_sizes):
                for j in range(blocks):
                    strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                    x = BasicBlock(self.num_filters * 2**i, strides, norm)(x)
            x = jnp.mean(x, axis=(1, 2))
            return nn.Dense(self.num_classes)(x)

    class TransformerBlock(nn.Module):
        heads: int

        @nn.compact
        def __call__(self, h, mask):
            width = h.shape[-1]
            # train_lm.py's norm: no scale, no bias.
            norm = functools.partial(nn.LayerNorm, epsilon=1e-5, use_bias=False, use_scale=False)
            h = h + nn.MultiHeadDotProductAttention(num_heads=self.heads, use_bias=False)(
                norm()(h), mask=mask
            )
            y = nn.gelu(nn.Dense(4 * width, use_bias=False)(norm()(h)))
            return h + nn.Dense(width, use_bias=False)(y)

    class Transformer(nn.Module):
        vocab: int = 256
        width: int = 128
        layers: int = 2
        heads: int = 4
        context: int = 64

        @nn.compact
        def __call__(self, tokens):
            t = tokens.shape[1]
            h = nn.Embed(self.vocab, self.width, embedding_init=nn.initializers.normal(0.02))(
                tokens
            )
            pos = self.param("pos", nn.initializers.normal(0.02), (self.context, self.width))
            h = h + pos[:t]
            mask = nn.make_causal_mask(tokens)
            for _ in range(self.layers):
                h = TransformerBlock(self.heads)(h, mask)
            h = nn.LayerNorm(epsilon=1e-5, use_bias=False, use_scale=False)(h)
            return nn.Dense(self.vocab, use_bias=False)(h)

    return ResNet, Transformer


# ---- the two workloads ------------------------------------------------------
#
# Each returns a Workload: the initial state (as the mapped step takes it),
# the batch, a builder make(bn, grads, metrics) of the unmapped step from the
# reductions it uses (None: no reduction), how to map a step, and how to
# read the parameters (device 0's copy) from a state.


class Workload:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def resnet18_workload(args, jaxring):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax.training import train_state

    ResNet, _ = build_models()
    n = args.devices
    per = args.per_device or 4
    size = args.image_size
    rng = np.random.default_rng(args.seed)
    images = rng.normal(size=(n, per, size, size, 3)).astype(np.float32)
    labels = rng.integers(0, 1000, (n, per)).astype(np.int32)

    class TrainState(train_state.TrainState):
        batch_stats: dict

    init_model = ResNet()
    variables = jax.jit(init_model.init)(
        jax.random.PRNGKey(args.seed), jnp.zeros((1, size, size, 3), jnp.float32)
    )
    # The ImageNet example's learning-rate scaling, without its schedule.
    lr = 0.1 * n * per / 256
    state = TrainState.create(
        apply_fn=init_model.apply,
        params=variables["params"],
        tx=optax.sgd(lr, momentum=0.9, nesterov=True),
        batch_stats=variables["batch_stats"],
    )

    def make(bn, grads_mean, metrics_mean):
        model = ResNet(bn_reduce=bn)

        def train_step(state, batch):
            images, labels = batch

            def loss_fn(params):
                logits, new_model_state = model.apply(
                    {"params": params, "batch_stats": state.batch_stats},
                    images,
                    mutable=["batch_stats"],
                )
                one_hot = jax.nn.one_hot(labels, 1000)
                loss = jnp.mean(optax.softmax_cross_entropy(logits, one_hot))
                l2 = sum(jnp.sum(w**2) for w in jax.tree.leaves(params) if w.ndim > 1)
                return loss + 0.0001 * 0.5 * l2, (new_model_state, logits)

            (_, (new_model_state, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                state.params
            )
            if grads_mean is not None:
                grads = grads_mean(grads, "batch")
            one_hot = jax.nn.one_hot(labels, 1000)
            metrics = {
                "loss": jnp.mean(optax.softmax_cross_entropy(logits, one_hot)),
                "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels),
            }
            metrics = metrics_mean(metrics, "batch")
            new_state = state.apply_gradients(
                grads=grads, batch_stats=new_model_state["batch_stats"]
            )
            return new_state, metrics

        return train_step

    def mapped(fn):
        return jax.pmap(fn, axis_name="batch")

    # pmap takes a leading device axis: the state is stacked n times, the
    # batch split; both placed on the devices once, outside the timing.
    from jax.sharding import NamedSharding, PartitionSpec as P

    # pmap's outputs sit on a mesh of Auto axes: inputs placed on the same
    # kind of mesh keep the step from compiling again at its third call.
    mesh = jax.make_mesh((n,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    along = NamedSharding(mesh, P("batch"))

    def stacked(tree):
        return jax.device_put(
            jax.tree.map(lambda a: np.broadcast_to(a, (n,) + np.shape(a)), tree), along
        )

    replicated = stacked(state)
    batch = jax.device_put((images, labels), along)
    return Workload(
        name="resnet18",
        state=replicated,
        batch=batch,
        make=make,
        mapped=mapped,
        params=lambda s: jax.tree.map(
            lambda a: np.asarray(a.addressable_shards[0].data)[0], s.params
        ),
        grads_like=lambda: stacked(state.params),
        describe=f"ResNet-18, {n} devices x {per} images of {size}x{size}x3, pmap",
        has_bn=True,
        param_count=sum(x.size for x in jax.tree.leaves(state.params)),
    )


def transformer_workload(args, jaxring):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    _, Transformer = build_models()
    n = args.devices
    per = args.per_device or 8
    context = 64
    model = Transformer(context=context)
    rng = np.random.default_rng(args.seed)
    seqs = rng.integers(0, 256, (n * per, context + 1)).astype(np.int32)
    params = jax.jit(model.init)(jax.random.PRNGKey(args.seed), jnp.zeros((1, context), jnp.int32))[
        "params"
    ]
    optimizer = optax.adamw(3e-3, weight_decay=0.01)
    opt_state = optimizer.init(params)
    mesh = jax.make_mesh((n,), ("batch",))

    def make(bn, grads_mean, metrics_mean):
        del bn

        def train_step(state, seqs):
            params, opt_state = state

            def loss_of(p):
                logits = model.apply({"params": p}, seqs[:, :-1])
                return optax.softmax_cross_entropy_with_integer_labels(logits, seqs[:, 1:]).mean()

            loss, grads = jax.value_and_grad(loss_of)(params)
            if grads_mean is not None:
                grads = grads_mean(grads, "batch")
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), metrics_mean(loss, "batch")

        return train_step

    def mapped(fn):
        return jax.jit(
            jax.shard_map(
                fn, mesh=mesh, in_specs=(P(), P("batch")), out_specs=(P(), P()), check_vma=False
            )
        )

    replicated = NamedSharding(mesh, P())
    state = jax.device_put((params, opt_state), replicated)
    batch = jax.device_put(seqs, NamedSharding(mesh, P("batch")))

    def grads_like():
        # Shaped like the gradients, one copy per device; their values do
        # not change the allreduce's time.
        stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (n,) + a.shape), params)
        return jax.device_put(stacked, NamedSharding(mesh, P("batch")))

    return Workload(
        name="transformer",
        state=state,
        batch=batch,
        make=make,
        mapped=mapped,
        params=lambda s: jax.tree.map(np.asarray, s[0]),
        grads_like=grads_like,
        describe=f"transformer (width 128, 2 blocks), {n} devices x {per} sequences "
        f"of {context}, shard_map(check_vma=False)",
        has_bn=False,
        param_count=sum(x.size for x in jax.tree.leaves(params)),
        mesh=mesh,
    )


# ---- variants ---------------------------------------------------------------


def overlap_options(args) -> dict:
    return {
        k: v
        for k, v in (("bucket_mb", args.bucket_mb), ("partition_mb", args.partition_mb))
        if v is not None
    }


def build_variant(name, w, args, jaxring):
    """The step of one variant, its initial inputs, and the state after its
    first step (which traces and compiles it)."""
    import jax

    lax_mean, jr_mean = jax.lax.pmean, jaxring.pmean

    def jr_per_leaf(tree, axis_name):
        return jax.tree.map(lambda leaf: jr_mean(leaf, axis_name), tree)

    if name == "comm":
        # The gradients' allreduce alone, as the serialized step sends it
        # (one fused jaxring.pmean); BatchNorm's small reductions are left out.
        if w.name == "resnet18":

            def comm_step(g, _):
                g = jr_mean(g, "batch")
                return g, jax.tree.leaves(g)[0].sum()

            f = jax.pmap(comm_step, axis_name="batch")
        else:
            from jax.sharding import PartitionSpec as P

            def comm_step(g, _):
                g = jr_mean(jax.tree.map(lambda a: a[0], g), "batch")
                return jax.tree.map(lambda a: a[None], g), jax.tree.leaves(g)[0].sum()

            f = jax.jit(
                jax.shard_map(
                    comm_step,
                    mesh=w.mesh,
                    in_specs=(P("batch"), P("batch")),
                    out_specs=(P("batch"), P()),
                    check_vma=False,
                )
            )
        state = w.grads_like()
    else:
        bn, grads, metrics = {
            "plain": (lax_mean, lax_mean, lax_mean),
            "overlap": (lax_mean, lax_mean, lax_mean),
            "overlap-nogang": (lax_mean, lax_mean, lax_mean),
            "jaxring-pmean": (jr_mean, jr_mean, jr_mean),
            "jaxring-bn": (jr_mean, lax_mean, lax_mean),
            "jaxring-grads": (lax_mean, jr_mean, lax_mean),
            "jaxring-per-leaf": (jr_mean, jr_per_leaf, jr_mean),
            "compute": (lax_mean, None, lax_mean),
        }[name]
        step = w.make(bn, grads, metrics)
        if name.startswith("overlap"):
            step = jaxring.overlap(step, axis_name="batch", **overlap_options(args))
        f = w.mapped(step)
        state = w.state
    # The link and gang start are read when the step is traced, on its first
    # call: make it here, under the settings this variant asks for.
    jaxring.config.update("cpu_gang_start", name != "overlap-nogang")
    try:
        first, _ = f(state, w.batch)
        jax.block_until_ready(first)
    finally:
        jaxring.config.reset("cpu_gang_start")
    return f, state, first


def temp_mib(f, state, batch) -> float:
    """The temporary buffer XLA's CPU runtime allocates for each run of the
    step, per device (the executable compiled by the first call is reused).
    Above glibc's mmap threshold (at most 32 MiB) malloc maps it afresh
    each run, so every page of it faults and is zeroed every step."""
    analysis = f.lower(state, batch).compile().memory_analysis()
    return analysis.temp_size_in_bytes / 2**20


def run_steps(f, state, batch, steps, wait_each=False):
    """Seconds per step of `steps` steps, dispatched back to back (or each
    waited for), and the state they leave."""
    import jax

    t0 = time.perf_counter()
    for _ in range(steps):
        state, _ = f(state, batch)
        if wait_each:
            jax.block_until_ready(state)
    jax.block_until_ready(state)
    return (time.perf_counter() - t0) / steps, state


# ---- what the reductions are ------------------------------------------------


def reduction_census(w, args, jaxring):
    """Counts the step's psums by kind (BatchNorm forward statistics, their
    transposes in the backward pass, gradients, metrics) and returns the
    bucket report of the overlapped step."""
    import jax

    step = w.make(jax.lax.pmean, jax.lax.pmean, jax.lax.pmean)
    kinds = {
        "BatchNorm statistics (forward)": [0, 0],
        "BatchNorm backward sums": [0, 0],
        "gradients": [0, 0],
        "metrics": [0, 0],
    }
    holder = {}

    def probe(state, batch):
        jaxpr = jax.make_jaxpr(step)(state, batch)
        for eqn in jaxpr.eqns:
            if eqn.primitive.name not in ("psum", "psum_invariant"):
                continue
            stack = str(eqn.source_info.name_stack)
            size = sum(v.aval.size for v in eqn.invars)
            if w.has_bn and "transpose" in stack:
                kind = "BatchNorm backward sums"
            elif w.has_bn and "jvp(" in stack:
                kind = "BatchNorm statistics (forward)"
            elif all(v.aval.shape == () for v in eqn.invars):
                kind = "metrics"
            else:
                kind = "gradients"
            kinds[kind][0] += len(eqn.invars)
            kinds[kind][1] += size
        holder["report"] = jaxring.explain(
            jaxring.overlap(step, axis_name="batch", **overlap_options(args)), state, batch
        )
        return batch

    if w.name == "resnet18":
        jax.eval_shape(jax.pmap(probe, axis_name="batch"), w.state, w.batch)
    else:
        from jax.sharding import PartitionSpec as P

        jax.eval_shape(
            jax.shard_map(
                probe,
                mesh=w.mesh,
                in_specs=(P(), P("batch")),
                out_specs=P("batch"),
                check_vma=False,
            ),
            w.state,
            w.batch,
        )
    return kinds, holder["report"]


def print_census(w, args, jaxring):
    kinds, report = reduction_census(w, args, jaxring)
    print("reductions in the step (psum'd values, elements):")
    for k, (count, size) in kinds.items():
        if count:
            print(f"  {k:>32}: {count:4d} values, {size:10d} elements")
    # A bucket that carries a BatchNorm statistic (forward) or its
    # cotangent's sum (backward) is waited for right after it starts: the
    # next layer needs it. Gradients bucketed with such a sum wait too.
    groups = {
        "BatchNorm statistics (forward), alone": [0, 0],
        "BatchNorm backward sum + gradients, waited at once": [0, 0],
        "gradients": [0, 0],
        "metrics / other": [0, 0],
    }
    for b in report.buckets:
        text = " ".join(b.leaves)
        if w.has_bn and "value from transpose(" in text:
            key = "BatchNorm backward sum + gradients, waited at once"
        elif w.has_bn and "value from jvp(" in text:
            key = "BatchNorm statistics (forward), alone"
        elif any(leaf.startswith("args") for leaf in b.leaves):
            key = "gradients"
        else:
            key = "metrics / other"
        groups[key][0] += 1
        groups[key][1] += b.nbytes
    bucketed = sum(b.nbytes for b in report.buckets)
    print(
        f"jaxring.overlap {overlap_options(args) or '(defaults)'}: "
        f"{len(report.buckets)} buckets, {bucketed / 2**20:.2f} MiB"
    )
    for k, (count, nbytes) in groups.items():
        if count:
            print(f"  {k:>52}: {count:3d} buckets, {nbytes / 2**20:7.2f} MiB")
    for line in getattr(report, "run_at_once", []):
        print(f"  not bucketed: {line}")
    gradient_bytes = 4 * kinds["gradients"][1]
    if bucketed < 0.5 * gradient_bytes:
        print(
            f"  note: the buckets carry {bucketed / 2**20:.2f} MiB of "
            f"{gradient_bytes / 2**20:.2f} MiB of gradients; the rest is reduced "
            "as written (lax.pmean), so overlap times mostly plain's step"
        )
    if args.report:
        print(report)
    return {k: {"values": count, "elements": size} for k, (count, size) in kinds.items()}


# ---- main -------------------------------------------------------------------


def max_abs_diff(a, b):
    import jax
    import numpy as np

    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def bench(w, args, jaxring):
    import jax

    names = list(args.variants)
    if w.name != "resnet18":
        names = [v for v in names if v != "jaxring-bn"]
    # The link is read when a step is traced: every variant is built under it.
    if args.link:
        jaxring.config.update("cpu_link", args.link)
    try:
        built = {}
        for name in names:
            t0 = time.perf_counter()
            built[name] = build_variant(name, w, args, jaxring)
            temp = temp_mib(built[name][0], built[name][1], w.batch)
            print(
                f"  built {name} in {time.perf_counter() - t0:.1f} s; XLA's "
                f"temporary buffer {temp:.1f} MiB per device",
                flush=True,
            )
    finally:
        jaxring.config.reset("cpu_link")
    init_params = w.params(w.state)
    f_of = {k: built[k][0] for k in names}
    # Each variant goes on from the state its first step left.
    states = {k: built[k][2] for k in names}
    first_params = {k: w.params(built[k][2]) for k in names if k in REDUCING}
    # The first steps of a process run slow (measured: 1.0-1.4x the later
    # ones for several rounds) while glibc's allocator adapts to XLA's
    # buffers, so untimed rounds come first, alternating like the timed
    # ones so that no variant is favoured; every reducing variant runs the
    # same steps.
    samples = {k: [] for k in names}
    cpu = {k: [] for k in names}
    for r in range(args.warmup + args.rounds):
        for k in names:
            c0, f0 = os.times(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            dt, states[k] = run_steps(f_of[k], states[k], w.batch, args.steps, args.wait_each_step)
            c1, f1 = os.times(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            if r >= args.warmup:
                samples[k].append(dt)
                cpu[k].append(
                    (
                        (c1.user - c0.user) / args.steps,
                        (c1.system - c0.system) / args.steps,
                        (f1 - f0) / args.steps,
                    )
                )
    med = {k: statistics.median(v) for k, v in samples.items()}
    cpu_med = {
        k: tuple(statistics.median(x[i] for x in v) for i in range(3)) for k, v in cpu.items()
    }

    print(
        f"\n{w.describe}; {w.param_count / 1e6:.2f} M parameters; "
        f"link {args.link or 'none'}; PJRT_NPROC={os.environ.get('PJRT_NPROC')}; "
        f"gang start {'on' if jaxring.config.cpu_gang_start else 'off'}; "
        f"median of {args.rounds} rounds x {args.steps} steps"
    )
    base = med.get("plain")
    # The process's CPU time per step (all threads; user, system, in ms)
    # and its minor page faults show whether a variant's extra time is work
    # (copies, spinning), the kernel mapping fresh pages, or waiting.
    print(
        f"  {'variant':<15} {'ms/step':>9} {'/ plain':>8} {'CPU user':>9} {'sys':>6} "
        f"{'faults':>8}   (min-max ms)"
    )
    for k in names:
        ratio = f"{med[k] / base:8.3f}" if base else "       -"
        lo, hi = min(samples[k]) * 1e3, max(samples[k]) * 1e3
        user, system, faults = cpu_med[k]
        print(
            f"  {k:<15} {med[k] * 1e3:9.1f} {ratio} {user * 1e3:9.0f} {system * 1e3:6.0f} "
            f"{faults:8.0f}   ({lo:.1f}-{hi:.1f})"
        )
    if "compute" in med and "comm" in med:
        bound = max(med["compute"], med["comm"])
        print(f"  max(compute, comm) = {bound * 1e3:.1f} ms")
        for k in ("overlap", "jaxring-pmean"):
            if k in med:
                print(f"  {k} / max(compute, comm) = {med[k] / bound:.3f}")
    if "overlap" in med and "jaxring-pmean" in med:
        print(f"  overlap / jaxring-pmean = {med['overlap'] / med['jaxring-pmean']:.3f}")

    # Every reducing variant ran the same steps from the same state, so
    # their parameters differ only by rounding: after one step by little
    # (a gradient reduced twice or not at all is off by the update's size),
    # after all of them by what the steps made of it.
    reducing = [k for k in names if k in REDUCING]
    ok = True
    result = {
        "variants": {
            k: {"ms_per_step": med[k] * 1e3, "over_plain": med[k] / base if base else None}
            for k in names
        },
        "agreement": {},
    }
    if len(reducing) > 1:
        ref = reducing[0]
        ref_first, ref_last = first_params[ref], w.params(states[ref])
        moved_first = max(max_abs_diff(ref_first, init_params), 1e-30)
        moved_last = max(max_abs_diff(ref_last, init_params), 1e-30)
        total = args.warmup * args.steps + args.rounds * args.steps + 1
        print(f"  agreement with {ref} (max |params diff|, relative to how far {ref} moved them):")
        for k in reducing[1:]:
            first = max_abs_diff(first_params[k], ref_first)
            last = max_abs_diff(w.params(states[k]), ref_last)
            good = (
                first <= args.tolerance * moved_first and last <= args.drift_tolerance * moved_last
            )
            ok &= good
            result["agreement"][k] = {
                "after_first_step": first / moved_first,
                "after_all_steps": last / moved_last,
                "ok": good,
            }
            print(
                f"    {k:<16} after 1 step {first:.3g} ({first / moved_first:.2g}), "
                f"after {total} steps {last:.3g} ({last / moved_last:.2g})  "
                f"{'ok' if good else 'FAILED'}"
            )
    jax.block_until_ready(states)
    result["reference"] = reducing[0] if reducing else None
    return ok, result


def main(argv=None):
    args = parse_args(argv)
    import jaxring

    jaxring.use_cpu_devices(args.devices)  # before JAX starts its backend
    models = ["resnet18", "transformer"] if args.model == "both" else [args.model]
    ok = True
    results = {}
    for m in models:
        t0 = time.perf_counter()
        w = (resnet18_workload if m == "resnet18" else transformer_workload)(args, jaxring)
        print(f"{m}: set up in {time.perf_counter() - t0:.1f} s", flush=True)
        census = None
        if any(v.startswith("overlap") for v in args.variants) or args.report:
            census = print_census(w, args, jaxring)
        model_ok, results[m] = bench(w, args, jaxring)
        results[m]["census"] = census
        ok &= model_ok
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if not ok:
        print("FAILED: the variants' parameters disagree")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
