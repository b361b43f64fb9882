"""python -m jaxring.simulate: the model it feeds and the table it prints."""

import json
import subprocess
import sys

import pytest

from jaxring import simulate
from jaxring._src import cost_model as cm


def test_resnet50_has_its_published_parameter_count():
    layers = simulate.resnet50_layers()
    # torchvision's resnet50 (with batch norms' scale and offset): 25,557,032.
    assert sum(p for _, p, _ in layers) == 25_557_032
    # About 4.1 G multiply-adds per 224x224 image.
    assert 7.6e9 < sum(f for _, _, f in layers) < 8.4e9


def test_step_time_hides_cheap_communication_and_exposes_the_rest():
    layers = simulate.resnet50_layers()
    m = simulate.machine_for(16, simulate.PRESETS["issue"], 0.0)
    compute = 0.15
    free = simulate.step_time(layers, m, lambda mm, n: 0.0, compute, 25, 1)
    assert free == pytest.approx(compute)
    # A slow allreduce: the step is at least the buckets' communication,
    # which cannot start before the first gradients exist.
    slow = simulate.step_time(layers, m, lambda mm, n: n * 1e-9, compute, 25, 1)
    grad_bytes = 4 * sum(p for _, p, _ in layers)
    assert slow >= compute / 3 + grad_bytes * 1e-9
    assert slow < compute + grad_bytes * 1e-9


def test_tiered_plan_scales_better_at_thousands_of_gpus():
    rows = simulate.simulate(simulate.PRESETS["issue"], [8, 256, 4096], 2, 1 << 20, 25.0, 1.0, 0.0)
    assert rows[0]["flat_allreduce_s"] == pytest.approx(rows[0]["tiered_allreduce_s"])
    for r in rows:
        assert 0 < r["flat_efficiency"] <= 1 and 0 < r["tiered_efficiency"] <= 1
    big = rows[-1]
    assert big["tiered_allreduce_s"] < big["flat_allreduce_s"]
    assert big["tiered_efficiency"] > big["flat_efficiency"]
    # The allreduce time is the cost model's, for the machine of that size.
    m = simulate.machine_for(4096, simulate.PRESETS["issue"], 0.0)
    assert big["tiered_allreduce_s"] == pytest.approx(
        cm.tiered_time(m, big["grad_bytes"], 2, 1 << 20)
    )


@pytest.mark.jax_independent  # jaxring's own script
def test_command_prints_predictions_and_writes_plot(tmp_path):
    png, js = tmp_path / "s.png", tmp_path / "s.json"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxring.simulate",
            "--gpus",
            "8",
            "64",
            "512",
            "--plot",
            str(png),
            "--json",
            str(js),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "PREDICTIONS of jaxring's cost model, not measurements" in res.stdout
    assert "95% at 256 GPUs: PowerAI DDL" in res.stdout
    rows = json.loads(js.read_text())["rows"]
    assert [r["gpus"] for r in rows] == [8, 64, 512]
    assert png.stat().st_size > 10_000
    res = subprocess.run(
        [sys.executable, "-m", "jaxring.simulate", "--gpus", "12"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert res.returncode != 0 and "do not fill hosts of 8" in res.stderr
