// Small device primitives shared by the CUDA kernels: launch helpers, warp/block scans, 16-bit
// conversions and the fast exp2 / reciprocal. Hopper-only instructions live in hopper.cuh.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <initializer_list>

#include "common/dispatch.h"

namespace kda_dsa_ops {

constexpr int kWarpSize = 32;

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Lets `kernel` take `bytes` of dynamic shared memory (above 48 KB needs the opt-in).
template <typename Kernel>
void set_smem(Kernel kernel, size_t bytes) {
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

inline int num_sms(int device) {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

template <typename T>
__device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v) { return static_cast<T>(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// Rows read and written C values at a time (the memory-bound kernels: hc_mix, short_conv,
// swiglu): one vector load or store when vec (the row length a multiple of C, rows aligned to
// C elements: aligned_to), else element by element with zeros past D.
inline bool aligned_to(const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// Whether rows of `width` elements of T starting at each of ptrs (null: absent) take C-wide vectors.
template <int C, typename T>
bool rows_vectorised(int64_t width, std::initializer_list<const void*> ptrs) {
  if (width % C != 0) return false;
  for (const void* ptr : ptrs) {
    if (ptr != nullptr && !aligned_to(ptr, sizeof(T) * C)) return false;
  }
  return true;
}

template <typename T, int C>
struct alignas(sizeof(T) * C) Pack {
  T v[C];
};

template <typename T, int C>
__device__ __forceinline__ void load_cols(const T* row, int64_t d, int64_t D, bool vec, float (&out)[C]) {
  if (vec) {
    const Pack<T, C> pk = *reinterpret_cast<const Pack<T, C>*>(row + d);
#pragma unroll
    for (int e = 0; e < C; ++e) out[e] = to_float(pk.v[e]);
  } else {
#pragma unroll
    for (int e = 0; e < C; ++e) out[e] = d + e < D ? to_float(row[d + e]) : 0.f;
  }
}

template <typename T, int C>
__device__ __forceinline__ void store_cols(T* row, int64_t d, int64_t D, bool vec, const float (&v)[C]) {
  if (vec) {
    Pack<T, C> pk;
#pragma unroll
    for (int e = 0; e < C; ++e) pk.v[e] = from_float<T>(v[e]);
    *reinterpret_cast<Pack<T, C>*>(row + d) = pk;
  } else {
#pragma unroll
    for (int e = 0; e < C; ++e) {
      if (d + e < D) row[d + e] = from_float<T>(v[e]);
    }
  }
}

constexpr float kLog2e = 1.4426950408889634f;

// 2^x and 1/x on the MUFU unit with denormals flushed (exp2f / __fdividef add a range check
// and rescale around every call to honour denormals, ~4 instructions each).
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcp_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// One element of type e at p[i] (Elem: dispatch.h), as float / from float.
__device__ __forceinline__ float load_elem(const void* p, int64_t i, Elem e) {
  switch (e) {
    case Elem::kBF16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case Elem::kF16:
      return __half2float(static_cast<const __half*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ void store_elem(void* p, int64_t i, float x, Elem e) {
  switch (e) {
    case Elem::kBF16:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
      break;
    case Elem::kF16:
      static_cast<__half*>(p)[i] = __float2half_rn(x);
      break;
    default:
      static_cast<float*>(p)[i] = x;
  }
}

// Float -> uint32 whose unsigned order is the descending order of the float (NaN ranks last,
// -0 equals +0).
__device__ __forceinline__ uint32_t descending_bits(float v) {
  if (isnan(v)) v = -INFINITY;
  v += 0.f;
  const uint32_t b = __float_as_uint(v);
  const uint32_t ascending = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return ~ascending;
}

// The inverse of descending_bits (for finite values).
__device__ __forceinline__ float from_descending_bits(uint32_t d) {
  const uint32_t asc = ~d;
  return __uint_as_float((asc & 0x80000000u) ? (asc & 0x7fffffffu) : ~asc);
}

// d sigmoid(x) / dx = e / (1 + e)^2 with e = exp(-|x|): no cancellation near saturation.
__device__ __forceinline__ float sigmoid_grad(float x) {
  const float e = expf(-fabsf(x));
  const float d = 1.f + e;
  return e / (d * d);
}

struct SumOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct MinOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a < b ? a : b; }
};
struct MaxOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a > b ? a : b; }
};

template <typename T, typename Op>
__device__ __forceinline__ T warp_inclusive_scan(T v, Op op) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int d = 1; d < kWarpSize; d *= 2) {
    const T other = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v = op(v, other);
  }
  return v;
}

template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
  for (int d = kWarpSize / 2; d > 0; d /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, d));
  return v;
}

// Inclusive scan over the block (blockDim.x a multiple of 32, at most 1024). Returns the
// thread's prefix; *total receives the block total. warp_totals: 32 entries of shared memory.
template <typename T, typename Op>
__device__ T block_inclusive_scan(T v, Op op, T identity, T* warp_totals, T* total) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  v = warp_inclusive_scan(v, op);
  if (lane == kWarpSize - 1) warp_totals[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T w = lane < warps ? warp_totals[lane] : identity;
    w = warp_inclusive_scan(w, op);
    warp_totals[lane] = w;
  }
  __syncthreads();
  if (warp > 0) v = op(warp_totals[warp - 1], v);
  *total = warp_totals[warps - 1];
  __syncthreads();
  return v;
}

// Exclusive and inclusive prefix sums of n ints over one block, chunk by chunk:
// store(i, exclusive, inclusive) for every i < n. Every thread of the block must call it.
template <typename Load, typename Store>
__device__ void block_scan_sum(int n, Load load, Store store) {
  __shared__ int warp_totals[kWarpSize];
  int carry = 0;
  for (int base = 0; base < n; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const int v = i < n ? load(i) : 0;
    int total;
    const int inclusive = block_inclusive_scan(v, SumOp{}, 0, warp_totals, &total);
    if (i < n) store(i, carry + inclusive - v, carry + inclusive);
    carry += total;
  }
}

}  // namespace kda_dsa_ops
