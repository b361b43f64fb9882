"""jaxring-bench: its table and its plot, on a few small sizes."""

import subprocess
import sys


def test_bench_prints_the_table_and_writes_the_plot(tmp_path):
    png = tmp_path / "busbw.png"
    res = subprocess.run(
        [sys.executable, "-m", "jaxring.bench", "--devices", "2", "--min-bytes", "4K",
         "--max-bytes", "64K", "--min-time", "0.05", "--rounds", "1", "--plot", str(png)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [l for l in res.stdout.splitlines() if l.strip().endswith("x") and "|" in l]
    assert [r.split()[0:2] for r in rows] == [["4", "KiB"], ["16", "KiB"], ["64", "KiB"]], res.stdout
    assert f"plot written to {png}" in res.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
