"""One process of a GPU allreduce job, for the checks in tests/gpu.

    python gpu_worker.py PROCESS NUM_PROCESSES PORT MODE

The job itself (launch, the environment by NCCL version, Job) is
gpu_job.py beside it, shared with the GPU benchmark. MODE:

* ``correctness``: every dtype and op, both algorithms, random sizes, ring
  and chunk counts, against numpy on the same inputs (which every process
  can make: rank r's input comes from seed r). Inputs are small integers,
  so every sum, product, minimum and maximum is exact in every dtype and
  the comparison is bit for bit. Then float32 sums with each 16-bit
  ``wire_dtype``, both algorithms, on random (inexact) values: each result
  within the documented bound of the float64 sum and bit for bit that of
  the allreduce of the operand cast to the wire format. With 4 processes,
  the tiered plan of 2 x 2 ranks against numpy and NCCL's allreduce.
* ``peer_missing``: process 1 never calls; process 0's call must fail
  after its timeout, and its next call must fail at once saying the
  communicator was aborted.
* ``overlap``: an MLP train step under ``jaxring.overlap`` against the same
  step with ``jaxring.pmean`` at the end, over several steps, bit for bit
  (with two ranks every sum has one order).
* ``peer_dies``: both processes complete one allreduce, then process 1
  exits; process 0's next call must raise (the watchdog aborts the
  communicator after the timeout and the abort check stops the
  computation) instead of hanging.
* ``selftest_*`` (gpu_job): the launcher's own checks, without a GPU.

Prints "OK" last on success. ``launch`` starts such a job.
"""

import os
import sys
import time

import numpy as np

import gpu_job
from gpu_job import Job, gpu_env, mlp_inputs, mlp_step, serve, sharing_mode  # noqa: F401  (gpu_env, sharing_mode: for the checks)


def launch(
    processes: int, mode: str, timeout: float = 240, log_dir: str | None = None
) -> list[tuple[int, str]]:
    """A job of this worker (gpu_job.launch)."""
    return gpu_job.launch(__file__, processes, mode, timeout, log_dir)


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
    home = [
        lines for lines in comps.values() if any("jaxring_allreduce_start_cuda" in l for l in lines)
    ]
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
    ok = (
        len(starts) == len(dones) > 0
        and bool(computes)
        and starts[0] < computes[-1]
        and all(s < d for s, d in zip(starts, dones))
    )
    return ok, " ".join(words)


NUMPY_OP = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def _inputs(rank: int, n: int, dtype, op: str) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + n)
    signed = not np.issubdtype(np.dtype(dtype), np.unsignedinteger)
    if op == "prod":
        vals = rng.choice([1, 2, -1] if signed else [1, 2], n)
    else:
        vals = rng.integers(-4 if signed else 0, 5, n)
    return vals.astype(dtype)


def _random_case(job: Job, rng, dtype, op: str, sizes) -> tuple:
    """(n, rings, chunk bytes, every rank's input, numpy's result) of a
    case with one of `sizes` elements."""
    n = int(rng.choice(sizes))
    rings = int(rng.integers(1, 4))
    chunk = int(rng.choice([4096, 65536, 1 << 20]))
    xs = [_inputs(r, n, dtype, op) for r in range(job.nprocs)]
    expected = xs[0]
    for x in xs[1:]:
        expected = NUMPY_OP[op](expected, x).astype(dtype)
    return n, rings, chunk, xs, expected


def correctness(job: Job) -> int:
    import jax.numpy as jnp

    dtypes = [
        jnp.float16,
        jnp.bfloat16,
        np.float32,
        np.float64,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
    ]
    rng = np.random.default_rng(7)
    failures = cases = 0
    for dtype in dtypes:
        for op in ("sum", "prod", "min", "max"):
            for algorithm in ("ring", "nccl"):
                if algorithm == "nccl" and np.dtype(dtype) in (np.int16, np.uint16):
                    continue  # NCCL has no 16-bit integers
                n, rings, chunk, xs, expected = _random_case(
                    job, rng, dtype, op, [1, 7, 1000, int(rng.integers(1, 300_000))]
                )
                # Named before it runs and judged after: a hang's log ends
                # with the case that hung.
                print(
                    f"case {np.dtype(dtype)} {op} {algorithm} n={n} rings={rings} chunk={chunk}",
                    flush=True,
                )
                f = job.allreduce_fn(
                    op=op, algorithm=algorithm, rings=rings, chunk_bytes=chunk, timeout_s=60.0
                )
                got = job.local_result(f(job.global_array(xs[job.pid])))
                cases += 1
                if got.tobytes() != expected.tobytes():
                    failures += 1
                    print(f"  MISMATCH: {got[:8]} vs {expected[:8]}", flush=True)
                else:
                    print("  ok", flush=True)
    for extra in (wire_formats, tiered):
        more_cases, more_failures = extra(job, rng)
        cases += more_cases
        failures += more_failures
    print(f"process {job.pid}: {cases} cases, {failures} mismatches", flush=True)
    return failures


def tiered(job: Job, rng, dtypes=None) -> tuple[int, int]:
    """With 4 processes, the tiered plan of 2 x 2 ranks: bit for bit against
    numpy and against NCCL's own allreduce on the same inputs (small
    integers, so every order of summation gives the same bits)."""
    import jax.numpy as jnp

    if job.nprocs != 4:
        return 0, 0
    cases = failures = 0
    for dtype in dtypes or (np.float32, jnp.bfloat16, np.int32):
        for op in ("sum", "max"):
            n, rings, chunk, xs, expected = _random_case(
                job, rng, dtype, op, [1, 7, int(rng.integers(1, 300_000))]
            )
            print(
                f"case {np.dtype(dtype)} {op} topology=(2, 2) n={n} rings={rings} chunk={chunk}",
                flush=True,
            )
            x = job.global_array(xs[job.pid])
            f = job.allreduce_fn(
                op=op, rings=rings, chunk_bytes=chunk, topology=(2, 2), timeout_s=60.0
            )
            # Small integers sum to the same bits in any order: that the
            # call carries the tiers is what says the tiered plan ran.
            if "topology = dense<2> : tensor<2xi64>" not in f.lower(x).as_text():
                print("  MISMATCH: the lowered call does not carry the tiers [2, 2]", flush=True)
                return cases + 1, failures + 1
            got = job.local_result(f(x))
            nccl = job.local_result(job.allreduce_fn(op=op, algorithm="nccl", timeout_s=60.0)(x))
            cases += 1
            if got.tobytes() != expected.tobytes() or got.tobytes() != nccl.tobytes():
                failures += 1
                print(f"  MISMATCH: {got[:8]} vs numpy {expected[:8]}, NCCL {nccl[:8]}", flush=True)
            else:
                print("  ok", flush=True)
    return cases, failures


def wire_formats(job: Job, rng, algorithms=("ring", "nccl")) -> tuple[int, int]:
    """float32 sums that travel in a 16-bit wire format: (cases, failures)."""
    import jax.numpy as jnp

    from jaxring._src import wire_format

    cases = failures = 0
    for wire in ("bfloat16", "float16"):
        for algorithm in algorithms:
            n = int(rng.integers(1, 300_000))
            xs = [
                np.random.default_rng(500 + r).normal(0, 1, n).astype(np.float32)
                for r in range(job.nprocs)
            ]
            exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
            bound = wire_format.error_bound(
                np.dtype(jnp.dtype(wire)),
                job.nprocs,
                np.sum([np.abs(x.astype(np.float64)) for x in xs], axis=0),
            )
            print(f"case float32 sum {algorithm} wire_dtype={wire} n={n}", flush=True)
            kw = dict(op="sum", algorithm=algorithm, rings=2, chunk_bytes=65536, timeout_s=60.0)
            got = job.local_result(
                job.allreduce_fn(wire_dtype=wire, **kw)(job.global_array(xs[job.pid]))
            )
            cast = job.local_result(
                job.allreduce_fn(**kw)(job.global_array(xs[job.pid].astype(jnp.dtype(wire))))
            ).astype(np.float32)
            cases += 1
            over = np.abs(got.astype(np.float64) - exact) > bound
            if got.dtype != np.float32 or over.any() or got.tobytes() != cast.tobytes():
                failures += 1
                print(
                    f"  MISMATCH: dtype {got.dtype}, {int(over.sum())} beyond the bound, "
                    f"equal to the cast operand's allreduce: "
                    f"{got.tobytes() == cast.tobytes()}",
                    flush=True,
                )
            else:
                print("  ok", flush=True)
    return cases, failures


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
        print(
            f"call {i} {'failed' if err else 'returned'} after {took:.1f} s: {(err or '')[:400]}",
            flush=True,
        )
    (_, first), (second_took, second) = calls
    ok = (
        first is not None
        and "timed out" in first
        and second is not None
        and "aborted" in second
        and second_took < 4.0
    )
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
        print(
            f"call after the peer died failed after {time.perf_counter() - t0:.1f} s: "
            f"{str(e)[:300]}",
            flush=True,
        )
        return 0
    print("call after the peer died returned", flush=True)
    return 1


def overlap(job: Job) -> int:
    ws, x = mlp_inputs(job, 256, 6, 64)
    plain, over = mlp_step(job, False), mlp_step(job, True, bucket_mb=0.25)
    # The order XLA compiled: buckets start while the backward pass still
    # has work, and each done comes after its start.
    scheduled, order = overlap_schedule(over.lower(ws, x).compile().as_text())
    print(
        f"compiled order ({'overlapping' if scheduled else 'NOT overlapping'}): {order}", flush=True
    )
    if not scheduled:
        return 1
    a = b = ws
    for _ in range(3):
        a, b = plain(a, x), over(b, x)
    same = all(np.asarray(u).tobytes() == np.asarray(v).tobytes() for u, v in zip(a, b))
    from jaxring import _jaxring_cuda

    print(
        f"overlap equals pmean at the end after 3 steps: {same}; "
        f"starts pending: {_jaxring_cuda.split_phase_pending()}",
        flush=True,
    )
    return 0 if same and _jaxring_cuda.split_phase_pending() == 0 else 1


if __name__ == "__main__":
    serve(
        {
            "correctness": correctness,
            "peer_missing": peer_missing,
            "peer_dies": peer_dies,
            "overlap": overlap,
        },
        # The overlapped and the plain step are compiled apart; with GEMM
        # autotuning each might pick another algorithm and round otherwise.
        xla_flags={"overlap": "--xla_gpu_autotune_level=0"},
    )
