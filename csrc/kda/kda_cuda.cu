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
  __device__ void atomic_min(int* at, int value) const { atomicMin(at, value); }
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
  float* A;  // A and Minv: nullptr in the forward, which keeps them in shared memory
  T *Minv, *Aqk, *W, *Ut, *Qg, *Kd;
  float* gC;
  unsigned char* mark;  // [HV, slots, V + 1] chunk_mark_nonfinite's marks: the forward's, else nullptr
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

// Load steps [t0, t0+L) of value head hv into shared memory; with mark (the forward's), finite
// stand-ins for non-finite inputs (first [V + 2] is scratch).
template <typename T>
__device__ void load_chunk(const BlockTeam& tm, const Sizes<T>& z, ChunkDims d, int64_t t0, int64_t hv,
                           const T* q, const T* k, const T* v, const T* g, const T* beta, const ChunkSmem<T>& s,
                           int* first = nullptr, unsigned char* mark = nullptr) {
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
  if (mark != nullptr) chunk_mark_nonfinite(tm, d, sk, sG, sv, sb, first, mark);
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
  load_chunk(tm, z, d, t0, hv, q, k, v, g, beta, sm, reinterpret_cast<int*>(sY),
             out.mark != nullptr ? out.mark + (hv * sq_.slots + slot) * (z.V + 1) : nullptr);
  const int64_t row = hv * sq_.tokens + t0;
  chunk_intra(tm, d, sm.q, sm.k, sm.gates(), sm.v, sm.beta, out.A != nullptr ? out.A + row * kChunk : sA,
              out.Aqk + row * kChunk, out.Minv != nullptr ? out.Minv + row * kChunk : sMinv,
              out.W + row * z.K, out.Ut + row * z.V, out.Qg + row * z.K, out.Kd + row * z.K,
              out.gC + (hv * sq_.slots + slot) * z.K, sY);
}

// Two adjacent elements (an even column) from fp32.
__device__ __forceinline__ void store_pair(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
template <typename T>
__device__ __forceinline__ void store_pair(T* p, float a, float b) {
  *reinterpret_cast<uint32_t*>(p) = mma::pack2<T>(a, b);
}
// Eight consecutive elements (16-byte aligned) from fp32.
__device__ __forceinline__ void store8(__nv_bfloat16* p, const float (&x)[8]) {
  using bf16 = __nv_bfloat16;
  *reinterpret_cast<uint4*>(p) = make_uint4(mma::pack2<bf16>(x[0], x[1]), mma::pack2<bf16>(x[2], x[3]),
                                            mma::pack2<bf16>(x[4], x[5]), mma::pack2<bf16>(x[6], x[7]));
}

// N (2, 4 or 8) consecutive elements at p, aligned to their size, as floats: one vector load.
template <int N, typename T>
__device__ __forceinline__ void load_floats(const T* p, float (&x)[N]) {
  static_assert(N == 2 || N == 4 || N == 8, "2, 4 or 8 elements");
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      const float2 v = *reinterpret_cast<const float2*>(p + i);
      x[i] = v.x;
      x[i + 1] = v.y;
    }
  } else {
    uint32_t u[N / 2];
    if constexpr (N == 8) {
      const uint4 v = *reinterpret_cast<const uint4*>(p);
      u[0] = v.x, u[1] = v.y, u[2] = v.z, u[3] = v.w;
    } else if constexpr (N == 4) {
      const uint2 v = *reinterpret_cast<const uint2*>(p);
      u[0] = v.x, u[1] = v.y;
    } else {
      u[0] = *reinterpret_cast<const uint32_t*>(p);
    }
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const float2 f = mma::unpack2<T>(u[i]);
      x[2 * i] = f.x;
      x[2 * i + 1] = f.y;
    }
  }
}

// acc (this warp's 16 x 8 kTiles tile: rows 16 rt.., columns n0.., of which the first N / 2 are
// used, N / 2 a multiple of 16) += A B over the k blocks [kk0, kk1) of 16. A row-major [*, lda]
// (kTransA: A is the transpose of a row-major [k, *] tile); B row-major [k, *] (kBnk: B is the
// transpose of a row-major [*, k] tile).
template <bool kTransA, bool kBnk, int kTiles>
__device__ __forceinline__ void warp_tile_product(float (&acc)[kTiles][4], const __nv_bfloat16* A, int lda,
                                                  const __nv_bfloat16* B, int ldb, int rt, int n0, int N, int kk0,
                                                  int kk1) {
  for (int kk = kk0; kk < kk1; ++kk) {
    uint32_t a[4];
    if constexpr (kTransA) {
      mma::load_a_trans(a, A, lda, 16 * rt, 16 * kk);
    } else {
      mma::load_a(a, A, lda, 16 * rt, 16 * kk);
    }
#pragma unroll
    for (int pp = 0; pp < kTiles / 2; ++pp) {
      if (pp < N / 32) {
        uint32_t b[4];
        if constexpr (kBnk) {
          mma::load_b_nk(b, B, ldb, n0 + 16 * pp, 16 * kk);
        } else {
          mma::load_b_kn(b, B, ldb, n0 + 16 * pp, 16 * kk);
        }
        mma::mma_16816_x2<__nv_bfloat16>(acc[2 * pp], acc[2 * pp + 1], a, b);
      }
    }
  }
}

// f(t, col, x0, x1) for the pairs (t, col), (t, col + 1) of a warp_tile_product tile; zeroes acc.
template <typename F>
__device__ __forceinline__ void drain_tile(float (&acc)[8][4], int rt, int n0, int N, F f) {
  const int lane = static_cast<int>(threadIdx.x % 32);
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    if (n < N / 16) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        f(16 * rt + lane / 4 + 8 * hh, n0 + 8 * n + 2 * (lane % 4), acc[n][2 * hh], acc[n][2 * hh + 1]);
        acc[n][2 * hh] = acc[n][2 * hh + 1] = 0.f;
      }
    }
  }
}

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The op's inputs as given (contiguous, 16-byte aligned): q, k [B,T,H,K], v [B,T,HV,V] of T;
// g [B,T,HV,K] and beta [B,T,HV] float or T.
template <typename T>
struct RawIn {
  const T *q, *k, *v;
  const void *g, *beta;
  bool g_f32, beta_f32, l2norm;
};

// One butterfly step of warp_sum_transposed: the lanes whose bit m is set keep v[m, 2m), the
// others v[0, m), each adding its partner's half.
template <int kM, int N>
__device__ __forceinline__ void butterfly_step(float (&v)[N], bool up) {
#pragma unroll
  for (int i = 0; i < kM; ++i) {
    const float send = up ? v[i] : v[i + kM], keep = up ? v[i + kM] : v[i];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, kM);
  }
}
// N (32 or 16) per-lane values v[i] summed over the warp: lane l returns the sum of v[l % N] (the
// values halve each step: N - 1 shuffles, and one more for N = 16, instead of N x 5).
template <int N>
__device__ __forceinline__ float warp_sum_transposed(float (&v)[N]) {
  static_assert(N == 16 || N == 32, "16 or 32 values");
  const int lane = threadIdx.x % 32;
  if constexpr (N == 32) butterfly_step<16>(v, lane & 16);
  butterfly_step<8>(v, lane & 8);
  butterfly_step<4>(v, lane & 4);
  butterfly_step<2>(v, lane & 2);
  butterfly_step<1>(v, lane & 1);
  return N == 32 ? v[0] : v[0] + __shfl_xor_sync(0xffffffffu, v[0], 16);
}

constexpr float kNormEps = 1e-6f;  // x / sqrt(|x|^2 + eps), as reference/kda.py

// Shared-memory tiles of one chunk of one value head for the bf16 kernels (256 threads): the raw
// q, k [kChunk, kK + 8] in T, G = log2(e) cumsum(g) [kChunk, kK + 4] in fp32 (plain fp32 sum,
// scaled so that every exp is one ex2), beta and the factors 1 / |q_t|, 1 / |k_t| (ones without
// normalisation) [kChunk], and kThreads floats of scratch. Rows from L on are zero (g too: G
// stays at its last value).
template <int kK, typename T>
struct ChunkTiles16 {
  static constexpr int kThreads = 256, kLdK = kK + 8, kLdG = kK + 4, kLdV = kMaxHeadDim + 8;
  static constexpr size_t bytes() {
    return 2 * sizeof(T) * kChunk * kLdK + 4 * (kChunk * kLdG + 3 * kChunk + kThreads);
  }
  T *q, *k;
  float *G, *beta, *rq, *rk, *part;
  int* first;  // [kMaxHeadDim + 2] the forward's scratch of chunk_mark_nonfinite (nullptr elsewhere)

  // The tiles laid out from smem on (bytes() of it); *end receives the first byte after them.
  __device__ static ChunkTiles16 carve(unsigned char* smem, unsigned char** end) {
    T* q = reinterpret_cast<T*>(smem);
    T* k = q + kChunk * kLdK;
    float* G = reinterpret_cast<float*>(k + kChunk * kLdK);
    float* beta = G + kChunk * kLdG;
    *end = reinterpret_cast<unsigned char*>(beta + 3 * kChunk + kThreads);
    return ChunkTiles16{q, k, G, beta, beta + kChunk, beta + 2 * kChunk, beta + 3 * kChunk, nullptr};
  }

  // chunk_mark_nonfinite's rule in the passes of load: the first non-finite step of k, g, beta
  // into first[V], of column j of v into first[j], the first of all into first[V + 1].
  __device__ void note_nonfinite(int j, int t, int V) const {
    atomicMin(first + j, t);
    atomicMin(first + V + 1, t);
  }
  __device__ void find_nonfinite_v_beta(int L, const T* sv, int V) const {
    const int tid = static_cast<int>(threadIdx.x);
    for (int i = tid; i < L * (V / 8); i += kThreads) {
      const int t = i / (V / 8), c = i % (V / 8) * 8;
      float x[8];
      load_floats(sv + t * kLdV + c, x);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        if (!isfinite(x[e])) note_nonfinite(c + e, t, V);
      }
    }
    if (tid < L && !isfinite(beta[tid])) note_nonfinite(V, tid, V);
  }
  // After load's passes: the marks into mark [V + 1] and, for a chunk that is not clean, finite
  // stand-ins from the first step of k, g, beta on (k, beta, 1 / |k| zero, G held at its last
  // finite value, in the padding rows from L on as well: the products read them) and for v from
  // its column's first step on (zero).
  __device__ void put_stand_ins(int L, T* sv, int V, unsigned char* mark) const {
    const int tid = static_cast<int>(threadIdx.x), any = first[V + 1], row = first[V];
    if (tid == 0) mark[V] = static_cast<unsigned char>(any);
    if (any == L) return;  // clean: nothing is written (first is not read again)
    if (tid < V) mark[tid] = static_cast<unsigned char>(min(first[tid], row));
    for (int i = tid; i < L * V; i += kThreads) {
      if (i / V >= min(first[i % V], row)) sv[i / V * kLdV + i % V] = from_float<T>(0.f);
    }
    for (int i = row * kK + tid; i < kChunk * kK; i += kThreads) {  // G's rows from L on too (padding)
      const int t = i / kK, c = i % kK;
      k[t * kLdK + c] = from_float<T>(0.f);
      G[t * kLdG + c] = row > 0 ? G[(row - 1) * kLdG + c] : 0.f;
    }
    for (int t = row + tid; t < L; t += kThreads) beta[t] = rk[t] = 0.f;
    __syncthreads();
  }

  // Fills the tiles (v [kChunk, kLdV] too where sv is given) for the whole block; ends with a
  // __syncthreads(). With mark (the forward's: sv and first given), finite stand-ins for
  // non-finite inputs and their marks.
  __device__ void load(const RawIn<T>& in, int64_t H, int64_t HV, int64_t t0, int L, int64_t hv, T* sv,
                       int V, unsigned char* mark = nullptr) const {
    constexpr float kLog2e = 1.4426950408889634f;
    const int64_t h = hv / (HV / H);
    const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
    if (mark != nullptr && tid < V + 2) first[tid] = L;  // (V + 2 <= kThreads)
    // Loads; rows from L on are zero (g too: G stays at its last value).
    for (int i = tid; i < kChunk * (kK / 8); i += kThreads) {
      const int t = i / (kK / 8), c = i % (kK / 8) * 8;
      const int64_t src = ((t0 + t) * H + h) * kK + c;
      mma::cp_async_16_or_zero(q + t * kLdK + c, t < L ? in.q + src : nullptr);
      mma::cp_async_16_or_zero(k + t * kLdK + c, t < L ? in.k + src : nullptr);
    }
    for (int i = tid; sv != nullptr && i < kChunk * (V / 8); i += kThreads) {
      const int t = i / (V / 8), c = i % (V / 8) * 8;
      mma::cp_async_16_or_zero(sv + t * kLdV + c, t < L ? in.v + ((t0 + t) * HV + hv) * V + c : nullptr);
    }
    if (in.g_f32) {
      const float* g = static_cast<const float*>(in.g);
      for (int i = tid; i < kChunk * (kK / 4); i += kThreads) {
        const int t = i / (kK / 4), c = i % (kK / 4) * 4;
        mma::cp_async_16_or_zero(G + t * kLdG + c, t < L ? g + ((t0 + t) * HV + hv) * kK + c : nullptr);
      }
    } else {
      const T* g = static_cast<const T*>(in.g);
      for (int i = tid; i < kChunk * kK; i += kThreads) {
        const int t = i / kK, c = i % kK;
        G[t * kLdG + c] = t < L ? to_float(g[((t0 + t) * HV + hv) * kK + c]) : 0.f;
      }
    }
    if (tid < kChunk) {
      const int64_t e = (t0 + tid) * HV + hv;
      beta[tid] = tid >= L ? 0.f
                   : in.beta_f32 ? static_cast<const float*>(in.beta)[e]
                                 : to_float(static_cast<const T*>(in.beta)[e]);
    }
    mma::cp_async_wait_all();
    __syncthreads();
    if (mark != nullptr) find_nonfinite_v_beta(L, sv, V);

    // 1 / |q_t|, 1 / |k_t| (ones without normalisation); G = log2(e) cumsum(g) by parts of rows.
    for (int task = warp; task < 2 * kChunk; task += kThreads / 32) {
      float x[kK / 32], ss = 0.f;
      load_floats((task < kChunk ? q : k) + (task % kChunk) * kLdK + lane * (kK / 32), x);
#pragma unroll
      for (int c = 0; c < kK / 32; ++c) ss += x[c] * x[c];
      ss = warp_reduce(ss, SumOp{});
      if (lane == 0) (task < kChunk ? rq : rk)[task % kChunk] = in.l2norm ? rsqrtf(ss + kNormEps) : 1.f;
      if (mark != nullptr && lane == 0 && task >= kChunk && !isfinite(ss)) note_nonfinite(V, task - kChunk, V);
    }
    {
      constexpr int kParts = kThreads / kK, kRows = kChunk / kParts;
      const int c = tid % kK, p0 = tid / kK;
      float x[kRows];
      float run = 0.f;
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const float g = G[(p0 * kRows + i) * kLdG + c];
        if (mark != nullptr && !(g < INFINITY)) note_nonfinite(V, p0 * kRows + i, V);  // NaN or +inf
        run += floor_log_decay(g);
        x[i] = run;
      }
      part[p0 * kK + c] = run;
      __syncthreads();
      float base = 0.f;
      for (int p = 0; p < p0; ++p) base += part[p * kK + c];
#pragma unroll
      for (int i = 0; i < kRows; ++i) G[(p0 * kRows + i) * kLdG + c] = (base + x[i]) * kLog2e;
    }
    __syncthreads();
    if (mark != nullptr) put_stand_ins(L, sv, V, mark);
  }
};

// The intra-chunk terms for bf16 / fp16 inputs in bf16-product mode (K 64 or 128, V 64 or 128),
// in bf16 for the bf16 state passes (the backward's also A in fp32 and Minv in bf16). One block
// of 8 warps per (chunk, value head), two blocks per SM. It reads the op's inputs as they are:
// the casts, the q / k L2 normalisation and the cumsum of g (plain fp32, scaled by log2 e so that
// every exp is one ex2) happen here.
//   diagonal 16 x 16 blocks of A, Aqk   one exp per pair (t, s <= t) and channel; a warp takes the
//                                       rows p and 15 - p of a block (17 pairs), a lane K/32
//                                       channels, and one butterfly sums the 32 terms per row
//   blocks left of the diagonal         mma.sync of k_t exp(G_t - G_r), q_t exp(G_t - G_r) with
//                                       k_s exp(G_r - G_s) (r the block's first row), the operands
//                                       made as the fragments are loaded; a warp per 16 x 16 block
//   Minv = (I + diag(beta) A)^-1        diagonal blocks by substitution (a lane per column, the
//                                       column in registers), then two doubling steps in fp32:
//                                       M10 = -D1 Ab10 D0 (and M32), M[2:4, 0:2] = -M22 Ab M11
//   W = Minv diag(beta) k exp(G), Ut = Minv diag(beta) v   mma.sync with Minv diag(beta) in bf16
template <int kK>
struct IntraBf16 {
  static constexpr int kThreads = 256;
  static constexpr int kLdK = kK + 8;                // 16-bit rows of q, k (then k exp(G))
  static constexpr int kLdV = kMaxHeadDim + 8;       // 16-bit rows of v
  static constexpr int kLdG = kK + 4;                // fp32 rows of G
  static constexpr int kLdA = kChunk + 4;            // fp32 rows of A and Minv
  static constexpr int kLdM = kChunk + 8;            // bf16 rows of Minv diag(beta)
  static constexpr size_t kGBytes = 4 * kChunk * kLdG;
  static constexpr size_t kInvBytes = 4 * kChunk * kLdA + 2 * kChunk * kLdM + 4 * 32 * 32;
  static constexpr size_t kRegion = kGBytes > kInvBytes ? kGBytes : kInvBytes;  // G, later Minv
  static constexpr size_t bytes() {
    return 2 * (2 * kChunk * kLdK + kChunk * kLdV) + kRegion + 4 * (kChunk * kLdA + 3 * kChunk + 256) +
           4 * (kMaxHeadDim + 2);
  }
  static_assert(kK == 64 || kK == 128, "K 64 or 128");
};

template <int kK, typename T>
__global__ void __launch_bounds__(IntraBf16<kK>::kThreads, 2)
    intra_bf16_kernel(Seqs sq_, int64_t H, int64_t HV, int V, RawIn<T> in, Intra<__nv_bfloat16> out) {
  using bf16 = __nv_bfloat16;
  using Z = IntraBf16<kK>;
  constexpr int kLdK = Z::kLdK, kLdG = Z::kLdG, kLdA = Z::kLdA;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sq = reinterpret_cast<T*>(smem_raw);
  T* sk = sq + kChunk * kLdK;
  T* sv = sk + kChunk * kLdK;
  unsigned char* region = reinterpret_cast<unsigned char*>(sv + kChunk * Z::kLdV);
  float* sG = reinterpret_cast<float*>(region);
  float* sMinv = sG;  // once G is spent
  bf16* sMb = reinterpret_cast<bf16*>(sMinv + kChunk * kLdA);
  float* sP = reinterpret_cast<float*>(sMb + kChunk * Z::kLdM);
  float* sA = reinterpret_cast<float*>(region + Z::kRegion);
  float* sbeta = sA + kChunk * kLdA;
  float* srq = sbeta + kChunk;
  float* srk = srq + kChunk;
  float* spart = srk + kChunk;
  int* sfirst = reinterpret_cast<int*>(spart + 256);

  const int64_t slot = blockIdx.x, hv = blockIdx.y;
  int64_t t0;
  int L;
  if (!sq_.locate(slot, t0, L) || !sq_.valid(slot, t0, L)) return;
  const int64_t row0 = hv * sq_.tokens + t0;  // workspace row of step 0
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32, g8 = lane / 4, q4 = lane % 4;

  const ChunkTiles16<kK, T> ct{sq, sk, sG, sbeta, srq, srk, spart, sfirst};
  ct.load(in, H, HV, t0, L, hv, sv, V, out.mark != nullptr ? out.mark + (hv * sq_.slots + slot) * (V + 1) : nullptr);

  // Blocks left of the diagonal: warp w < 6 takes block (b, j) of A and Aqk, r = 16 b.
  if (warp < 6) {
    const int b = warp < 1 ? 1 : warp < 3 ? 2 : 3, j = warp < 1 ? 0 : warp < 3 ? warp - 1 : warp - 3, r = 16 * b;
    float accA[2][4] = {}, accQ[2][4] = {};
    for (int kk = 0; kk < kK / 16; ++kk) {
      uint32_t ak[4], aq[4], bk[2][2];
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {  // channels c, c + 1 with c = 16 kk + 2 q4 + 8 cc
        const int c = 16 * kk + 2 * q4 + 8 * cc;
        const float2 gr = *reinterpret_cast<const float2*>(sG + r * kLdG + c);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {  // rows t = r + g8 + 8 hh
          const int t = r + g8 + 8 * hh;
          const float2 gt = *reinterpret_cast<const float2*>(sG + t * kLdG + c);
          const float e0 = exp2_approx(gt.x - gr.x), e1 = exp2_approx(gt.y - gr.y);
          float kt[2], qt[2];
          load_floats(sk + t * kLdK + c, kt);
          load_floats(sq + t * kLdK + c, qt);
          const float fk = srk[t], fq = srq[t];
          ak[hh + 2 * cc] = mma::pack2<bf16>(kt[0] * fk * e0, kt[1] * fk * e1);
          aq[hh + 2 * cc] = mma::pack2<bf16>(qt[0] * fq * e0, qt[1] * fq * e1);
        }
#pragma unroll
        for (int n = 0; n < 2; ++n) {  // key rows s = 16 j + 8 n + g8
          const int s = 16 * j + 8 * n + g8;
          const float2 gs = *reinterpret_cast<const float2*>(sG + s * kLdG + c);
          float ks[2];
          load_floats(sk + s * kLdK + c, ks);
          const float fk = srk[s];
          bk[n][cc] = mma::pack2<bf16>(ks[0] * fk * exp2_approx(gr.x - gs.x), ks[1] * fk * exp2_approx(gr.y - gs.y));
        }
      }
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        mma::mma_16816<bf16>(accA[n], ak, bk[n][0], bk[n][1]);
        mma::mma_16816<bf16>(accQ[n], aq, bk[n][0], bk[n][1]);
      }
    }
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int t = r + g8 + 8 * hh, s = 16 * j + 8 * n + 2 * q4;
        sA[t * kLdA + s] = accA[n][2 * hh];
        sA[t * kLdA + s + 1] = accA[n][2 * hh + 1];
        if (t < L) store_pair(out.Aqk + (row0 + t) * kChunk + s, accQ[n][2 * hh], accQ[n][2 * hh + 1]);
      }
    }
  }
  // Diagonal blocks: 32 tasks (block bb, rows 16 bb + p and 16 bb + 15 - p), on the raw q, k; the
  // norms' factors are applied to the sums.
  for (int task = warp; task < 32; task += Z::kThreads / 32) {
    constexpr int kC = kK / 32;  // channels per lane
    const int b0 = task / 8 * 16, p = task % 8, c0 = lane * kC;
    const int t1 = b0 + p, t2 = b0 + 15 - p;
    float k1[kC], q1[kC], G1[kC], k2[kC], q2[kC], G2[kC];
    load_floats(sk + t1 * kLdK + c0, k1);
    load_floats(sq + t1 * kLdK + c0, q1);
    load_floats(sG + t1 * kLdG + c0, G1);
    load_floats(sk + t2 * kLdK + c0, k2);
    load_floats(sq + t2 * kLdK + c0, q2);
    load_floats(sG + t2 * kLdG + c0, G2);
    float v1[32], v2[32];  // [s]: A_ts, [16 + s]: Aqk_ts, for t = t1 and t2
#pragma unroll
    for (int i = 0; i < 32; ++i) v1[i] = v2[i] = 0.f;
#pragma unroll
    for (int s = 0; s < 16; ++s) {
      if (s > 15 - p) continue;  // s <= 15 - p covers s <= p (p < 8)
      float ks[kC], Gs[kC];
      load_floats(sk + (b0 + s) * kLdK + c0, ks);
      load_floats(sG + (b0 + s) * kLdG + c0, Gs);
      if (s <= p) {
#pragma unroll
        for (int c = 0; c < kC; ++c) {
          const float e = exp2_approx(G1[c] - Gs[c]) * ks[c];
          v1[s] += k1[c] * e;
          v1[16 + s] += q1[c] * e;
        }
      }
#pragma unroll
      for (int c = 0; c < kC; ++c) {
        const float e = exp2_approx(G2[c] - Gs[c]) * ks[c];
        v2[s] += k2[c] * e;
        v2[16 + s] += q2[c] * e;
      }
    }
    const float a1 = warp_sum_transposed(v1), a2 = warp_sum_transposed(v2);
    const int s = lane % 16;
    const float fs = srk[b0 + s];
    if (lane < 16) {
      sA[t1 * kLdA + b0 + s] = s < p ? a1 * srk[t1] * fs : 0.f;
      sA[t2 * kLdA + b0 + s] = s < 15 - p ? a2 * srk[t2] * fs : 0.f;
    } else {
      if (t1 < L) out.Aqk[(row0 + t1) * kChunk + b0 + s] = from_float<bf16>(s <= p ? a1 * srq[t1] * fs : 0.f);
      if (t2 < L) out.Aqk[(row0 + t2) * kChunk + b0 + s] = from_float<bf16>(s <= 15 - p ? a2 * srq[t2] * fs : 0.f);
    }
  }
  // Aqk is zero right of the diagonal blocks.
  for (int i = tid; i < kChunk * kChunk / 2; i += Z::kThreads) {
    const int t = i / (kChunk / 2), s = i % (kChunk / 2) * 2;
    if (t < L && s >= (t / 16 + 1) * 16) store_pair(out.Aqk + (row0 + t) * kChunk + s, 0.f, 0.f);
  }
  __syncthreads();

  // Elementwise: Qg = q exp(G), Kd = k exp(G_last - G) out, k exp(G) over k (bf16), gC = exp(G_last).
  const float* Gl = sG + (L - 1) * kLdG;
  for (int i = tid; i < kChunk * (kK / 8); i += Z::kThreads) {
    const int t = i / (kK / 8), c = i % (kK / 8) * 8;
    const float fq = srq[t], fk = srk[t];
    float qx[8], kx[8], gt[8], gl[8], qg[8], kd[8], ke[8];
    load_floats(sq + t * kLdK + c, qx);
    load_floats(sk + t * kLdK + c, kx);
    load_floats(sG + t * kLdG + c, gt);
    load_floats(Gl + c, gl);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float x = exp2_approx(gt[e]);
      qg[e] = qx[e] * fq * x;
      ke[e] = kx[e] * fk * x;
      kd[e] = kx[e] * fk * exp2_approx(gl[e] - gt[e]);
    }
    store8(reinterpret_cast<bf16*>(sk) + t * kLdK + c, ke);
    if (t < L) {
      store8(out.Qg + (row0 + t) * kK + c, qg);
      store8(out.Kd + (row0 + t) * kK + c, kd);
    }
  }
  if (tid < kK) out.gC[(hv * sq_.slots + slot) * kK + tid] = exp2_approx(Gl[tid]);
  if constexpr (!std::is_same_v<T, bf16>) {  // v to bf16 in place, the operand of Ut
    for (int i = tid; i < kChunk * (V / 2); i += Z::kThreads) {
      const int t = i / (V / 2), c = i % (V / 2) * 2;
      float x[2];
      load_floats(sv + t * Z::kLdV + c, x);
      store_pair(reinterpret_cast<bf16*>(sv) + t * Z::kLdV + c, x[0], x[1]);
    }
  }
  __syncthreads();

  // The inverse. Diagonal blocks D_b: lane s of warp b < 4 solves column s; warps 4..7 zero the
  // blocks above the diagonal.
  if (warp < 4) {
    if (lane < 16) {
      const int b0 = 16 * warp, s = lane;
      float x[16];
#pragma unroll
      for (int t = 0; t < 16; ++t) {
        float acc = 0.f;
#pragma unroll
        for (int u = 0; u < t; ++u) acc += sA[(b0 + t) * kLdA + b0 + u] * x[u];
        x[t] = t < s ? 0.f : t == s ? 1.f : -sbeta[b0 + t] * acc;
      }
#pragma unroll
      for (int t = 0; t < 16; ++t) sMinv[(b0 + t) * kLdA + b0 + s] = x[t];
    }
  } else {
    for (int i = tid - 128; i < kChunk * kChunk; i += 128) {
      const int t = i / kChunk, s = i % kChunk;
      if (s / 16 > t / 16) sMinv[t * kLdA + s] = 0.f;
    }
  }
  __syncthreads();
  {  // M[b+1, b] = -D_{b+1} diag(beta) A[b+1, b] D_b for b = 0 and 2: first P = beta A D_b.
    const int pr = tid / 128, i = tid % 128 / 8, j = tid % 8 * 2, r = 32 * pr + 16, c = 32 * pr;
    float p0 = 0.f, p1 = 0.f;
#pragma unroll
    for (int u = 0; u < 16; ++u) {
      const float a = sA[(r + i) * kLdA + c + u];
      p0 += a * sMinv[(c + u) * kLdA + c + j];
      p1 += a * sMinv[(c + u) * kLdA + c + j + 1];
    }
    sP[pr * 256 + i * 16 + j] = sbeta[r + i] * p0;
    sP[pr * 256 + i * 16 + j + 1] = sbeta[r + i] * p1;
    __syncthreads();
    float m0 = 0.f, m1 = 0.f;
    for (int u = 0; u <= i; ++u) {
      const float d = sMinv[(r + i) * kLdA + r + u];
      m0 += d * sP[pr * 256 + u * 16 + j];
      m1 += d * sP[pr * 256 + u * 16 + j + 1];
    }
    sMinv[(r + i) * kLdA + c + j] = -m0;
    sMinv[(r + i) * kLdA + c + j + 1] = -m1;
  }
  __syncthreads();
  {  // M[2:4, 0:2] = -M22 diag(beta) A[2:4, 0:2] M11 (32 x 32 blocks), P = beta A M11 first.
    const int i = tid / 8, j = tid % 8 * 4;
    float p[4] = {};
#pragma unroll 8
    for (int u = 0; u < 32; ++u) {
      const float a = sA[(32 + i) * kLdA + u];
      const float4 m = *reinterpret_cast<const float4*>(sMinv + u * kLdA + j);
      p[0] += a * m.x;
      p[1] += a * m.y;
      p[2] += a * m.z;
      p[3] += a * m.w;
    }
    const float fb = sbeta[32 + i];
    *reinterpret_cast<float4*>(sP + i * 32 + j) = make_float4(fb * p[0], fb * p[1], fb * p[2], fb * p[3]);
    __syncthreads();
    float m[4] = {};
    for (int u = 0; u <= i; ++u) {
      const float d = sMinv[(32 + i) * kLdA + 32 + u];
      const float4 x = *reinterpret_cast<const float4*>(sP + u * 32 + j);
      m[0] += d * x.x;
      m[1] += d * x.y;
      m[2] += d * x.z;
      m[3] += d * x.w;
    }
    *reinterpret_cast<float4*>(sMinv + (32 + i) * kLdA + j) = make_float4(-m[0], -m[1], -m[2], -m[3]);
  }
  __syncthreads();
  for (int i = tid; i < kChunk * kChunk / 2; i += Z::kThreads) {  // Minv diag(beta) in bf16
    const int t = i / (kChunk / 2), s = i % (kChunk / 2) * 2;
    store_pair(sMb + t * Z::kLdM + s, s <= t ? sMinv[t * kLdA + s] * sbeta[s] : 0.f,
               s + 1 <= t ? sMinv[t * kLdA + s + 1] * sbeta[s + 1] : 0.f);
  }
  if (out.A != nullptr) {  // the backward's A and Minv
    for (int i = tid; i < L * kChunk / 2; i += Z::kThreads) {
      const int t = i / (kChunk / 2), s = i % (kChunk / 2) * 2;
      store_pair(out.A + (row0 + t) * kChunk + s, s < t ? sA[t * kLdA + s] : 0.f,
                 s + 1 < t ? sA[t * kLdA + s + 1] : 0.f);
      store_pair(out.Minv + (row0 + t) * kChunk + s, s <= t ? sMinv[t * kLdA + s] : 0.f,
                 s + 1 <= t ? sMinv[t * kLdA + s + 1] : 0.f);
    }
  }
  __syncthreads();

  // W = Mb (k exp(G)), Ut = Mb v: warp w takes rows 16 (w % 4).. and half of the columns.
  const int rt = warp % 4, half = warp / 4;
  const auto product = [&](const bf16* B, int ldb, int N, bf16* dst) {
    float acc[8][4] = {};
    const int n0 = half * N / 2;
    warp_tile_product<false, false>(acc, sMb, Z::kLdM, B, ldb, rt, n0, N, 0, kChunk / 16);
    drain_tile(acc, rt, n0, N, [&](int t, int col, float x0, float x1) {
      if (t < L) store_pair(dst + (row0 + t) * N + col, x0, x1);
    });
  };
  product(reinterpret_cast<const bf16*>(sk), kLdK, kK, out.W);
  product(reinterpret_cast<const bf16*>(sv), Z::kLdV, V, out.Ut);
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
    // this chunk's marks (the forward's), read early: nullptr unless it is not clean
    const unsigned char* marks = in.mark != nullptr ? in.mark + (st.hv * sq_.slots + slot) * (z.V + 1) : nullptr;
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

  // The chunk at workspace row `row` (L steps): into the staging area (kStaged) or into tile set
  // s; X's rows (Ut or dO, 64 columns) at x + t * ldx.
  __device__ void stage(const Intra<Ws>& in, int64_t row, int L, const Ws* x, int64_t ldx, int s) const {
    constexpr int kVec = 16 / sizeof(Ws);  // elements per 16-byte copy
    const Tiles d = set(s);
    const Ws* src[3] = {in.W + row * kK, in.Qg + row * kK, in.Kd + row * kK};
    const auto dst_k = [&](int m, int t, int c) -> void* {
      if constexpr (kStaged) {
        return (m == 0 ? stW : m == 1 ? stQ : stKd) + t * kK + c;
      } else {
        return (m == 0 ? d.W : m == 1 ? d.Q : d.Kd) + t * kLdK + c;
      }
    };
#pragma unroll
    for (int m = 0; m < 3; ++m) {
      for (int i = threadIdx.x; i < kChunk * (kK / kVec); i += kThreads) {
        const int t = i / (kK / kVec), c = i % (kK / kVec) * kVec;
        mma::cp_async_16_or_zero(dst_k(m, t, c), t < L ? src[m] + t * kK + c : nullptr);
      }
    }
    for (int i = threadIdx.x; i < kChunk * (kChunk / kVec); i += kThreads) {
      const int t = i / (kChunk / kVec), c = i % (kChunk / kVec) * kVec;
      void* da = kStaged ? static_cast<void*>(stA + t * kChunk + c) : static_cast<void*>(d.A + t * kLdC + c);
      void* dx = kStaged ? static_cast<void*>(stX + t * kLdX + c) : static_cast<void*>(d.X + t * kLdC + c);
      mma::cp_async_16_or_zero(da, t < L ? in.Aqk + (row + t) * kChunk + c : nullptr);
      mma::cp_async_16_or_zero(dx, t < L ? x + t * ldx + c : nullptr);
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

// Forward: U = Ut - W S, O = scale (Qg S + Aqk U), S <- diag(gC) S + Kd^T U; o (element type O),
// ht, starts as for state_fwd_kernel.
template <int kK, typename Ws, typename O>
__global__ void __launch_bounds__(Bf16State<kK, Ws>::kThreads) state_fwd_bf16_kernel(
    Seqs sq_, Sizes<float> z, float scale, Intra<Ws> in, const float* __restrict__ h0, O* o, float* ht,
    float* starts) {
  using F = Bf16State<kK, Ws>;
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
      sm.stage(in, row, L, in.Ut + row * V + st.j0, V, static_cast<int>(i % 2));
    }
  };
  stage(0);
  for (int64_t i = 0; i < st.chunks; ++i) {
    int64_t slot, t0;
    int L;
    if (!st.chunk(sq_, i, slot, t0, L)) break;
    // this chunk's marks of the tile's columns (the forward's), read early: nullptr unless it is not clean
    const unsigned char* marks = in.mark != nullptr ? in.mark + (st.hv * sq_.slots + slot) * (V + 1) : nullptr;
    const unsigned char* mark = marks != nullptr && marks[V] < L ? marks + st.j0 : nullptr;
    sm.store_state(S, starts != nullptr ? starts + (st.hv * sq_.slots + slot) * kK * V : nullptr, V, st.j0);
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
    const auto marked = [&](float x, int t, int col) { return mark != nullptr && t >= mark[col] ? NAN : x; };
    if (o != nullptr) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int t = sm.urow(2 * h), col = sm.ucol(j, 2 * h);
          if (t < L) {
            store_pair(o + ((t0 + t) * z.HV + st.hv) * V + st.j0 + col, marked(scale * acc_o[j][2 * h], t, col),
                       marked(scale * acc_o[j][2 * h + 1], t, col + 1));
          }
        }
      }
    }
    sm.scale_state_rows(S, in.gC + (st.hv * sq_.slots + slot) * kK);
    sm.mul_state(S, cur.Kd, sm.bU);
#pragma unroll
    for (int j = 0; j < F::kSTiles; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) S[j][r] = marked(S[j][r], L - 1, sm.scol(j, r));  // NaN where the last step is
    }
    __syncthreads();  // every read of this chunk's tiles is done before the next chunk rewrites them
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
    float* dends, float* dh0) {
  using F = Bf16State<kK, Ws>;
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
      sm.stage(in, st.hv * sq_.tokens + t0, L, dO + (t0 * z.HV + st.hv) * V + st.j0, z.HV * V,
               static_cast<int>(i % 2));
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
    const typename F::Tiles cur = sm.set(static_cast<int>(i % 2));
    if constexpr (F::kStaged) {
      sm.round_chunk(L, 1.f, scale, scale);
      F::round_tile(cur.X, F::kLdC, sm.stX, F::kLdX, kChunk, kChunk, 1.f);
    }
    sm.round_state(dS);
    __syncthreads();
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
    sm.scale_state_rows(dS, in.gC + (st.hv * sq_.slots + slot) * kK);
    sm.mul_state(dS, cur.Q, cur.X);
    sm.mul_state(dS, cur.W, sm.bU);
    __syncthreads();
  }
  mma::cp_async_wait<0>();
  sm.store_state(dS, dh0 + st.matrix(z.HV), V, st.j0);
}

// Element types of the gradients and of the row kernels, chosen at run time.
enum class Elem : int { kF32, kBF16, kF16 };

Elem elem_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return Elem::kF32;
    case at::kBFloat16:
      return Elem::kBF16;
    case at::kHalf:
      return Elem::kF16;
    default:
      TORCH_CHECK(false, "kda: the CUDA kernels take bfloat16, float16 or float32 inputs, got ", t.scalar_type(),
                  " (use the CPU kernel for float64)");
  }
}

__device__ __forceinline__ float load_elem(const void* p, int64_t i, Elem e) {
  switch (e) {
    case Elem::kBF16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case Elem::kF16:
      return __half2float(static_cast<const __half*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ void store_elem(void* p, int64_t i, float x, Elem e) {
  switch (e) {
    case Elem::kBF16:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
      break;
    case Elem::kF16:
      static_cast<__half*>(p)[i] = __float2half_rn(x);
      break;
    default:
      static_cast<float*>(p)[i] = x;
  }
}

// The backward's outputs, token-major in their element types: dq, dk [tokens, H, K], dg
// [tokens, HV, K], dbeta [tokens, HV].
struct GradOut {
  void *dq, *dk, *dg, *dbeta;
  Elem eq, eg, eb;
};

// Scratch and head-major outputs of the chunk backward: row t of value head hv at hv * tokens + t.
template <typename T>
struct BwdWork {
  T *U, *dU, *dW, *ZW, *ZU, *kE, *qE;  // scratch (the bf16 kernels: ZW only)
  T *dq, *dk, *dg, *dbeta;              // outputs [HV, tokens, K] ([HV, tokens] for dbeta)
  // The bf16 kernels' chunk_bwd_dense results (else nullptr): dA, dAqk [HV, tokens, kChunk], sum_j
  // dS1 S0 [HV, slots, K] (then G_last's extra gradient).
  T *dA, *dAqk, *last;
};

// The chunk backward (both parts of chunk_bwd) on the prepared fp32 inputs.
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
  const int64_t gc = (hv * sq_.slots + slot) * K;
  chunk_bwd(tm, d, scale, sm.q, sm.k, sm.gates(), sm.v, sm.beta, in.A + row * kChunk, in.Aqk + row * kChunk,
            in.Minv + row * kChunk, in.W + row * K, in.Ut + row * V, in.Qg + row * K, in.Kd + row * K, in.gC + gc,
            starts + state, dends + state, dO + (t0 * z.HV + hv) * V, static_cast<int>(z.HV * V), sc, w.dq + row * K,
            w.dk + row * K, w.dg + row * K, dv + (t0 * z.HV + hv) * V, static_cast<int>(z.HV * V), w.dbeta + row);
}

// chunk_bwd_dense in bf16-product mode for K, V in {64, 128}: one block of 8 warps per (chunk,
// value head), every product an mma.sync on bf16 tiles in shared memory (fp32 accumulation),
// warp w taking rows 16 (w % 4).. and half of the columns. It takes the intra kernel's bf16
// terms, dO as scale dO in bf16, and v, beta as given. Results into w's dq (dQg), dk (dKd), ZW,
// dA, dAqk, last and dbeta, and dv (in v's type), as chunk_bwd_dense leaves them.
template <int kK>
struct BwdDenseBf16 {
  static constexpr int kThreads = 256;
  static constexpr int kLd = kMaxHeadDim + 8;  // bf16 rows of the [*, K] and [*, V] tiles
  static constexpr int kLdC = kChunk + 8;      // bf16 rows of Aqk and Minv
  static constexpr size_t bytes() {
    return 2 * (2 * kK * kLd + 7 * kChunk * kLd + 2 * kChunk * kLdC) + 4 * 2 * kChunk;
  }
};

template <int kK, typename T>
__global__ void __launch_bounds__(BwdDenseBf16<kK>::kThreads, 1)
    bwd_dense_bf16_kernel(Seqs sq_, int64_t HV, int V, Intra<__nv_bfloat16> in, const float* __restrict__ starts,
                          const float* __restrict__ dends, const __nv_bfloat16* __restrict__ dOs, RawIn<T> raw,
                          BwdWork<float> w, T* dv) {
  using bf16 = __nv_bfloat16;
  using Z = BwdDenseBf16<kK>;
  constexpr int kLd = Z::kLd, kLdC = Z::kLdC;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sS0 = reinterpret_cast<bf16*>(smem_raw);  // [kK, V]
  bf16* sdS1 = sS0 + kK * kLd;                     // [kK, V]
  bf16* sW = sdS1 + kK * kLd;                      // [64, K]
  bf16* sKd = sW + kChunk * kLd;                   // [64, K], then ZW
  bf16* sUt = sKd + kChunk * kLd;                  // [64, V]
  bf16* sdO = sUt + kChunk * kLd;                  // [64, V] (scale dO), then ZU
  bf16* sU = sdO + kChunk * kLd;                   // [64, V]
  bf16* sdU = sU + kChunk * kLd;                   // [64, V]
  bf16* sdW = sdU + kChunk * kLd;                  // [64, K]
  bf16* sAqk = sdW + kChunk * kLd;                 // [64, 64]
  bf16* sMinv = sAqk + kChunk * kLdC;              // [64, 64]
  float* sdb = reinterpret_cast<float*>(sMinv + kChunk * kLdC);  // [2, 64] halves of dbeta's first term

  const int64_t slot = blockIdx.x, hv = blockIdx.y;
  int64_t t0;
  int L;
  if (!sq_.locate(slot, t0, L) || !sq_.valid(slot, t0, L)) return;
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int rt = warp % 4, half = warp / 4;
  const int64_t row0 = hv * sq_.tokens + t0, gc = (hv * sq_.slots + slot) * kK, state = gc * V;
  const int64_t ldv = HV * V;  // token-major rows of dO, v, dv

  // The chunk's terms and dO (rows from L on zero) by bulk copies; the states (and sum_j dS1 S0
  // per row, in fp32) rounded to bf16 meanwhile.
  const auto rows = [&](const bf16* base, int64_t ld) {
    return [=](int r) { return r < L ? base + r * ld : nullptr; };
  };
  mma::gather_rows(sW, kLd, kChunk, kK, kK, rows(in.W + row0 * kK, kK));
  mma::gather_rows(sKd, kLd, kChunk, kK, kK, rows(in.Kd + row0 * kK, kK));
  mma::gather_rows(sUt, kLd, kChunk, V, V, rows(in.Ut + row0 * V, V));
  mma::gather_rows(sAqk, kLdC, kChunk, kChunk, kChunk, rows(in.Aqk + row0 * kChunk, kChunk));
  mma::gather_rows(sMinv, kLdC, kChunk, kChunk, kChunk, rows(in.Minv + row0 * kChunk, kChunk));
  mma::gather_rows(sdO, kLd, kChunk, V, V, rows(dOs + (t0 * HV + hv) * V, ldv));
  mma::cp_async_commit();
  constexpr int kRowsPerWarp = kK / (Z::kThreads / 32), kBatch = 4;
  for (int c0 = warp * kRowsPerWarp; c0 < (warp + 1) * kRowsPerWarp; c0 += kBatch) {
    float4 a[kBatch], b[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const bool in_row = lane * 4 < V;
      a[j] = in_row ? __ldg(reinterpret_cast<const float4*>(starts + state + (c0 + j) * V + lane * 4)) : float4{};
      b[j] = in_row ? __ldg(reinterpret_cast<const float4*>(dends + state + (c0 + j) * V + lane * 4)) : float4{};
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int c = c0 + j;
      if (lane * 4 < V) {
        *reinterpret_cast<uint2*>(sS0 + c * kLd + lane * 4) =
            make_uint2(mma::pack2<bf16>(a[j].x, a[j].y), mma::pack2<bf16>(a[j].z, a[j].w));
        *reinterpret_cast<uint2*>(sdS1 + c * kLd + lane * 4) =
            make_uint2(mma::pack2<bf16>(b[j].x, b[j].y), mma::pack2<bf16>(b[j].z, b[j].w));
      }
      const float dot = warp_reduce(a[j].x * b[j].x + a[j].y * b[j].y + a[j].z * b[j].z + a[j].w * b[j].w, SumOp{});
      if (lane == 0) w.last[gc + c] = dot;
    }
  }
  mma::cp_async_wait<0>();
  __syncthreads();

  float acc[8][4] = {};
  {  // U = Ut - W S0, dU = Aqk^T (scale dO) + Kd dS1 (rows from L on are zero in both)
    const int n0 = half * V / 2;
    warp_tile_product<false, false>(acc, sW, kLd, sS0, kLd, rt, n0, V, 0, kK / 16);
    drain_tile(acc, rt, n0, V, [&](int t, int col, float x0, float x1) {
      store_pair(sU + t * kLd + col, to_float(sUt[t * kLd + col]) - x0, to_float(sUt[t * kLd + col + 1]) - x1);
    });
    warp_tile_product<true, false>(acc, sAqk, kLdC, sdO, kLd, rt, n0, V, 0, kChunk / 16);
    warp_tile_product<false, false>(acc, sKd, kLd, sdS1, kLd, rt, n0, V, 0, kK / 16);
    drain_tile(acc, rt, n0, V, [&](int t, int col, float x0, float x1) { store_pair(sdU + t * kLd + col, x0, x1); });
  }
  __syncthreads();
  {  // dQg = (scale dO) S0^T, dKd = U dS1^T, dW = -dU S0^T, dAqk = (scale dO) U^T (s <= t)
    const int n0 = half * kK / 2;
    warp_tile_product<false, true>(acc, sdO, kLd, sS0, kLd, rt, n0, kK, 0, V / 16);
    drain_tile(acc, rt, n0, kK, [&](int t, int col, float x0, float x1) {
      if (t < L) store_pair(w.dq + (row0 + t) * kK + col, x0, x1);
    });
    warp_tile_product<false, true>(acc, sU, kLd, sdS1, kLd, rt, n0, kK, 0, V / 16);
    drain_tile(acc, rt, n0, kK, [&](int t, int col, float x0, float x1) {
      if (t < L) store_pair(w.dk + (row0 + t) * kK + col, x0, x1);
    });
    warp_tile_product<false, true>(acc, sdU, kLd, sS0, kLd, rt, n0, kK, 0, V / 16);
    drain_tile(acc, rt, n0, kK, [&](int t, int col, float x0, float x1) { store_pair(sdW + t * kLd + col, -x0, -x1); });
    warp_tile_product<false, true>(acc, sdO, kLd, sU, kLd, rt, half * kChunk / 2, kChunk, 0, V / 16);
    drain_tile(acc, rt, half * kChunk / 2, kChunk, [&](int t, int col, float x0, float x1) {
      if (t < L) store_pair(w.dAqk + (row0 + t) * kChunk + col, col <= t ? x0 : 0.f, col + 1 <= t ? x1 : 0.f);
    });
  }
  __syncthreads();
  {  // ZW = Minv^T dW (out, and over Kd), ZU = Minv^T dU (over dO), dv = diag(beta) ZU, sum_j ZU v
    warp_tile_product<true, false>(acc, sMinv, kLdC, sdW, kLd, rt, half * kK / 2, kK, 0, kChunk / 16);
    drain_tile(acc, rt, half * kK / 2, kK, [&](int t, int col, float x0, float x1) {
      store_pair(sKd + t * kLd + col, x0, x1);
      if (t < L) store_pair(w.ZW + (row0 + t) * kK + col, x0, x1);
    });
    warp_tile_product<true, false>(acc, sMinv, kLdC, sdU, kLd, rt, half * V / 2, V, 0, kChunk / 16);
    float part[2] = {0.f, 0.f};
    drain_tile(acc, rt, half * V / 2, V, [&](int t, int col, float x0, float x1) {
      store_pair(sdO + t * kLd + col, x0, x1);
      if (t < L) {
        const int64_t e = (t0 + t) * ldv + hv * V + col, eb = (t0 + t) * HV + hv;
        const float b = raw.beta_f32 ? __ldg(static_cast<const float*>(raw.beta) + eb)
                                     : to_float(__ldg(static_cast<const T*>(raw.beta) + eb));
        const float v0 = to_float(__ldg(raw.v + e)), v1 = to_float(__ldg(raw.v + e + 1));
        store_pair(dv + e, b * x0, b * x1);
        part[(t / 8) % 2] += x0 * v0 + x1 * v1;
      }
    });
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      part[hh] += __shfl_xor_sync(0xffffffffu, part[hh], 1);
      part[hh] += __shfl_xor_sync(0xffffffffu, part[hh], 2);
      if (lane % 4 == 0) sdb[half * kChunk + 16 * rt + lane / 4 + 8 * hh] = part[hh];
    }
  }
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < L) w.dbeta[row0 + threadIdx.x] = sdb[threadIdx.x] + sdb[kChunk + threadIdx.x];
  {  // dA = -(ZW W^T + ZU Ut^T), kept for s < t
    warp_tile_product<false, true>(acc, sKd, kLd, sW, kLd, rt, half * kChunk / 2, kChunk, 0, kK / 16);
    warp_tile_product<false, true>(acc, sdO, kLd, sUt, kLd, rt, half * kChunk / 2, kChunk, 0, V / 16);
    drain_tile(acc, rt, half * kChunk / 2, kChunk, [&](int t, int col, float x0, float x1) {
      if (t < L) store_pair(w.dA + (row0 + t) * kChunk + col, col < t ? -x0 : 0.f, col + 1 < t ? -x1 : 0.f);
    });
  }
}

// This block's chunk for the bf16 backward kernels: its tiles laid out from the front of shared
// memory (rest: the first byte after them), its first token t0 and length L.
template <int kK, typename T>
struct Chunk16 {
  ChunkTiles16<kK, T> ct;
  unsigned char* rest;
  int64_t t0, row0, gc;  // row0: the workspaces' row of step 0; gc: the [HV, slots, K] offset
  int L;
  // false for an unused slot, else the chunk is loaded.
  __device__ bool begin(const Seqs& sq_, int64_t H, int64_t HV, const RawIn<T>& in, unsigned char* smem) {
    ct = ChunkTiles16<kK, T>::carve(smem, &rest);
    if (!sq_.locate(blockIdx.x, t0, L) || !sq_.valid(blockIdx.x, t0, L)) return false;
    row0 = blockIdx.y * sq_.tokens + t0;
    gc = (blockIdx.y * sq_.slots + blockIdx.x) * kK;
    ct.load(in, H, HV, t0, L, blockIdx.y, nullptr, 0);
    return true;
  }
};

// bwd_pairs_diag_kernel's results for the rows i < n (up to 16) of one channel of a diagonal
// block (element i at at + i ld), the loads of kGroup rows issued together. ra[i] is replaced by
// row i's term of dbeta, ZW k exp(G) (its registers are free then); the return value is the
// channel's term of G_last's extra gradient over these rows, sum Kd dKd.
template <typename QN>
__device__ __forceinline__ float pairs_diag_out(int n, int64_t at, int ld, const float* beta, float gl,
                                                const float (&kn)[16], QN qn, const float (&G)[16],
                                                float (&ra)[16], const float (&rq)[16], const float (&cl)[16],
                                                const float* zw, float* dq, float* dk, float* dg) {
  constexpr int kGroup = 2;
  float last = 0.f;
#pragma unroll
  for (int i0 = 0; i0 < 16; i0 += kGroup) {
    float dqg[kGroup], dkd[kGroup], z[kGroup];
#pragma unroll
    for (int i = 0; i < kGroup; ++i) {
      const int64_t e = at + (i0 + i) * ld;
      dqg[i] = i0 + i < n ? dq[e] : 0.f;
      dkd[i] = i0 + i < n ? dk[e] : 0.f;
      z[i] = i0 + i < n ? __ldg(zw + e) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      const int i = i0 + j;
      const float eg = exp2_approx(G[i]), ed = exp2_approx(gl - G[i]), zg = z[j] * eg;
      last += kn[i] * ed * dkd[j];
      if (i < n) {
        const int64_t e = at + i * ld;
        const float bz = beta[i] * zg;
        dq[e] = dqg[j] * eg + rq[i];
        dk[e] = dkd[j] * ed + ra[i] + cl[i] + bz;
        const float qi = qn(i);
        dg[e] = dqg[j] * qi * eg - dkd[j] * kn[i] * ed + kn[i] * (ra[i] - cl[i] + bz) + qi * rq[i];
      }
      ra[i] = zg * kn[i];
    }
  }
  return last;
}

// chunk_bwd_pairs in bf16-product mode (bf16 / fp16 inputs, K 64 or 128), part 1 of 2, after
// bwd_dense_bf16_kernel: dbeta's other terms, G_last's extra gradient into w.last, and per element
// (t, c) the terms from dQg, dKd and ZW and the pairs inside the diagonal 16 x 16 blocks. A thread
// per (channel, diagonal block) walks the block's 136 pairs once, each pair's exp serving the row
// terms of t and the column term of s; the sums over channels and rows (dbeta, w.last) go
// through shared memory. dq, dk, dg into w (over dQg, dKd); part 2
// (bwd_pairs_offdiag_kernel) adds the pairs across blocks and the reverse cumsum.
template <int kK, typename T>
struct PairsDiag {
  using C = ChunkTiles16<kK, T>;
  static constexpr size_t bytes() { return C::bytes() + 4 * (2 * kChunk * kChunk + kChunk + kK); }
};

template <int kK, typename T>
__global__ void __launch_bounds__(ChunkTiles16<kK, T>::kThreads, 2)
    bwd_pairs_diag_kernel(Seqs sq_, int64_t H, int64_t HV, RawIn<T> in, const float* __restrict__ A, BwdWork<float> w,
                          GradOut out) {
  using C = ChunkTiles16<kK, T>;
  constexpr int kLdK = C::kLdK, kLdG = C::kLdG;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Chunk16<kK, T> ch;
  if (!ch.begin(sq_, H, HV, in, smem_raw)) return;
  const C& ct = ch.ct;
  const int L = ch.L;
  const int64_t row0 = ch.row0, gc = ch.gc;
  const T *sq = ct.q, *sk = ct.k;
  const float *sG = ct.G, *sbeta = ct.beta, *srq = ct.rq, *srk = ct.rk;
  float* sdA = reinterpret_cast<float*>(ch.rest);  // [kChunk, kChunk]: beta_t dA_ts
  float* sdAqk = sdA + kChunk * kChunk;            // [kChunk, kChunk]
  float* sdb = sdAqk + kChunk * kChunk;            // [kChunk]: dbeta's terms here
  float* slast = sdb + kChunk;                     // [kK]: sum_t Kd dKd
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const float* Gl = sG + (L - 1) * kLdG;
  if (tid < kChunk) sdb[tid] = 0.f;
  if (tid < kK) slast[tid] = 0.f;
  __syncthreads();

  {  // dA (times beta_t) and dAqk staged; dbeta_t += sum_{s<t} dA A (iteration j: rows warp / 2 + 4 j)
    constexpr int kIters = kChunk * kChunk / C::kThreads;
    static_assert(kIters == 16, "a transposed sum over 16 rows");
#pragma unroll 8
    for (int j = 0; j < kIters; ++j) {
      const int i = tid + j * C::kThreads, t = i / kChunk;
      sdA[i] = t < L ? sbeta[t] * __ldg(w.dA + row0 * kChunk + i) : 0.f;
      sdAqk[i] = t < L ? __ldg(w.dAqk + row0 * kChunk + i) : 0.f;
    }
    float da_a[kIters];
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const int i = tid + j * C::kThreads, t = i / kChunk;
      da_a[j] = t < L ? __ldg(w.dA + row0 * kChunk + i) * __ldg(A + row0 * kChunk + i) : 0.f;
    }
    const float sum = warp_sum_transposed(da_a);
    if (lane < kIters) atomicAdd(sdb + warp / 2 + 4 * lane, sum);
  }
  __syncthreads();

  // Per (channel, diagonal block), a warp sharing its block: the block's pairs, then the outputs,
  // dbeta's ZW k exp(G) summed over the warp's channels, sum_t Kd dKd over the block's rows.
  for (int task = tid; task < 4 * kK; task += C::kThreads) {
    const int c = task % kK, b0 = task / kK * 16;
    if (b0 >= L) continue;
    // q's normalised row i of the block, from shared memory where needed (not held in registers)
    const auto qn = [&](int i) { return to_float(sq[(b0 + i) * kLdK + c]) * srq[b0 + i]; };
    float kn[16], G[16], ra[16], rq[16], cl[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      kn[i] = to_float(sk[(b0 + i) * kLdK + c]) * srk[b0 + i];
      G[i] = sG[(b0 + i) * kLdG + c];
      ra[i] = rq[i] = cl[i] = 0.f;
    }
#pragma unroll
    for (int t = 0; t < 16; ++t) {
      const float qt = qn(t);
#pragma unroll
      for (int s = 0; s <= t; ++s) {
        const float e = exp2_approx(G[t] - G[s]), x = kn[s] * e;
        const float da = sdA[(b0 + t) * kChunk + b0 + s], dq = sdAqk[(b0 + t) * kChunk + b0 + s];
        ra[t] += da * x;
        rq[t] += dq * x;
        cl[s] += (da * kn[t] + dq * qt) * e;
      }
    }
    const float last = pairs_diag_out(L - b0, (row0 + b0) * kK + c, kK, sbeta + b0, Gl[c], kn, qn, G, ra, rq, cl,
                                      w.ZW, w.dq, w.dk, w.dg);
    atomicAdd(slast + c, last);
    const float zsum = warp_sum_transposed(ra);  // dbeta's terms now
    if (lane < 16) atomicAdd(sdb + b0 + lane, zsum);
  }
  __syncthreads();
  if (tid < L) {
    const float db = w.dbeta[row0 + tid] + sdb[tid];
    if (out.dbeta != nullptr) {
      store_elem(out.dbeta, (ch.t0 + tid) * HV + blockIdx.y, db, out.eb);
    } else {
      w.dbeta[row0 + tid] = db;
    }
  }
  if (tid < kK) w.last[gc + tid] = w.last[gc + tid] * exp2_approx(Gl[tid]) + slast[tid];
}

// Part 2 of 2: the pairs across diagonal blocks as mma.sync products on bf16 tiles, the operands
// scaled to one reference row per warp as in the intra kernel. Warp w owns the rows of block
// b = w % 4 and half of the columns. Row terms (b >= 1, r = 16 b): exp(G_t - G_r) times
// (dA Ks_r, dAqk Ks_r) with Ks_r = k_s exp(G_r - G_s) over s < r. Column terms (b <= 2, r' = 16 b
// + 16): exp(G_r' - G_s) times (dA^T kE_r' + dAqk^T qE_r') over the rows t >= r', kE_r', qE_r' =
// k_t, q_t exp(G_t - G_r'). Every factor is at most 1. The terms are staged in shared memory (over
// the spent operands), then one pass adds them to dq, dk, dg and takes dg's reverse cumsum from
// w.last.
template <int kK, typename T>
struct PairsOffdiag {
  using C = ChunkTiles16<kK, T>;
  static constexpr int kLdK = C::kLdK, kLdC = kChunk + 8, kLdS = kK + 8;
  // Ks_16, Ks_32, Ks_48 (16, 32, 48 rows) and kE_16, kE_32, kE_48 (48, 32, 16 rows): 96 rows each.
  static constexpr int kSlabRows = 96;
  static constexpr size_t kOperands = 2 * (2 * kChunk * kLdC + 3 * kSlabRows * kLdK);
  static constexpr size_t kStaging = 4 * 3 * kChunk * kLdS;  // the dq, dk, dg terms in fp32
  static constexpr size_t bytes() { return C::bytes() + (kOperands > kStaging ? kOperands : kStaging); }
  // First row of slab j (reference row 16 j + 16) among the Ks and the kE / qE rows.
  __device__ static int ks_row(int j) { return j == 0 ? 0 : j == 1 ? 16 : 48; }
  __device__ static int e_row(int j) { return j == 0 ? 0 : j == 1 ? 48 : 80; }
};

template <int kK, typename T>
__global__ void __launch_bounds__(ChunkTiles16<kK, T>::kThreads, 1)
    bwd_pairs_offdiag_kernel(Seqs sq_, int64_t H, int64_t HV, RawIn<T> in, BwdWork<float> w, GradOut out) {
  using bf16 = __nv_bfloat16;
  using C = ChunkTiles16<kK, T>;
  using Z = PairsOffdiag<kK, T>;
  constexpr int kLdK = C::kLdK, kLdG = C::kLdG, kLdC = Z::kLdC, kLdS = Z::kLdS;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Chunk16<kK, T> ch;
  if (!ch.begin(sq_, H, HV, in, smem_raw)) return;
  const C& ct = ch.ct;
  const int L = ch.L;
  const int64_t row0 = ch.row0, gc = ch.gc;
  bf16* sdA = reinterpret_cast<bf16*>(ch.rest);  // [kChunk, kLdC]: beta_t dA_ts
  bf16* sdAqk = sdA + kChunk * kLdC;              // [kChunk, kLdC]
  bf16* sKs = sdAqk + kChunk * kLdC;              // [96, kLdK]
  bf16* skE = sKs + Z::kSlabRows * kLdK;          // [96, kLdK]
  bf16* sqE = skE + Z::kSlabRows * kLdK;          // [96, kLdK]
  float* sSq = reinterpret_cast<float*>(ch.rest);  // [kChunk, kLdS] each, over the operands
  float* sSk = sSq + kChunk * kLdS;
  float* sSg = sSk + kChunk * kLdS;
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const auto kn = [&](int t, int c) { return to_float(ct.k[t * kLdK + c]) * ct.rk[t]; };
  const auto qn = [&](int t, int c) { return to_float(ct.q[t * kLdK + c]) * ct.rq[t]; };
  const auto G = [&](int t, int c) { return ct.G[t * kLdG + c]; };

#pragma unroll 8
  for (int i = tid; i < kChunk * kChunk / 2; i += C::kThreads) {
    const int t = i / (kChunk / 2), s = i % (kChunk / 2) * 2;
    const float b = t < L ? ct.beta[t] : 0.f;
    const float2 da = t < L ? __ldg(reinterpret_cast<const float2*>(w.dA + (row0 + t) * kChunk + s)) : float2{};
    const float2 dq = t < L ? __ldg(reinterpret_cast<const float2*>(w.dAqk + (row0 + t) * kChunk + s)) : float2{};
    store_pair(sdA + t * kLdC + s, b * da.x, b * da.y);
    store_pair(sdAqk + t * kLdC + s, dq.x, dq.y);
  }
  for (int i = tid; i < Z::kSlabRows * kK; i += C::kThreads) {
    const int j = i / kK, c = i % kK;
    {  // Ks_r row s
      const int slab = j < 16 ? 0 : j < 48 ? 1 : 2, r = 16 * slab + 16, s = j - Z::ks_row(slab);
      sKs[j * kLdK + c] = __float2bfloat16_rn(kn(s, c) * exp2_approx(G(r, c) - G(s, c)));
    }
    {  // kE_r, qE_r row t
      const int slab = j < 48 ? 0 : j < 80 ? 1 : 2, r = 16 * slab + 16, t = r + j - Z::e_row(slab);
      const float e = exp2_approx(G(t, c) - G(r, c));
      skE[j * kLdK + c] = __float2bfloat16_rn(kn(t, c) * e);
      sqE[j * kLdK + c] = __float2bfloat16_rn(qn(t, c) * e);
    }
  }
  __syncthreads();

  const int rt = warp % 4, n0 = warp / 4 * kK / 2;
  float ya[8][4] = {}, yq[8][4] = {}, x[8][4] = {};
  if (rt >= 1) {  // block rt's rows from the keys before it
    const bf16* Ks = sKs + Z::ks_row(rt - 1) * kLdK;
    warp_tile_product<false, false>(ya, sdA, kLdC, Ks, kLdK, rt, n0, kK, 0, rt);
    warp_tile_product<false, false>(yq, sdAqk, kLdC, Ks, kLdK, rt, n0, kK, 0, rt);
  }
  if (rt <= 2) {  // block rt's rows as keys of the later rows (operand rows t - r' + e_row)
    const int off = (Z::e_row(rt) - 16 * (rt + 1)) * kLdK;
    warp_tile_product<true, false>(x, sdA, kLdC, skE + off, kLdK, rt, n0, kK, rt + 1, 4);
    warp_tile_product<true, false>(x, sdAqk, kLdC, sqE + off, kLdK, rt, n0, kK, rt + 1, 4);
  }
  __syncthreads();  // the operands are spent: the staging goes over them
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    if (n < kK / 16) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = 16 * rt + lane / 4 + 8 * (e / 2), c = n0 + 8 * n + 2 * (lane % 4) + e % 2;
        const float fr = rt >= 1 ? exp2_approx(G(t, c) - G(16 * rt, c)) : 0.f;
        const float fc = rt <= 2 ? exp2_approx(G(16 * rt + 16, c) - G(t, c)) : 0.f;
        const float pa = fr * ya[n][e], pq = fr * yq[n][e], pc = fc * x[n][e];
        sSq[t * kLdS + c] = pq;
        sSk[t * kLdS + c] = pa + pc;
        sSg[t * kLdS + c] = kn(t, c) * (pa - pc) + qn(t, c) * pq;
      }
    }
  }
  __syncthreads();

  // dq, dk, dg += the staged terms, then dg's reverse cumsum: a thread per channel and part of
  // the rows, each part's old values loaded together.
  constexpr int kParts = C::kThreads / kK, kRows = kChunk / kParts;
  const int c = tid % kK, p0 = tid / kK;
  float old[kRows];
  const auto add_staged = [&](float* d, const float* st) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int t = p0 * kRows + i;
      old[i] = t < L ? d[(row0 + t) * kK + c] : 0.f;
    }
#pragma unroll
    for (int i = 0; i < kRows; ++i) old[i] += st[(p0 * kRows + i) * kLdS + c];
  };
  const bool direct = out.dq != nullptr;
  for (int which = 0; which < 2; ++which) {
    float* d = which == 0 ? w.dq : w.dk;
    float* st = which == 0 ? sSq : sSk;
    add_staged(d, st);
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int t = p0 * kRows + i;
      if (direct) {
        st[t * kLdS + c] = old[i];  // the normalisation's pass below takes them from here
      } else if (t < L) {
        d[(row0 + t) * kK + c] = old[i];
      }
    }
  }
  add_staged(w.dg, sSg);
  float run = 0.f;
#pragma unroll
  for (int i = kRows - 1; i >= 0; --i) {
    run += old[i];
    old[i] = run;
  }
  ct.part[p0 * kK + c] = run;
  __syncthreads();
  float base = w.last[gc + c];
  for (int p = p0 + 1; p < kParts; ++p) base += ct.part[p * kK + c];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int t = p0 * kRows + i;
    if (t < L && direct) {
      store_elem(out.dg, ((ch.t0 + t) * HV + blockIdx.y) * kK + c, old[i] + base, out.eg);
    } else if (t < L) {
      w.dg[(row0 + t) * kK + c] = old[i] + base;
    }
  }
  if (!direct) return;
  // dq, dk w.r.t. the raw q, k (HV == H): through the normalisation, (d - n (n . d)) r; a warp per row.
  __syncthreads();
  for (int task = warp; task < 2 * L; task += C::kThreads / 32) {
    const bool is_k = task >= L;
    const int t = task % L;
    const float* d = (is_k ? sSk : sSq) + t * kLdS;
    const T* x = (is_k ? ct.k : ct.q) + t * kLdK;
    const float r = (is_k ? ct.rk : ct.rq)[t];
    float ds[kK / 32], n[kK / 32], nd = 0.f;
#pragma unroll
    for (int i = 0; i < kK / 32; ++i) {
      ds[i] = d[lane + 32 * i];
      n[i] = to_float(x[lane + 32 * i]) * r;
      nd += n[i] * ds[i];
    }
    nd = in.l2norm ? warp_reduce(nd, SumOp{}) : 0.f;
#pragma unroll
    for (int i = 0; i < kK / 32; ++i) {
      store_elem(is_k ? out.dk : out.dq, ((ch.t0 + t) * HV + blockIdx.y) * kK + lane + 32 * i, (ds[i] - n[i] * nd) * r,
                 out.eq);
    }
  }
}

constexpr int kRowWarps = 8;  // warps per block of the row kernels

// One row of K (<= 128) elements of type e at p + at into x (element lane + 32 i, zeros past K);
// returns 1 / sqrt(|x|^2 + eps), or 1 without l2norm. Every lane of the warp calls it.
__device__ __forceinline__ float load_row(const void* p, int64_t at, int K, Elem e, bool l2norm,
                                          float (&x)[kMaxHeadDim / 32]) {
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxHeadDim / 32; ++i) {
    const int c = static_cast<int>(threadIdx.x % 32) + 32 * i;
    x[i] = c < K ? load_elem(p, at + c, e) : 0.f;
    ss += x[i] * x[i];
  }
  return l2norm ? rsqrtf(warp_reduce(ss, SumOp{}) + kNormEps) : 1.f;
}

// Rows of K (<= 128) elements: out = x r in fp32 (load_row's r); a warp per row.
__global__ void __launch_bounds__(32 * kRowWarps) l2norm_rows_kernel(const void* x, Elem e, int64_t rows, int K,
                                                                    bool l2norm, float* out) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (row >= rows) return;
  float xs[kMaxHeadDim / 32];
  const float r = load_row(x, row * K, K, e, l2norm, xs);
#pragma unroll
  for (int i = 0; i < kMaxHeadDim / 32; ++i) {
    if (lane + 32 * i < K) out[row * K + lane + 32 * i] = xs[i] * r;
  }
}

// The CUDA backward's last step, a warp per (token, task): the gradients w.r.t. the raw q, k
// (each head's value heads summed, then through the normalisation: (d - n (n . d)) r with n = x r,
// r = 1 / sqrt(|x|^2 + eps) from the raw rows x), dg and dbeta token-major, each in its output
// type. Inputs head-major: [HV, tokens, K], [HV, tokens].
struct FinishArgs {
  const float *dq, *dk, *dg, *dbeta;
  const void *q, *k;  // the raw q, k [tokens, H, K] (element type eqk)
  Elem eqk;
  bool l2norm;
  GradOut o;
  int64_t tokens;
  int H, HV, K;
};

__global__ void __launch_bounds__(32 * kRowWarps) finish_grads_kernel(FinishArgs a) {
  const int lane = static_cast<int>(threadIdx.x % 32), group = a.HV / a.H;
  const int64_t t = blockIdx.x;
  const int task = static_cast<int>(blockIdx.y * kRowWarps + threadIdx.x / 32);
  if (task >= 2 * a.H + a.HV) return;
  if (task < 2 * a.H) {
    const bool is_k = task >= a.H;
    const int h = task % a.H;
    const float* d = is_k ? a.dk : a.dq;
    const int64_t at_row = (t * a.H + h) * a.K;
    float ds[kMaxHeadDim / 32], x[kMaxHeadDim / 32], nd = 0.f;
    const float r = load_row(is_k ? a.k : a.q, at_row, a.K, a.eqk, a.l2norm, x);
#pragma unroll
    for (int i = 0; i < kMaxHeadDim / 32; ++i) {
      const int c = lane + 32 * i;
      ds[i] = 0.f;
      if (c < a.K) {
        for (int j = 0; j < group; ++j) ds[i] += d[((h * group + j) * a.tokens + t) * a.K + c];
      }
      nd += x[i] * ds[i];
    }
    nd = a.l2norm ? warp_reduce(nd, SumOp{}) * r : 0.f;
#pragma unroll
    for (int i = 0; i < kMaxHeadDim / 32; ++i) {
      const int c = lane + 32 * i;
      if (c < a.K) store_elem(is_k ? a.o.dk : a.o.dq, at_row + c, (ds[i] - x[i] * r * nd) * r, a.o.eq);
    }
  } else {
    const int hv = task - 2 * a.H;
    for (int c = lane; c < a.K; c += 32) {
      store_elem(a.o.dg, (t * a.HV + hv) * a.K + c, a.dg[(hv * a.tokens + t) * a.K + c], a.o.eg);
    }
    if (lane == 0) store_elem(a.o.dbeta, t * a.HV + hv, a.dbeta[hv * a.tokens + t], a.o.eb);
  }
}

struct Launch {
  Seqs seqs;
  cudaStream_t stream;
};

Launch launch_setup(const Problem& p, const at::Tensor& ref) {
  elem_of(ref);  // float64 is the CPU kernel's
  const int64_t tokens = p.B * p.T;
  // Upper bound of the chunk count that needs no look at cu_seqlens: sum ceil(len/64) <= T/64 + N.
  const int64_t slots = p.cu_seqlens.defined() ? tokens / kChunk + p.N : p.N * ((p.T + kChunk - 1) / kChunk);
  const int32_t* cu = p.cu_seqlens.defined() ? p.cu_seqlens.data_ptr<int32_t>() : nullptr;
  return Launch{Seqs{cu, p.N, p.T, tokens, slots}, c10::cuda::getCurrentCUDAStream(ref.get_device()).stream()};
}

// f(std::integral_constant<int, K>, T{}) for the bf16 kernels' head size K and input type T.
template <typename F>
void with_bf16_types(const Problem& p, const at::Tensor& q, F f) {
  const auto run = [&](auto tag) {
    if (p.K == 128) {
      f(std::integral_constant<int, 128>{}, tag);
    } else {
      f(std::integral_constant<int, 64>{}, tag);
    }
  };
  if (q.scalar_type() == at::kBFloat16) {
    run(__nv_bfloat16{});
  } else {
    run(__half{});
  }
}

template <typename T>
RawIn<T> raw_in(const Inputs& raw, bool l2norm) {
  return RawIn<T>{static_cast<const T*>(raw.q.data_ptr()),
                  static_cast<const T*>(raw.k.data_ptr()),
                  static_cast<const T*>(raw.v.data_ptr()),
                  raw.g.data_ptr(),
                  raw.beta.data_ptr(),
                  raw.g.scalar_type() == at::kFloat,
                  raw.beta.scalar_type() == at::kFloat,
                  l2norm};
}

// intra_bf16_kernel over every chunk slot, on the raw inputs.
template <int kK, typename T>
void run_intra_bf16(const Problem& p, const Inputs& raw, bool l2norm, const Launch& l, const Intra<__nv_bfloat16>& w) {
  if (l.seqs.slots == 0) return;
  const RawIn<T> in = raw_in<T>(raw, l2norm);
  const auto kernel = intra_bf16_kernel<kK, T>;
  set_smem(kernel, IntraBf16<kK>::bytes());
  kernel<<<dim3(l.seqs.slots, p.HV), IntraBf16<kK>::kThreads, IntraBf16<kK>::bytes(), l.stream>>>(
      l.seqs, p.H, p.HV, static_cast<int>(p.V), in, w);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The forward's workspace of chunk_mark_nonfinite's marks, [HV, slots, V + 1].
unsigned char* marks(const Problem& p, const Launch& l, const at::TensorOptions& opts, std::vector<at::Tensor>& keep) {
  keep.push_back(at::empty({std::max<int64_t>(1, p.HV * l.seqs.slots * (p.V + 1))}, opts.dtype(at::kByte)));
  return keep.back().data_ptr<unsigned char>();
}

// The intra-chunk terms of every chunk from the prepared inputs into fp32 workspaces (A and Minv
// only for the backward).
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
                   ws(std::max<int64_t>(1, p.HV * l.seqs.slots * p.K)), for_bwd ? nullptr : marks(p, l, opts, keep)};
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
    launch(generic, state_smem_bytes(p.K), kThreads);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Forward state passing (o, ht, starts each may be nullptr).
void run_state_fwd(const Problem& p, const Launch& l, const Intra<float>& intra, const float* h0, float* o, float* ht,
                   float* starts) {
  run_state_pass(p, l, state_fwd_kernel<float>, state_fwd_bf16_kernel<128, float, float>,
                 state_fwd_bf16_kernel<64, float, float>, intra, h0, o, ht, starts);
}

// The bf16 kernels' workspaces of the intra-chunk terms (A in fp32 and Minv for the backward),
// filled by intra_bf16_kernel from the raw inputs.
template <int kK, typename T>
Intra<__nv_bfloat16> run_intra_bf16_ws(const Problem& p, const Inputs& raw, bool l2norm, const Launch& l,
                                       bool for_bwd, std::vector<at::Tensor>& keep) {
  using bf16 = __nv_bfloat16;
  const int64_t rows = p.HV * l.seqs.tokens;
  const auto ws = [&](int64_t n, at::ScalarType type) {
    keep.push_back(at::empty({std::max<int64_t>(1, n)}, raw.q.options().dtype(type)));
    return keep.back().data_ptr();
  };
  const auto ws16 = [&](int64_t n) { return static_cast<bf16*>(ws(n, at::kBFloat16)); };
  const Intra<bf16> w{for_bwd ? static_cast<float*>(ws(rows * kChunk, at::kFloat)) : nullptr,
                      for_bwd ? ws16(rows * kChunk) : nullptr,
                      ws16(rows * kChunk),
                      ws16(rows * kK),
                      ws16(rows * p.V),
                      ws16(rows * kK),
                      ws16(rows * kK),
                      static_cast<float*>(ws(p.HV * l.seqs.slots * kK, at::kFloat)),
                      for_bwd ? nullptr : marks(p, l, raw.q.options(), keep)};
  run_intra_bf16<kK, T>(p, raw, l2norm, l, w);
  return w;
}

// state_fwd_bf16_kernel on bf16 terms (o in O, ht, starts each may be nullptr).
template <int kK, typename O>
void run_state_fwd_bf16(const Problem& p, const Launch& l, const Intra<__nv_bfloat16>& w, const Inputs& raw, O* o,
                        float* ht, float* starts) {
  using F = Bf16State<kK, __nv_bfloat16>;
  const auto kernel = state_fwd_bf16_kernel<kK, __nv_bfloat16, O>;
  set_smem(kernel, F::bytes());
  kernel<<<state_grid(p), F::kThreads, F::bytes(), l.stream>>>(
      l.seqs, Sizes<float>{p.H, p.HV, p.K, p.V, true}, static_cast<float>(p.scale), w,
      raw.initial_state.defined() ? raw.initial_state.data_ptr<float>() : nullptr, o, ht, starts);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The bf16 forward: intra_bf16_kernel on the raw inputs, the state pass on its bf16 terms, o in T.
template <int kK, typename T>
void run_fwd_bf16(const Problem& p, const Inputs& raw, bool l2norm, const Launch& l, T* o, float* ht) {
  std::vector<at::Tensor> keep;
  const Intra<__nv_bfloat16> w = run_intra_bf16_ws<kK, T>(p, raw, l2norm, l, false, keep);
  if (p.N > 0) run_state_fwd_bf16<kK, T>(p, l, w, raw, o, ht, nullptr);
}

// The finishing pass (group sum, normalisation, token-major, output types) over head-major dq,
// dk, dg, dbeta.
void run_finish(const Problem& p, const Launch& l, const float* dq, const float* dk, const float* dg,
                const float* dbeta, const at::Tensor& q, const at::Tensor& k, bool l2norm, const GradOut& out) {
  const FinishArgs a{dq,     dk,  dg,           dbeta, q.data_ptr(), k.data_ptr(), elem_of(q),
                     l2norm, out, l.seqs.tokens, static_cast<int>(p.H), static_cast<int>(p.HV), static_cast<int>(p.K)};
  const dim3 grid(static_cast<unsigned>(l.seqs.tokens),
                  static_cast<unsigned>(ceil_div(2 * p.H + p.HV, int64_t{kRowWarps})));
  finish_grads_kernel<<<grid, 32 * kRowWarps, 0, l.stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

GradOut grad_out(const Grads& gr) {
  return GradOut{gr.dq.data_ptr(), gr.dk.data_ptr(), gr.dg.data_ptr(), gr.dbeta.data_ptr(),
                 elem_of(gr.dq),   elem_of(gr.dg),   elem_of(gr.dbeta)};
}

// The bf16 backward: the intra-chunk terms in bf16 from the raw inputs, both state passes on them
// (dOs = scale dO in bf16), then per chunk the dense part and the two pair kernels; these write
// the final gradients where HV == H, else head-major fp32 for the finishing pass.
template <int kK, typename T>
void run_bwd_bf16(const Problem& p, const Inputs& raw, bool l2norm, const Launch& l, const at::Tensor& dOs,
                  const float* dht, Grads& gr) {
  using bf16 = __nv_bfloat16;
  std::vector<at::Tensor> keep;
  const Intra<bf16> intra = run_intra_bf16_ws<kK, T>(p, raw, l2norm, l, true, keep);
  const auto f32 = raw.q.options().dtype(at::kFloat);
  const int64_t rows = p.HV * l.seqs.tokens;
  const at::Tensor starts = at::empty({std::max<int64_t>(1, p.HV * l.seqs.slots * kK * p.V)}, f32);
  const at::Tensor dends = at::empty_like(starts);
  if (p.N > 0) {
    run_state_fwd_bf16<kK, float>(p, l, intra, raw, nullptr, nullptr, starts.data_ptr<float>());
    using F = Bf16State<kK, bf16>;
    const auto kernel = state_bwd_bf16_kernel<kK, bf16>;
    set_smem(kernel, F::bytes());
    kernel<<<state_grid(p), F::kThreads, F::bytes(), l.stream>>>(
        l.seqs, Sizes<float>{p.H, p.HV, p.K, p.V, true}, static_cast<float>(p.scale), intra,
        static_cast<const bf16*>(dOs.data_ptr()), dht, dends.data_ptr<float>(), gr.dinitial_state.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (rows == 0 || l.seqs.slots == 0) return;
  const auto ws = [&](int64_t n) {
    keep.push_back(at::empty({std::max<int64_t>(1, n)}, f32));
    return keep.back().data_ptr<float>();
  };
  // Head-major: dq, dk, dg, dbeta (every row of a chunk is written), ZW, dA, dAqk, sum_j dS1 S0.
  const BwdWork<float> w{nullptr, nullptr, nullptr, ws(rows * kK), nullptr, nullptr, nullptr,
                         ws(rows * kK), ws(rows * kK), ws(rows * kK), ws(rows),
                         ws(rows * kChunk), ws(rows * kChunk), ws(p.HV * l.seqs.slots * kK)};
  const GradOut out = grad_out(gr);
  const bool direct = p.HV == p.H;
  const RawIn<T> ri = raw_in<T>(raw, l2norm);
  const dim3 grid(static_cast<unsigned>(l.seqs.slots), static_cast<unsigned>(p.HV));
  const auto dense = bwd_dense_bf16_kernel<kK, T>;
  set_smem(dense, BwdDenseBf16<kK>::bytes());
  dense<<<grid, BwdDenseBf16<kK>::kThreads, BwdDenseBf16<kK>::bytes(), l.stream>>>(
      l.seqs, p.HV, static_cast<int>(p.V), intra, starts.data_ptr<float>(), dends.data_ptr<float>(),
      static_cast<const bf16*>(dOs.data_ptr()), ri, w, static_cast<T*>(gr.dv.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const auto diag = bwd_pairs_diag_kernel<kK, T>;
  set_smem(diag, PairsDiag<kK, T>::bytes());
  diag<<<grid, ChunkTiles16<kK, T>::kThreads, PairsDiag<kK, T>::bytes(), l.stream>>>(
      l.seqs, p.H, p.HV, ri, intra.A, w, direct ? out : GradOut{});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const auto offdiag = bwd_pairs_offdiag_kernel<kK, T>;
  set_smem(offdiag, PairsOffdiag<kK, T>::bytes());
  offdiag<<<grid, ChunkTiles16<kK, T>::kThreads, PairsOffdiag<kK, T>::bytes(), l.stream>>>(
      l.seqs, p.H, p.HV, ri, w, direct ? out : GradOut{});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (!direct) run_finish(p, l, w.dq, w.dk, w.dg, w.dbeta, raw.q, raw.k, l2norm, out);
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

bool bf16_fwd_supported(const Problem& p, const at::Tensor& q) {
  return q.is_cuda() && p.bf16_products && (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf) &&
         (p.K == 64 || p.K == 128) && (p.V == 64 || p.V == 128);
}

void fwd_cuda_bf16(const Problem& p, const Inputs& raw, bool l2norm, at::Tensor& o, at::Tensor& final_state) {
  const c10::cuda::CUDAGuard guard(raw.q.device());
  const Launch l = launch_setup(p, raw.q);
  float* ht = final_state.defined() ? final_state.data_ptr<float>() : nullptr;
  with_bf16_types(p, raw.q, [&](auto k, auto tag) {
    using T = decltype(tag);
    run_fwd_bf16<decltype(k)::value, T>(p, raw, l2norm, l, static_cast<T*>(o.data_ptr()), ht);
  });
}

void bwd_cuda_bf16(const Problem& p, const Inputs& raw, bool l2norm, const at::Tensor& dOs,
                   const at::Tensor& grad_final_state, Grads& gr) {
  const c10::cuda::CUDAGuard guard(raw.q.device());
  const Launch l = launch_setup(p, raw.q);
  const float* dht = grad_final_state.defined() ? grad_final_state.data_ptr<float>() : nullptr;
  with_bf16_types(p, raw.q, [&](auto k, auto tag) {
    run_bwd_bf16<decltype(k)::value, decltype(tag)>(p, raw, l2norm, l, dOs, dht, gr);
  });
}

void bwd_cuda(const Problem& p, const Inputs& in, const at::Tensor& q, const at::Tensor& k, bool l2norm,
              const at::Tensor& grad_o, const at::Tensor& grad_final_state, Grads& gr) {
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
    run_state_pass(p, l, state_bwd_kernel<float>, state_bwd_bf16_kernel<128, float>, state_bwd_bf16_kernel<64, float>,
                   intra, dO, dht, dends.data_ptr<float>(), gr.dinitial_state.data_ptr<float>());
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
  const BwdWork<float> w{ws(rows * p.V),       ws(rows * p.V),          ws(rows * p.K),       ws(rows * p.K),
                         ws(rows * p.V),       ws(rows * p.K),          ws(rows * p.K),       dq.data_ptr<float>(),
                         dk.data_ptr<float>(), dg.data_ptr<float>(),    dbeta.data_ptr<float>(), nullptr,
                         nullptr,              nullptr};
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
  run_finish(p, l, dq.data_ptr<float>(), dk.data_ptr<float>(), dg.data_ptr<float>(), dbeta.data_ptr<float>(), q, k,
             l2norm, grad_out(gr));
}

at::Tensor l2norm_rows_cuda(const at::Tensor& x, bool l2norm) {
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  const int64_t K = x.size(-1), rows = K > 0 ? x.numel() / K : 0;
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  if (rows > 0) {
    l2norm_rows_kernel<<<static_cast<unsigned>(ceil_div(rows, int64_t{kRowWarps})), 32 * kRowWarps, 0,
                         c10::cuda::getCurrentCUDAStream(x.get_device()).stream()>>>(
        xc.data_ptr(), elem_of(xc), rows, static_cast<int>(K), l2norm, out.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

}  // namespace kda_dsa_ops::kda
