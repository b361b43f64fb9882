"""benchmarks/real_step.py: the ResNet-18 step runs in every default variant,
the variants agree, and the table is printed."""

import json
import pathlib
import subprocess
import sys
import tempfile

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "real_step.py"

pytestmark = [pytest.mark.slow, pytest.mark.examples]


def test_resnet18_step_prints_the_table_and_the_variants_agree():
    with tempfile.TemporaryDirectory() as cwd:  # outside the checkout
        res = subprocess.run(
            [
                sys.executable,
                str(SCRIPT),
                "--model",
                "resnet18",
                "--devices",
                "4",
                "--per-device",
                "2",
                "--image-size",
                "16",
                "--rounds",
                "1",
                "--steps",
                "1",
                "--warmup",
                "0",
                "--json",
                "result.json",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=cwd,
        )
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        result = json.loads((pathlib.Path(cwd) / "result.json").read_text())["resnet18"]
    variants = result["variants"]
    assert set(variants) == {"plain", "overlap", "jaxring-pmean"}, result
    assert variants["plain"]["over_plain"] == 1.0, variants
    assert all(v["ms_per_step"] > 0 for v in variants.values()), variants
    # The reducing variants agree with the first of them (plain).
    assert result["reference"] == "plain", result
    assert sorted(result["agreement"]) == ["jaxring-pmean", "overlap"], result
    assert all(a["ok"] for a in result["agreement"].values()), result
    assert result["census"]["BatchNorm statistics (forward)"]["values"] == 20, result
    # The table a reader sees.
    assert "variant" in res.stdout and "ms/step" in res.stdout and "FAILED" not in res.stdout
