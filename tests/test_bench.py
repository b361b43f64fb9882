"""jaxring-bench: its table and its plot, on a few small sizes."""

import json
import pathlib
import subprocess
import sys

import pytest


def test_bench_prints_the_table_and_writes_the_plot(tmp_path):
    png = tmp_path / "busbw.png"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxring.bench",
            "--devices",
            "2",
            "--min-bytes",
            "4K",
            "--max-bytes",
            "64K",
            "--min-time",
            "0.05",
            "--rounds",
            "1",
            "--plot",
            str(png),
            "--json",
            str(tmp_path / "rows.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["bytes"] for r in rows] == [4 << 10, 16 << 10, 64 << 10], rows
    for r in rows:
        assert r["jaxring_busbw"] > 0 and r["psum_busbw"] > 0, r
        assert r["speedup"] == pytest.approx(r["psum_s"] / r["jaxring_s"]), r
    # One table row per size, as printed.
    assert sum(1 for l in res.stdout.splitlines() if l.rstrip().endswith("x")) == 3, res.stdout
    assert f"plot written to {png}" in res.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.jax_independent  # processes and transports
def test_process_benchmark_prints_every_job_with_its_launcher_settings(tmp_path):
    """benchmarks/tcp_allreduce.py on two small sizes: the shared-memory,
    TCP and in-process jobs each give a row per size (with --exchange, the
    exchange algorithm's too; the shared-memory job, direct over the host
    segment too), and the table names the launcher options it passed
    on."""
    import pathlib

    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "tcp_allreduce.py"
    res = subprocess.run(
        [
            sys.executable,
            str(script),
            "--processes",
            "2",
            "--min-bytes",
            "4K",
            "--max-bytes",
            "16K",
            "--rounds",
            "1",
            "--cpu-bind",
            "cores",
            "--keep-freed-memory",
            "--exchange",
            "--plot",
            "",
            "--json",
            str(tmp_path / "rows.json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    head = next(l for l in res.stdout.splitlines() if l.startswith("# 2 processes"))
    assert head.endswith("; jaxring.launch --cpu-bind cores --keep-freed-memory"), head
    # The ratio columns of every job pair.
    for ratio in ("shm/gloo", "shm/direct", "shm exch/ring", "tcp exch/ring", "xdir/direct"):
        assert ratio in res.stdout, res.stdout
    jobs = json.loads((tmp_path / "rows.json").read_text())["2"]
    # The shared-memory job: jaxring, gloo, direct over the host segment, the
    # ring and the exchange; the TCP job: jaxring, gloo, ring, exchange; the
    # one-process job: jaxring.
    columns = {
        "auto": ("jaxring", "gloo", "host_direct", "ring", "exchange"),
        "tcp": ("jaxring", "gloo", "ring", "exchange"),
        "direct": ("jaxring",),
    }
    assert sorted(jobs) == sorted(columns), jobs
    for job, kinds in columns.items():
        assert [r["bytes"] for r in jobs[job]] == [4 << 10, 16 << 10], jobs[job]
        for r in jobs[job]:
            assert all(r[f"{k}_busbw"] > 0 for k in kinds), (job, r)


@pytest.mark.jax_independent  # the script's table
def test_overlap_benchmark_prints_every_variant_and_the_bound(tmp_path):
    """benchmarks/overlap_cnn.py on a small CNN: every variant is timed and
    the ratios (with and without gang start) and the bound are printed."""
    import pathlib

    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "overlap_cnn.py"
    res = subprocess.run(
        [
            sys.executable,
            str(script),
            "--devices",
            "4",
            "--layers",
            "4",
            "--width",
            "32",
            "--image",
            "16",
            "--per-device-batch",
            "4",
            "--rounds",
            "1",
            "--link",
            "1Gbit,20us",
            "--sweep",
            "0.25",
            "--timeline",
            str(tmp_path / "t.json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    for name in ("compute", "comm", "serialized", "overlap", "overlap, no gang"):
        assert f"{name}:" in out, out
    for line in (
        "overlap / serialized",
        "overlap / max(compute, comm)",
        "without gang start:",
        "first bucket ready on every device after",
        "bound for any schedule, max(compute, comm) / serialized",
        "bound within the step, max(compute, first ready + comm) =",
        "bucket_mb=0.25",
        "best: bucket_mb=",
    ):
        assert line in out, out
    assert (tmp_path / "t.json").stat().st_size > 0


@pytest.mark.jax_independent  # jaxring's own script
def test_exchange_crossover_prints_measured_and_modelled_ratios(tmp_path):
    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "exchange_crossover.py"
    res = subprocess.run(
        [
            sys.executable,
            str(script),
            "--links",
            "41Mbit,50us",
            "--devices",
            "4",
            "--sizes",
            "256",
            "64K",
            "--calls",
            "2",
            "--rounds",
            "1",
            "--json",
            str(tmp_path / "rows.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["bytes"] for r in rows] == [256, 64 << 10], rows
    assert all(r["ring_ms"] > 0 and r["exchange_ms"] > 0 for r in rows), rows
    # The model's choice on this link: the exchange for 256 B, the ring for 64 KiB.
    assert [r["auto_picks"] for r in rows] == ["exchange", "ring"], rows
