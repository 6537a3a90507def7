// What the GQA kernels at 8 heads a kv head (Dqk, dv <= 128; gqa_fwd_cuda.cu, gqa_bwd_cuda.cu) share:
// the keys along the mma's rows, each lane's ldmatrix row address saying which key a step's row
// holds, and the kv rows' gathers.
#pragma once

#include "dsa/dsa_cuda.cuh"

namespace kda_dsa_ops::dsa::gqa {

constexpr int kDim = 128;  // Dqk and dv, padded
constexpr int kLd = kDim + 8;

// The 8 x 8 16-bit matrix whose fragment (row lane / 4, cols 2 (lane % 4) ..) is x, transposed.
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// A step's rows as this lane addresses them: key lane % 16 for S^T's ldmatrix (its columns 8 (lane /
// 16) ..), key lane % 8 + 8 (lane / 16) for V^T's ldmatrix.trans (its columns 8 (lane / 8 % 2) ..).
template <typename T>
struct StepRows {
  const T* k;
  const T* v;
};
__device__ __forceinline__ int k_row_of_lane() { return threadIdx.x % 16; }
__device__ __forceinline__ int v_row_of_lane() { return threadIdx.x % 8 + threadIdx.x % 32 / 16 * 8; }
template <typename T>
__device__ __forceinline__ StepRows<T> step_rows(const T* k_row, const T* v_row) {
  const int lane = threadIdx.x % 32;
  return {k_row + lane / 16 * 8, v_row + lane / 8 % 2 * 8};
}

// A lane's 16-byte piece (lane % 16) of the kv rows of one kv head, from an address and a key
// stride fixed for the kernel: a row's copy costs a select, one wide multiply-add and the cp.async
// (zeros past Dqk and for a slot without a key). With the address computed a row, the copies took ~20
// SASS instructions each.
template <typename T>
struct KvPieces {
  const char* base;  // the piece in key 0's row
  uint32_t stride;   // bytes from one key's row to the next
  bool in;           // the piece lies within Dqk

  __device__ __forceinline__ KvPieces(const AttnArgs& a, int kvh) {
    const int piece = threadIdx.x % 16;
    in = piece * 8 < a.Dqk;
    base = reinterpret_cast<const char*>(static_cast<const T*>(a.kv) + int64_t{kvh} * a.Dqk + (in ? piece * 8 : 0));
    stride = static_cast<uint32_t>(a.Hkv * a.Dqk * sizeof(T));
  }
  // Key k's piece (k < 0: zeros) into the shared row dst.
  __device__ __forceinline__ void copy(T* dst, int k) const {
    const bool valid = in && k >= 0;
    const uint32_t key = valid ? static_cast<uint32_t>(k) : 0u;  // (unsigned: one IMAD.WIDE.U32)
    cp_async_16_zfill(dst + threadIdx.x % 16 * 8, base + uint64_t{key} * stride, valid);
  }
};

}  // namespace kda_dsa_ops::dsa::gqa
