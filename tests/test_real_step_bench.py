"""benchmarks/real_step.py: the ResNet-18 step runs in every default variant,
the variants agree, and the table is printed."""

import pathlib
import re
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
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=cwd,
        )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert re.search(r"variant\s+ms/step\s+/ plain", out), out
    rows = {
        m.group(1): (float(m.group(2)), float(m.group(3)))
        for m in re.finditer(
            r"^\s+(plain|overlap|jaxring-pmean)\s+([\d.]+)\s+([\d.]+)", out, re.MULTILINE
        )
    }
    assert set(rows) == {"plain", "overlap", "jaxring-pmean"}, out
    assert rows["plain"][1] == 1.0 and all(ms > 0 for ms, _ in rows.values()), rows
    assert out.count(" ok") == 2 and "FAILED" not in out, out
    assert "BatchNorm statistics (forward):   20 values" in out, out
