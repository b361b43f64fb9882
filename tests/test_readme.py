"""Every Python block of the README runs, so the README cannot rot."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_examples():
    assert BLOCKS


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_block_runs(script, i):
    res = script(BLOCKS[i], devices=8, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
