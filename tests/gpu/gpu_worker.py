"""One process of a GPU allreduce job, for tests/gpu and the GPU benchmark.

    python gpu_worker.py PROCESS NUM_PROCESSES PORT MODE

Every process uses the one visible GPU with a memory fraction each; how
NCCL lets several ranks share one GPU depends on its version (see gpu_env).
MODE:

* ``correctness``: every dtype and op, both algorithms, random sizes, ring
  and chunk counts, against numpy on the same inputs (which every process
  can make: rank r's input comes from seed r). Inputs are small integers,
  so every sum, product, minimum and maximum is exact in every dtype and
  the comparison is bit for bit.
* ``bench``: busbw of jaxring's ring and of NCCL's allreduce on the same
  communicators, 1 MiB to 256 MiB, in alternating rounds; prints a table.
* ``bench_sweep``: the ring's busbw by rings and chunk size against
  NCCL's, 16 to 256 MiB.
* ``peer_missing``: process 1 never calls; process 0's call must fail
  after its timeout, and its next call must fail at once saying the
  communicator was aborted.
* ``overlap``: an MLP train step under ``jaxring.overlap`` against the same
  step with ``jaxring.pmean`` at the end, over several steps, bit for bit
  (with two ranks every sum has one order).
* ``overlap_bench``: step time of that step (larger) with and without
  overlap, in alternating rounds.
* ``peer_dies``: both processes complete one allreduce, then process 1
  exits; process 0's next call must raise (the watchdog aborts the
  communicator after the timeout and the abort check stops the
  computation) instead of hanging.

Prints "OK" last on success. ``launch`` starts such a job.

The ``selftest_*`` modes need no GPU and no JAX: they check ``launch``
itself (a rank that hangs, one that prints a lot, one that dies).
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

# NCCL lets several ranks share one GPU with this setting from 2.30 on.
_MULTI_RANK_NCCL = (2, 30, 0)


def installed_nccl_version() -> tuple | None:
    """(major, minor, patch) of the NCCL jaxring loads, or None without the
    CUDA backend."""
    try:
        from jaxring import _jaxring_cuda
    except ImportError:
        return None
    code = _jaxring_cuda.nccl_version()
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


def launch(processes: int, mode: str, timeout: float = 240,
           log_dir: str | None = None) -> list[tuple[int, str]]:
    """Runs a job of `processes` workers in `mode`; (return code, output) each.

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
    log_dir = log_dir or os.environ.get("JAXRING_GPU_LOGS") or tempfile.mkdtemp(
        prefix="jaxring-gpu-")
    os.makedirs(log_dir, exist_ok=True)
    nccl = installed_nccl_version() if not mode.startswith("selftest") else None
    paths = [os.path.join(log_dir, f"{mode}-{processes}-rank{p}.log")
             for p in range(processes)]
    procs = []
    for p, path in enumerate(paths):
        with open(path, "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(p), str(processes),
                 str(port), mode],
                stdout=log, stderr=subprocess.STDOUT, env=gpu_env(processes, p, nccl)))
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


def differing_elements(got: bytes, want: bytes, name: str) -> np.ndarray:
    """Indices where two reductions of type `name` (a key of
    _jaxring.ELEM_TYPES) differ bit for bit, NaN against NaN counting as
    equal: a NaN's payload is not specified (the CPU keeps an operand's, a
    GPU may give the canonical NaN)."""
    dtype = {"bfloat16": "uint16"}.get(name, name)
    g, w = np.frombuffer(got, dtype), np.frombuffer(want, dtype)
    bits = f"u{g.itemsize}"
    differ = g.view(bits) != w.view(bits)
    if name == "bfloat16":
        def isnan(u):
            return ((u & 0x7F80) == 0x7F80) & ((u & 0x007F) != 0)
        differ &= ~(isnan(g) & isnan(w))
    elif np.dtype(dtype).kind == "f":
        differ &= ~(np.isnan(g) & np.isnan(w))
    return np.flatnonzero(differ)


def hlo_computations(text: str) -> dict[str, list[str]]:
    """The computations of an HLO module's text, name -> instruction lines
    in order (in a scheduled module, the order they run in)."""
    comps, name = {}, None
    for line in text.splitlines():
        if name is None:
            if line and not line[0].isspace() and line.rstrip().endswith("{"):
                words = line.split()
                name = words[1] if words[0] == "ENTRY" else words[0]
                comps[name] = []
        elif line.startswith("}"):
            name = None
        else:
            comps[name].append(line.strip())
    return comps


def overlap_schedule(text: str) -> tuple[bool, str]:
    """Whether a compiled overlapped step starts its first allreduce before
    its last computation, and every done follows its start; with the order
    in words (S start, D done, c a fusion or GEMM, run-length counted)."""
    comps = hlo_computations(text)
    home = [lines for lines in comps.values()
            if any("jaxring_allreduce_start_cuda" in l for l in lines)]
    if not home:
        return False, "no jaxring_allreduce_start_cuda in the compiled module"
    marks = []
    for line in home[0]:
        if "jaxring_allreduce_start_cuda" in line:
            marks.append("S")
        elif "jaxring_allreduce_done_cuda" in line:
            marks.append("D")
        elif " fusion(" in line or "gemm" in line or "command_buffer" in line:
            marks.append("c")
    starts = [i for i, m in enumerate(marks) if m == "S"]
    dones = [i for i, m in enumerate(marks) if m == "D"]
    computes = [i for i, m in enumerate(marks) if m == "c"]
    words, run = [], 1
    for i, m in enumerate(marks):
        if i + 1 < len(marks) and marks[i + 1] == m:
            run += 1
            continue
        words.append(m if run == 1 else f"{m}x{run}")
        run = 1
    ok = (len(starts) == len(dones) > 0 and bool(computes)
          and starts[0] < computes[-1]
          and all(s < d for s, d in zip(starts, dones)))
    return ok, " ".join(words)


class Job:
    """This process's view of the job: its mesh over one GPU per process."""

    def __init__(self, pid: int, nprocs: int, port: int):
        import jaxring  # noqa: F401  (before JAX starts its backend)
        import jax
        jax.config.update("jax_enable_x64", True)
        # A peer that never starts fails set-up in 30 s, not the default 300.
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nprocs,
                                   process_id=pid, initialization_timeout=30)
        from jax.sharding import NamedSharding, PartitionSpec as P
        self.jax, self.P = jax, P
        self.pid, self.nprocs = pid, nprocs
        self.mesh = jax.make_mesh((nprocs,), ("i",))
        self.sharding = NamedSharding(self.mesh, P("i"))

    def global_array(self, local: np.ndarray):
        shard = self.jax.device_put(local, self.jax.local_devices()[0])
        return self.jax.make_array_from_single_device_arrays(
            (self.nprocs * local.shape[0],), self.sharding, [shard])

    def allreduce_fn(self, **kw):
        import jaxring
        return self.jax.jit(self.jax.shard_map(
            lambda v: jaxring.allreduce(v, "i", **kw), mesh=self.mesh,
            in_specs=self.P("i"), out_specs=self.P("i"), check_vma=False))

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
                    print(f"process {p} did not say it was done within {wait_s} s",
                          flush=True)
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
                f"jaxring_gpu_worker/{key}", int(wait_s * 1000))
        except Exception:  # the client's own error types; a timeout among them
            return None


NUMPY_OP = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def _inputs(rank: int, n: int, dtype, op: str) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + n)
    signed = not np.issubdtype(np.dtype(dtype), np.unsignedinteger)
    if op == "prod":
        vals = rng.choice([1, 2, -1] if signed else [1, 2], n)
    else:
        vals = rng.integers(-4 if signed else 0, 5, n)
    return vals.astype(dtype)


def correctness(job: Job) -> int:
    import jax.numpy as jnp
    dtypes = [jnp.float16, jnp.bfloat16, np.float32, np.float64, np.int8,
              np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
              np.uint64]
    rng = np.random.default_rng(7)
    failures = cases = 0
    for dtype in dtypes:
        for op in ("sum", "prod", "min", "max"):
            for algorithm in ("ring", "nccl"):
                if algorithm == "nccl" and np.dtype(dtype) in (np.int16, np.uint16):
                    continue  # NCCL has no 16-bit integers
                n = int(rng.choice([1, 7, 1000, int(rng.integers(1, 300_000))]))
                rings = int(rng.integers(1, 4))
                chunk = int(rng.choice([4096, 65536, 1 << 20]))
                xs = [_inputs(r, n, dtype, op) for r in range(job.nprocs)]
                expected = xs[0]
                for x in xs[1:]:
                    expected = NUMPY_OP[op](expected, x).astype(dtype)
                # Named before it runs and judged after: a hang's log ends
                # with the case that hung.
                print(f"case {np.dtype(dtype)} {op} {algorithm} n={n} rings={rings} "
                      f"chunk={chunk}", flush=True)
                f = job.allreduce_fn(op=op, algorithm=algorithm, rings=rings,
                                     chunk_bytes=chunk, timeout_s=60.0)
                got = job.local_result(f(job.global_array(xs[job.pid])))
                cases += 1
                if got.tobytes() != expected.tobytes():
                    failures += 1
                    print(f"  MISMATCH: {got[:8]} vs {expected[:8]}", flush=True)
                else:
                    print("  ok", flush=True)
    print(f"process {job.pid}: {cases} cases, {failures} mismatches", flush=True)
    return failures


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


def bench(job: Job) -> int:
    sizes = [1 << s for s in range(20, 29, 2)]  # 1 MiB .. 256 MiB
    rounds, iters = 5, 10
    rows = []
    for nbytes in sizes:
        x = job.global_array(np.ones(nbytes // 4, np.float32))
        fns = {a: job.allreduce_fn(algorithm=a, chunk_bytes=max(1 << 20, nbytes // 8))
               for a in ("ring", "nccl")}
        seconds = median_seconds(job, fns, (x,), rounds, iters)
        busbw = {a: 2 * (job.nprocs - 1) / job.nprocs * nbytes / s / 1e9
                 for a, s in seconds.items()}
        rows.append((nbytes, busbw["ring"], busbw["nccl"]))
    if job.pid == 0:
        print(f"world {job.nprocs} on one GPU: busbw GB/s, float32 sum "
              f"(median of {rounds} rounds of {iters} calls)")
        print(f"{'bytes':>12} {'ring':>10} {'nccl':>10} {'ring/nccl':>10}")
        for nbytes, ring, nccl in rows:
            print(f"{nbytes:>12} {ring:>10.2f} {nccl:>10.2f} {ring / nccl:>10.3f}")
    return 0


def bench_sweep(job: Job) -> int:
    """busbw of the ring by rings and chunk size against NCCL's allreduce,
    16 to 256 MiB: which of the ring's parameters its gap to NCCL depends
    on."""
    rounds, iters = 3, 5
    configs = [("nccl", 2, 1 << 22)] + [("ring", r, c) for r in (1, 2, 4)
                                        for c in (1 << 20, 1 << 22, 1 << 24)]
    results = {}
    for nbytes in (1 << 24, 1 << 26, 1 << 28):
        x = job.global_array(np.ones(nbytes // 4, np.float32))
        fns = {cfg: job.allreduce_fn(algorithm=cfg[0], rings=cfg[1], chunk_bytes=cfg[2])
               for cfg in configs}
        for cfg, s in median_seconds(job, fns, (x,), rounds, iters).items():
            results[(nbytes, cfg)] = 2 * (job.nprocs - 1) / job.nprocs * nbytes / s / 1e9
    if job.pid == 0:
        print(f"world {job.nprocs} on one GPU: busbw GB/s by configuration, float32 sum "
              f"(median of {rounds} rounds of {iters} calls); ratio to nccl in brackets")
        sizes = sorted({n for n, _ in results})
        print(f"{'algorithm rings chunk':>24} " + " ".join(f"{n >> 20:>9} MiB" for n in sizes))
        for cfg in configs:
            cells = []
            for n in sizes:
                bw = results[(n, cfg)]
                cells.append(f"{bw:6.2f} ({bw / results[(n, configs[0])]:.2f})")
            print(f"{cfg[0]:>10} {cfg[1]:>5} {cfg[2] >> 10:>6}K " + " ".join(
                f"{c:>13}" for c in cells))
    return 0


def peer_missing(job: Job) -> int:
    if job.pid != 0:
        # Alive, but never joins; it waits for process 0's calls to be over.
        return 0 if job.wait_for("peer_missing/calls_over", 90) is not None else 1
    f = job.allreduce_fn(timeout_s=5.0)
    x = job.global_array(np.ones(1024, np.float32))
    calls = []
    for _ in range(2):
        t0 = time.perf_counter()
        try:
            job.local_result(f(x))
            calls.append((time.perf_counter() - t0, None))
        except Exception as e:  # XLA's runtime error carries the handler's message
            calls.append((time.perf_counter() - t0, str(e)))
    job.publish("peer_missing/calls_over", "1")
    for i, (took, err) in enumerate(calls):
        print(f"call {i} {'failed' if err else 'returned'} after {took:.1f} s: "
              f"{(err or '')[:400]}", flush=True)
    (_, first), (second_took, second) = calls
    ok = (first is not None and "timed out" in first and second is not None
          and "aborted" in second and second_took < 4.0)
    return 0 if ok else 1


def peer_dies(job: Job) -> int:
    x = job.global_array(np.ones(1 << 20, np.float32))
    # Communicators are cached per (devices, ring), not per call: a first
    # call with a generous timeout sets them up, so that the 5 s below
    # covers the allreduce alone, not NCCL's communicator set-up.
    job.local_result(job.allreduce_fn(timeout_s=60.0)(x))
    f = job.allreduce_fn(timeout_s=5.0)
    job.local_result(f(x))  # both ranks: one good call with the short timeout
    if job.pid != 0:
        job.say_done(0)  # before dying, so that rank 0 still leaves last
        sys.stdout.flush()
        os._exit(0)  # dies without a word to its peer
    t0 = time.perf_counter()
    try:
        job.local_result(f(x))
    except Exception as e:  # XLA's error for the stopped computation
        print(f"call after the peer died failed after {time.perf_counter() - t0:.1f} s: "
              f"{str(e)[:300]}", flush=True)
        return 0
    print("call after the peer died returned", flush=True)
    return 1


def _mlp_step(job: Job, overlapped: bool, bucket_mb: float = 1.0):
    import jax.numpy as jnp
    import jaxring

    def step(ws, x):
        def loss(ws):
            h = x
            for w in ws:
                h = jnp.tanh(h @ w)
            return jnp.mean(h ** 2)
        grads = jax.grad(loss)(ws)
        if overlapped:
            grads = job.jax.lax.pmean(grads, "i")
        else:
            grads = jaxring.pmean(grads, "i")
        return [w - 0.1 * g for w, g in zip(ws, grads)]

    jax = job.jax
    if overlapped:
        step = jaxring.overlap(axis_name="i", bucket_mb=bucket_mb,
                               first_bucket_mb=bucket_mb / 4)(step)
    return jax.jit(jax.shard_map(step, mesh=job.mesh, in_specs=(job.P(), job.P("i")),
                                 out_specs=job.P(), check_vma=False))


def _mlp_inputs(job: Job, width: int, layers: int, batch: int):
    rng = np.random.default_rng(0)
    ws = [(rng.normal(0, 1 / np.sqrt(width), (width, width))).astype(np.float32)
          for _ in range(layers)]
    x = np.random.default_rng(1 + job.pid).normal(0, 1, (batch, width)).astype(np.float32)
    shard = job.jax.device_put(x, job.jax.local_devices()[0])
    xs = job.jax.make_array_from_single_device_arrays(
        (job.nprocs * batch, width), job.sharding, [shard])
    return ws, xs


def overlap(job: Job) -> int:
    ws, x = _mlp_inputs(job, 256, 6, 64)
    plain, over = _mlp_step(job, False), _mlp_step(job, True, bucket_mb=0.25)
    # The order XLA compiled: buckets start while the backward pass still
    # has work, and each done comes after its start.
    scheduled, order = overlap_schedule(over.lower(ws, x).compile().as_text())
    print(f"compiled order ({'overlapping' if scheduled else 'NOT overlapping'}): "
          f"{order}", flush=True)
    if not scheduled:
        return 1
    a = b = ws
    for _ in range(3):
        a, b = plain(a, x), over(b, x)
    same = all(np.asarray(u).tobytes() == np.asarray(v).tobytes() for u, v in zip(a, b))
    from jaxring import _jaxring_cuda
    print(f"overlap equals pmean at the end after 3 steps: {same}; "
          f"starts pending: {_jaxring_cuda.split_phase_pending()}", flush=True)
    return 0 if same and _jaxring_cuda.split_phase_pending() == 0 else 1


def overlap_bench(job: Job) -> int:
    ws, x = _mlp_inputs(job, 2048, 8, 512)
    # Buckets of 25 MiB (PyTorch DDP's default) and of 4 MiB: every bucket
    # is an allreduce of its own, with its own per-step costs.
    fns = {"pmean at end": _mlp_step(job, False),
           "overlap 25 MiB": _mlp_step(job, True, bucket_mb=25.0),
           "overlap 4 MiB": _mlp_step(job, True, bucket_mb=4.0)}
    med = median_seconds(job, fns, (ws, x), rounds=5, iters=5)
    if job.pid == 0:
        print(f"overlap on GPU, world {job.nprocs}, 8x2048^2 MLP (128 MiB of "
              f"gradients), median of 5 rounds of 5 steps: "
              + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in med.items())
              + "; overlap/plain = " + ", ".join(
                  f"{med[k] / med['pmean at end']:.3f} ({k})" for k in med if k != "pmean at end"),
              flush=True)
    return 0


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


def main() -> None:
    pid, nprocs, port, mode = (int(sys.argv[1]), int(sys.argv[2]),
                               int(sys.argv[3]), sys.argv[4])
    if mode.startswith("selftest"):
        rc = _selftest(pid, mode)
        print("OK" if rc == 0 else f"failed: {rc}", flush=True)
        os._exit(rc)
    if mode == "overlap":
        # The overlapped and the plain step are compiled apart; with GEMM
        # autotuning each might pick another algorithm and round otherwise.
        os.environ["XLA_FLAGS"] = "--xla_gpu_autotune_level=0"
    job = Job(pid, nprocs, port)
    rc = {"correctness": correctness, "bench": bench, "bench_sweep": bench_sweep,
          "peer_missing": peer_missing,
          "peer_dies": peer_dies, "overlap": overlap,
          "overlap_bench": overlap_bench}[mode](job)
    if rc == 0:
        print("OK", flush=True)
    job.leave(rc)


if __name__ == "__main__":
    main()
