"""What ``python -m jaxring.launch`` runs in each process it starts.

Initializes jax.distributed from the environment the launcher set, then runs
the user's script (or, after ``-m``, module) as ``__main__``, so a script
written for one process runs
unchanged as one process of N. A script written for a cluster, which calls
``jax.distributed.initialize()`` itself, runs unchanged too: its call finds
the job already set up and does nothing. It runs inside
``jaxring.translate_errors``, so a failed allreduce that the script does not
catch is reported as a ``jaxring.JaxringError``.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys
import traceback

from jaxring._src.errors import translate_errors

_PR_SET_PDEATHSIG = 1


def _die_with_launcher() -> None:
    """Linux: the kernel kills this process if the launcher dies, so a
    launcher killed with SIGKILL leaves nothing behind."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the launcher died before prctl took effect
        os._exit(1)


def is_loopback(address: str) -> bool:
    """Whether "host:port" names this host's loopback interface."""
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def _keep_the_launchers_job(coordinator: str, num_processes: int, process_id: int) -> None:
    """Makes the script's own ``jax.distributed.initialize`` accept the job
    set up here. JAX reads the coordinator from JAX_COORDINATOR_ADDRESS but
    has no variable for the process count or id (only SLURM's, Open MPI's
    and other clusters' own), and it refuses a second initialization. So a
    call that asks for nothing else does nothing; one that asks for another
    job says why it cannot have it."""
    import jax

    job = dict(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=None,
    )

    def initialize(
        coordinator_address=None,
        num_processes=None,
        process_id=None,
        local_device_ids=None,
        *args,
        **kwargs,
    ):
        asked = dict(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            local_device_ids=local_device_ids,
        )
        other = [
            f"{name}={value!r}"
            for name, value in asked.items()
            if value is not None and value != job[name]
        ]
        if other:
            raise RuntimeError(
                f"jax.distributed.initialize({', '.join(other)}): "
                "jaxring.launch already initialized jax.distributed in this "
                f"process, as process {job['process_id']} of "
                f"{job['num_processes']} with the coordinator at "
                f"{job['coordinator_address']}. Under the launcher, call "
                "jax.distributed.initialize() without arguments or not at "
                "all; or start the script without the launcher."
            )

    initialize.__doc__ = jax.distributed.initialize.__doc__
    jax.distributed.initialize = initialize


def main() -> None:
    if len(sys.argv) < 2 or (sys.argv[1] == "-m" and len(sys.argv) < 3):
        raise SystemExit("usage: python -m jaxring._src.launched (script.py | -m module) [args]")
    module = sys.argv[2] if sys.argv[1] == "-m" else None
    script = None if module else sys.argv[1]
    args = sys.argv[3:] if module else sys.argv[2:]
    _die_with_launcher()
    import jax

    # JAX's own collectives across processes (lax.psum on CPU) need Gloo;
    # jaxring's own allreduces use jaxring's TCP transport either way.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    coordinator = os.environ["JAXRING_COORDINATOR"]
    num_processes = int(os.environ["JAXRING_NUM_PROCESSES"])
    process_id = int(os.environ["JAXRING_PROCESS_ID"])
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        # JAX's coordinator listens on every address unless told otherwise,
        # and has no authentication: a job on one host keeps it on loopback.
        coordinator_bind_address=coordinator if is_loopback(coordinator) else None,
    )
    _keep_the_launchers_job(coordinator, num_processes, process_id)
    sys.argv = [script or module, *args]
    # What python would have put first on sys.path for the script or module.
    # The launcher starts this file with -P (safe_path), so that a job
    # started from a checkout imports the installed jaxring rather than the
    # source tree in the current directory: the entry is inserted then,
    # where without -P it replaces the current directory's.
    entry = os.getcwd() if module else os.path.dirname(os.path.abspath(script))
    if sys.flags.safe_path:
        sys.path.insert(0, entry)
    else:
        sys.path[0] = entry

    try:
        with translate_errors():
            if module:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            _exit_now(
                e.code if isinstance(e.code, int) else 1,
                None if isinstance(e.code, int) else str(e.code),
            )
        raise
    except BaseException:
        _exit_now(1, traceback.format_exc())


def _exit_now(code: int, message: str | None) -> None:
    """Exits at once. A normal exit would run jax.distributed's shutdown,
    which waits at a barrier for every other process: a failed process would
    hang there instead of letting the launcher stop the job."""
    if message:
        sys.stderr.write(message if message.endswith("\n") else message + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
