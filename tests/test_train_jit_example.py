"""examples/train_jit.py: its plain jit step with jaxring.value_and_grad
makes the update one device makes from the whole batch, and learns."""

import json
import pathlib
import subprocess
import sys
import tempfile

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_jit.py"

pytestmark = pytest.mark.examples


def run(*args, timeout=600):
    """The trainer's summary (its --result) and its losses."""
    with tempfile.TemporaryDirectory() as cwd:  # outside the checkout
        res = subprocess.run(
            [sys.executable, str(SCRIPT), "--quiet", "--result", "result.json", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        summary = json.loads((pathlib.Path(cwd) / "result.json").read_text())
    return summary, summary["losses"]


def test_first_update_equals_the_one_device_full_batch_update():
    fields, losses = run("--devices", "8", "--steps", "3", "--check-update")
    assert fields["mode"] == "overlap" and len(losses) == 3
    check = fields["update_check"]
    # Adam's first update is nearly lr * sign(gradient), so it barely shows
    # the gradients' scale; its first moment, the averaged gradient itself,
    # does: gradients reduced twice would make it 8 times too large.
    assert check["update"] > 0 and check["params_diff"] <= 1e-3 * check["update"], check
    assert check["mu"] > 0 and check["mu_diff"] <= 1e-5 * check["mu"], check


def test_same_loss_curve_as_xlas_all_reduce():
    _, overlap = run("--mode", "overlap", "--devices", "4", "--steps", "10")
    _, xla = run("--mode", "psum", "--devices", "4", "--steps", "10")
    assert len(overlap) == len(xla) == 10
    for a, b in zip(overlap, xla):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (overlap, xla)


@pytest.mark.slow
def test_reaches_95_percent_on_digits():
    fields, _ = run("--devices", "8")
    assert fields["test_accuracy"] >= 0.95, fields
