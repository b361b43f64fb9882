"""The example trainers run, learn, and give the same curve in every mode."""

import functools
import json
import pathlib
import subprocess
import sys
import tempfile

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"

pytestmark = pytest.mark.examples


def run_example(name, *args, timeout=600):
    """The trainer's summary (its --result) and its losses."""
    with tempfile.TemporaryDirectory() as cwd:  # outside the checkout
        res = subprocess.run(
            [sys.executable, str(EXAMPLES / name), "--quiet", "--result", "result.json", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        summary = json.loads((pathlib.Path(cwd) / "result.json").read_text())
    return summary, summary["losses"]


def test_quickstart_learns_without_an_overlap_warning():
    with tempfile.TemporaryDirectory() as cwd:  # outside the checkout
        res = subprocess.run(
            [sys.executable, "-W", "error::UserWarning", str(EXAMPLES / "quickstart_overlap.py")],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=cwd,
        )
    assert res.returncode == 0, res.stderr[-3000:]
    losses = [
        float(line.split()[-1]) for line in res.stdout.splitlines() if line.startswith("step")
    ]
    assert len(losses) == 5 and losses[-1] < 0.25 * losses[0], res.stdout


# Training to accuracy runs on the newest jax only (the slow tier); the
# older releases check the trainers' updates and loss curves.
@pytest.mark.slow
def test_mlp_reaches_95_percent_on_digits_with_overlap():
    fields, _ = run_example("train_mlp.py", "--mode", "overlap", "--devices", "8")
    assert fields["test_accuracy"] >= 0.95, fields


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["wire16", "powersgd"])
def test_mlp_reaches_95_percent_with_compression_under_overlap(compression):
    fields, _ = run_example(
        "train_mlp.py", "--mode", "overlap", "--devices", "8", "--compression", compression
    )
    assert fields["compression"] == compression
    assert fields["test_accuracy"] >= 0.95, fields


# The older releases compare with lax (psum); the allreduce mode's first
# update is checked on every jax below.
@pytest.mark.parametrize("mode", [pytest.param("allreduce", marks=pytest.mark.slow), "psum"])
def test_mlp_modes_give_the_same_loss_curve(mode):
    _, overlap = run_example(
        "train_mlp.py", "--mode", "overlap", "--devices", "4", "--max-steps", "10"
    )
    _, other = run_example("train_mlp.py", "--mode", mode, "--devices", "4", "--max-steps", "10")
    assert len(overlap) == len(other) == 10
    for a, b in zip(overlap, other):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (overlap, other)


@pytest.mark.slow
def test_cnn_reaches_95_percent_with_overlap():
    fields, _ = run_example("train_cnn.py", "--mode", "overlap", "--devices", "8")
    assert fields["test_accuracy"] >= 0.95, fields


@functools.cache
def cnn_curve(*args) -> tuple:
    """The losses of 4 steps of train_cnn.py on 4 devices; one run per set
    of arguments, which the CNN tests share (each run is 10-15 s)."""
    return tuple(run_example("train_cnn.py", "--devices", "4", "--max-steps", "4", *args)[1])


@pytest.mark.slow
def test_cnn_powersgd_warm_up_steps_average_uncompressed_then_compress():
    # Loss k is taken before update k: with 2 warm-up steps the first three
    # losses are those of uncompressed training, the fourth is not; without
    # a warm-up the second already differs.
    curves = {
        name: cnn_curve(*args)
        for name, args in (
            ("none", ("--mode", "overlap")),
            ("warm", ("--mode", "overlap", "--compression", "powersgd", "--warm-up-steps", "2")),
            ("cold", ("--mode", "overlap", "--compression", "powersgd")),
        )
    }
    for a, b in zip(curves["warm"][:3], curves["none"][:3]):
        assert abs(a - b) <= 1e-4 * abs(b), curves
    assert abs(curves["warm"][3] - curves["none"][3]) > 1e-3, curves
    assert abs(curves["cold"][1] - curves["none"][1]) > 1e-3, curves


def test_cnn_warm_up_steps_need_powersgd():
    with tempfile.TemporaryDirectory() as cwd:
        res = subprocess.run(
            [sys.executable, str(EXAMPLES / "train_cnn.py"), "--warm-up-steps", "5"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=cwd,
        )
    assert res.returncode == 2 and "use it with --compression powersgd" in res.stderr


@pytest.mark.slow
def test_cnn_modes_agree_on_the_first_steps():
    # BatchNorm and momentum amplify float rounding (the ring and XLA sum in
    # different orders) from about 1e-6 at step 2 to 1e-4 at step 3; in
    # float64 the modes agree to 1e-16, so only the first steps are compared.
    curves = {mode: cnn_curve("--mode", mode)[:3] for mode in ("overlap", "allreduce", "psum")}
    for mode, losses in curves.items():
        assert len(losses) == 3
        for a, b in zip(losses, curves["psum"]):
            assert abs(a - b) <= 1e-3 * abs(b), (mode, curves)


@pytest.mark.slow
def test_cnn_wire16_makes_as_many_buckets_as_the_bf16_wire(tmp_path):
    # The same gradients in the same 16-bit format: wire16's allreduces must
    # share buckets as overlap(wire_dtype=...)'s do (a leaf's result used
    # before the next leaf's allreduce was issued once gave every leaf an
    # allreduce of its own: 44 buckets a step against 17).
    counts = {}
    for name, args in (
        ("bf16", ("--wire-dtype", "bfloat16")),
        ("wire16", ("--compression", "wire16")),
    ):
        trace = tmp_path / f"{name}.json"
        run_example(
            "train_cnn.py", "--devices", "4", "--max-steps", "3", "--timeline", str(trace), *args
        )
        events = json.loads(trace.read_text())
        events = events["traceEvents"] if isinstance(events, dict) else events
        # Buckets, not spans: a bucket carries an allreduce per dtype, and
        # wire16 leaves the float32 metrics in float32.
        counts[name] = len({e["name"] for e in events if e.get("ph") == "X" and e.get("tid") == 0})
    assert counts["wire16"] == counts["bf16"] > 0, counts


@pytest.mark.slow
def test_cnn_local_batch_norm_makes_no_batch_norm_allreduces():
    # Synced BatchNorm averages its statistics in the forward and the
    # backward pass, each average a reduction the step waits for at once,
    # which jaxring.overlap leaves as written; with --batch-norm local only
    # the gradients and the logged values remain, all in buckets.
    reports = {}
    for mode in ("sync", "local"):
        with tempfile.TemporaryDirectory() as cwd:
            res = subprocess.run(
                [
                    sys.executable,
                    str(EXAMPLES / "train_cnn.py"),
                    "--quiet",
                    "--devices",
                    "4",
                    "--max-steps",
                    "2",
                    "--report",
                    "--batch-norm",
                    mode,
                ],
                capture_output=True,
                text=True,
                timeout=600,
                cwd=cwd,
            )
        assert res.returncode == 0, res.stderr[-3000:]
        reports[mode] = [
            l for l in res.stdout.splitlines() if "jaxring.overlap" in l or "not bucketed" in l
        ]
    assert any("not bucketed: 16 reduction(s)" in l for l in reports["sync"]), reports
    assert reports["local"] and not any("not bucketed" in l for l in reports["local"]), reports


@pytest.mark.slow
def test_lm_learns_the_standard_library_with_overlap():
    fields, losses = run_example("train_lm.py", "--mode", "overlap", "--devices", "8")
    # A uniform guess over bytes is 8 bits/char; 300 steps reach about 2.5.
    assert fields["bits_per_char"] < 3.0, fields


@pytest.mark.parametrize("mode", [pytest.param("allreduce", marks=pytest.mark.slow), "psum"])
def test_lm_modes_give_the_same_loss_curve(mode):
    common = ("--devices", "4", "--steps", "5", "--layers", "1", "--width", "64")
    _, overlap = run_example("train_lm.py", "--mode", "overlap", *common)
    _, other = run_example("train_lm.py", "--mode", mode, *common)
    assert len(overlap) == len(other) == 5
    for a, b in zip(overlap, other):
        assert abs(a - b) <= 1e-4 * abs(b), (overlap, other)


@pytest.mark.slow  # the timeline is jaxring's own: test_timeline.py covers every jax
def test_lm_timeline_spans_its_last_ten_steps(tmp_path):
    """--timeline records every step from max(1, steps - 10) on (the first
    step compiles), and says so; stopping before that records nothing."""
    common = ("--devices", "2", "--layers", "1", "--width", "64")

    def spans(steps):
        path = tmp_path / f"{steps}.json"
        out = subprocess.run(
            [
                sys.executable,
                str(EXAMPLES / "train_lm.py"),
                "--quiet",
                *common,
                "--steps",
                str(steps),
                "--timeline",
                str(path),
                "--result",
                str(tmp_path / "result.json"),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads((tmp_path / "result.json").read_text())
        assert result["timeline_steps"] == [max(2, steps - 9), steps], result
        assert f"timeline of steps {max(2, steps - 9)} to {steps}:" in out.stdout
        trace = json.loads(path.read_text())
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        return sum(1 for e in events if e.get("ph") == "X" and e.get("tid") == 0)

    # Steps 2..5 against 3..12: the same buckets per step, 4 steps against 10.
    four, ten = spans(5), spans(12)
    assert four > 0 and ten * 4 == four * 10, (four, ten)
    early = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "train_lm.py"),
            "--quiet",
            *common,
            "--steps",
            "12",
            "--eval-every",
            "1",
            "--target-loss",
            "100",
            "--timeline",
            str(tmp_path / "no.json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert early.returncode == 0, early.stderr[-3000:]
    assert "no timeline: the run ended at step 1," in early.stdout
    assert not (tmp_path / "no.json").exists()


def run_launched(name, *args, timeout=600):
    """The example as 2 processes of 2 devices each; process 0's losses."""
    with tempfile.TemporaryDirectory() as cwd:
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "jaxring.launch",
                "-n",
                "2",
                "--devices-per-process",
                "2",
                str(EXAMPLES / name),
                "--quiet",
                "--result",
                "result-{process}.json",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
        )
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        by_rank = {
            p: json.loads((pathlib.Path(cwd) / f"result-{p}.json").read_text())["losses"]
            for p in (0, 1)
        }
    assert by_rank[0] == by_rank[1], res.stdout[-3000:]
    return by_rank[0]


# train_cnn.py runs with wire16 only: the plain one adds nothing worth its
# minute (the MLP covers the plain path, wire16 the BatchNorm CNN's). On
# the older jax releases test_multiprocess.py's launched checks stand for
# these.
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(
    "name,steps",
    [
        ("train_mlp.py", ("--max-steps", "6")),
        ("train_lm.py", ("--steps", "4", "--layers", "1", "--width", "64")),
        ("train_mlp.py", ("--max-steps", "6", "--compression", "powersgd")),
        ("train_cnn.py", ("--max-steps", "3", "--compression", "wire16")),
    ],
)
def test_example_under_the_launcher_matches_one_process(name, steps):
    """2 processes x 2 devices (direct over the host segment) train as 1
    process of 4 devices does: every process draws the same batches from
    the seed."""
    launched = run_launched(name, "--mode", "overlap", *steps)
    _, alone = run_example(name, "--mode", "overlap", "--devices", "4", *steps)
    assert len(launched) == len(alone) > 0
    # A 16-bit wire rounds partial sums, whose order may differ across
    # processes from one process's (the exchange for BatchNorm's small
    # allreduces, say); BatchNorm amplifies that.
    tolerance = 1e-3 if "wire16" in steps else 1e-5
    for a, b in zip(launched, alone):
        assert abs(a - b) <= tolerance * abs(b), (launched, alone)


@pytest.mark.parametrize(
    "name,mode",
    [
        ("train_mlp.py", "overlap"),
        ("train_mlp.py", "allreduce"),
        ("train_cnn.py", "overlap"),
        ("train_lm.py", "overlap"),
        pytest.param("train_lm.py", "psum", marks=pytest.mark.slow),
    ],
)
def test_trainer_updates_as_one_device_on_the_whole_batch(name, mode):
    """One step of the trainer (SGD) against the same step run on one
    device with the whole batch: an extra or a missing gradient reduction
    is off by the device count."""
    with tempfile.TemporaryDirectory() as cwd:  # outside the checkout
        res = subprocess.run(
            [sys.executable, str(EXAMPLES / name), "--check-update", "--mode", mode],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=cwd,
        )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "update check:" in res.stdout


def test_quickstart_updates_as_one_device_on_the_whole_batch():
    """examples/quickstart_overlap.py's step, with SGD in place of Adam
    (whose update hardly changes with the gradient's scale), against the
    gradient of the whole batch on one device."""
    code = f"""
        import importlib.util, sys
        import jax, jax.numpy as jnp, numpy as np, optax
        from jax.sharding import NamedSharding, PartitionSpec as P
        sys.path.insert(0, {str(EXAMPLES)!r})
        spec = importlib.util.spec_from_file_location("quickstart", {str(EXAMPLES / "quickstart_overlap.py")!r})
        q = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(q)        # defines the step; trains only as __main__
        q.opt = optax.sgd(1.0)
        x, y = q.batch()
        xs, ys = (jax.device_put(a, NamedSharding(q.mesh, P("batch"))) for a in (x, y))
        new, _, _ = q.train_step(q.params, q.opt.init(q.params), xs, ys)
        grads = jax.grad(q.loss_fn)(q.params, x, y)
        for k in grads:
            np.testing.assert_allclose(np.asarray(q.params[k] - new[k]), np.asarray(grads[k]),
                                       rtol=1e-4, atol=1e-6)
        print("ok")
    """
    from conftest import run_script

    res = run_script(code, devices=None)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
