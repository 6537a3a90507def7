// The bf16 kernels' tiles: one chunk of one value head in shared memory as the bf16 family reads
// it (ChunkTiles16: raw q, k in T, G = log2(e) cumsum(g) in fp32, beta and the norms' factors),
// the warp-level products on such tiles (m16n8k16 with fp32 accumulation, ldmatrix-friendly rows
// whose 16-bit leading dimension is an odd multiple of 8), and small vector loads and stores.
#pragma once

#include "kda/kda_cuda.cuh"

namespace kda_dsa_ops::kda {

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

// A [kChunk, kCols] tile of E (rows at src + t * ld) into shared rows of kLdS elements by
// 16-byte cp.async for a block of kThreads, zeros from row L on: thread i copies the pieces i,
// i + kThreads, ..., whose addresses differ from its first by constants (no index arithmetic or
// branch per piece; a piece from L on has source size 0 and reads nothing). The caller commits.
template <int kThreads, int kCols, int kLdS, typename E>
__device__ __forceinline__ void copy_rows_async(E* dst, const E* src, int64_t ld, int L) {
  constexpr int kVec = 16 / sizeof(E), kPieces = kCols / kVec, kRowsPerPass = kThreads / kPieces;
  static_assert(kCols % kVec == 0 && kThreads % kPieces == 0 && kChunk % kRowsPerPass == 0, "whole passes");
  const int r = static_cast<int>(threadIdx.x) / kPieces, c = static_cast<int>(threadIdx.x) % kPieces * kVec;
  E* d = dst + r * kLdS + c;
  const E* s = src + r * ld + c;
#pragma unroll
  for (int j = 0; j < kChunk / kRowsPerPass; ++j) {
    mma::cp_async_16_zfill(d + j * kRowsPerPass * kLdS, s + j * kRowsPerPass * ld, r + j * kRowsPerPass < L);
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

// The largest decay range (log2 units, on every channel) over which the bf16 kernels factor a
// span's pairs through its midpoint Gm, E_ts = 2^(G_t - Gm) 2^(Gm - G_s): the factors stay within
// 2^+-48, so no term overflows and none that matters flushes to zero.
constexpr float kFactorRange = 96.f;

// Shared-memory tiles of one chunk of one value head for the bf16 kernels (256 threads): the raw
// q, k [kChunk, kK + 8] in T, G = log2(e) cumsum(g) [kChunk, kK + 4] in fp32 (plain fp32 sum,
// scaled so that every exp is one ex2; g the log-decay, through the in-kernel gate where it is
// on), beta (through its sigmoid where on) and the factors 1 / |q_t|, 1 / |k_t| (ones without
// normalisation) [kChunk] and kThreads floats of scratch. Rows from L on are zero (g too: G stays
// at its last value).
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

  // Whether every channel's decay range from row r0 to row r1, G_r0 - G_r1, is within
  // kFactorRange (NaN is not): a block barrier.
  __device__ bool mild_span(int r0, int r1) const {
    const int c = static_cast<int>(threadIdx.x);
    return !__syncthreads_or(c < kK && !(G[r0 * kLdG + c] - G[r1 * kLdG + c] <= kFactorRange));
  }
  // Bit b set where the diagonal 16 x 16 block b is mild (mild_span over its rows).
  __device__ int mild_blocks() const {
    int mild = 0;
    for (int b = 0; b < kChunk / 16; ++b) {
      if (mild_span(16 * b, 16 * b + 15)) mild |= 1 << b;
    }
    return mild;
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
      float x[8], nan_if_any = 0.f;  // x * 0 is NaN exactly where x is not finite
      load_floats(sv + t * kLdV + c, x);
#pragma unroll
      for (int e = 0; e < 8; ++e) nan_if_any += x[e] * 0.f;
      if (!isnan(nan_if_any)) continue;
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
    const int64_t h = hv / (HV / H);
    const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
    if (mark != nullptr && tid < V + 2) first[tid] = L;  // (V + 2 <= kThreads)
    // Loads: q, k, v (where given) and g (fp32; else converted here) by cp.async, zeros from L on
    // (g too: G stays at its last value).
    copy_rows_async<kThreads, kK, kLdK>(q, in.q + (t0 * H + h) * kK, H * kK, L);
    copy_rows_async<kThreads, kK, kLdK>(k, in.k + (t0 * H + h) * kK, H * kK, L);
    if (sv != nullptr && V == kMaxHeadDim) {
      copy_rows_async<kThreads, kMaxHeadDim, kLdV>(sv, in.v + (t0 * HV + hv) * V, HV * V, L);
    } else if (sv != nullptr) {
      copy_rows_async<kThreads, kMaxHeadDim / 2, kLdV>(sv, in.v + (t0 * HV + hv) * V, HV * V, L);
    }
    if (in.g_f32) {
      copy_rows_async<kThreads, kK, kLdG>(G, static_cast<const float*>(in.g) + (t0 * HV + hv) * kK, HV * kK, L);
    }
    mma::cp_async_commit();
    if (!in.g_f32) {
      const T* g = static_cast<const T*>(in.g);
      for (int i = tid; i < kChunk * kK; i += kThreads) {
        const int t = i / kK, c = i % kK;
        G[t * kLdG + c] = t < L ? to_float(g[((t0 + t) * HV + hv) * kK + c]) : 0.f;
      }
    }
    if (tid < kChunk) beta[tid] = tid < L ? in.beta_at((t0 + tid) * HV + hv) : 0.f;
    mma::cp_async_wait<0>();
    __syncthreads();
    if (mark != nullptr) find_nonfinite_v_beta(L, sv, V);

    // 1 / |q_t|, 1 / |k_t| (ones without normalisation): warp w the rows 16 w.. of [q; k], their
    // sums of squares independent until one transposed warp sum; G = log2(e) cumsum(g) by parts
    // of rows.
    {
      constexpr int kTasks = 2 * kChunk / (kThreads / 32);
      static_assert(kTasks == 16, "16 rows a warp");
      float ss[kTasks];
#pragma unroll
      for (int r = 0; r < kTasks; ++r) {
        const int task = kTasks * warp + r;
        float x[kK / 32];
        load_floats((task < kChunk ? q : k) + (task % kChunk) * kLdK + lane * (kK / 32), x);
        ss[r] = 0.f;
#pragma unroll
        for (int c = 0; c < kK / 32; ++c) ss[r] += x[c] * x[c];
      }
      const float sum = warp_sum_transposed(ss);  // lane l: task 16 warp + l % 16
      const int task = kTasks * warp + lane;
      if (lane < kTasks) {
        (task < kChunk ? rq : rk)[task % kChunk] = in.l2norm ? rsqrtf(sum + kNormEps) : 1.f;
        if (mark != nullptr && task >= kChunk && !isfinite(sum)) note_nonfinite(V, task - kChunk, V);
      }
    }
    {
      constexpr int kParts = kThreads / kK, kRows = kChunk / kParts;
      const int c = tid % kK, p0 = tid / kK;
      if (in.gate.A_log != nullptr) {  // the in-kernel gate on this thread's rows first (its code once, not per row)
        const GateIn::Channel gate = in.gate.channel(hv, c, kK);
#pragma unroll 1
        for (int t = p0 * kRows; t < min(L, (p0 + 1) * kRows); ++t) G[t * kLdG + c] = in.gate.decay(G[t * kLdG + c], gate);
      }
      float x[kRows];
      float run = 0.f;
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int t = p0 * kRows + i;
        const float g = t < L ? G[t * kLdG + c] : 0.f;  // the log-decay
        if (mark != nullptr && !(g < INFINITY)) note_nonfinite(V, t, V);  // NaN or +inf
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

}  // namespace kda_dsa_ops::kda
