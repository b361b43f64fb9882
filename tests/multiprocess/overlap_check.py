"""Run by tests/test_multiprocess.py: an MLP train step over every device of
every process, once with lax.pmean (JAX's Gloo collectives across processes)
and once under jaxring.overlap (buckets over jaxring's TCP transport).
Reports the losses, the largest difference of the losses and of the
parameters after three steps, and the data frames sent over sockets."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from report import report

import jaxring

LAYERS, WIDTH = 4, 128
devices = np.array(jax.devices())
mesh = Mesh(devices, ("batch",))
rng = np.random.default_rng(0)
params = [
    (
        rng.normal(size=(WIDTH, WIDTH)).astype(np.float32) / np.sqrt(WIDTH),
        np.zeros(WIDTH, np.float32),
    )
    for _ in range(LAYERS)
]
data = rng.normal(size=(devices.size * 8, WIDTH)).astype(np.float32)


def loss_fn(p, x):
    h = x
    for w, b in p:
        h = jnp.tanh(h @ w + b)
    return jnp.mean((h - x) ** 2)


def step(p, x):
    loss, grads = jax.value_and_grad(loss_fn)(p, x)
    grads = jax.lax.pmean(grads, "batch")
    new = jax.tree_util.tree_map(lambda a, g: a - 0.1 * g, p, grads)
    return new, jax.lax.pmean(loss, "batch")


def sharded(fn):
    # check_vma=False: the step's pmean of the local gradients is their one
    # reduction (docs/overlap.md).
    return jax.jit(
        jax.shard_map(
            fn, mesh=mesh, in_specs=(P(), P("batch")), out_specs=(P(), P()), check_vma=False
        )
    )


replicated = NamedSharding(mesh, P())
put = lambda a: jax.make_array_from_callback(a.shape, replicated, lambda idx: a[idx])
x = jax.make_array_from_callback(data.shape, NamedSharding(mesh, P("batch")), lambda idx: data[idx])
results = {}
for name, fn in [
    ("pmean", step),
    ("overlap", jaxring.overlap(step, axis_name="batch", bucket_mb=0.05, first_bucket_mb=0.05)),
]:
    f = sharded(fn)
    p = jax.tree_util.tree_map(put, params)
    losses = []
    for _ in range(3):
        p, loss = f(p, x)
        losses.append(float(np.asarray(loss.addressable_data(0))))
    results[name] = (
        losses,
        [np.asarray(a.addressable_data(0)) for a in jax.tree_util.tree_leaves(p)],
    )
(l0, p0), (l1, p1) = results["pmean"], results["overlap"]
loss_diff = max(abs(a - b) for a, b in zip(l0, l1))
param_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(p0, p1))
frames = jaxring.transport_info()["data_frames"]
report(
    "result",
    losses={"pmean": l0, "overlap": l1},
    loss_diff=loss_diff,
    param_diff=param_diff,
    data_frames=frames["device_thread"] + frames["sender_thread"],
)
