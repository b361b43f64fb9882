"""The example trainers run, learn, and give the same curve in every mode."""

import pathlib
import subprocess
import sys
import tempfile

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def run_example(name, *args, timeout=600):
    with tempfile.TemporaryDirectory() as cwd:  # outside the checkout
        res = subprocess.run([sys.executable, str(EXAMPLES / name), "--quiet", *args],
                             capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = next(line for line in res.stdout.splitlines() if line.startswith("mode="))
    losses = next(line for line in res.stdout.splitlines() if line.startswith("losses:"))
    fields = dict(f.split("=", 1) for f in summary.split() if "=" in f)
    return fields, [float(v) for v in losses.split()[1:]]


def test_mlp_reaches_95_percent_on_digits_with_overlap():
    fields, _ = run_example("train_mlp.py", "--mode", "overlap", "--devices", "8")
    assert float(fields["accuracy"]) >= 0.95, fields


@pytest.mark.parametrize("mode", ["allreduce", "psum"])
def test_mlp_modes_give_the_same_loss_curve(mode):
    _, overlap = run_example("train_mlp.py", "--mode", "overlap", "--devices", "4",
                             "--max-steps", "10")
    _, other = run_example("train_mlp.py", "--mode", mode, "--devices", "4",
                           "--max-steps", "10")
    assert len(overlap) == len(other) == 10
    for a, b in zip(overlap, other):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (overlap, other)


def test_cnn_reaches_95_percent_with_overlap():
    fields, _ = run_example("train_cnn.py", "--mode", "overlap", "--devices", "8")
    assert float(fields["accuracy"]) >= 0.95, fields


def test_cnn_modes_agree_on_the_first_steps():
    # BatchNorm and momentum amplify float rounding (the ring and XLA sum in
    # different orders) from about 1e-6 at step 2 to 1e-4 at step 3; in
    # float64 the modes agree to 1e-16, so only the first steps are compared.
    curves = {mode: run_example("train_cnn.py", "--mode", mode, "--devices", "4",
                                "--max-steps", "3")[1]
              for mode in ("overlap", "allreduce", "psum")}
    for mode, losses in curves.items():
        assert len(losses) == 3
        for a, b in zip(losses, curves["psum"]):
            assert abs(a - b) <= 1e-3 * abs(b), (mode, curves)


def test_lm_learns_the_standard_library_with_overlap():
    fields, losses = run_example("train_lm.py", "--mode", "overlap", "--devices", "8")
    # A uniform guess over bytes is 8 bits/char; 300 steps reach about 2.5.
    assert float(fields["bits/char"]) < 3.0, fields


@pytest.mark.parametrize("mode", ["allreduce", "psum"])
def test_lm_modes_give_the_same_loss_curve(mode):
    common = ("--devices", "4", "--steps", "5", "--layers", "1", "--width", "64")
    _, overlap = run_example("train_lm.py", "--mode", "overlap", *common)
    _, other = run_example("train_lm.py", "--mode", mode, *common)
    assert len(overlap) == len(other) == 5
    for a, b in zip(overlap, other):
        assert abs(a - b) <= 1e-4 * abs(b), (overlap, other)
