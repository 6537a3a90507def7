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

// An item per (query, block of up to 64 heads) of an MLA layout (Hkv 1, Dqk 576 or 512, dv 512), or
// per block of packed queries (QueryPack: each row attends over its query's slots of the union),
// taken in turn by persistent blocks (mla_fwd_kernel). A producer warpgroup gathers the selected
// rows, 64 keys a tile, a pair of tiles at a time into two stages of 128B-swizzled tiles (cp.async,
// zeros for slots without a key; an odd last tile is paired with one without keys). Consumer group
// g takes tile 2j + g of pair j whole for S = Q K^T (wgmma m64n64k16 over the Dqk columns) and the
// value columns 256 g .. 256 g + 255 of both tiles for O += P V (wgmma m64n256k16): its own tile's
// P from registers, the other group's through shared memory. Group 0's new row maxima go to group
// 1, whose maxima (no smaller) come back and rescale group 0's P before group 1 reads it: both
// groups end on the same maxima, each keeping the row sums of its own tiles. A stage is filled and
// released by halves (part 0: the first four chunks, value columns 0 - 255, which group 0 reads for
// P V; part 1: the rest, group 1's), so a group's next S starts on the half it released first.
// Where probabilities are asked for, a second pass over the block's items recomputes S and sums
// the final probabilities over the heads.
// Two consumer warpgroups and the producer one. Registers go by warpgroups, so a producer warp
// alone would cost as much; setmaxnreg moves the producer's to the consumers.
template <int Dqk>
struct MlaFwd : sm90::WarpSpecialized<2, 56, 224> {
  static constexpr int kDqk = Dqk, kDv = 512, kRows = 64, kKeys = 64;
  static constexpr int kChunks = kDqk / 64;                 // 64-column swizzled chunks of a row
  static constexpr int kChunkBytes = 64 * 128;              // 64 rows x 64 columns
  static constexpr int kTileBytes = kChunks * kChunkBytes;  // Q, or a key tile: 72 KB (576) / 64 KB (512)
  static constexpr int kLeft = 4;                           // part 0's chunks
  static constexpr int kPBytes = kRows * kKeys * 2;         // one tile's P
  // Group 0's P: at 576 in its tile's last chunk (rope columns only S reads, refilled once group 1
  // released the part), at 512 beside group 1's.
  static constexpr int kPBuffers = Dqk == 576 ? 1 : 2;
  static_assert(Dqk == 576 || Dqk == 512);
};

// The two stages by halves: full[s][part] counts the producer threads' arrivals (each waits for
// its copies), empty[s][part] one arrival per warp of the group done with it.
struct PairRing {
  uint64_t full[2][2], empty[2][2];
  __device__ void init() {
    for (int s = 0; s < 2; ++s) {
      for (int p = 0; p < 2; ++p) {
        sm90::mbar_init(&full[s][p], 128);
        sm90::mbar_init(&empty[s][p], 4);
      }
    }
    sm90::mbar_init_fence();
  }
  __device__ void wait_full(int pair, int s, int part) { sm90::mbar_wait(&full[s][part], pair & 1); }
  __device__ void wait_empty(int pair, int s, int part) { sm90::mbar_wait(&empty[s][part], (pair & 1) ^ 1); }
  __device__ void release(int s, int part) { sm90::mbar_arrive(&empty[s][part]); }
  __device__ void filled(int s, int part) {
    sm90::mbar_arrive_cp_async(&full[s][part]);
    sm90::mbar_arrive(&full[s][part]);
  }
};

// The groups' one-way hand-offs of a pair: a group's row maxima (kMax0, kMax1) and its P in shared
// memory (kP0, kP1), each an mbarrier that the sending group's 128 threads arrive at (each
// releasing its own writes) and the other group waits on with the pair's parity. A group sends
// pair j + 1's only after it has waited for the other's pair j, so no phase is passed unseen.
// (Named barriers with bar.arrive would do, but compute-sanitizer's racecheck does not follow them.)
enum MlaHandoff : int { kMax0, kMax1, kP0, kP1 };

struct MlaFwdShared {
  PairRing ring;
  uint64_t handoff[4];    // MlaHandoff
  uint32_t rows[2][64];   // per stage and slot: the rows with its key (KeyTile)
  float row_max[2][64];   // group g's maxima after its tile of the pair
  float row_sum[2][64];   // per consumer group, at the end
};

template <int Dqk>
constexpr size_t kMlaFwdSmem = sm90::kSwizzleAlign + 3 * MlaFwd<Dqk>::kTileBytes +
                               MlaFwd<Dqk>::kPBuffers * MlaFwd<Dqk>::kPBytes + sizeof(MlaFwdShared);
static_assert(kMlaFwdSmem<576> <= kMaxSmem && kMlaFwdSmem<512> <= kMaxSmem);

// One consumer thread's place (MlaPlace), the pairs of tiles, the ring's uses and the hand-offs
// before this block's item, the scale in log2 units, the shared addresses of Q and the stages, and
// each group's P.
struct MlaThread : MlaPlace {
  int group, pairs, uses, sends;
  float sl2;
  uint32_t q_base, k_base[2];
  uint8_t* p[2];
};

// A block's items (query t or packed block t, head block from head0: 64 rows, pairs of 64-key
// tiles), every gridDim.x-th from blockIdx.x: item k is t * head_blocks + head block = k, or
// order[k] (packed blocks longest first, so that the blocks' shares come out even).
struct MlaItem {
  int64_t item, t;
  int head0, rows, tiles, pairs;
  __device__ MlaItem(const AttnFwdArgs& a, int64_t k)
      : item(a.order != nullptr ? int64_t{a.order[k]} : k), t(item / a.head_blocks),
        head0(static_cast<int>(item % a.head_blocks) * 64), rows(mla_block_rows(a, t, head0)),
        tiles(mla_block_tiles<64>(a, t)), pairs((tiles + 1) / 2) {}
};

// The producer's walk over its items' pairs (pass 0; again in pass 1 with probabilities asked
// for), items without keys skipped: `next` moves on, false past the last.
struct MlaLoads {
  int64_t item, t, k0;  // k0: the pair's first slot
  int head0, rows, pairs, j, pass;
  __device__ bool next(const AttnFwdArgs& a) {
    while (++j >= pairs) {
      item = item < 0 ? blockIdx.x : item + gridDim.x;
      if (item >= a.T * a.head_blocks) {
        if (pass == 1 || a.probs == nullptr) return false;
        pass = 1;
        item = blockIdx.x;
      }
      const MlaItem it(a, item);
      t = it.t, head0 = it.head0, rows = it.rows, pairs = it.pairs;
      j = -1;
    }
    k0 = int64_t{j} * 2 * 64;
    return true;
  }
};

// Producer warpgroup: pair j's halves in the order they are released (tile 2j's part 0, tile 2j +
// 1's part 1, then the other two); each tile's keys read a pair ahead (the next item's first pair
// during an item's last, while the consumers finish it); the gate into L2 for pass 0's epilogues.
template <typename T, typename M>
__device__ __forceinline__ void mla_produce(const AttnFwdArgs& a, MlaFwdShared& sh, uint8_t* sK) {
  using namespace sm90;
  static_assert(M::kKeys == 64);
  uint8_t* stage[2] = {sK, sK + M::kTileBytes};
  using Keys = KeyTile<T, M::kKeys, M::kDqk>;
  MlaLoads cur{-1, 0, 0, 0, 0, 0, 0, 0};  // (before the first item: no pairs)
  if (!cur.next(a)) return;
  MlaLoads nxt = cur;
  bool more = nxt.next(a);
  Keys t0(a, cur.t, cur.k0), t1(a, cur.t, cur.k0 + M::kKeys);
  for (int use = 0;; ++use) {
    sh.ring.wait_empty(use, 0, 0);
    t0.store_rows(a, cur.t, cur.k0, sh.rows[0]);
    t0.template copy<0, M::kLeft>(stage[0], a);
    sh.ring.filled(0, 0);
    sh.ring.wait_empty(use, 1, 1);
    t1.template copy<M::kLeft, M::kChunks>(stage[1], a);
    sh.ring.filled(1, 1);
    sh.ring.wait_empty(use, 0, 1);
    t0.template copy<M::kLeft, M::kChunks>(stage[0], a);
    sh.ring.filled(0, 1);
    if (more) t0 = Keys(a, nxt.t, nxt.k0);  // the next pair's keys load while this pair's last half goes out
    sh.ring.wait_empty(use, 1, 0);
    t1.store_rows(a, cur.t, cur.k0 + M::kKeys, sh.rows[1]);
    t1.template copy<0, M::kLeft>(stage[1], a);
    sh.ring.filled(1, 0);
    if (more) t1 = Keys(a, nxt.t, nxt.k0 + M::kKeys);
    if (cur.pass == 0 && cur.j == cur.pairs - 1 && a.gate != nullptr && threadIdx.x == 256) {
      bulk_prefetch_l2(static_cast<const T*>(a.gate) + (cur.t * a.H + cur.head0) * M::kDv,
                       cur.rows * M::kDv * sizeof(T));
    }
    if (!more) return;
    cur = nxt;
    more = nxt.next(a);
  }
}

// S = Q K^T over chunks [kFrom, kTo) of the tile at k_base.
template <typename T, typename M, int kFrom, int kTo>
__device__ __forceinline__ void mla_logits_chunks(float (&sc)[32], uint32_t q_base, uint32_t k_base) {
  using namespace sm90;
  const uint64_t q_desc = sw128_descriptor(q_base, 16), k_desc = sw128_descriptor(k_base, 16);
#pragma unroll
  for (int kk = 4 * kFrom; kk < 4 * kTo; ++kk) {
    const uint32_t off = (kk / 4) * M::kChunkBytes + (kk % 4) * 32;
    wgmma_m64n64k16<T, 0, 0>(sc, desc_advance(q_desc, off), desc_advance(k_desc, off));
  }
}

// sc = S of group kG's tile of pair j, issued and committed: group 0 starts on part 0, group 1 on
// part 1 (the producer's order); `between` runs once the first part is issued.
template <typename T, typename M, int kG, typename F>
__device__ __forceinline__ void mla_logits_issue(float (&sc)[32], MlaFwdShared& sh, const MlaThread& th, int j,
                                                 F&& between) {
  using namespace sm90;
#pragma unroll
  for (int x = 0; x < 32; ++x) sc[x] = 0.f;
  fence_accumulators(sc);
  constexpr int kFrom[2] = {0, M::kLeft}, kTo[2] = {M::kLeft, M::kChunks};  // the parts' chunks
  sh.ring.wait_full(th.uses + j, kG, kG);
  wgmma_fence();
  mla_logits_chunks<T, M, kFrom[kG], kTo[kG]>(sc, th.q_base, th.k_base[kG]);
  wgmma_commit();
  between();
  sh.ring.wait_full(th.uses + j, kG, 1 - kG);
  wgmma_fence();
  mla_logits_chunks<T, M, kFrom[1 - kG], kTo[1 - kG]>(sc, th.q_base, th.k_base[kG]);
  wgmma_commit();
}

// The tile's logits in log2 units (no key for the row: -inf; thread columns 8 j + 2c (+1), rows
// r0, r0 + 8) and their row maxima.
__device__ __forceinline__ void mla_mask(float (&sc)[32], const uint32_t* slot_rows, const MlaThread& th,
                                         float (&mx)[2]) {
  mx[0] = mx[1] = -INFINITY;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const bool valid = (slot_rows[8 * j + 2 * th.c + (e & 1)] >> th.bit[e / 2]) & 1;
      sc[4 * j + e] = valid ? sc[4 * j + e] * th.sl2 : -INFINITY;
      mx[e / 2] = fmaxf(mx[e / 2], sc[4 * j + e]);
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
  }
}

// O, the row sums and the maxima onto new maxima (a factor of 1 where the row has had no key);
// alpha: the factors.
__device__ __forceinline__ void mla_rescale(float (&o)[128], float (&l_run)[2], float (&m_run)[2],
                                            const float (&m_new)[2], float (&alpha)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    alpha[h] = m_new[h] == -INFINITY ? 1.f : exp2f(m_run[h] - m_new[h]);
    m_run[h] = m_new[h];
    l_run[h] *= alpha[h];
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
}

// P = exp2(S - m) in sc and, rounded, as the A operand pairs of P V; the row sums.
template <typename T>
__device__ __forceinline__ void mla_exp(float (&sc)[32], uint32_t (&pa)[16], const float (&m_run)[2],
                                        float (&l_run)[2]) {
#pragma unroll
  for (int x = 0; x < 32; ++x) {
    sc[x] = exp2f(sc[x] - finite_or_zero(m_run[(x / 2) % 2]));
    l_run[(x / 2) % 2] += sc[x];
  }
#pragma unroll
  for (int x = 0; x < 16; ++x) pa[x] = pack2<T>(sc[2 * x], sc[2 * x + 1]);
}

// P's pairs into the 128B-swizzled 64 x 64 tile at sP (pair x: row r0 + 8 (x % 2), columns 8 (x /
// 2) + 2c (+1)).
__device__ __forceinline__ void mla_store_p(uint8_t* sP, const uint32_t (&pa)[16], const MlaThread& th) {
#pragma unroll
  for (int x = 0; x < 16; ++x) {
    const int r = th.r0 + 8 * (x % 2), col = 8 * (x / 2) + 2 * th.c;
    *reinterpret_cast<uint32_t*>(sP + sm90::sw128_offset(r, col / 8) + (col % 8) * 2) = pa[x];
  }
}

// O += P V over group kG's value columns: of its own tile with P from registers, of the other
// group's with that group's P from shared memory.
template <typename T, typename M, int kG>
__device__ __forceinline__ void mla_pv_own(float (&o)[128], const uint32_t (&pa)[16], const MlaThread& th) {
  using namespace sm90;
  const uint64_t v_desc = sw128_descriptor(th.k_base[kG] + 4 * kG * M::kChunkBytes, M::kChunkBytes);
#pragma unroll
  for (int kk = 0; kk < M::kKeys / 16; ++kk) {
    const uint32_t a[4] = {pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]};
    wgmma_m64n256k16_rs<T, 1>(o, a, desc_advance(v_desc, kk * 2048));
  }
  wgmma_commit();
}

template <typename T, typename M, int kG>
__device__ __forceinline__ void mla_pv_other(float (&o)[128], const MlaThread& th) {
  using namespace sm90;
  const uint64_t p_desc = sw128_descriptor(smem_addr(th.p[1 - kG]), 16),
                 v_desc = sw128_descriptor(th.k_base[1 - kG] + 4 * kG * M::kChunkBytes, M::kChunkBytes);
#pragma unroll
  for (int kk = 0; kk < M::kKeys / 16; ++kk) {
    wgmma_m64n256k16<T, 0, 1>(o, desc_advance(p_desc, kk * 32), desc_advance(v_desc, kk * 2048));
  }
  wgmma_commit();
}

// Group kG's tile with its new maxima m_new: the maxima out to the other group, O and the row sums
// onto them, P (sc, and pa for P V), and O += P V over the tile's own value columns issued.
template <typename T, typename M, int kG>
__device__ __forceinline__ void mla_own_tile(MlaFwdShared& sh, const MlaThread& th, float (&sc)[32],
                                             uint32_t (&pa)[16], float (&o)[128], float (&m_run)[2],
                                             float (&l_run)[2], const float (&m_new)[2]) {
  using namespace sm90;
  if (th.c == 0) {
    sh.row_max[kG][th.r0] = m_new[0];
    sh.row_max[kG][th.r0 + 8] = m_new[1];
  }
  mbar_arrive(&sh.handoff[kG == 0 ? kMax0 : kMax1]);
  float alpha[2];
  mla_rescale(o, l_run, m_run, m_new, alpha);
  mla_exp<T>(sc, pa, m_run, l_run);
  fence_accumulators(o);
  wgmma_fence();
  mla_pv_own<T, M, kG>(o, pa, th);
}

// Group kG's main loop over the pairs (the head comment's order). Group 0: S; its maxima to group
// 1; P V of its tile, whose part 0 is then released; group 1's maxima rescale P into shared memory
// and O; P V of group 1's tile (waited for, and that part released, once the next S is issued).
// Group 1: S; group 0's maxima with its own; P V of its tile; P to shared memory; P V of group 0's
// tile; both parts 1 released.
template <typename T, typename M, int kG>
__device__ __forceinline__ void mla_attend(MlaFwdShared& sh, const MlaThread& th, float (&o)[128], float (&m_run)[2],
                                           float (&l_run)[2]) {
  using namespace sm90;
  float sc[32], mx[2], m_new[2], alpha[2];
  uint32_t pa[16];
  for (int j = 0; j < th.pairs; ++j) {
    mla_logits_issue<T, M, kG>(sc, sh, th, j, [&] {
      if (kG == 0 && j > 0) {  // the previous pair's P V over stage 1's part 0 is done
        wgmma_wait<1>();
        fence_accumulators(o);
        if (th.lane == 0) sh.ring.release(1, 0);
      }
    });
    wgmma_wait<0>();
    fence_accumulators(sc);
    mla_mask(sc, sh.rows[kG], th, mx);
    const int r[2] = {th.r0, th.r0 + 8};
    if constexpr (kG == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) m_new[h] = fmaxf(m_run[h], mx[h]);
      mla_own_tile<T, M, 0>(sh, th, sc, pa, o, m_run, l_run, m_new);
      wgmma_wait<0>();
      fence_accumulators(o);
      if (th.lane == 0) sh.ring.release(0, 0);
      mbar_wait(&sh.handoff[kMax1], (th.sends + j) & 1);
#pragma unroll
      for (int h = 0; h < 2; ++h) m_new[h] = sh.row_max[1][r[h]];
      mla_rescale(o, l_run, m_run, m_new, alpha);
#pragma unroll
      for (int x = 0; x < 16; ++x) pa[x] = pack2<T>(sc[2 * x] * alpha[x % 2], sc[2 * x + 1] * alpha[x % 2]);
      mla_store_p(th.p[0], pa, th);
      fence_proxy_async();
      mbar_arrive(&sh.handoff[kP0]);
      mbar_wait(&sh.handoff[kP1], (th.sends + j) & 1);
      fence_accumulators(o);
      wgmma_fence();
      mla_pv_other<T, M, 0>(o, th);
    } else {
      mbar_wait(&sh.handoff[kMax0], (th.sends + j) & 1);
#pragma unroll
      for (int h = 0; h < 2; ++h) m_new[h] = fmaxf(sh.row_max[0][r[h]], mx[h]);  // group 0's: no smaller than m_run
      mla_own_tile<T, M, 1>(sh, th, sc, pa, o, m_run, l_run, m_new);
      mla_store_p(th.p[1], pa, th);
      fence_proxy_async();
      mbar_arrive(&sh.handoff[kP1]);
      mbar_wait(&sh.handoff[kP0], (th.sends + j) & 1);
      wgmma_fence();
      mla_pv_other<T, M, 1>(o, th);
      wgmma_wait<1>();
      if (th.lane == 0) sh.ring.release(1, 1);
      wgmma_wait<0>();
      fence_accumulators(o);
      if (th.lane == 0) sh.ring.release(0, 1);
    }
  }
  if constexpr (kG == 0) {
    wgmma_wait<0>();
    fence_accumulators(o);
    if (th.pairs > 0 && th.lane == 0) sh.ring.release(1, 0);
  }
}

// A 4 x 4 transpose of 32-bit words across the lanes of a quad: lane c's w[i] becomes lane i's w[c]
// (two exchanges: lanes 1 apart swap the words whose bit 0 differs from theirs, then lanes 2 apart).
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4], int c, uint32_t quad) {
#pragma unroll
  for (int s = 1; s <= 2; s *= 2) {
    const bool up = c & s;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      if (p & s) continue;  // the pair (p, p + s)
      const uint32_t lo = w[p], hi = w[p + s];
      const uint32_t got = __shfl_xor_sync(quad, up ? lo : hi, s);
      w[p] = up ? got : lo;
      w[p + s] = up ? hi : got;
    }
  }
}

// Epilogue: both groups' row sums into sh.row_sum (`met` runs once both groups are there), then o /
// l times sigmoid(gate) (the row's gate loads all issued before its first store) and lse.
template <typename T, typename M, typename F>
__device__ __forceinline__ void mla_store(const AttnFwdArgs& a, MlaFwdShared& sh, const MlaThread& th,
                                          const float (&o)[128], const float (&m_run)[2], float (&l_run)[2],
                                          F&& met) {
  using namespace sm90;
  const int group = th.group, c = th.c, r0 = th.r0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
    if (c == 0) sh.row_sum[group][r0 + 8 * h] = l_run[h];
  }
  named_barrier_sync(1, 256);
  met();
  T* out = static_cast<T*>(a.o);
  const T* gate = static_cast<const T*>(a.gate);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 8 * h;
    if (r >= th.rows) continue;
    const float l = sh.row_sum[0][r] + sh.row_sum[1][r];
    const float inv = l != 0.f ? 1.f / l : 0.f;
    const int64_t row = th.t * a.H + th.head0 + r;
    const uint32_t quad = 0xfu << (th.lane & ~3);  // the lanes of the row
    // Lane c of the row's quad holds columns 8 n + 2c (+1); reads and writes go 16 bytes a lane
    // (columns 8 (4k + c) ..), turned by 4 x 4 transposes of the quad's words.
    uint4 gq[8];  // the row's gate, all loads issued before the first store
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      gq[k] = gate != nullptr
                  ? __ldg(reinterpret_cast<const uint4*>(gate + row * M::kDv + 256 * group + 8 * (4 * k + c)))
                  : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      uint32_t w[4] = {gq[k].x, gq[k].y, gq[k].z, gq[k].w};
      if (gate != nullptr) quad_transpose(w, c, quad);  // w[i]: columns 8 (4k + i) + 2c (+1)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int n = 4 * k + i;
        float v0 = o[4 * n + 2 * h] * inv, v1 = o[4 * n + 2 * h + 1] * inv;
        if (gate != nullptr) {
          const float2 gf = unpack2<T>(w[i]);
          v0 *= sigmoidf(gf.x);
          v1 *= sigmoidf(gf.y);
        }
        w[i] = pack2<T>(v0, v1);
      }
      quad_transpose(w, c, quad);
      *reinterpret_cast<uint4*>(out + row * M::kDv + 256 * group + 8 * (4 * k + c)) =
          make_uint4(w[0], w[1], w[2], w[3]);
    }
    if (group == 0 && c == 0) a.lse[row] = l != 0.f ? (m_run[h] + log2f(l)) * kLn2 : -INFINITY;
  }
}

// One halving exchange with the lane `lanes` apart: the first kHalf columns keep the sums of the
// half the thread keeps (the upper one where `upper`), the other half goes to the partner.
template <int kHalf>
__device__ __forceinline__ void halve(float (&v)[16], bool upper, int lanes) {
#pragma unroll
  for (int k = 0; k < kHalf; ++k) {
    const float lo = v[k], hi = v[k + kHalf];
    v[k] = (upper ? hi : lo) + __shfl_xor_sync(0xffffffffu, upper ? lo : hi, lanes);
  }
}

// Second pass (probabilities asked for): exp(S - lse) summed over each query's heads, per key
// (rows without the key, and the padding rows past `rows`, add nothing). Group g takes tile 2j + g
// of each pair as in the first pass; a tile's S is issued before the previous one's sums are formed
// (two accumulators in turn), and its stage released as soon as S is read. Each warp sums its
// 8-row units (rows r0 and r0 + 8 are two) over the lanes 4 apart by halving exchanges (lane g
// ends with columns 8g + 2c (+1)), through shared memory (two buffers in turn: one barrier a tile);
// then a query's units are added: probs [t, query, slot] for a packed block's queries
// (AttnArgs::member), else [t, slot] (added over head blocks).
template <typename M>
__device__ __forceinline__ void mla_probability_sums(const AttnFwdArgs& a, const MlaThread& th, const float (&sc)[32],
                                                     uint32_t valid, const float (&lse2)[2], float* colsum,
                                                     int tile, int n) {
  const int group = th.group, warp = th.warp, g = th.g;
  float v[2][16];  // [h][column 2 j + e]
#pragma unroll
  for (int j = 0; j < 8; ++j) {
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
  for (int h = 0; h < 2; ++h) {
    halve<8>(v[h], g & 4, 16);
    halve<4>(v[h], g & 2, 8);
    halve<2>(v[h], g & 1, 4);
  }
  float* buf = colsum + (2 * (n % 2) + group) * 512;  // [n % 2][group][unit 2 warp + h][64 keys]
  const int col = 8 * g + 2 * th.c;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    *reinterpret_cast<float2*>(buf + (2 * warp + h) * 64 + col) = make_float2(v[h][0], v[h][1]);
  }
  sm90::named_barrier_sync(2 + group, 128);
  if (warp == 0) {
    const int units = a.query_rows / 8, queries = a.member != nullptr ? a.G / a.query_rows : 1;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t k = int64_t{tile} * M::kKeys + 32 * half + th.lane;
      const float* cs = buf + 32 * half + th.lane;
      for (int q = 0; q < queries && k < a.topk; ++q) {
        float s = 0.f;
        for (int u = q * units; u < (q + 1) * units; ++u) s += cs[64 * u];
        float* dst = a.probs + (th.t * queries + q) * a.topk + k;
        if (a.head_blocks == 1) {
          *dst = s;
        } else {
          atomicAdd(dst, s);
        }
      }
    }
  }
}

template <typename T, typename M, int kG>
__device__ __forceinline__ void mla_probabilities(const AttnFwdArgs& a, MlaFwdShared& sh, uint8_t* sP,
                                                  const MlaThread& th) {
  using namespace sm90;
  float lse2[2];  // lse in log2 units, +inf (every p 0) for a row without keys or past `rows`
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = th.r0 + 8 * h;
    const float l = r < th.rows ? a.lse[th.t * a.H + th.head0 + r] : -INFINITY;
    lse2[h] = l == -INFINITY ? INFINITY : l * kLog2e;
  }
  float* colsum = reinterpret_cast<float*>(sP);  // P is done with
  static_assert(M::kPBytes >= 4 * 512 * sizeof(float));
  float sc[2][32];
  // Pair j's S (in sc[b]) is done: its slots' row bits read, its stage released, the next pair's
  // S issued into the other accumulator, then pair j's sums.
  const auto step = [&](auto b, int j) {
    constexpr int kB = decltype(b)::value;
    wgmma_wait<0>();
    fence_accumulators(sc[kB]);
    uint32_t valid = 0;
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        valid |= ((sh.rows[kG][8 * jj + 2 * th.c + (x & 1)] >> th.bit[x / 2]) & 1u) << (4 * jj + x);
      }
    }
    __syncwarp();
    if (th.lane == 0) {
      sh.ring.release(kG, 0);
      sh.ring.release(kG, 1);
    }
    if (j + 1 < th.pairs) mla_logits_issue<T, M, kG>(sc[1 - kB], sh, th, j + 1, [] {});
    mla_probability_sums<M>(a, th, sc[kB], valid, lse2, colsum, 2 * j + kG, j);
  };
  if (th.pairs > 0) mla_logits_issue<T, M, kG>(sc[0], sh, th, 0, [] {});
  for (int j = 0; j < th.pairs; j += 2) {
    step(std::integral_constant<int, 0>{}, j);
    if (j + 1 < th.pairs) step(std::integral_constant<int, 1>{}, j + 1);
  }
  wgmma_wait<0>();  // (none in flight: for ptxas, which cannot tell)
}

// Q of item `item` (rows past the block's as zeros) into sQ by cp.async from the consumers, committed.
template <typename T, typename M>
__device__ __forceinline__ void mla_load_q(const AttnFwdArgs& a, uint8_t* sQ, int64_t item) {
  const MlaItem it(a, item);
  load_rows64<T, M::kDqk>(sQ, static_cast<const T*>(a.q) + (it.t * a.H + it.head0) * M::kDqk, it.rows);
}

// Group kG's share of an item once its Q has arrived: pass 0 the attention (the epilogue's `met`
// loads the next Q: both groups are done with this one's), pass 1 the probabilities.
template <typename T, typename M, int kPass, int kG>
__device__ __forceinline__ void mla_item(const AttnFwdArgs& a, MlaFwdShared& sh, uint8_t* sQ, uint8_t* sP,
                                         const MlaThread& th, int64_t next) {
  const auto load_next = [&] {
    if (next >= 0) mla_load_q<T, M>(a, sQ, next);
  };
  if constexpr (kPass == 0) {
    float o[128];
#pragma unroll
    for (int x = 0; x < 128; ++x) o[x] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // l_run: this thread's columns
    mla_attend<T, M, kG>(sh, th, o, m_run, l_run);
    mla_store<T, M>(a, sh, th, o, m_run, l_run, load_next);
  } else {
    mla_probabilities<T, M, kG>(a, sh, sP, th);
    sm90::named_barrier_sync(1, 256);
    load_next();
  }
}

// The consumers' pass kPass over the block's items (a loop of its own: the two passes in one loop
// body would not fit the consumers' registers). uses, sends: the ring's pairs and the hand-offs so
// far.
template <typename T, typename M, int kPass>
__device__ __forceinline__ void mla_consume(const AttnFwdArgs& a, MlaFwdShared& sh, uint8_t* sQ, uint8_t* sK,
                                            uint8_t* sP, int& uses, int& sends) {
  using namespace sm90;
  const int64_t items = a.T * a.head_blocks;
  const int group = threadIdx.x / 128;
  uint8_t* p0 = M::kPBuffers == 1 ? sK + 8 * M::kChunkBytes : sP;  // group 0's P
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const MlaItem it(a, item);
    const MlaThread th{mla_place(a, it.t, it.head0, it.rows, it.tiles),
                       group, it.pairs, uses, sends, a.scale * kLog2e, smem_addr(sQ),
                       {smem_addr(sK), smem_addr(sK + M::kTileBytes)}, {p0, sP + (M::kPBuffers - 1) * M::kPBytes}};
    // the next Q: the block's next item's, or its first item's again for the probabilities' pass
    int64_t next = item + gridDim.x;
    if (next >= items) next = kPass == 0 && a.probs != nullptr ? int64_t{blockIdx.x} : -1;
    cp_async_wait<0>();
    fence_proxy_async();  // Q is read by wgmma
    named_barrier_sync(1, 256);
    if (group == 0) {
      mla_item<T, M, kPass, 0>(a, sh, sQ, sP, th, next);
    } else {
      mla_item<T, M, kPass, 1>(a, sh, sQ, sP, th, next);
    }
    uses += it.pairs;
    if (kPass == 0) sends += it.pairs;
  }
}

// Persistent blocks, one an SM: a block takes items blockIdx.x, + gridDim.x, .. in turn (MlaItem),
// the producer running on into the next item's tiles while the consumers finish one; with
// probabilities asked for, a second pass over the same items (lse from the first).
template <typename T, typename M>
__global__ void __launch_bounds__(M::kThreads, 1) mla_fwd_kernel(const __grid_constant__ AttnFwdArgs a) {
#ifdef KDA_SM90A_ENABLED
  using namespace sm90;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = aligned_smem(smem_raw);
  uint8_t* sQ = smem;
  uint8_t* sK = sQ + M::kTileBytes;  // the two stages
  uint8_t* sP = sK + 2 * M::kTileBytes;
  MlaFwdShared& sh = *reinterpret_cast<MlaFwdShared*>(sP + M::kPBuffers * M::kPBytes);

  // the consumers bring the first Q (cp.async, all in flight at once) while the producer starts
  if (threadIdx.x < 256) mla_load_q<T, M>(a, sQ, blockIdx.x);
  if (threadIdx.x == 0) {
    for (uint64_t& h : sh.handoff) mbar_init(&h, 128);
    sh.ring.init();  // its fence covers the hand-offs' inits too
  }
  __syncthreads();
  if (M::is_producer()) {
    M::producer_registers();
    mla_produce<T, M>(a, sh, sK);
    return;
  }
  M::consumer_registers();
  int uses = 0, sends = 0;
  mla_consume<T, M, 0>(a, sh, sQ, sK, sP, uses, sends);
  if (a.probs != nullptr) mla_consume<T, M, 1>(a, sh, sQ, sK, sP, uses, sends);
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
      AttnFwdArgs a{attn_args(pk, q, kv, gate, M::kRows), o.data_ptr(), lse.data_ptr<float>(),
                    probs.defined() ? probs.data_ptr<float>() : nullptr};
      const int64_t items = p.T * a.head_blocks;
      if (items == 0) return;
      const auto blocks = std::min<int64_t>(items, num_sms(q.get_device()));
      // Packed blocks' unions differ in length: they are dealt longest first, each round of
      // `blocks` items in the direction opposite to the last, so that the blocks' shares even out.
      const at::Tensor order = with_order(pk, a, blocks);
      const auto kernel = mla_fwd_kernel<scalar_t, M>;
      set_smem(kernel, smem);
      kernel<<<static_cast<unsigned>(blocks), M::kThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(a);
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
