"""The typed reduction kernels against numpy / ml_dtypes."""

import ml_dtypes
import numpy as np
import pytest

from jaxring import _jaxring

T = _jaxring.ELEM_TYPES
OPS = {"sum": 0, "prod": 1, "min": 2, "max": 3}


def kernel(dtype_name, op, a, b):
    out = _jaxring.reduce_bytes(T[dtype_name], OPS[op], a.tobytes(), b.tobytes())
    return np.frombuffer(out, a.dtype)


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", list(OPS))
def test_16_bit_floats_combine_in_float32_and_round_once(name, op):
    dt = np.dtype(getattr(ml_dtypes, name) if name == "bfloat16" else np.float16)
    # Every 16-bit pattern against a shuffled copy: covers subnormals, inf
    # and NaN, and every rounding case of the conversion.
    a = np.arange(2**16, dtype=np.uint16).view(dt)
    b = np.random.default_rng(0).permutation(a)
    f = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
    with np.errstate(all="ignore"):
        expected = f(a.astype(np.float32), b.astype(np.float32)).astype(dt)
    got = kernel(name, op, a, b)
    nan = np.isnan(expected.astype(np.float32))
    assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
    assert np.array_equal(got[~nan].view(np.uint16), expected[~nan].view(np.uint16))


@pytest.mark.parametrize(
    "name", ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
)
@pytest.mark.parametrize("op", list(OPS))
def test_integers_wrap_like_numpy(name, op):
    dt = np.dtype(name)
    info = np.iinfo(dt)
    rng = np.random.default_rng(1)
    a = rng.integers(info.min, info.max, 5000, dtype=dt, endpoint=True)
    b = rng.integers(info.min, info.max, 5000, dtype=dt, endpoint=True)
    a[:4] = [info.max, info.min, info.max, 0]
    b[:4] = [info.max, info.min, 1, info.min]
    f = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
    with np.errstate(all="ignore"):
        expected = f(a, b)
    assert np.array_equal(kernel(name, op, a, b), expected)


@pytest.mark.parametrize("name", ["float32", "float64"])
@pytest.mark.parametrize("op", list(OPS))
def test_wide_floats_match_numpy_and_propagate_nan(name, op):
    dt = np.dtype(name)
    rng = np.random.default_rng(2)
    a = rng.standard_normal(1001).astype(dt)
    b = rng.standard_normal(1001).astype(dt)
    a[0], b[1] = np.nan, np.nan
    f = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
    assert np.array_equal(kernel(name, op, a, b), f(a, b), equal_nan=True)
