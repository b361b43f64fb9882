"""16-bit wire formats: float32 values that travel the ring as bfloat16 or
float16.

A float32 operand is rounded to the wire format once on its rank; every hop
of the ring then adds in float32 and rounds once for the next hop (the
reduce kernel's rule for 16-bit floats), and the result is widened back to
float32. Other dtypes travel as they are.

Error bound (first order in u, the format's unit roundoff, u = 2**-8 for
bfloat16 and 2**-11 for float16): for a sum over n ranks,

    |result - exact sum| <= n * u * sum_i |x_i|

elementwise: n - 1 rounded additions and one rounding of each input, each
off by at most u times a partial sum no larger than sum_i |x_i|. A mean
divides both sides by n. float16 also overflows to inf beyond 65504.
"""

from __future__ import annotations

import jax
import numpy as np

WIRE_DTYPES = (np.dtype(jax.numpy.bfloat16), np.dtype(np.float16))

# What a wire format carries: float32 values (and complex64's float32 lanes).
CARRIED = np.dtype(np.float32)

UNIT_ROUNDOFF = {np.dtype(jax.numpy.bfloat16): 2.0**-8, np.dtype(np.float16): 2.0**-11}


def wire_dtype_of(value, where: str) -> np.dtype | None:
    """value (None, a dtype or its name) as a wire dtype, or a ValueError
    naming where it was given."""
    if value is None:
        return None
    try:
        dtype = np.dtype(jax.numpy.dtype(value))
    except TypeError:
        dtype = None
    if dtype not in WIRE_DTYPES:
        raise ValueError(
            f"{where}: wire_dtype must be None, 'bfloat16' or 'float16', got {value!r}"
        )
    return dtype


def travels_as(dtype: np.dtype, wire: np.dtype | None) -> np.dtype:
    """The dtype a value of dtype travels in under the wire format wire."""
    return wire if wire is not None and np.dtype(dtype) == CARRIED else np.dtype(dtype)


def error_bound(wire: np.dtype, world: int, abs_sum):
    """The documented elementwise bound on |result - exact sum| of a sum over
    world ranks whose inputs' absolute values sum to abs_sum."""
    return world * UNIT_ROUNDOFF[np.dtype(wire)] * abs_sum
