"""examples/train_jit.py: its plain jit step with jaxring.value_and_grad
makes the update one device makes from the whole batch, and learns."""

import pathlib
import re
import subprocess
import sys
import tempfile

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_jit.py"

pytestmark = pytest.mark.examples


def run(*args, timeout=600):
    with tempfile.TemporaryDirectory() as cwd:  # outside the checkout
        res = subprocess.run(
            [sys.executable, str(SCRIPT), "--quiet", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
        )
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    summary = next(line for line in lines if line.startswith("mode="))
    fields = dict(f.split("=", 1) for f in summary.split() if "=" in f)
    losses = next(line for line in lines if line.startswith("losses:"))
    return fields, [float(v) for v in losses.split()[1:]], res.stdout


def test_first_update_equals_the_one_device_full_batch_update():
    fields, losses, out = run("--devices", "8", "--steps", "3", "--check-update")
    assert fields["mode"] == "overlap" and len(losses) == 3
    check = dict(
        re.findall(
            r"(\w+)=([-\d.e+]+)",
            next(line for line in out.splitlines() if line.startswith("update check:")),
        )
    )
    check = {k: float(v) for k, v in check.items()}
    # Adam's first update is nearly lr * sign(gradient), so it barely shows
    # the gradients' scale; its first moment, the averaged gradient itself,
    # does: gradients reduced twice would make it 8 times too large.
    assert check["update"] > 0 and check["params_diff"] <= 1e-3 * check["update"], check
    assert check["mu"] > 0 and check["mu_diff"] <= 1e-5 * check["mu"], check


def test_same_loss_curve_as_xlas_all_reduce():
    _, overlap, _ = run("--mode", "overlap", "--devices", "4", "--steps", "10")
    _, xla, _ = run("--mode", "psum", "--devices", "4", "--steps", "10")
    assert len(overlap) == len(xla) == 10
    for a, b in zip(overlap, xla):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (overlap, xla)


@pytest.mark.slow
def test_reaches_95_percent_on_digits():
    fields, _, _ = run("--devices", "8")
    assert float(fields["accuracy"]) >= 0.95, fields
