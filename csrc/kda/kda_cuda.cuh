// The CUDA kernels' shared parts: the block team (chunk_algebra's products on the tensor
// cores), the sequences of a call, the workspaces between the stages, the launch context and
// the stages' launchers. The stages, one file each:
//   intra_cuda.cu   one block per (chunk, value head), all chunks at once: the state-free terms
//                   A, Aqk, Minv, W, Ut, Qg, Kd, gC of kda_chunk.h into head-major workspaces
//   state_cuda.cu   one block per (64-column value tile, value head, sequence), chunks in order
//                   (backward: in reverse), the state tile on chip: U = Ut - W S,
//                   O = scale (Qg S + Aqk U), S <- diag(gC) S + Kd^T U, and the backward's
//                   end-state gradient of every chunk
//   bwd_cuda.cu     one block per (chunk, value head): every gradient of the chunk, then the
//                   finishing pass (group sum, normalisation, output types)
//   kda_cuda.cu     the forward and backward as sequences of the stages, and the row kernel
// Two families run through the stages: the generic one (fp32 workspaces, any K, V <= 128,
// products 3xTF32 or bf16 operands) and the bf16 one (bf16-product mode, K 64 or 128, bf16
// workspaces, the op's raw inputs read by the intra kernel; tiles16.cuh).
// No host synchronisation: with cu_seqlens each block finds its chunk from the device copy.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <vector>

#include "common/device.cuh"
#include "common/mma.cuh"
#include "kda/kda.h"
#include "kda/kda_chunk.h"

namespace kda_dsa_ops::kda {

constexpr int kThreads = 512;      // threads of the generic kernels' blocks
constexpr int kStateCols = 64;     // state columns per block of the state kernels
constexpr int kRowWarps = 8;       // warps per block of the row kernels

// Bytes between the rows of the forward's marks ([HV, slots, stride]: mark[j < V], then the first
// of all at V; chunk_mark_nonfinite's): whole 16-byte pieces, which the wgmma state pass stages
// with the chunk's tiles.
__host__ __device__ constexpr int64_t mark_stride(int64_t V) { return (V + 16) / 16 * 16; }

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
        mma::split_tf32(a, a_hi, a_lo);
#pragma unroll
        for (int j = 0; j < NB; ++j) {
          const int cb = n_first + 8 * j + g;
          const float b[2] = {cb < N && kc[0] < Kn ? B(kc[0], cb) : 0.f, cb < N && kc[1] < Kn ? B(kc[1], cb) : 0.f};
          uint32_t b_hi[2], b_lo[2];
          mma::split_tf32(b, b_hi, b_lo);
          mma::mma_tf32(acc[j], a_lo, b_hi);
          mma::mma_tf32(acc[j], a_hi, b_lo);
          mma::mma_tf32(acc[j], a_hi, b_hi);
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
  unsigned char* mark;  // [HV, slots, mark_stride(V)] chunk_mark_nonfinite's marks: the forward's, else nullptr
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

// kda.h's Gate as the bf16 kernels compute it where they load g and beta (fp32, the fast
// exponential and logarithm: their absolute error, ~1e-6, is far inside the bf16 products'
// rounding), with the backward's chain rule at its last stores of dg and dbeta and its per-chunk
// sums of the gradients w.r.t. dt_bias and A_log (reduced over the chunks by the launcher).
struct GateIn {
  const float *A_log, *dt_bias;  // [HV], [HV * K]; nullptr: g is the log-decay; no bias
  float lower_bound, beta_scale;
  float *bias_part, *alog_part;  // the backward's [HV, slots, K], [HV, slots] (else nullptr)

  struct Channel {  // the constants of one channel: a = exp(A_log), the bias
    float a, bias;
  };
  __device__ static float sigmoid(float x) { return __fdividef(1.f, 1.f + __expf(-x)); }
  __device__ static float softplus(float x) { return x > 20.f ? x : __logf(1.f + __expf(x)); }
  __device__ Channel channel(int64_t hv, int c, int K) const {
    if (A_log == nullptr) return {1.f, 0.f};
    return {__expf(__ldg(A_log + hv)), dt_bias != nullptr ? __ldg(dt_bias + hv * K + c) : 0.f};
  }
  // The log-decay from the raw g.
  __device__ float decay(float g, Channel ch) const {
    if (A_log == nullptr) return g;
    const float x = g + ch.bias;
    return lower_bound == 0.f ? -ch.a * softplus(x) : lower_bound * sigmoid(ch.a * x);
  }
  // The gradients w.r.t. x = g + dt_bias (so g's and dt_bias's) and A_log from d, the log-decay's.
  __device__ float2 decay_grad(float d, float g, Channel ch) const {
    const float x = g + ch.bias;
    if (lower_bound == 0.f) return {-ch.a * d * (x > 20.f ? 1.f : sigmoid(x)), -ch.a * d * softplus(x)};
    const float s = sigmoid(ch.a * x), dx = d * lower_bound * ch.a * s * (1.f - s);
    return {dx, dx * x};
  }
  __device__ float beta(float b) const { return beta_scale == 0.f ? b : beta_scale * sigmoid(b); }
  // The gradient w.r.t. the raw beta from d, beta's, where b is the transformed value.
  __device__ float beta_grad(float d, float b) const { return beta_scale == 0.f ? d : d * b * (1.f - b / beta_scale); }
};

// The op's inputs as given (contiguous, 16-byte aligned): q, k [B,T,H,K], v [B,T,HV,V] of T;
// g [B,T,HV,K] and beta [B,T,HV] float or T (raw where gate says so).
template <typename T>
struct RawIn {
  const T *q, *k, *v;
  const void *g, *beta;
  bool g_f32, beta_f32, l2norm;
  GateIn gate;
  __device__ float g_at(int64_t e) const {
    return g_f32 ? __ldg(static_cast<const float*>(g) + e) : to_float(__ldg(static_cast<const T*>(g) + e));
  }
  __device__ float beta_at(int64_t e) const {
    return gate.beta(beta_f32 ? __ldg(static_cast<const float*>(beta) + e)
                              : to_float(__ldg(static_cast<const T*>(beta) + e)));
  }
};

constexpr float kNormEps = 1e-6f;  // x / sqrt(|x|^2 + eps), as reference/kda.py

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

// A call's sequences and stream.
struct Launch {
  Seqs seqs;
  cudaStream_t stream;
};

template <typename T>
RawIn<T> raw_in(const Inputs& raw, bool l2norm, const Gate& gate) {
  const auto f32 = [](const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; };
  return RawIn<T>{static_cast<const T*>(raw.q.data_ptr()),
                  static_cast<const T*>(raw.k.data_ptr()),
                  static_cast<const T*>(raw.v.data_ptr()),
                  raw.g.data_ptr(),
                  raw.beta.data_ptr(),
                  raw.g.scalar_type() == at::kFloat,
                  raw.beta.scalar_type() == at::kFloat,
                  l2norm,
                  GateIn{f32(gate.A_log), f32(gate.dt_bias), static_cast<float>(gate.lower_bound),
                         static_cast<float>(gate.beta_scale), nullptr, nullptr}};
}

inline GradOut grad_out(const Grads& gr) {
  return GradOut{gr.dq.data_ptr(), gr.dk.data_ptr(), gr.dg.data_ptr(), gr.dbeta.data_ptr(),
                 elem_of(gr.dq, "kda"), elem_of(gr.dg, "kda"), elem_of(gr.dbeta, "kda")};
}

// The stages' launchers. The generic family on the prepared fp32 inputs (intra_cuda.cu,
// state_cuda.cu, bwd_cuda.cu); `keep` holds the workspaces until the caller's last launch.
Intra<float> run_intra(const Problem& p, const Inputs& in, const Launch& l, bool for_bwd,
                       std::vector<at::Tensor>& keep);
// Forward state passing (o, ht, starts each may be nullptr); starts [HV, slots, K, V].
void run_state_fwd(const Problem& p, const Launch& l, const Intra<float>& intra, const float* h0, float* o, float* ht,
                   float* starts);
// Backward state passing: dends [HV, slots, K, V], the initial state's gradient into dh0.
void run_state_bwd(const Problem& p, const Launch& l, const Intra<float>& intra, const float* dO, const float* dht,
                   float* dends, float* dh0);
// Every gradient of every chunk, then the finishing pass into gr (gr.dv in fp32).
void run_chunk_bwd(const Problem& p, const Inputs& in, const Launch& l, const Intra<float>& intra,
                   const float* starts, const float* dends, const at::Tensor& grad_o, const at::Tensor& q,
                   const at::Tensor& k, bool l2norm, Grads& gr);

// The bf16 family (K = kK in {64, 128}, T the inputs' bf16 / fp16 type), instantiated in the
// stages' files. The intra-chunk terms in bf16 from the raw inputs (A in fp32 and Minv for the
// backward).
template <int kK, typename T>
Intra<__nv_bfloat16> run_intra_bf16(const Problem& p, const Inputs& raw, bool l2norm, const Launch& l, bool for_bwd,
                                    std::vector<at::Tensor>& keep);
// Forward state passing on bf16 terms (o in O, ht, starts each may be nullptr); the start states
// in bf16, the operand the chunk backward takes.
template <int kK, typename O>
void run_state_fwd_bf16(const Problem& p, const Launch& l, const Intra<__nv_bfloat16>& w, const Inputs& raw, O* o,
                        float* ht, __nv_bfloat16* starts);
// Backward state passing on bf16 terms, dOs = scale dO in bf16; dends in bf16.
template <int kK>
void run_state_bwd_bf16(const Problem& p, const Launch& l, const Intra<__nv_bfloat16>& w, const at::Tensor& dOs,
                        const float* dht, __nv_bfloat16* dends, float* dh0);
// Every gradient of every chunk from the bf16 terms: the final gradients where HV == H, else
// through the finishing pass.
template <int kK, typename T>
void run_chunk_bwd_bf16(const Problem& p, const Inputs& raw, bool l2norm, const Launch& l,
                        const Intra<__nv_bfloat16>& intra, const __nv_bfloat16* starts,
                        const __nv_bfloat16* dends, const at::Tensor& dOs, Grads& gr);

}  // namespace kda_dsa_ops::kda
