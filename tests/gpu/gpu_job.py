"""Jobs of several processes sharing one GPU, for the GPU checks
(tests/gpu/gpu_worker.py) and the GPU benchmark (benchmarks/gpu_bench_worker.py).

A worker script defines its modes, functions of a Job that return an exit
code, and calls serve(modes) as its main; launch(worker, processes, mode)
runs a job of it. Every process uses the one visible GPU with a memory
fraction each; how NCCL lets several ranks share one GPU depends on its
version (see gpu_env).

The ``selftest_*`` modes, served by every worker, need no GPU and start no
JAX backend: they check ``launch`` itself (a rank that hangs, one that
prints a lot, one that dies).
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

from jaxring._src import lib

# NCCL lets several ranks share one GPU with this setting from 2.30 on.
_MULTI_RANK_NCCL = (2, 30, 0)


def installed_nccl_version() -> tuple | None:
    """(major, minor, patch) of the NCCL jaxring loads, or None without the
    CUDA backend."""
    cuda = lib.cuda()
    if cuda is None:
        return None
    code = cuda.nccl_version()
    return (code // 10000, code // 100 % 100, code % 100)


def gpu_env(processes: int, rank: int = 0, nccl: tuple | None = None) -> dict:
    """The environment of rank `rank` of `processes` ranks sharing GPU 0.

    NCCL >= 2.30 shares a GPU among ranks with NCCL_MULTI_RANK_GPU_ENABLE.
    Older NCCL refuses two ranks with the same host hash and bus id
    ("Duplicate GPU detected"), so there each rank gets a host id of its own
    and talks over loopback sockets, as ranks on different hosts would.
    """
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cuda"
    env.pop("XLA_FLAGS", None)
    env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.8 / processes:.3f}"
    env["PYTHONFAULTHANDLER"] = "1"
    env.setdefault("NCCL_DEBUG", "WARN")
    # Every rank's kernels must be resident on the GPU at once, or a ring
    # step waits for a peer that cannot run: up to 3 rings per rank, so the
    # blocks each communicator may use are capped to fit the 132 SMs of an
    # H100/H200 (NCCL's notes on sharing a GPU advise NCCL_MAX_CTAS).
    env.setdefault("NCCL_MAX_CTAS", str(max(2, 96 // (3 * processes))))
    # Several communicators issued side by side (one per ring) need this
    # since NCCL 2.26; the backend sets it too, unless set.
    env.setdefault("NCCL_LAUNCH_ORDER_IMPLICIT", "1")
    if nccl is None or nccl >= _MULTI_RANK_NCCL:
        env["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    else:
        env["NCCL_HOSTID"] = f"jaxring-rank-{rank}"
        env["NCCL_SOCKET_IFNAME"] = "lo"
        env["NCCL_IB_DISABLE"] = "1"
    return env


def sharing_mode(nccl: tuple | None) -> str:
    """How gpu_env lets ranks share the GPU with this NCCL, in words."""
    if nccl is None or nccl >= _MULTI_RANK_NCCL:
        return "NCCL_MULTI_RANK_GPU_ENABLE=1"
    return "a host id per rank over loopback sockets (NCCL_HOSTID, NCCL < 2.30)"


def launch(
    worker: str, processes: int, mode: str, timeout: float = 240, log_dir: str | None = None
) -> list[tuple[int, str]]:
    """Runs a job of `processes` copies of the script `worker` (whose main
    is serve()) in `mode`; (return code, output) each.

    One deadline, `timeout` seconds, covers the whole job. Each rank writes
    to a log file of its own under `log_dir` (default $JAXRING_GPU_LOGS, else
    a temporary folder), never to a pipe: a rank that prints a lot cannot
    block while its peer waits for it inside NCCL. Ranks still running at
    the deadline get SIGABRT, which makes Python's fault handler write every
    thread's stack into the log, and SIGKILL 5 s later.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_dir = (
        log_dir or os.environ.get("JAXRING_GPU_LOGS") or tempfile.mkdtemp(prefix="jaxring-gpu-")
    )
    os.makedirs(log_dir, exist_ok=True)
    nccl = installed_nccl_version() if not mode.startswith("selftest") else None
    paths = [os.path.join(log_dir, f"{mode}-{processes}-rank{p}.log") for p in range(processes)]
    procs = []
    for p, path in enumerate(paths):
        with open(path, "w") as log:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        os.path.abspath(worker),
                        str(p),
                        str(processes),
                        str(port),
                        mode,
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=gpu_env(processes, p, nccl),
                )
            )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    late = [p for p in procs if p.poll() is None]
    for p in late:
        p.send_signal(signal.SIGABRT)
    grace = time.monotonic() + 5
    while time.monotonic() < grace and any(p.poll() is None for p in late):
        time.sleep(0.1)
    for p in late:
        if p.poll() is None:
            p.kill()
        p.wait()
    results = []
    for p, path in zip(procs, paths):
        with open(path, errors="replace") as log:
            text = log.read()
        if p in late:
            text += f"\n(still running after {timeout} s: stopped with SIGABRT)"
        results.append((p.returncode, text))
    return results


class Job:
    """This process's view of the job: its mesh over one GPU per process."""

    def __init__(self, pid: int, nprocs: int, port: int):
        import jax

        jax.config.update("jax_enable_x64", True)
        # A peer that never starts fails set-up in 30 s, not the default 300.
        jax.distributed.initialize(
            f"127.0.0.1:{port}", num_processes=nprocs, process_id=pid, initialization_timeout=30
        )
        from jax.sharding import NamedSharding, PartitionSpec as P

        self.jax, self.P = jax, P
        self.pid, self.nprocs = pid, nprocs
        self.mesh = jax.make_mesh((nprocs,), ("i",))
        self.sharding = NamedSharding(self.mesh, P("i"))

    def global_array(self, local: np.ndarray):
        shard = self.jax.device_put(local, self.jax.local_devices()[0])
        return self.jax.make_array_from_single_device_arrays(
            (self.nprocs * local.shape[0],), self.sharding, [shard]
        )

    def allreduce_fn(self, **kw):
        import jaxring

        return self.jax.jit(
            self.jax.shard_map(
                lambda v: jaxring.allreduce(v, "i", **kw),
                mesh=self.mesh,
                in_specs=self.P("i"),
                out_specs=self.P("i"),
                check_vma=False,
            )
        )

    @staticmethod
    def local_result(out) -> np.ndarray:
        return np.asarray(out.addressable_shards[0].data)

    def leave(self, rc: int, wait_s: float = 60) -> None:
        """Ends this process, rank 0 last: rank 0 hosts JAX's coordination
        service, and its exit kills every rank still connected to it. Each
        other rank says it is done through the key-value store and exits;
        rank 0 waits (at most wait_s) for all of them to have said so.
        jax.distributed's own shutdown barrier is skipped: a peer that
        failed would hold it."""
        sys.stdout.flush()
        if self.pid != 0:
            self.say_done(rc)
        else:
            for p in range(1, self.nprocs):
                if self.wait_for(f"done/{p}", wait_s) is None:
                    print(f"process {p} did not say it was done within {wait_s} s", flush=True)
        sys.stdout.flush()
        os._exit(rc)

    def say_done(self, rc: int) -> None:
        self.publish(f"done/{self.pid}", str(rc))

    def publish(self, key: str, value: str) -> None:
        from jaxring._src import jax_compat

        jax_compat.distributed_client().key_value_set(f"jaxring_gpu_worker/{key}", value)

    def wait_for(self, key: str, wait_s: float) -> str | None:
        """The value another rank published under `key`, or None after wait_s."""
        from jaxring._src import jax_compat

        try:
            return jax_compat.distributed_client().blocking_key_value_get(
                f"jaxring_gpu_worker/{key}", int(wait_s * 1000)
            )
        except Exception:  # the client's own error types; a timeout among them
            return None


def median_seconds(job: Job, fns: dict, args: tuple, rounds: int, iters: int) -> dict:
    """Seconds per call of each function on `args`, the median of `rounds`
    rounds of `iters` calls; the rounds alternate between the functions, so
    that drift (clocks, a neighbour) hits them all alike. A first call of
    each compiles it and sets up its communicators."""
    for f in fns.values():
        job.jax.block_until_ready(f(*args))
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                out = f(*args)
            job.jax.block_until_ready(out)
            times[k].append((time.perf_counter() - t0) / iters)
    return {k: float(np.median(t)) for k, t in times.items()}


def mlp_step(job: Job, overlapped: bool, bucket_mb: float = 1.0):
    import jax.numpy as jnp

    import jaxring

    def step(ws, x):
        def loss(ws):
            h = x
            for w in ws:
                h = jnp.tanh(h @ w)
            return jnp.mean(h**2)

        grads = jax.grad(loss)(ws)
        if overlapped:
            grads = job.jax.lax.pmean(grads, "i")
        else:
            grads = jaxring.pmean(grads, "i")
        return [w - 0.1 * g for w, g in zip(ws, grads)]

    jax = job.jax
    if overlapped:
        step = jaxring.overlap(axis_name="i", bucket_mb=bucket_mb, first_bucket_mb=bucket_mb / 4)(
            step
        )
    return jax.jit(
        jax.shard_map(
            step, mesh=job.mesh, in_specs=(job.P(), job.P("i")), out_specs=job.P(), check_vma=False
        )
    )


def mlp_inputs(job: Job, width: int, layers: int, batch: int):
    rng = np.random.default_rng(0)
    ws = [
        (rng.normal(0, 1 / np.sqrt(width), (width, width))).astype(np.float32)
        for _ in range(layers)
    ]
    x = np.random.default_rng(1 + job.pid).normal(0, 1, (batch, width)).astype(np.float32)
    shard = job.jax.device_put(x, job.jax.local_devices()[0])
    xs = job.jax.make_array_from_single_device_arrays(
        (job.nprocs * batch, width), job.sharding, [shard]
    )
    return ws, xs


def _selftest(pid: int, mode: str) -> int:
    """The launcher's own checks: no GPU, no JAX."""
    if mode == "selftest_hang" and pid == 1:
        time.sleep(3600)
    if mode == "selftest_spew":
        line = f"rank {pid} " + "x" * 1000 + "\n"
        for _ in range(1100):  # about 1.1 MiB, far beyond a pipe's buffer
            sys.stdout.write(line)
    if mode == "selftest_die" and pid == 1:
        os._exit(3)
    return 0


def serve(modes: dict[str, Callable[[Job], int]], xla_flags: dict[str, str] | None = None) -> None:
    """A worker's main: `python WORKER PROCESS NUM_PROCESSES PORT MODE`
    runs modes[MODE] (or a selftest mode) as process PROCESS, prints "OK"
    last on success, and leaves with its exit code. xla_flags: XLA_FLAGS
    for some modes, set before JAX starts."""
    pid, nprocs, port, mode = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    if mode.startswith("selftest"):
        rc = _selftest(pid, mode)
        print("OK" if rc == 0 else f"failed: {rc}", flush=True)
        os._exit(rc)
    if mode not in modes:
        print(f"unknown mode {mode!r}; this worker has {sorted(modes)}", flush=True)
        os._exit(2)
    if xla_flags and mode in xla_flags:
        os.environ["XLA_FLAGS"] = xla_flags[mode]
    job = Job(pid, nprocs, port)
    rc = modes[mode](job)
    if rc == 0:
        print("OK", flush=True)
    job.leave(rc)
