"""The element types an allreduce takes, and how each travels.

The ring reduces the SUPPORTED_DTYPES itself. Complex and bool values
travel as lanes of a type it has (to_ring_form), and under a 16-bit wire
format float32 travels rounded (to_wire_form); each comes with the function
that turns the reduced value into the result lax would give.
"""

from __future__ import annotations

import jax
import numpy as np
from jax import lax

from jaxring._src import wire_format

SUPPORTED_DTYPES = tuple(
    np.dtype(d)
    for d in (
        jax.numpy.float16,
        jax.numpy.bfloat16,
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
    )
)

# Dtypes the ring has no reduction for, carried in one it has.
LANE_DTYPES = (np.dtype(np.complex64), np.dtype(np.complex128), np.dtype(np.bool_))

# Element types NCCL's own allreduce has (jaxring's ring moves bytes and
# reduces with its own kernels, so it has every supported type).
NCCL_DTYPES = tuple(
    d for d in SUPPORTED_DTYPES if d not in (np.dtype(np.int16), np.dtype(np.uint16))
)


def check_dtype(leaf) -> np.dtype:
    dtype = np.dtype(jax.numpy.result_type(leaf))
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"jaxring.allreduce: unsupported dtype {dtype}; supported: "
            + ", ".join(str(d) for d in (*SUPPORTED_DTYPES, *LANE_DTYPES))
        )
    return dtype


def to_ring_form(leaf, op: str):
    """(a value of a dtype the ring reduces, the function that makes the
    reduced value the result lax would give).

    A complex sum is the sum of its real and imaginary parts, so they travel
    as two float lanes of one operation. A bool sum counts the True values
    in int32, as lax.psum does; max, min and prod of bools are or, and, and
    and again, which uint8 0/1 lanes compute exactly.
    """
    check_op_dtype(leaf, op)
    dtype = np.dtype(leaf.dtype)
    if dtype.kind == "c":
        lanes = jax.numpy.stack([jax.numpy.real(leaf), jax.numpy.imag(leaf)], axis=-1)
        return lanes, lambda r: lax.complex(r[..., 0], r[..., 1])
    if dtype == np.bool_:
        if op == "sum":
            return leaf.astype(np.int32), lambda r: r
        return leaf.astype(np.uint8), lambda r: r.astype(np.bool_)
    return leaf, lambda r: r


def check_op_dtype(leaf, op: str) -> None:
    """Raises where op is not defined for leaf's dtype (op as the ring
    runs it: "sum" for a mean)."""
    dtype = np.dtype(leaf.dtype)
    if dtype.kind == "c":
        if op != "sum":
            raise TypeError(
                f"jaxring.allreduce: op={op!r} is not defined for {dtype} "
                "(complex numbers have no order, and a product does not act "
                "on the real and imaginary parts apart); use op='sum' or 'mean'."
            )
    elif dtype != np.bool_:
        check_dtype(leaf)


def to_wire_form(leaf, restore, wire: np.dtype):
    """leaf in the dtype it travels in under the wire format, and the
    function that makes its reduced value the result in leaf's dtype."""
    dtype = np.dtype(leaf.dtype)
    if wire_format.travels_as(dtype, wire) == dtype:
        return leaf, restore
    return leaf.astype(wire), lambda r: restore(r.astype(dtype))
