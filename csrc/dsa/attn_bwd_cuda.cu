// Sparse attention's backward. With P the probabilities, dA = sigmoid(gate) dO the gradient of
// the attention output and delta = rowsum(dO * o) (the gate folded in):
//   dS = scale P * (dA V^T - delta) (elementwise),  dq = dS K,
//   dkv[s] += dS^T q (key columns) + P^T dA (value columns),  dgate = dO * o * (1 - sigmoid(gate)).
// The forward's blocks (packed queries included), key tiles of 32: dq in registers, dkv added to
// an fp32 buffer with 16-byte atomics, or, deterministic, stored per (query, slot) and summed in
// index order afterwards. The MLA layouts above 16 heads per kv head take mla_bwd_cuda.cu's
// kernel on sm_90a instead, and the atomic backward's packed blocks at 8 heads a kv head with Dqk <=
// 128 gqa_bwd_cuda.cu's.
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "common/dispatch.h"
#include "dsa/dsa_cuda.cuh"

namespace kda_dsa_ops::dsa {

namespace {

template <int kDqk, int kDv, int kRows>
struct BwdShape : AttnShape<kDqk, kRows, 32> {
  using Base = AttnShape<kDqk, kRows, 32>;
  static constexpr int kLdO = kDv + 8;
  static constexpr int kQTiles = kDqk / 2 / 8;                         // dq tiles per warp
  static constexpr int kUnitsPerWarp = kDqk / 16 / (Base::kWarps / 2);  // 16-column dkv units per warp
  static_assert(kDqk / 16 % (Base::kWarps / 2) == 0, "dkv columns must split evenly over the warps");
  // d(attention output), P, dS, delta and lse.
  static constexpr size_t kExtra = (kRows * kLdO + 2 * kRows * Base::kLdP) * 2 + 2 * kRows * sizeof(float);
  static constexpr int kStages = Base::stages_for(kExtra);  // key tiles in flight
  static constexpr size_t kSmem = Base::tile_bytes(kStages) + kExtra;
};

template <typename T, int kDqk, int kDv, int kRows, bool kPacked>
__global__ void __launch_bounds__(BwdShape<kDqk, kDv, kRows>::kThreads) attn_bwd_kernel(AttnBwdArgs a) {
  using S = BwdShape<kDqk, kDv, kRows>;
  const AttnItem item = attn_item<kPacked>(a);
  if (attn_skips(a, item.t, item.kvh)) return;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + kRows * S::kLd;                // kStages key tiles
  T* sO = sK + S::kStages * S::kKeys * S::kLd;  // d(attention output) = grad_o * sigmoid(gate)
  T* sP = sO + kRows * S::kLdO;
  T* sDS = sP + kRows * S::kLdP;
  float* delta = reinterpret_cast<float*>(sDS + kRows * S::kLdP);
  float* lse2 = delta + kRows;
  int* sIdx = reinterpret_cast<int*>(lse2 + kRows);  // [kStages][kKeys]
  uint8_t* sHas = reinterpret_cast<uint8_t*>(sIdx + S::kStages * S::kKeys);  // [kStages][kKeys]

  const T* gate = static_cast<const T*>(a.gate);
  const T* grad_o = static_cast<const T*>(a.grad_o);
  const T* o = static_cast<const T*>(a.o_in);
  const AttnBlock blk = attn_block<T, kRows, kDqk, kPacked>(a, item, sQ, S::kLd);
  const auto [t, kvh, head0, rows, length, warp, lane, g, c, wr, wc, r0, kd, sl2, idx] = blk;
  const int kdv = round16(a.dv);
  // delta = sum(grad_o * o) (o gated), dgate = grad_o * o * (1 - sigmoid(gate)).
  for (int r = warp; r < kRows; r += S::kWarps) {
    const int64_t row = attn_q_row<kPacked>(a, blk, r);
    const bool valid = row >= 0;
    float dsum = 0.f;
    // Every load of the row before the first store (dgate could alias them as far as the compiler
    // knows: loads after a store would each wait for the previous round trip).
    constexpr int kPer = kDv / 32;
    float dd[kPer], od[kPer], sg[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int d = lane + 32 * k;
      const bool in = valid && d < a.dv;
      dd[k] = in ? to_float(grad_o[row * a.dv + d]) : 0.f;
      od[k] = in ? to_float(o[row * a.dv + d]) : 0.f;
      sg[k] = in && gate != nullptr ? to_float(gate[row * a.dv + d]) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int d = lane + 32 * k;
      float s = 1.f;
      if (gate != nullptr) {
        s = sigmoidf(sg[k]);
        if (valid && d < a.dv) static_cast<T*>(a.dgate)[row * a.dv + d] = from_float<T>(dd[k] * od[k] * (1.f - s));
      }
      dsum += dd[k] * od[k];
      sO[r * S::kLdO + d] = from_float<T>(dd[k] * s);
    }
    dsum = warp_reduce(dsum, SumOp{});
    if (lane == 0) {
      delta[r] = dsum;
      const float l = valid ? a.lse_in[row] : -INFINITY;
      lse2[r] = l == -INFINITY ? INFINITY : l * kLog2e;  // no key: every p = 0; NaN stays NaN
    }
  }

  float dq[S::kQTiles][4] = {};
  AttnTiles<T, S::kStages, S::kKeys, kPacked> tiles =
      attn_tiles<T, S::kStages, S::kKeys, kDqk, kPacked>(a, blk, sK, S::kLd, sIdx, sHas);
  tiles.start();
  int it = 0;
  for (int k0 = 0; k0 < length; k0 += S::kKeys, ++it) {
    const int b = tiles.ready(it, k0);
    const T* sKt = tiles.tile(b);
    const int* sIdxt = sIdx + b * S::kKeys;

    // Logits and dP = dO V^T for rows wr * 16.., keys wc * 16..: V is the keys' first dv columns, so
    // each fragment of the key tile serves both products (loaded once: shared-memory loads bound the
    // kernel).
    float s[2][4] = {}, dp[2][4] = {};
    for (int kk = 0; kk < kd; kk += 16) {
      uint32_t af[4], bf[4];
      load_a(af, sQ, S::kLd, wr * 16, kk);
      load_b_nk(bf, sKt, S::kLd, wc * 16, kk);
      mma_16816<T>(s[0], af, bf[0], bf[1]);
      mma_16816<T>(s[1], af, bf[2], bf[3]);
      if (kk < kdv) {
        load_a(af, sO, S::kLdO, wr * 16, kk);
        mma_16816<T>(dp[0], af, bf[0], bf[1]);
        mma_16816<T>(dp[1], af, bf[2], bf[3]);
      }
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int col = wc * 16 + j * 8 + 2 * c;
      float p[4], ds[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int rr = r0 + 8 * (e / 2);
        const bool in = attn_has<kPacked>(a, sIdxt, sHas + b * S::kKeys, col + (e & 1), wr, e / 2);
        p[e] = in ? exp2f(s[j][e] * sl2 - lse2[rr]) : 0.f;
        ds[e] = p[e] * (dp[j][e] - delta[rr]) * a.scale;
      }
      *reinterpret_cast<uint32_t*>(sP + r0 * S::kLdP + col) = pack2<T>(p[0], p[1]);
      *reinterpret_cast<uint32_t*>(sP + (r0 + 8) * S::kLdP + col) = pack2<T>(p[2], p[3]);
      *reinterpret_cast<uint32_t*>(sDS + r0 * S::kLdP + col) = pack2<T>(ds[0], ds[1]);
      *reinterpret_cast<uint32_t*>(sDS + (r0 + 8) * S::kLdP + col) = pack2<T>(ds[2], ds[3]);
    }
    __syncthreads();
    // dq += dS K (rows wr * 16.., cols wc * kDqk / 2..).
#pragma unroll
    for (int kk = 0; kk < S::kKeys; kk += 16) {
      uint32_t af[4];
      load_a(af, sDS, S::kLdP, wr * 16, kk);
#pragma unroll
      for (int np = 0; np < S::kQTiles / 2; ++np) {
        uint32_t bf[4];
        load_b_kn(bf, sKt, S::kLd, wc * (kDqk / 2) + np * 16, kk);
        mma_16816<T>(dq[2 * np], af, bf[0], bf[1]);
        mma_16816<T>(dq[2 * np + 1], af, bf[2], bf[3]);
      }
    }
    // dkv[key] += dS^T Q + P^T dO (value columns): keys (warp % 2) * 16.., column units of the warp.
    {
      const int kg = warp % 2, u0 = warp / 2 * S::kUnitsPerWarp;
      uint32_t a_ds[kRows / 16][4], a_p[kRows / 16][4];
#pragma unroll
      for (int ks2 = 0; ks2 < kRows / 16; ++ks2) {
        load_a_trans(a_ds[ks2], sDS, S::kLdP, kg * 16, ks2 * 16);
        load_a_trans(a_p[ks2], sP, S::kLdP, kg * 16, ks2 * 16);
      }
      for (int u = u0; u < u0 + S::kUnitsPerWarp; ++u) {
        const int n0 = u * 16;
        if (n0 >= kd) break;
        float acc[2][4] = {};
#pragma unroll
        for (int ks2 = 0; ks2 < kRows / 16; ++ks2) {
          uint32_t bf[4];
          load_b_kn(bf, sQ, S::kLd, n0, ks2 * 16);
          mma_16816<T>(acc[0], a_ds[ks2], bf[0], bf[1]);
          mma_16816<T>(acc[1], a_ds[ks2], bf[2], bf[3]);
        }
        if (n0 < kdv) {
#pragma unroll
          for (int ks2 = 0; ks2 < kRows / 16; ++ks2) {
            uint32_t bf[4];
            load_b_kn(bf, sO, S::kLdO, n0, ks2 * 16);
            mma_16816<T>(acc[0], a_p[ks2], bf[0], bf[1]);
            mma_16816<T>(acc[1], a_p[ks2], bf[2], bf[3]);
          }
        }
        // Lanes c and c ^ 1 swap halves so that each holds four consecutive columns of one row
        // (even c: row g, odd c: row g + 8): one 16-byte atomic (or store) instead of two 8-byte.
        const int h = c % 2, slot = kg * 16 + g + 8 * h, key = sIdxt[slot];
        float4 v[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float send0 = h == 0 ? acc[j][2] : acc[j][0], send1 = h == 0 ? acc[j][3] : acc[j][1];
          const float got0 = __shfl_xor_sync(0xffffffffu, send0, 1), got1 = __shfl_xor_sync(0xffffffffu, send1, 1);
          v[j] = h == 0 ? make_float4(acc[j][0], acc[j][1], got0, got1) : make_float4(got0, got1, acc[j][2], acc[j][3]);
        }
        if (key >= 0) {
          float* dst = a.dkv != nullptr
                           ? a.dkv + (int64_t{key} * a.Hkv + kvh) * a.Dqk
                           : a.contrib + ((((t - a.t0) * a.Hkv + kvh) * a.head_blocks + blockIdx.z) * a.topk + k0 + slot) *
                                             int64_t{a.Dqk};
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int col = n0 + j * 8 + 4 * (c / 2);
            if (col >= a.Dqk) continue;
            if (a.dkv != nullptr) {
              atomicAdd(reinterpret_cast<float4*>(dst + col), v[j]);
            } else {
              *reinterpret_cast<float4*>(dst + col) = v[j];
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
    const int64_t row = attn_q_row<kPacked>(a, blk, r0 + 8 * h);
    if (row < 0) continue;
    T* dst = dq_out + row * a.Dqk;
#pragma unroll
    for (int n = 0; n < S::kQTiles; ++n) {
      store_pair_within(dst, wc * (kDqk / 2) + n * 8 + 2 * c, a.Dqk, dq[n][2 * h], dq[n][2 * h + 1]);
    }
  }
}

// The deterministic dkv, one chunk of queries: each (query, kv head, head block, slot)'s
// contribution (a row of contrib) added to its dkv row in index order. The entries come sorted by
// dkv row, stably (in query order within a row); each block takes kSumEntries of them and, for
// each row whose run starts there, sums the run's contributions in order and adds the sum to the
// row, its only writer in the chunk (skip: the row of the slots without a key). A thread per four
// columns.
constexpr int kSumEntries = 32, kSumBatch = 8;

struct SumArgs {
  const int32_t* rows;   // [n] sorted
  const int64_t* order;  // [n]: the entry's row of contrib
  int64_t n;
  const float* contrib;  // [.., D]
  int D;
  int32_t skip;
  float* dkv;  // [.., D]
};

__global__ void ordered_sum_kernel(const SumArgs a) {
  const auto [rows, order, n, contrib, D, skip, dkv] = a;
  const int64_t e0 = blockIdx.x * int64_t{kSumEntries}, e1 = min(n, e0 + kSumEntries);
  for (int64_t e = e0; e < e1; ++e) {
    const int32_t row = rows[e];
    if (row == skip || (e > 0 && rows[e - 1] == row)) continue;
    int64_t end = e + 1;
    while (end < n && rows[end] == row) ++end;
    for (int c = threadIdx.x; c < D / 4; c += blockDim.x) {
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int64_t r0 = e; r0 < end; r0 += kSumBatch) {  // a batch's loads all in flight, then added in order
        float4 v[kSumBatch];
#pragma unroll
        for (int u = 0; u < kSumBatch; ++u) {
          v[u] = r0 + u < end ? reinterpret_cast<const float4*>(contrib + order[r0 + u] * D)[c] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < kSumBatch; ++u) {
          if (r0 + u >= end) break;
          acc.x += v[u].x;
          acc.y += v[u].y;
          acc.z += v[u].z;
          acc.w += v[u].w;
        }
      }
      float4* dst = reinterpret_cast<float4*>(dkv + int64_t{row} * D) + c;
      const float4 old = *dst;
      *dst = make_float4(old.x + acc.x, old.y + acc.y, old.z + acc.z, old.w + acc.w);
    }
  }
}

// The deterministic dkv of the Hopper MLA backward without stored terms (AttnBwdArgs::ticket): each
// query's keys sorted (an out-of-range key -1), kOrderedClasses classes of turns, the dkv copies of
// the classes past the first added to dkv at the end. `run` launches the kernel.
constexpr int kOrderedClasses = 4;

template <typename Run>
void ordered_dkv(const AttnProblem& p, const at::Tensor& indices, AttnBwdArgs a, at::Tensor& dkv, Run&& run) {
  const at::Tensor idx = indices.view({p.T, p.topk});
  const at::Tensor sorted =
      std::get<0>(at::where(idx.ge(0).logical_and(idx.lt(p.Tk)), idx, at::full({}, -1, idx.options())).sort(-1));
  at::Tensor progress = at::zeros({p.T * a.head_blocks + 1}, idx.options());  // + the ticket
  at::Tensor dkv_more = at::zeros({kOrderedClasses - 1, p.Tk, p.Dqk}, dkv.options());
  a.indices = sorted.data_ptr<int32_t>();
  a.dkv = dkv.data_ptr<float>();
  a.dkv_more = dkv_more.data_ptr<float>();
  a.classes = kOrderedClasses;
  a.progress = progress.data_ptr<int32_t>();
  a.ticket = reinterpret_cast<unsigned*>(a.progress + p.T * a.head_blocks);
  run(a);
  for (int c = 0; c < kOrderedClasses - 1; ++c) dkv.narrow(0, 0, p.Tk).add_(dkv_more[c]);
}

// One launch of the backward (QueryPack: each_launch).
void bwd_launch(const QueryPack& pk, const at::Tensor& grad_o, const at::Tensor& q, const at::Tensor& kv,
                const at::Tensor& o, const at::Tensor& lse, const at::Tensor& gate, bool deterministic, at::Tensor& dq,
                at::Tensor& dkv, at::Tensor& dgate) {
  const AttnProblem& p = pk.problem;
  const bool hopper = mla_bwd_takes(p, q);
  KDA_DISPATCH_CUDA_HALF(q.scalar_type(), "sparse_attn_bwd", [&] {
    with_attn_instance(p, pk.group > 1, [&](auto dqk, auto dv, auto rows, auto packed) {
      constexpr int kDqk = decltype(dqk)::value, kDv = decltype(dv)::value, kRows = decltype(rows)::value;
      using S = BwdShape<kDqk, kDv, kRows>;
      // The queries t0 .. t0 + n on this problem's kernel (the Hopper one's blocks have 64 heads too).
      const auto run = [&](const AttnBwdArgs& a, int64_t n) {
        if (hopper) {
          mla_bwd_launch<scalar_t>(a, n);
        } else if (kDqk == 128 && decltype(packed)::value && a.dkv != nullptr && pk.group == 8 && p.H / p.Hkv == 64) {
          gqa_packed_bwd_launch<scalar_t>(a, n);
        } else {
          launch(attn_bwd_kernel<scalar_t, kDqk, kDv, kRows, decltype(packed)::value>, dim3(n, p.Hkv, a.head_blocks),
                 S::kThreads, S::kSmem, a);
        }
      };
      AttnBwdArgs a{attn_args(pk, q, kv, gate, kRows),
                    grad_o.data_ptr(),
                    o.data_ptr(),
                    lse.data_ptr<float>(),
                    dq.data_ptr(),
                    nullptr,
                    nullptr,
                    dgate.defined() ? dgate.data_ptr() : nullptr};
      if (!deterministic) {
        a.dkv = dkv.data_ptr<float>();
        const at::Tensor order = with_order(pk, a);
        run(a, p.T);
        return;
      }
      if (hopper && pk.group == 1 && p.Hkv == 1 && p.topk > 0) {
        ordered_dkv(p, pk.indices, a, dkv, [&](const AttnBwdArgs& b) { run(b, p.T); });
        return;
      }
      // Deterministic, otherwise (packed blocks, the portable kernel): each (query, slot)
      // contribution is stored, then summed into dkv in index order (ordered_sum_kernel), a chunk
      // of queries at a time: up to 2^28 floats of contributions, a whole number of waves of blocks
      // (a block an SM) where one fits. dkv has one extra row for the slots without a key.
      const int64_t per_query = p.Hkv * a.head_blocks * p.topk * p.Dqk;
      const int64_t wave = std::max<int64_t>(1, num_sms(q.get_device()) / (p.Hkv * a.head_blocks));
      int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 28) / std::max<int64_t>(per_query, 1));
      if (chunk >= wave) chunk -= chunk % wave;
      at::Tensor contrib = at::empty({std::min(chunk, p.T) * per_query}, q.options().dtype(at::kFloat));
      const at::Tensor& indices = pk.indices;
      const at::Tensor kvh = at::arange(p.Hkv, indices.options()).view({1, -1, 1});
      at::Tensor rows_of;
      if (pk.lengths.defined()) {  // packed: a union's keys up to its length, past it none (mostly unwritten)
        const at::Tensor in = at::arange(p.topk, indices.options()).view({1, 1, -1}).lt(pk.lengths.unsqueeze(-1));
        rows_of = at::full(indices.sizes(), p.Tk * p.Hkv, indices.options());
        rows_of.index_put_({in}, indices.index({in}) * p.Hkv + kvh.expand_as(indices).index({in}));
      } else {
        rows_of = at::where(indices.ge(0).logical_and(indices.lt(p.Tk)), indices * p.Hkv + kvh,
                            at::full({}, p.Tk * p.Hkv, indices.options()))
                      .to(at::kInt);
      }
      at::Tensor dkv_rows = dkv.view({-1, p.Dqk});
      for (int64_t t0 = 0; t0 < p.T; t0 += chunk) {
        const int64_t n = std::min(chunk, p.T - t0);
        a.t0 = t0;
        a.contrib = contrib.data_ptr<float>();
        run(a, n);
        const auto [rows, order] = rows_of.narrow(0, t0, n)
                                       .unsqueeze(2)
                                       .expand({n, p.Hkv, a.head_blocks, p.topk})
                                       .reshape({-1})
                                       .sort(std::optional<bool>(true), 0, false);  // stable
        const int64_t entries = rows.numel();
        const SumArgs sum{rows.data_ptr<int32_t>(), order.data_ptr<int64_t>(), entries,
                          contrib.data_ptr<float>(),  static_cast<int>(p.Dqk),   static_cast<int32_t>(p.Tk * p.Hkv),
                          dkv_rows.data_ptr<float>()};
        launch(ordered_sum_kernel, dim3(ceil_div(entries, kSumEntries)), static_cast<int>(ceil_div(p.Dqk / 4, 32) * 32),
               0, sum);
      }
    });
  });
}

}  // namespace

void attn_bwd_cuda(const QueryPack& pk, const at::Tensor& grad_o, const at::Tensor& q, const at::Tensor& kv,
                   const at::Tensor& o, const at::Tensor& lse, const at::Tensor& gate, bool deterministic,
                   at::Tensor& dq, at::Tensor& dkv, at::Tensor& dgate) {
  const c10::cuda::CUDAGuard guard(q.device());
  each_launch(pk, [&](const QueryPack& part) {
    bwd_launch(part, grad_o, q, kv, o, lse, gate, deterministic, dq, dkv, dgate);
  });
}

}  // namespace kda_dsa_ops::dsa
