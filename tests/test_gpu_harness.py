"""The GPU checks' harness, on CPU: the job launcher (one deadline, a log
file per rank, SIGABRT with stack dumps for a rank that hangs), the choice
of how ranks share a GPU by NCCL version, and the NaN-aware comparison of
reduce kernels, the device script's runner (budget, step limits, summary,
packed logs) and the compiled-order check of the overlap test. A GPU run is
rare and short, so what decides whether it yields evidence is tested where
it is cheap."""

import os
import signal
import subprocess
import sys
import tarfile
import time

import numpy as np
import pytest

from jaxring import _jaxring

# The harness is test scaffolding of jaxring's own, whatever the jax.
pytestmark = pytest.mark.jax_independent

GPU_DIR = os.path.join(os.path.dirname(__file__), "gpu")
sys.path.insert(0, GPU_DIR)
import gpu_worker  # noqa: E402


def test_a_hanging_rank_is_stopped_at_the_deadline_with_its_stack(tmp_path):
    t0 = time.monotonic()
    # 15 s: each rank imports jaxring (and JAX) before it reaches its mode.
    (rc0, out0), (rc1, out1) = gpu_worker.launch(
        2, "selftest_hang", timeout=15, log_dir=str(tmp_path)
    )
    took = time.monotonic() - t0
    assert took < 15 + 5 + 5, took
    assert rc0 == 0 and out0.rstrip().endswith("OK"), out0
    assert rc1 == -signal.SIGABRT, (rc1, out1)
    # Python's fault handler shows where the rank was stuck.
    assert "Fatal Python error: Aborted" in out1, out1
    assert "in _selftest" in out1, out1
    assert "still running after 15 s" in out1
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "selftest_hang-2-rank0.log",
        "selftest_hang-2-rank1.log",
    ]


def test_a_rank_printing_a_mebibyte_does_not_block():
    results = gpu_worker.launch(2, "selftest_spew", timeout=60)
    for rc, out in results:
        assert rc == 0 and out.rstrip().endswith("OK")
        assert len(out) > 1 << 20


def test_a_dying_rank_is_reported_and_the_job_ends_at_once():
    t0 = time.monotonic()
    (rc0, out0), (rc1, _) = gpu_worker.launch(2, "selftest_die", timeout=60)
    assert time.monotonic() - t0 < 30
    assert rc0 == 0 and out0.rstrip().endswith("OK")
    assert rc1 == 3


def test_ranks_share_the_gpu_by_nccl_version():
    new = [gpu_worker.gpu_env(2, r, (2, 30, 1)) for r in range(2)]
    assert all(e["NCCL_MULTI_RANK_GPU_ENABLE"] == "1" and "NCCL_HOSTID" not in e for e in new)
    old = [gpu_worker.gpu_env(2, r, (2, 28, 9)) for r in range(2)]
    assert all("NCCL_MULTI_RANK_GPU_ENABLE" not in e for e in old)
    assert old[0]["NCCL_HOSTID"] != old[1]["NCCL_HOSTID"]
    assert all(e["NCCL_SOCKET_IFNAME"] == "lo" and e["NCCL_IB_DISABLE"] == "1" for e in old)
    assert "NCCL_HOSTID" in gpu_worker.sharing_mode((2, 28, 9))


def test_nan_payloads_compare_equal_and_numbers_do_not():
    """The CPU reference keeps an operand's NaN payload; a GPU may give the
    canonical NaN. Both are NaN; a NaN against a number is a difference."""
    a = np.array([1.0, np.nan, 2.0, 3.0], np.float32)
    b = np.array([1.0, 1.0, np.nan, 4.0], np.float32)
    t = _jaxring.ELEM_TYPES["float32"]
    want = _jaxring.reduce_bytes(t, 0, a.tobytes(), b.tobytes())
    other_nan = np.frombuffer(want, np.float32).copy()
    other_nan.view(np.uint32)[1:3] = 0x7FC00001  # another quiet NaN payload
    assert len(gpu_worker.differing_elements(other_nan.tobytes(), want, "float32")) == 0
    wrong = other_nan.copy()
    wrong[1] = 0.0
    wrong[3] = 8.0
    assert list(gpu_worker.differing_elements(wrong.tobytes(), want, "float32")) == [1, 3]
    # bfloat16 travels as raw 16-bit patterns: 0x7FC0 and 0x7FA1 are NaNs,
    # 0x7F80 is infinity.
    bf = lambda *u: np.array(u, np.uint16).tobytes()
    assert len(gpu_worker.differing_elements(bf(0x7FC0, 1), bf(0x7FA1, 1), "bfloat16")) == 0
    assert list(gpu_worker.differing_elements(bf(0x7F80, 1), bf(0x7FC0, 1), "bfloat16")) == [0]
    ints = np.array([5, 6], np.int32).tobytes()
    assert list(
        gpu_worker.differing_elements(ints, np.array([5, 7], np.int32).tobytes(), "int32")
    ) == [1]


@pytest.mark.slow
def test_the_device_script_names_each_failure_within_its_budget(tmp_path):
    """run_device_checks.sh with stand-in steps (device_checks.selftest_steps):
    a job whose rank hangs, one whose ranks print a mebibyte, one whose rank
    dies, a step that needs the dead one, a step longer than what is left
    of the budget, and one for which no time is left."""
    budget = 55  # the jobs import jaxring (and JAX): a few seconds each
    t0 = time.monotonic()
    r = subprocess.run(
        [
            "bash",
            os.path.join(GPU_DIR, "run_device_checks.sh"),
            str(tmp_path),
            "--selftest",
            "--budget",
            str(budget),
        ],
        capture_output=True,
        text=True,
        timeout=budget + 30,
        cwd="/tmp",
        # The jobs import jaxring: this Python has it.
        env={**os.environ, "PYTHON": sys.executable},
    )
    took = time.monotonic() - t0
    assert took < budget + 10, took
    assert r.returncode == 1, r.stdout + r.stderr
    # Three files at most, whatever the number of logs.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs.tar.gz", "summary.txt"]
    summary = (tmp_path / "summary.txt").read_text()
    status = {}
    for line in summary.splitlines():
        words = line.split()
        if words and words[0] in ("PASS", "FAIL", "TIMEOUT", "SKIPPED"):
            status[words[1]] = (words[0], line)
    assert [(n, s) for n, (s, _) in status.items()] == [
        ("passes", "PASS"),
        ("spews", "PASS"),
        ("hangs", "TIMEOUT"),
        ("dies", "FAIL"),
        ("after_death", "SKIPPED"),
        ("why_it_died", "PASS"),
        ("outlasts_budget", "TIMEOUT"),
        ("no_time_left", "SKIPPED"),
    ], summary
    assert "exit status 3" in status["dies"][1]
    assert "needs dies" in status["after_death"][1]
    # A diagnosis runs only after a failure, and its output is in the summary.
    assert "a diagnosis of the death" in summary and "why_it_passed" not in summary
    assert "budget spent" in status["no_time_left"][1]
    # The hanging rank's stack, from its own log, is in the summary.
    hang_part = summary.split("TIMEOUT hangs")[1].split("FAIL    dies")[0]
    assert "selftest_hang-2-rank1.log" in hang_part and "in _selftest" in hang_part
    # Every step's and every rank's log is packed.
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        names = set(tar.getnames())
        spew = tar.extractfile("logs/ranks/selftest_spew-2-rank0.log").read()
    assert {"logs/02-hangs.log", "logs/ranks/selftest_hang-2-rank1.log"} <= names, names
    assert len(spew) > 1 << 20
    assert summary.rstrip().splitlines()[-1].startswith("done in")


def test_only_named_steps_run_and_unknown_names_are_refused(tmp_path, capsys):
    import device_checks

    assert (
        device_checks.main([str(tmp_path), "--selftest", "--only", "passes", "dies", "after_death"])
        == 1
    )
    summary = (tmp_path / "summary.txt").read_text()
    assert "PASS    passes" in summary and "FAIL    dies" in summary
    assert "SKIPPED after_death" in summary and "hangs" not in summary
    with pytest.raises(SystemExit):
        device_checks.main([str(tmp_path), "--only", "no_such_step"])
    assert "no step ['no_such_step']" in capsys.readouterr().err


def test_every_gpu_step_names_prerequisites_that_come_before_it():
    import device_checks

    seen = set()
    for step in device_checks.gpu_steps():
        assert set(step.needs) <= seen, (step.name, step.needs)
        seen.add(step.name)
    assert {"probe", "build", "world2", "busbw"} <= seen


# A compiled overlapped step as XLA prints it (trimmed): the schedule is the
# order of the instructions in the computation that holds the starts.
_SCHEDULED = """HloModule jit_step, is_scheduled=true

%fused_tanh (p: f32[64,256]) -> f32[64,256] {
  %p = f32[64,256]{1,0} parameter(0)
  ROOT %t = f32[64,256]{1,0} tanh(%p)
}

ENTRY %main.1 (w: f32[256,256], x: f32[64,256]) -> f32[256,256] {
  %w = f32[256,256]{1,0} parameter(0)
  %x = f32[64,256]{1,0} parameter(1)
  %gemm.1 = (f32[64,256]{1,0}, s8[0]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm"
  %fusion.1 = f32[64,256]{1,0} fusion(%gemm.1), kind=kLoop, calls=%fused_tanh
  %start.1 = f32[256,256]{1,0} custom-call(%w), custom_call_target="jaxring_allreduce_start_cuda"
  %gemm.2 = (f32[256,256]{1,0}, s8[0]{0}) custom-call(%fusion.1, %x), custom_call_target="__cublas$gemm"
  %start.2 = f32[256,256]{1,0} custom-call(%gemm.2), custom_call_target="jaxring_allreduce_start_cuda"
  %done.1 = f32[256,256]{1,0} custom-call(%start.1), custom_call_target="jaxring_allreduce_done_cuda"
  ROOT %done.2 = f32[256,256]{1,0} custom-call(%start.2), custom_call_target="jaxring_allreduce_done_cuda"
}
"""


def test_the_compiled_order_check_reads_a_schedule():
    comps = gpu_worker.hlo_computations(_SCHEDULED)
    assert list(comps) == ["%fused_tanh", "%main.1"]
    assert len(comps["%main.1"]) == 9
    assert gpu_worker.overlap_schedule(_SCHEDULED) == (True, "cx2 S c S Dx2")
    # Every start after the last computation: nothing overlaps.
    lines = _SCHEDULED.splitlines()
    starts = [l for l in lines if "allreduce_start" in l]
    rest = [l for l in lines if "allreduce_start" not in l]
    at = next(i for i, l in enumerate(rest) if "%done.1" in l)
    serial = "\n".join(rest[:at] + starts + rest[at:])
    assert gpu_worker.overlap_schedule(serial) == (False, "cx3 Sx2 Dx2")
    assert (
        gpu_worker.overlap_schedule(_SCHEDULED.replace("jaxring_allreduce_start_cuda", "other"))[0]
        is False
    )
