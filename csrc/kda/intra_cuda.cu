// KDA's intra-chunk stage: per (chunk, value head) the terms of kda_chunk.h that do not depend
// on the state,
//   A_ts = sum_c k_t k_s exp(G_t - G_s) (s < t),  Aqk_ts = sum_c q_t k_s exp(G_t - G_s) (s <= t),
//   Minv = (I + diag(beta) A)^-1,  [W | Ut] = Minv diag(beta) [k exp(G) | v],
//   Qg = q exp(G),  Kd = k exp(G_last - G),  gC = exp(G_last),
// every chunk at once (grid: chunk slots x value heads), into head-major workspaces (row t of
// value head hv at hv * tokens + t) that the state and backward stages read. The forward also
// finds each chunk's first non-finite step (the marks, [HV, slots, mark_stride(V)]).
//   intra_kernel       the generic family: kda_chunk.h's chunk_intra on the block team, the
//                      chunk in shared memory, fp32 workspaces
//   intra_bf16_kernel  the bf16 family: the tiling is described above the kernel
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "kda/kda_cuda.cuh"
#include "kda/tiles16.cuh"

namespace kda_dsa_ops::kda {

namespace {

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
             out.mark != nullptr ? out.mark + (hv * sq_.slots + slot) * mark_stride(z.V) : nullptr);
  const int64_t row = hv * sq_.tokens + t0;
  chunk_intra(tm, d, sm.q, sm.k, sm.gates(), sm.v, sm.beta, out.A != nullptr ? out.A + row * kChunk : sA,
              out.Aqk + row * kChunk, out.Minv != nullptr ? out.Minv + row * kChunk : sMinv,
              out.W + row * z.K, out.Ut + row * z.V, out.Qg + row * z.K, out.Kd + row * z.K,
              out.gC + (hv * sq_.slots + slot) * z.K, sY);
}

// The intra-chunk terms for bf16 / fp16 inputs in bf16-product mode (K 64 or 128, V 64 or 128),
// in bf16 for the bf16 state passes (the backward's also A in fp32 and Minv in bf16). One block
// of 8 warps per (chunk, value head), two blocks per SM. It reads the op's inputs as they are:
// the casts, the q / k L2 normalisation and the cumsum of g (plain fp32, scaled by log2 e so that
// every exp is one ex2) happen here.
//   A, Aqk where the chunk's decay is   every channel's G_0 - G_last <= kFactorRange: one
//   mild                                factorisation through the channel's midpoint Gm,
//                                       E_ts = 2^(G_t - Gm) 2^(Gm - G_s) (factors within
//                                       2^+-48), two mma.sync products [k; q] 2^(G - Gm) times
//                                       (k 2^(Gm - G))^T, the lower triangle kept by selection
//   A, Aqk otherwise, by 16 x 16 blocks:
//     blocks left of the diagonal       mma.sync of k_t exp(G_t - G_r), q_t exp(G_t - G_r) with
//                                       k_s exp(G_r - G_s) (r the block's first row), the operands
//                                       made as the fragments are loaded; a warp per block
//     diagonal blocks of mild decay     the same with the block's midpoint in place of G_r
//     other diagonal blocks             one exp per pair (t, s <= t) and channel; a warp takes the
//                                       rows p and 15 - p of a block (17 pairs), a lane K/32
//                                       channels, and one butterfly sums the 32 terms per row
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
  static constexpr int kLdQ = kChunk + 8;            // bf16 rows of Aqk (mild chunks), over q
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
  bf16* sAq = reinterpret_cast<bf16*>(sq);  // [kChunk, kLdQ] once q is spent (mild chunks)
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
  // Rows of N columns from src (leading dim ld) to the workspace dst: a row in N / 8 lanes.
  const auto store_rows = [&](const bf16* src, int ld, auto n_tag, bf16* dst) {
    constexpr int N = decltype(n_tag)::value, kRowsPerPass = Z::kThreads / (N / 8);
    const int r = tid / (N / 8), c = tid % (N / 8) * 8;
    for (int t = r; t < L; t += kRowsPerPass) {
      *reinterpret_cast<uint4*>(dst + (row0 + t) * N + c) = *reinterpret_cast<const uint4*>(src + t * ld + c);
    }
  };

  const ChunkTiles16<kK, T> ct{sq, sk, sG, sbeta, srq, srk, spart, sfirst};
  ct.load(in, H, HV, t0, L, hv, sv, V, out.mark != nullptr ? out.mark + (hv * sq_.slots + slot) * mark_stride(V) : nullptr);

  // The chunk's decay range D = max_c (G_0c - G_Lc) against kFactorRange: one factorisation of
  // every pair where it is mild, else the 16 x 16 blocks (the midpoints Gm and 2^Gm into spart).
  const float* Gl = sG + (L - 1) * kLdG;
  if (tid < kK) {
    spart[tid] = 0.5f * (sG[tid] + Gl[tid]);
    spart[kK + tid] = exp2_ftz(spart[tid]);
  }
  const bool wide = !ct.mild_span(0, L - 1);
  if (!wide) {
    // Operands: qa = q 2^(G - Gm), ka = k 2^(G - Gm) over q, k; kb = k 2^(Gm - G) over A; with Qg =
    // qa 2^Gm and Kd = k 2^(G_last - G) out.
    bf16* sKb = reinterpret_cast<bf16*>(sA);
    for (int i = tid; i < kChunk * (kK / 8); i += Z::kThreads) {
      const int t = i / (kK / 8), c = i % (kK / 8) * 8;
      const float fq = srq[t], fk = srk[t];
      float qx[8], kx[8], gt[8], gl[8], gm[8], pm[8], qa[8], ka[8], kb[8], qg[8], kd[8];
      load_floats(sq + t * kLdK + c, qx);
      load_floats(sk + t * kLdK + c, kx);
      load_floats(sG + t * kLdG + c, gt);
      load_floats(Gl + c, gl);
      load_floats(spart + c, gm);
      load_floats(spart + kK + c, pm);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float up = exp2_ftz(gt[e] - gm[e]), down = exp2_ftz(gm[e] - gt[e]);
        qa[e] = qx[e] * fq * up;
        ka[e] = kx[e] * fk * up;
        kb[e] = kx[e] * fk * down;
        qg[e] = qa[e] * pm[e];
        kd[e] = kx[e] * fk * exp2_ftz(gl[e] - gt[e]);
      }
      store8(reinterpret_cast<bf16*>(sq) + t * kLdK + c, qa);
      store8(reinterpret_cast<bf16*>(sk) + t * kLdK + c, ka);
      store8(sKb + t * kLdK + c, kb);
      if (t < L) {
        store8(out.Qg + (row0 + t) * kK + c, qg);
        store8(out.Kd + (row0 + t) * kK + c, kd);
      }
    }
    __syncthreads();
    // A = ka kb^T (warps 0-3), Aqk = qa kb^T (warps 4-7): warp w the rows 16 (w % 4).. up to the
    // diagonal; the upper triangle (2^(G_t - G_s) >= 1 there) is dropped by selection. Aqk goes
    // to sAq over q (spent once the products are) with zeros in the columns past the product's,
    // and out in whole rows below.
    const int rt = warp % 4;
    float acc[8][4] = {};
    warp_tile_product<false, true>(acc, reinterpret_cast<const bf16*>(warp < 4 ? sk : sq), kLdK, sKb, kLdK, rt, 0,
                                   32 * (rt + 1), 0, kK / 16);
    __syncthreads();  // kb and qa are read: A and Aqk may take their places
    drain_tile(acc, rt, 0, 32 * (rt + 1), [&](int t, int s, float x0, float x1) {
      if (warp < 4) {
        sA[t * kLdA + s] = s < t ? x0 : 0.f;
        sA[t * kLdA + s + 1] = s + 1 < t ? x1 : 0.f;
      } else {
        mma::store_pair(sAq + t * Z::kLdQ + s, s <= t ? x0 : 0.f, s + 1 <= t ? x1 : 0.f);
      }
    });
    if (warp >= 4 && rt < 3) {  // the product's rows 16 rt.. end at column 16 (rt + 1)
      const int pairs = 8 * (3 - rt);  // column pairs from there to kChunk
      for (int i = lane; i < 16 * pairs; i += 32) {
        mma::store_pair(sAq + (16 * rt + i / pairs) * Z::kLdQ + 16 * (rt + 1) + i % pairs * 2, 0.f, 0.f);
      }
    }
  } else {
    // Diagonal blocks whose own range is mild (bit b of mild) take a factorisation through their
    // midpoint like the whole chunk above; the others one exp per pair (below).
    const int mild = ct.mild_blocks();
    // Block (b, j <= b) of A and Aqk as mma.sync products of k_t, q_t 2^(G_t - R) and k_s 2^(R - G_s):
    // R = G_r (r = 16 b, the block's first row) left of the diagonal, the midpoint of the block's
    // G on it (the lower triangle kept by selection).
    const auto block_product = [&](int b, int j) {
      const int r = 16 * b;
      const bool diag = b == j;
      float accA[2][4] = {}, accQ[2][4] = {};
      for (int kk = 0; kk < kK / 16; ++kk) {
        uint32_t ak[4], aq[4], bk[2][2];
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {  // channels c, c + 1 with c = 16 kk + 2 q4 + 8 cc
          const int c = 16 * kk + 2 * q4 + 8 * cc;
          float2 gr = *reinterpret_cast<const float2*>(sG + r * kLdG + c);
          if (diag) {
            const float2 ge = *reinterpret_cast<const float2*>(sG + (r + 15) * kLdG + c);
            gr = make_float2(0.5f * (gr.x + ge.x), 0.5f * (gr.y + ge.y));
          }
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {  // rows t = r + g8 + 8 hh
            const int t = r + g8 + 8 * hh;
            const float2 gt = *reinterpret_cast<const float2*>(sG + t * kLdG + c);
            const float e0 = exp2_ftz(gt.x - gr.x), e1 = exp2_ftz(gt.y - gr.y);
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
            bk[n][cc] = mma::pack2<bf16>(ks[0] * fk * exp2_ftz(gr.x - gs.x), ks[1] * fk * exp2_ftz(gr.y - gs.y));
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
          const bool a0 = !diag || s < t, a1 = !diag || s + 1 < t, q0 = !diag || s <= t, q1 = !diag || s + 1 <= t;
          sA[t * kLdA + s] = a0 ? accA[n][2 * hh] : 0.f;
          sA[t * kLdA + s + 1] = a1 ? accA[n][2 * hh + 1] : 0.f;
          if (t < L) {
            mma::store_pair(out.Aqk + (row0 + t) * kChunk + s, q0 ? accQ[n][2 * hh] : 0.f,
                            q1 ? accQ[n][2 * hh + 1] : 0.f);
          }
        }
      }
    };
    // Tasks: 0-5 the blocks left of the diagonal, 6-9 the mild diagonal blocks.
    for (int task = warp; task < 10; task += Z::kThreads / 32) {
      if (task < 6) {
        const int b = task < 1 ? 1 : task < 3 ? 2 : 3, j = task < 1 ? 0 : task < 3 ? task - 1 : task - 3;
        block_product(b, j);
      } else if (mild >> (task - 6) & 1) {
        block_product(task - 6, task - 6);
      }
    }
    // Diagonal blocks that are not mild: 8 tasks each (block bb, rows 16 bb + p and 16 bb + 15 - p),
    // on the raw q, k; the norms' factors are applied to the sums.
    for (int task = warp; task < 32; task += Z::kThreads / 32) {
      if (mild >> (task / 8) & 1) continue;
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
            const float e = exp2_ftz(G1[c] - Gs[c]) * ks[c];
            v1[s] += k1[c] * e;
            v1[16 + s] += q1[c] * e;
          }
        }
#pragma unroll
        for (int c = 0; c < kC; ++c) {
          const float e = exp2_ftz(G2[c] - Gs[c]) * ks[c];
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
  }
  if (wide) {  // Aqk is zero right of the diagonal blocks
    for (int i = tid; i < kChunk * kChunk / 2; i += Z::kThreads) {
      const int t = i / (kChunk / 2), s = i % (kChunk / 2) * 2;
      if (t < L && s >= (t / 16 + 1) * 16) mma::store_pair(out.Aqk + (row0 + t) * kChunk + s, 0.f, 0.f);
    }
  }
  __syncthreads();
  if (!wide) store_rows(sAq, Z::kLdQ, std::integral_constant<int, kChunk>{}, out.Aqk);  // Aqk's rows from sAq

  // Elementwise (blocks): Qg = q exp(G), Kd = k exp(G_last - G) out, k exp(G) over k (bf16).
  if (wide) {
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
        const float x = exp2_ftz(gt[e]);
        qg[e] = qx[e] * fq * x;
        ke[e] = kx[e] * fk * x;
        kd[e] = kx[e] * fk * exp2_ftz(gl[e] - gt[e]);
      }
      store8(reinterpret_cast<bf16*>(sk) + t * kLdK + c, ke);
      if (t < L) {
        store8(out.Qg + (row0 + t) * kK + c, qg);
        store8(out.Kd + (row0 + t) * kK + c, kd);
      }
    }
  }
  if (tid < kK) out.gC[(hv * sq_.slots + slot) * kK + tid] = exp2_ftz(Gl[tid]);  // gC = exp(G_last)
  if constexpr (!std::is_same_v<T, bf16>) {  // v to bf16 in place, the operand of Ut
    for (int i = tid; i < kChunk * (V / 2); i += Z::kThreads) {
      const int t = i / (V / 2), c = i % (V / 2) * 2;
      float x[2];
      load_floats(sv + t * Z::kLdV + c, x);
      mma::store_pair(reinterpret_cast<bf16*>(sv) + t * Z::kLdV + c, x[0], x[1]);
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
    mma::store_pair(sMb + t * Z::kLdM + s, s <= t ? sMinv[t * kLdA + s] * sbeta[s] : 0.f,
               s + 1 <= t ? sMinv[t * kLdA + s + 1] * sbeta[s + 1] : 0.f);
  }
  if (out.A != nullptr) {  // the backward's A and Minv
    for (int i = tid; i < L * kChunk / 2; i += Z::kThreads) {
      const int t = i / (kChunk / 2), s = i % (kChunk / 2) * 2;
      mma::store_pair(out.A + (row0 + t) * kChunk + s, s < t ? sA[t * kLdA + s] : 0.f,
                 s + 1 < t ? sA[t * kLdA + s + 1] : 0.f);
      mma::store_pair(out.Minv + (row0 + t) * kChunk + s, s <= t ? sMinv[t * kLdA + s] : 0.f,
                 s + 1 <= t ? sMinv[t * kLdA + s + 1] : 0.f);
    }
  }
  __syncthreads();

  // W = Mb (k exp(G)), Ut = Mb v: warp w takes rows 16 (w % 4).. and half of the columns, into
  // shared memory (W over q, Ut over A: both spent), then out in 16-byte pieces of whole rows.
  const int rt = warp % 4, half = warp / 4;
  bf16* sW = reinterpret_cast<bf16*>(sq);  // [kChunk, kLdK]
  bf16* sU = reinterpret_cast<bf16*>(sA);  // [kChunk, kLdV]
  static_assert(kChunk * Z::kLdV * 2 <= kChunk * kLdA * 4, "Ut fits over A");
  // Factored: k holds ka = k 2^(G - Gm), so W's columns take the factor 2^Gm.
  const auto product = [&](const bf16* B, int ldb, int N, bf16* dst, int ld_dst, const float* col_scale) {
    float acc[8][4] = {};
    const int n0 = half * N / 2;
    float2 scale[8];  // this lane's columns' factors, read before the products
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      scale[n] = col_scale != nullptr && n < N / 16
                     ? *reinterpret_cast<const float2*>(col_scale + n0 + 8 * n + 2 * (lane % 4))
                     : make_float2(1.f, 1.f);
    }
    warp_tile_product<false, false>(acc, sMb, Z::kLdM, B, ldb, rt, n0, N, 0, kChunk / 16);
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      acc[n][0] *= scale[n].x, acc[n][1] *= scale[n].y, acc[n][2] *= scale[n].x, acc[n][3] *= scale[n].y;
    }
    drain_tile(acc, rt, n0, N, [&](int t, int col, float x0, float x1) {
      *reinterpret_cast<uint32_t*>(dst + t * ld_dst + col) = mma::pack2<bf16>(x0, x1);
    });
  };
  product(reinterpret_cast<const bf16*>(sk), kLdK, kK, sW, kLdK, wide ? nullptr : spart + kK);
  product(reinterpret_cast<const bf16*>(sv), Z::kLdV, V, sU, Z::kLdV, nullptr);
  __syncthreads();
  store_rows(sW, kLdK, std::integral_constant<int, kK>{}, out.W);
  if (V == kMaxHeadDim) {
    store_rows(sU, Z::kLdV, std::integral_constant<int, kMaxHeadDim>{}, out.Ut);
  } else {
    store_rows(sU, Z::kLdV, std::integral_constant<int, kMaxHeadDim / 2>{}, out.Ut);
  }
}

// The forward's workspace of chunk_mark_nonfinite's marks, [HV, slots, mark_stride(V)].
unsigned char* marks(const Problem& p, const Launch& l, const at::TensorOptions& opts, std::vector<at::Tensor>& keep) {
  keep.push_back(at::empty({std::max<int64_t>(1, p.HV * l.seqs.slots * mark_stride(p.V))}, opts.dtype(at::kByte)));
  return keep.back().data_ptr<unsigned char>();
}

}  // namespace

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

template <int kK, typename T>
Intra<__nv_bfloat16> run_intra_bf16(const Problem& p, const Inputs& raw, bool l2norm, const Launch& l, bool for_bwd,
                                    std::vector<at::Tensor>& keep) {
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
  if (l.seqs.slots == 0) return w;
  const auto kernel = intra_bf16_kernel<kK, T>;
  set_smem(kernel, IntraBf16<kK>::bytes());
  kernel<<<dim3(l.seqs.slots, p.HV), IntraBf16<kK>::kThreads, IntraBf16<kK>::bytes(), l.stream>>>(
      l.seqs, p.H, p.HV, static_cast<int>(p.V), raw_in<T>(raw, l2norm, p.gate), w);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return w;
}

#define KDA_INTRA_BF16(K, T)                                                                                    \
  template Intra<__nv_bfloat16> run_intra_bf16<K, T>(const Problem&, const Inputs&, bool, const Launch&, bool, \
                                                     std::vector<at::Tensor>&);
KDA_INTRA_BF16(64, __nv_bfloat16)
KDA_INTRA_BF16(128, __nv_bfloat16)
KDA_INTRA_BF16(64, __half)
KDA_INTRA_BF16(128, __half)
#undef KDA_INTRA_BF16

}  // namespace kda_dsa_ops::kda
