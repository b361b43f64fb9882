#include "reduce_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "../reduce_ops.h"

namespace jaxring::cuda {

namespace {

// How an element is stored and combined: most types combine as themselves;
// float16 and bfloat16 are stored as their 16 bits and combine in float32.
template <typename T>
struct Native {
  using Stored = T;
  using Value = T;
  __device__ static Value load(Stored x) { return x; }
  __device__ static Stored store(Value v) { return v; }
};
struct Half {
  using Stored = uint16_t;
  using Value = float;
  __device__ static Value load(Stored x) {
    return __half2float(__ushort_as_half(x));
  }
  __device__ static Stored store(Value v) {
    return __half_as_ushort(__float2half_rn(v));
  }
};
struct BFloat16 {
  using Stored = uint16_t;
  using Value = float;
  __device__ static Value load(Stored x) {
    return __bfloat162float(__ushort_as_bfloat16(x));
  }
  __device__ static Stored store(Value v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
};

template <typename Elem, ReduceOp Op>
struct Combine {
  using S = typename Elem::Stored;
  using V = typename Elem::Value;
  __device__ S operator()(S a, S b) const {
    const V x = Elem::load(a), y = Elem::load(b);
    V r;
    if constexpr (Op == ReduceOp::kSum)
      r = combine_sum(x, y);
    else if constexpr (Op == ReduceOp::kProd)
      r = combine_prod(x, y);
    else if constexpr (Op == ReduceOp::kMin)
      r = nan_min(x, y);
    else
      r = nan_max(x, y);
    return Elem::store(r);
  }
};

// 16 bytes per thread per iteration: one vector load of each operand.
template <typename S>
struct alignas(16) Pack {
  static constexpr int kElems = 16 / sizeof(S);
  S v[kElems];
};

template <typename S, typename F>
__global__ void reduce_packed(S* __restrict__ dst, const S* __restrict__ src,
                              int64_t packs, F f) {
  auto* d = reinterpret_cast<Pack<S>*>(dst);
  const auto* s = reinterpret_cast<const Pack<S>*>(src);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < packs; i += stride) {
    Pack<S> a = d[i];
    const Pack<S> b = s[i];
#pragma unroll
    for (int k = 0; k < Pack<S>::kElems; ++k) a.v[k] = f(a.v[k], b.v[k]);
    d[i] = a;
  }
}

template <typename S, typename F>
__global__ void reduce_scalar(S* __restrict__ dst, const S* __restrict__ src,
                              int64_t n, F f) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    dst[i] = f(dst[i], src[i]);
  }
}

constexpr int kThreads = 256;
// Enough blocks to fill an H100/H200-class device several times over; the
// grid-stride loops cover the rest.
constexpr int64_t kMaxBlocks = 132 * 8;

int64_t blocks_for(int64_t items) {
  return std::max<int64_t>(
      1, std::min(kMaxBlocks, (items + kThreads - 1) / kThreads));
}

template <typename Elem, ReduceOp Op>
cudaError_t launch_typed(void* dst_v, const void* src_v, int64_t n,
                         cudaStream_t stream) {
  using S = typename Elem::Stored;
  S* dst = static_cast<S*>(dst_v);
  const S* src = static_cast<const S*>(src_v);
  const Combine<Elem, Op> f;
  int64_t done = 0;
  const bool aligned = (reinterpret_cast<uintptr_t>(dst) % 16 == 0) &&
                       (reinterpret_cast<uintptr_t>(src) % 16 == 0);
  // Clears an error left by an earlier, unrelated runtime call, which the
  // cudaGetLastError after a launch would otherwise blame on it.
  (void)cudaGetLastError();
  if (aligned) {
    const int64_t packs = n / Pack<S>::kElems;
    if (packs > 0) {
      reduce_packed<<<blocks_for(packs), kThreads, 0, stream>>>(dst, src, packs,
                                                                f);
      if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
      done = packs * Pack<S>::kElems;
    }
  }
  if (done < n) {
    reduce_scalar<<<blocks_for(n - done), kThreads, 0, stream>>>(
        dst + done, src + done, n - done, f);
  }
  return cudaGetLastError();
}

template <typename Elem>
cudaError_t launch_op(ReduceOp op, void* dst, const void* src, int64_t n,
                      cudaStream_t stream) {
  switch (op) {
    case ReduceOp::kSum:
      return launch_typed<Elem, ReduceOp::kSum>(dst, src, n, stream);
    case ReduceOp::kProd:
      return launch_typed<Elem, ReduceOp::kProd>(dst, src, n, stream);
    case ReduceOp::kMin:
      return launch_typed<Elem, ReduceOp::kMin>(dst, src, n, stream);
    case ReduceOp::kMax:
      return launch_typed<Elem, ReduceOp::kMax>(dst, src, n, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_reduce(ElemType type, ReduceOp op, void* dst,
                          const void* src, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  switch (type) {
    case ElemType::kF16: return launch_op<Half>(op, dst, src, n, stream);
    case ElemType::kBF16: return launch_op<BFloat16>(op, dst, src, n, stream);
    case ElemType::kF32:
      return launch_op<Native<float>>(op, dst, src, n, stream);
    case ElemType::kF64:
      return launch_op<Native<double>>(op, dst, src, n, stream);
    case ElemType::kS8:
      return launch_op<Native<int8_t>>(op, dst, src, n, stream);
    case ElemType::kS16:
      return launch_op<Native<int16_t>>(op, dst, src, n, stream);
    case ElemType::kS32:
      return launch_op<Native<int32_t>>(op, dst, src, n, stream);
    case ElemType::kS64:
      return launch_op<Native<int64_t>>(op, dst, src, n, stream);
    case ElemType::kU8:
      return launch_op<Native<uint8_t>>(op, dst, src, n, stream);
    case ElemType::kU16:
      return launch_op<Native<uint16_t>>(op, dst, src, n, stream);
    case ElemType::kU32:
      return launch_op<Native<uint32_t>>(op, dst, src, n, stream);
    case ElemType::kU64:
      return launch_op<Native<uint64_t>>(op, dst, src, n, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jaxring::cuda
