// Sparse attention's forward for the MLA layouts (one kv head, dv 512: DeepSeek's Dqk 576, GLM-5.3's
// NoPE Dqk 512) on sm_90a: the equations of attn_fwd_cuda.cu, with wgmma.
#include <c10/cuda/CUDAGuard.h>

#include "common/dispatch.h"
#include "common/pipeline.cuh"
#include "common/switches.h"
#include "common/tma.h"
#include "dsa/dsa_cuda.cuh"

namespace kda_dsa_ops::dsa {

namespace {

// One block per (query, block of up to 64 heads) of an MLA layout (Hkv 1, Dqk 576 or 512, dv 512), or
// per block of packed queries (QueryPack: each row attends over its query's slots of the union). A
// producer warpgroup gathers the selected rows, 64 keys a tile, into a 2-stage ring of
// 128B-swizzled tiles (cp.async, zeros for slots without a key). Two consumer warpgroups each take
// 32 of a tile's keys for S = Q K^T (wgmma m64n32k16 over the Dqk columns) and half of the value
// columns for O += P V (wgmma m64n256k16: P from shared memory, V the tile's first 512 columns read
// N-major). The row maxima cross between the groups every tile; each group keeps its own row sums,
// added at the end. Where probabilities are asked for, a second pass over the tiles recomputes S
// and sums the final probabilities over the heads.
// Two consumer warpgroups and the producer one. Registers go by warpgroups, so a producer warp
// alone would cost as much; setmaxnreg moves the producer's to the consumers.
template <int Dqk>
struct MlaFwd : sm90::WarpSpecialized<2, 56, 224> {
  static constexpr int kDqk = Dqk, kDv = 512, kRows = 64, kKeys = 64;
  static constexpr int kChunks = kDqk / 64;                 // 64-column swizzled chunks of a row
  static constexpr int kChunkBytes = 64 * 128;              // 64 rows x 64 columns
  static constexpr int kTileBytes = kChunks * kChunkBytes;  // Q, or a key tile: 72 KB (576) / 64 KB (512)
  static constexpr int kStages = 2;
  static constexpr int kSplit = 5;  // S starts on a tile's first chunks while the rest arrive
  static constexpr int kPBytes = kRows * kKeys * 2;
  using Ring = sm90::StageRing<kStages, 2>;  // full: a tile's first kSplit chunks, the rest
  static_assert(Dqk == 576 || Dqk == 512);
};

struct MlaFwdShared {
  MlaFwd<576>::Ring ring;  // (the same ring for both widths)
  uint32_t rows[MlaFwd<576>::kStages][64];  // per stage and slot: the rows with its key (produce_key_tile)
  float row_max[2][64];  // per consumer group, this tile
  float row_sum[2][64];  // per consumer group, at the end
};

template <int Dqk>
constexpr size_t kMlaFwdSmem = sm90::kSwizzleAlign + (1 + MlaFwd<Dqk>::kStages) * MlaFwd<Dqk>::kTileBytes +
                               MlaFwd<Dqk>::kPBytes + sizeof(MlaFwdShared);
static_assert(kMlaFwdSmem<576> <= kMaxSmem);

// One consumer thread's place (MlaPlace), its warpgroup (group), the scale in log2 units and the
// shared addresses of Q and P.
struct MlaThread : MlaPlace {
  int group;
  float sl2;
  uint32_t q_base, p_base;
};

// Producer warpgroup: the tiles in order (produce_key_tile), round twice with probabilities asked
// for.
template <typename T, typename M>
__device__ __forceinline__ void mla_produce(const AttnFwdArgs& a, MlaFwdShared& sh, uint8_t* sK, int64_t t,
                                            int head0, int rows, int tiles) {
  using namespace sm90;
  const int loads = a.probs != nullptr ? 2 * tiles : tiles;  // the second pass reads the tiles again
  for (int i = 0; i < loads; ++i) {
    produce_key_tile<T, M::kKeys, M::kDqk, M::kSplit>(sh.ring, i, sK + M::Ring::stage(i) * M::kTileBytes, a, t,
                                                      int64_t{i % tiles} * M::kKeys, sh.rows[M::Ring::stage(i)]);
    if (i == tiles - 1 && a.gate != nullptr && threadIdx.x == 256) {  // the epilogue reads the gate from L2
      bulk_prefetch_l2(static_cast<const T*>(a.gate) + (t * a.H + head0) * M::kDv, rows * M::kDv * sizeof(T));
    }
  }
}

// sc = S = Q K^T over this group's 32 keys of the tile loaded i-th, once its chunks arrive: issued
// and committed (mla_logits_issue), or also waited for (mla_logits).
template <typename T, typename M>
__device__ __forceinline__ void mla_logits_issue(float (&sc)[16], MlaFwdShared& sh, const uint8_t* sK,
                                                 const MlaThread& th, int i) {
  using namespace sm90;
  const uint32_t k_base = smem_addr(sK + M::Ring::stage(i) * M::kTileBytes);
#pragma unroll
  for (int x = 0; x < 16; ++x) sc[x] = 0.f;
  fence_accumulators(sc);
  sh.ring.wait_full(i, 0);
  wgmma_fence();
  const uint64_t q_desc = sw128_descriptor(th.q_base, 16), k_desc = sw128_descriptor(k_base + th.group * 32 * 128, 16);
#pragma unroll
  for (int kk = 0; kk < M::kDqk / 16; ++kk) {
    if (kk == 4 * M::kSplit) sh.ring.wait_full(i, 1);
    const uint32_t off = (kk / 4) * M::kChunkBytes + (kk % 4) * 32;
    wgmma_m64n32k16<T, 0, 0>(sc, desc_advance(q_desc, off), desc_advance(k_desc, off));
  }
  wgmma_commit();
}

template <typename T, typename M>
__device__ __forceinline__ void mla_logits(float (&sc)[16], MlaFwdShared& sh, const uint8_t* sK, const MlaThread& th,
                                           int i) {
  mla_logits_issue<T, M>(sc, sh, sK, th, i);
  sm90::wgmma_wait<0>();
  sm90::fence_accumulators(sc);
}

// The consumers' main loop over the tiles: S, the online softmax (the row maxima cross between
// the two groups every tile; each group keeps its row sums l_run of its columns), P into shared
// memory, O += P V over the group's 256 value columns. A tile is released once its P V is done.
template <typename T, typename M>
__device__ __forceinline__ void mla_attend(MlaFwdShared& sh, uint8_t* sK, uint8_t* sP, const MlaThread& th,
                                           float (&o)[128], float (&m_run)[2], float (&l_run)[2]) {
  using namespace sm90;
  const int group = th.group, c = th.c, r0 = th.r0;
  float sc[16];
  for (int i = 0; i < th.tiles; ++i) {
    const int s = i % M::kStages;
    const uint32_t k_base = smem_addr(sK + s * M::kTileBytes);
    if (i > 0) {  // the previous P V is done: its tile can be refilled while S runs
      wgmma_wait<0>();
      fence_accumulators(o);
      if (th.lane == 0) sh.ring.release(i - 1);
    }
    mla_logits<T, M>(sc, sh, sK, th, i);
    const uint32_t* slot_rows = sh.rows[s] + 32 * group;  // this group's 32 slots

    // Logits in log2 units (no key for the row: -inf); thread columns 32 group + 8 j + 2c (+1),
    // rows r0, r0 + 8.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool valid = (slot_rows[8 * j + 2 * c + (e & 1)] >> th.bit[e / 2]) & 1;
        sc[4 * j + e] = valid ? sc[4 * j + e] * th.sl2 : -INFINITY;
        mx[e / 2] = fmaxf(mx[e / 2], sc[4 * j + e]);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      if (c == 0) sh.row_max[group][r0 + 8 * h] = mx[h];
    }
    named_barrier_sync(1, 256);  // both groups' maxima; both groups' previous P V are done
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + 8 * h;
      const float m_new = fmaxf(m_run[h], fmaxf(sh.row_max[0][r], sh.row_max[1][r]));
      alpha[h] = m_new == -INFINITY ? 1.f : exp2f(m_run[h] - m_new);
      m_run[h] = m_new;
      l_run[h] *= alpha[h];
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float pr[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        pr[e] = exp2f(sc[4 * j + e] - finite_or_zero(m_run[e / 2]));
        l_run[e / 2] += pr[e];
      }
      const int col = 32 * group + 8 * j + 2 * c;
      *reinterpret_cast<uint32_t*>(sP + sw128_offset(r0, col / 8) + (col % 8) * 2) = pack2<T>(pr[0], pr[1]);
      *reinterpret_cast<uint32_t*>(sP + sw128_offset(r0 + 8, col / 8) + (col % 8) * 2) = pack2<T>(pr[2], pr[3]);
    }
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {  // the maxima rose (rarer by the tile)
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        o[4 * n] *= alpha[0];
        o[4 * n + 1] *= alpha[0];
        o[4 * n + 2] *= alpha[1];
        o[4 * n + 3] *= alpha[1];
      }
    }
    fence_proxy_async();
    named_barrier_sync(1, 256);  // P complete
    fence_accumulators(o);
    wgmma_fence();
    const uint64_t p_desc = sw128_descriptor(th.p_base, 16),
                   v_desc = sw128_descriptor(k_base + 4 * group * M::kChunkBytes, M::kChunkBytes);
#pragma unroll
    for (int kk = 0; kk < M::kKeys / 16; ++kk) {  // O += P V over this group's 256 value columns
      wgmma_m64n256k16<T, 0, 1>(o, desc_advance(p_desc, kk * 32), desc_advance(v_desc, kk * 2048));
    }
    wgmma_commit();
  }
  wgmma_wait<0>();
  fence_accumulators(o);
}

// Epilogue: both groups' row sums into sh.row_sum, then o / l times sigmoid(gate) (the row's gate
// loads all issued before its first store) and lse.
template <typename T, typename M>
__device__ __forceinline__ void mla_store(const AttnFwdArgs& a, MlaFwdShared& sh, const MlaThread& th,
                                          const float (&o)[128], const float (&m_run)[2], float (&l_run)[2]) {
  using namespace sm90;
  const int group = th.group, c = th.c, r0 = th.r0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
    if (c == 0) sh.row_sum[group][r0 + 8 * h] = l_run[h];
  }
  named_barrier_sync(1, 256);
  T* out = static_cast<T*>(a.o);
  const T* gate = static_cast<const T*>(a.gate);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 8 * h;
    if (r >= th.rows) continue;
    const float l = sh.row_sum[0][r] + sh.row_sum[1][r];
    const float inv = l != 0.f ? 1.f / l : 0.f;
    const int64_t row = th.t * a.H + th.head0 + r;
    uint32_t gv[32];  // the row's gate pairs, all loads issued before the first store
#pragma unroll
    for (int n = 0; n < 32; ++n) {
      gv[n] = gate != nullptr ? __ldg(reinterpret_cast<const unsigned int*>(gate + row * M::kDv + 256 * group + 8 * n + 2 * c))
                              : 0u;
    }
#pragma unroll
    for (int n = 0; n < 32; ++n) {
      const int col = 256 * group + 8 * n + 2 * c;
      float v0 = o[4 * n + 2 * h] * inv, v1 = o[4 * n + 2 * h + 1] * inv;
      if (gate != nullptr) {
        const float2 gf = unpack2<T>(gv[n]);
        v0 *= sigmoidf(gf.x);
        v1 *= sigmoidf(gf.y);
      }
      *reinterpret_cast<uint32_t*>(out + row * M::kDv + col) = pack2<T>(v0, v1);
    }
    if (group == 0 && c == 0) a.lse[row] = l != 0.f ? (m_run[h] + log2f(l)) * kLn2 : -INFINITY;
  }
}

// Second pass (probabilities asked for): exp(S - lse) summed over each query's heads, per key
// (rows without the key, and the padding rows past `rows`, add nothing). A tile's S is issued
// before the previous one's sums are formed (two accumulators in turn), and its stage released as
// soon as S is read. Each warp sums its 8-row units (rows r0 and r0 + 8 are two) over the lanes 4
// apart by halving exchanges (lane g ends with column 8 (g / 2) + 2c + g % 2), through P's shared
// memory (two buffers in turn: one barrier a tile); then a query's units are added: probs [t,
// query, slot] for a packed block's queries (AttnArgs::member), else [t, slot] (added over head
// blocks).
template <typename M>
__device__ __forceinline__ void mla_probability_sums(const AttnFwdArgs& a, const MlaThread& th, const float (&sc)[16],
                                                     uint32_t valid, const float (&lse2)[2], float* colsum, int i) {
  const int group = th.group, warp = th.warp, g = th.g;
  float v[2][8];  // [h][column 2 j + e]
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const bool on = (valid >> (4 * j + 2 * h + e)) & 1;
        v[h][2 * j + e] = on ? exp2f(sc[4 * j + 2 * h + e] * th.sl2 - lse2[h]) : 0.f;
      }
    }
  }
#pragma unroll
  for (int b = 2; b >= 0; --b) {  // lanes 4 << b apart: keep the half of the columns whose bit b is g's
    const bool upper = (g >> b) & 1;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int k = 0; k < (1 << b); ++k) {
        const float send = upper ? v[h][k] : v[h][k + (1 << b)];
        const float keep = upper ? v[h][k + (1 << b)] : v[h][k];
        v[h][k] = keep + __shfl_xor_sync(0xffffffffu, send, 4 << b);
      }
    }
  }
  float* buf = colsum + (i % 2) * 512;  // [group][unit 2 warp + h][32 keys]
  const int col = 8 * (g / 2) + 2 * th.c + g % 2;
#pragma unroll
  for (int h = 0; h < 2; ++h) buf[(8 * group + 2 * warp + h) * 32 + col] = v[h][0];
  sm90::named_barrier_sync(2 + group, 128);
  if (warp == 0) {
    const int units = a.query_rows / 8, queries = a.member != nullptr ? a.G / a.query_rows : 1;
    const int64_t k = int64_t{i - th.tiles} * M::kKeys + 32 * group + th.lane;
    const float* cs = buf + 8 * group * 32 + th.lane;
    for (int q = 0; q < queries && k < a.topk; ++q) {
      float s = 0.f;
      for (int u = q * units; u < (q + 1) * units; ++u) s += cs[32 * u];
      float* dst = a.probs + (th.t * queries + q) * a.topk + k;
      if (a.head_blocks == 1) {
        *dst = s;
      } else {
        atomicAdd(dst, s);
      }
    }
  }
}

template <typename T, typename M>
__device__ __forceinline__ void mla_probabilities(const AttnFwdArgs& a, MlaFwdShared& sh, const uint8_t* sK,
                                                  uint8_t* sP, const MlaThread& th, const float (&m_run)[2]) {
  using namespace sm90;
  float lse2[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = th.r0 + 8 * h;
    const float l = sh.row_sum[0][r] + sh.row_sum[1][r];
    lse2[h] = r < th.rows && l != 0.f ? m_run[h] + log2f(l) : INFINITY;
  }
  float* colsum = reinterpret_cast<float*>(sP);  // P is done with
  static_assert(M::kPBytes >= 2 * 512 * sizeof(float));
  float sc[2][16];
  // Tile i's S (in sc[b]) is done: its slots' row bits read, its stage released, the next tile's S
  // issued into the other accumulator, then tile i's sums.
  const auto step = [&](auto b, int i) {
    constexpr int kB = decltype(b)::value;
    wgmma_wait<0>();
    fence_accumulators(sc[kB]);
    const uint32_t* slot_rows = sh.rows[M::Ring::stage(i)] + 32 * th.group;  // this group's 32 slots
    uint32_t valid = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        valid |= ((slot_rows[8 * j + 2 * th.c + (x & 1)] >> th.bit[x / 2]) & 1u) << (4 * j + x);
      }
    }
    __syncwarp();
    if (th.lane == 0) sh.ring.release(i);
    if (i + 1 < 2 * th.tiles) mla_logits_issue<T, M>(sc[1 - kB], sh, sK, th, i + 1);
    mla_probability_sums<M>(a, th, sc[kB], valid, lse2, colsum, i);
  };
  if (th.tiles > 0) mla_logits_issue<T, M>(sc[0], sh, sK, th, th.tiles);
  for (int i = th.tiles; i < 2 * th.tiles; i += 2) {
    step(std::integral_constant<int, 0>{}, i);
    if (i + 1 < 2 * th.tiles) step(std::integral_constant<int, 1>{}, i + 1);
  }
}

template <typename T, typename M>
__global__ void __launch_bounds__(M::kThreads, 1) mla_fwd_kernel(const __grid_constant__ AttnFwdArgs a) {
#ifdef KDA_SM90A_ENABLED
  using namespace sm90;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = aligned_smem(smem_raw);
  uint8_t* sQ = smem;
  uint8_t* sK = sQ + M::kTileBytes;  // kStages key tiles
  uint8_t* sP = sK + M::kStages * M::kTileBytes;
  MlaFwdShared& sh = *reinterpret_cast<MlaFwdShared*>(sP + M::kPBytes);

  const int64_t t = blockIdx.x;
  const int head0 = blockIdx.z * M::kRows, rows = mla_block_rows(a, t, head0);
  const T* q = static_cast<const T*>(a.q);
  // the consumers bring Q (cp.async, all in flight at once) while the producer starts
  if (threadIdx.x < 256) load_rows64<T, M::kDqk>(sQ, q + (t * a.H + head0) * M::kDqk, rows);
  if (threadIdx.x == 0) sh.ring.init(128, 8);  // every producer thread; every consumer warp
  __syncthreads();
  const int tiles = mla_block_tiles<M::kKeys>(a, t);

  if (M::is_producer()) {
    M::producer_registers();
    mla_produce<T, M>(a, sh, sK, t, head0, rows, tiles);
    return;
  }
  M::consumer_registers();
  const MlaThread th{mla_place(a, t, head0, rows, tiles), static_cast<int>(threadIdx.x / 128), a.scale * kLog2e,
                     smem_addr(sQ), smem_addr(sP)};
  float o[128];
#pragma unroll
  for (int x = 0; x < 128; ++x) o[x] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // l_run: this thread's columns
  cp_async_wait<0>();
  fence_proxy_async();  // Q is read by wgmma
  named_barrier_sync(1, 256);
  mla_attend<T, M>(sh, sK, sP, th, o, m_run, l_run);
  if (a.probs != nullptr && tiles > 0 && th.lane == 0) sh.ring.release(tiles - 1);
  mla_store<T, M>(a, sh, th, o, m_run, l_run);
  if (a.probs != nullptr) mla_probabilities<T, M>(a, sh, sK, sP, th, m_run);
#endif
}

}  // namespace

bool mla_fwd_takes(const AttnProblem& p, const at::Tensor& q) {
  return (p.Dqk == 576 || p.Dqk == 512) && p.dv == 512 && p.Hkv == 1 && is_sm90(q) &&
         !switch_on(Switch::kPortableSfa);
}

void mla_fwd_cuda(const QueryPack& pk, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& gate,
                  at::Tensor& o, at::Tensor& lse, at::Tensor& probs) {
  const AttnProblem& p = pk.problem;
  const c10::cuda::CUDAGuard guard(q.device());
  KDA_DISPATCH_CUDA_HALF(q.scalar_type(), "sparse_attn_fwd", [&] {
    const auto launch = [&](auto width) {
      using M = MlaFwd<decltype(width)::value>;
      constexpr size_t smem = kMlaFwdSmem<M::kDqk>;
      // probs: zeros (atomics over head blocks)
      const AttnFwdArgs a{attn_args(pk, q, kv, gate, M::kRows), o.data_ptr(), lse.data_ptr<float>(),
                          probs.defined() ? probs.data_ptr<float>() : nullptr};
      const auto kernel = mla_fwd_kernel<scalar_t, M>;
      set_smem(kernel, smem);
      kernel<<<dim3(p.T, 1, a.head_blocks), M::kThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (p.Dqk == 576) {
      launch(std::integral_constant<int, 576>{});
    } else {
      launch(std::integral_constant<int, 512>{});
    }
  });
}

}  // namespace kda_dsa_ops::dsa
