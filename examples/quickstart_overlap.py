"""Data-parallel training with jaxring.overlap: an MLP on random regression
data, on 8 virtual CPU devices. Copy it and change the model and the data."""

import functools

import jaxring

jaxring.use_cpu_devices(8)  # before JAX starts; drop on GPUs

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

mesh = jax.make_mesh((jax.device_count(),), ("batch",))
opt = optax.adam(1e-2)


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


# check_vma=False: each device's gradients stay its own, and the pmean below
# is their one reduction (under the default check_vma=True autodiff would
# already sum them over "batch"; docs/overlap.md).
@jax.jit
@functools.partial(
    jax.shard_map,
    mesh=mesh,
    out_specs=P(),
    check_vma=False,
    in_specs=(P(), P(), P("batch"), P("batch")),
)
@jaxring.overlap(axis_name="batch")  # the gradients' pmean overlaps the backward pass
def train_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    grads = jax.lax.pmean(grads, "batch")
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "batch")


rng = np.random.default_rng(0)
params = {
    "w1": jnp.asarray(rng.normal(0, 0.3, (32, 64)), jnp.float32),
    "b1": jnp.zeros(64),
    "w2": jnp.asarray(rng.normal(0, 0.3, (64, 1)), jnp.float32),
}
truth = rng.normal(size=(32, 1))


def batch():
    x = rng.normal(size=(256, 32)).astype(np.float32)
    return x, np.sin(x @ truth).astype(np.float32)


if __name__ == "__main__":
    opt_state = opt.init(params)
    for step in range(200):
        x, y = (jax.device_put(a, NamedSharding(mesh, P("batch"))) for a in batch())
        params, opt_state, loss = train_step(params, opt_state, x, y)
        if step % 50 == 0 or step == 199:
            print(f"step {step:3d}  loss {float(loss):.4f}")
