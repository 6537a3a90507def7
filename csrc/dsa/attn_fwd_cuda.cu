// Sparse attention's forward on mma.sync (any GPU with it; the MLA layout on Hopper goes to
// mla_fwd_cuda.cu):
//   o[t, h] = sigmoid(gate[t, h]) * sum_{s in sel(t)} softmax_s(scale q[t, h] . kv[s]) kv[s, :dv],
//   lse[t, h], and with return_p the probabilities summed over the heads of each kv head.
// One block per (query or packed queries, kv head, block of up to 64 heads), key tiles of 64 (two in
// flight where shared memory holds them), the online softmax in registers, P through shared memory
// into P V.
#include <c10/cuda/CUDAGuard.h>

#include "common/dispatch.h"
#include "dsa/dsa_cuda.cuh"

namespace kda_dsa_ops::dsa {

namespace {

template <int kDqk, int kDv, int kRows>
struct FwdShape : AttnShape<kDqk, kRows, 64> {
  using Base = AttnShape<kDqk, kRows, 64>;
  static constexpr int kVTiles = kDv / 2 / 8;  // value tiles per warp
  // P, the softmax reductions and the probability column sums.
  static constexpr size_t kExtra =
      kRows * Base::kLdP * 2 + (4 * kRows + kRows / 16 * Base::kKeys) * sizeof(float);
  static constexpr int kStages = Base::stages_for(kExtra);  // key tiles in flight
  static constexpr size_t kSmem = Base::tile_bytes(kStages) + kExtra;
};

template <typename T, int kDqk, int kDv, int kRows, bool kPacked>
__global__ void __launch_bounds__(FwdShape<kDqk, kDv, kRows>::kThreads) attn_fwd_kernel(AttnFwdArgs a) {
  using S = FwdShape<kDqk, kDv, kRows>;
  const AttnItem item = attn_item<kPacked>(a);
  if (attn_skips(a, item.t, item.kvh)) return;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + kRows * S::kLd;  // kStages key tiles
  T* sP = sK + S::kStages * S::kKeys * S::kLd;
  float* red_max = reinterpret_cast<float*>(sP + kRows * S::kLdP);  // [2][kRows]
  float* red_sum = red_max + 2 * kRows;                             // [2][kRows]
  float* colsum = red_sum + 2 * kRows;                              // [kRows / 16][kKeys]
  int* sIdx = reinterpret_cast<int*>(colsum + kRows / 16 * S::kKeys);  // [kStages][kKeys]
  uint8_t* sHas = reinterpret_cast<uint8_t*>(sIdx + S::kStages * S::kKeys);  // [kStages][kKeys]

  const AttnBlock blk = attn_block<T, kRows, kDqk, kPacked>(a, item, sQ, S::kLd);
  const auto [t, kvh, head0, rows, length, warp, lane, g, c, wr, wc, r0, kd, sl2, idx] = blk;
  using Tiles = AttnTiles<T, S::kStages, S::kKeys, kPacked>;
  const auto key_tiles = [&] {
    return attn_tiles<T, S::kStages, S::kKeys, kDqk, kPacked>(a, blk, sK, S::kLd, sIdx, sHas);
  };
  // Logits in log2 units for rows r0, r0 + 8 and keys wc * 32.. of tile buffer b (-inf where the
  // row's query does not have the slot's key).
  const auto logits = [&](float (&s)[4][4], const Tiles& tiles, int b) {
    for (int j = 0; j < 4; ++j) {
      for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
    }
    warp_qk_16x32(s, sQ, tiles.tile(b), S::kLd, wr * 16, wc * 32, kd);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool in = attn_has<kPacked>(a, sIdx + b * S::kKeys, sHas + b * S::kKeys,
                                          wc * 32 + j * 8 + 2 * c + (e & 1), wr, e / 2);
        s[j][e] = in ? s[j][e] * sl2 : -INFINITY;
      }
    }
  };

  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  float o_acc[S::kVTiles][4] = {};
  Tiles tiles = key_tiles();
  tiles.start();
  int it = 0;
  for (int k0 = 0; k0 < length; k0 += S::kKeys, ++it) {
    const int b = tiles.ready(it, k0);
    const T* sKt = tiles.tile(b);
    float s[4][4];
    logits(s, tiles, b);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) mx[e / 2] = fmaxf(mx[e / 2], s[j][e]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      if (c == 0) red_max[wc * kRows + r0 + 8 * h] = mx[h];
    }
    __syncthreads();
    float m_new[2], alpha[2], sum[2] = {0.f, 0.f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int rr = r0 + 8 * h;
      m_new[h] = fmaxf(m_run[h], fmaxf(red_max[rr], red_max[kRows + rr]));
      alpha[h] = m_new[h] == -INFINITY ? 1.f : exp2f(m_run[h] - m_new[h]);
    }
    const float m_sub[2] = {finite_or_zero(m_new[0]), finite_or_zero(m_new[1])};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = exp2f(s[j][e] - m_sub[e / 2]);
        s[j][e] = p;
        sum[e / 2] += p;
      }
      const int col = wc * 32 + j * 8 + 2 * c;
      *reinterpret_cast<uint32_t*>(sP + r0 * S::kLdP + col) = pack2<T>(s[j][0], s[j][1]);
      *reinterpret_cast<uint32_t*>(sP + (r0 + 8) * S::kLdP + col) = pack2<T>(s[j][2], s[j][3]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
      sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
      if (c == 0) red_sum[wc * kRows + r0 + 8 * h] = sum[h];
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int rr = r0 + 8 * h;
      l_run[h] = l_run[h] * alpha[h] + (red_sum[rr] + red_sum[kRows + rr]);
      m_run[h] = m_new[h];
    }
#pragma unroll
    for (int n = 0; n < S::kVTiles; ++n) {
      o_acc[n][0] *= alpha[0];
      o_acc[n][1] *= alpha[0];
      o_acc[n][2] *= alpha[1];
      o_acc[n][3] *= alpha[1];
    }
#pragma unroll
    for (int kk = 0; kk < S::kKeys; kk += 16) {
      uint32_t af[4];
      load_a(af, sP, S::kLdP, wr * 16, kk);
#pragma unroll
      for (int np = 0; np < S::kVTiles / 2; ++np) {
        uint32_t bf[4];
        load_b_kn(bf, sKt, S::kLd, wc * (kDv / 2) + np * 16, kk);
        mma_16816<T>(o_acc[2 * np], af, bf[0], bf[1]);
        mma_16816<T>(o_acc[2 * np + 1], af, bf[2], bf[3]);
      }
    }
    __syncthreads();
  }

  T* out = static_cast<T*>(a.o);
  const T* gate = static_cast<const T*>(a.gate);
  float lse2[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    lse2[h] = l_run[h] != 0.f ? m_run[h] + log2f(l_run[h]) : INFINITY;
    const int64_t row = attn_q_row<kPacked>(a, blk, r0 + 8 * h);
    if (row < 0) continue;
    const float inv = l_run[h] != 0.f ? 1.f / l_run[h] : 0.f;
    // The gate eight value tiles at a time, loaded before their stores (which could alias it, as
    // far as the compiler knows; sigmoid(inf) = 1 where there is no gate).
    constexpr int kBatch = S::kVTiles < 8 ? S::kVTiles : 8;
#pragma unroll
    for (int n0 = 0; n0 < S::kVTiles; n0 += kBatch) {
      float gv[kBatch][2];
#pragma unroll
      for (int n = 0; n < kBatch; ++n) {
        const int col = wc * (kDv / 2) + (n0 + n) * 8 + 2 * c;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          gv[n][e] = gate != nullptr && col + e < a.dv ? to_float(gate[row * a.dv + col + e]) : INFINITY;
        }
      }
#pragma unroll
      for (int n = 0; n < kBatch; ++n) {
        const int col = wc * (kDv / 2) + (n0 + n) * 8 + 2 * c;
        store_pair_within(out + row * a.dv, col, a.dv, o_acc[n0 + n][2 * h] * inv * sigmoidf(gv[n][0]),
                   o_acc[n0 + n][2 * h + 1] * inv * sigmoidf(gv[n][1]));
      }
    }
    if (wc == 0 && c == 0) a.lse[row] = l_run[h] != 0.f ? lse2[h] * kLn2 : -INFINITY;
  }
  if (a.probs == nullptr) return;

  // Second pass: the final probabilities summed over the block's heads (unpacked: QueryPack).
  Tiles again = key_tiles();
  again.start();
  it = 0;
  for (int k0 = 0; k0 < length; k0 += S::kKeys, ++it) {
    const int b = again.ready(it, k0);
    float s[4][4];
    logits(s, again, b);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = (r0 < rows ? exp2f(s[j][e] - lse2[0]) : 0.f) + (r0 + 8 < rows ? exp2f(s[j][2 + e] - lse2[1]) : 0.f);
        v += __shfl_xor_sync(0xffffffffu, v, 4);
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        if (g == 0) colsum[wr * S::kKeys + wc * 32 + j * 8 + 2 * c + e] = v;
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < S::kKeys && k0 + i < a.topk; i += blockDim.x) {
      float v = 0.f;
      for (int r = 0; r < kRows / 16; ++r) v += colsum[r * S::kKeys + i];
      float* dst = a.probs + (t * a.Hkv + kvh) * a.topk + k0 + i;
      if (a.head_blocks == 1) {
        *dst = v;
      } else {
        atomicAdd(dst, v);
      }
    }
  }
}

}  // namespace

void attn_fwd_cuda(const QueryPack& pk, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& gate,
                   at::Tensor& o, at::Tensor& lse, at::Tensor& probs) {
  const AttnProblem& p = pk.problem;
  if (mla_fwd_takes(p, q)) {
    mla_fwd_cuda(pk, q, kv, gate, o, lse, probs);
    return;
  }
  const c10::cuda::CUDAGuard guard(q.device());
  each_launch(pk, [&](const QueryPack& part) {
    if (gqa_fwd_takes(part.problem, part.group)) {
      gqa_fwd_cuda(part, q, kv, gate, o, lse, probs);
      return;
    }
    KDA_DISPATCH_CUDA_HALF(q.scalar_type(), "sparse_attn_fwd", [&] {
      with_attn_instance(part.problem, part.group > 1, [&](auto dqk, auto dv, auto rows, auto packed) {
        constexpr int kDqk = decltype(dqk)::value, kDv = decltype(dv)::value, kRows = decltype(rows)::value;
        using S = FwdShape<kDqk, kDv, kRows>;
        AttnFwdArgs a{attn_args(part, q, kv, gate, kRows), o.data_ptr(), lse.data_ptr<float>(),
                      probs.defined() ? probs.data_ptr<float>() : nullptr};
        const at::Tensor order = with_order(part, a);
        launch(attn_fwd_kernel<scalar_t, kDqk, kDv, kRows, decltype(packed)::value>,
               dim3(part.problem.T, part.problem.Hkv, a.head_blocks), S::kThreads, S::kSmem, a);
      });
    });
  });
}

}  // namespace kda_dsa_ops::dsa
