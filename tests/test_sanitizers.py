"""The C++ core (plan, reductions, both transports) under sanitizers.

Builds the C++ core tests (tests/cpp/) with AddressSanitizer +
UndefinedBehaviorSanitizer and with ThreadSanitizer, and runs them: each
virtual device is a thread, as in XLA, and the TCP transport runs between two
forked processes.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.sanitizers, pytest.mark.slow]


@pytest.mark.parametrize("sanitizer", ["address,undefined", "thread"])
def test_core_under_sanitizer(tmp_path, sanitizer):
    cmake = shutil.which("cmake")
    assert cmake, "cmake is needed for the sanitizer build (pip install cmake)"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(
        [
            cmake,
            "-S",
            str(ROOT),
            "-B",
            str(tmp_path),
            *gen,
            f"-DPython_EXECUTABLE={sys.executable}",
            "-DJAXRING_BUILD_PYTHON=OFF",
            "-DJAXRING_BUILD_CORE_TESTS=ON",
            # No build type: asserts stay in; the flags are -O1 -g.
            f"-DJAXRING_SANITIZE={sanitizer}",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    # Every core: a sanitizer build of the whole core is most of this test.
    subprocess.run(
        [cmake, "--build", str(tmp_path), "--parallel", str(os.cpu_count() or 1)],
        check=True,
        capture_output=True,
        text=True,
    )
    res = subprocess.run(
        [str(tmp_path / "jaxring_core_tests")],
        capture_output=True,
        text=True,
        timeout=600,
        env={
            "ASAN_OPTIONS": "detect_leaks=1",
            "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
            "TSAN_OPTIONS": "halt_on_error=1",
        },
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    # tests/cpp/main.cc runs doctest in three phases and prints this last
    # line only when every phase passed; some test cases must have run.
    for phase in (1, 2, 3):
        assert f"[core tests] phase {phase} of 3" in res.stdout, res.stdout[-2000:]
    assert "Status: FAILURE" not in res.stdout, res.stdout[-2000:]
    passed = re.search(
        r"^\[core tests\] all phases passed: (\d+) test cases, (\d+) assertions$",
        res.stdout,
        re.M,
    )
    assert passed, res.stdout[-2000:]
    assert int(passed[1]) > 0 and int(passed[2]) > 0, passed[0]
