// Sparse attention's forward at 8 or 16 query heads a kv head with Dqk <= 128 (GQA, mma.sync): the
// equations of attn_fwd_cuda.cu with the keys along the mma's rows, S^T = K Q^T and O^T += V^T P^T,
// so that a step of 16 keys x 8 heads fills an m16n8k16 product whatever keys the neighbouring
// queries chose. A warp keeps one query's online softmax over such steps (GqaWarp): Q^T's fragments
// and O^T's accumulators stay in registers, P^T goes from the accumulators to the next product's
// operand by movmatrix, and each lane's ldmatrix row address says which key a step's row holds.
// Two kernels:
// - packed, at 8 heads (QueryPack: 8 queries a block; gqa_bwd_cuda.cu's backward walks the same
//   way): two producer warps gather the block's union
//   of keys in tiles of 128 slots, half a tile each (cp.async into a ring of three stages,
//   mbarriers; with one producer warp the consumers waited for it: 1.48 ms against 1.42 below), and
//   each consumer warp, one per query, steps through the slots its query chose (member bits) across
//   the tiles. A key that several queries chose is read from L2 once for the block. A step's rows
//   are arbitrary rows of the ring, and a row's bank group is its index % 8: the warp queues its
//   rows by group and a step takes up to 4 of each queue, so that each eight-row ldmatrix matrix
//   reads 8 groups (with the rows in arrival order and dealt by group a step, conflicts were 45% of
//   the shared-load wavefronts on random sets). A warp keeps the rows it has not used of one tile
//   only: while rows of the tile before wait, it takes part-filled steps (masked) and then releases
//   that tile. On random sets (unions at 0.45 of the slots, about 4 rows a queue a tile, many
//   part-filled steps) the forward takes 1.42 ms all packed against 1.57 unpacked (H200, T 4096, Tk
//   8192, 4 kv heads): the packed launch takes the blocks whose union keeps at most 0.6 of their
//   slots (dsa_cuda.cu).
// - unpacked (the other blocks, 16 heads, return_p, T = 1): a block per (query, kv head) of four
//   warps; each warp takes every fourth tile of 32 slots, gathered into its own two stages (cp.async,
//   zeros for a slot without a key), and the warps' partial results are merged through shared
//   memory at the end. With return_p a second pass sums the final probabilities over the heads.
#include <c10/cuda/CUDAGuard.h>

#include "common/dispatch.h"
#include "dsa/gqa_cuda.cuh"

namespace kda_dsa_ops::dsa {

namespace {

using namespace gqa;

// One query's kG heads on one kv head, a warp's: Q^T as B fragments (dims x heads, zeros past Dqk),
// the running maxima (equal over g) and the thread's own keys' sums for heads 8 n + 2 c + h, and O^T
// (dims 16 d + g (+ 8), heads 8 n + 2 c (+ 1)).
template <typename T, int kG>
struct GqaWarp {
  static constexpr int kN = kG / 8;  // 8-head tiles
  uint32_t qb[kDim / 16][kN][2];
  float m_run[kN][2], l_run[kN][2];
  float o_acc[kDim / 16][kN][4];
  int kd, kdv;
  bool full;  // Dqk and dv both kDim: the steps' loops without a bound read at run time
  float sl2;

  __device__ __forceinline__ explicit GqaWarp(const AttnArgs& a) {
    kd = round16(a.Dqk);
    kdv = round16(a.dv);
    full = kd == kDim && kdv == kDim;
    sl2 = a.scale * kLog2e;
#pragma unroll
    for (int n = 0; n < kN; ++n) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        m_run[n][h] = -INFINITY;
        l_run[n][h] = 0.f;
      }
#pragma unroll
      for (int d = 0; d < kDim / 16; ++d) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o_acc[d][n][e] = 0.f;
      }
    }
  }

  // Q^T from q, the query's row of head 0 on the kv head (Dqk columns a row).
  __device__ __forceinline__ void q_from_global(const T* q, int Dqk) {
    const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
#pragma unroll
    for (int kk = 0; kk < kDim / 16; ++kk) {
#pragma unroll
      for (int n = 0; n < kN; ++n) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int col = kk * 16 + 8 * h + 2 * c;
          qb[kk][n][h] = col < Dqk ? *reinterpret_cast<const uint32_t*>(q + (8 * n + g) * Dqk + col) : 0u;
        }
      }
    }
  }
  // Q^T from the heads' rows in shared memory (kLd apart, 16 of them, zeros past Dqk).
  __device__ __forceinline__ void q_from_shared(const T* sQ) {
#pragma unroll
    for (int kk = 0; kk < kDim / 16; ++kk) {
      uint32_t b[4];
      load_b_nk(b, sQ, kLd, 0, kk * 16);
#pragma unroll
      for (int n = 0; n < kN; ++n) {
        qb[kk][n][0] = b[2 * n];
        qb[kk][n][1] = b[2 * n + 1];
      }
    }
  }

  // The logits in log2 units of kM steps of 16 keys, S^T for keys 16 m + g (+ 8) and heads 8 n + 2 c
  // (+ 1); -inf where bit 16 m + key of mask is clear (the even and odd 16-dim steps into separate
  // sums: two chains of dependent products). kFull: the loop over all kDim dims, with no branch
  // between its loads and products (a bound read at run time put one after each product).
  template <int kM, bool kFull = false>
  __device__ __forceinline__ void logits(float (&s)[kM][kN][4], const StepRows<T> (&rows)[kM], uint32_t mask) const {
    const int g = threadIdx.x % 32 / 4;
    float odd[kM][kN][4];
#pragma unroll
    for (int m = 0; m < kM; ++m) {
#pragma unroll
      for (int n = 0; n < kN; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[m][n][e] = odd[m][n][e] = 0.f;
      }
    }
#pragma unroll
    for (int kk = 0; kk < kDim / 16; ++kk) {
      if (!kFull && kk * 16 >= kd) break;
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        uint32_t af[4];
        ldmatrix_x4(af, rows[m].k + kk * 16);
#pragma unroll
        for (int n = 0; n < kN; ++n) mma_16816<T>(kk % 2 ? odd[m][n] : s[m][n], af, qb[kk][n][0], qb[kk][n][1]);
      }
    }
#pragma unroll
    for (int m = 0; m < kM; ++m) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool in = mask >> (16 * m + g + 8 * (e / 2)) & 1;
#pragma unroll
        for (int n = 0; n < kN; ++n) s[m][n][e] = in ? (s[m][n][e] + odd[m][n][e]) * sl2 : -INFINITY;
      }
    }
  }

  // The online softmax over kM steps of 16 keys (mask as logits takes it).
  template <int kM>
  __device__ __forceinline__ void step(const StepRows<T> (&rows)[kM], uint32_t mask) {
    if (full) {
      step_over<kM, true>(rows, mask);
    } else {
      step_over<kM, false>(rows, mask);
    }
  }
  template <int kM, bool kFull>
  __device__ __forceinline__ void step_over(const StepRows<T> (&rows)[kM], uint32_t mask) {
    float s[kM][kN][4];
    logits<kM, kFull>(s, rows, mask);
    uint32_t pb[kM][kN][2];  // P^T as B fragments (keys x heads)
#pragma unroll
    for (int n = 0; n < kN; ++n) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int m = 0; m < kM; ++m) mx = fmaxf(mx, fmaxf(s[m][n][h], s[m][n][h + 2]));
        mx = fmaxf(mx, __shfl_xor_sync(~0u, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(~0u, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(~0u, mx, 16));
        const float m_new = fmaxf(m_run[n][h], mx);
        const float alpha = m_new == -INFINITY ? 1.f : exp2f(m_run[n][h] - m_new);
        const float m_sub = finite_or_zero(m_new);
        float sum = 0.f;
#pragma unroll
        for (int m = 0; m < kM; ++m) {
#pragma unroll
          for (int e = h; e < 4; e += 2) {
            s[m][n][e] = exp2f(s[m][n][e] - m_sub);
            sum += s[m][n][e];
          }
        }
        l_run[n][h] = l_run[n][h] * alpha + sum;
        m_run[n][h] = m_new;
#pragma unroll
        for (int d = 0; d < kDim / 16; ++d) {
          o_acc[d][n][h] *= alpha;
          o_acc[d][n][h + 2] *= alpha;
        }
      }
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        pb[m][n][0] = transpose8x8(pack2<T>(s[m][n][0], s[m][n][1]));
        pb[m][n][1] = transpose8x8(pack2<T>(s[m][n][2], s[m][n][3]));
      }
    }
#pragma unroll
    for (int d = 0; d < kDim / 16; ++d) {
      if (!kFull && d * 16 >= kdv) break;
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        uint32_t va[4];
        ldmatrix_x4_trans(va, rows[m].v + d * 16);
#pragma unroll
        for (int n = 0; n < kN; ++n) mma_16816<T>(o_acc[d][n], va, pb[m][n][0], pb[m][n][1]);
      }
    }
  }

  // l_run summed over the warp's keys.
  __device__ __forceinline__ void sum_over_keys() {
#pragma unroll
    for (int n = 0; n < kN; ++n) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        l_run[n][h] += __shfl_xor_sync(~0u, l_run[n][h], 4);
        l_run[n][h] += __shfl_xor_sync(~0u, l_run[n][h], 8);
        l_run[n][h] += __shfl_xor_sync(~0u, l_run[n][h], 16);
      }
    }
  }
};

// The packed kernel (8 heads a kv head, 8 queries a block): a consumer warp per query, then the
// producer warps (20 warps an SM, five a scheduler, 96 registers a thread as with one).
struct PackedShape : PackedRing<128, 3, 2> {
  static constexpr size_t kWords = size_t{kStages} * kU * 4;  // the slots' member bits
  static constexpr size_t kSmem = kRing + kWords + kLists + 2 * kStages * sizeof(uint64_t);
  static_assert((kRing + kWords + kLists) % 8 == 0, "the mbarriers' alignment");
};

// Block t of the pack on kv head kvh: its union's slots in tiles of kU (AttnArgs: indices, member,
// lengths; topk the union's capacity), each tile's rows and the slots' member bits gathered by the
// producer; consumer warp w steps through query t group + w's slots.
template <typename T>
__global__ void __launch_bounds__(PackedShape::kThreads, 2) gqa_packed_fwd_kernel(AttnFwdArgs a) {
  using P = PackedShape;
  constexpr int kG = 8;
  constexpr int kU = P::kU, kStages = P::kStages;
  extern __shared__ __align__(16) unsigned char smem[];
  T* ring = reinterpret_cast<T*>(smem);
  uint32_t* words = reinterpret_cast<uint32_t*>(smem + P::kRing);
  uint16_t* lists = reinterpret_cast<uint16_t*>(smem + P::kRing + P::kWords);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + P::kRing + P::kWords + P::kLists);
  uint64_t* empty = full + kStages;
  const int64_t t = blockIdx.x;
  if (attn_skips(a, t, blockIdx.y)) return;
  const int kvh = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int heads = static_cast<int>(a.H / a.group);  // the call's query heads
  const int64_t first_row = t * a.group * heads;
  const int queries = static_cast<int>(min(int64_t{a.group}, (a.rows_total - first_row) / heads));
  const int length = a.lengths[t * a.Hkv + kvh], tiles = (length + kU - 1) / kU;
  const int64_t base = (t * a.Hkv + kvh) * a.topk;  // the block's union
  start_ring<P::kZeroRow, kStages, P::kProducers>(ring, full, empty, queries);

  if (warp >= P::kQueries) {
    produce_union<kU, kStages, P::kProducers, false>(a, kvh, base, length, warp - P::kQueries, ring, words,
                                                     static_cast<int32_t*>(nullptr), full, empty);
    return;
  }
  if (warp >= queries) return;

  const int64_t row0 = first_row + int64_t{warp} * heads + int64_t{kvh} * kG;  // q's row of head 0
  GqaWarp<T, kG> st(a);
  st.q_from_global(static_cast<const T*>(a.q) + row0 * a.Dqk, a.Dqk);
  // Queue r (lanes r, r + 8, .. keep its head and tail) holds the chosen rows whose index % 8 is r,
  // in arrival order: a step takes up to 4 rows of each, step row 8 j + r the queue's j-th, so that
  // the 8 rows of each of its ldmatrix matrices fall in 8 bank groups (a row's 16-byte pieces: (row
  // + piece) % 8, the rows kLd = 17 pieces apart); a gap reads the zero row of its group.
  const int r = lane % 8;
  uint16_t* queue = lists + warp * P::kList + r * P::kQueue;
  int head = 0, tail = 0;
  const auto step = [&](auto m_tiles) {
    constexpr int kM = decltype(m_tiles)::value;
    const int waiting = tail - head;
    const uint32_t mask = step_mask<kM>(waiting);
    StepRows<T> sr[kM];
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      const int jk = 2 * m + lane % 16 / 8, jv = 2 * m + lane / 16;  // (both rows' group: r)
      const int rk = jk < waiting ? queue[(head + jk) % P::kQueue] : P::kZeroRow + r;
      const int rv = jv < waiting ? queue[(head + jv) % P::kQueue] : P::kZeroRow + r;
      sr[m] = step_rows(ring + rk * kLd, ring + rv * kLd);
    }
    st.template step<kM>(sr, mask);
    head += min(waiting, 2 * kM);
  };
  // A step over up to 4 rows a queue (2 where no queue has more).
  const auto take = [&]() {
    if (__any_sync(~0u, tail - head > 2)) {
      step(std::integral_constant<int, 2>{});
    } else {
      step(std::integral_constant<int, 1>{});
    }
  };
  for (int i = 0; i < tiles; ++i) {
    const int s = i % kStages, before = tail;
    sm90::mbar_wait(&full[s], i / kStages & 1);
    queue_tile<kU, P::kQueue>(queue, tail, words, s, warp);
    __syncwarp();
    while (__all_sync(~0u, tail - head >= 4)) take();
    while (__any_sync(~0u, head < before)) take();  // the tile before's rows: it is released now
    __syncwarp();
    if (i > 0 && lane == 0) sm90::mbar_arrive(&empty[(i - 1) % kStages]);
  }
  while (__any_sync(~0u, head < tail)) take();

  st.sum_over_keys();
  const int g = lane / 4, c = lane % 4;
  T* out = static_cast<T*>(a.o);
  const T* gate = static_cast<const T*>(a.gate);
#pragma unroll
  for (int n = 0; n < GqaWarp<T, kG>::kN; ++n) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row0 + 8 * n + 2 * c + h;
      const float l = st.l_run[n][h];
      if (g == 0) a.lse[row] = l != 0.f ? (st.m_run[n][h] + log2f(l)) * kLn2 : -INFINITY;
      const float inv = l != 0.f ? 1.f / l : 0.f;
#pragma unroll
      for (int d = 0; d < kDim / 16; ++d) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = 16 * d + g + 8 * e;
          if (col >= a.dv) continue;
          float v = st.o_acc[d][n][h + 2 * e] * inv;
          if (gate != nullptr) v *= sigmoidf(to_float(gate[row * a.dv + col]));
          out[row * a.dv + col] = from_float<T>(v);
        }
      }
    }
  }
}

// The unpacked kernel: four warps a (query, kv head), each with its own ring.
constexpr int kWarps = 4;
constexpr int kKeys = 32;       // slots of a warp's tile
constexpr int kM = kKeys / 16;  // its 16-key steps
constexpr int kStages = 2;      // a warp's tiles in flight
constexpr int kLdO = kDim + 4;  // the merge's rows (fp32, no bank conflicts)

template <int kG>
struct GqaShape {
  static constexpr size_t kRing = size_t{kWarps} * kStages * kKeys * kLd * 2;
  static constexpr size_t kMerge = 2 * kWarps * kG * sizeof(float);  // each warp's maxima and sums
  static constexpr size_t kSmem = kRing + kMerge;
  static_assert(kWarps * kG * kLdO * sizeof(float) <= kRing && 16 * kLd * 2 <= kRing, "Q and the merge reuse the ring");
};

// (Three blocks an SM, as the ring allows: without the bound ptxas held 8 heads to 128 registers and
// spilled.)
template <typename T, int kG>
__global__ void __launch_bounds__(kWarps * 32, 3) gqa_fwd_kernel(AttnFwdArgs a) {
  using S = GqaShape<kG>;
  constexpr int kN = GqaWarp<T, kG>::kN;
  extern __shared__ __align__(16) unsigned char smem[];
  T* ring = reinterpret_cast<T*>(smem);
  float* merge_m = reinterpret_cast<float*>(smem + S::kRing);  // [kWarps][kG]
  float* merge_l = merge_m + kWarps * kG;                      // [kWarps][kG]
  const int64_t t = blockIdx.x;
  if (attn_skips(a, t, blockIdx.y)) return;
  const int kvh = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int64_t row0 = t * a.H + int64_t{kvh} * kG;  // q's row of head 0
  const int32_t* sel = a.indices + (t * a.Hkv + kvh) * a.topk;
  const KvPieces<T> pieces(a, kvh);
  GqaWarp<T, kG> st(a);
  {
    T* sQ = ring;  // until the fragments are loaded
    const T* q = static_cast<const T*>(a.q);
    gather_rows(sQ, kLd, 16, a.Dqk, kDim, [&](int r) { return r < kG ? q + (row0 + r) * a.Dqk : nullptr; });
    cp_async_wait_all();
    __syncthreads();
    st.q_from_shared(sQ);
    __syncthreads();
  }

  // The warp's tiles: slots (warp + kWarps i) kKeys .., i < tiles, in stage i % kStages of its ring.
  const int all_tiles = (a.topk + kKeys - 1) / kKeys;
  const int tiles = all_tiles > warp ? (all_tiles - warp + kWarps - 1) / kWarps : 0;
  T* my_ring = ring + warp * kStages * kKeys * kLd;
  const auto slot0 = [&](int i) { return (warp + kWarps * i) * kKeys; };
  // This lane's slot of tile i: its key as the selection has it (-1 past the tile or the selection).
  const auto slot_key = [&](int i) {
    const int j = slot0(i) + lane;
    return i < tiles && lane < kKeys && j < a.topk ? sel[j] : -1;
  };
  // Tile i's rows into its stage (lanes 16 h .. 16 h + 15 copy row 2 r + h's 16-byte pieces; key:
  // slot_key(i)), one commit group (empty past the last tile); returns the tile's slots that have a
  // key (bit r).
  const auto issue = [&](int i, int key) -> uint32_t {
    uint32_t mask = 0;
    if (i < tiles) {
      const bool ok = key >= 0 && key < a.Tk;
      mask = __ballot_sync(~0u, ok);
      T* dst = my_ring + (i % kStages) * kKeys * kLd;
#pragma unroll
      for (int r = 0; r < kKeys / 2; ++r) {
        const int row = 2 * r + lane / 16;
        pieces.copy(dst + row * kLd, __shfl_sync(~0u, ok ? key : -1, row));
      }
    }
    cp_async_commit();
    return mask;
  };
  // f(tile's step rows, its mask, i) for each of the warp's tiles, kStages - 1 of them in flight
  // ahead and the keys of the next one loaded.
  const auto each_tile = [&](auto&& f) {
    uint32_t masks[kStages];
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) masks[s] = issue(s, slot_key(s));
    int next = slot_key(kStages - 1);
    for (int i = 0; i < tiles; ++i) {
      __syncwarp();  // the stage refilled now was read by the last step
      masks[kStages - 1] = issue(i + kStages - 1, next);
      next = slot_key(i + kStages);
      cp_async_wait<kStages - 1>();
      __syncwarp();
      const T* tile = my_ring + (i % kStages) * kKeys * kLd;
      StepRows<T> rows[kM];
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        rows[m] = step_rows(tile + (16 * m + k_row_of_lane()) * kLd, tile + (16 * m + v_row_of_lane()) * kLd);
      }
      f(rows, masks[0], i);
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) masks[s] = masks[s + 1];
    }
    cp_async_wait<0>();
  };
  each_tile([&](const StepRows<T>(&rows)[kM], uint32_t mask, int) { st.template step<kM>(rows, mask); });

  // The merge: each warp's maxima and sums, then its O^T scaled to the block's maxima and sums.
  st.sum_over_keys();
#pragma unroll
  for (int n = 0; n < kN; ++n) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (g == 0) {
        merge_m[warp * kG + 8 * n + 2 * c + h] = st.m_run[n][h];
        merge_l[warp * kG + 8 * n + 2 * c + h] = st.l_run[n][h];
      }
    }
  }
  __syncthreads();
  // Head `head`'s maximum and sum over the warps, and warp w's factor to them.
  const auto block_max = [&](int head) {
    float mx = -INFINITY;
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, merge_m[w * kG + head]);
    return mx;
  };
  const auto factor = [&](int w, int head, float mx) {
    const float m = merge_m[w * kG + head];
    return m == -INFINITY ? 0.f : exp2f(m - mx);
  };
  const auto block_sum = [&](int head, float mx) {
    float l = 0.f;
    for (int w = 0; w < kWarps; ++w) l += factor(w, head, mx) * merge_l[w * kG + head];
    return l;
  };
  float* merge_o = reinterpret_cast<float*>(ring);  // [kWarps][kG][kLdO]
  float lse2[kN][2];                                  // the thread's heads', log2 units
#pragma unroll
  for (int n = 0; n < kN; ++n) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int head = 8 * n + 2 * c + h;
      const float mx = block_max(head), l = block_sum(head, mx);
      lse2[n][h] = l != 0.f ? mx + log2f(l) : INFINITY;
      if (warp == 0 && g == 0) a.lse[row0 + head] = l != 0.f ? lse2[n][h] * kLn2 : -INFINITY;
      const float f = l != 0.f ? factor(warp, head, mx) / l : 0.f;
#pragma unroll
      for (int d = 0; d < kDim / 16; ++d) {
        float* o = merge_o + (warp * kG + head) * kLdO + 16 * d + g;
        o[0] = st.o_acc[d][n][h] * f;
        o[8] = st.o_acc[d][n][h + 2] * f;
      }
    }
  }
  __syncthreads();
  T* out = static_cast<T*>(a.o);
  const T* gate = static_cast<const T*>(a.gate);
  for (int i = threadIdx.x; i < kG * a.dv; i += kWarps * 32) {
    const int head = i / a.dv, col = i % a.dv;
    float v = 0.f;
    for (int w = 0; w < kWarps; ++w) v += merge_o[(w * kG + head) * kLdO + col];
    const int64_t row = row0 + head;
    if (gate != nullptr) v *= sigmoidf(to_float(gate[row * a.dv + col]));
    out[row * a.dv + col] = from_float<T>(v);
  }
  if (a.probs == nullptr) return;

  // Second pass: the final probabilities summed over the kv head's heads, a warp its own slots.
  __syncthreads();  // the merge's rows are read before the ring is refilled
  float* probs = a.probs + (t * a.Hkv + kvh) * a.topk;
  each_tile([&](const StepRows<T>(&rows)[kM], uint32_t mask, int i) {
    float s[kM][kN][4];
    st.template logits<kM>(s, rows, mask);
#pragma unroll
    for (int m = 0; m < kM; ++m) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float v = 0.f;
#pragma unroll
        for (int n = 0; n < kN; ++n) v += exp2f(s[m][n][2 * r] - lse2[n][0]) + exp2f(s[m][n][2 * r + 1] - lse2[n][1]);
        v += __shfl_xor_sync(~0u, v, 1);
        v += __shfl_xor_sync(~0u, v, 2);
        const int j = slot0(i) + 16 * m + g + 8 * r;
        if (c == 0 && j < a.topk) probs[j] = v;
      }
    }
  });
}

}  // namespace

bool gqa_fwd_takes(const AttnProblem& p, int64_t group) {
  const int64_t G = p.Hkv > 0 ? p.H / group / p.Hkv : 0;
  return (G == 8 || (G == 16 && group == 1)) && p.Dqk <= kDim;
}

void gqa_fwd_cuda(const QueryPack& pk, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& gate,
                  at::Tensor& o, at::Tensor& lse, at::Tensor& probs) {
  const AttnProblem& p = pk.problem;
  const c10::cuda::CUDAGuard guard(q.device());
  // (a block holds all of a kv head's rows; packed launches come without probabilities)
  const AttnFwdArgs a{attn_args(pk, q, kv, gate, static_cast<int>(p.H / p.Hkv)), o.data_ptr(), lse.data_ptr<float>(),
                      probs.defined() ? probs.data_ptr<float>() : nullptr};
  KDA_DISPATCH_CUDA_HALF(q.scalar_type(), "sparse_attn_fwd", [&] {
    const auto run = [&](auto heads) {
      constexpr int kG = decltype(heads)::value;
      launch(gqa_fwd_kernel<scalar_t, kG>, dim3(p.T, p.Hkv), kWarps * 32, GqaShape<kG>::kSmem, a);
    };
    if (pk.group > 1) {
      launch(gqa_packed_fwd_kernel<scalar_t>, dim3(p.T, p.Hkv), PackedShape::kThreads, PackedShape::kSmem, a);
    } else if (p.H / p.Hkv == 8) {
      run(std::integral_constant<int, 8>{});
    } else {
      run(std::integral_constant<int, 16>{});
    }
  });
}

}  // namespace kda_dsa_ops::dsa
