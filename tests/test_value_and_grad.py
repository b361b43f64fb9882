"""jaxring.value_and_grad: in a plain jit step, the loss and gradients equal
jax.value_and_grad's on the whole batch, and the compiled program averages
the gradients with jaxring's buckets, not with an XLA all-reduce."""

import pathlib
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxring

# A reduction that jaxring.overlap left alone would be sent by XLA instead.
pytestmark = pytest.mark.filterwarnings("error::jaxring.OverlapWarning")

N = 8
WIDTH = 32
LAYERS = 4


@pytest.fixture(autouse=True)
def _no_state_left_behind(no_jaxring_state_left_behind):
    yield


def mesh(kind=AxisType.Explicit, shape=(N,), names=("batch",)):
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


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
        p = params[f"layer{i}"]
        x = jnp.tanh(x @ p["w"] + p["b"])
    return x


def loss_fn(params, x, y):
    return jnp.mean((mlp(params, x) - y) ** 2)


def loss_with_aux(params, x, y):
    pred = mlp(params, x)
    loss = jnp.mean((pred - y) ** 2)
    return loss, {
        "pred_mean": jnp.mean(pred),
        "positives": jnp.sum(pred > 0),
        "per_example": jnp.sum(pred, axis=-1),
    }


def batch(seed=1, per_device=4, width=WIDTH, devices=N):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(devices * per_device, width)).astype(np.float32)
    y = rng.normal(size=(devices * per_device, width)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(y)


def assert_moments_close(got, want):
    """Optimizer states equal to rtol 1e-4, each leaf with an absolute
    tolerance of 1e-5 of its largest element."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        v = np.asarray(v)
        scale = float(np.max(np.abs(v))) if v.size else 0.0
        np.testing.assert_allclose(np.asarray(u), v, rtol=1e-4, atol=1e-5 * scale + 1e-12)


def assert_trees_close(a, b, rtol=2e-5, atol=2e-6):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(
        lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol),
        a,
        b,
    )


def placed(m, params, *batch_args, axis="batch"):
    return (
        jax.device_put(params, NamedSharding(m, P())),
        *jax.device_put(batch_args, NamedSharding(m, P(axis))),
    )


def small_buckets():
    # Buckets of about one layer each, so that there are several.
    one_layer = WIDTH * WIDTH * 4 / 2**20
    return dict(bucket_mb=one_layer, first_bucket_mb=one_layer)


# ---- values -------------------------------------------------------------------


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_matches_value_and_grad_on_the_whole_batch(kind):
    m = mesh(kind)
    params, (x, y) = init_mlp(), batch()
    want_loss, want_grads = jax.jit(jax.value_and_grad(loss_fn))(params, x, y)

    @jax.jit
    def step(params, x, y):
        return jaxring.value_and_grad(loss_fn, mesh=m, axis_name="batch", **small_buckets())(
            params, x, y
        )

    for args in (placed(m, params, x, y), (params, x, y)):  # placed, and not
        loss, grads = step(*args)
        assert loss.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(loss), np.asarray(want_loss), rtol=2e-6)
        assert_trees_close(grads, want_grads)
        assert all(g.sharding.is_fully_replicated for g in jax.tree.leaves(grads))


def test_outside_jit_compiles_once():
    m = mesh()
    params, (x, y) = init_mlp(), batch()
    traces = []

    def counted(params, x, y):
        traces.append(1)
        return loss_fn(params, x, y)

    vg = jaxring.value_and_grad(counted, mesh=m, axis_name="batch")
    want = jax.value_and_grad(loss_fn)(params, x, y)
    assert_trees_close(vg(params, x, y), want)
    assert_trees_close(vg(params, x + 0, y), want)
    assert len(traces) == 1


def test_two_axis_mesh_and_a_tuple_axis_name():
    params, (x, y) = init_mlp(), batch()
    want = jax.value_and_grad(loss_fn)(params, x, y)
    m = mesh(shape=(4, 2), names=("data", "model"))
    for axis, spec in (("data", P("data")), (("data", "model"), P(("data", "model")))):
        got = jax.jit(jaxring.value_and_grad(loss_fn, mesh=m, axis_name=axis))(
            jax.device_put(params, NamedSharding(m, P())),
            *jax.device_put((x, y), NamedSharding(m, spec)),
        )
        assert_trees_close(got, want)


def test_batch_args_may_be_pytrees():
    m = mesh()
    params, (x, y) = init_mlp(), batch()

    def dict_loss(params, data):
        return loss_fn(params, data["x"], data["y"])

    got = jax.jit(jaxring.value_and_grad(dict_loss, mesh=m, axis_name="batch"))(
        params, {"x": x, "y": y}
    )
    assert_trees_close(got, jax.value_and_grad(loss_fn)(params, x, y))


def test_has_aux_stacks_each_shards_aux():
    m = mesh()
    params, (x, y) = init_mlp(), batch()
    (want_loss, want_aux), want_grads = jax.value_and_grad(loss_with_aux, has_aux=True)(
        params, x, y
    )
    (loss, aux), grads = jax.jit(
        jaxring.value_and_grad(loss_with_aux, mesh=m, axis_name="batch", has_aux=True)
    )(*placed(m, params, x, y))
    np.testing.assert_allclose(np.asarray(loss), np.asarray(want_loss), rtol=2e-6)
    assert_trees_close(grads, want_grads)
    # Row i is shard i's aux: the loss function on that shard's examples.
    # It stays where it was computed, split over the axis.
    assert aux["pred_mean"].shape == (N,)
    assert aux["pred_mean"].sharding.spec == P("batch")
    rows = jax.device_get(aux)
    for i in range(N):
        examples = slice(i * 4, (i + 1) * 4)
        _, local = loss_with_aux(params, x[examples], y[examples])
        assert_trees_close(jax.tree.map(lambda a: a[i], rows), local)
    np.testing.assert_allclose(
        np.asarray(aux["pred_mean"].mean(0)),
        np.asarray(want_aux["pred_mean"]),
        rtol=1e-5,
        atol=1e-7,
    )
    assert aux["positives"].dtype == want_aux["positives"].dtype
    assert int(aux["positives"].sum()) == int(want_aux["positives"])
    np.testing.assert_allclose(
        np.asarray(aux["per_example"]).reshape(-1),
        np.asarray(want_aux["per_example"]),
        rtol=1e-5,
        atol=1e-6,
    )


def test_adam_step_in_jit_equals_the_one_device_update():
    m = mesh()
    opt = optax.adam(1e-2)
    params, (x, y) = init_mlp(), batch()

    def make_step(grad_fn):
        @jax.jit
        def step(params, opt_state, x, y):
            loss, grads = grad_fn(params, x, y)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return step

    one_device = make_step(jax.value_and_grad(loss_fn))
    ring = make_step(jaxring.value_and_grad(loss_fn, mesh=m, axis_name="batch", **small_buckets()))
    want = (params, opt.init(params))
    p, xs, ys = placed(m, params, x, y)
    got = (p, jax.device_put(opt.init(params), NamedSharding(m, P())))
    for _ in range(3):
        *want, want_loss = one_device(*want, x, y)
        *got, loss = ring(*got, xs, ys)
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
        assert_trees_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        # Adam's update hardly depends on the gradients' scale: gradients
        # reduced twice (n times too large) would pass the check above, not
        # this one of its moments. An element far smaller than the rest of
        # its leaf is a sum that mostly cancelled: its float32 rounding is
        # that of the leaf's larger terms, which the 8 devices sum in
        # another order than one device does. So the absolute tolerance
        # scales with each leaf, 1e-5 of its largest element (seen: 1.5e-6),
        # far below the 7x error of a double reduction.
        assert_moments_close(got[1], want[1])


def test_overlap_options_pass_through(capsys):
    m = mesh()
    params, (x, y) = init_mlp(), batch()
    vg = jaxring.value_and_grad(
        loss_fn, mesh=m, axis_name="batch", report=True, wire_dtype="bfloat16", **small_buckets()
    )
    opts = vg.jaxring_overlap_options
    assert opts.axis_name == "batch" and opts.wire_dtype == np.dtype(jnp.bfloat16)
    assert opts.bucket_mb == small_buckets()["bucket_mb"]
    loss, grads = jax.jit(vg)(*placed(m, params, x, y))
    assert re.search(r"jaxring.overlap: \d+ bucket\(s\)", capsys.readouterr().out)
    # bfloat16 on the wire: close to the float32 result, not equal.
    assert_trees_close(
        (loss, grads), jax.value_and_grad(loss_fn)(params, x, y), rtol=2e-2, atol=2e-3
    )


# ---- the compiled program ------------------------------------------------------


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_compiled_step_uses_jaxring_buckets_and_no_xla_all_reduce(kind):
    m = mesh(kind)
    opt = optax.sgd(0.1)
    params, (x, y) = init_mlp(), batch()

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jaxring.value_and_grad(loss_fn, mesh=m, axis_name="batch", **small_buckets())(
            params, x, y
        )
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    hlo = (
        step.lower(*placed(m, params, x, y)[:1], opt.init(params), *placed(m, params, x, y)[1:])
        .compile()
        .as_text()
    )
    starts = re.findall(r'custom_call_target="jaxring_allreduce_start_cpu"', hlo)
    dones = re.findall(r'custom_call_target="jaxring_allreduce_done_cpu"', hlo)
    buckets = set(re.findall(r"jaxring_bucket(\d+)", hlo))
    assert len(starts) == len(dones) == len(buckets) >= LAYERS, (len(starts), buckets)
    assert not re.search(r"\ball-reduce(-start)?\(", hlo)
    assert not re.search(r"\b(all-gather|reduce-scatter|collective-permute)", hlo)


# ---- errors -------------------------------------------------------------------


def test_params_split_over_the_batch_axis_are_refused():
    params, (x, y) = init_mlp(), batch()
    for kind in (AxisType.Explicit, AxisType.Auto):
        m = mesh(kind)
        split = dict(
            params,
            layer0=dict(
                params["layer0"],
                w=jax.device_put(params["layer0"]["w"], NamedSharding(m, P("batch"))),
            ),
        )
        vg = jaxring.value_and_grad(loss_fn, mesh=m, axis_name="batch")
        # A concrete array's sharding is known outside jit ...
        with pytest.raises(
            ValueError,
            match=r"params\['layer0'\]\['w'\] is split over "
            r"'batch', the batch axis",
        ):
            vg(split, x, y)
    # ... and inside jit on a mesh of explicit axes, from the abstract value.
    m = mesh(AxisType.Explicit)
    split = jax.device_put(params, NamedSharding(m, P("batch")))
    with pytest.raises(ValueError, match="params must be replicated over it"):
        jax.jit(jaxring.value_and_grad(loss_fn, mesh=m, axis_name="batch"))(split, x, y)


@pytest.mark.parametrize("bad", [(30, WIDTH), ()])
def test_batch_that_does_not_split_evenly_is_refused(bad):
    m = mesh()
    params, (x, y) = init_mlp(), batch()
    vg = jax.jit(jaxring.value_and_grad(loss_fn, mesh=m, axis_name="batch"))
    with pytest.raises(
        ValueError,
        match=rf"batch argument 2 has shape {re.escape(str(bad))}; "
        r".*divisible by the size of 'batch' \(8\)",
    ):
        vg(params, x, jnp.zeros(bad, jnp.float32))
    with pytest.raises(ValueError, match=r"batch argument 1\['x'\] has shape \(12, 32\)"):
        jaxring.value_and_grad(lambda p, d: loss_fn(p, d["x"], d["y"]), mesh=m, axis_name="batch")(
            params, {"x": x[:12], "y": y}
        )


def test_axis_not_in_the_mesh_is_refused():
    with pytest.raises(
        ValueError,
        match=r"axis_name 'data' is not an axis of the mesh, "
        r"whose axes are \('batch',\)",
    ):
        jaxring.value_and_grad(loss_fn, mesh=mesh(), axis_name="data")
    with pytest.raises(TypeError, match="axis_name must be a mesh axis name"):
        jaxring.value_and_grad(loss_fn, mesh=mesh(), axis_name=0)


def test_no_batch_argument_is_refused():
    m = mesh()
    vg = jaxring.value_and_grad(lambda p: jnp.sum(p**2), mesh=m, axis_name="batch")
    with pytest.raises(ValueError, match="needs at least one batch argument"):
        jax.jit(vg)(jnp.ones(3))


def test_wrong_mesh_type_is_refused():
    for bad in ("batch", jax.devices(), mesh().abstract_mesh):
        with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
            jaxring.value_and_grad(loss_fn, mesh=bad, axis_name="batch")


def test_unknown_keywords_are_refused():
    with pytest.raises(
        TypeError,
        match=r"unexpected keyword argument\(s\) bucket_size; "
        r"the options it passes on to jaxring.overlap are "
        r"bucket_mb, first_bucket_mb",
    ):
        jaxring.value_and_grad(loss_fn, mesh=mesh(), axis_name="batch", bucket_size=4)
    with pytest.raises(ValueError, match="bucket_mb must be a positive number"):
        jaxring.value_and_grad(loss_fn, mesh=mesh(), axis_name="batch", bucket_mb=0)
    vg = jaxring.value_and_grad(loss_fn, mesh=mesh(), axis_name="batch")
    params, (x, y) = init_mlp(), batch()
    with pytest.raises(TypeError, match=r"takes \(params, \*batch_args\) only, got keyword"):
        vg(params, x, y=y)


def test_inside_a_shard_map_over_the_axis_is_refused():
    m = mesh()
    params, (x, y) = init_mlp(), batch()
    vg = jaxring.value_and_grad(loss_fn, mesh=m, axis_name="batch")
    inner = jax.shard_map(
        lambda p, x, y: vg(p, x, y),
        mesh=m,
        in_specs=(P(), P("batch"), P("batch")),
        out_specs=P(),
        check_vma=False,
    )
    with pytest.raises(ValueError, match="already maps 'batch'; there, take"):
        jax.jit(inner)(*placed(m, params, x, y))


def test_a_jit_step_compiles_to_the_program_of_the_shard_map_step():
    """The optimizer outside the shard_map costs nothing: once partitioned,
    the jit step with jaxring.value_and_grad is the shard_map step under
    jaxring.overlap (the benchmark compares the compiled entry computations)."""
    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "jit_value_and_grad.py"
    with tempfile.TemporaryDirectory() as cwd:
        res = subprocess.run(
            [
                sys.executable,
                str(script),
                "--devices",
                "4",
                "--layers",
                "2",
                "--width",
                "64",
                "--rounds",
                "1",
                "--steps",
                "1",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=cwd,
        )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "the two jaxring variants compile to the same program: yes" in res.stdout, res.stdout
