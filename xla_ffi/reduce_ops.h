// The element-wise combine rules, shared by the CPU reductions (reduce.cc)
// and the CUDA reduce kernels (cuda/reduce_kernels.cu), so that both
// backends give the same bits: integers wrap like XLA's, min/max propagate
// NaN like XLA's, floats combine in their own type.
#pragma once

#include <type_traits>

#if defined(__CUDACC__)
#define JAXRING_HOST_DEVICE __host__ __device__
#else
#define JAXRING_HOST_DEVICE
#endif

namespace jaxring {

// Integer arithmetic wraps like XLA's; done in the unsigned type so that a
// signed overflow is defined behaviour.
template <typename T>
JAXRING_HOST_DEVICE inline T wrap_add(T a, T b) {
  using U = std::make_unsigned_t<T>;
  return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
}
template <typename T>
JAXRING_HOST_DEVICE inline T wrap_mul(T a, T b) {
  using U = std::make_unsigned_t<T>;
  // Promote to at least unsigned int so that uint16*uint16 does not become
  // a signed int multiplication that can overflow.
  using W = std::conditional_t<(sizeof(U) < sizeof(unsigned)), unsigned, U>;
  return static_cast<T>(static_cast<U>(static_cast<W>(static_cast<U>(a)) *
                                       static_cast<W>(static_cast<U>(b))));
}

// min/max propagate NaN like XLA's (std::min would drop it depending on
// argument order). x != x is the NaN test that works in host and device code.
template <typename T>
JAXRING_HOST_DEVICE inline T nan_min(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (a != a || b != b) return a + b;
  }
  return b < a ? b : a;
}
template <typename T>
JAXRING_HOST_DEVICE inline T nan_max(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (a != a || b != b) return a + b;
  }
  return a < b ? b : a;
}

template <typename T>
JAXRING_HOST_DEVICE inline T combine_sum(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    return wrap_add(a, b);
  } else {
    return a + b;
  }
}
template <typename T>
JAXRING_HOST_DEVICE inline T combine_prod(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    return wrap_mul(a, b);
  } else {
    return a * b;
  }
}

}  // namespace jaxring
