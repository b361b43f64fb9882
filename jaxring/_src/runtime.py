"""Process-level set-up: the CPU thread pool, FFI target registration and
a clean exit.

The PjRt CPU client runs every device program on one shared pool of
max(cores, devices) threads, and each device admits 32 programs in flight. A
training loop that dispatches steps back to back fills those slots; further
launches then park pool threads, the programs already running can no longer
get a thread per device, and every collective among them waits forever. XLA's
own psum hangs this way after ~33 back-to-back calls on 8 virtual devices of
a 2-core machine. A larger pool (PJRT_NPROC, read when the CPU client starts)
removes the hazard, so jaxring sizes it at import, before any backend exists.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import warnings

from jaxring._src import jax_compat, lib

# Threads for the XLA CPU pool when jaxring sets it. Measured: 16 threads let
# 500 back-to-back calls of psum and of jaxring.allreduce finish on 8 devices.
_MIN_CPU_THREADS = 32
_THREADS_PER_DEVICE = 4
_MAX_CPU_THREADS = 4096

_registered = False
_pool_set_by_jaxring = False


def _requested_cpu_devices() -> int:
    m = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    n = int(m.group(1)) if m else 1
    n = max(n, int(os.environ.get("JAX_NUM_CPU_DEVICES", "1") or 1))
    return n


def cpu_threads_for(devices: int) -> int:
    """Pool size jaxring asks for with `devices` virtual CPU devices."""
    return max(_MIN_CPU_THREADS, os.cpu_count() or 1, _THREADS_PER_DEVICE * devices)


def _thread_count(text: str) -> int:
    try:
        threads = int(text)
    except ValueError:
        threads = 0
    if not 1 <= threads <= _MAX_CPU_THREADS:
        raise ValueError(
            f"JAXRING_CPU_THREADS={text!r}: expected a thread count from 1 to {_MAX_CPU_THREADS}"
        )
    return threads


HUGE_PAGES_ENV = "JAXRING_HUGE_PAGES"


def check_huge_pages_setting() -> None:
    """JAXRING_HUGE_PAGES, checked at import: "1", "0" or unset (empty).

    The C++ side (xla_ffi/cpu/huge_pages.cc) reads it at the first large
    result and takes any value but "0" for "1", so "no" or "false" would ask
    for huge pages; anything else is refused here, before it is read there.
    """
    raw = os.environ.get(HUGE_PAGES_ENV, "")
    if raw not in ("", "0", "1"):
        raise ValueError(
            f"{HUGE_PAGES_ENV}={raw!r}: expected 1 (ask for transparent huge "
            "pages on CPU results of 4 MiB or more) or 0 (do not); unset, it "
            "is 1, or 0 where MALLOC_MMAP_THRESHOLD_ is set"
        )


def size_cpu_pool(devices: int | None = None) -> None:
    """Sets PJRT_NPROC before the CPU client starts, unless the user did.

    Called at import; call it again with ``devices`` when the device count is
    chosen later (before JAX's first computation).
    """
    global _pool_set_by_jaxring
    if "PJRT_NPROC" in os.environ and not _pool_set_by_jaxring:
        return
    explicit = os.environ.get("JAXRING_CPU_THREADS")
    if devices is None:
        devices = _requested_cpu_devices()
    threads = _thread_count(explicit) if explicit else cpu_threads_for(devices)

    if jax_compat.backends_are_initialized():
        warnings.warn(
            "jaxring was imported after JAX started its CPU backend, so it "
            "could not size the CPU thread pool; back-to-back dispatch of "
            "collectives on many virtual devices may hang. Import jaxring "
            f"before using JAX, or set PJRT_NPROC={threads} yourself.",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    os.environ["PJRT_NPROC"] = str(threads)
    _pool_set_by_jaxring = True


def use_cpu_devices(n: int) -> None:
    """Asks JAX for n virtual CPU devices and sizes the CPU pool for them.

    Sets ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS``
    (replacing an earlier count) and, unless set, ``JAX_PLATFORMS=cpu``. Call
    it before JAX starts its backend (before the first ``jax.devices()`` or
    computation); the example trainers and the benchmarks call it first.
    Once the backend runs, the count is fixed: a call asking for the count it
    has does nothing, any other raises ``RuntimeError``.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"jaxring.use_cpu_devices: n must be a positive int, got {n!r}")

    if jax_compat.backends_are_initialized():
        # JAX starts every backend at once, so asking for the CPU devices now
        # starts nothing; XLA_FLAGS would only be read by the next process.
        import jax

        try:
            running = jax.local_device_count("cpu")
        except RuntimeError:  # JAX_PLATFORMS left the CPU backend out
            running = 0
        if running == n:
            return
        raise RuntimeError(
            f"jaxring.use_cpu_devices({n}) was called after JAX started its "
            f"backend (with {running} CPU devices), when the device count can "
            "no longer change. Call it before the first JAX computation or "
            "jax.devices(), or set XLA_FLAGS=--xla_force_host_platform_"
            f"device_count={n} before starting Python."
        )
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
    )
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    size_cpu_pool(n)


def register_ffi_targets() -> None:
    global _registered
    if _registered:
        return

    register_targets(lib.cpu.registrations(), platform="cpu")
    # Registered after JAX's own exit handler (at `import jax`), so it runs
    # before JAX destroys its backends.
    atexit.register(_let_completions_finish)
    _registered = True


# How long an exiting process waits for transport threads to leave XLA.
_EXIT_WAIT_S = 10.0


def _let_completions_finish() -> None:
    """Quiets the transport threads before JAX's exit handlers and the C
    library's run.

    A peer that exits first makes this process's TCP threads reconnect to
    tell the others, while this process may be exiting too, and libcrypto
    frees its state in an atexit handler: a handshake then crashed in
    OpenSSL (seen as a rare segfault at exit in 4-process jobs). So no
    handshake starts from here on, and those in OpenSSL are waited for.

    A transport thread that completes an allreduce runs XLA's continuations
    (the program's rest and its clean-up), some of them after the result is
    visible to Python; JAX's exit handler destroys the CPU client, so it must
    wait for them, or the client may be torn down under a thread still
    running its code."""

    if not lib.cpu.close_handshakes(_EXIT_WAIT_S):
        sys.stderr.write(
            "jaxring: a TCP handshake was still in OpenSSL "
            f"{_EXIT_WAIT_S:g} s into interpreter exit; exiting anyway\n"
        )
    if not lib.cpu.wait_for_completions(_EXIT_WAIT_S):
        sys.stderr.write(
            f"jaxring: a transport thread was still completing an XLA "
            f"computation {_EXIT_WAIT_S:g} s into interpreter exit; exiting "
            "anyway\n"
        )


def register_targets(registrations: dict, platform: str) -> None:
    """Registers FFI handlers with XLA, explaining an FFI API mismatch.

    A handler carries the FFI API version of the jaxlib headers it was built
    against, and XLA refuses handlers newer than itself.
    """
    import jax
    import jaxlib

    for name, capsule in registrations.items():
        try:
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
        except Exception as e:  # XLA raises its own error types
            if "API version" not in str(e):
                raise
            raise RuntimeError(
                f"jaxring's {platform} handlers were built against the XLA FFI "
                f"headers of jaxlib {lib.build_config.BUILT_WITH_JAXLIB} (FFI API "
                f"{lib.build_config.FFI_API_VERSION}), which this jaxlib "
                f"{jaxlib.__version__} is too old to load. Reinstall jaxring "
                "with pip's default build isolation (it builds against the "
                "oldest supported jaxlib), or with --no-build-isolation "
                f"against the jaxlib you run. XLA said: {e}"
            ) from e
