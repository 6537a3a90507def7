// Warp-level tensor-core primitives (sm_80+): mma.sync m16n8k16 on 16-bit operands and m16n8k8
// on tf32 ones (split into hi + lo for fp32 accuracy), both with fp32 accumulation; ldmatrix
// fragment loads from shared memory, stores of accumulator pairs and cp.async row gathers.
//
// Fragment layout (g = lane / 4, c = lane % 4): an accumulator tile of 16 x 8 holds
// (row g, cols 2c, 2c+1) in d[0], d[1] and (row g + 8, same cols) in d[2], d[3].
// The loaders below take tiles stored row-major in shared memory with a leading dimension ld
// (elements); rows of 16 bytes must be 16-byte aligned and ld * 2 bytes an odd multiple of 16
// keeps ldmatrix free of bank conflicts.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/device.cuh"

namespace kda_dsa_ops::mma {

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

// d += a b: a 16 x 16 (row), b 16 x 8 (col), T = __nv_bfloat16 or __half.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// c0 += a b (cols n0..), c1 += a b (cols n0 + 8..), with b[4] from load_b_nk / load_b_kn.
template <typename T>
__device__ __forceinline__ void mma_16816_x2(float (&c0)[4], float (&c1)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[4]) {
  mma_16816<T>(c0, a, b[0], b[1]);
  mma_16816<T>(c1, a, b[2], b[3]);
}

// A fragment (16 x 16) of a row-major tile: rows row0.., cols k0...
template <typename T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* s, int ld, int row0, int k0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4(a, s + (row0 + lane % 16) * ld + k0 + lane / 16 * 8);
}

// A fragment (16 x 16) of X^T where X is row-major [k][m]: A rows m0.., cols (X rows) k0...
template <typename T>
__device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], const T* s, int ld, int m0, int k0) {
  const int lane = threadIdx.x % 32, i = lane % 8, m = lane / 8;
  ldmatrix_x4_trans(a, s + (k0 + i + m / 2 * 8) * ld + m0 + m % 2 * 8);
}

// B fragments of two 16 x 8 tiles (cols n0.. and n0 + 8..) of B = X^T, X row-major [n][k]:
// b[0], b[1] for the first tile, b[2], b[3] for the second.
template <typename T>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const T* s, int ld, int n0, int k0) {
  const int lane = threadIdx.x % 32, i = lane % 8, m = lane / 8;
  ldmatrix_x4(b, s + (n0 + i + m / 2 * 8) * ld + k0 + m % 2 * 8);
}

// The same for B row-major [k][n].
template <typename T>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const T* s, int ld, int n0, int k0) {
  const int lane = threadIdx.x % 32, i = lane % 8, m = lane / 8;
  ldmatrix_x4_trans(b, s + (k0 + i + m % 2 * 8) * ld + n0 + m / 2 * 8);
}

// Two floats as one register of two 16-bit values (the lower column first).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// The two 16-bit values packed by pack2 (or loaded as a pair, the lower address first) as floats.
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&v));
  }
}

// Two adjacent elements (p 2-element aligned: an even column) from fp32, one store.
__device__ __forceinline__ void store_pair(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
template <typename T>
__device__ __forceinline__ void store_pair(T* p, float a, float b) {
  *reinterpret_cast<uint32_t*>(p) = pack2<T>(a, b);
}
// Columns col, col + 1 of a row of `width` elements (col even), each only where it is inside.
template <typename T>
__device__ __forceinline__ void store_pair_within(T* row, int col, int width, float a, float b) {
  if (col < width) row[col] = from_float<T>(a);
  if (col + 1 < width) row[col + 1] = from_float<T>(b);
}

// A fragment (16 x 16 over k) from two accumulator tiles (cols k0.. and k0 + 8..): the
// probabilities of one key block feed the next product without a trip through shared memory.
template <typename T>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack2<T>(lo[0], lo[1]);
  a[1] = pack2<T>(lo[2], lo[3]);
  a[2] = pack2<T>(hi[0], hi[1]);
  a[3] = pack2<T>(hi[2], hi[3]);
}

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

// d += a b for one m16n8k8 tile with tf32 operands (fp32 accumulation).
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// x = hi + lo with hi, lo tf32: products of the parts recover fp32 accuracy (3 MMAs: hi hi,
// hi lo, lo hi; lo lo is below fp32 rounding).
template <int N>
__device__ __forceinline__ void split_tf32(const float (&x)[N], uint32_t (&hi)[N], uint32_t (&lo)[N]) {
  for (int i = 0; i < N; ++i) {
    hi[i] = to_tf32(x[i]);
    lo[i] = to_tf32(x[i] - __uint_as_float(hi[i]));
  }
}

// 16 bytes global -> shared, asynchronously.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(__cvta_generic_to_global(src))
               : "memory");
}
// 16 bytes global -> shared asynchronously, or 16 zero bytes where src is nullptr.
__device__ __forceinline__ void cp_async_16_or_zero(void* dst, const void* src) {
  if (src != nullptr) {
    cp_async_16(dst, src);
  } else {
    *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
  }
}
// 16 bytes global -> shared asynchronously where valid, else 16 zero bytes, without a branch (the
// copy's source size is 0: nothing is read from src, which must still be a global address).
__device__ __forceinline__ void cp_async_16_zfill(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(dst)),
               "l"(__cvta_generic_to_global(src)), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  cp_async_commit();
  cp_async_wait<0>();
}

// Copies cols [0, width) of `rows` rows into a row-major shared tile of leading dimension ld and
// zero-fills cols [width, cols): src(r) is row r's global address or nullptr for a row of zeros.
// width and cols multiples of 8; every thread of the block calls it.
template <typename T, typename Src>
__device__ __forceinline__ void gather_rows(T* dst, int ld, int rows, int width, int cols, Src src) {
  const int chunks = cols / 8;
  for (int i = threadIdx.x; i < rows * chunks; i += blockDim.x) {
    const int r = i / chunks, c = i % chunks * 8;
    const T* row = src(r);
    cp_async_16_or_zero(dst + r * ld + c, row != nullptr && c < width ? row + c : nullptr);
  }
}

}  // namespace kda_dsa_ops::mma
