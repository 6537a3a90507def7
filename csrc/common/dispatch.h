// Dtype dispatch for the kernels, the one mechanism: per instantiation (the KDA_DISPATCH_*
// macros; CPU kernels take every floating type, fp64 lets tests compare exactly against the
// reference; CUDA kernels the types they are built for), or per element at run time (Elem).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

namespace kda_dsa_ops {
// The type kernels accumulate in: float64 for float64 inputs (CPU), float32 otherwise.
inline at::ScalarType accumulation_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// A CUDA tensor's element type chosen at run time, where one kernel reads or writes many tensors
// that each take their own input's dtype (KDA's gradients: q's, g's, beta's): one instantiation
// serves every combination, and the loads and stores (device.cuh: load_elem, store_elem) switch
// on a value that is uniform across the grid. Operand types of the tensor-core kernels are
// chosen per instantiation (the macros below).
enum class Elem : int { kF32, kBF16, kF16 };

inline Elem elem_of(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return Elem::kF32;
    case at::kBFloat16:
      return Elem::kBF16;
    case at::kHalf:
      return Elem::kF16;
    default:
      TORCH_CHECK(false, op, ": the CUDA kernels take bfloat16, float16 or float32 inputs, got ", t.scalar_type(),
                  " (use the CPU kernel for float64)");
  }
}
}  // namespace kda_dsa_ops

#define KDA_DISPATCH_CPU_FLOATING(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

#define KDA_DISPATCH_CASE(ENUM, CTYPE, ...) \
  case ENUM: {                              \
    using scalar_t = CTYPE;                 \
    return __VA_ARGS__();                   \
  }

#define KDA_DISPATCH_HALF_CASES(...)                           \
  KDA_DISPATCH_CASE(at::kBFloat16, __nv_bfloat16, __VA_ARGS__) \
  KDA_DISPATCH_CASE(at::kHalf, __half, __VA_ARGS__)

// bfloat16 / float16.
#define KDA_DISPATCH_CUDA_HALF(TYPE, NAME, ...)                                                 \
  [&] {                                                                                        \
    switch (TYPE) {                                                                            \
      KDA_DISPATCH_HALF_CASES(__VA_ARGS__)                                                     \
      default:                                                                                 \
        TORCH_CHECK(false, NAME, ": CUDA kernel takes bfloat16 or float16, got ", TYPE);       \
    }                                                                                          \
  }()

// float32 / bfloat16 / float16.
#define KDA_DISPATCH_CUDA_FLOATING(TYPE, NAME, ...)                                            \
  [&] {                                                                                        \
    switch (TYPE) {                                                                            \
      KDA_DISPATCH_CASE(at::kFloat, float, __VA_ARGS__)                                        \
      KDA_DISPATCH_HALF_CASES(__VA_ARGS__)                                                     \
      default:                                                                                 \
        TORCH_CHECK(false, NAME, ": CUDA kernel takes float32, bfloat16 or float16, got ", TYPE); \
    }                                                                                          \
  }()
