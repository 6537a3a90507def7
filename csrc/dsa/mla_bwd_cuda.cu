// Sparse attention's backward for the MLA layouts (one kv head, dv 512: DeepSeek's Dqk 576, GLM-5.3's
// NoPE Dqk 512) on sm_90a, for blocks of 64 heads: the equations of attn_bwd_cuda.cu with wgmma.
#include <c10/cuda/CUDAGuard.h>

#include "common/pipeline.cuh"
#include "dsa/dsa_cuda.cuh"

namespace kda_dsa_ops::dsa {

namespace {

// One block per (query, block of up to 64 heads), or per block of packed queries (QueryPack: each
// row's P and dS are 0 off its query's slots). A producer warpgroup gathers the selected rows,
// 32 keys a tile, into a 2-stage ring of 128B-swizzled tiles (as the forward's). Per tile, the two
// consumer warpgroups share the work evenly:
//   group 0: S = Q K^T (wgmma m64n32k16 over the Dqk columns);
//   group 1: dP = dA V^T (over the 512 value columns);
//   both:    P and dS = scale P (dP - delta) for half of the keys each, the other half of S or
//            dP - delta traded through shared memory (mla_bwd_consume);
//            dq += dS K over half of the columns each (m64n256k16, group 1 adds the rope columns at
//            576), then dkv^T = Q^T dS^T + dA^T P^T in 64-column tiles (m64n32k16, Q and dA read
//            M-major from their own tiles), each added to dkv with 16-byte atomics while the next
//            is computed. Deterministic: packed blocks store them per (query, slot) for the ordered
//            sum; blocks of one query add them in turn order (mla_bwd_herald).
// dS and P are kept [heads x keys]: dS is dq's A (K-major), and both are dkv's B (read MN-major).
template <int Dqk>
struct MlaBwd : sm90::WarpSpecialized<2, 40, 232> {
  static constexpr int kDqk = Dqk, kDv = 512, kRows = 64, kKeys = 32;
  static constexpr int kChunks = kDqk / 64;      // 64-column swizzled chunks of a row
  static constexpr int kRowChunk = kRows * 128;  // a chunk of Q or dA: 64 rows
  static constexpr int kKeyChunk = kKeys * 128;  // a chunk of a key tile: 32 rows
  static constexpr int kQBytes = kChunks * kRowChunk, kABytes = kDv / 64 * kRowChunk;
  static constexpr int kTileBytes = kChunks * kKeyChunk;
  static constexpr int kStages = 2;
  static constexpr int kSplit = 5;  // S and dP start on a tile's first chunks while the rest arrive
  static constexpr int kDsBytes = kRows * 128;  // dS, P [64 x 32] in 128-byte rows
  using Ring = sm90::StageRing<kStages, 2>;
  static_assert(Dqk == 576 || Dqk == 512);
  // Group 0 takes dkv tiles 0-3 (and 8, the rope columns, at 576), group 1 tiles 4-7; dq's
  // columns: group 0 chunks 0-3, group 1 chunks 4-7 (and 8).
  template <int kGroup>
  static constexpr int dkv_tiles() { return kGroup == 0 && kChunks == 9 ? 5 : 4; }
  template <int kGroup>
  static constexpr int dkv_tile(int m) { return m < 4 ? 4 * kGroup + m : 8; }
};

struct MlaBwdShared {
  MlaBwd<576>::Ring ring;  // (the same ring for both widths)
  uint32_t rows[MlaBwd<576>::kStages][32];  // per stage and slot: the rows with its key (produce_key_tile)
  float delta[64];                // rowsum(dO * o)
  float lse2[64];                 // lse in log2 units; +inf for a row without a key or past `rows`
  unsigned turn;                  // the block's turn (AttnBwdArgs::ticket)
  uint64_t cleared, added;        // the ordered path's (mla_bwd_herald)
};

template <int Dqk>
constexpr size_t kMlaBwdSmem = sm90::kSwizzleAlign + MlaBwd<Dqk>::kQBytes + MlaBwd<Dqk>::kABytes +
                               MlaBwd<Dqk>::kStages * MlaBwd<Dqk>::kTileBytes + 2 * MlaBwd<Dqk>::kDsBytes +
                               sizeof(MlaBwdShared);
static_assert(kMlaBwdSmem<576> <= kMaxSmem);
static_assert(MlaBwd<576>::kDsBytes / 2 * 2 >= 256 * 2 * 16, "the trade fits the halves of dS's and P's rows past their keys");

// The shared-memory tiles' addresses.
struct MlaBwdTiles {
  uint32_t q, da, keys, ds, p;
};

// One consumer thread's place (MlaPlace) and its thread in its warpgroup.
struct MlaBwdThread : MlaPlace {
  int tid;
  int64_t u;  // the ordered path's turn of the block (AttnBwdArgs::ticket), t head_blocks + its head block
};

// What a block does with dkv's terms: adds them, stores them per (query, slot) for the ordered sum
// (no dkv), or adds them in turn order (AttnBwdArgs::ticket).
enum class DkvMode { kAdd, kStore, kOrdered };

// Producer warpgroup: the tiles in order (produce_key_tile), by kGroups x 8 of its threads.
template <typename T, typename M, int kGroups>
__device__ __forceinline__ void mla_bwd_produce(const AttnBwdArgs& a, MlaBwdShared& sh, uint8_t* sK, int64_t t,
                                                int tiles) {
  for (int i = 0; i < tiles; ++i) {
    produce_key_tile<T, M::kKeys, M::kDqk, M::kSplit, kGroups>(
        sh.ring, i, sK + M::Ring::stage(i) * M::kTileBytes, a, t, int64_t{i} * M::kKeys, sh.rows[M::Ring::stage(i)]);
  }
}

// The consumers' first step, a warp per row: delta = sum(dO * o) (o gated), dA = dO * sigmoid(gate)
// into its swizzled tile, dgate = dO * o * (1 - sigmoid(gate)), lse in log2 units.
template <typename T, typename M>
__device__ __forceinline__ void mla_bwd_rows(const AttnBwdArgs& a, MlaBwdShared& sh, uint8_t* sA, int64_t t,
                                             int head0, int rows) {
  const T* grad_o = static_cast<const T*>(a.grad_o);
  const T* o = static_cast<const T*>(a.o_in);
  const T* gate = static_cast<const T*>(a.gate);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < M::kRows; r += 8) {
    const bool valid = r < rows;
    const int64_t row = t * a.H + head0 + r;
    float dd[2][8], od[2][8], gd[2][8];  // every load of the row before the first store
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int d = 8 * (lane + 32 * k);
      load_cols<T, 8>(grad_o + row * M::kDv, d, valid ? M::kDv : 0, valid, dd[k]);
      load_cols<T, 8>(o + row * M::kDv, d, valid ? M::kDv : 0, valid, od[k]);
      load_cols<T, 8>(gate + row * M::kDv, d, valid && gate != nullptr ? M::kDv : 0, valid && gate != nullptr, gd[k]);
    }
    float dsum = 0.f;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int piece = lane + 32 * k;
      float da[8], dg[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float s = gate != nullptr ? sigmoidf(gd[k][e]) : 1.f;
        dg[e] = dd[k][e] * od[k][e] * (1.f - s);
        dsum += dd[k][e] * od[k][e];
        da[e] = dd[k][e] * s;
      }
      if (valid && gate != nullptr) store_cols<T, 8>(static_cast<T*>(a.dgate) + row * M::kDv, 8 * piece, M::kDv, true, dg);
      Pack<T, 8> pk;
#pragma unroll
      for (int e = 0; e < 8; ++e) pk.v[e] = from_float<T>(da[e]);
      *reinterpret_cast<Pack<T, 8>*>(sA + (piece / 8) * M::kRowChunk + sm90::sw128_offset(r, piece % 8)) = pk;
    }
    dsum = warp_reduce(dsum, SumOp{});
    if (lane == 0) {
      sh.delta[r] = dsum;
      const float l = valid ? a.lse_in[row] : -INFINITY;
      sh.lse2[r] = l == -INFINITY ? INFINITY : l * kLog2e;  // no key: every p = 0; NaN stays NaN
    }
  }
}

// The 8 x 8 block of 32-bit values whose row g, columns 2c and 2c + 1, lane (g, c) holds, transposed:
// the lane then holds its column g, rows 2c and 2c + 1. movmatrix moves 16-bit halves, so the
// floats go across as their high and their low halves.
__device__ __forceinline__ void transpose8x8(float& x0, float& x1) {
  const uint32_t a0 = __float_as_uint(x0), a1 = __float_as_uint(x1);
  uint32_t hi = __byte_perm(a0, a1, 0x7632), lo = __byte_perm(a0, a1, 0x5410);
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %0;" : "+r"(hi));
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %0;" : "+r"(lo));
  x0 = __uint_as_float(__byte_perm(lo, hi, 0x5410));
  x1 = __uint_as_float(__byte_perm(lo, hi, 0x7632));
}

// dkv^T tile mt (rows: columns 64 mt.. of dkv; columns: the tile's 32 keys) into dkv. The
// accumulator's 8 x 8 blocks (rows 16 warp + 8 h.., keys 8j..) are transposed (transpose8x8): the
// lane of (g, c) then holds rows 8h + 2c, 8h + 2c + 1 of key 8j + g. Lanes c and c ^ 1 trade a pair,
// so that each holds four consecutive rows, 4 (c / 2) + 8 (c % 2).., and adds them as 16 bytes to
// dst[j] (the key's row of dkv or of the stored contributions). A quarter-warp's eight adds then
// fill two keys' 64 bytes. kOrdered: the term of key j added once for each of its copies in the
// query (bit j of `several`: more than one, counted from its slot in the query's keys `sel`).
template <DkvMode kMode>
__device__ __forceinline__ void mla_bwd_scatter(float (&acc)[16], int mt, const MlaBwdThread& th,
                                                float* const (&dst)[4], int several, const int32_t* sel,
                                                int64_t k0, int64_t topk) {
  const bool odd = th.c % 2;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float* x = acc + 4 * j;  // x[2h + e]: row 16 warp + 8h + g, key 8j + 2c + e
    transpose8x8(x[0], x[1]);
    transpose8x8(x[2], x[3]);
    const float got0 = __shfl_xor_sync(0xffffffffu, odd ? x[0] : x[2], 1);
    const float got1 = __shfl_xor_sync(0xffffffffu, odd ? x[1] : x[3], 1);
    if (dst[j] == nullptr) continue;
    const float4 v = odd ? make_float4(got0, got1, x[2], x[3]) : make_float4(x[0], x[1], got0, got1);
    float4* p = reinterpret_cast<float4*>(dst[j] + 64 * mt + 16 * th.warp + 8 * odd + 4 * (th.c / 2));
    if constexpr (kMode == DkvMode::kStore) {
      *p = v;
    } else {
      if constexpr (kMode == DkvMode::kOrdered) {  // a red, not an atom (ptxas keeps atomicAdd as an atom here)
        float n = 1.f;
        if ((several >> j) & 1) {
          const int64_t slot = k0 + 8 * j + th.g;
          while (slot + static_cast<int64_t>(n) < topk && sel[slot + static_cast<int64_t>(n)] == sel[slot]) n += 1.f;
        }
        asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x * n),
                     "f"(v.y * n), "f"(v.z * n), "f"(v.w * n)
                     : "memory");
      } else {
        atomicAdd(p, v);
      }
    }
  }
}

// dkv^T tile mt = Q^T dS^T (+ dA^T P^T for the value columns), committed as one wgmma group.
template <typename T, typename M>
__device__ __forceinline__ void mla_bwd_dkv(float (&acc)[16], int mt, const MlaBwdTiles& s) {
  using namespace sm90;
#pragma unroll
  for (int x = 0; x < 16; ++x) acc[x] = 0.f;
  fence_accumulators(acc);
  wgmma_fence();
  const uint64_t q_desc = sw128_descriptor(s.q + mt * M::kRowChunk, M::kRowChunk),
                 ds_desc = sw128_descriptor(s.ds, M::kDsBytes);
#pragma unroll
  for (int kh = 0; kh < 4; ++kh) {
    wgmma_m64n32k16<T, 1, 1>(acc, desc_advance(q_desc, kh * 2048), desc_advance(ds_desc, kh * 2048));
  }
  if (mt < M::kDv / 64) {
    const uint64_t da_desc = sw128_descriptor(s.da + mt * M::kRowChunk, M::kRowChunk),
                   p_desc = sw128_descriptor(s.p, M::kDsBytes);
#pragma unroll
    for (int kh = 0; kh < 4; ++kh) {
      wgmma_m64n32k16<T, 1, 1>(acc, desc_advance(da_desc, kh * 2048), desc_advance(p_desc, kh * 2048));
    }
  }
  wgmma_commit();
}

// The ordered path (AttnBwdArgs::ticket): one thread of the producer warpgroup, the herald, keeps
// the block's turn. Per tile i it waits until the turn before it in its class has passed the
// tile's last key (its word in `progress` above it), then clears the consumers' adds (`cleared`,
// phase i); once their adds are issued (`added`, phase i) it publishes the block's word: the key
// below which its adds and those of every turn before it in its class are done, the lesser of the
// next tile's first key and the word of the turn before when last read (`seen`; Tk: there is no
// turn before). The fences release the consumers' adds (ordered before them by `added`) and
// acquire the turn before's; the consumers never wait on a fence or a poll of their own.
template <int kKeys>
__device__ __forceinline__ void mla_bwd_herald(const AttnBwdArgs& a, MlaBwdShared& sh, int64_t t, int64_t u,
                                               int tiles) {
  const int32_t* sel = a.indices + t * a.topk;
  const int* before = a.progress + u - a.classes;
  int* const mine = a.progress + u;
  const int Tk = static_cast<int>(a.Tk);
  int seen = u >= a.classes ? 0 : Tk;
  const auto read_before = [&] {
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(seen) : "l"(before) : "memory");
  };
  const auto publish = [&](int word) {  // after a fence
    asm volatile("st.relaxed.gpu.global.s32 [%0], %1;" ::"l"(mine), "r"(word) : "memory");
  };
  const auto wait_past = [&](int last) {
    if (seen > last) return;
    do read_before();
    while (seen <= last);
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
  };
  for (int i = 0; i < tiles; ++i) {
    const int64_t next = int64_t{i + 1} * kKeys;
    wait_past(sel[min(next, int64_t{a.topk}) - 1]);  // the tile's keys, sorted, end with its last slot's
    sm90::mbar_arrive(&sh.cleared);
    sm90::mbar_wait(&sh.added, i & 1);
    if (seen < Tk) read_before();  // a later word of the turn before, on the way
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
    publish(next < a.topk ? min(sel[next], seen) : seen);
  }
  wait_past(Tk - 1);  // done once the turn before is
  publish(Tk);
}

// The ordered path adds a key repeated within the query once, by its first copy, times its copies
// (the copies' terms are equal, and the adds of one instruction to one address may be summed among
// themselves first, in no fixed order). The query's keys are sorted, so a slot's copies follow it:
// this lane's later copies (their slots' neighbours before them hold the same key, from the lanes
// of row g - 1 or the key before the tile, around[0]) are taken as -1; returns the bits j of the
// first copies that have more (the neighbour after them: row g + 1's, or around[1]).
__device__ __forceinline__ int mla_bwd_first_copies(int (&key)[4], const int (&around)[2], const MlaBwdThread& th) {
  int up[4], down[4], several = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    up[j] = __shfl_sync(0xffffffffu, key[j], (th.lane + 28) % 32);   // slot 8j + g - 1 (g = 0: 8j + 7)
    down[j] = __shfl_sync(0xffffffffu, key[j], (th.lane + 4) % 32);  // slot 8j + g + 1 (g = 7: 8j)
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int before = th.g > 0 ? up[j] : j > 0 ? up[j - 1] : around[0];
    const int after = th.g < 7 ? down[j] : j < 3 ? down[j + 1] : around[1];
    if (key[j] >= 0 && after == key[j] && before != key[j]) several |= 1 << j;
    if (before == key[j]) key[j] = -1;
  }
  return several;
}

// A consumer group's walk over the tiles (kGroup: its share, above; kMode: what it does with dkv's
// terms), then its dq columns stored.
template <typename T, typename M, int kGroup, DkvMode kMode>
__device__ __forceinline__ void mla_bwd_consume(const AttnBwdArgs& a, MlaBwdShared& sh, uint8_t* sK, uint8_t* sDS,
                                                uint8_t* sP, const MlaBwdTiles& s,
                                                const MlaBwdThread& th) {
  using namespace sm90;
  constexpr bool kRope = kGroup == 1 && M::kChunks == 9;  // dq's chunk 8
  constexpr int kTiles = M::template dkv_tiles<kGroup>();
  const float sl2 = a.scale * kLog2e;
  const int32_t* sel = a.indices + th.t * a.topk;
  const int c = th.c, r0 = th.r0;
  float dq[128], dq_rope[32];
#pragma unroll
  for (int x = 0; x < 128; ++x) dq[x] = 0.f;
#pragma unroll
  for (int x = 0; x < 32; ++x) dq_rope[x] = 0.f;
  float acc[2][16];
  for (int i = 0; i < th.tiles; ++i) {
    const int64_t k0 = int64_t{i} * M::kKeys;
    const uint32_t kb = s.keys + M::Ring::stage(i) * M::kTileBytes;
    // This lane's four keys in dkv (slots 8j + g, mla_bwd_scatter), read before the GEMMs wait; the
    // ordered path's keys next to the tile's (mla_bwd_first_copies).
    int key[4], around[2];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t slot = k0 + 8 * j + th.g;
      key[j] = slot < a.topk ? sel[slot] : -1;
    }
    if constexpr (kMode == DkvMode::kOrdered) {
      around[0] = k0 > 0 ? sel[k0 - 1] : -1;
      around[1] = k0 + M::kKeys < a.topk ? sel[k0 + M::kKeys] : -1;
    }
    // S (group 0) or dP (group 1) for the tile's 32 keys.
    float x[16];
#pragma unroll
    for (int e = 0; e < 16; ++e) x[e] = 0.f;
    fence_accumulators(x);
    const uint64_t a_desc = sw128_descriptor(kGroup == 0 ? s.q : s.da, 16), k_desc = sw128_descriptor(kb, 16);
    constexpr int kSteps = (kGroup == 0 ? M::kDqk : M::kDv) / 16;
    sh.ring.wait_full(i, 0);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
      if (kk == 4 * M::kSplit) sh.ring.wait_full(i, 1);
      wgmma_m64n32k16<T, 0, 0>(x, desc_advance(a_desc, (kk / 4) * M::kRowChunk + (kk % 4) * 32),
                               desc_advance(k_desc, (kk / 4) * M::kKeyChunk + (kk % 4) * 32));
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_accumulators(x);
    const uint32_t* slot_rows = sh.rows[M::Ring::stage(i)];
    // P and dS: each group forms them for half of the tile's keys (group 0 the first 16, group 1
    // the last 16), trading the other half of its S or dP - delta through shared memory: the 16-byte
    // pieces of dS's and P's 128-byte rows past their 32 keys, which no wgmma reads.
    constexpr int kMine = 2 * kGroup, kTheirs = 2 - kMine;  // the first of each half's 8-key groups
    const auto trade = [&](int group, int q) {  // float4 q of the group's thread th.tid
      return reinterpret_cast<float4*>((group == 0 ? sDS : sP) + sw128_offset(th.tid / 2, 4 + 2 * (th.tid % 2) + q));
    };
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const float* v = x + 4 * (kTheirs + q);
      *trade(kGroup, q) = kGroup == 0 ? make_float4(v[0], v[1], v[2], v[3])
                                      : make_float4(v[0] - sh.delta[r0], v[1] - sh.delta[r0],
                                                    v[2] - sh.delta[r0 + 8], v[3] - sh.delta[r0 + 8]);
    }
    named_barrier_sync(1, 256);  // the trade is written, and both groups are done with the last tile
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int j = kMine + q;
      const float4 got = *trade(1 - kGroup, q);
      const float other[4] = {got.x, got.y, got.z, got.w};
      float p[4], ds[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 8 * j + 2 * c + (e & 1), r = r0 + 8 * (e / 2);
        const float sv = kGroup == 0 ? x[4 * j + e] : other[e];
        const float dpd = kGroup == 0 ? other[e] : x[4 * j + e] - sh.delta[r];
        p[e] = (slot_rows[col] >> th.bit[e / 2]) & 1 ? exp2f(sv * sl2 - sh.lse2[r]) : 0.f;
        ds[e] = p[e] * dpd * a.scale;
      }
      const int col = 8 * j + 2 * c;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int off = sw128_offset(r0 + 8 * h, col / 8) + (col % 8) * 2;
        *reinterpret_cast<uint32_t*>(sDS + off) = pack2<T>(ds[2 * h], ds[2 * h + 1]);
        *reinterpret_cast<uint32_t*>(sP + off) = pack2<T>(p[2 * h], p[2 * h + 1]);
      }
    }
    fence_proxy_async();  // dS and P are read by wgmma
    named_barrier_sync(1, 256);
    // dq += dS K over this group's columns (the key tile read N-major), then the dkv tiles.
    wgmma_fence();
    const uint64_t ds_desc = sw128_descriptor(s.ds, 16), kn_desc = sw128_descriptor(kb, M::kKeyChunk);
#pragma unroll
    for (int kk = 0; kk < M::kKeys / 16; ++kk) {
      wgmma_m64n256k16<T, 0, 1>(dq, desc_advance(ds_desc, kk * 32),
                                desc_advance(kn_desc, 4 * kGroup * M::kKeyChunk + kk * 2048));
      if constexpr (kRope) {
        wgmma_m64n64k16<T, 0, 1>(dq_rope, desc_advance(ds_desc, kk * 32), desc_advance(kn_desc, 8 * M::kKeyChunk + kk * 2048));
      }
    }
    wgmma_commit();
    int several = 0;
    if constexpr (kMode == DkvMode::kOrdered) several = mla_bwd_first_copies(key, around, th);
    const bool counted = kMode == DkvMode::kOrdered && __any_sync(0xffffffffu, several != 0);  // repeats
    float* dst[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int slot = 8 * j + th.g;
      if constexpr (kMode == DkvMode::kStore) {
        dst[j] = slot_rows[slot] == 0
                     ? nullptr
                     : a.contrib + (((th.t - a.t0) * a.head_blocks + blockIdx.z) * a.topk + k0 + slot) * int64_t{M::kDqk};
      } else if constexpr (kMode == DkvMode::kOrdered) {
        const int64_t cls = th.u % a.classes;
        dst[j] = slot_rows[slot] == 0 || key[j] < 0
                     ? nullptr
                     : (cls == 0 ? a.dkv : a.dkv_more + (cls - 1) * a.Tk * M::kDqk) + int64_t{key[j]} * M::kDqk;
      } else {
        dst[j] = slot_rows[slot] == 0 ? nullptr : a.dkv + int64_t{key[j]} * M::kDqk;
      }
    }
    mla_bwd_dkv<T, M>(acc[0], M::template dkv_tile<kGroup>(0), s);
#pragma unroll
    for (int m = 0; m < kTiles; ++m) {
      if (m + 1 < kTiles) {
        mla_bwd_dkv<T, M>(acc[(m + 1) % 2], M::template dkv_tile<kGroup>(m + 1), s);
        wgmma_wait<1>();
      } else {
        wgmma_wait<0>();
      }
      fence_accumulators(acc[m % 2]);
      if (m == 0) {  // dq, the key tile's last reader, is done
        fence_accumulators(dq);
        fence_accumulators(dq_rope);
        if (th.lane == 0) sh.ring.release(i);
        if constexpr (kMode == DkvMode::kOrdered) sm90::mbar_wait(&sh.cleared, i & 1);  // the herald's
      }
      if (counted) {  // warp-uniform: the adds with counts on a path of their own
        mla_bwd_scatter<kMode>(acc[m % 2], M::template dkv_tile<kGroup>(m), th, dst, several, sel, k0, a.topk);
      } else {
        mla_bwd_scatter<kMode>(acc[m % 2], M::template dkv_tile<kGroup>(m), th, dst, 0, sel, k0, a.topk);
      }
    }
    if constexpr (kMode == DkvMode::kOrdered) mbar_arrive(&sh.added);  // the tile's adds are issued
  }
  T* out = static_cast<T*>(a.dq);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 8 * h;
    if (r >= th.rows) continue;
    T* row = out + (th.t * a.H + th.head0 + r) * M::kDqk;
#pragma unroll
    for (int n = 0; n < 32; ++n) {
      *reinterpret_cast<uint32_t*>(row + 256 * kGroup + 8 * n + 2 * c) = pack2<T>(dq[4 * n + 2 * h], dq[4 * n + 2 * h + 1]);
    }
    if constexpr (kRope) {
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        *reinterpret_cast<uint32_t*>(row + 512 + 8 * n + 2 * c) = pack2<T>(dq_rope[4 * n + 2 * h], dq_rope[4 * n + 2 * h + 1]);
      }
    }
  }
}

// kOrdered: the ordered deterministic path (a kernel of its own: 64 of the producer threads gather,
// one is the herald).
template <typename T, typename M, bool kOrdered>
__global__ void __launch_bounds__(M::kThreads, 1) mla_bwd_kernel(const __grid_constant__ AttnBwdArgs a) {
#ifdef KDA_SM90A_ENABLED
  using namespace sm90;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sQ = aligned_smem(smem_raw);
  uint8_t* sA = sQ + M::kQBytes;
  uint8_t* sK = sA + M::kABytes;  // kStages key tiles
  uint8_t* sDS = sK + M::kStages * M::kTileBytes;
  uint8_t* sP = sDS + M::kDsBytes;
  MlaBwdShared& sh = *reinterpret_cast<MlaBwdShared*>(sP + M::kDsBytes);

  if constexpr (kOrdered) {  // blocks take their turns in the order they start
    if (threadIdx.x == 0) sh.turn = atomicAdd(a.ticket, 1u);
    __syncthreads();
  }
  const int64_t u = kOrdered ? a.t0 * a.head_blocks + sh.turn : 0;
  const int64_t t = kOrdered ? u / a.head_blocks : a.order != nullptr ? a.order[blockIdx.x] : a.t0 + blockIdx.x;
  const int head0 = static_cast<int>(kOrdered ? u % a.head_blocks : blockIdx.z) * M::kRows;
  const int rows = mla_block_rows(a, t, head0);
  const T* q = static_cast<const T*>(a.q);
  // the consumers bring Q (cp.async) while the producer starts
  if (threadIdx.x < 256) load_rows64<T, M::kDqk>(sQ, q + (t * a.H + head0) * M::kDqk, rows);
  // the gathering producer threads (64 on the ordered path: one of the others is its herald); every
  // consumer warp
  constexpr int kGroups = kOrdered ? 8 : 16;
  if (threadIdx.x == 0) {
    if constexpr (kOrdered) {
      mbar_init(&sh.cleared, 1);
      mbar_init(&sh.added, 256);
    }
    sh.ring.init(8 * kGroups, 8);
  }
  __syncthreads();
  const int tiles = mla_block_tiles<M::kKeys>(a, t);

  if (M::is_producer()) {
    M::producer_registers();
    if (threadIdx.x >= 256 + 8 * kGroups) {
      if (kOrdered && threadIdx.x == 256 + 8 * kGroups) mla_bwd_herald<M::kKeys>(a, sh, t, u, tiles);
      return;
    }
    mla_bwd_produce<T, M, kGroups>(a, sh, sK, t, tiles);
    return;
  }
  M::consumer_registers();
  mla_bwd_rows<T, M>(a, sh, sA, t, head0, rows);
  cp_async_wait<0>();
  fence_proxy_async();  // Q and dA are read by wgmma
  named_barrier_sync(1, 256);
  const MlaBwdThread th{mla_place(a, t, head0, rows, tiles), static_cast<int>(threadIdx.x % 128), u};
  const MlaBwdTiles s{smem_addr(sQ), smem_addr(sA), smem_addr(sK), smem_addr(sDS), smem_addr(sP)};
  const auto consume = [&](auto mode) {
    if (threadIdx.x < 128) {
      mla_bwd_consume<T, M, 0, decltype(mode)::value>(a, sh, sK, sDS, sP, s, th);
    } else {
      mla_bwd_consume<T, M, 1, decltype(mode)::value>(a, sh, sK, sDS, sP, s, th);
    }
  };
  if constexpr (kOrdered) {
    consume(std::integral_constant<DkvMode, DkvMode::kOrdered>{});
  } else if (a.dkv != nullptr) {
    consume(std::integral_constant<DkvMode, DkvMode::kAdd>{});
  } else {
    consume(std::integral_constant<DkvMode, DkvMode::kStore>{});
  }
#endif
}

}  // namespace

bool mla_bwd_takes(const AttnProblem& p, const at::Tensor& q) { return mla_fwd_takes(p, q) && p.H / p.Hkv > 16; }

template <typename T>
void mla_bwd_launch(const AttnBwdArgs& a, int64_t queries) {
  if (queries == 0 || a.head_blocks == 0) return;
  const auto run = [&](auto width) {
    using M = MlaBwd<decltype(width)::value>;
    constexpr size_t smem = kMlaBwdSmem<M::kDqk>;
    const auto kernel = a.ticket != nullptr ? mla_bwd_kernel<T, M, true> : mla_bwd_kernel<T, M, false>;
    set_smem(kernel, smem);
    kernel<<<dim3(queries, 1, a.head_blocks), M::kThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (a.Dqk == 576) {
    run(std::integral_constant<int, 576>{});
  } else {
    run(std::integral_constant<int, 512>{});
  }
}

template void mla_bwd_launch<__nv_bfloat16>(const AttnBwdArgs&, int64_t);
template void mla_bwd_launch<__half>(const AttnBwdArgs&, int64_t);

}  // namespace kda_dsa_ops::dsa
