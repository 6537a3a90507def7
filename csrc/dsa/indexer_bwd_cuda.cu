// The lightning indexer's backward: for the selected keys s of query t and their score gradients
// dI, with d = q[t, j] . k[s] > 0 the terms through the ReLU,
//   dq[t, j] = sum_s dI[t, s] w[t, j] k[s],  dk[s] += sum_j dI[t, s] w[t, j] q[t, j],
//   dw[t, j] = sum_s dI[t, s] ReLU(d).
// One block per query (8 warps), key tiles of 64 in two stages, dq and dw in registers, dk added
// to an fp32 buffer.
#include <c10/cuda/CUDAGuard.h>

#include "common/dispatch.h"
#include "dsa/dsa_cuda.cuh"

namespace kda_dsa_ops::dsa {

namespace {

constexpr int kIdxThreads = 256;
static_assert(kIdxKeys <= kIdxThreads, "KeyTiles reads a tile's slots a thread each");

// The indexer's selected keys with their score gradients (0 where no key).
template <typename T>
using IndexedRows = RowsWith<T, kIdxKeys, float>;

struct IndexerBwdArgs {
  const void* q;
  const void* k;
  const float* w;
  const int32_t* indices;
  const float* grad;
  int64_t Tk;  // indices outside [0, Tk) count as -1
  int Hi, Di, topk;
  void* dq;
  float* dk;
  float* dw;
};

constexpr int kIdxLdC = kIdxKeys + 8;

template <typename T>
__global__ void __launch_bounds__(kIdxThreads) indexer_bwd_kernel(IndexerBwdArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + kIdxRows * kIdxLd;  // 2 key tiles
  T* sC = sK + 2 * kIdxKeys * kIdxLd;
  float* sW = reinterpret_cast<float*>(sC + kIdxRows * kIdxLdC);
  float* sG = sW + kIdxRows;           // [2][kIdxKeys]
  float* dw_part = sG + 2 * kIdxKeys;  // [2][kIdxRows]
  int* sIdx = reinterpret_cast<int*>(dw_part + 2 * kIdxRows);  // [2][kIdxKeys]

  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const int64_t t = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int wr = warp / 2, wc = warp % 2;
  const int kd = round16(a.Di);

  gather_rows(sQ, kIdxLd, kIdxRows, a.Di, kIdxDim,
              [&](int r) { return r < a.Hi ? q + (t * a.Hi + r) * a.Di : static_cast<const T*>(nullptr); });
  for (int r = threadIdx.x; r < kIdxRows; r += blockDim.x) sW[r] = r < a.Hi ? a.w[t * a.Hi + r] : 0.f;

  float dq[8][4] = {};
  float dw[2] = {0.f, 0.f};
  KeyTiles<T, 2, kIdxKeys, IndexedRows<T>> tiles{
      sK, kIdxLd, a.Di, kIdxDim, a.topk,
      IndexedRows<T>{{sIdx, a.indices + t * a.topk, a.topk, a.Tk, 1, 0, a.Di, k}, sG, a.grad + t * a.topk}};
  tiles.start();
  int it = 0;
  for (int k0 = 0; k0 < a.topk; k0 += kIdxKeys, ++it) {
    const int b = tiles.ready(it, k0);
    const T* sKt = tiles.tile(b);
    const int* sIdxt = sIdx + b * kIdxKeys;
    const float* sGt = sG + b * kIdxKeys;

    float s[4][4] = {};
    warp_qk_16x32(s, sQ, sKt, kIdxLd, wr * 16, wc * 32, kd);
    // d score / d (q.k) = g w [q.k > 0]; d score / d w = g relu(q.k).
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int col = wc * 32 + j * 8 + 2 * c;
      float coef[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float gk = sGt[col + (e & 1)], d = s[j][e];
        const bool active = d > 0.f;
        dw[e / 2] += active ? gk * d : 0.f;
        coef[e] = active ? gk * sW[wr * 16 + g + 8 * (e / 2)] : 0.f;
      }
      *reinterpret_cast<uint32_t*>(sC + (wr * 16 + g) * kIdxLdC + col) = pack2<T>(coef[0], coef[1]);
      *reinterpret_cast<uint32_t*>(sC + (wr * 16 + g + 8) * kIdxLdC + col) = pack2<T>(coef[2], coef[3]);
    }
    __syncthreads();
    // dq += C K (rows wr * 16.., cols wc * 64..).
#pragma unroll
    for (int kk = 0; kk < kIdxKeys; kk += 16) {
      uint32_t af[4];
      load_a(af, sC, kIdxLdC, wr * 16, kk);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t bf[4];
        load_b_kn(bf, sKt, kIdxLd, wc * 64 + np * 16, kk);
        mma_16816<T>(dq[2 * np], af, bf[0], bf[1]);
        mma_16816<T>(dq[2 * np + 1], af, bf[2], bf[3]);
      }
    }
    // dk[key] += (C^T Q)[key]: keys (warp % 4) * 16.., cols (warp / 4) * 64...
    {
      const int kg = warp % 4, n_base = warp / 4 * 64;
      uint32_t at[4][4];
#pragma unroll
      for (int ks2 = 0; ks2 < 4; ++ks2) load_a_trans(at[ks2], sC, kIdxLdC, kg * 16, ks2 * 16);
      for (int u = 0; u < 4; ++u) {
        const int n0 = n_base + u * 16;
        if (n0 >= kd) break;
        float acc[2][4] = {};
#pragma unroll
        for (int ks2 = 0; ks2 < 4; ++ks2) {
          uint32_t bf[4];
          load_b_kn(bf, sQ, kIdxLd, n0, ks2 * 16);
          mma_16816<T>(acc[0], at[ks2], bf[0], bf[1]);
          mma_16816<T>(acc[1], at[ks2], bf[2], bf[3]);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int key = sIdxt[kg * 16 + g + 8 * h];
          if (key < 0) continue;
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int col = n0 + j * 8 + 2 * c;
            if (col < a.Di) {
              atomicAdd(reinterpret_cast<float2*>(a.dk + int64_t{key} * a.Di + col),
                        make_float2(acc[j][2 * h], acc[j][2 * h + 1]));
            }
          }
        }
      }
    }
    __syncthreads();
  }
  T* dq_out = static_cast<T*>(a.dq);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = wr * 16 + g + 8 * h;
    if (row >= a.Hi) continue;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      store_pair_within(dq_out + (t * a.Hi + row) * a.Di, wc * 64 + n * 8 + 2 * c, a.Di, dq[n][2 * h], dq[n][2 * h + 1]);
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    dw[h] += __shfl_xor_sync(0xffffffffu, dw[h], 1);
    dw[h] += __shfl_xor_sync(0xffffffffu, dw[h], 2);
    if (c == 0) dw_part[wc * kIdxRows + wr * 16 + g + 8 * h] = dw[h];
  }
  __syncthreads();
  for (int r = threadIdx.x; r < a.Hi; r += blockDim.x) a.dw[t * a.Hi + r] = dw_part[r] + dw_part[kIdxRows + r];
}

}  // namespace

void indexer_bwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w, const at::Tensor& indices,
                      const at::Tensor& grad_scores, at::Tensor& dq, at::Tensor& dk, at::Tensor& dw) {
  if (q.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  IndexerBwdArgs a{q.data_ptr(),
                   k.data_ptr(),
                   w.data_ptr<float>(),
                   indices.data_ptr<int32_t>(),
                   grad_scores.data_ptr<float>(),
                   k.size(0),
                   static_cast<int>(q.size(1)),
                   static_cast<int>(q.size(2)),
                   static_cast<int>(indices.size(1)),
                   dq.data_ptr(),
                   dk.data_ptr<float>(),
                   dw.data_ptr<float>()};
  const size_t smem = ((kIdxRows + 2 * kIdxKeys) * kIdxLd + kIdxRows * kIdxLdC) * q.element_size() +
                      (3 * kIdxRows + 2 * kIdxKeys) * sizeof(float) + 2 * kIdxKeys * sizeof(int);
  KDA_DISPATCH_CUDA_HALF(q.scalar_type(), "lightning_indexer_bwd", [&] {
    launch(indexer_bwd_kernel<scalar_t>, dim3(q.size(0)), kIdxThreads, smem, a);
  });
}

}  // namespace kda_dsa_ops::dsa
