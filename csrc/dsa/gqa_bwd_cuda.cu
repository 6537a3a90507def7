// Sparse attention's backward for the packed blocks at 8 query heads a kv head with Dqk <= 128 (8
// queries a block, atomic dkv; attn_bwd_cuda.cu's equations), walked as gqa_fwd_cuda.cu's packed
// forward walks them: two producer warps gather the block's union in tiles of 64 slots (three
// stages), with each slot's member bits and key, and a consumer warp a query queues the rows its
// query chose by bank group and steps through them with the keys along the mma's rows: S^T = K Q^T
// and dP^T = V dA^T from one load of each step's key fragments (Q^T and dA^T in registers), P^T and
// dS^T from them, dq^T += K^T dS^T in registers (dS^T the next product's operand by movmatrix), and
// P and dS stored to [64 rows x ring slot] buffers. Once every warp has taken a tile's rows, the
// eight warps add the tile's dkv from those buffers as the dense kernel does, each buffer entry
// masked by its slot's member bits (the entries of the queries that did not choose a slot hold an
// earlier tile's values), and release the tile. The dense kernel loads each slot's key fragments
// for all 64 rows whichever queries chose it; here S, dP and dq load them for the chosen rows only
// (H200, 4 kv heads, T 4096, Tk 8192, SFAG: random sets 8.06 -> 6.81 ms, window sets 4.61 -> 4.37,
// causal random sets over 8192 tokens 8.49 -> 7.86).
// The consumers' walk, the rows' prologue and the dkv adds are written out here as in the kernels
// they follow: as shared functions (the walk's queues an object, the adds and the prologue the
// dense kernel's helpers) they cost this kernel 5%, the packed forward 1.5% and G 64's SFAG 0.6%
// (same SASS counts; A/B on the H200, 2026-12-05). The functions of gqa_cuda.cuh (the ring's set-up,
// the producers, the queue push, the step mask) leave both packed kernels' SASS as it was.
#include <c10/cuda/CUDAGuard.h>

#include "dsa/gqa_cuda.cuh"

namespace kda_dsa_ops::dsa {

namespace {

using namespace gqa;

// (One CTA of 10 warps an SM: 168 registers a thread.)
struct PackedBwdShape : PackedRing<64, 3, 2> {
  static constexpr int kRows = 64;               // the block's query rows
  static constexpr int kLdB = kStages * kU + 8;  // P and dS: a row's ring slots (25 16-byte pieces)
  static constexpr size_t kRowsQA = size_t{2} * kRows * kLd * 2;  // Q and dA, the block's 64 rows
  static constexpr size_t kBufs = size_t{2} * kRows * kLdB * 2;   // P and dS
  static constexpr size_t kSlots = size_t{2} * kStages * kU * 4;  // the slots' member bits and keys
  static constexpr size_t kRowStats = size_t{2} * kRows * 4;      // delta, lse (log2 units)
  static constexpr size_t kSmem = kRing + kRowsQA + kBufs + kSlots + kLists + kRowStats + 2 * kStages * sizeof(uint64_t);
  static_assert((kRing + kRowsQA + kBufs + kSlots + kLists + kRowStats) % 8 == 0, "the mbarriers' alignment");
  static_assert(kSmem <= kMaxSmem, "shared memory");
};

template <typename T>
__global__ void __launch_bounds__(PackedBwdShape::kThreads, 1) gqa_packed_bwd_kernel(AttnBwdArgs a) {
  using P = PackedBwdShape;
  constexpr int kU = P::kU, kStages = P::kStages, kRows = P::kRows;
  extern __shared__ __align__(16) unsigned char smem[];
  T* ring = reinterpret_cast<T*>(smem);
  T* sQ = reinterpret_cast<T*>(smem + P::kRing);
  T* sA = sQ + kRows * kLd;  // d(attention output) = grad_o * sigmoid(gate)
  T* sP = sA + kRows * kLd;
  T* sDS = sP + kRows * P::kLdB;
  uint32_t* words = reinterpret_cast<uint32_t*>(sDS + kRows * P::kLdB);
  int32_t* keys = reinterpret_cast<int32_t*>(words + kStages * kU);
  uint16_t* lists = reinterpret_cast<uint16_t*>(keys + kStages * kU);
  float* delta = reinterpret_cast<float*>(lists + P::kQueries * P::kList);
  float* lse2 = delta + kRows;
  uint64_t* full = reinterpret_cast<uint64_t*>(lse2 + kRows);
  uint64_t* empty = full + kStages;
  const AttnItem item = attn_item<true>(a);
  const int64_t t = item.t;
  const int kvh = item.kvh;
  if (attn_skips(a, t, kvh)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int heads = static_cast<int>(a.H / a.group);  // the call's query heads
  const int64_t first_row = t * a.group * heads;
  const int queries = static_cast<int>(min(int64_t{a.group}, (a.rows_total - first_row) / heads));
  const int length = a.lengths[t * a.Hkv + kvh], tiles = (length + kU - 1) / kU;
  const int64_t base = (t * a.Hkv + kvh) * a.topk;  // the block's union
  start_ring<P::kZeroRow, kStages, P::kProducers>(ring, full, empty, P::kQueries);

  if (warp >= P::kQueries) {  // the producers, with each slot's key for dkv's adds
    produce_union<kU, kStages, P::kProducers, true>(a, kvh, base, length, warp - P::kQueries, ring, words, keys,
                                                    full, empty);
    return;
  }

  // The warp's query: its rows of Q and dA (zeros past Dqk and dv, and for no query), delta, lse and
  // dgate, as the dense kernel forms them.
  const int64_t row0 = first_row + int64_t{warp} * heads + int64_t{kvh} * 8;  // q's row of head 0
  const bool valid = warp < queries;
  {
    const T* q = static_cast<const T*>(a.q);
    const T* gate = static_cast<const T*>(a.gate);
    const T* grad_o = static_cast<const T*>(a.grad_o);
    const T* o = static_cast<const T*>(a.o_in);
    for (int j = 0; j < 8; ++j) {
      const int64_t row = row0 + j;
      const int r = 8 * warp + j;
#pragma unroll
      for (int k = 0; k < kDim / 32; ++k) {
        const int d = lane + 32 * k;
        sQ[r * kLd + d] = valid && d < a.Dqk ? q[row * a.Dqk + d] : from_float<T>(0.f);
      }
      float dsum = 0.f;
      float dd[kDim / 32], od[kDim / 32], sg[kDim / 32];
#pragma unroll
      for (int k = 0; k < kDim / 32; ++k) {
        const int d = lane + 32 * k;
        const bool in = valid && d < a.dv;
        dd[k] = in ? to_float(grad_o[row * a.dv + d]) : 0.f;
        od[k] = in ? to_float(o[row * a.dv + d]) : 0.f;
        sg[k] = in && gate != nullptr ? to_float(gate[row * a.dv + d]) : 0.f;
      }
#pragma unroll
      for (int k = 0; k < kDim / 32; ++k) {
        const int d = lane + 32 * k;
        float sig = 1.f;
        if (gate != nullptr) {
          sig = sigmoidf(sg[k]);
          if (valid && d < a.dv) static_cast<T*>(a.dgate)[row * a.dv + d] = from_float<T>(dd[k] * od[k] * (1.f - sig));
        }
        dsum += dd[k] * od[k];
        sA[r * kLd + d] = from_float<T>(dd[k] * sig);
      }
      dsum = warp_reduce(dsum, SumOp{});
      if (lane == 0) {
        delta[r] = dsum;
        const float l = valid ? a.lse_in[row] : -INFINITY;
        lse2[r] = l == -INFINITY ? INFINITY : l * kLog2e;  // no key: every p = 0; NaN stays NaN
      }
    }
  }
  __syncwarp();
  const int kd = round16(a.Dqk), kdv = round16(a.dv);
  const float sl2 = a.scale * kLog2e;
  // Q^T and dA^T as B fragments (dims x heads), this thread's heads' delta and lse.
  uint32_t qb[kDim / 16][2], ab[kDim / 16][2];
#pragma unroll
  for (int kk = 0; kk < kDim / 16; ++kk) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      qb[kk][h] = *reinterpret_cast<const uint32_t*>(sQ + (8 * warp + g) * kLd + kk * 16 + 8 * h + 2 * c);
      ab[kk][h] = *reinterpret_cast<const uint32_t*>(sA + (8 * warp + g) * kLd + kk * 16 + 8 * h + 2 * c);
    }
  }
  float my_delta[2], my_lse2[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    my_delta[h] = delta[8 * warp + 2 * c + h];
    my_lse2[h] = lse2[8 * warp + 2 * c + h];
  }
  float dq[kDim / 16][4] = {};  // dq^T: dims 16 d + g (+ 8), heads 2 c (+ 1)
  T* sPw = sP + 8 * warp * P::kLdB;
  T* sDSw = sDS + 8 * warp * P::kLdB;

  const int r = lane % 8;
  uint16_t* queue = lists + warp * P::kList + r * P::kQueue;
  int head = 0, tail = 0;
  // A step of kM x 16 queued rows (the forward's rule: step row 8 j + r is queue r's j-th).
  const bool full_dims = kd == kDim && kdv == kDim;  // the steps' loops without a bound read at run time
  const auto step = [&](auto m_tiles, auto dims) {
    constexpr int kM = decltype(m_tiles)::value;
    constexpr bool kFull = decltype(dims)::value;
    const int waiting = tail - head;
    const uint32_t mask = step_mask<kM>(waiting);
    StepRows<T> sr[kM];
    int slot_of[kM][2];  // the ring rows of this thread's accumulator rows 16 m + g (+ 8)
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      const int jk = 2 * m + lane % 16 / 8, jv = 2 * m + lane / 16;
      const int rk = jk < waiting ? queue[(head + jk) % P::kQueue] : P::kZeroRow + r;
      const int rv = jv < waiting ? queue[(head + jv) % P::kQueue] : P::kZeroRow + r;
      sr[m] = step_rows(ring + rk * kLd, ring + rv * kLd);
      slot_of[m][0] = __shfl_sync(~0u, rk, g);
      slot_of[m][1] = __shfl_sync(~0u, rk, g + 8);
    }
    // S^T and dP^T (keys 16 m + g (+ 8), heads 2 c (+ 1)), even and odd 16-dim steps apart.
    float s[kM][4] = {}, s2[kM][4] = {}, dp[kM][4] = {}, dp2[kM][4] = {};
#pragma unroll
    for (int kk = 0; kk < kDim / 16; ++kk) {
      if (!kFull && kk * 16 >= kd) break;
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        uint32_t af[4];
        ldmatrix_x4(af, sr[m].k + kk * 16);
        mma_16816<T>(kk % 2 ? s2[m] : s[m], af, qb[kk][0], qb[kk][1]);
        if (kFull || kk * 16 < kdv) mma_16816<T>(kk % 2 ? dp2[m] : dp[m], af, ab[kk][0], ab[kk][1]);
      }
    }
    uint32_t dsb[kM][2];  // dS^T as B fragments (keys x heads)
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      float p[4], ds[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool in = mask >> (16 * m + g + 8 * (e / 2)) & 1;
        p[e] = in ? exp2f((s[m][e] + s2[m][e]) * sl2 - my_lse2[e & 1]) : 0.f;
        ds[e] = p[e] * (dp[m][e] + dp2[m][e] - my_delta[e & 1]) * a.scale;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (mask >> (16 * m + g + 8 * h) & 1) {
          const int col = slot_of[m][h];
          sPw[(2 * c) * P::kLdB + col] = from_float<T>(p[2 * h]);
          sPw[(2 * c + 1) * P::kLdB + col] = from_float<T>(p[2 * h + 1]);
          sDSw[(2 * c) * P::kLdB + col] = from_float<T>(ds[2 * h]);
          sDSw[(2 * c + 1) * P::kLdB + col] = from_float<T>(ds[2 * h + 1]);
        }
      }
      dsb[m][0] = transpose8x8(pack2<T>(ds[0], ds[1]));
      dsb[m][1] = transpose8x8(pack2<T>(ds[2], ds[3]));
    }
    // dq^T += K^T dS^T.
#pragma unroll
    for (int d = 0; d < kDim / 16; ++d) {
      if (!kFull && d * 16 >= kd) break;
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        uint32_t ka[4];
        ldmatrix_x4_trans(ka, sr[m].v + d * 16);
        mma_16816<T>(dq[d], ka, dsb[m][0], dsb[m][1]);
      }
    }
    head += min(waiting, 2 * kM);
  };
  const auto take = [&]() {
    const auto with_dims = [&](auto m_tiles) {
      if (full_dims) {
        step(m_tiles, std::true_type{});
      } else {
        step(m_tiles, std::false_type{});
      }
    };
    if (__any_sync(~0u, tail - head > 2)) {
      with_dims(std::integral_constant<int, 2>{});
    } else {
      with_dims(std::integral_constant<int, 1>{});
    }
  };
  // dkv of the tile in stage s, from the P and dS buffers (every warp's steps over it done): slots
  // (warp % 4) 16 .., column units of 16 from (warp / 4) 4, the dense kernel's products and adds.
  const auto add_dkv = [&](int s) {
    const int kg = warp % 4, u0 = warp / 4 * 4;
    const uint32_t w0 = words[s * kU + kg * 16 + g], w1 = words[s * kU + kg * 16 + g + 8];
    uint32_t a_ds[kRows / 16][4], a_p[kRows / 16][4];
#pragma unroll
    for (int ks2 = 0; ks2 < kRows / 16; ++ks2) {
      load_a_trans(a_ds[ks2], sDS, P::kLdB, s * kU + kg * 16, ks2 * 16);
      load_a_trans(a_p[ks2], sP, P::kLdB, s * kU + kg * 16, ks2 * 16);
      // rows (queries 2 ks2 and 2 ks2 + 1) x slots g, g + 8: only the queries that chose the slot
      const uint32_t keep[4] = {w0 >> (2 * ks2) & 1 ? ~0u : 0u, w1 >> (2 * ks2) & 1 ? ~0u : 0u,
                                w0 >> (2 * ks2 + 1) & 1 ? ~0u : 0u, w1 >> (2 * ks2 + 1) & 1 ? ~0u : 0u};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        a_ds[ks2][e] &= keep[e];
        a_p[ks2][e] &= keep[e];
      }
    }
#pragma unroll
    for (int u = u0; u < u0 + 4; ++u) {
      const int n0 = u * 16;
      if (n0 >= kd) break;
      float acc[2][4] = {};
#pragma unroll
      for (int ks2 = 0; ks2 < kRows / 16; ++ks2) {
        uint32_t bf[4];
        load_b_kn(bf, sQ, kLd, n0, ks2 * 16);
        mma_16816<T>(acc[0], a_ds[ks2], bf[0], bf[1]);
        mma_16816<T>(acc[1], a_ds[ks2], bf[2], bf[3]);
      }
      if (n0 < kdv) {
#pragma unroll
        for (int ks2 = 0; ks2 < kRows / 16; ++ks2) {
          uint32_t bf[4];
          load_b_kn(bf, sA, kLd, n0, ks2 * 16);
          mma_16816<T>(acc[0], a_p[ks2], bf[0], bf[1]);
          mma_16816<T>(acc[1], a_p[ks2], bf[2], bf[3]);
        }
      }
      const int h = c % 2, key = keys[s * kU + kg * 16 + g + 8 * h];
      float4 v[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float send0 = h == 0 ? acc[j][2] : acc[j][0], send1 = h == 0 ? acc[j][3] : acc[j][1];
        const float got0 = __shfl_xor_sync(~0u, send0, 1), got1 = __shfl_xor_sync(~0u, send1, 1);
        v[j] = h == 0 ? make_float4(acc[j][0], acc[j][1], got0, got1) : make_float4(got0, got1, acc[j][2], acc[j][3]);
      }
      if (key >= 0) {
        float* dst = a.dkv + (int64_t{key} * a.Hkv + kvh) * a.Dqk;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int col = n0 + j * 8 + 4 * (c / 2);
          if (col < a.Dqk) atomicAdd(reinterpret_cast<float4*>(dst + col), v[j]);
        }
      }
    }
  };

  for (int i = 0; i < tiles; ++i) {
    const int s = i % kStages, before = tail;
    sm90::mbar_wait(&full[s], i / kStages & 1);
    queue_tile<kU, P::kQueue>(queue, tail, words, s, warp);
    __syncwarp();
    while (__all_sync(~0u, tail - head >= 4)) take();
    while (__any_sync(~0u, head < before)) take();  // the tile before's rows
    if (i > 0) {
      sm90::named_barrier_sync(1, 32 * P::kQueries);  // every warp's steps over tile i - 1 done
      add_dkv((i - 1) % kStages);
      __syncwarp();
      if (lane == 0) sm90::mbar_arrive(&empty[(i - 1) % kStages]);
    }
  }
  while (__any_sync(~0u, head < tail)) take();
  if (tiles > 0) {
    sm90::named_barrier_sync(1, 32 * P::kQueries);
    add_dkv((tiles - 1) % kStages);
  }

  if (!valid) return;
  T* dq_out = static_cast<T*>(a.dq);
#pragma unroll
  for (int d = 0; d < kDim / 16; ++d) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = 16 * d + g + 8 * (e / 2);
      if (col < a.Dqk) dq_out[(row0 + 2 * c + (e & 1)) * a.Dqk + col] = from_float<T>(dq[d][e]);
    }
  }
}

}  // namespace

template <typename T>
void gqa_packed_bwd_launch(const AttnBwdArgs& a, int64_t blocks) {
  launch(gqa_packed_bwd_kernel<T>, dim3(blocks, a.Hkv), PackedBwdShape::kThreads, PackedBwdShape::kSmem, a);
}

template void gqa_packed_bwd_launch<__nv_bfloat16>(const AttnBwdArgs&, int64_t);
template void gqa_packed_bwd_launch<__half>(const AttnBwdArgs&, int64_t);

}  // namespace kda_dsa_ops::dsa
