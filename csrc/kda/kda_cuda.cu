// KDA on CUDA: the chunked algorithm of kda_chunk.h run by thread blocks.
//   intra kernel       one block per (chunk, value head), all chunks at once: the state-free
//                      terms (A, Aqk, W, Ut, Qg, Kd, gC) into head-major workspaces.
//   state kernels      one block per (value-column tile, value head, sequence), chunks in order
//                      (backward: in reverse), the state tile in shared memory: outputs, the
//                      final state, and for the backward the start state and end-state gradient
//                      of every chunk.
//   chunk bwd kernel   one block per (chunk, value head): every gradient of the chunk.
//   bf16 state kernels the state passes in bf16-product mode (K 64 or 128, V % 64 == 0): the
//                      state (gradient) in fp32 registers, the products on bf16 operands
//                      (m16n8k16, fp32 accumulation), the next chunk staged while this one computes.
// No host synchronisation: with cu_seqlens each block finds its chunk from the device copy.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "common/device.cuh"
#include "common/mma.cuh"
#include "kda/kda.h"
#include "kda/kda_chunk.h"

namespace kda_dsa_ops::kda {

namespace {

constexpr int kThreads = 512;
constexpr int kStateCols = 64;  // state columns per block of the state kernels

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

// d += a b for one m16n8k8 tile with tf32 operands (fp32 accumulation).
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// x = hi + lo with hi, lo tf32: products of the parts recover fp32 accuracy (3 MMAs: hi hi,
// hi lo, lo hi; lo lo is below fp32 rounding).
template <int N>
__device__ __forceinline__ void split_tf32(const float (&x)[N], uint32_t (&hi)[N], uint32_t (&lo)[N]) {
  for (int i = 0; i < N; ++i) {
    hi[i] = to_tf32(x[i]);
    lo[i] = to_tf32(x[i] - __uint_as_float(hi[i]));
  }
}

// team_gemm's contract on the tensor cores: each warp computes a 16 x 8NB strip of C, operands
// read through the strided views (no layout requirement); the A fragment of a k-step is loaded
// and converted once for the NB column tiles of the strip, and each element of C sees the same
// MMAs in the same order whatever NB is. kBf16 (bf16-product mode): m16n8k16 MMAs on bf16
// operands, one per 16 x 8 x 16 block; else split-tf32 m16n8k8 MMAs, three per 16 x 8 x 8 block
// (fp32 accuracy). Both accumulate in fp32.
template <int NB, bool kBf16>
__device__ __forceinline__ void warp_gemm_strips(int M, int N, int Kn, float alpha, View<float> A, View<float> B,
                                                 Out<float> C, Prior<float> prior, const float* kscale) {
  using bf16 = __nv_bfloat16;
  constexpr int kStep = kBf16 ? 16 : 8;
  const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int mt = (M + 15) / 16, ns = (N + 8 * NB - 1) / (8 * NB);
  for (int strip = threadIdx.x / 32; strip < mt * ns; strip += blockDim.x / 32) {
    const int m0 = strip / ns * 16, n_first = strip % ns * 8 * NB;
    const int r0 = m0 + g, r1 = r0 + 8;
    float acc[NB][4];
#pragma unroll
    for (int j = 0; j < NB; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    for (int k0 = 0; k0 < Kn; k0 += kStep) {
      // This lane's reduction indices: bf16 k0 + 2q + {0, 1, 8, 9}; tf32 k0 + q + {0, 4}.
      constexpr int kIdx = kBf16 ? 4 : 2;
      int kc[kIdx];
      float ks[kIdx];
#pragma unroll
      for (int i = 0; i < kIdx; ++i) {
        kc[i] = kBf16 ? k0 + 2 * q + (i / 2) * 8 + i % 2 : k0 + q + 4 * i;
        ks[i] = kc[i] < Kn ? (kscale != nullptr ? kscale[kc[i]] : 1.f) : 0.f;
      }
      auto a_at = [&](int r, int i) { return r < M && ks[i] != 0.f ? A(r, kc[i]) * ks[i] : 0.f; };
      if constexpr (kBf16) {
        const uint32_t a[4] = {mma::pack2<bf16>(a_at(r0, 0), a_at(r0, 1)), mma::pack2<bf16>(a_at(r1, 0), a_at(r1, 1)),
                               mma::pack2<bf16>(a_at(r0, 2), a_at(r0, 3)), mma::pack2<bf16>(a_at(r1, 2), a_at(r1, 3))};
#pragma unroll
        for (int j = 0; j < NB; ++j) {
          const int cb = n_first + 8 * j + g;
          auto b_at = [&](int i) { return cb < N && kc[i] < Kn ? B(kc[i], cb) : 0.f; };
          mma::mma_16816<bf16>(acc[j], a, mma::pack2<bf16>(b_at(0), b_at(1)), mma::pack2<bf16>(b_at(2), b_at(3)));
        }
      } else {
        const float a[4] = {a_at(r0, 0), a_at(r1, 0), a_at(r0, 1), a_at(r1, 1)};
        uint32_t a_hi[4], a_lo[4];
        split_tf32(a, a_hi, a_lo);
#pragma unroll
        for (int j = 0; j < NB; ++j) {
          const int cb = n_first + 8 * j + g;
          const float b[2] = {cb < N && kc[0] < Kn ? B(kc[0], cb) : 0.f, cb < N && kc[1] < Kn ? B(kc[1], cb) : 0.f};
          uint32_t b_hi[2], b_lo[2];
          split_tf32(b, b_hi, b_lo);
          mma_tf32(acc[j], a_lo, b_hi);
          mma_tf32(acc[j], a_hi, b_lo);
          mma_tf32(acc[j], a_hi, b_hi);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < NB; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int m = m0 + g + 8 * (r / 2), n = n_first + 8 * j + 2 * q + r % 2;
        if (m < M && n < N) prior.store(C(m, n), alpha * acc[j][r], m, n);
      }
    }
  }
}

template <bool kBf16>
__device__ __forceinline__ void warp_gemm_of(int nb, int M, int N, int Kn, float alpha, View<float> A, View<float> B,
                                             Out<float> C, Prior<float> prior, const float* kscale) {
  if (nb == 4) {
    warp_gemm_strips<4, kBf16>(M, N, Kn, alpha, A, B, C, prior, kscale);
  } else if (nb == 2) {
    warp_gemm_strips<2, kBf16>(M, N, Kn, alpha, A, B, C, prior, kscale);
  } else {
    warp_gemm_strips<1, kBf16>(M, N, Kn, alpha, A, B, C, prior, kscale);
  }
}

// Strips as wide as keep every warp of the block busy (up to 4 column tiles).
__device__ __forceinline__ void warp_gemm(int M, int N, int Kn, float alpha, View<float> A, View<float> B, Out<float> C,
                                          Prior<float> prior, const float* kscale, bool bf16) {
  const int tiles = (M + 15) / 16 * ((N + 7) / 8), warps = static_cast<int>(blockDim.x / 32);
  const int nb = tiles >= 4 * warps ? 4 : tiles >= 2 * warps ? 2 : 1;
  if (bf16) {
    warp_gemm_of<true>(nb, M, N, Kn, alpha, A, B, C, prior, kscale);
  } else {
    warp_gemm_of<false>(nb, M, N, Kn, alpha, A, B, C, prior, kscale);
  }
}

// The CUDA kernels' team: the threads of a block, products on the tensor cores.
struct BlockTeam {
  bool bf16;  // products on bf16 operands (Problem::bf16_products)
  __device__ int rank() const { return static_cast<int>(threadIdx.x); }
  __device__ int size() const { return static_cast<int>(blockDim.x); }
  __device__ void sync() const { __syncthreads(); }
  __device__ void gemm(int M, int N, int Kn, float alpha, View<float> A, View<float> B, Out<float> C,
                       Prior<float> prior = Prior<float>{}, const float* kscale = nullptr) const {
    warp_gemm(M, N, Kn, alpha, A, B, C, prior, kscale, bf16);
  }
  __device__ float pair_exp(float x) const { return bf16 ? __expf(x) : expf(x); }
  __device__ void gemm_fp32(int M, int N, int Kn, float alpha, View<float> A, View<float> B, Out<float> C,
                            Prior<float> prior = Prior<float>{}, const float* kscale = nullptr) const {
    warp_gemm(M, N, Kn, alpha, A, B, C, prior, kscale, false);
  }
};

// The sequences of a call: rows of the batch, or the segments of cu_seqlens. Values of cu_seqlens
// that are not checked may be wrong: then chunks that fall outside [0, tokens) are skipped.
struct Seqs {
  const int32_t* cu;  // nullptr: N rows of T tokens
  int64_t N, T, tokens, slots;

  __device__ int64_t chunks_of(int64_t len) const { return len > 0 ? (len + kChunk - 1) / kChunk : 0; }
  __device__ void bounds(int64_t n, int64_t& bos, int64_t& len) const {
    if (cu == nullptr) {
      bos = n * T;
      len = T;
    } else {
      bos = cu[n];
      len = static_cast<int64_t>(cu[n + 1]) - cu[n];
    }
  }
  // First chunk slot of sequence n.
  __device__ int64_t first_slot(int64_t n) const {
    if (cu == nullptr) return n * chunks_of(T);
    int64_t base = 0;
    for (int64_t m = 0; m < n; ++m) base += chunks_of(static_cast<int64_t>(cu[m + 1]) - cu[m]);
    return base;
  }
  // Chunk `slot`: its first token t0 and length L; false for an unused slot.
  __device__ bool locate(int64_t slot, int64_t& t0, int& L) const {
    int64_t n = 0, i = slot;
    if (cu == nullptr) {
      const int64_t c = chunks_of(T);
      if (c == 0) return false;
      n = slot / c;
      i = slot % c;
      if (n >= N) return false;
    } else {
      for (; n < N; ++n) {
        const int64_t c = chunks_of(static_cast<int64_t>(cu[n + 1]) - cu[n]);
        if (i < c) break;
        i -= c;
      }
      if (n == N) return false;
    }
    int64_t bos, len;
    bounds(n, bos, len);
    t0 = bos + i * kChunk;
    L = static_cast<int>(len - i * kChunk < kChunk ? len - i * kChunk : kChunk);
    return true;
  }
  __device__ bool valid(int64_t slot, int64_t t0, int L) const {
    return slot < slots && t0 >= 0 && t0 + L <= tokens;
  }
};

// Head-major workspaces of the intra-chunk terms: row t of value head hv at (hv * tokens + t).
template <typename T>
struct Intra {
  T *A, *Minv;  // nullptr in the forward, which keeps them in shared memory
  T *Aqk, *W, *Ut, *Qg, *Kd, *gC;
};

template <typename T>
struct Sizes {
  int64_t H, HV, K, V;
  bool bf16;  // products on bf16 operands (Problem::bf16_products)
};

// Shared-memory copy of one chunk of one value head: q, k, G = hi + lo (cumulated), v, beta.
template <typename T>
struct ChunkSmem {
  T *q, *k, *G, *Glo, *v, *beta, *end;
  __device__ ChunkSmem(T* base, int64_t K, int64_t V)
      : q(base), k(q + kChunk * K), G(k + kChunk * K), Glo(G + kChunk * K), v(Glo + kChunk * K),
        beta(v + kChunk * V), end(beta + kChunk) {}
  __device__ Gates<T> gates() const { return {G, Glo}; }
  static size_t bytes(int64_t K, int64_t V) { return sizeof(T) * (4 * kChunk * K + kChunk * V + kChunk); }
};

// Load steps [t0, t0+L) of value head hv into shared memory.
template <typename T>
__device__ void load_chunk(const BlockTeam& tm, const Sizes<T>& z, ChunkDims d, int64_t t0, int64_t hv,
                           const T* q, const T* k, const T* v, const T* g, const T* beta, const ChunkSmem<T>& s) {
  T *sq = s.q, *sk = s.k, *sG = s.G, *sv = s.v, *sb = s.beta;
  const int64_t h = hv / (z.HV / z.H);
  for (int i = tm.rank(); i < d.L * d.K; i += tm.size()) {
    const int64_t t = t0 + i / d.K, c = i % d.K;
    sq[i] = q[(t * z.H + h) * z.K + c];
    sk[i] = k[(t * z.H + h) * z.K + c];
    sG[i] = g[(t * z.HV + hv) * z.K + c];
  }
  for (int i = tm.rank(); i < d.L * d.V; i += tm.size()) {
    sv[i] = v[((t0 + i / d.V) * z.HV + hv) * z.V + i % d.V];
  }
  for (int t = tm.rank(); t < d.L; t += tm.size()) sb[t] = beta[(t0 + t) * z.HV + hv];
  tm.sync();
  chunk_cumsum(tm, d, sG, s.Glo);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) intra_kernel(Seqs sq_, Sizes<T> z, const T* __restrict__ q,
                                                         const T* __restrict__ k, const T* __restrict__ v,
                                                         const T* __restrict__ g, const T* __restrict__ beta,
                                                         Intra<T> out) {
  extern __shared__ unsigned char smem_raw[];
  const ChunkSmem<T> sm(reinterpret_cast<T*>(smem_raw), z.K, z.V);
  T* sA = sm.end;                   // [kChunk, kChunk]
  T* sMinv = sA + kChunk * kChunk;  // [kChunk, kChunk]
  T* sY = sMinv + kChunk * kChunk;  // [intra_scratch(K)]
  const int64_t slot = blockIdx.x, hv = blockIdx.y;
  int64_t t0;
  int L;
  if (!sq_.locate(slot, t0, L) || !sq_.valid(slot, t0, L)) return;
  const BlockTeam tm{z.bf16};
  const ChunkDims d{L, static_cast<int>(z.K), static_cast<int>(z.V)};
  load_chunk(tm, z, d, t0, hv, q, k, v, g, beta, sm);
  const int64_t row = hv * sq_.tokens + t0;
  chunk_intra(tm, d, sm.q, sm.k, sm.gates(), sm.v, sm.beta, out.A != nullptr ? out.A + row * kChunk : sA,
              out.Aqk + row * kChunk, out.Minv != nullptr ? out.Minv + row * kChunk : sMinv,
              out.W + row * z.K, out.Ut + row * z.V, out.Qg + row * z.K, out.Kd + row * z.K,
              out.gC + (hv * sq_.slots + slot) * z.K, sY);
}

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
    if (starts != nullptr) st.store(tm, S, starts + (st.hv * sq_.slots + slot) * st.K * z.V);
    const int64_t row = st.hv * sq_.tokens + t0;
    sm.stage_chunk(tm, in, row, L, st.K);
    stage(tm, sm.tile, in.Ut + row * z.V + st.j0, z.V, L, st.Vt);
    tm.sync();
    chunk_state_fwd(tm, ChunkDims{L, st.K, st.Vt}, scale, sm.W, sm.tile, st.Vt, sm.Qg, sm.Kd, sm.Aqk,
                    in.gC + (st.hv * sq_.slots + slot) * st.K, S, st.Vt, sm.U,
                    o != nullptr ? o + (t0 * z.HV + st.hv) * z.V + st.j0 : nullptr, static_cast<int>(z.HV * z.V));
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
// Per chunk the fp32 terms of kda_chunk.h, staged by cp.async while the previous chunk computes,
// are rounded to bf16 tiles (ldmatrix-friendly rows), and the products run as m16n8k16 MMAs with
// fp32 accumulation; [L, 64] results (U, O, dU) are split over the warps as 4 row tiles x 2
// column halves. Rows of a short chunk beyond L are zero in every staged term.
template <int kK>
struct Bf16State {
  using bf16 = __nv_bfloat16;
  static constexpr int kWarps = 8, kThreads = 32 * kWarps, kCols = kStateCols;
  static constexpr int kLdK = kK + 8;        // bf16 rows of W, Qg, Kd: an odd multiple of 16 bytes
  static constexpr int kLdC = kCols + 8;     // bf16 rows of the [*, 64] tiles (kChunk == kCols)
  static constexpr int kLdX = kCols + 4;     // fp32 staged rows of Ut / dO (no bank conflicts on reads)
  static constexpr int kRowTiles = kK / 16;  // 16-row tiles of the state
  static constexpr int kSTiles = kCols / 8 * kRowTiles / kWarps;  // 8-column tiles of the state per warp
  static constexpr size_t kStageFloats = 3 * kChunk * kK + kChunk * kChunk + kChunk * kLdX;
  static constexpr size_t kBf16 = 3 * kChunk * kLdK + kK * kLdC + 3 * kChunk * kLdC;
  static constexpr size_t bytes() { return kStageFloats * sizeof(float) + kBf16 * sizeof(bf16); }
  static_assert(kChunk == kCols && kK % 64 == 0 && kSTiles % 2 == 0, "tile shapes");

  // fp32 staging: W, Qg, Kd [kChunk, kK], Aqk [kChunk, kChunk], X (Ut or dO) [kChunk, kLdX];
  // bf16 tiles: W, Qg, Kd, the state S [kK, 64], Aqk, X and the [L, 64] product U (or dU).
  float *stW, *stQ, *stKd, *stA, *stX;
  bf16 *bW, *bQ, *bKd, *bS, *bA, *bX, *bU;
  int warp, g, q, rs, cs0, ru, cu0;

  __device__ explicit Bf16State(unsigned char* smem)
      : stW(reinterpret_cast<float*>(smem)), stQ(stW + kChunk * kK), stKd(stQ + kChunk * kK),
        stA(stKd + kChunk * kK), stX(stA + kChunk * kChunk), bW(reinterpret_cast<bf16*>(stX + kChunk * kLdX)),
        bQ(bW + kChunk * kLdK), bKd(bQ + kChunk * kLdK), bS(bKd + kChunk * kLdK), bA(bS + kK * kLdC),
        bX(bA + kChunk * kLdC), bU(bX + kChunk * kLdC), warp(threadIdx.x / 32), g(threadIdx.x % 32 / 4),
        q(threadIdx.x % 4), rs(warp % kRowTiles), cs0(warp / kRowTiles * kSTiles), ru(warp % 4), cu0(warp / 4 * 4) {}

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

  // The chunk at workspace row `row` (L steps) into the staging area; X's rows at x + t * ldx.
  __device__ void stage(const Intra<float>& in, int64_t row, int L, const float* x, int64_t ldx) const {
    const float* src[3] = {in.W + row * kK, in.Qg + row * kK, in.Kd + row * kK};
    float* dst[3] = {stW, stQ, stKd};
#pragma unroll
    for (int m = 0; m < 3; ++m) {
      for (int i = threadIdx.x; i < kChunk * (kK / 4); i += kThreads) {
        const int t = i / (kK / 4), c = i % (kK / 4) * 4;
        copy4(dst[m] + t * kK + c, t < L ? src[m] + t * kK + c : nullptr);
      }
    }
    for (int i = threadIdx.x; i < kChunk * (kChunk / 4); i += kThreads) {
      const int t = i / (kChunk / 4), c = i % (kChunk / 4) * 4;
      copy4(stA + t * kChunk + c, t < L ? in.Aqk + (row + t) * kChunk + c : nullptr);
      copy4(stX + t * kLdX + c, t < L ? x + t * ldx + c : nullptr);
    }
    mma::cp_async_commit();
  }
  __device__ static void copy4(float* d, const float* s) {
    if (s != nullptr) {
      mma::cp_async_16(d, s);
    } else {
      *reinterpret_cast<float4*>(d) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
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
  // The staged terms as bf16 tiles; the intra kernel leaves Aqk's columns from L on unwritten:
  // they are zeroed here.
  __device__ void round_chunk(int L, float w_factor, float q_factor, float a_factor) const {
    round_tile(bW, kLdK, stW, kK, kChunk, kK, w_factor);
    round_tile(bQ, kLdK, stQ, kK, kChunk, kK, q_factor);
    round_tile(bKd, kLdK, stKd, kK, kChunk, kK, 1.f);
    for (int e = threadIdx.x; e < kChunk * kChunk / 2; e += kThreads) {
      const int t = e / (kChunk / 2), c = e % (kChunk / 2) * 2;
      const float2 x = *reinterpret_cast<const float2*>(stA + t * kChunk + c);
      *reinterpret_cast<uint32_t*>(bA + t * kLdC + c) =
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
  // An [L, 64] fragment set into the bf16 tile bU.
  __device__ void round_u(const float (&u)[4][4]) const {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      *reinterpret_cast<uint32_t*>(bU + urow(0) * kLdC + ucol(j, 0)) = mma::pack2<bf16>(u[j][0], u[j][1]);
      *reinterpret_cast<uint32_t*>(bU + urow(2) * kLdC + ucol(j, 2)) = mma::pack2<bf16>(u[j][2], u[j][3]);
    }
  }
  // acc (this warp's [L, 64] fragments) += A B over k blocks [kk0, kk1): A rows 16 ru.. of a
  // [*, ld_a] row-major tile (or of the transpose of one when kTransA), B [*, 64] row-major.
  template <bool kTransA>
  __device__ void mul_u(float (&acc)[4][4], const bf16* a_tile, int ld_a, const bf16* b_tile, int kk0,
                        int kk1) const {
    for (int kk = kk0; kk < kk1; ++kk) {
      uint32_t a[4];
      if constexpr (kTransA) {
        mma::load_a_trans(a, a_tile, ld_a, 16 * ru, 16 * kk);
      } else {
        mma::load_a(a, a_tile, ld_a, 16 * ru, 16 * kk);
      }
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        uint32_t b[4];
        mma::load_b_kn(b, b_tile, kLdC, 8 * cu0 + 16 * p, 16 * kk);
        mma::mma_16816_x2<bf16>(acc[2 * p], acc[2 * p + 1], a, b);
      }
    }
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
  __device__ void scale_state_rows(float (&S)[kSTiles][4], const float* gc) const {
    const float g0 = gc[srow(0)], g1 = gc[srow(2)];
#pragma unroll
    for (int j = 0; j < kSTiles; ++j) {
      S[j][0] *= g0;
      S[j][1] *= g0;
      S[j][2] *= g1;
      S[j][3] *= g1;
    }
  }
};

// Forward: U = Ut - W S, O = scale (Qg S + Aqk U), S <- diag(gC) S + Kd^T U; o, ht, starts as
// for state_fwd_kernel.
template <int kK>
__global__ void __launch_bounds__(Bf16State<kK>::kThreads) state_fwd_bf16_kernel(Seqs sq_, Sizes<float> z, float scale,
                                                                                Intra<float> in,
                                                                                const float* __restrict__ h0, float* o,
                                                                                float* ht, float* starts) {
  using F = Bf16State<kK>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const F sm(smem_raw);
  const StateTile<float> st(sq_, z);
  const int64_t V = z.V;
  float S[F::kSTiles][4];
  sm.load_state(S, h0 != nullptr ? h0 + st.matrix(z.HV) : nullptr, V, st.j0);
  auto stage = [&](int64_t i) {
    int64_t slot, t0;
    int L;
    if (i < st.chunks && st.chunk(sq_, i, slot, t0, L)) {
      const int64_t row = st.hv * sq_.tokens + t0;
      sm.stage(in, row, L, in.Ut + row * V + st.j0, V);
    }
  };
  stage(0);
  for (int64_t i = 0; i < st.chunks; ++i) {
    int64_t slot, t0;
    int L;
    if (!st.chunk(sq_, i, slot, t0, L)) break;
    sm.store_state(S, starts != nullptr ? starts + (st.hv * sq_.slots + slot) * kK * V : nullptr, V, st.j0);
    mma::cp_async_wait<0>();
    __syncthreads();
    sm.round_chunk(L, 1.f, 1.f, 1.f);
    sm.round_state(S);
    float u[4][4], acc_o[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        u[j][r] = 0.f;
        acc_o[j][r] = 0.f;
      }
    }
    float ut[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) ut[j][r] = sm.stX[sm.urow(r) * F::kLdX + sm.ucol(j, r)];
    }
    __syncthreads();  // the staging area is free, the bf16 tiles are complete
    stage(i + 1);
    sm.template mul_u<false>(u, sm.bW, F::kLdK, sm.bS, 0, kK / 16);
    sm.template mul_u<false>(acc_o, sm.bQ, F::kLdK, sm.bS, 0, kK / 16);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) u[j][r] = ut[j][r] - u[j][r];
    }
    sm.round_u(u);
    __syncthreads();
    sm.template mul_u<false>(acc_o, sm.bA, F::kLdC, sm.bU, 0, sm.ru + 1);  // Aqk is zero above the diagonal
    if (o != nullptr) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int t = sm.urow(2 * h);
          if (t < L) {
            *reinterpret_cast<float2*>(o + ((t0 + t) * z.HV + st.hv) * V + st.j0 + sm.ucol(j, 2 * h)) =
                make_float2(scale * acc_o[j][2 * h], scale * acc_o[j][2 * h + 1]);
          }
        }
      }
    }
    sm.scale_state_rows(S, in.gC + (st.hv * sq_.slots + slot) * kK);
    sm.mul_state(S, sm.bKd, sm.bU);
    __syncthreads();  // every read of this chunk's tiles is done before the next chunk rewrites them
  }
  mma::cp_async_wait<0>();
  sm.store_state(S, ht != nullptr ? ht + st.matrix(z.HV) : nullptr, V, st.j0);
}

// Backward, chunks in reverse, dS the gradient of the chunk's end state (stored into dends):
// dU = scale Aqk^T dO + Kd dS, dS <- diag(gC) dS + scale Qg^T dO - W^T dU (the factors scale and
// -1 ride on the bf16 rounding of Aqk, Qg and W); the initial state's gradient into dh0.
template <int kK>
__global__ void __launch_bounds__(Bf16State<kK>::kThreads) state_bwd_bf16_kernel(Seqs sq_, Sizes<float> z, float scale,
                                                                                Intra<float> in,
                                                                                const float* __restrict__ dO,
                                                                                const float* __restrict__ dht,
                                                                                float* dends, float* dh0) {
  using F = Bf16State<kK>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const F sm(smem_raw);
  const StateTile<float> st(sq_, z);
  const int64_t V = z.V;
  float dS[F::kSTiles][4];
  sm.load_state(dS, dht != nullptr ? dht + st.matrix(z.HV) : nullptr, V, st.j0);
  auto stage = [&](int64_t i) {
    int64_t slot, t0;
    int L;
    if (i >= 0 && st.chunk(sq_, i, slot, t0, L)) {
      sm.stage(in, st.hv * sq_.tokens + t0, L, dO + (t0 * z.HV + st.hv) * V + st.j0, z.HV * V);
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
    sm.store_state(dS, dends + (st.hv * sq_.slots + slot) * kK * V, V, st.j0);
    mma::cp_async_wait<0>();
    __syncthreads();
    sm.round_chunk(L, -1.f, scale, scale);
    sm.round_state(dS);
    F::round_tile(sm.bX, F::kLdC, sm.stX, F::kLdX, kChunk, kChunk, 1.f);
    __syncthreads();
    stage(i - 1);
    float du[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) du[j][r] = 0.f;
    }
    sm.template mul_u<true>(du, sm.bA, F::kLdC, sm.bX, sm.ru, kChunk / 16);  // (Aqk^T)_ts is zero for s < t
    sm.template mul_u<false>(du, sm.bKd, F::kLdK, sm.bS, 0, kK / 16);
    sm.round_u(du);
    __syncthreads();
    sm.scale_state_rows(dS, in.gC + (st.hv * sq_.slots + slot) * kK);
    sm.mul_state(dS, sm.bQ, sm.bX);
    sm.mul_state(dS, sm.bW, sm.bU);
    __syncthreads();
  }
  mma::cp_async_wait<0>();
  sm.store_state(dS, dh0 + st.matrix(z.HV), V, st.j0);
}

// Scratch and head-major outputs of the chunk backward: row t of value head hv at hv * tokens + t.
template <typename T>
struct BwdWork {
  T *U, *dU, *dW, *ZW, *ZU, *kE, *qE;  // scratch
  T *dq, *dk, *dg, *dbeta;   // outputs [HV, tokens, K] ([HV, tokens] for dbeta)
};

template <typename T>
__global__ void __launch_bounds__(kThreads) chunk_bwd_kernel(Seqs sq_, Sizes<T> z, T scale, const T* __restrict__ q,
                                                             const T* __restrict__ k, const T* __restrict__ v,
                                                             const T* __restrict__ g, const T* __restrict__ beta,
                                                             Intra<T> in, const T* __restrict__ starts,
                                                             const T* __restrict__ dends, const T* __restrict__ dO,
                                                             BwdWork<T> w, T* dv) {
  extern __shared__ unsigned char smem_raw[];
  const ChunkSmem<T> sm(reinterpret_cast<T*>(smem_raw), z.K, z.V);
  const int64_t slot = blockIdx.x, hv = blockIdx.y;
  int64_t t0;
  int L;
  if (!sq_.locate(slot, t0, L) || !sq_.valid(slot, t0, L)) return;
  const BlockTeam tm{z.bf16};
  const int K = static_cast<int>(z.K), V = static_cast<int>(z.V);
  const ChunkDims d{L, K, V};
  load_chunk(tm, z, d, t0, hv, q, k, v, g, beta, sm);
  const int64_t row = hv * sq_.tokens + t0, state = (hv * sq_.slots + slot) * K * V;
  T* sdAqk = sm.end;
  T* sdA = sdAqk + kChunk * kChunk;
  T* sY = sdA + kChunk * kChunk;  // [2 kSub, K]
  T* slast = sY + 2 * kSub * K;
  const ChunkBwdScratch<T> sc{w.U + row * V, w.dU + row * V, w.dW + row * K, w.ZW + row * K, w.ZU + row * V,
                              sdAqk,         sdA,            slast,          w.kE + row * K, w.qE + row * K,
                              sY};
  chunk_bwd(tm, d, scale, sm.q, sm.k, sm.gates(), sm.v, sm.beta, in.A + row * kChunk, in.Aqk + row * kChunk,
            in.Minv + row * kChunk, in.W + row * K,
            in.Ut + row * V, in.Qg + row * K, in.Kd + row * K, in.gC + (hv * sq_.slots + slot) * K, starts + state,
            dends + state, dO + (t0 * z.HV + hv) * V, static_cast<int>(z.HV * V), sc, w.dq + row * K,
            w.dk + row * K, w.dg + row * K, dv + (t0 * z.HV + hv) * V, static_cast<int>(z.HV * V),
            w.dbeta + row);
}

struct Launch {
  Seqs seqs;
  cudaStream_t stream;
};

Launch launch_setup(const Problem& p, const at::Tensor& ref) {
  TORCH_CHECK(ref.scalar_type() == at::kFloat, "kda: the CUDA kernels take bfloat16, float16 or float32 inputs, got ",
              "float64 (use the CPU kernel for float64)");
  const int64_t tokens = p.B * p.T;
  // Upper bound of the chunk count that needs no look at cu_seqlens: sum ceil(len/64) <= T/64 + N.
  const int64_t slots = p.cu_seqlens.defined() ? tokens / kChunk + p.N : p.N * ((p.T + kChunk - 1) / kChunk);
  const int32_t* cu = p.cu_seqlens.defined() ? p.cu_seqlens.data_ptr<int32_t>() : nullptr;
  return Launch{Seqs{cu, p.N, p.T, tokens, slots}, c10::cuda::getCurrentCUDAStream(ref.get_device()).stream()};
}

// The intra-chunk terms of every chunk into workspaces (A and Minv only for the backward).
Intra<float> run_intra(const Problem& p, const Inputs& in, const Launch& l, bool for_bwd,
                       std::vector<at::Tensor>& keep) {
  const auto opts = in.q.options();
  const int64_t rows = p.HV * l.seqs.tokens;
  auto ws = [&](int64_t n) {
    keep.push_back(at::empty({n}, opts));
    return keep.back().data_ptr<float>();
  };
  Intra<float> out{for_bwd ? ws(rows * kChunk) : nullptr, for_bwd ? ws(rows * kChunk) : nullptr, ws(rows * kChunk),
                   ws(rows * p.K), ws(rows * p.V), ws(rows * p.K), ws(rows * p.K),
                   ws(std::max<int64_t>(1, p.HV * l.seqs.slots * p.K))};
  if (l.seqs.slots == 0) return out;
  const size_t smem =
      ChunkSmem<float>::bytes(p.K, p.V) + sizeof(float) * (2 * kChunk * kChunk + intra_scratch(static_cast<int>(p.K)));
  set_smem(intra_kernel<float>, smem);
  intra_kernel<float><<<dim3(l.seqs.slots, p.HV), kThreads, smem, l.stream>>>(
      l.seqs, Sizes<float>{p.H, p.HV, p.K, p.V, p.bf16_products}, in.q.data_ptr<float>(), in.k.data_ptr<float>(),
      in.v.data_ptr<float>(), in.g.data_ptr<float>(), in.beta.data_ptr<float>(), out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

size_t state_smem_bytes(int64_t K) { return StateSmem<float>::bytes(K); }

dim3 state_grid(const Problem& p) { return dim3(static_cast<unsigned>(ceil_div(p.V, int64_t{kStateCols})), p.HV, p.N); }

// A state pass: its bf16-operand kernel in bf16-product mode where the head sizes fit its
// tiles, else the generic kernel (its products 3xTF32, or bf16 operands in bf16-product mode).
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
    launch(bf16_k128, Bf16State<128>::bytes(), Bf16State<128>::kThreads);
  } else if (tiles && p.K == 64) {
    launch(bf16_k64, Bf16State<64>::bytes(), Bf16State<64>::kThreads);
  } else {
    launch(generic, state_smem_bytes(p.K), kThreads);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Forward state passing (o, ht, starts each may be nullptr).
void run_state_fwd(const Problem& p, const Launch& l, const Intra<float>& intra, const float* h0, float* o, float* ht,
                   float* starts) {
  run_state_pass(p, l, state_fwd_kernel<float>, state_fwd_bf16_kernel<128>, state_fwd_bf16_kernel<64>, intra, h0, o,
                 ht, starts);
}

}  // namespace

void fwd_cuda(const Problem& p, const Inputs& in, at::Tensor& o, at::Tensor& final_state) {
  const c10::cuda::CUDAGuard guard(in.q.device());
  const Launch l = launch_setup(p, in.q);
  std::vector<at::Tensor> keep;
  const Intra<float> intra = run_intra(p, in, l, false, keep);
  if (p.N == 0) return;
  run_state_fwd(p, l, intra, in.initial_state.defined() ? in.initial_state.data_ptr<float>() : nullptr,
                o.data_ptr<float>(), final_state.defined() ? final_state.data_ptr<float>() : nullptr, nullptr);
}

void bwd_cuda(const Problem& p, const Inputs& in, const at::Tensor& grad_o, const at::Tensor& grad_final_state,
              Grads& gr) {
  const c10::cuda::CUDAGuard guard(in.q.device());
  const Launch l = launch_setup(p, in.q);
  std::vector<at::Tensor> keep;
  const Intra<float> intra = run_intra(p, in, l, true, keep);
  const Sizes<float> z{p.H, p.HV, p.K, p.V, p.bf16_products};
  const auto opts = in.q.options();
  const int64_t tokens = l.seqs.tokens, rows = p.HV * tokens;
  const at::Tensor starts = at::empty({std::max<int64_t>(1, p.HV * l.seqs.slots * p.K * p.V)}, opts);
  const at::Tensor dends = at::empty_like(starts);
  const float scale = static_cast<float>(p.scale);
  if (p.N > 0) {
    run_state_fwd(p, l, intra, in.initial_state.defined() ? in.initial_state.data_ptr<float>() : nullptr, nullptr,
                  nullptr, starts.data_ptr<float>());
    const float* dO = grad_o.data_ptr<float>();
    const float* dht = grad_final_state.defined() ? grad_final_state.data_ptr<float>() : nullptr;
    run_state_pass(p, l, state_bwd_kernel<float>, state_bwd_bf16_kernel<128>, state_bwd_bf16_kernel<64>, intra, dO,
                   dht, dends.data_ptr<float>(), gr.dinitial_state.data_ptr<float>());
  }
  if (rows == 0) return;
  auto ws = [&](int64_t n) {
    keep.push_back(at::empty({n}, opts));
    return keep.back().data_ptr<float>();
  };
  // Head-major gradients; every row of a used chunk is written.
  const at::Tensor dq = at::zeros({p.HV, p.B, p.T, p.K}, opts), dk = at::zeros_like(dq), dg = at::zeros_like(dq);
  const at::Tensor dbeta = at::zeros({p.HV, p.B, p.T}, opts);
  gr.dv.zero_();
  const BwdWork<float> w{ws(rows * p.V), ws(rows * p.V), ws(rows * p.K), ws(rows * p.K), ws(rows * p.V),
                         ws(rows * p.K), ws(rows * p.K), dq.data_ptr<float>(), dk.data_ptr<float>(), dg.data_ptr<float>(),
                         dbeta.data_ptr<float>()};
  if (l.seqs.slots > 0) {
    const size_t smem =
        ChunkSmem<float>::bytes(p.K, p.V) + sizeof(float) * (2 * kChunk * kChunk + (2 * kSub + 1) * p.K);
    set_smem(chunk_bwd_kernel<float>, smem);
    chunk_bwd_kernel<float><<<dim3(l.seqs.slots, p.HV), kThreads, smem, l.stream>>>(
        l.seqs, z, scale, in.q.data_ptr<float>(), in.k.data_ptr<float>(), in.v.data_ptr<float>(),
        in.g.data_ptr<float>(), in.beta.data_ptr<float>(), intra, starts.data_ptr<float>(), dends.data_ptr<float>(),
        grad_o.data_ptr<float>(), w, gr.dv.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  gr.dq.copy_(dq.permute({1, 2, 0, 3}));
  gr.dk.copy_(dk.permute({1, 2, 0, 3}));
  gr.dg.copy_(dg.permute({1, 2, 0, 3}));
  gr.dbeta.copy_(dbeta.permute({1, 2, 0}));
}

}  // namespace kda_dsa_ops::kda
