"""Run by tests/test_multiprocess.py under `python -m jaxring.launch`.

Every process builds every rank's inputs from one seed, so it can compute the
numpy reference for the whole job itself, and compares jaxring.allreduce
(over TCP between processes, in memory inside one) against it for every
dtype and op at random sizes. Checks that every local rank got the same
bits and reports one "check" per case with a digest of them, so the test
can compare bits across processes, and across runs that split the ranks
between processes differently, then "done" with what the transport
counted. An optional third argument is the topology setting
("auto", "flat" or "2x2"), or "ring", "exchange" or "direct" for that
algorithm (topology "auto"); the "lowered" report says which tiers
(topology) and algorithm the lowered custom call of a 4 MiB allreduce
carries, and which algorithm a 64-byte one runs (small_algorithm).
"""

import hashlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from report import report

import jaxring

jax.config.update("jax_enable_x64", True)

DTYPES = [
    np.float32,
    np.float64,
    jnp.bfloat16,
    np.float16,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
]
OPS = ["sum", "prod", "min", "max"]


def inputs(rng, world, count, dtype):
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        lo, hi = max(info.min, -100), min(info.max, 100)
        return rng.integers(lo, hi, size=(world, count)).astype(dtype)
    return rng.uniform(0.5, 1.5, size=(world, count)).astype(dtype)


def reference(x, op):
    if np.issubdtype(x.dtype, np.integer):
        f = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op]
        return f(x, axis=0, dtype=x.dtype) if op in ("sum", "prod") else f(x, axis=0)
    wide = x.astype(np.float64)
    return {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op](wide, axis=0)


def main():
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    cases = int(sys.argv[2]) if len(sys.argv) > 2 else 24
    if len(sys.argv) > 3 and sys.argv[3] in ("ring", "exchange", "direct"):
        jaxring.config.update("algorithm", sys.argv[3])
    elif len(sys.argv) > 3:
        t = sys.argv[3]
        jaxring.config.update(
            "topology", t if t in ("auto", "flat") else tuple(int(d) for d in t.split("x"))
        )
    devices = np.array(jax.devices())
    world = devices.size
    mesh = Mesh(devices, ("x",))
    rng = np.random.default_rng(seed)
    fns = {}
    for case in range(cases):
        dtype = np.dtype(DTYPES[case % len(DTYPES)])
        op = OPS[(case // len(DTYPES)) % len(OPS)]
        count = int(
            rng.choice([0, 1, 7, world * 2 + 1, 1000, 65537, int(rng.integers(1, 300_000))])
        )
        rings = int(rng.integers(1, 4))
        chunk = int(rng.choice([256, 4096, 1 << 20]))
        x = inputs(rng, world, count, dtype)
        key = (op, rings, chunk)
        if key not in fns:
            fns[key] = jax.jit(
                jax.shard_map(
                    lambda v, op=op, rings=rings, chunk=chunk: jaxring.allreduce(
                        v, "x", op=op, rings=rings, chunk_bytes=chunk
                    ),
                    mesh=mesh,
                    in_specs=P("x"),
                    out_specs=P("x"),
                    check_vma=False,
                )
            )
        arr = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("x")), lambda idx: x[idx])
        if case == 0:
            from jaxring import _jaxring

            names = {v: k for k, v in _jaxring.ALGORITHMS.items()}
            algorithms = {}
            for title, length in (("algorithm", 1 << 20), ("small_algorithm", 16)):
                probe = jax.ShapeDtypeStruct(
                    (world, length), np.float32, sharding=NamedSharding(mesh, P("x"))
                )
                hlo = fns[key].lower(probe).as_text()
                number = int(re.search(r"algorithm = (\d+)", hlo).group(1))
                algorithms[title] = names[number]
            # The large one's tiers, e.g. dense<[4, 2]> : tensor<2xi64>;
            # dense<2> : tensor<2xi64> is a splat; dense<> : tensor<0xi64>
            # is empty (flat).
            attr = re.search(
                r"topology = dense<([^>]*)> : tensor<(\d+)xi64>",
                fns[key]
                .lower(
                    jax.ShapeDtypeStruct(
                        (world, 1 << 20), np.float32, sharding=NamedSharding(mesh, P("x"))
                    )
                )
                .as_text(),
            )
            tiers = re.findall(r"\d+", attr.group(1))
            if len(tiers) == 1:
                tiers = tiers * int(attr.group(2))
            report("lowered", topology="x".join(tiers) or "flat", **algorithms)
        out = fns[key](arr)
        want = reference(x, op)
        first = None
        for shard in out.addressable_shards:
            got = np.asarray(shard.data)[0]
            if np.issubdtype(dtype, np.integer):
                ok = np.array_equal(got, want)
            else:
                # Reduction order and per-hop rounding: a few ulps per hop.
                eps = float(np.finfo(dtype).eps) * (world + 2) * 4
                scale = np.maximum(np.abs(want), 1.0) if op != "prod" else np.abs(want) + 1e-30
                ok = bool(np.all(np.abs(got.astype(np.float64) - want) <= eps * scale))
            if not ok:
                bad = np.nonzero(got != want)[0]
                raise SystemExit(
                    f"MISMATCH case {case}: {op} {dtype} n={count} "
                    f"rings={rings} chunk={chunk} shard {shard.index}: "
                    f"{len(bad)} elements differ, first at {bad[:3]}: "
                    f"{got[bad[:3]]} != {want[bad[:3]]}"
                )
            if first is None:
                first = got.tobytes()
            elif got.tobytes() != first:
                raise SystemExit(
                    f"MISMATCH case {case}: ranks of this process "
                    f"got different bits (shard {shard.index})"
                )
        digest = hashlib.sha256(first).hexdigest()[:16]
        report("check", case=case, op=op, dtype=str(dtype), count=count, digest=digest)
    # Large chunks: a shared-memory ring (8 MiB) holds two of 4 MiB, so a
    # sender may find it full and hand frames to the connection's sender
    # thread, behind those it wrote itself.
    big = inputs(rng, world, 3 << 20, np.float32)
    f = jax.jit(
        jax.shard_map(
            lambda v: jaxring.allreduce(v, "x", rings=1, chunk_bytes=4 << 20),
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P("x"),
            check_vma=False,
        )
    )
    out = f(
        jax.make_array_from_callback(big.shape, NamedSharding(mesh, P("x")), lambda idx: big[idx])
    )
    want = big.astype(np.float64).sum(axis=0)
    for shard in out.addressable_shards:
        got = np.asarray(shard.data)[0].astype(np.float64)
        if not np.all(np.abs(got - want) <= 1e-6 * (world + 2) * np.abs(want)):
            raise SystemExit("MISMATCH in the 12 MiB allreduce")
    # Which threads wrote the data frames, and how many of this process's
    # connections carried data through shared memory (0 in one process, or
    # with JAXRING_TRANSPORT=tcp).
    info = jaxring.transport_info()
    report(
        "done",
        data_frames=info["data_frames"],
        shm_links=len(info["shm_outbound"]),
        socket_buffer=info["socket_buffer"],
        host_direct=info["host_direct"],
    )


if __name__ == "__main__":
    main()
    # Unlike the other scripts here, this one exits through the interpreter's
    # full teardown, as users' scripts do: that path once crashed 4-process
    # jobs (a TCP handshake running into libcrypto's atexit clean-up; see
    # runtime._let_completions_finish).
