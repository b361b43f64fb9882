// Typed element-wise reductions used at every reduce-scatter hop.
//
// float16 and bfloat16 are widened to float32, combined, and rounded back
// once per hop (round to nearest even), which is what NCCL does; the error of
// an allreduce therefore grows with the number of hops, not the element type
// of the intermediate.
#pragma once

#include <cstdint>
#include <string>

namespace jaxring {

enum class ReduceOp : int { kSum = 0, kProd = 1, kMin = 2, kMax = 3 };

// The element types jaxring reduces. Values match nothing outside jaxring;
// the FFI handlers translate XLA's types into these.
enum class ElemType : int {
  kF16,
  kBF16,
  kF32,
  kF64,
  kS8,
  kS16,
  kS32,
  kS64,
  kU8,
  kU16,
  kU32,
  kU64,
};

int64_t elem_bytes(ElemType t);
const char* elem_type_name(ElemType t);
const char* reduce_op_name(ReduceOp op);
// Returns false for an op value that is not a ReduceOp.
bool reduce_op_from_int(int64_t v, ReduceOp* op);

// dst[i] = a[i] (op) b[i] for i in [0, n). dst may alias a or b.
void reduce(ElemType t, ReduceOp op, void* dst, const void* a, const void* b,
            int64_t n);

// Conversions exposed for tests.
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bfloat16_to_float(uint16_t b);
uint16_t float_to_bfloat16(float f);

}  // namespace jaxring
