"""step_order: the equations that feed a reduction move up to where their
inputs exist, so that jaxring.overlap can start it during the backward pass."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import jaxring
from jaxring._src import step_order

N = 8
LAYERS = 4


def mesh():
    return Mesh(np.array(jax.devices()), ("batch",))


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(0, 0.3, (16, 16)), jnp.float32) for _ in range(LAYERS)]


def _loss(params, x):
    for w in params:
        x = jnp.tanh(x @ w)
    return jnp.sum(x**2)


def scaled_step(params, x):
    # The psum's operands are made after the whole backward pass, in
    # program order, as an optimizer transformation would make them.
    grads = jax.grad(_loss)(params, x)
    scaled = [g * 0.5 for g in grads]
    return jax.lax.psum(scaled, "batch")


def _jaxpr_in_map(fn, *args):
    holder = {}

    def body(*a):
        holder["jaxpr"] = jax.make_jaxpr(fn)(*a).jaxpr
        return fn(*a)

    jax.eval_shape(
        jax.shard_map(
            body, mesh=mesh(), in_specs=(P(), P("batch")), out_specs=P(), check_vma=False
        ),
        *args,
    )
    return holder["jaxpr"]


def test_each_scaling_moves_up_to_just_after_its_gradient():
    x = np.ones((N * 2, 16), np.float32)
    jaxpr = _jaxpr_in_map(scaled_step, _params(), x)
    psums = {i for i, e in enumerate(jaxpr.eqns) if e.primitive.name.startswith("psum")}
    order = step_order.hoisted_order(jaxpr, psums)
    assert sorted(order) == list(range(len(jaxpr.eqns)))
    muls = [
        i
        for i, e in enumerate(jaxpr.eqns)
        if e.primitive.name == "mul" and any(getattr(v, "val", None) == 0.5 for v in e.invars)
    ]
    assert len(muls) == LAYERS
    position = {i: k for k, i in enumerate(order)}
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    made = sorted((producer[jaxpr.eqns[m].invars[0]], m) for m in muls)
    # In program order every scaling follows the last gradient; now each
    # comes before the backward pass makes the next gradient.
    for (grad, m), (next_grad, _) in zip(made, made[1:]):
        assert position[grad] < position[m] < position[next_grad], (grad, m, next_grad)
    last_dot = max(i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "dot_general")
    assert min(position[m] for m in muls) < position[last_dot]
    # The order is a topological one.
    seen = set(jaxpr.invars) | set(jaxpr.constvars)
    for i in order:
        e = jaxpr.eqns[i]
        assert all(v in seen for v in e.invars if not hasattr(v, "val")), e
        seen.update(e.outvars)


def test_what_reads_a_reduced_value_stays_behind():
    def two_stage(params, x):
        grads = jax.grad(_loss)(params, x)
        p = jax.lax.psum([g * 2.0 for g in grads], "batch")
        # Depends on the first psum's result: moving it up would move the
        # wait for that bucket up too.
        return jax.lax.psum([q * 3.0 + g for q, g in zip(p, grads)], "batch")

    x = np.ones((N * 2, 16), np.float32)
    jaxpr = _jaxpr_in_map(two_stage, _params(), x)
    psums = {i for i, e in enumerate(jaxpr.eqns) if e.primitive.name.startswith("psum")}
    movable = step_order.movable_equations(jaxpr, psums)
    second = max(psums)
    assert second not in movable
    for i, e in enumerate(jaxpr.eqns):
        if e.primitive.name == "mul" and any(getattr(v, "val", None) == 3.0 for v in e.invars):
            assert i not in movable


def test_overlap_starts_the_buckets_during_the_backward_pass():
    params, x = _params(), np.random.default_rng(1).normal(size=(N * 2, 16)).astype(np.float32)
    run = lambda f: jax.jit(
        jax.shard_map(f, mesh=mesh(), in_specs=(P(), P("batch")), out_specs=P(), check_vma=False)
    )
    step = jaxring.overlap(scaled_step, axis_name="batch", bucket_mb=0.0005, first_bucket_mb=0.0005)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxring.OverlapWarning)
        got = run(step)(params, x)
    want = run(scaled_step)(params, x)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    text = jax.make_jaxpr(run(step))(params, x).pretty_print()
    first_start = text.index("jaxring_allreduce_start")
    last_dot = text.rindex("dot_general")
    assert first_start < last_dot, "no bucket starts before the backward pass ends"
