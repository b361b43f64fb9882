"""The GPU checks' harness, on CPU: the job launcher (one deadline, a log
file per rank, SIGABRT with stack dumps for a rank that hangs), the choice
of how ranks share a GPU by NCCL version, and the NaN-aware comparison of
reduce kernels. A GPU run is rare and short, so what decides whether it
yields evidence is tested where it is cheap."""

import os
import signal
import sys
import time

import numpy as np

from jaxring import _jaxring

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "gpu"))
import gpu_worker  # noqa: E402


def test_a_hanging_rank_is_stopped_at_the_deadline_with_its_stack(tmp_path):
    t0 = time.monotonic()
    (rc0, out0), (rc1, out1) = gpu_worker.launch(2, "selftest_hang", timeout=4,
                                                 log_dir=str(tmp_path))
    took = time.monotonic() - t0
    assert took < 4 + 5 + 5, took
    assert rc0 == 0 and out0.rstrip().endswith("OK"), out0
    assert rc1 == -signal.SIGABRT, (rc1, out1)
    # Python's fault handler shows where the rank was stuck.
    assert "Fatal Python error: Aborted" in out1, out1
    assert "in _selftest" in out1, out1
    assert "still running after 4 s" in out1
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "selftest_hang-2-rank0.log", "selftest_hang-2-rank1.log"]


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
    assert all(e["NCCL_MULTI_RANK_GPU_ENABLE"] == "1" and "NCCL_HOSTID" not in e
               for e in new)
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
    bf = lambda *u: np.array(u, np.uint16).tobytes()  # noqa: E731
    assert len(gpu_worker.differing_elements(bf(0x7FC0, 1), bf(0x7FA1, 1), "bfloat16")) == 0
    assert list(gpu_worker.differing_elements(bf(0x7F80, 1), bf(0x7FC0, 1), "bfloat16")) == [0]
    ints = np.array([5, 6], np.int32).tobytes()
    assert list(gpu_worker.differing_elements(ints, np.array([5, 7], np.int32).tobytes(),
                                              "int32")) == [1]
