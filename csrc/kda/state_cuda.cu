// KDA's state stage: the chunks of each sequence in order, the state carried on chip,
//   forward   U = Ut - W S,  O = scale (Qg S + Aqk U),  S <- diag(gC) S + Kd^T U
//   backward  (chunks in reverse, dS the gradient of the chunk's end state)
//             dU = scale Aqk^T dO + Kd dS,  dS <- diag(gC) dS + scale Qg^T dO - W^T dU
// One block per (64-column value tile, value head, sequence): the value columns of the state
// are independent, so a [K, 64] tile of it is all a block keeps. The forward also writes the
// start state of every chunk (for the backward) and the final state; the backward the end-state
// gradient of every chunk and the initial state's.
//   state_fwd_kernel, state_bwd_kernel             the generic family: the state tile and the
//                                                  chunk's terms in shared memory, kda_chunk.h's
//                                                  chunk_state_fwd / _bwd on the block team
//   state_fwd_bf16_kernel, state_bwd_bf16_kernel   bf16 operands, the state in registers, the
//                                                  next chunk staged while this one computes
//   state_fwd_wgmma_kernel, state_bwd_wgmma_kernel the bf16 passes at K 128 on Hopper's wgmma:
//                                                  two warpgroups, the state in their
//                                                  accumulators
#include <c10/cuda/CUDAGuard.h>

#include "common/hopper.cuh"
#include "common/tma.h"
#include "kda/kda_cuda.cuh"
#include "kda/tiles16.cuh"

namespace kda_dsa_ops::kda {

namespace {

// Copy a rows x cols block (leading dim ld) into dense shared memory.
template <typename T>
__device__ void stage(const BlockTeam& tm, T* dst, const T* src, int64_t ld, int rows, int cols) {
  for (int i = tm.rank(); i < rows * cols; i += tm.size()) dst[i] = src[(i / cols) * ld + i % cols];
}

// Shared memory of the state kernels: the state tile, a [kChunk, Vt] scratch, and the chunk's
// W, Qg, Kd [kChunk, K], Aqk [kChunk, kChunk] and one [kChunk, Vt] tile (Ut or dO), staged.
template <typename T>
struct StateSmem {
  T *S, *U, *W, *Qg, *Kd, *Aqk, *tile;
  __device__ StateSmem(T* base, int64_t K)
      : S(base), U(S + K * kStateCols), W(U + kChunk * kStateCols), Qg(W + kChunk * K), Kd(Qg + kChunk * K),
        Aqk(Kd + kChunk * K), tile(Aqk + kChunk * kChunk) {}
  static size_t bytes(int64_t K) {
    return sizeof(T) * (K * kStateCols + 2 * kChunk * kStateCols + 3 * kChunk * K + kChunk * kChunk);
  }
  // Stage the state-independent terms of the chunk starting at workspace row `row`.
  __device__ void stage_chunk(const BlockTeam& tm, const Intra<T>& in, int64_t row, int L, int64_t K) const {
    stage(tm, W, in.W + row * K, K, L, static_cast<int>(K));
    stage(tm, Qg, in.Qg + row * K, K, L, static_cast<int>(K));
    stage(tm, Kd, in.Kd + row * K, K, L, static_cast<int>(K));
    stage(tm, Aqk, in.Aqk + row * kChunk, kChunk, L, kChunk);
  }
};

// The block's state tile: columns [j0, j0 + Vt) of the [K, V] state of value head hv, sequence n,
// and the chunks of that sequence.
template <typename T>
struct StateTile {
  int j0, Vt, K;
  int64_t V, hv, n, bos, len, first, chunks;
  __device__ StateTile(const Seqs& sq, const Sizes<T>& z)
      : j0(static_cast<int>(blockIdx.x) * kStateCols),
        Vt(static_cast<int>(z.V - j0 < kStateCols ? z.V - j0 : kStateCols)),
        K(static_cast<int>(z.K)), V(z.V), hv(blockIdx.y), n(blockIdx.z) {
    sq.bounds(n, bos, len);
    first = sq.first_slot(n);
    chunks = sq.chunks_of(len);
  }
  // Chunk i of the sequence: its slot, first token and length; false when it lies outside.
  __device__ bool chunk(const Seqs& sq, int64_t i, int64_t& slot, int64_t& t0, int& L) const {
    slot = first + i;
    t0 = bos + i * kChunk;
    L = static_cast<int>(len - i * kChunk < kChunk ? len - i * kChunk : kChunk);
    return sq.valid(slot, t0, L);
  }
  // The forward's marks of a chunk (per value column, then its first non-finite step at [V]);
  // nullptr without marks.
  __device__ const unsigned char* marks(const Seqs& sq, const unsigned char* mark, int64_t slot) const {
    return mark != nullptr ? mark + (hv * sq.slots + slot) * mark_stride(V) : nullptr;
  }
  // The chunk's first non-finite step, L without marks.
  __device__ int first_marked(const Seqs& sq, const unsigned char* mark, int64_t slot, int L) const {
    return mark != nullptr ? marks(sq, mark, slot)[V] : L;
  }
  // Offset of this sequence's and head's [K, V] matrix in an [N, HV, K, V] tensor.
  __device__ int64_t matrix(int64_t HV) const { return (n * HV + hv) * K * V; }
  // tile = the tile's columns of the [K, V] matrix at src (zeros for nullptr), for the whole team.
  __device__ void load(const BlockTeam& tm, T* tile, const T* src) const {
    for (int i = tm.rank(); i < K * Vt; i += tm.size()) {
      tile[i] = src != nullptr ? src[(i / Vt) * V + j0 + i % Vt] : T(0);
    }
    tm.sync();
  }
  __device__ void store(const BlockTeam& tm, const T* tile, T* dst) const {
    for (int i = tm.rank(); i < K * Vt; i += tm.size()) dst[(i / Vt) * V + j0 + i % Vt] = tile[i];
  }
};

// Forward state passing. o (may be nullptr) [tokens, HV, V]; starts (may be nullptr) receives
// the start state of every chunk, [HV, slots, K, V].
template <typename T>
__global__ void __launch_bounds__(kThreads) state_fwd_kernel(Seqs sq_, Sizes<T> z, T scale, Intra<T> in,
                                                             const T* __restrict__ h0, T* o, T* ht, T* starts) {
  extern __shared__ unsigned char smem_raw[];
  const StateSmem<T> sm(reinterpret_cast<T*>(smem_raw), z.K);
  T* S = sm.S;
  const BlockTeam tm{z.bf16};
  const StateTile<T> st(sq_, z);
  st.load(tm, S, h0 != nullptr ? h0 + st.matrix(z.HV) : nullptr);
  for (int64_t i = 0; i < st.chunks; ++i) {
    int64_t slot, t0;
    int L;
    if (!st.chunk(sq_, i, slot, t0, L)) break;
    // this chunk's marks (the forward's), read early: nullptr unless it is not clean
    const unsigned char* marks = in.mark != nullptr ? in.mark + (st.hv * sq_.slots + slot) * mark_stride(z.V) : nullptr;
    const bool dirty = marks != nullptr && marks[z.V] < L;
    if (starts != nullptr) st.store(tm, S, starts + (st.hv * sq_.slots + slot) * st.K * z.V);
    const int64_t row = st.hv * sq_.tokens + t0;
    sm.stage_chunk(tm, in, row, L, st.K);
    stage(tm, sm.tile, in.Ut + row * z.V + st.j0, z.V, L, st.Vt);
    tm.sync();
    chunk_state_fwd(tm, ChunkDims{L, st.K, st.Vt}, scale, sm.W, sm.tile, st.Vt, sm.Qg, sm.Kd, sm.Aqk,
                    in.gC + (st.hv * sq_.slots + slot) * st.K, S, st.Vt, sm.U,
                    o != nullptr ? o + (t0 * z.HV + st.hv) * z.V + st.j0 : nullptr, static_cast<int>(z.HV * z.V),
                    dirty ? marks + st.j0 : nullptr);
  }
  if (ht != nullptr) st.store(tm, S, ht + st.matrix(z.HV));
}

// Backward state passing: end-state gradient of every chunk into dends [HV, slots, st.K, V], the
// initial state's gradient into dh0.
template <typename T>
__global__ void __launch_bounds__(kThreads) state_bwd_kernel(Seqs sq_, Sizes<T> z, T scale, Intra<T> in,
                                                             const T* __restrict__ dO, const T* __restrict__ dht,
                                                             T* dends, T* dh0) {
  extern __shared__ unsigned char smem_raw[];
  const StateSmem<T> sm(reinterpret_cast<T*>(smem_raw), z.K);
  T* dS = sm.S;
  const BlockTeam tm{z.bf16};
  const StateTile<T> st(sq_, z);
  st.load(tm, dS, dht != nullptr ? dht + st.matrix(z.HV) : nullptr);
  for (int64_t i = st.chunks - 1; i >= 0; --i) {
    int64_t slot, t0;
    int L;
    if (!st.chunk(sq_, i, slot, t0, L)) continue;
    st.store(tm, dS, dends + (st.hv * sq_.slots + slot) * st.K * z.V);
    const int64_t row = st.hv * sq_.tokens + t0;
    sm.stage_chunk(tm, in, row, L, st.K);
    stage(tm, sm.tile, dO + (t0 * z.HV + st.hv) * z.V + st.j0, z.HV * z.V, L, st.Vt);
    tm.sync();
    chunk_state_bwd(tm, ChunkDims{L, st.K, st.Vt}, scale, sm.W, sm.Qg, sm.Kd, sm.Aqk, in.gC + (st.hv * sq_.slots + slot) * st.K,
                    sm.tile, st.Vt, dS, st.Vt, sm.U);
  }
  st.store(tm, dS, dh0 + st.matrix(z.HV));
}

// The bf16-operand state passes (bf16-product mode, the precision of flash-linear-attention's
// chunk_kda; K 64 or 128, V a multiple of 64): one block of 8 warps per (64-column value tile,
// value head, sequence), like the generic state kernels, with the state (or its gradient) tile
// [kK, 64] in fp32 registers: warp w holds rows 16 (w % kK/16).. and its share of the columns.
// The chunk's terms come from the intra kernels' workspaces (Ws): fp32 ones are staged by
// cp.async while the previous chunk computes and rounded to one set of bf16 tiles
// (ldmatrix-friendly rows); bf16 ones are copied straight into two sets of tiles used in turn.
// The products run as m16n8k16 MMAs with fp32 accumulation; [L, 64] results (U, O, dU) are
// split over the warps as 4 row tiles x 2 column halves. Rows of a short chunk beyond L are zero
// in every staged term.
template <int kK, typename Ws>
struct Bf16State {
  using bf16 = __nv_bfloat16;
  static constexpr bool kStaged = std::is_same_v<Ws, float>;  // fp32 terms, rounded per chunk
  static constexpr int kWarps = 8, kThreads = 32 * kWarps, kCols = kStateCols;
  static constexpr int kLdK = kK + 8;        // bf16 rows of W, Qg, Kd: an odd multiple of 16 bytes
  static constexpr int kLdC = kCols + 8;     // bf16 rows of the [*, 64] tiles (kChunk == kCols)
  static constexpr int kLdX = kCols + 4;     // fp32 staged rows of Ut / dO (no bank conflicts on reads)
  static constexpr int kRowTiles = kK / 16;  // 16-row tiles of the state
  static constexpr int kSTiles = kCols / 8 * kRowTiles / kWarps;  // 8-column tiles of the state per warp
  static constexpr int kSets = kStaged ? 1 : 2;
  static constexpr size_t kStageFloats = kStaged ? 3 * kChunk * kK + kChunk * kChunk + kChunk * kLdX : 0;
  static constexpr size_t kSetBf16 = 3 * kChunk * kLdK + 2 * kChunk * kLdC;
  static constexpr size_t kBf16 = kSets * kSetBf16 + kK * kLdC + kChunk * kLdC;
  static constexpr size_t bytes() { return kStageFloats * sizeof(float) + kBf16 * sizeof(bf16); }
  static_assert(kChunk == kCols && kK % 64 == 0 && kSTiles % 2 == 0, "tile shapes");

  // A chunk's bf16 tiles: W, Qg, Kd [kChunk, kK], Aqk [kChunk, kChunk], X (Ut or dO) [kChunk, 64].
  struct Tiles {
    bf16 *W, *Q, *Kd, *A, *X;
  };
  // fp32 staging (kStaged): W, Qg, Kd [kChunk, kK], Aqk [kChunk, kChunk], X [kChunk, kLdX].
  float *stW, *stQ, *stKd, *stA, *stX;
  bf16 *sets, *bS, *bU;  // the tile sets; the state S [kK, 64] and the [L, 64] product U (or dU)
  int warp, g, q, rs, cs0, ru, cu0;

  __device__ explicit Bf16State(unsigned char* smem)
      : stW(reinterpret_cast<float*>(smem)), stQ(stW + kChunk * kK), stKd(stQ + kChunk * kK),
        stA(stKd + kChunk * kK), stX(stA + kChunk * kChunk),
        sets(reinterpret_cast<bf16*>(smem + kStageFloats * sizeof(float))), bS(sets + kSets * kSetBf16),
        bU(bS + kK * kLdC), warp(threadIdx.x / 32), g(threadIdx.x % 32 / 4), q(threadIdx.x % 4), rs(warp % kRowTiles),
        cs0(warp / kRowTiles * kSTiles), ru(warp % 4), cu0(warp / 4 * 4) {}
  // Tile set s (kStaged: the one set whatever s).
  __device__ Tiles set(int s) const {
    bf16* b = sets + (kStaged ? 0 : s) * kSetBf16;
    return Tiles{b, b + kChunk * kLdK, b + 2 * kChunk * kLdK, b + 3 * kChunk * kLdK, b + 3 * kChunk * kLdK + kChunk * kLdC};
  }

  // Element r of this thread's fragment j: state row / column, [L, 64] row / column.
  __device__ int srow(int r) const { return 16 * rs + g + 8 * (r / 2); }
  __device__ int scol(int j, int r) const { return 8 * (cs0 + j) + 2 * q + r % 2; }
  __device__ int urow(int r) const { return 16 * ru + g + 8 * (r / 2); }
  __device__ int ucol(int j, int r) const { return 8 * (cu0 + j) + 2 * q + r % 2; }

  // The state tile from / to a [kK, V] matrix at m (columns j0..; nullptr: zeros / nothing).
  __device__ void load_state(float (&S)[kSTiles][4], const float* m, int64_t V, int j0) const {
#pragma unroll
    for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) S[j][r] = m != nullptr ? m[srow(r) * V + j0 + scol(j, r)] : 0.f;
    }
  }
  __device__ void store_state(const float (&S)[kSTiles][4], float* m, int64_t V, int j0) const {
    if (m == nullptr) return;
#pragma unroll
    for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) m[srow(r) * V + j0 + scol(j, r)] = S[j][r];
    }
  }
  // A chunk's start state (or its end state's gradient) for the chunk backward, in the terms' type:
  // fp32 from the registers (save_early, before the chunk's products), or bf16 as round_state left
  // it in bS (save_rounded, after the barrier that follows round_state): the operand the chunk
  // backward takes, written in whole 16-byte rows.
  __device__ void save_early(const float (&S)[kSTiles][4], Ws* m, int64_t V, int j0) const {
    if constexpr (kStaged) store_state(S, m, V, j0);
  }
  __device__ void save_rounded(Ws* m, int64_t V, int j0) const {
    if constexpr (!kStaged) {
      if (m == nullptr) return;
      for (int i = threadIdx.x; i < kK * (kCols / 8); i += kThreads) {
        const int r = i / (kCols / 8), c = i % (kCols / 8) * 8;
        *reinterpret_cast<uint4*>(m + r * V + j0 + c) = *reinterpret_cast<const uint4*>(bS + r * kLdC + c);
      }
    }
  }

  // The chunk at workspace row `row` (L steps): into the staging area (kStaged) or into tile set
  // s; X's rows (Ut or dO, 64 columns) at x + t * ldx.
  __device__ void stage(const Intra<Ws>& in, int64_t row, int L, const Ws* x, int64_t ldx, int s) const {
    if constexpr (kStaged) {
      copy_rows_async<kThreads, kK, kK>(stW, in.W + row * kK, kK, L);
      copy_rows_async<kThreads, kK, kK>(stQ, in.Qg + row * kK, kK, L);
      copy_rows_async<kThreads, kK, kK>(stKd, in.Kd + row * kK, kK, L);
      copy_rows_async<kThreads, kChunk, kChunk>(stA, in.Aqk + row * kChunk, kChunk, L);
      copy_rows_async<kThreads, kCols, kLdX>(stX, x, ldx, L);
    } else {
      const Tiles d = set(s);
      copy_rows_async<kThreads, kK, kLdK>(d.W, in.W + row * kK, kK, L);
      copy_rows_async<kThreads, kK, kLdK>(d.Q, in.Qg + row * kK, kK, L);
      copy_rows_async<kThreads, kK, kLdK>(d.Kd, in.Kd + row * kK, kK, L);
      copy_rows_async<kThreads, kChunk, kLdC>(d.A, in.Aqk + row * kChunk, kChunk, L);
      copy_rows_async<kThreads, kCols, kLdC>(d.X, x, ldx, L);
    }
    mma::cp_async_commit();
  }

  // rows x cols of fp32 (leading dim ld_src) times `factor` -> bf16 (leading dim ld_dst).
  __device__ static void round_tile(bf16* d, int ld_dst, const float* src, int ld_src, int rows, int cols,
                                    float factor) {
    for (int i = threadIdx.x; i < rows * (cols / 4); i += kThreads) {
      const int t = i / (cols / 4), c = i % (cols / 4) * 4;
      const float4 x = *reinterpret_cast<const float4*>(src + t * ld_src + c);
      uint2 packed;
      packed.x = mma::pack2<bf16>(factor * x.x, factor * x.y);
      packed.y = mma::pack2<bf16>(factor * x.z, factor * x.w);
      *reinterpret_cast<uint2*>(d + t * ld_dst + c) = packed;
    }
  }
  // The staged terms (kStaged) as bf16 tiles; the fp32 intra kernel leaves Aqk's columns from L
  // on unwritten: they are zeroed here.
  __device__ void round_chunk(int L, float w_factor, float q_factor, float a_factor) const {
    const Tiles d = set(0);
    round_tile(d.W, kLdK, stW, kK, kChunk, kK, w_factor);
    round_tile(d.Q, kLdK, stQ, kK, kChunk, kK, q_factor);
    round_tile(d.Kd, kLdK, stKd, kK, kChunk, kK, 1.f);
    for (int e = threadIdx.x; e < kChunk * kChunk / 2; e += kThreads) {
      const int t = e / (kChunk / 2), c = e % (kChunk / 2) * 2;
      const float2 x = *reinterpret_cast<const float2*>(stA + t * kChunk + c);
      *reinterpret_cast<uint32_t*>(d.A + t * kLdC + c) =
          mma::pack2<bf16>(c < L ? a_factor * x.x : 0.f, c + 1 < L ? a_factor * x.y : 0.f);
    }
  }
  // The state tile as the bf16 B operand [kK, 64].
  __device__ void round_state(const float (&S)[kSTiles][4]) const {
#pragma unroll
    for (int j = 0; j < kSTiles; ++j) {
      *reinterpret_cast<uint32_t*>(bS + srow(0) * kLdC + scol(j, 0)) = mma::pack2<bf16>(S[j][0], S[j][1]);
      *reinterpret_cast<uint32_t*>(bS + srow(2) * kLdC + scol(j, 2)) = mma::pack2<bf16>(S[j][2], S[j][3]);
    }
  }
  // An [L, 64] fragment set times `factor` into the bf16 tile bU.
  __device__ void round_u(const float (&u)[4][4], float factor = 1.f) const {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      *reinterpret_cast<uint32_t*>(bU + urow(0) * kLdC + ucol(j, 0)) =
          mma::pack2<bf16>(factor * u[j][0], factor * u[j][1]);
      *reinterpret_cast<uint32_t*>(bU + urow(2) * kLdC + ucol(j, 2)) =
          mma::pack2<bf16>(factor * u[j][2], factor * u[j][3]);
    }
  }
  // acc (this warp's [L, 64] fragments) += A B over k blocks [kk0, kk1): A rows 16 ru.. of a
  // [*, ld_a] row-major tile (or of the transpose of one when kTransA), B [*, 64] row-major.
  template <bool kTransA>
  __device__ void mul_u(float (&acc)[4][4], const bf16* a_tile, int ld_a, const bf16* b_tile, int kk0,
                        int kk1) const {
    warp_tile_product<kTransA, false>(acc, a_tile, ld_a, b_tile, kLdC, ru, 8 * cu0, kCols, kk0, kk1);
  }
  // S (this warp's state fragments) += X^T Y over the chunk's steps: X [kChunk, kK] (ld kLdK),
  // Y [kChunk, 64].
  __device__ void mul_state(float (&S)[kSTiles][4], const bf16* x, const bf16* y) const {
#pragma unroll
    for (int kk = 0; kk < kChunk / 16; ++kk) {
      uint32_t a[4];
      mma::load_a_trans(a, x, kLdK, 16 * rs, 16 * kk);
#pragma unroll
      for (int p = 0; p < kSTiles / 2; ++p) {
        uint32_t b[4];
        mma::load_b_kn(b, y, kLdC, 8 * cs0 + 16 * p, 16 * kk);
        mma::mma_16816_x2<bf16>(S[2 * p], S[2 * p + 1], a, b);
      }
    }
  }
  // The chunk's decay gC of this thread's state rows (read with the chunk's tiles).
  __device__ float2 row_decay(const float* gc) const { return make_float2(gc[srow(0)], gc[srow(2)]); }
  __device__ void scale_state_rows(float (&S)[kSTiles][4], float2 decay) const {
    const float g0 = decay.x, g1 = decay.y;
#pragma unroll
    for (int j = 0; j < kSTiles; ++j) {
      S[j][0] *= g0;
      S[j][1] *= g0;
      S[j][2] *= g1;
      S[j][3] *= g1;
    }
  }
};

// The forward's O goes through shared memory (over the chunk's spent W and Qg tiles) in rows of
// kLdO<O>, then to o (rows t0.. of value head hv, columns j0..) in 16-byte pieces of whole rows.
template <typename O>
constexpr int kLdO = kStateCols + 16 / sizeof(O);
template <int kThreads, typename O>
__device__ void store_o_rows(O* o, const O* sO, int64_t t0, int L, int64_t HV, int64_t hv, int64_t V, int j0) {
  constexpr int kPieces = kStateCols * sizeof(O) / 16;
  for (int i = threadIdx.x; i < L * kPieces; i += kThreads) {
    const int t = i / kPieces, c = i % kPieces * (16 / sizeof(O));
    *reinterpret_cast<uint4*>(o + ((t0 + t) * HV + hv) * V + j0 + c) = *reinterpret_cast<const uint4*>(sO + t * kLdO<O> + c);
  }
}

// Forward: U = Ut - W S, O = scale (Qg S + Aqk U), S <- diag(gC) S + Kd^T U; o (element type O),
// ht, starts as for state_fwd_kernel.
template <int kK, typename Ws, typename O>
__global__ void __launch_bounds__(Bf16State<kK, Ws>::kThreads) state_fwd_bf16_kernel(
    Seqs sq_, Sizes<float> z, float scale, Intra<Ws> in, const float* __restrict__ h0, O* o, float* ht,
    Ws* starts) {
  using F = Bf16State<kK, Ws>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const F sm(smem_raw);
  const StateTile<float> st(sq_, z);
  const int64_t V = z.V;
  float S[F::kSTiles][4];
  sm.load_state(S, h0 != nullptr ? h0 + st.matrix(z.HV) : nullptr, V, st.j0);
  // The staged chunk's decay (gC of this thread's rows) and first non-finite step (the forward's
  // marks), read with its tiles: a chunk before their use.
  float2 next_decay{};
  int next_marked = 0;
  auto stage = [&](int64_t i) {
    int64_t slot, t0;
    int L;
    if (i < st.chunks && st.chunk(sq_, i, slot, t0, L)) {
      const int64_t row = st.hv * sq_.tokens + t0;
      sm.stage(in, row, L, in.Ut + row * V + st.j0, V, static_cast<int>(i % 2));
      next_decay = sm.row_decay(in.gC + (st.hv * sq_.slots + slot) * kK);
      next_marked = st.first_marked(sq_, in.mark, slot, L);
    }
  };
  stage(0);
  for (int64_t i = 0; i < st.chunks; ++i) {
    int64_t slot, t0;
    int L;
    if (!st.chunk(sq_, i, slot, t0, L)) break;
    const unsigned char* marks = st.marks(sq_, in.mark, slot);
    const int first_marked = next_marked;
    const float2 decay = next_decay;
    Ws* start = starts != nullptr ? starts + (st.hv * sq_.slots + slot) * kK * V : nullptr;
    sm.save_early(S, start, V, st.j0);
    mma::cp_async_wait<0>();
    __syncthreads();
    const typename F::Tiles cur = sm.set(static_cast<int>(i % 2));
    if constexpr (F::kStaged) sm.round_chunk(L, 1.f, 1.f, 1.f);
    sm.round_state(S);
    float u[4][4], acc_o[4][4], ut[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        u[j][r] = 0.f;
        acc_o[j][r] = 0.f;
        if constexpr (F::kStaged) {
          ut[j][r] = sm.stX[sm.urow(r) * F::kLdX + sm.ucol(j, r)];
        } else {
          ut[j][r] = to_float(cur.X[sm.urow(r) * F::kLdC + sm.ucol(j, r)]);
        }
      }
    }
    __syncthreads();  // the staging area is free, the bf16 tiles are complete
    sm.save_rounded(start, V, st.j0);
    stage(i + 1);
    sm.template mul_u<false>(u, cur.W, F::kLdK, sm.bS, 0, kK / 16);
    sm.template mul_u<false>(acc_o, cur.Q, F::kLdK, sm.bS, 0, kK / 16);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) u[j][r] = ut[j][r] - u[j][r];
    }
    sm.round_u(u);
    __syncthreads();
    sm.template mul_u<false>(acc_o, cur.A, F::kLdC, sm.bU, 0, sm.ru + 1);  // Aqk is zero above the diagonal
    const unsigned char* mark = first_marked < L ? marks + st.j0 : nullptr;  // nullptr: the chunk is clean
    const auto marked = [&](float x, int t, int col) { return mark != nullptr && t >= mark[col] ? NAN : x; };
    // O into shared memory over W and Qg (spent since the barrier above), out in whole rows after
    // the chunk's last barrier.
    O* sO = reinterpret_cast<O*>(cur.W);
    static_assert(kChunk * kLdO<O> * sizeof(O) <= 2 * kChunk * F::kLdK * sizeof(__nv_bfloat16), "O over W and Qg");
    if (o != nullptr) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int t = sm.urow(2 * h), col = sm.ucol(j, 2 * h);
          mma::store_pair(sO + t * kLdO<O> + col, marked(scale * acc_o[j][2 * h], t, col),
                          marked(scale * acc_o[j][2 * h + 1], t, col + 1));
        }
      }
    }
    sm.scale_state_rows(S, decay);
    sm.mul_state(S, cur.Kd, sm.bU);
#pragma unroll
    for (int j = 0; j < F::kSTiles; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) S[j][r] = marked(S[j][r], L - 1, sm.scol(j, r));  // NaN where the last step is
    }
    __syncthreads();  // every read of this chunk's tiles is done before the next chunk rewrites them
    // O out before the next chunk's first barrier
    if (o != nullptr) store_o_rows<F::kThreads>(o, sO, t0, L, z.HV, st.hv, V, st.j0);
  }
  mma::cp_async_wait<0>();
  sm.store_state(S, ht != nullptr ? ht + st.matrix(z.HV) : nullptr, V, st.j0);
}

// Backward, chunks in reverse, dS the gradient of the chunk's end state (stored into dends):
// dU = scale Aqk^T dO + Kd dS, dS <- diag(gC) dS + scale Qg^T dO - W^T dU; the initial state's
// gradient into dh0. With fp32 terms (staged) the factor scale rides on the rounding of Aqk and
// Qg; with bf16 terms dO comes as scale dO in bf16. -1 rides on the rounding of dU.
template <int kK, typename Ws>
__global__ void __launch_bounds__(Bf16State<kK, Ws>::kThreads) state_bwd_bf16_kernel(
    Seqs sq_, Sizes<float> z, float scale, Intra<Ws> in, const Ws* __restrict__ dO, const float* __restrict__ dht,
    Ws* dends, float* dh0) {
  using F = Bf16State<kK, Ws>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const F sm(smem_raw);
  const StateTile<float> st(sq_, z);
  const int64_t V = z.V;
  float dS[F::kSTiles][4];
  sm.load_state(dS, dht != nullptr ? dht + st.matrix(z.HV) : nullptr, V, st.j0);
  float2 next_decay{};  // the staged chunk's gC (this thread's rows), read with its tiles
  auto stage = [&](int64_t i) {
    int64_t slot, t0;
    int L;
    if (i >= 0 && st.chunk(sq_, i, slot, t0, L)) {
      sm.stage(in, st.hv * sq_.tokens + t0, L, dO + (t0 * z.HV + st.hv) * V + st.j0, z.HV * V,
               static_cast<int>(i % 2));
      next_decay = sm.row_decay(in.gC + (st.hv * sq_.slots + slot) * kK);
    }
  };
  stage(st.chunks - 1);
  for (int64_t i = st.chunks - 1; i >= 0; --i) {
    int64_t slot, t0;
    int L;
    if (!st.chunk(sq_, i, slot, t0, L)) {
      stage(i - 1);  // keep one staged chunk in flight, as the generic kernel skips this one
      continue;
    }
    Ws* dend = dends + (st.hv * sq_.slots + slot) * kK * V;
    const float2 decay = next_decay;
    sm.save_early(dS, dend, V, st.j0);
    mma::cp_async_wait<0>();
    __syncthreads();
    const typename F::Tiles cur = sm.set(static_cast<int>(i % 2));
    if constexpr (F::kStaged) {
      sm.round_chunk(L, 1.f, scale, scale);
      F::round_tile(cur.X, F::kLdC, sm.stX, F::kLdX, kChunk, kChunk, 1.f);
    }
    sm.round_state(dS);
    __syncthreads();
    sm.save_rounded(dend, V, st.j0);
    stage(i - 1);
    float du[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) du[j][r] = 0.f;
    }
    sm.template mul_u<true>(du, cur.A, F::kLdC, cur.X, sm.ru, kChunk / 16);  // (Aqk^T)_ts is zero for s < t
    sm.template mul_u<false>(du, cur.Kd, F::kLdK, sm.bS, 0, kK / 16);
    sm.round_u(du, -1.f);
    __syncthreads();
    sm.scale_state_rows(dS, decay);
    sm.mul_state(dS, cur.Q, cur.X);
    sm.mul_state(dS, cur.W, sm.bU);
    __syncthreads();
  }
  mma::cp_async_wait<0>();
  sm.store_state(dS, dh0 + st.matrix(z.HV), V, st.j0);
}

// The state passes on bf16 workspaces at K 128 with Hopper's wgmma: two warpgroups, each operand
// read from shared memory once per product (mma.sync reads the state tile once per warp). The
// chunk's terms arrive in 128-byte-swizzled [64, 64] chunks (the layout sw128_descriptor reads:
// K-major, or M-major for a transposed A), by TMA from one thread in the forward, by cp.async in
// the backward, kSets sets used in turn; the
// state S [128, 64] (or its gradient) lives in the warpgroups' accumulators (warpgroup w rows
// 64 w..) and goes to shared memory as the bf16 B operand (M/N-major) once a chunk, U (or dU)
// likewise.
//   forward   warpgroup 0: U = Ut - W S, into bU     warpgroup 1: O = scale (Qg S + Aqk U)
//             both: S[64 w.., :] <- diag(gC) S + (Kd^T U)[64 w.., :]
//   backward  warpgroup 0: -dU = -(Aqk^T dO + Kd dS), into bU (dO pre-scaled, swizzled as a B operand)
//             both: dS[64 w.., :] <- diag(gC) dS + (Qg^T dO - W^T dU)[64 w.., :]

// The forward wgmma pass's TMA maps over the bf16 workspaces (rows [HV tokens, width], [64, 64]
// boxes, 128-byte swizzle): W, Qg, Kd, Aqk, Ut.
struct WgMaps {
  CUtensorMap W, Q, Kd, A, X;
};

template <int kSetCount>
struct WgState {
  using bf16 = __nv_bfloat16;
  static constexpr int kK = 128, kThreads = 256, kCols = kStateCols;
  static constexpr int kChunkBytes = kChunk * 128;           // one swizzled [64, 64] chunk
  static constexpr int kTermBytes = (kK / 64) * kChunkBytes;  // W, Qg, Kd
  static constexpr int kMarkAt = 3 * kTermBytes + 2 * kChunkBytes;  // after W, Qg, Kd, Aqk, X: the marks row
  static constexpr int kSetBytes = (kMarkAt + static_cast<int>(mark_stride(kMaxHeadDim)) + 1023) / 1024 * 1024;
  static constexpr int kSBytes = kK * 128, kUBytes = kChunk * 128;
  static constexpr int kSets = kSetCount;
  static constexpr size_t bytes() { return 1024 + kSets * kSetBytes + kSBytes + kUBytes + 8 * kSets; }
  static_assert(kChunk == 64 && kCols == 64, "tile shapes");

  struct Tiles {
    unsigned char *W, *Q, *Kd, *A, *X;
    const unsigned char* M;
  };
  // 1024-aligned, by pointer arithmetic on the shared array (through an integer the compiler would
  // lose the address space and read shared memory with generic loads)
  unsigned char* base;
  unsigned char *bS, *bU;
  uint64_t* bars;  // the forward's: set s's TMA copies land on bars[s]
  int wg, q, r0;  // warpgroup; this thread's column pair q; its rows r0, r0 + 8 of the warpgroup's [64, *] tiles

  __device__ explicit WgState(unsigned char* smem)
      : base(smem + (1024 - sm90::smem_addr(smem) % 1024) % 1024),
        bS(base + kSets * kSetBytes), bU(bS + kSBytes), bars(reinterpret_cast<uint64_t*>(bU + kUBytes)),
        wg(threadIdx.x / 128), q(threadIdx.x % 4),
        r0(threadIdx.x % 128 / 32 * 16 + threadIdx.x % 32 / 4) {}
  __device__ Tiles set(int s) const {
    unsigned char* b = base + s * kSetBytes;
    return Tiles{b, b + kTermBytes, b + 2 * kTermBytes, b + 3 * kTermBytes, b + 3 * kTermBytes + kChunkBytes,
                 b + kMarkAt};
  }
  // Accumulator element e of a [64, 64] tile: row, column (the wgmma layout).
  __device__ int arow(int e) const { return r0 + 8 * (e % 4 / 2); }
  __device__ static int acol(int e, int q) { return 8 * (e / 4) + 2 * q + e % 2; }
  // Byte of element (r, c) in a swizzled tile of 64-element rows.
  __device__ static int sw_byte(int r, int c) { return sm90::sw128_offset(r, c / 8) + c % 8 * 2; }

  // A [kChunk, kCols] bf16 tile (rows at src + t * ld) into swizzled [64, 64] chunks at dst, zeros
  // from row L on; per thread pieces at constant distances, as copy_rows_async.
  template <int kC>
  __device__ static void copy_sw(unsigned char* dst, const bf16* src, int64_t ld, int L) {
    constexpr int kPieces = kC / 8, kRows = kThreads / kPieces;
    static_assert(kRows % 8 == 0 && kChunk % kRows == 0, "whole passes of whole swizzle groups");
    const int r = static_cast<int>(threadIdx.x) / kPieces, p = static_cast<int>(threadIdx.x) % kPieces;
    unsigned char* d = dst + p / 8 * kChunkBytes + sm90::sw128_offset(r, p % 8);
    const bf16* s = src + r * ld + p * 8;
#pragma unroll
    for (int j = 0; j < kChunk / kRows; ++j) mma::cp_async_16_zfill(d + j * kRows * 128, s + j * kRows * ld, r + j * kRows < L);
  }
  // The backward's chunk at workspace row `row` into set s by cp.async: W, Kd, Qg, Aqk and dO (rows
  // at x + t * ldx), zeros from row L on.
  __device__ void stage(const Intra<bf16>& in, int64_t row, int L, const bf16* x, int64_t ldx, int s) const {
    const Tiles d = set(s);
    copy_sw<kK>(d.W, in.W + row * kK, kK, L);
    copy_sw<kK>(d.Kd, in.Kd + row * kK, kK, L);
    copy_sw<kK>(d.Q, in.Qg + row * kK, kK, L);
    copy_sw<kChunk>(d.A, in.Aqk + row * kChunk, kChunk, L);
    copy_sw<kCols>(d.X, x, ldx, L);
  }
  // The forward's chunk at workspace row `row` into set s by TMA from one thread, onto bars[s]: W
  // and Kd, Qg and Aqk when with_qa, Ut's columns j0.. and the marks row of mark_bytes at marks
  // (nullptr: none). Rows past the chunk's end arrive too (the next sequence's, or zeros past the
  // workspace): the kernel zeroes Kd's and U's.
  __device__ void stage_tma(const WgMaps& m, int row, int j0, int s, bool with_qa, const unsigned char* marks,
                            int mark_bytes) const {
    const Tiles d = set(s);
    uint64_t* bar = bars + s;
    sm90::mbar_arrive_expect_tx(bar, (with_qa ? 8 : 5) * kChunkBytes + (marks != nullptr ? mark_bytes : 0));
    for (int c = 0; c < kK / 64; ++c) {
      sm90::tma_load_2d(d.W + c * kChunkBytes, &m.W, bar, 64 * c, row);
      sm90::tma_load_2d(d.Kd + c * kChunkBytes, &m.Kd, bar, 64 * c, row);
      if (with_qa) sm90::tma_load_2d(d.Q + c * kChunkBytes, &m.Q, bar, 64 * c, row);
    }
    if (with_qa) sm90::tma_load_2d(d.A, &m.A, bar, 0, row);
    sm90::tma_load_2d(d.X, &m.X, bar, j0, row);
    if (marks != nullptr) sm90::bulk_load(const_cast<unsigned char*>(d.M), marks, mark_bytes, bar);
  }
  // Zeros in the rows from L on of the [kChunk, kK] swizzled term at t (whole 128-byte rows).
  __device__ static void zero_rows(unsigned char* t, int L) {
    const int pieces = (kChunk - L) * 8;  // per [64, 64] chunk
    for (int i = static_cast<int>(threadIdx.x); i < pieces * (kK / 64); i += kThreads) {
      *reinterpret_cast<uint4*>(t + i / pieces * kChunkBytes + L * 128 + i % pieces * 16) = uint4{};
    }
  }
  // The state in bS (bf16) to the [kK, V] matrix at m, columns j0.., in whole 16-byte rows.
  __device__ void save_state(bf16* m, int64_t V, int j0) const {
    for (int p = threadIdx.x; p < kK * 8; p += kThreads) {
      *reinterpret_cast<uint4*>(m + p / 8 * V + j0 + p % 8 * 8) = *reinterpret_cast<const uint4*>(bS + sm90::sw128_offset(p / 8, p % 8));
    }
  }
  // The accumulator state from / to a [kK, V] fp32 matrix at m (columns j0..; nullptr: zeros / nothing).
  __device__ void load_state(float (&S)[32], const float* m, int64_t V, int j0) const {
#pragma unroll
    for (int e = 0; e < 32; ++e) S[e] = m != nullptr ? m[(64 * wg + arow(e)) * V + j0 + acol(e, q)] : 0.f;
  }
  __device__ void store_state(const float (&S)[32], float* m, int64_t V, int j0) const {
    if (m == nullptr) return;
#pragma unroll
    for (int e = 0; e < 32; ++e) m[(64 * wg + arow(e)) * V + j0 + acol(e, q)] = S[e];
  }
  __device__ void scale_state(float (&S)[32], float2 decay) const {
#pragma unroll
    for (int e = 0; e < 32; ++e) S[e] *= e % 4 < 2 ? decay.x : decay.y;
  }
  // An accumulator tile (times factor) as bf16 into the swizzled tile t at rows row0.. (M/N-major
  // B), zeros in its rows from `rows` on.
  __device__ void put(unsigned char* t, int row0, const float (&a)[32], float factor = 1.f, int rows = kChunk) const {
#pragma unroll
    for (int e = 0; e < 32; e += 2) {
      *reinterpret_cast<uint32_t*>(t + sw_byte(row0 + arow(e), acol(e, q))) =
          arow(e) < rows ? mma::pack2<bf16>(factor * a[e], factor * a[e + 1]) : 0u;
    }
  }
  // acc += A B over kSteps k blocks of 16: A K-major in chunks of kChunkBytes (kTransA 0) or the
  // M-major [k, 64] rows of one chunk (kTransA 1); B the M/N-major [k, 64] rows at b. Returns with
  // at most kPending of this warpgroup's products in flight (acc is not to be read before a later
  // product's wait covers it).
  template <int kTransA, int kSteps, int kPending = 0>
  __device__ static void product(float (&acc)[32], const unsigned char* a, const unsigned char* b) {
    sm90::fence_accumulators(acc);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
      const uint32_t a_off = kTransA ? kk * 2048 : kk / 4 * kChunkBytes + kk % 4 * 32;
      sm90::wgmma_m64n64k16<bf16, kTransA, 1>(acc, sm90::sw128_descriptor(sm90::smem_addr(a) + a_off, kChunkBytes),
                                              sm90::sw128_descriptor(sm90::smem_addr(b) + kk * 2048, kChunkBytes));
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<kPending>();
    sm90::fence_accumulators(acc);
  }
};
// The forward stages each chunk two ahead, the backward one (three sets of the same size would fit
// there too; not measured).
using WgFwd = WgState<3>;
using WgBwd = WgState<2>;
static_assert(WgFwd::bytes() <= 227 * 1024 && WgBwd::bytes() <= 227 * 1024, "an SM's shared memory, one block");

template <typename O>
__global__ void __launch_bounds__(WgFwd::kThreads) state_fwd_wgmma_kernel(
    Seqs sq_, Sizes<float> z, float scale, Intra<__nv_bfloat16> in, const float* __restrict__ h0, O* o, float* ht,
    __nv_bfloat16* starts, const __grid_constant__ WgMaps maps) {
  using F = WgFwd;
  constexpr int kK = F::kK;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const F sm(smem_raw);
  const StateTile<float> st(sq_, z);
  const int64_t V = z.V;
  const bool with_o = o != nullptr;  // else only the states (the backward's start-state pass)
  const int srow0 = 64 * sm.wg;      // this warpgroup's state rows
  float S[32];
  sm.load_state(S, h0 != nullptr ? h0 + st.matrix(z.HV) : nullptr, V, st.j0);
  // The tiles and the marks row are staged kSets - 1 chunks ahead by TMA from thread 0, set s's
  // k-th chunk completing phase k of bars[s] (the marks read from global memory would stall each
  // chunk for a load); gC is read one chunk ahead.
  if (threadIdx.x == 0) {
    for (int s = 0; s < F::kSets; ++s) sm90::mbar_init(sm.bars + s, 1);
    sm90::mbar_init_fence();
  }
  __syncthreads();
  auto stage = [&](int64_t i) {
    int64_t slot, t0;
    int L;
    if (threadIdx.x == 0 && i < st.chunks && st.chunk(sq_, i, slot, t0, L)) {
      sm.stage_tma(maps, static_cast<int>(st.hv * sq_.tokens + t0), st.j0, static_cast<int>(i % F::kSets), with_o,
                   st.marks(sq_, in.mark, slot), static_cast<int>(mark_stride(V)));
    }
  };
  float2 next_decay{};
  auto peek = [&](int64_t i) {
    int64_t slot, t0;
    int L;
    if (i < st.chunks && st.chunk(sq_, i, slot, t0, L)) {
      const float* gc = in.gC + (st.hv * sq_.slots + slot) * kK + srow0;
      next_decay = make_float2(gc[sm.arow(0)], gc[sm.arow(2)]);
    }
  };
  for (int i = 0; i < F::kSets - 1; ++i) stage(i);
  peek(0);
  for (int64_t i = 0; i < st.chunks; ++i) {
    int64_t slot, t0;
    int L;
    if (!st.chunk(sq_, i, slot, t0, L)) break;
    const float2 decay = next_decay;
    sm90::mbar_wait(sm.bars + i % F::kSets, static_cast<uint32_t>(i / F::kSets) & 1);
    const F::Tiles cur = sm.set(static_cast<int>(i % F::kSets));
    const int first_marked = in.mark != nullptr ? cur.M[V] : L;
    if (L < kChunk) F::zero_rows(cur.Kd, L);  // past the chunk's end (U's rows there are zeros too)
    sm.put(sm.bS, srow0, S);
    sm90::fence_proxy_async();  // bS and Kd are read by wgmma; O's writes over W precede the next copies there
    __syncthreads();  // bS complete; the previous chunk's set is free
    if (starts != nullptr) sm.save_state(starts + (st.hv * sq_.slots + slot) * kK * V, V, st.j0);
    stage(i + F::kSets - 1);
    peek(i + 1);
    float acc[32];
#pragma unroll
    for (int e = 0; e < 32; ++e) acc[e] = 0.f;
    if (sm.wg == 0) {
      F::product<0, kK / 16>(acc, cur.W, sm.bS);
#pragma unroll
      for (int e = 0; e < 32; ++e) {
        acc[e] = to_float(*reinterpret_cast<const __nv_bfloat16*>(cur.X + F::sw_byte(sm.arow(e), F::acol(e, sm.q)))) - acc[e];
      }
      sm.put(sm.bU, 0, acc, 1.f, L);
      sm90::fence_proxy_async();
    } else if (with_o) {
      F::product<0, kK / 16>(acc, cur.Q, sm.bS);
    }
    __syncthreads();  // bU complete
    sm.scale_state(S, decay);
    const unsigned char* kd = cur.Kd + sm.wg * F::kChunkBytes;
    if (sm.wg == 1 && with_o) {  // Aqk U in flight beside Kd^T U
      F::product<0, kChunk / 16, 1>(acc, cur.A, sm.bU);
      F::product<1, kChunk / 16>(S, kd, sm.bU);
      sm90::fence_accumulators(acc);
    } else {
      F::product<1, kChunk / 16>(S, kd, sm.bU);
    }
    const unsigned char* mark = first_marked < L ? cur.M + st.j0 : nullptr;  // nullptr: the chunk is clean
    const auto marked = [&](float x, int t, int col) { return mark != nullptr && t >= mark[col] ? NAN : x; };
    // O into shared memory over W and Qg (their products are done), out in whole rows after the
    // chunk's last barrier.
    O* sO = reinterpret_cast<O*>(cur.W);
    static_assert(kChunk * kLdO<O> * sizeof(O) <= 2 * F::kTermBytes, "O over W and Qg");
    if (sm.wg == 1 && with_o) {
#pragma unroll
      for (int e = 0; e < 32; e += 2) {
        const int t = sm.arow(e), col = F::acol(e, sm.q);
        mma::store_pair(sO + t * kLdO<O> + col, marked(scale * acc[e], t, col), marked(scale * acc[e + 1], t, col + 1));
      }
    }
#pragma unroll
    for (int e = 0; e < 32; ++e) S[e] = marked(S[e], L - 1, F::acol(e, sm.q));  // NaN where the last step is
    __syncthreads();  // every read of this chunk's tiles is done before the next chunk rewrites them
    // O out before the next chunk's first barrier
    if (with_o) store_o_rows<F::kThreads>(o, sO, t0, L, z.HV, st.hv, V, st.j0);
  }
  sm.store_state(S, ht != nullptr ? ht + st.matrix(z.HV) : nullptr, V, st.j0);
}

// The backward state pass at K 128 on wgmma (chunks in reverse; WgState above).
__global__ void __launch_bounds__(WgBwd::kThreads) state_bwd_wgmma_kernel(
    Seqs sq_, Sizes<float> z, Intra<__nv_bfloat16> in, const __nv_bfloat16* __restrict__ dO,
    const float* __restrict__ dht, __nv_bfloat16* dends, float* dh0) {
  using F = WgBwd;
  constexpr int kK = F::kK;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const F sm(smem_raw);
  const StateTile<float> st(sq_, z);
  const int64_t V = z.V;
  float dS[32];
  sm.load_state(dS, dht != nullptr ? dht + st.matrix(z.HV) : nullptr, V, st.j0);
  float2 next_decay{};  // the staged chunk's gC (this thread's rows), read with its tiles
  auto stage = [&](int64_t i) {
    int64_t slot, t0;
    int L;
    if (i >= 0 && st.chunk(sq_, i, slot, t0, L)) {
      sm.stage(in, st.hv * sq_.tokens + t0, L, dO + (t0 * z.HV + st.hv) * V + st.j0, z.HV * V,
               static_cast<int>(i % F::kSets));
      const float* gc = in.gC + (st.hv * sq_.slots + slot) * kK + 64 * sm.wg;
      next_decay = make_float2(gc[sm.arow(0)], gc[sm.arow(2)]);
    }
    mma::cp_async_commit();
  };
  stage(st.chunks - 1);
  for (int64_t i = st.chunks - 1; i >= 0; --i) {
    int64_t slot, t0;
    int L;
    if (!st.chunk(sq_, i, slot, t0, L)) {
      __syncthreads();  // the chunk before may still be read
      stage(i - 1);     // keep one staged chunk in flight, as the generic kernel skips this one
      continue;
    }
    const float2 decay = next_decay;
    mma::cp_async_wait<0>();
    sm90::fence_proxy_async();  // the copies are read by wgmma
    __syncthreads();            // (and every read of the chunk before is done)
    const F::Tiles cur = sm.set(static_cast<int>(i % F::kSets));
    const unsigned char* tdO = cur.X;
    sm.put(sm.bS, 64 * sm.wg, dS);
    sm90::fence_proxy_async();
    __syncthreads();  // bS complete; the other set is free
    if (dends != nullptr) sm.save_state(dends + (st.hv * sq_.slots + slot) * kK * V, V, st.j0);
    stage(i - 1);
    sm.scale_state(dS, decay);
    if (sm.wg == 0) {
      float du[32];
#pragma unroll
      for (int e = 0; e < 32; ++e) du[e] = 0.f;
      F::product<1, kChunk / 16>(du, cur.A, tdO);  // Aqk^T dO ((Aqk^T)_ts is zero for s < t)
      F::product<0, kK / 16>(du, cur.Kd, sm.bS);   // + Kd dS
      sm.put(sm.bU, 0, du, -1.f);
      sm90::fence_proxy_async();
    }
    F::product<1, kChunk / 16>(dS, cur.Q + sm.wg * F::kChunkBytes, tdO);  // + Qg^T dO
    __syncthreads();  // bU complete
    F::product<1, kChunk / 16>(dS, cur.W + sm.wg * F::kChunkBytes, sm.bU);  // - W^T dU
  }
  mma::cp_async_wait<0>();
  sm.store_state(dS, dh0 != nullptr ? dh0 + st.matrix(z.HV) : nullptr, V, st.j0);
}

dim3 state_grid(const Problem& p) { return dim3(static_cast<unsigned>(ceil_div(p.V, int64_t{kStateCols})), p.HV, p.N); }

// A state pass on fp32 terms: its bf16-operand kernel in bf16-product mode where the head sizes
// fit its tiles, else the generic kernel (its products 3xTF32, or bf16 operands in bf16-product
// mode).
template <typename Generic, typename Bf16K128, typename Bf16K64, typename... Args>
void run_state_pass(const Problem& p, const Launch& l, Generic generic, Bf16K128 bf16_k128, Bf16K64 bf16_k64,
                    Args... args) {
  const Sizes<float> z{p.H, p.HV, p.K, p.V, p.bf16_products};
  const float scale = static_cast<float>(p.scale);
  const auto launch = [&](auto kernel, size_t smem, int threads) {
    set_smem(kernel, smem);
    kernel<<<state_grid(p), threads, smem, l.stream>>>(l.seqs, z, scale, args...);
  };
  const bool tiles = p.bf16_products && p.V % kStateCols == 0;
  if (tiles && p.K == 128) {
    launch(bf16_k128, Bf16State<128, float>::bytes(), Bf16State<128, float>::kThreads);
  } else if (tiles && p.K == 64) {
    launch(bf16_k64, Bf16State<64, float>::bytes(), Bf16State<64, float>::kThreads);
  } else {
    launch(generic, StateSmem<float>::bytes(p.K), kThreads);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void run_state_fwd(const Problem& p, const Launch& l, const Intra<float>& intra, const float* h0, float* o, float* ht,
                   float* starts) {
  run_state_pass(p, l, state_fwd_kernel<float>, state_fwd_bf16_kernel<128, float, float>,
                 state_fwd_bf16_kernel<64, float, float>, intra, h0, o, ht, starts);
}

void run_state_bwd(const Problem& p, const Launch& l, const Intra<float>& intra, const float* dO, const float* dht,
                   float* dends, float* dh0) {
  run_state_pass(p, l, state_bwd_kernel<float>, state_bwd_bf16_kernel<128, float>, state_bwd_bf16_kernel<64, float>,
                 intra, dO, dht, dends, dh0);
}

template <int kK, typename O>
void run_state_fwd_bf16(const Problem& p, const Launch& l, const Intra<__nv_bfloat16>& w, const Inputs& raw, O* o,
                        float* ht, __nv_bfloat16* starts) {
  const Sizes<float> z{p.H, p.HV, p.K, p.V, true};
  const float* h0 = raw.initial_state.defined() ? raw.initial_state.data_ptr<float>() : nullptr;
  if constexpr (kK == WgFwd::kK) {
    const int64_t rows = std::max<int64_t>(1, p.HV * l.seqs.tokens);  // (the workspaces hold one row at least)
    const auto map = [&](const __nv_bfloat16* ws, int64_t width, const char* name) {
      const at::Tensor t = at::from_blob(const_cast<__nv_bfloat16*>(ws), {rows, width}, raw.q.options().dtype(at::kBFloat16));
      return make_tensor_map_sw128<2>(t, {static_cast<uint64_t>(width), static_cast<uint64_t>(rows)},
                                      {static_cast<uint64_t>(width)}, {64, 64}, name);
    };
    const WgMaps maps{map(w.W, kK, "W"), map(w.Qg, kK, "Qg"), map(w.Kd, kK, "Kd"), map(w.Aqk, kChunk, "Aqk"),
                      map(w.Ut, p.V, "Ut")};
    set_smem(state_fwd_wgmma_kernel<O>, WgFwd::bytes());
    state_fwd_wgmma_kernel<O><<<state_grid(p), WgFwd::kThreads, WgFwd::bytes(), l.stream>>>(
        l.seqs, z, static_cast<float>(p.scale), w, h0, o, ht, starts, maps);
  } else {
    using F = Bf16State<kK, __nv_bfloat16>;
    set_smem(state_fwd_bf16_kernel<kK, __nv_bfloat16, O>, F::bytes());
    state_fwd_bf16_kernel<kK, __nv_bfloat16, O><<<state_grid(p), F::kThreads, F::bytes(), l.stream>>>(
        l.seqs, z, static_cast<float>(p.scale), w, h0, o, ht, starts);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int kK>
void run_state_bwd_bf16(const Problem& p, const Launch& l, const Intra<__nv_bfloat16>& w, const at::Tensor& dOs,
                        const float* dht, __nv_bfloat16* dends, float* dh0) {
  using bf16 = __nv_bfloat16;
  const Sizes<float> z{p.H, p.HV, p.K, p.V, true};
  const auto* dO = static_cast<const bf16*>(dOs.data_ptr());
  if constexpr (kK == WgBwd::kK) {
    set_smem(state_bwd_wgmma_kernel, WgBwd::bytes());
    state_bwd_wgmma_kernel<<<state_grid(p), WgBwd::kThreads, WgBwd::bytes(), l.stream>>>(l.seqs, z, w, dO, dht, dends,
                                                                                        dh0);
  } else {
    using F = Bf16State<kK, bf16>;
    set_smem(state_bwd_bf16_kernel<kK, bf16>, F::bytes());
    state_bwd_bf16_kernel<kK, bf16><<<state_grid(p), F::kThreads, F::bytes(), l.stream>>>(
        l.seqs, z, static_cast<float>(p.scale), w, dO, dht, dends, dh0);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

#define KDA_STATE_FWD_BF16(K, O)                                                                                 \
  template void run_state_fwd_bf16<K, O>(const Problem&, const Launch&, const Intra<__nv_bfloat16>&, const Inputs&, \
                                         O*, float*, __nv_bfloat16*);
KDA_STATE_FWD_BF16(64, __nv_bfloat16)
KDA_STATE_FWD_BF16(128, __nv_bfloat16)
KDA_STATE_FWD_BF16(64, __half)
KDA_STATE_FWD_BF16(128, __half)
KDA_STATE_FWD_BF16(64, float)
KDA_STATE_FWD_BF16(128, float)
#undef KDA_STATE_FWD_BF16
template void run_state_bwd_bf16<64>(const Problem&, const Launch&, const Intra<__nv_bfloat16>&, const at::Tensor&,
                                     const float*, __nv_bfloat16*, float*);
template void run_state_bwd_bf16<128>(const Problem&, const Launch&, const Intra<__nv_bfloat16>&, const at::Tensor&,
                                      const float*, __nv_bfloat16*, float*);

}  // namespace kda_dsa_ops::kda
