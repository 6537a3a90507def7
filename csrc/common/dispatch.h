// Dtype dispatch for the kernels. CPU kernels take every floating type (fp64 lets tests
// compare exactly against the reference); CUDA kernels take the 16-bit types they are built for.
#pragma once

#include <ATen/Dispatch.h>

#define KDA_DISPATCH_CPU_FLOATING(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

#define KDA_DISPATCH_CUDA_HALF(TYPE, NAME, ...)                                   \
  [&] {                                                                          \
    switch (TYPE) {                                                              \
      case at::kBFloat16: {                                                      \
        using scalar_t = __nv_bfloat16;                                          \
        return __VA_ARGS__();                                                    \
      }                                                                          \
      case at::kHalf: {                                                          \
        using scalar_t = __half;                                                 \
        return __VA_ARGS__();                                                    \
      }                                                                          \
      default:                                                                   \
        TORCH_CHECK(false, NAME, ": CUDA kernel takes bfloat16 or float16, got ", TYPE); \
    }                                                                            \
  }()

#define KDA_DISPATCH_CUDA_FLOATING(TYPE, NAME, ...)                               \
  [&] {                                                                          \
    switch (TYPE) {                                                              \
      case at::kFloat: {                                                         \
        using scalar_t = float;                                                  \
        return __VA_ARGS__();                                                    \
      }                                                                          \
      case at::kBFloat16: {                                                      \
        using scalar_t = __nv_bfloat16;                                          \
        return __VA_ARGS__();                                                    \
      }                                                                          \
      case at::kHalf: {                                                          \
        using scalar_t = __half;                                                 \
        return __VA_ARGS__();                                                    \
      }                                                                          \
      default:                                                                   \
        TORCH_CHECK(false, NAME, ": CUDA kernel takes float32, bfloat16 or float16, got ", TYPE); \
    }                                                                            \
  }()
