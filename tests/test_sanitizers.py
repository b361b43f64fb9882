"""The C++ core (plan, reductions, both transports) under sanitizers.

Builds tests/cpp/core_tests.cc with AddressSanitizer + UndefinedBehavior-
Sanitizer and with ThreadSanitizer, and runs it: each virtual device is a
thread, as in XLA, and the TCP transport runs between two forked processes.
"""

import os
import pathlib
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
    assert "all checks passed" in res.stdout
