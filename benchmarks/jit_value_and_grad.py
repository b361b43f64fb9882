"""A plain jit step with jaxring.value_and_grad against the shard_map step
under jaxring.overlap: the same MLP, batch and Adam update, timed side by side.

The two send the same buckets, and XLA compiles them to one program: the
update outside the shard_map (jit) or inside it (overlap) ends up in the
same place once the step is partitioned. The script checks that (the
optimized entry computations, with names and ids left out, are compared)
and prints it. Rounds alternate between the variants (and XLA's own
all-reduce in a plain jit step, for reference), in an order that rotates
from round to round, since on a busy 2-core machine the variant that runs
first after another is slowed; each round times --steps steps dispatched
back to back. The figures are the medians over the rounds of the time per
step, and the ratio is the median of the rounds' own ratios.

    python benchmarks/jit_value_and_grad.py                  # 8 devices
    python benchmarks/jit_value_and_grad.py --layers 8 --width 1024 --rounds 11
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--per-device-batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=10, help="steps per timed round")
    p.add_argument("--link", default=None, help='emulated link, e.g. "2Gbit,20us"')
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import jaxring

    jaxring.use_cpu_devices(args.devices)  # before JAX starts its backend
    if args.link:
        jaxring.config.update("cpu_link", args.link)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((args.devices,), ("batch",))
    optimizer = optax.adam(1e-3)
    rng = np.random.default_rng(0)
    params = [
        {
            "w": jnp.asarray(
                rng.normal(0, args.width**-0.5, (args.width, args.width)), jnp.float32
            ),
            "b": jnp.zeros((args.width,), jnp.float32),
        }
        for _ in range(args.layers)
    ]
    n = args.devices * args.per_device_batch
    x = rng.normal(size=(n, args.width)).astype(np.float32)
    y = rng.normal(size=(n, args.width)).astype(np.float32)

    def loss_fn(params, x, y):
        for layer in params:
            x = jnp.tanh(x @ layer["w"] + layer["b"])
        return jnp.mean((x - y) ** 2)

    def update(params, opt_state, grads):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    @jax.jit
    def jit_step(params, opt_state, x, y):
        loss, grads = jaxring.value_and_grad(loss_fn, mesh=mesh, axis_name="batch")(params, x, y)
        return *update(params, opt_state, grads), loss

    @jax.jit
    @jax.shard_map(
        mesh=mesh, in_specs=(P(), P(), P("batch"), P("batch")), out_specs=P(), check_vma=False
    )
    @jaxring.overlap(axis_name="batch")
    def shard_map_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        loss, grads = jax.lax.pmean((loss, grads), "batch")
        return *update(params, opt_state, grads), loss

    @jax.jit
    def xla_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return *update(params, opt_state, grads), loss

    variants = {
        "jit + jaxring.value_and_grad": jit_step,
        "shard_map + jaxring.overlap": shard_map_step,
        "jit + jax.value_and_grad (XLA)": xla_step,
    }
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("batch"))
    start = (
        jax.device_put(params, replicated),
        jax.device_put(optimizer.init(params), replicated),
        *jax.device_put((x, y), sharded),
    )

    # Compile, and check that the variants compute the same step.
    outs = {name: jax.block_until_ready(f(*start)) for name, f in variants.items()}
    ref = outs["shard_map + jaxring.overlap"]
    for out in outs.values():
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(
                np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6
            ),
            out,
            ref,
        )

    programs = {
        name: _entry_program(f.lower(*start).compile().as_text()) for name, f in variants.items()
    }
    same = programs["jit + jaxring.value_and_grad"] == programs["shard_map + jaxring.overlap"]

    times = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            f = variants[name]
            state = start
            t0 = time.perf_counter()
            for _ in range(args.steps):
                state = (*f(*state)[:2], state[2], state[3])
            jax.block_until_ready(state)
            times[name].append((time.perf_counter() - t0) / args.steps)

    mib = sum(v.size * 4 for v in jax.tree.leaves(params)) / 2**20
    print(
        f"{args.devices} devices, {args.layers} layers of {args.width}, "
        f"{mib:.1f} MiB of gradients, batch {n}, {args.rounds} rounds of "
        f"{args.steps} steps (median ms per step)"
    )
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    for name, ms in medians.items():
        print(f"  {name:32s} {ms:8.2f} ms")
    print(f"  the two jaxring variants compile to the same program: {'yes' if same else 'no'}")
    ratio = statistics.median(
        a / b
        for a, b in zip(times["jit + jaxring.value_and_grad"], times["shard_map + jaxring.overlap"])
    )
    print(
        f"jit + jaxring.value_and_grad / shard_map + jaxring.overlap = {ratio:.3f} "
        "(median of the rounds' ratios)"
    )
    return medians


def _entry_program(hlo: str) -> list[str]:
    """The optimized entry computation's instructions, sorted, without
    names, ids and source metadata, which differ between two traces of one
    program."""
    entry = hlo[hlo.index("\nENTRY") :]
    entry = entry[entry.index("{\n") + 2 :]  # the signature names its parameters
    entry = re.sub(r", metadata=\{[^}]*\}", "", entry)
    entry = re.sub(r"(op_id|slot_id) = \d+", r"\1", entry)
    entry = re.sub(r"%[\w.-]+", "%", entry)
    entry = re.sub(r"parameter\(\d+\)", "parameter()", entry)
    return sorted(entry.splitlines())


if __name__ == "__main__":
    main()
    sys.exit(0)
