"""jaxring.overlap: the rewritten step computes what the original computes,
and its compiled program issues each bucket during the backward pass."""

import re
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxring
from jaxring import _jaxring

from conftest import overlapped_and_plain

N = 8
WIDTH = 32
LAYERS = 4


@pytest.fixture(autouse=True)
def _no_state_left_behind(no_jaxring_state_left_behind):
    yield


def mesh():
    return jax.make_mesh((N,), ("batch",))


def init_mlp(seed=0, layers=LAYERS, width=WIDTH):
    rng = np.random.default_rng(seed)
    return {
        f"layer{i}": {
            "w": jnp.asarray(rng.normal(0, 0.3, (width, width)), jnp.float32),
            "b": jnp.asarray(rng.normal(0, 0.1, (width,)), jnp.float32),
        }
        for i in range(layers)
    }


def mlp(params, x):
    for i in range(len(params)):
        with jax.named_scope(f"layer{i}"):
            p = params[f"layer{i}"]
            x = jnp.tanh(x @ p["w"] + p["b"])
    return x


def batch(seed=1, per_device=4, width=WIDTH):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N * per_device, width)).astype(np.float32)
    y = rng.normal(size=(N * per_device, width)).astype(np.float32)
    return {"x": jnp.asarray(x), "y": jnp.asarray(y)}


def make_step(pmean, optimizer, model=mlp, check_vma=False):
    """A train step written the right way for its shard_map; `pmean` is
    lax.pmean or jaxring's. Under check_vma=False the pmean of the local
    gradients is the one reduction; under check_vma=True the loss is
    averaged over the batch axis inside the loss function, and autodiff
    sums the replicated parameters' gradients (docs/overlap.md)."""

    def step(params, opt_state, data):
        def loss_fn(p):
            pred = model(p, data["x"])
            loss, aux = jnp.mean((pred - data["y"]) ** 2), {"pred_mean": jnp.mean(pred)}
            if check_vma:
                loss, aux = pmean(loss, "batch"), pmean(aux, "batch")
            return loss, aux

        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        if not check_vma:
            grads = pmean(grads, "batch")
            loss, aux = pmean(loss, "batch"), pmean(aux, "batch")
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss, aux

    return step


def sharded(step, check_vma=False):
    m = mesh()
    return jax.jit(
        jax.shard_map(
            step, mesh=m, in_specs=(P(), P(), P("batch")), out_specs=P(), check_vma=check_vma
        )
    )


def train(step_fn, params, optimizer, data, steps=3):
    opt_state = optimizer.init(params)
    m = mesh()
    data = jax.device_put(data, NamedSharding(m, P("batch")))
    history = []
    for _ in range(steps):
        params, opt_state, loss, aux = step_fn(params, opt_state, data)
        history.append((float(loss), float(aux["pred_mean"])))
    return params, history


def train_noting_warnings(step_fn, params, optimizer, data):
    """train(), and the OverlapWarning messages it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", jaxring.OverlapWarning)
        out = train(step_fn, params, optimizer, data)
    return out, [str(w.message) for w in caught if issubclass(w.category, jaxring.OverlapWarning)]


def assert_trees_close(a, b, rtol=2e-5, atol=2e-6):
    jax.tree.map(
        lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol),
        a,
        b,
    )


def small_buckets(**kw):
    # Buckets of about one layer each, so that there are several.
    return dict(
        axis_name="batch",
        bucket_mb=WIDTH * WIDTH * 4 / 2**20,
        first_bucket_mb=WIDTH * WIDTH * 4 / 2**20,
        **kw,
    )


@pytest.mark.parametrize("check_vma", [True, False])
def test_mlp_with_optax_matches_psum_and_plain_jaxring(check_vma):
    opt = optax.adam(1e-2)
    params, data = init_mlp(), batch()
    ref_lax = train(
        sharded(make_step(jax.lax.pmean, opt, check_vma=check_vma), check_vma), params, opt, data
    )
    ref_ring = train(
        sharded(make_step(jaxring.pmean, opt, check_vma=check_vma), check_vma), params, opt, data
    )
    ov = jaxring.overlap(make_step(jax.lax.pmean, opt, check_vma=check_vma), **small_buckets())
    got = train(sharded(ov, check_vma), params, opt, data)
    assert_trees_close(got, ref_ring)
    assert_trees_close(got, ref_lax)


def test_pmap_step():
    opt = optax.sgd(0.1)
    params, data = init_mlp(), batch()
    data = jax.tree.map(lambda a: a.reshape(N, -1, *a.shape[1:]), data)

    def run(step):
        f = jax.pmap(step, axis_name="batch", in_axes=(None, None, 0))
        p, s = params, opt.init(params)
        for _ in range(2):
            p, s, loss, _ = f(p, s, data)
            p, s = jax.tree.map(lambda a: a[0], (p, s))
        return p, float(loss[0])

    ref = run(make_step(jax.lax.pmean, opt))
    got = run(jaxring.overlap(make_step(jax.lax.pmean, opt), **small_buckets()))
    assert_trees_close(got, ref)


def test_bare_decorator_rewrites_every_mapped_axis():
    opt = optax.sgd(0.1)
    params, data = init_mlp(), batch()
    ref = train(sharded(make_step(jax.lax.pmean, opt)), params, opt, data, steps=1)
    got = train(sharded(jaxring.overlap(make_step(jax.lax.pmean, opt))), params, opt, data, steps=1)
    assert_trees_close(got, ref)


def test_results_are_repeatable_bit_for_bit():
    opt = optax.sgd(0.1)
    params, data = init_mlp(), batch()
    step = sharded(jaxring.overlap(make_step(jax.lax.pmean, opt), **small_buckets()))
    a = train(step, params, opt, data)
    pooled = settled_pool_bytes()
    b = train(step, params, opt, data)
    jax.tree.map(lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)), a, b)
    # The second run's starts took the first run's buffers from the pool
    # (see xla_ffi/cpu/buffer_pool.h) instead of allocating more. The pool
    # settles at the most buffers of each size in use at once, which depends
    # on how the devices' threads interleave: a second run may need a few
    # more at once than the first (seen: +6 %), while one that reused none
    # would double the pool.
    assert pooled > 0
    grown = settled_pool_bytes() - pooled
    assert 0 <= grown < pooled // 2, (pooled, grown)


def settled_pool_bytes():
    """The split-phase buffer pool once the last step's buffers are back."""
    deadline = time.monotonic() + 10
    last = None
    while time.monotonic() < deadline:
        jax.effects_barrier()
        now = _jaxring.testing.split_phase_pooled_bytes()
        if now == last and _jaxring.testing.split_phase_unfinished_starts() == 0:
            return now
        last = now
        time.sleep(0.05)
    return last


def test_integer_reductions_are_bit_identical():
    def step(x):
        counts = jnp.stack([jnp.sum(x > t, dtype=jnp.int32) for t in range(-3, 4)])
        big = (x * 1e6).astype(jnp.int64) * 7919
        return jax.lax.psum(counts, "batch"), jax.lax.psum(big, "batch")

    m = mesh()
    x = jax.device_put(
        jnp.asarray(np.random.default_rng(0).normal(size=(N * 64,))), NamedSharding(m, P("batch"))
    )
    run = lambda f: jax.jit(
        jax.shard_map(
            f,
            mesh=m,
            in_specs=P("batch"),
            out_specs=P(),
        )
    )(x)
    ref = run(step)
    got = run(jaxring.overlap(step, axis_name="batch"))
    for r, g in zip(ref, got):
        assert g.dtype == r.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))


@pytest.mark.parametrize("check_vma", [False, True])
def test_nested_jit_remat_and_custom_vjp(check_vma):
    @jax.custom_vjp
    def softsign(x):
        return x / (1 + jnp.abs(x))

    def softsign_fwd(x):
        return softsign(x), x

    def softsign_bwd(x, g):
        return (g / (1 + jnp.abs(x)) ** 2,)

    softsign.defvjp(softsign_fwd, softsign_bwd)

    @jax.jit
    def layer(p, x):
        return softsign(x @ p["w"] + p["b"])

    def model(params, x):
        for i in range(len(params)):
            x = jax.checkpoint(layer)(params[f"layer{i}"], x)
        return x

    reduce_in_jit = jax.jit(lambda g, axis: jax.lax.pmean(g, axis), static_argnums=1)
    opt = optax.sgd(0.1)
    params, data = init_mlp(), batch()
    ref = train(
        sharded(make_step(jax.lax.pmean, opt, model, check_vma), check_vma), params, opt, data
    )
    ov = jaxring.overlap(make_step(reduce_in_jit, opt, model, check_vma), **small_buckets())
    got, messages = train_noting_warnings(sharded(ov, check_vma), params, opt, data)
    assert_trees_close(got, ref)
    if check_vma:
        # Under check_vma, AD itself sums the gradient of a replicated
        # parameter where the parameter is used: inside the remat body.
        assert messages and all("inside `remat" in m for m in messages), messages
    else:
        assert not messages, messages


def scan_model(params, x):
    def body(h, p):
        return jnp.tanh(h @ p["w"] + p["b"]), None

    return jax.lax.scan(body, x, params)[0]


def transformer_scan_model(params, x):
    """Pre-norm transformer blocks (attention over the batch rows, then an
    MLP), one scan step per block; x is [tokens, width]."""

    def norm(h):
        return (h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-5)

    def block(h, p):
        q = norm(h) @ p["w"]
        attn = jax.nn.softmax(q @ q.T / q.shape[-1] ** 0.5, axis=-1) @ q
        h = h + attn
        return h + jnp.tanh(norm(h) @ p["w"].T + p["b"]), None

    return jax.lax.scan(block, x, params)[0]


@pytest.mark.parametrize("model", [scan_model, transformer_scan_model], ids=["mlp", "transformer"])
@pytest.mark.parametrize("check_vma", [False, True])
def test_scan_over_layers(check_vma, model):
    opt = optax.adam(1e-2)
    layers = init_mlp()
    params = jax.tree.map(lambda *a: jnp.stack(a), *layers.values())
    data = batch()
    ref = train(
        sharded(make_step(jax.lax.pmean, opt, model, check_vma), check_vma), params, opt, data
    )
    ov = jaxring.overlap(make_step(jax.lax.pmean, opt, model, check_vma), axis_name="batch")
    got, messages = train_noting_warnings(sharded(ov, check_vma), params, opt, data)
    assert_trees_close(got, ref)
    if check_vma:
        # AD sums the replicated stacked parameters' gradients inside the
        # backward scan, one layer per iteration: left there, and said so.
        assert messages and all("inside `scan`" in m for m in messages), messages
    else:
        # The stacked gradients leave the scan whole: one bucket, after it.
        assert not messages, messages


def test_psum_inside_scan_is_left_alone_with_a_warning():
    def step(x):
        def body(c, row):
            return c + jax.lax.psum(row, "batch"), None

        total = jax.lax.scan(body, jnp.zeros(x.shape[1:]), x)[0]
        return total, jax.lax.psum(jnp.sum(x), "batch")

    m = mesh()
    x = jax.device_put(
        jnp.arange(N * 3 * 5, dtype=jnp.float32).reshape(N * 3, 5), NamedSharding(m, P("batch"))
    )
    run = lambda f: jax.jit(
        jax.shard_map(
            f,
            mesh=m,
            in_specs=P("batch"),
            out_specs=P(),
        )
    )(x)
    with pytest.warns(jaxring.OverlapWarning, match="inside `scan`"):
        got = run(jaxring.overlap(step, axis_name="batch"))
    assert_trees_close(got, run(step))


def test_batchnorm_statistic_is_done_before_it_is_used():
    def model(params, x):
        for i in range(len(params)):
            p = params[f"layer{i}"]
            h = x @ p["w"]
            mean = jax.lax.pmean(jnp.mean(h, axis=0), "batch")
            var = jax.lax.pmean(jnp.mean((h - mean) ** 2, axis=0), "batch")
            x = jnp.tanh((h - mean) / jnp.sqrt(var + 1e-5) + p["b"])
        return x

    opt = optax.sgd(0.1)
    params, data = init_mlp(), batch()
    ref = train(sharded(make_step(jax.lax.pmean, opt, model)), params, opt, data)
    ov = jaxring.overlap(make_step(jax.lax.pmean, opt, model), axis_name="batch")
    got = train(sharded(ov), params, opt, data)
    assert_trees_close(got, ref, rtol=1e-4, atol=1e-5)


def test_partitions_and_a_tight_credit_window():
    opt = optax.sgd(0.1)
    params, data = init_mlp(), batch()
    ref = train(sharded(make_step(jaxring.pmean, opt)), params, opt, data)
    tiny = WIDTH * WIDTH * 4 / 2**20 / 3  # a third of a layer's weight
    ov = jaxring.overlap(
        make_step(jax.lax.pmean, opt),
        axis_name="batch",
        bucket_mb=tiny,
        first_bucket_mb=tiny,
        partition_mb=tiny,
        max_inflight_mb=2 * tiny,
    )
    got = train(sharded(ov), params, opt, data)
    assert_trees_close(got, ref)


@pytest.mark.parametrize("gang", [True, False])
def test_gang_start_setting_is_lowered_and_changes_no_value(gang):
    """With cpu_gang_start the in-process starts wait for their peers (see
    xla_ffi/cpu/gang_start.h); on or off, the values are bit-identical."""
    opt = optax.sgd(0.1)
    params, data = init_mlp(), batch()
    step = make_step(jax.lax.pmean, opt)
    jaxring.config.update("cpu_gang_start", gang)
    try:
        f = sharded(jaxring.overlap(step, **small_buckets()))
        placed = jax.device_put(data, NamedSharding(mesh(), P("batch")))
        hlo = f.lower(params, opt.init(params), placed).as_text()
        got = train(f, params, opt, data)
    finally:
        jaxring.config.reset("cpu_gang_start")
    starts = re.findall(r"custom_call @jaxring_allreduce_start_cpu.*", hlo)
    assert len(starts) >= 3
    assert all(f"gang = {str(gang).lower()}" in line for line in starts)
    ref = train(sharded(jaxring.overlap(step, **small_buckets())), params, opt, data)
    jax.tree.map(lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)), got, ref)


def test_explain_names_buckets_by_parameter_path():
    opt = optax.sgd(0.1)
    params, data = init_mlp(), batch()
    step = jaxring.overlap(make_step(jax.lax.pmean, opt), **small_buckets())
    holder = {}

    def body(p, s, d):
        holder["report"] = jaxring.explain(step, p, s, d)
        return step(p, s, d)

    # Without check_vma the user's pmean is the gradient reduction (under
    # check_vma, AD sums replicated parameters' gradients itself).
    train(sharded(body, check_vma=False), params, opt, data, steps=1)
    report = holder["report"]
    leaves = [leaf for b in report.buckets for leaf in b.leaves]
    for i in range(LAYERS):
        assert any(f"args[0]['layer{i}']['w']" in leaf for leaf in leaves), leaves
    # Backward order: the last layer's gradient is in an earlier bucket.
    first = {
        i: next(
            b.index
            for b in report.buckets
            if any(f"['layer{i}']['w']" in leaf for leaf in b.leaves)
        )
        for i in range(LAYERS)
    }
    assert first[LAYERS - 1] < first[0]
    text = report.listing()
    assert "issued after" in text and "waited before" in text
    # The default text is a summary: a line, whatever the number of values.
    summary = str(report)
    assert summary.startswith(f"jaxring.overlap: {len(report.buckets)} bucket(s)")
    assert f"{len(leaves)} value(s)" in summary and "args[0]" not in summary


@pytest.mark.parametrize("report", [True, "full"])
def test_report_prints_at_trace_time(capsys, report):
    opt = optax.sgd(0.1)
    ov = jaxring.overlap(make_step(jax.lax.pmean, opt), report=report, **small_buckets())
    train(sharded(ov), init_mlp(), opt, batch(), steps=1)
    out = capsys.readouterr().out
    assert "jaxring.overlap:" in out
    assert ("issued after" in out) == (report == "full")
    with pytest.raises(ValueError, match="report must be False, True or 'full'"):
        jaxring.overlap(report="yes")


def on_devices(x):
    return jax.device_put(x, NamedSharding(mesh(), P("batch")))


def test_nothing_to_rewrite_warns():
    m = mesh()
    f = jax.jit(
        jax.shard_map(
            jaxring.overlap(lambda x: x * 2, axis_name="batch"),
            mesh=m,
            in_specs=P("batch"),
            out_specs=P("batch"),
        )
    )
    with pytest.warns(jaxring.OverlapWarning, match="nothing to overlap"):
        f(on_devices(jnp.ones(N)))


def test_unsupported_dtype_is_left_alone_with_a_warning():
    def step(x):
        return jax.lax.psum(x.astype(jnp.float8_e4m3fn), "batch"), jax.lax.psum(x, "batch")

    m = mesh()
    x = jax.device_put(jnp.arange(N, dtype=jnp.float32), NamedSharding(m, P("batch")))
    run = lambda f: jax.jit(
        jax.shard_map(
            f,
            mesh=m,
            in_specs=P("batch"),
            out_specs=P(),
        )
    )(x)
    with pytest.warns(jaxring.OverlapWarning, match="float8_e4m3fn"):
        got = run(jaxring.overlap(step, axis_name="batch"))
    assert_trees_close(got, run(step))


@pytest.mark.parametrize("partition_mb", [1.0, 16 / 2**20])
def test_complex_values_travel_as_float_lanes_in_the_float_buckets(partition_mb):
    rng = np.random.default_rng(5)

    def step(x):
        c = (x + 1j * jnp.cos(x)).astype(jnp.complex64)
        return (
            jax.lax.psum(c * c, "batch"),
            jax.lax.psum(x * 3, "batch"),
            jax.lax.pmean(c.astype(jnp.complex128), "batch"),
        )

    m = mesh()
    x = jax.device_put(
        jnp.asarray(rng.standard_normal((N * 3, 7)), jnp.float32), NamedSharding(m, P("batch"))
    )
    run = lambda f: jax.jit(
        jax.shard_map(
            f,
            mesh=m,
            in_specs=P("batch"),
            out_specs=P(),
        )
    )
    got, text, want = overlapped_and_plain(
        run, step, x, axis_name="batch", partition_mb=partition_mb
    )
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    assert " psum" not in text


def test_errors_are_clear():
    with pytest.raises(ValueError, match="bucket_mb"):
        jaxring.overlap(lambda x: x, bucket_mb=0)
    with pytest.raises(ValueError, match="max_inflight_mb"):
        jaxring.overlap(lambda x: x, max_inflight_mb=-1)
    with pytest.raises(TypeError, match="decorates a function"):
        jaxring.overlap(3)
    m = mesh()
    f = jax.jit(
        jax.shard_map(
            jaxring.overlap(lambda x: jax.lax.psum(x, "batch"), axis_name="model"),
            mesh=m,
            in_specs=P("batch"),
            out_specs=P(),
        )
    )
    with pytest.raises(NameError, match="unbound axis name: model"):
        f(on_devices(jnp.ones(N)))
    with pytest.raises(TypeError, match="decorated with jaxring.overlap"):
        jaxring.explain(lambda x: x, 1.0)


def test_a_misspelt_axis_name_blames_the_decorators_argument():
    f = jax.jit(
        jax.shard_map(
            jaxring.overlap(lambda x: jax.lax.psum(x, "batch"), axis_name="bacth"),
            mesh=mesh(),
            in_specs=P("batch"),
            out_specs=P(),
        )
    )
    with pytest.raises(
        NameError,
        match=r"jaxring\.overlap\(axis_name='bacth'\): the "
        r"decorator's axis_name argument names 'bacth', "
        r"which no map around the decorated step binds; "
        r"the axes bound here are 'batch': pass one of "
        r"those as axis_name",
    ) as raised:
        f(on_devices(jnp.ones(N)))
    assert "jaxring.allreduce" not in str(raised.value)


@pytest.mark.parametrize("check_vma", [False, True])
def test_compiled_order_overlaps_the_backward_pass(check_vma):
    """Each layer's bucket starts before the backward computation of the layer
    below it and is done after the whole backward pass."""
    opt = optax.sgd(0.1)
    layers = 6
    params, data = init_mlp(layers=layers, width=64), batch(width=64)
    one_layer = 64 * 64 * 4 / 2**20
    ov = jaxring.overlap(
        make_step(jax.lax.pmean, opt, check_vma=check_vma),
        axis_name="batch",
        bucket_mb=one_layer,
        first_bucket_mb=one_layer,
        partition_mb=100,
    )
    f = sharded(ov, check_vma)
    m = mesh()
    hlo = (
        f.lower(params, opt.init(params), jax.device_put(data, NamedSharding(m, P("batch"))))
        .compile()
        .as_text()
    )
    entry = hlo[hlo.index("\nENTRY") :].splitlines()
    starts, dones, backward = {}, {}, {}
    for pos, line in enumerate(entry):
        layer = re.search(r'op_name="[^"]*transpose\(jvp\(layer(\d+)\)\)([^"]*)"', line)
        target = re.search(r'custom_call_target="jaxring_allreduce_(start|done)_cpu"', line)
        if target:
            bucket = int(re.search(r"jaxring_bucket(\d+)", line).group(1))
            if target.group(1) == "start":
                starts[bucket] = (pos, int(layer.group(1)) if layer else None)
            else:
                dones[bucket] = pos
        elif layer and layer.group(2).endswith(("dot_general", "transpose")):
            # The matmuls (XLA names the weight gradient's after the
            # transpose it absorbs): the bulk of a layer's backward pass.
            backward.setdefault(int(layer.group(1)), []).append(pos)
    assert sorted(backward) == list(range(layers))
    assert sorted(starts) == sorted(dones)
    last_backward = max(max(v) for v in backward.values())
    started_in = {}
    for bucket, (pos, layer) in starts.items():
        if layer is not None:
            started_in.setdefault(layer, []).append(bucket)
            if layer > 0:
                # Issued before the backward matmuls of the layer below.
                assert pos < min(backward[layer - 1]), (bucket, layer)
    # Every layer's backward pass issues at least one bucket.
    assert sorted(started_in) == list(range(layers))
    if not check_vma:
        # The gradients are first used by the optimizer: every bucket is
        # waited for after the whole backward pass. (Under check_vma, AD sums
        # some values where they are needed mid-backward, and their buckets
        # are waited for right there.)
        for bucket, pos in dones.items():
            assert pos > last_backward, bucket


def test_flax_cnn_with_batchnorm_and_train_state():
    """The flax-style step of the README, unchanged but for the decorator."""
    import flax.linen as nn
    from flax.training import train_state

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            for features in (8, 16):
                x = nn.Conv(features, (3, 3))(x)
                x = nn.BatchNorm(use_running_average=not train, axis_name="batch")(x)
                x = nn.relu(x)
            return nn.Dense(10)(x.mean(axis=(1, 2)))

    class State(train_state.TrainState):
        batch_stats: dict

    model = CNN()
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.normal(size=(N, 4, 8, 8, 3)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, (N, 4)))
    variables = model.init(jax.random.key(0), images[0], train=False)
    state = State.create(
        apply_fn=model.apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        # Not adam: a conv bias before BatchNorm has a zero
        # gradient up to rounding, which adam would scale up
        # to full steps of either sign.
        tx=optax.sgd(0.1, momentum=0.9),
    )

    def train_step(state, images, labels):
        def loss_fn(params):
            logits, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats},
                images,
                train=True,
                mutable=["batch_stats"],
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, updates

        (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        grads = jax.lax.pmean(grads, "batch")
        state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
        return state, jax.lax.pmean(loss, "batch")

    def run(step):
        f = jax.pmap(step, axis_name="batch", in_axes=(None, 0, 0))
        s, losses = state, []
        for _ in range(3):
            s, loss = f(s, images, labels)
            s = jax.tree.map(lambda a: a[0], s)
            losses.append(float(loss[0]))
        return s.params, s.batch_stats, losses

    ref = run(train_step)
    got = run(
        jaxring.overlap(axis_name="batch", bucket_mb=0.002, first_bucket_mb=0.001)(train_step)
    )
    assert_trees_close(got, ref, rtol=1e-4, atol=1e-5)


def test_psum_of_a_psum_result():
    def step(x):
        once = jax.lax.psum(x, "batch")
        return jax.lax.psum(once * 2, "batch"), jax.lax.psum(jax.lax.psum(x, "batch"), "batch")

    m = mesh()
    x = jax.device_put(jnp.arange(N * 4, dtype=jnp.float32), NamedSharding(m, P("batch")))
    run = lambda f: jax.jit(
        jax.shard_map(
            f,
            mesh=m,
            in_specs=P("batch"),
            out_specs=P(),
            check_vma=False,
        )
    )(x)
    assert_trees_close(run(jaxring.overlap(step, axis_name="batch")), run(step))


def test_overlapped_step_inside_an_unrolled_scan():
    """JAX evaluates an unrolled scan body twice: each copy's allreduces must
    be told apart."""
    opt = optax.sgd(0.1)
    params, data = init_mlp(), batch()

    def scanned(step):
        def run(p, s, d):
            def body(carry, _):
                p, s = carry
                p, s, loss, _ = step(p, s, d)
                return (p, s), loss

            (p, s), losses = jax.lax.scan(body, (p, s), None, length=4, unroll=2)
            return p, s, losses[-1], {"pred_mean": losses[0]}

        return run

    ref = train(
        sharded(scanned(make_step(jax.lax.pmean, opt)), check_vma=False), params, opt, data, steps=1
    )
    ov = jaxring.overlap(make_step(jax.lax.pmean, opt), **small_buckets())
    got = train(sharded(scanned(ov), check_vma=False), params, opt, data, steps=1)
    assert_trees_close(got, ref)


def test_python_scalar_arguments_stay_static():
    def step(x, train):
        y = x * 2 if train else x
        return jax.lax.psum(y, "batch")

    m = mesh()
    x = jax.device_put(jnp.arange(N, dtype=jnp.float32), NamedSharding(m, P("batch")))
    f = jax.jit(
        jax.shard_map(
            lambda v: jaxring.overlap(step, axis_name="batch")(v, True),
            mesh=m,
            in_specs=P("batch"),
            out_specs=P(),
        )
    )
    np.testing.assert_allclose(np.asarray(f(x)), 2 * np.arange(N).sum())


def test_a_done_takes_the_op_id_of_its_own_start():
    from jaxring._src import runtime, split_phase

    runtime.register_ffi_targets()
    m = mesh()

    def two(v):
        handles = [
            split_phase.start(
                [v * k],
                axes=("batch",),
                op="sum",
                rings=1,
                chunk_bytes=1 << 20,
                timeout_s=30.0,
                label=f"b{k}",
            )
            for k in (1, 2)
        ]
        # Waited for in the other order: each done still pairs with its start.
        second, first = (split_phase.done(h, [jax.typeof(v)])[0] for h in handles[::-1])
        return first, second

    f = jax.jit(jax.shard_map(two, mesh=m, in_specs=P("batch"), out_specs=P(), check_vma=False))
    x = jax.device_put(jnp.arange(N * 3, dtype=jnp.float32), NamedSharding(m, P("batch")))
    text = f.lower(x).as_text()
    starts = re.findall(r"jaxring_allreduce_start_cpu.*?op_id = (-?\d+)", text, re.S)
    dones = re.findall(r"jaxring_allreduce_done_cpu.*?op_id = (-?\d+)", text, re.S)
    assert len(set(starts)) == 2 and sorted(starts) == sorted(dones), (starts, dones)
    first, second = f(x)
    total = np.arange(N * 3, dtype=np.float32).reshape(N, 3).sum(0)
    np.testing.assert_allclose(np.asarray(first), total)
    np.testing.assert_allclose(np.asarray(second), 2 * total)

    def stray(v):
        return split_phase.done(jnp.int32(0), [jax.typeof(v)])[0]

    with pytest.raises(RuntimeError, match="does not come from an allreduce start"):
        jax.jit(
            jax.shard_map(stray, mesh=m, in_specs=P("batch"), out_specs=P("batch"), check_vma=False)
        ).lower(x)


def test_a_start_no_peer_joins_fails_after_the_timeout(script):
    """A split-phase allreduce that only one device starts ends in an error
    that names the missing ranks, not a hang."""
    res = script(
        """
        import jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        import jaxring
        from jaxring._src import runtime, split_phase
        runtime.register_ffi_targets()
        mesh = jax.make_mesh((4,), ("batch",))

        def reduce_alone(v):
            h = split_phase.start([v], axes=("batch",), op="sum", rings=1,
                                  chunk_bytes=1 << 20, timeout_s=1.0, label="lonely")
            return split_phase.done(h, [jax.typeof(v)])[0]

        def body(v):
            first = jax.lax.axis_index("batch") == 0
            return jax.lax.cond(first, reduce_alone, lambda u: u, v)

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("batch"),
                                  out_specs=P("batch"), check_vma=False))
        x = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P("batch")))
        try:
            jax.block_until_ready(f(x))
        except Exception as e:
            print("ERROR:", e)
        else:
            print("NO ERROR")
    """,
        devices=4,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ERROR:" in res.stdout, res.stdout
    assert (
        "timed out after 1 s" in res.stdout and "rank(s) 1, 2, 3 of 4 never arrived" in res.stdout
    ), res.stdout


def reduce_grads_again_step(optimizer):
    """The trap: under check_vma=True autodiff has summed the gradients,
    and the step reduces them once more."""

    def step(params, opt_state, data):
        def loss_fn(p):
            return jnp.mean((mlp(p, data["x"]) - data["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = jax.lax.pmean(grads, "batch")  # the line the warning names
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        loss = jax.lax.pmean(loss, "batch")
        return params, opt_state, loss, {"pred_mean": loss}

    return step


def test_gradients_autodiff_reduced_are_not_sent_again():
    opt = optax.sgd(0.1)
    params, data = init_mlp(), batch()
    step = reduce_grads_again_step(opt)
    ov = jaxring.overlap(step, axis_name="batch")
    holder = {}

    def body(p, s, d):
        holder["report"] = jaxring.explain(ov, p, s, d)
        return ov(p, s, d)

    got, messages = train_noting_warnings(sharded(body, check_vma=True), params, opt, data)
    # Computed as lax defines it (the summed gradients times 8, divided by 8).
    assert_trees_close(got, train(sharded(step, check_vma=True), params, opt, data))
    line = next(
        i
        for i, text in enumerate(open(__file__).read().splitlines(), 1)
        if "the line the warning names" in text
    )
    assert messages and all(f"test_overlap.py:{line}" in m for m in messages), messages
    assert "args[0]['layer0']['w']" in messages[0] and "check_vma" in messages[0]
    assert "8x the full-batch gradient" in messages[0]
    # Each gradient travels once: the buckets carry what the same step
    # written for check_vma=False carries (gradients and the loss).
    sent = sum(b.nbytes for b in holder["report"].buckets)
    holder.clear()
    plain = jaxring.overlap(make_step(jax.lax.pmean, opt), axis_name="batch")
    train(
        sharded(
            lambda p, s, d: (
                holder.setdefault("report", jaxring.explain(plain, p, s, d)),
                plain(p, s, d),
            )[1],
            check_vma=False,
        ),
        params,
        opt,
        data,
        steps=1,
    )
    aux_bytes = 4  # make_step also averages its aux, a float32 scalar
    assert sent == sum(b.nbytes for b in holder["report"].buckets) - aux_bytes
    assert holder["report"].computed_locally == []


@pytest.mark.parametrize("check_vma", [True, False])
def test_each_idiom_updates_as_one_device_on_the_whole_batch(check_vma):
    """The idiom for each check_vma setting, with and without overlap,
    gives the update computed from the whole batch on one device."""
    opt = optax.sgd(0.1)
    params, data = init_mlp(), batch()
    full = jax.grad(lambda p: jnp.mean((mlp(p, data["x"]) - data["y"]) ** 2))(params)
    want = jax.tree.map(lambda w, g: w - 0.1 * g, params, full)
    for step in (
        make_step(jax.lax.pmean, opt, check_vma=check_vma),
        jaxring.overlap(make_step(jax.lax.pmean, opt, check_vma=check_vma), **small_buckets()),
    ):
        got, _ = train(sharded(step, check_vma), params, opt, data, steps=1)
        assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


def test_statistics_the_step_needs_at_once_stay_out_of_the_buckets():
    """BatchNorm statistics (and their cotangents' sums in the backward
    pass) are needed before the gradients exist: they run where they are,
    as written, and only the gradients and the loss are bucketed."""

    def model(params, x):
        for i in range(len(params)):
            p = params[f"layer{i}"]
            h = x @ p["w"]
            mean = jax.lax.pmean(jnp.mean(h, axis=0), "batch")
            x = jnp.tanh(h - mean + p["b"])
        return x

    opt = optax.sgd(0.1)
    params, data = init_mlp(), batch()
    step = jaxring.overlap(make_step(jax.lax.pmean, opt, model), axis_name="batch")
    holder = {}

    def body(p, s, d):
        holder["report"] = jaxring.explain(step, p, s, d)
        holder["text"] = jax.make_jaxpr(step)(p, s, d).pretty_print()
        return step(p, s, d)

    got = train(sharded(body), params, opt, data, steps=2)
    ref = train(sharded(make_step(jax.lax.pmean, opt, model)), params, opt, data, steps=2)
    assert_trees_close(got, ref, rtol=1e-4, atol=1e-5)
    report = holder["report"]
    leaves = [leaf for b in report.buckets for leaf in b.leaves]
    # The 8 gradients, the loss and the aux metric; no statistic.
    assert len(leaves) == 2 * LAYERS + 2, leaves
    assert all("float32[32]" not in leaf or "['b']" in leaf for leaf in leaves), leaves
    (urgent,) = report.run_at_once
    # A statistic per layer forward, its cotangent's sum per layer backward.
    assert urgent.startswith(f"{2 * LAYERS} reduction(s)"), urgent
    assert "not bucketed" in str(report)
    assert holder["text"].count("psum") >= 2 * LAYERS
