"""Test set-up: 8 virtual CPU devices, forced before JAX is imported."""

import os
import re
import subprocess
import sys
import tempfile
import textwrap

flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A tuning table in the user's cache would change the defaults the tests
# expect; the tuner's own tests name their files.
os.environ.setdefault("JAXRING_TUNING", "off")

import jaxring  # noqa: E402  (sizes the CPU pool before JAX starts)

# isort: split
import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import pytest  # noqa: E402


def overlapped_and_plain(run, step, x, **overlap_options):
    """run(jaxring.overlap(step, ...))(x), the jaxpr text of that program, and
    run(step)(x); an OverlapWarning (a reduction left alone) fails."""
    import warnings

    overlapped = jaxring.overlap(step, **overlap_options)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxring.OverlapWarning)
        got = run(overlapped)(x)
        text = jax.make_jaxpr(run(overlapped))(x).pretty_print()
    return got, text, run(step)(x)


def run_script(
    code: str, devices: int | None = 8, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Runs code in a fresh interpreter with `devices` virtual CPU devices
    (None: as a user's shell would, with no XLA_FLAGS; the code asks for
    devices itself)."""
    full_env = dict(os.environ)
    if devices is None:
        full_env.pop("XLA_FLAGS", None)
        full_env.pop("JAX_NUM_CPU_DEVICES", None)
    else:
        full_env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    full_env.pop("PJRT_NPROC", None)
    full_env.update(env or {})
    # Run outside the checkout so that the installed package is imported,
    # not the unbuilt sources.
    with tempfile.TemporaryDirectory() as cwd:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
            cwd=cwd,
        )


@pytest.fixture
def script():
    return run_script


@pytest.fixture
def no_jaxring_state_left_behind():
    """After the test: no split-phase start, in-process operation or gang
    start of jaxring's still pending."""
    import time

    from jaxring import _jaxring

    yield
    # Reading one replicated result does not wait for the other devices, so
    # give the last step a moment to finish everywhere.
    deadline = time.monotonic() + 30
    while (
        _jaxring.testing.split_phase_unfinished_starts()
        or _jaxring.testing.inprocess_pending_ops()
        or _jaxring.testing.gang_start_pending()
    ) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _jaxring.testing.split_phase_unfinished_starts() == 0
    assert _jaxring.testing.inprocess_pending_ops() == 0
    assert _jaxring.testing.gang_start_pending() == 0
