"""Starts N local processes of one multi-controller JAX job, like torchrun.

    jaxring-launch -n 4 train.py --steps 100
    jaxring-launch -n 4 -m jaxring.tune --quick

(``python -m jaxring.launch`` is the same, from outside a checkout of
jaxring.) Each process gets the coordinator's address, the number of
processes and its own index, initializes ``jax.distributed`` and runs the
script; a ``jax.distributed.initialize()`` in the script finds the job
already initialized and does nothing. The processes
share a fresh ``JAXRING_JOB_SECRET`` (or the caller's), with which jaxring's
TCP transport authenticates them, and a coordinator on 127.0.0.1 listens on
loopback only. ``--cpu-bind cores`` binds each process to its own share of
the physical cores, as mpirun does; ``--keep-freed-memory`` has glibc keep
the large buffers XLA frees for reuse (see _KEEP_FREED_MEMORY). Every output
line is prefixed with the process's rank. If one process exits with an
error, the launcher stops the others and exits with that status; Ctrl-C
stops them all. On a cluster, skip the launcher: call
``jax.distributed.initialize()`` in the script, and JAX picks up SLURM or
Open MPI by itself; jaxring then needs nothing more.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxring._src.distributed import SECRET_ENV, new_secret_hex

# How long processes get to exit after SIGTERM before SIGKILL. (JAX catches
# SIGTERM as a preemption notice, so a busy process usually needs the KILL.)
_GRACE_S = 3.0


# --keep-freed-memory: glibc's malloc takes buffers up to 1 GiB from its heap
# instead of mapping each one afresh, and keeps up to 4 GiB of freed heap
# instead of returning it to the kernel. XLA on CPU allocates every result
# buffer anew, so by default each allreduce's result lands on fresh pages,
# which the kernel zeroes on first touch (a page fault per 4 KiB or 2 MiB);
# kept, the same pages serve call after call. The cost: a process's
# resident memory stays near its peak. Every thread allocates from the main
# heap (one arena): another thread's arena grows in heaps of at most
# 64 MiB, so a buffer that size or larger, which XLA's threads allocate
# for results, would still be mapped afresh each time. Limits: glibc
# releases that cap the threshold at 32 MiB ignore it; other C libraries
# ignore all three.
_KEEP_FREED_MEMORY = {
    "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 32),
    "MALLOC_ARENA_MAX": "1",
}

# What the launcher tells each process it starts (read by launched.py).
_NUM_PROCESSES_ENV = "JAXRING_NUM_PROCESSES"
_PROCESS_ID_ENV = "JAXRING_PROCESS_ID"


def launched_process_count() -> int:
    """How many processes the launcher started this job with; 1 when this
    process was not started by it. Unlike ``jax.process_count()`` it can be
    read before JAX starts, to decide how to set up the devices."""
    return int(os.environ.get(_NUM_PROCESSES_ENV, "1"))


def physical_cores(cpus) -> list[list[int]]:
    """`cpus` grouped by the physical core they belong to (the hardware
    threads of one core together), cores in order of their first CPU. A
    CPU whose topology the kernel does not show counts as a core of its
    own."""
    cores: dict[tuple, list[int]] = {}
    for cpu in sorted(cpus):
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(base + "physical_package_id") as f:
                package = f.read().strip()
            with open(base + "core_id") as f:
                core = f.read().strip()
            key = (package, core)
        except OSError:
            key = ("cpu", cpu)
        cores.setdefault(key, []).append(cpu)
    return sorted(cores.values())


def cpu_shares(nproc: int, cores: list[list[int]]) -> list[list[int]]:
    """The CPUs each of nproc processes is bound to under --cpu-bind cores,
    given the physical cores it may use (physical_cores): disjoint,
    contiguous, near-equal shares of whole cores while there are at least
    as many cores as processes, so no two processes share a core through
    its hardware threads; one core each, taken in turn, beyond (as mpirun
    binds an oversubscribed job). `cores` is never empty: it comes from
    this process's affinity."""
    if nproc <= len(cores):
        return [
            sorted(
                c
                for core in cores[i * len(cores) // nproc : (i + 1) * len(cores) // nproc]
                for c in core
            )
            for i in range(nproc)
        ]
    return [sorted(cores[i % len(cores)]) for i in range(nproc)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, rank: int, out, lock: threading.Lock) -> None:
    prefix = f"[{rank}] ".encode()
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            out.flush()
    stream.close()


def _signal_live(procs: list[subprocess.Popen], sig: int) -> None:
    """Sends sig to the process group of every process still running."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to every live process group, then SIGKILL after a grace."""
    _signal_live(procs, signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    _signal_live(procs, signal.SIGKILL)
    for p in procs:
        p.wait()


def parse_args(argv):
    # `-m MODULE args...` takes the script's place, as with python itself:
    # everything after the module's name is the module's, so it is split
    # off before the launcher's own options are parsed.
    module, module_args = None, []
    for i, a in enumerate(argv):
        if a == "-m":
            if i + 1 < len(argv):
                module, module_args, argv = argv[i + 1], argv[i + 2 :], argv[:i]
            break
        if not a.startswith("-") and (i == 0 or argv[i - 1] not in _VALUED):
            break  # the script: what follows is its own
    ap = argparse.ArgumentParser(
        prog="python -m jaxring.launch",
        description="Run a JAX script (or -m module) as N local processes of one job.",
    )
    ap.add_argument("-n", "--nproc", type=int, required=True, help="number of processes")
    ap.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        help="virtual CPU devices in each process (sets --xla_force_host_platform_device_count)",
    )
    ap.add_argument(
        "--coordinator",
        default=None,
        help="host:port for jax.distributed's coordinator (default: 127.0.0.1 and a free port)",
    )
    ap.add_argument(
        "--cpu-bind",
        choices=("none", "cores"),
        default="none",
        help="cores: bind each process to its own share of the "
        "physical cores this launcher may use (as mpirun "
        "does), so "
        "the processes of one host stop migrating between "
        "cores; none (default): let the kernel place them",
    )
    ap.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="have glibc keep freed buffers (up to 1 GiB each, 4 GiB "
        "in all) for reuse instead of returning them to the "
        "kernel, which zeroes fresh pages: large allreduces "
        "on CPU stop paying page faults each call, and each "
        "process keeps its peak memory (sets "
        "MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ and "
        "MALLOC_ARENA_MAX where not set)",
    )
    ap.add_argument(
        "--prefix-command",
        default=None,
        metavar="TEMPLATE",
        help="run each process under this command, with {rank} "
        "replaced, e.g. 'ip netns exec node{rank}'",
    )
    ap.add_argument(
        "-m",
        dest="module",
        metavar="MODULE",
        default=None,
        help="run this module, as python -m does, instead of a "
        "script; the arguments after it are the module's",
    )
    ap.add_argument("script", nargs="?", help="the Python script to run")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    args = ap.parse_args(argv)
    if module is not None:
        if args.script is not None:
            ap.error("give a script or -m MODULE, not both")
        args.module, args.args = module, module_args
    elif args.script is None:
        ap.error("give the script to run (or -m MODULE)")
    if args.nproc < 1:
        ap.error("-n must be at least 1")
    if args.devices_per_process is not None and args.devices_per_process < 1:
        ap.error("--devices-per-process must be at least 1")
    return args


# The launcher's options that take a value (so that value is not the script).
_VALUED = {
    "-n",
    "--nproc",
    "--devices-per-process",
    "--coordinator",
    "--prefix-command",
    "--cpu-bind",
}


def child_env(
    base: dict,
    rank: int,
    nproc: int,
    coordinator: str,
    devices_per_process: int | None,
    job_secret: str,
    keep_freed_memory: bool = False,
) -> dict:
    env = dict(base)
    if keep_freed_memory:
        for name, value in _KEEP_FREED_MEMORY.items():
            env.setdefault(name, value)  # the caller's own setting wins
    env.update(JAXRING_COORDINATOR=coordinator, JAXRING_JOB_SECRET=job_secret, PYTHONUNBUFFERED="1")
    # Where jax.distributed.initialize() looks for the coordinator when not
    # given one (JAX has no such variable for the process count or id).
    env["JAX_COORDINATOR_ADDRESS"] = coordinator
    env[_NUM_PROCESSES_ENV] = str(nproc)
    env[_PROCESS_ID_ENV] = str(rank)
    if devices_per_process is not None:
        flags = [
            f
            for f in env.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")
        ]
        flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
        env["XLA_FLAGS"] = " ".join(flags)
    return env


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    coordinator = args.coordinator or f"127.0.0.1:{_free_port()}"
    # One secret for the job's TCP transport: the caller's, or a fresh one
    # that only these processes see.
    job_secret = os.environ.get(SECRET_ENV) or new_secret_hex()
    out = sys.stdout.buffer
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    shares = (
        cpu_shares(args.nproc, physical_cores(os.sched_getaffinity(0)))
        if args.cpu_bind == "cores"
        else [None] * args.nproc
    )
    for rank in range(args.nproc):
        prefix = shlex.split(args.prefix_command.format(rank=rank)) if args.prefix_command else []
        # -P: `python -m` would put the current directory first on
        # sys.path, and in a checkout of jaxring that is the source tree,
        # without the compiled extension; launched.py adds the script's own
        # directory.
        p = subprocess.Popen(
            [
                *prefix,
                sys.executable,
                "-P",
                "-m",
                "jaxring._src.launched",
                *(["-m", args.module] if args.module else [os.path.abspath(args.script)]),
                *args.args,
            ],
            env=child_env(
                os.environ,
                rank,
                args.nproc,
                coordinator,
                args.devices_per_process,
                job_secret,
                args.keep_freed_memory,
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # its own group: stopped with its children
        procs.append(p)
        if shares[rank] is not None:
            # Popen returns once the child has exec'd the interpreter, which
            # starts no thread of its own before it imports numpy and JAX:
            # the mask set now is inherited by every thread it starts (and
            # survives a prefix command's exec, which keeps the pid).
            os.sched_setaffinity(p.pid, shares[rank])
        t = threading.Thread(target=_pump, args=(p.stdout, rank, out, lock), daemon=True)
        t.start()
        pumps.append(t)

    def on_signal(signum, frame):
        _stop(procs)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    status = 0
    try:
        live = set(range(args.nproc))
        while live:
            for rank in sorted(live):
                code = procs[rank].poll()
                if code is None:
                    continue
                live.discard(rank)
                if code != 0:
                    status = code if code > 0 else 128 - code
                    with lock:
                        sys.stderr.write(
                            f"jaxring.launch: process {rank} exited with status "
                            f"{code}; stopping the other processes\n"
                        )
                    _stop(procs)
                    live.clear()
                    break
            time.sleep(0.05)
    finally:
        _stop(procs)
        for t in pumps:
            t.join(timeout=2.0)
    return status


if __name__ == "__main__":
    sys.exit(main())
