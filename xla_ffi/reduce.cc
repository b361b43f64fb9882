#include "reduce.h"

#include "reduce_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

namespace jaxring {

int64_t elem_bytes(ElemType t) {
  switch (t) {
    case ElemType::kS8:
    case ElemType::kU8: return 1;
    case ElemType::kF16:
    case ElemType::kBF16:
    case ElemType::kS16:
    case ElemType::kU16: return 2;
    case ElemType::kF32:
    case ElemType::kS32:
    case ElemType::kU32: return 4;
    case ElemType::kF64:
    case ElemType::kS64:
    case ElemType::kU64: return 8;
  }
  return 0;
}

const char* elem_type_name(ElemType t) {
  switch (t) {
    case ElemType::kF16: return "float16";
    case ElemType::kBF16: return "bfloat16";
    case ElemType::kF32: return "float32";
    case ElemType::kF64: return "float64";
    case ElemType::kS8: return "int8";
    case ElemType::kS16: return "int16";
    case ElemType::kS32: return "int32";
    case ElemType::kS64: return "int64";
    case ElemType::kU8: return "uint8";
    case ElemType::kU16: return "uint16";
    case ElemType::kU32: return "uint32";
    case ElemType::kU64: return "uint64";
  }
  return "?";
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kProd: return "prod";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
  }
  return "?";
}

bool reduce_op_from_int(int64_t v, ReduceOp* op) {
  if (v < 0 || v > 3) return false;
  *op = static_cast<ReduceOp>(v);
  return true;
}

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {  // inf or nan
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {  // normal
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {  // zero
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    bits =
        sign | (static_cast<uint32_t>(112 - e) << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or nan (keep nan quiet)
    return sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u);
  }
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to overflow
  if (abs < 0x38800000u) {                        // result is subnormal or zero
    if (abs < 0x33000000u) return sign;  // below half the smallest subnormal
    const uint32_t e = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14 + (113 - e) - 1 ... in [14, 24]
    const uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    uint32_t r = q + ((rem > half || (rem == half && (q & 1))) ? 1 : 0);
    return sign | static_cast<uint16_t>(r);
  }
  // Normal: rebias the exponent, round the mantissa to 10 bits.
  uint32_t r = abs - 0x38000000u;  // exponent 127 -> 15
  const uint32_t rem = r & 0x1fffu;
  r >>= 13;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1))) ++r;
  return sign | static_cast<uint16_t>(r);
}

float bfloat16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_bfloat16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>((x >> 16) | 0x40u);
  const uint32_t lsb = (x >> 16) & 1u;
  x += 0x7fffu + lsb;  // round to nearest even
  return static_cast<uint16_t>(x >> 16);
}

namespace {

template <typename T, typename F>
void apply(void* dst, const void* a, const void* b, int64_t n, F f) {
  T* d = static_cast<T*>(dst);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (int64_t i = 0; i < n; ++i) d[i] = f(x[i], y[i]);
}

template <typename T>
void reduce_native(ReduceOp op, void* dst, const void* a, const void* b,
                   int64_t n) {
  switch (op) {
    case ReduceOp::kSum: apply<T>(dst, a, b, n, combine_sum<T>); return;
    case ReduceOp::kProd: apply<T>(dst, a, b, n, combine_prod<T>); return;
    case ReduceOp::kMin: apply<T>(dst, a, b, n, nan_min<T>); return;
    case ReduceOp::kMax: apply<T>(dst, a, b, n, nan_max<T>); return;
  }
}

// 16-bit floats: widen, combine in float32, round once.
template <float (*Widen)(uint16_t), uint16_t (*Narrow)(float)>
void reduce_half(ReduceOp op, void* dst, const void* a, const void* b,
                 int64_t n) {
  uint16_t* d = static_cast<uint16_t*>(dst);
  const uint16_t* x = static_cast<const uint16_t*>(a);
  const uint16_t* y = static_cast<const uint16_t*>(b);
  // Blocks of floats keep the widened loop vectorisable.
  constexpr int64_t kBlock = 256;
  float fx[kBlock], fy[kBlock];
  for (int64_t base = 0; base < n; base += kBlock) {
    const int64_t m = std::min(kBlock, n - base);
    for (int64_t i = 0; i < m; ++i) {
      fx[i] = Widen(x[base + i]);
      fy[i] = Widen(y[base + i]);
    }
    reduce_native<float>(op, fx, fx, fy, m);
    for (int64_t i = 0; i < m; ++i) d[base + i] = Narrow(fx[i]);
  }
}

}  // namespace

void reduce(ElemType t, ReduceOp op, void* dst, const void* a, const void* b,
            int64_t n) {
  switch (t) {
    case ElemType::kF16:
      return reduce_half<half_to_float, float_to_half>(op, dst, a, b, n);
    case ElemType::kBF16:
      return reduce_half<bfloat16_to_float, float_to_bfloat16>(op, dst, a, b,
                                                               n);
    case ElemType::kF32: return reduce_native<float>(op, dst, a, b, n);
    case ElemType::kF64: return reduce_native<double>(op, dst, a, b, n);
    case ElemType::kS8: return reduce_native<int8_t>(op, dst, a, b, n);
    case ElemType::kS16: return reduce_native<int16_t>(op, dst, a, b, n);
    case ElemType::kS32: return reduce_native<int32_t>(op, dst, a, b, n);
    case ElemType::kS64: return reduce_native<int64_t>(op, dst, a, b, n);
    case ElemType::kU8: return reduce_native<uint8_t>(op, dst, a, b, n);
    case ElemType::kU16: return reduce_native<uint16_t>(op, dst, a, b, n);
    case ElemType::kU32: return reduce_native<uint32_t>(op, dst, a, b, n);
    case ElemType::kU64: return reduce_native<uint64_t>(op, dst, a, b, n);
  }
}

}  // namespace jaxring
