// KDA's backward stage: per (chunk, value head), from the chunk's start state S0, end-state
// gradient dS1 (the state stage's) and the intra stage's terms, every gradient of the chunk,
// differentiating kda_chunk.h's steps exactly (chunk_bwd there): the dense part (dU, dW, the
// gradients of Qg, Kd, Aqk, A through Minv, dv, dbeta's share) and the pair part (the gradients
// of A, Aqk back to q, k and the cumulative log-decay G, whose reverse cumsum is dg). Then the
// finishing pass: each head's value heads summed, the L2 normalisation's gradient, token-major
// outputs in the op's dtypes.
//   chunk_bwd_kernel           the generic family: kda_chunk.h's chunk_bwd on the block team
//   bwd_dense_bf16_kernel      the bf16 family, dense part: every product an mma.sync
//   bwd_pairs_kernel           the bf16 family, pair part: the pairs across the 16 x 16 blocks
//                              (mma.sync) and inside the diagonal ones, the reverse cumsum, the
//                              final gradients where HV == H
//   finish_grads_kernel        the finishing pass, a warp per (token, head task)
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "common/hopper.cuh"
#include "kda/kda_cuda.cuh"
#include "kda/tiles16.cuh"

namespace kda_dsa_ops::kda {

namespace {

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
// terms, the state passes' bf16 start states and end-state gradients, dO as scale dO in bf16, and
// v, beta as given. Results into w's dq (dQg), dk (dKd), ZW, dA, dAqk, last and dbeta, and dv (in
// v's type), as chunk_bwd_dense leaves them.
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
    bwd_dense_bf16_kernel(Seqs sq_, int64_t HV, int V, Intra<__nv_bfloat16> in,
                          const __nv_bfloat16* __restrict__ starts, const __nv_bfloat16* __restrict__ dends,
                          const __nv_bfloat16* __restrict__ dOs, RawIn<T> raw,
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

  // The chunk's terms, dO (rows from L on zero) and the states by bulk copies; then sum_j dS1 S0
  // per row (fp32 sums of the bf16 operands), a warp per kK / 8 rows, its rows' sums independent
  // until one transposed warp sum.
  const auto rows = [&](const bf16* base, int64_t ld) {
    return [=](int r) { return r < L ? base + r * ld : nullptr; };
  };
  mma::gather_rows(sS0, kLd, kK, V, V, [=](int r) { return starts + state + r * V; });
  mma::gather_rows(sdS1, kLd, kK, V, V, [=](int r) { return dends + state + r * V; });
  mma::gather_rows(sW, kLd, kChunk, kK, kK, rows(in.W + row0 * kK, kK));
  mma::gather_rows(sKd, kLd, kChunk, kK, kK, rows(in.Kd + row0 * kK, kK));
  mma::gather_rows(sUt, kLd, kChunk, V, V, rows(in.Ut + row0 * V, V));
  mma::gather_rows(sAqk, kLdC, kChunk, kChunk, kChunk, rows(in.Aqk + row0 * kChunk, kChunk));
  mma::gather_rows(sMinv, kLdC, kChunk, kChunk, kChunk, rows(in.Minv + row0 * kChunk, kChunk));
  mma::gather_rows(sdO, kLd, kChunk, V, V, rows(dOs + (t0 * HV + hv) * V, ldv));
  mma::cp_async_commit();
  // While the copies land: beta and v where this lane's ZU fragments lie (rows 16 rt + lane / 4
  // + 8 hh, column pairs half V / 2 + 8 n + 2 (lane % 4)), for dv = diag(beta) ZU and sum_j ZU v.
  float beta_rows[2];
  uint32_t v_pairs[8][2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int t = 16 * rt + lane / 4 + 8 * hh;
    beta_rows[hh] = t < L ? raw.beta_at((t0 + t) * HV + hv) : 0.f;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const int64_t e = (t0 + t) * ldv + hv * V + half * V / 2 + 8 * n + 2 * (lane % 4);
      v_pairs[n][hh] = t < L && n < V / 16 ? __ldg(reinterpret_cast<const uint32_t*>(raw.v + e)) : 0u;
    }
  }
  mma::cp_async_wait<0>();
  __syncthreads();
  {
    constexpr int kRows = kK / 8;
    float dot[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      dot[r] = 0.f;
      const int c = warp * kRows + r;
      for (int j = 2 * lane; r < kRows && j < V; j += 64) {
        const float2 a = mma::unpack2<bf16>(*reinterpret_cast<const uint32_t*>(sS0 + c * kLd + j));
        const float2 b = mma::unpack2<bf16>(*reinterpret_cast<const uint32_t*>(sdS1 + c * kLd + j));
        dot[r] += a.x * b.x + a.y * b.y;
      }
    }
    const float sum = warp_sum_transposed(dot);  // lane l: row warp kRows + l % 16
    if (lane < kRows) w.last[gc + warp * kRows + lane] = sum;
  }

  float acc[8][4] = {};
  {  // U = Ut - W S0, dU = Aqk^T (scale dO) + Kd dS1 (rows from L on are zero in both)
    const int n0 = half * V / 2;
    warp_tile_product<false, false>(acc, sW, kLd, sS0, kLd, rt, n0, V, 0, kK / 16);
    drain_tile(acc, rt, n0, V, [&](int t, int col, float x0, float x1) {
      mma::store_pair(sU + t * kLd + col, to_float(sUt[t * kLd + col]) - x0, to_float(sUt[t * kLd + col + 1]) - x1);
    });
    warp_tile_product<true, false>(acc, sAqk, kLdC, sdO, kLd, rt, n0, V, 0, kChunk / 16);
    warp_tile_product<false, false>(acc, sKd, kLd, sdS1, kLd, rt, n0, V, 0, kK / 16);
    drain_tile(acc, rt, n0, V, [&](int t, int col, float x0, float x1) { mma::store_pair(sdU + t * kLd + col, x0, x1); });
  }
  __syncthreads();
  {  // dQg = (scale dO) S0^T, dKd = U dS1^T, dW = -dU S0^T, dAqk = (scale dO) U^T (s <= t)
    const int n0 = half * kK / 2;
    warp_tile_product<false, true>(acc, sdO, kLd, sS0, kLd, rt, n0, kK, 0, V / 16);
    drain_tile(acc, rt, n0, kK, [&](int t, int col, float x0, float x1) {
      if (t < L) mma::store_pair(w.dq + (row0 + t) * kK + col, x0, x1);
    });
    warp_tile_product<false, true>(acc, sU, kLd, sdS1, kLd, rt, n0, kK, 0, V / 16);
    drain_tile(acc, rt, n0, kK, [&](int t, int col, float x0, float x1) {
      if (t < L) mma::store_pair(w.dk + (row0 + t) * kK + col, x0, x1);
    });
    warp_tile_product<false, true>(acc, sdU, kLd, sS0, kLd, rt, n0, kK, 0, V / 16);
    drain_tile(acc, rt, n0, kK, [&](int t, int col, float x0, float x1) { mma::store_pair(sdW + t * kLd + col, -x0, -x1); });
    warp_tile_product<false, true>(acc, sdO, kLd, sU, kLd, rt, half * kChunk / 2, kChunk, 0, V / 16);
    drain_tile(acc, rt, half * kChunk / 2, kChunk, [&](int t, int col, float x0, float x1) {
      if (t < L) mma::store_pair(w.dAqk + (row0 + t) * kChunk + col, col <= t ? x0 : 0.f, col + 1 <= t ? x1 : 0.f);
    });
  }
  __syncthreads();
  {  // ZW = Minv^T dW (out, and over Kd), ZU = Minv^T dU (over dO), dv = diag(beta) ZU, sum_j ZU v
    warp_tile_product<true, false>(acc, sMinv, kLdC, sdW, kLd, rt, half * kK / 2, kK, 0, kChunk / 16);
    drain_tile(acc, rt, half * kK / 2, kK, [&](int t, int col, float x0, float x1) {
      mma::store_pair(sKd + t * kLd + col, x0, x1);
      if (t < L) mma::store_pair(w.ZW + (row0 + t) * kK + col, x0, x1);
    });
    warp_tile_product<true, false>(acc, sMinv, kLdC, sdU, kLd, rt, half * V / 2, V, 0, kChunk / 16);
    float part[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < 8; ++n) {  // drain_tile's order, with v_pairs' indices
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int t = 16 * rt + lane / 4 + 8 * hh, col = half * V / 2 + 8 * n + 2 * (lane % 4);
        const float x0 = acc[n][2 * hh], x1 = acc[n][2 * hh + 1];
        acc[n][2 * hh] = acc[n][2 * hh + 1] = 0.f;
        if (n >= V / 16) continue;
        mma::store_pair(sdO + t * kLd + col, x0, x1);
        if (t < L) {
          const float2 vv = mma::unpack2<T>(v_pairs[n][hh]);
          mma::store_pair(dv + (t0 + t) * ldv + hv * V + col, beta_rows[hh] * x0, beta_rows[hh] * x1);
          part[hh] += x0 * vv.x + x1 * vv.y;
        }
      }
    }
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
      if (t < L) mma::store_pair(w.dA + (row0 + t) * kChunk + col, col < t ? -x0 : 0.f, col + 1 < t ? -x1 : 0.f);
    });
  }
}

// chunk_bwd_pairs in bf16-product mode (bf16 / fp16 inputs, K 64 or 128), after
// bwd_dense_bf16_kernel: the gradients of A and Aqk back to q, k and the cumulative log-decay G,
// with the terms from dQg, dKd and ZW, dbeta's other terms and dg's reverse cumsum; one block of
// 8 warps per (chunk, value head). The terms of dq, dk, dg gather in fp32 in shared memory from
// three parts:
//   across blocks    mma.sync on bf16 tiles, the operands scaled to one reference row per warp as
//                    in the intra kernel; warp w owns the rows of block b = w % 4 and half of the
//                    columns. Row terms (b >= 1, r = 16 b): exp(G_t - G_r) times (dA Ks_r,
//                    dAqk Ks_r) with Ks_r = k_s exp(G_r - G_s) over s < r. Column terms (b <= 2,
//                    r' = 16 b + 16): exp(G_r' - G_s) times (dA^T kE_r' + dAqk^T qE_r') over the
//                    rows t >= r', kE_r', qE_r' = k_t, q_t exp(G_t - G_r'). Every factor is at
//                    most 1.
//   per element      the terms from dQg, dKd, ZW (read in batches of rows; the block asks L2 for
//                    them as it starts, and reads dA, dAqk, A into registers while the chunk
//                    loads), with dbeta's ZW k exp(G) and G_last's extra gradient summed through
//                    shared memory.
//   inside the       a thread per (channel, diagonal block) walks the block's 136 pairs once
//   diagonal blocks  (fp32), each pair's exp serving the row terms of t and the column term of s.
// Then dg's reverse cumsum and the outputs: the final gradients where HV == H (through the
// in-kernel gate, beta and the normalisation), else head-major into w for the finishing pass.
template <int kK, typename T>
struct Pairs {
  using C = ChunkTiles16<kK, T>;
  static constexpr int kLdK = C::kLdK, kLdC = kChunk + 8, kLdS = kK + 8;
  // Ks_16, Ks_32, Ks_48 (16, 32, 48 rows) and kE_16, kE_32, kE_48 (48, 32, 16 rows): 96 rows each.
  static constexpr int kSlabRows = 96;
  static constexpr size_t kOperands = 2 * (2 * kChunk * kLdC + 3 * kSlabRows * kLdK);
  static constexpr size_t kStaging = 4 * 3 * kChunk * kLdS;  // the dq, dk, dg terms, over the operands
  static constexpr size_t kRegion = kOperands > kStaging ? kOperands : kStaging;
  // then beta_t dA and dAqk in fp32 [kChunk, kChunk] each, dbeta's terms [kChunk], G_last's [kK]
  static constexpr size_t bytes() { return C::bytes() + kRegion + 4 * (2 * kChunk * kChunk + kChunk + kK); }
  // First row of slab j (reference row 16 j + 16) among the Ks and the kE / qE rows.
  __device__ static int ks_row(int j) { return j == 0 ? 0 : j == 1 ? 16 : 48; }
  __device__ static int e_row(int j) { return j == 0 ? 0 : j == 1 ? 48 : 80; }
};

template <int kK, typename T>
__global__ void __launch_bounds__(ChunkTiles16<kK, T>::kThreads, 1)
    bwd_pairs_kernel(Seqs sq_, int64_t H, int64_t HV, RawIn<T> in, const float* __restrict__ A, BwdWork<float> w,
                     GradOut out) {
  using bf16 = __nv_bfloat16;
  using C = ChunkTiles16<kK, T>;
  using Z = Pairs<kK, T>;
  constexpr int kLdK = C::kLdK, kLdG = C::kLdG, kLdC = Z::kLdC, kLdS = Z::kLdS;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* rest;  // the first byte after the chunk's tiles
  const C ct = C::carve(smem_raw, &rest);
  int64_t t0;
  int L;
  if (!sq_.locate(blockIdx.x, t0, L) || !sq_.valid(blockIdx.x, t0, L)) return;
  const int64_t row0 = blockIdx.y * sq_.tokens + t0;              // the workspaces' row of step 0
  const int64_t gc = (blockIdx.y * sq_.slots + blockIdx.x) * kK;  // the [HV, slots, K] offset
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  if (threadIdx.x == 0) {  // what the per-element pass reads, into L2 while the chunk loads
    for (const float* x : {w.dq, w.dk, w.ZW}) sm90::bulk_prefetch_l2(x + row0 * kK, 4 * L * kK);
  }
  // dA, dAqk and A where the first pass takes them (rows warp + 8 j, columns 2 lane..), read
  // while the chunk loads.
  constexpr int kIters = kChunk * kChunk / 2 / C::kThreads;
  static_assert(kIters == 8 && C::kThreads == 256, "a warp per row in each iteration");
  float2 da[kIters], dqk[kIters], a[kIters];
#pragma unroll
  for (int j = 0; j < kIters; ++j) {
    const int t = warp + 8 * j;
    const int64_t e = (row0 + t) * kChunk + 2 * lane;
    da[j] = t < L ? __ldg(reinterpret_cast<const float2*>(w.dA + e)) : float2{};
    dqk[j] = t < L ? __ldg(reinterpret_cast<const float2*>(w.dAqk + e)) : float2{};
    a[j] = t < L ? __ldg(reinterpret_cast<const float2*>(A + e)) : float2{};
  }
  ct.load(in, H, HV, t0, L, blockIdx.y, nullptr, 0);
  bf16* sdA = reinterpret_cast<bf16*>(rest);  // [kChunk, kLdC]: beta_t dA_ts
  bf16* sdAqk = sdA + kChunk * kLdC;          // [kChunk, kLdC]
  bf16* sKs = sdAqk + kChunk * kLdC;          // [96, kLdK]
  bf16* skE = sKs + Z::kSlabRows * kLdK;      // [96, kLdK]
  bf16* sqE = skE + Z::kSlabRows * kLdK;      // [96, kLdK]
  float* sSq = reinterpret_cast<float*>(rest);  // [kChunk, kLdS] each, over the operands
  float* sSk = sSq + kChunk * kLdS;
  float* sSg = sSk + kChunk * kLdS;
  float* fdA = reinterpret_cast<float*>(rest + Z::kRegion);  // [kChunk, kChunk]: beta_t dA_ts
  float* fdAqk = fdA + kChunk * kChunk;                      // [kChunk, kChunk]
  float* sdb = fdAqk + kChunk * kChunk;                      // [kChunk]: dbeta's terms here
  float* slast = sdb + kChunk;                               // [kK]: sum_t Kd dKd, then G_last's gradient
  const auto kn = [&](int t, int c) { return to_float(ct.k[t * kLdK + c]) * ct.rk[t]; };
  const auto qn = [&](int t, int c) { return to_float(ct.q[t * kLdK + c]) * ct.rq[t]; };
  const auto G = [&](int t, int c) { return ct.G[t * kLdG + c]; };
  if (tid < kK) slast[tid] = 0.f;

  // dA (times beta_t) and dAqk in fp32 and as bf16 operands, and dbeta_t's first term sum_{s<t}
  // dA A (warp w the rows w + 8 j, their sums summed over the warp at once); the operand slabs.
  {
    float da_a[16] = {};
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const int t = warp + 8 * j, s = 2 * lane;
      const float b = t < L ? ct.beta[t] : 0.f;
      da_a[j] = da[j].x * a[j].x + da[j].y * a[j].y;
      *reinterpret_cast<float2*>(fdA + t * kChunk + s) = make_float2(b * da[j].x, b * da[j].y);
      *reinterpret_cast<float2*>(fdAqk + t * kChunk + s) = dqk[j];
      mma::store_pair(sdA + t * kLdC + s, b * da[j].x, b * da[j].y);
      mma::store_pair(sdAqk + t * kLdC + s, dqk[j].x, dqk[j].y);
    }
    const float sum = warp_sum_transposed(da_a);  // lane l < 8: row warp + 8 l
    if (lane < kIters) sdb[warp + 8 * lane] = sum;  // every row once: dbeta's terms start here
  }
  for (int i = tid; i < Z::kSlabRows * (kK / 8); i += C::kThreads) {  // eight channels a thread
    const int j = i / (kK / 8), c = i % (kK / 8) * 8;
    float x[8], y[8], gr[8], gx[8], o[8];
    {  // Ks_r row s
      const int slab = j < 16 ? 0 : j < 48 ? 1 : 2, r = 16 * slab + 16, s = j - Z::ks_row(slab);
      load_floats(ct.k + s * kLdK + c, x);
      load_floats(ct.G + r * kLdG + c, gr);
      load_floats(ct.G + s * kLdG + c, gx);
      const float f = ct.rk[s];
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] = x[e] * f * exp2_ftz(gr[e] - gx[e]);
      store8(sKs + j * kLdK + c, o);
    }
    {  // kE_r, qE_r row t
      const int slab = j < 48 ? 0 : j < 80 ? 1 : 2, r = 16 * slab + 16, t = r + j - Z::e_row(slab);
      load_floats(ct.k + t * kLdK + c, x);
      load_floats(ct.q + t * kLdK + c, y);
      load_floats(ct.G + r * kLdG + c, gr);
      load_floats(ct.G + t * kLdG + c, gx);
      const float fk = ct.rk[t], fq = ct.rq[t];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        gx[e] = exp2_ftz(gx[e] - gr[e]);
        o[e] = x[e] * fk * gx[e];
        y[e] *= fq * gx[e];
      }
      store8(skE + j * kLdK + c, o);
      store8(sqE + j * kLdK + c, y);
    }
  }
  __syncthreads();

  // Across blocks.
  {
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
        for (int hh = 0; hh < 2; ++hh) {  // columns c, c + 1 of row t
          const int t = 16 * rt + lane / 4 + 8 * hh, c = n0 + 8 * n + 2 * (lane % 4), e = t * kLdS + c;
          float gt[2], gr[2], gc[2], kt[2], qt[2], sq[2], sk[2], sg[2];
          load_floats(ct.G + t * kLdG + c, gt);
          load_floats(ct.G + 16 * rt * kLdG + c, gr);
          load_floats(ct.G + (16 * rt + 16) * kLdG + c, gc);
          load_floats(ct.k + t * kLdK + c, kt);
          load_floats(ct.q + t * kLdK + c, qt);
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const float fr = rt >= 1 ? exp2_ftz(gt[i] - gr[i]) : 0.f;
            const float fc = rt <= 2 ? exp2_ftz(gc[i] - gt[i]) : 0.f;
            const float pa = fr * ya[n][2 * hh + i], pq = fr * yq[n][2 * hh + i], pc = fc * x[n][2 * hh + i];
            sq[i] = pq;
            sk[i] = pa + pc;
            sg[i] = kt[i] * ct.rk[t] * (pa - pc) + qt[i] * ct.rq[t] * pq;
          }
          *reinterpret_cast<float2*>(sSq + e) = make_float2(sq[0], sq[1]);
          *reinterpret_cast<float2*>(sSk + e) = make_float2(sk[0], sk[1]);
          *reinterpret_cast<float2*>(sSg + e) = make_float2(sg[0], sg[1]);
        }
      }
    }
  }
  __syncthreads();

  // Per element, four channels a thread and a row per kLanes lanes (the loads of kBatch rows
  // issued together): the terms from dQg, dKd and ZW; dbeta's ZW k exp(G) summed over each row's
  // lanes, sum_t Kd dKd over the rows.
  const float* Gl = ct.G + (L - 1) * kLdG;
  {
    constexpr int kLanes = kK / 4, kStep = C::kThreads / kLanes, kBatch = 4;
    const int c = tid % kLanes * 4;
    float gl[4], last[4] = {};
    load_floats(Gl + c, gl);
#pragma unroll
    for (int tb = tid / kLanes; tb < kChunk; tb += kStep * kBatch) {
      float4 dqg[kBatch], dkd[kBatch], z[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int t = tb + i * kStep;
        const int64_t e = (row0 + t) * kK + c;
        dqg[i] = t < L ? __ldg(reinterpret_cast<const float4*>(w.dq + e)) : float4{};
        dkd[i] = t < L ? __ldg(reinterpret_cast<const float4*>(w.dk + e)) : float4{};
        z[i] = t < L ? __ldg(reinterpret_cast<const float4*>(w.ZW + e)) : float4{};
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int t = tb + i * kStep, e = t * kLdS + c;
        float gt[4], kt[4], qt[4];
        load_floats(ct.G + t * kLdG + c, gt);
        load_floats(ct.k + t * kLdK + c, kt);
        load_floats(ct.q + t * kLdK + c, qt);
        const float fk = ct.rk[t], fq = ct.rq[t], b = ct.beta[t];
        const float dq4[4] = {dqg[i].x, dqg[i].y, dqg[i].z, dqg[i].w};
        const float dk4[4] = {dkd[i].x, dkd[i].y, dkd[i].z, dkd[i].w}, z4[4] = {z[i].x, z[i].y, z[i].z, z[i].w};
        float4 aq = *reinterpret_cast<const float4*>(sSq + e), ak = *reinterpret_cast<const float4*>(sSk + e),
               ag = *reinterpret_cast<const float4*>(sSg + e);
        float* pq = &aq.x;
        float* pk = &ak.x;
        float* pg = &ag.x;
        float zrow = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float eg = exp2_ftz(gt[j]), ed = exp2_ftz(gl[j] - gt[j]), kn_ = kt[j] * fk, qn_ = qt[j] * fq;
          const float zg = z4[j] * eg, bz = b * zg;
          last[j] += kn_ * ed * dk4[j];
          pq[j] += dq4[j] * eg;
          pk[j] += dk4[j] * ed + bz;
          pg[j] += dq4[j] * qn_ * eg - dk4[j] * kn_ * ed + kn_ * bz;
          zrow += zg * kn_;
        }
        *reinterpret_cast<float4*>(sSq + e) = aq;
        *reinterpret_cast<float4*>(sSk + e) = ak;
        *reinterpret_cast<float4*>(sSg + e) = ag;
#pragma unroll
        for (int m = kLanes / 2; m >= 1; m /= 2) zrow += __shfl_xor_sync(0xffffffffu, zrow, m);
        if (tid % kLanes == 0) sdb[t] += zrow;  // one group of lanes per row
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) atomicAdd(slast + c + j, last[j]);
  }
  __syncthreads();

  // Inside the diagonal blocks, a thread per (channel, block), a warp sharing its block: the
  // block's pairs into the staged terms.
  for (int task = tid; task < 4 * kK; task += C::kThreads) {
    const int cw = task % kK, b0 = task / kK * 16;
    if (b0 >= L) continue;
    float kr[16], Gr[16], ra[16], rq[16], cl[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      kr[i] = kn(b0 + i, cw);
      Gr[i] = G(b0 + i, cw);
      ra[i] = rq[i] = cl[i] = 0.f;
    }
#pragma unroll
    for (int t = 0; t < 16; ++t) {
      const float qt = qn(b0 + t, cw);
#pragma unroll
      for (int s0 = 0; s0 <= t; s0 += 4) {  // four pairs' dA, dAqk a load (the same for the warp)
        const float4 da4 = *reinterpret_cast<const float4*>(fdA + (b0 + t) * kChunk + b0 + s0);
        const float4 dq4 = *reinterpret_cast<const float4*>(fdAqk + (b0 + t) * kChunk + b0 + s0);
        const float das[4] = {da4.x, da4.y, da4.z, da4.w}, dqs[4] = {dq4.x, dq4.y, dq4.z, dq4.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int s = s0 + j;
          if (s <= t) {
            const float e = exp2_ftz(Gr[t] - Gr[s]), xs = kr[s] * e;
            ra[t] += das[j] * xs;
            rq[t] += dqs[j] * xs;
            cl[s] += (das[j] * kr[t] + dqs[j] * qt) * e;
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if (b0 + i < L) {
        const int e = (b0 + i) * kLdS + cw;
        sSq[e] += rq[i];
        sSk[e] += ra[i] + cl[i];
        sSg[e] += kr[i] * (ra[i] - cl[i]) + qn(b0 + i, cw) * rq[i];
      }
    }
  }
  __syncthreads();
  if (tid < L) {  // w.r.t. the raw beta where its sigmoid is in the kernel
    const float db = in.gate.beta_grad(w.dbeta[row0 + tid] + sdb[tid], ct.beta[tid]);
    if (out.dbeta != nullptr) {
      store_elem(out.dbeta, (t0 + tid) * HV + blockIdx.y, db, out.eb);
    } else {
      w.dbeta[row0 + tid] = db;
    }
  }
  if (tid < kK) slast[tid] = w.last[gc + tid] * exp2_ftz(Gl[tid]) + slast[tid];  // G_last's extra gradient

  // dq, dk out (head-major) where the finishing pass takes them; dg's reverse cumsum: a thread per
  // channel and part of the rows.
  constexpr int kParts = C::kThreads / kK, kRows = kChunk / kParts;
  const int c = tid % kK, p0 = tid / kK;
  const bool direct = out.dq != nullptr;
  if (!direct) {
    for (int i = 0; i < kRows; ++i) {
      const int t = p0 * kRows + i;
      if (t < L) {
        w.dq[(row0 + t) * kK + c] = sSq[t * kLdS + c];
        w.dk[(row0 + t) * kK + c] = sSk[t * kLdS + c];
      }
    }
  }
  float old[kRows];
  float run = 0.f;
#pragma unroll
  for (int i = kRows - 1; i >= 0; --i) {
    run += sSg[(p0 * kRows + i) * kLdS + c];
    old[i] = run;
  }
  ct.part[p0 * kK + c] = run;
  __syncthreads();
  float base = slast[c];
  for (int p = p0 + 1; p < kParts; ++p) base += ct.part[p * kK + c];
  const GateIn& gate = in.gate;
#pragma unroll
  for (int i = 0; i < kRows; ++i) sSg[(p0 * kRows + i) * kLdS + c] = old[i] + base;  // w.r.t. the log-decay
  // Out a row at a time (the store's and the gate's code once): w.r.t. the raw g with the in-kernel
  // gate, with this thread's shares of dt_bias's and A_log's gradients; then their sums over the
  // chunk in a fixed order (the parts of a channel, then the warps).
  const GateIn::Channel channel = gate.channel(blockIdx.y, c, kK);
  float dx_sum = 0.f, da_sum = 0.f;
#pragma unroll 1
  for (int t = p0 * kRows; t < min(L, (p0 + 1) * kRows); ++t) {
    float dg = sSg[t * kLdS + c];
    if (gate.A_log != nullptr) {
      const float2 d = gate.decay_grad(dg, in.g_at(((t0 + t) * HV + blockIdx.y) * kK + c), channel);
      dg = d.x;
      dx_sum += d.x;
      da_sum += d.y;
    }
    if (direct) {
      store_elem(out.dg, ((t0 + t) * HV + blockIdx.y) * kK + c, dg, out.eg);
    } else {
      w.dg[(row0 + t) * kK + c] = dg;
    }
  }
  if (gate.A_log != nullptr) {
    __syncthreads();  // the kept rows are read: the sums go over them
    float* red = sSg;
    red[p0 * kK + c] = dx_sum;
    da_sum = warp_reduce(da_sum, SumOp{});
    if (lane == 0) red[kParts * kK + warp] = da_sum;
    __syncthreads();
    if (tid < kK) {
      float sum = 0.f;
      for (int p = 0; p < kParts; ++p) sum += red[p * kK + tid];
      gate.bias_part[gc + tid] = sum;
    }
    if (tid == 0) {
      float sum = 0.f;
      for (int j = 0; j < C::kThreads / 32; ++j) sum += red[kParts * kK + j];
      gate.alog_part[gc / kK] = sum;
    }
  }
  if (!direct) return;
  // dq, dk w.r.t. the raw q, k (HV == H): through the normalisation, (d - n (n . d)) r; warp w the
  // rows task = w + 8 j of [dq; dk], their n . d independent until one transposed warp sum.
  __syncthreads();
  constexpr int kTasks = 2 * kChunk / (C::kThreads / 32);
  static_assert(kTasks == 16, "16 rows a warp");
  const auto row = [&](int task, float (&ds)[kK / 32], float (&n)[kK / 32]) {
    const bool is_k = task >= L;
    const int t = task % L;
    const float* d = (is_k ? sSk : sSq) + t * kLdS;
    const T* x = (is_k ? ct.k : ct.q) + t * kLdK;
    const float r = (is_k ? ct.rk : ct.rq)[t];
#pragma unroll
    for (int i = 0; i < kK / 32; ++i) {
      ds[i] = d[lane + 32 * i];
      n[i] = to_float(x[lane + 32 * i]) * r;
    }
  };
  float nd_rows[kTasks];
#pragma unroll
  for (int j = 0; j < kTasks; ++j) {
    float ds[kK / 32], n[kK / 32];
    nd_rows[j] = 0.f;
    if (warp + 8 * j >= 2 * L) continue;
    row(warp + 8 * j, ds, n);
#pragma unroll
    for (int i = 0; i < kK / 32; ++i) nd_rows[j] += n[i] * ds[i];
  }
  const float nd_lane = warp_sum_transposed(nd_rows);  // lane l: the row of j = l % 16
#pragma unroll 1
  for (int j = 0; j < kTasks; ++j) {  // (the stores' code once: the kernel's code is near the instruction cache's size)
    const int task = warp + 8 * j;
    if (task >= 2 * L) break;
    const bool is_k = task >= L;
    const int t = task % L;
    const float r = (is_k ? ct.rk : ct.rq)[t];
    const float nd = in.l2norm ? __shfl_sync(0xffffffffu, nd_lane, j) : 0.f;
    float ds[kK / 32], n[kK / 32];
    row(task, ds, n);
#pragma unroll
    for (int i = 0; i < kK / 32; ++i) {
      store_elem(is_k ? out.dk : out.dq, ((t0 + t) * HV + blockIdx.y) * kK + lane + 32 * i, (ds[i] - n[i] * nd) * r,
                 out.eq);
    }
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

// The finishing pass (group sum, normalisation, token-major, output types) over head-major dq,
// dk, dg, dbeta.
void run_finish(const Problem& p, const Launch& l, const float* dq, const float* dk, const float* dg,
                const float* dbeta, const at::Tensor& q, const at::Tensor& k, bool l2norm, const GradOut& out) {
  const FinishArgs a{dq, dk, dg, dbeta, q.data_ptr(), k.data_ptr(), elem_of(q, "kda"), l2norm, out, l.seqs.tokens,
                     static_cast<int>(p.H), static_cast<int>(p.HV), static_cast<int>(p.K)};
  const dim3 grid(static_cast<unsigned>(l.seqs.tokens),
                  static_cast<unsigned>(ceil_div(2 * p.H + p.HV, int64_t{kRowWarps})));
  finish_grads_kernel<<<grid, 32 * kRowWarps, 0, l.stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void run_chunk_bwd(const Problem& p, const Inputs& in, const Launch& l, const Intra<float>& intra,
                   const float* starts, const float* dends, const at::Tensor& grad_o, const at::Tensor& q,
                   const at::Tensor& k, bool l2norm, Grads& gr) {
  const auto opts = in.q.options();
  const int64_t rows = p.HV * l.seqs.tokens;
  std::vector<at::Tensor> keep;
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
        l.seqs, Sizes<float>{p.H, p.HV, p.K, p.V, p.bf16_products}, static_cast<float>(p.scale),
        in.q.data_ptr<float>(), in.k.data_ptr<float>(), in.v.data_ptr<float>(), in.g.data_ptr<float>(),
        in.beta.data_ptr<float>(), intra, starts, dends, grad_o.data_ptr<float>(), w, gr.dv.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  run_finish(p, l, dq.data_ptr<float>(), dk.data_ptr<float>(), dg.data_ptr<float>(), dbeta.data_ptr<float>(), q, k,
             l2norm, grad_out(gr));
}

template <int kK, typename T>
void run_chunk_bwd_bf16(const Problem& p, const Inputs& raw, bool l2norm, const Launch& l,
                        const Intra<__nv_bfloat16>& intra, const __nv_bfloat16* starts,
                        const __nv_bfloat16* dends, const at::Tensor& dOs, Grads& gr) {
  using bf16 = __nv_bfloat16;
  const int64_t rows = p.HV * l.seqs.tokens;
  if (rows == 0 || l.seqs.slots == 0) return;
  std::vector<at::Tensor> keep;
  const auto ws = [&](int64_t n) {
    keep.push_back(at::empty({std::max<int64_t>(1, n)}, raw.q.options().dtype(at::kFloat)));
    return keep.back().data_ptr<float>();
  };
  // Head-major: dq, dk, dg, dbeta (every row of a chunk is written), ZW, dA, dAqk, sum_j dS1 S0.
  const BwdWork<float> w{nullptr, nullptr, nullptr, ws(rows * kK), nullptr, nullptr, nullptr,
                         ws(rows * kK), ws(rows * kK), ws(rows * kK), ws(rows),
                         ws(rows * kChunk), ws(rows * kChunk), ws(p.HV * l.seqs.slots * kK)};
  const GradOut out = grad_out(gr);
  const bool direct = p.HV == p.H;
  RawIn<T> ri = raw_in<T>(raw, l2norm, p.gate);
  at::Tensor bias_part, alog_part;  // the in-kernel gate's per-chunk sums (zero for the unused slots)
  if (p.gate.on()) {
    bias_part = at::zeros({p.HV, l.seqs.slots, kK}, raw.q.options().dtype(at::kFloat));
    alog_part = at::zeros({p.HV, l.seqs.slots}, bias_part.options());
    ri.gate.bias_part = bias_part.data_ptr<float>();
    ri.gate.alog_part = alog_part.data_ptr<float>();
  }
  const dim3 grid(static_cast<unsigned>(l.seqs.slots), static_cast<unsigned>(p.HV));
  const auto dense = bwd_dense_bf16_kernel<kK, T>;
  set_smem(dense, BwdDenseBf16<kK>::bytes());
  dense<<<grid, BwdDenseBf16<kK>::kThreads, BwdDenseBf16<kK>::bytes(), l.stream>>>(
      l.seqs, p.HV, static_cast<int>(p.V), intra, starts, dends, static_cast<const bf16*>(dOs.data_ptr()), ri, w,
      static_cast<T*>(gr.dv.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const auto pairs = bwd_pairs_kernel<kK, T>;
  set_smem(pairs, Pairs<kK, T>::bytes());
  pairs<<<grid, ChunkTiles16<kK, T>::kThreads, Pairs<kK, T>::bytes(), l.stream>>>(l.seqs, p.H, p.HV, ri, intra.A, w,
                                                                                   direct ? out : GradOut{});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (!direct) run_finish(p, l, w.dq, w.dk, w.dg, w.dbeta, raw.q, raw.k, l2norm, out);
  if (p.gate.on()) {
    gr.ddt_bias = bias_part.sum(1).reshape({p.HV * kK});
    gr.dA_log = alog_part.sum(1);
  }
}

#define KDA_CHUNK_BWD_BF16(K, T)                                                                                  \
  template void run_chunk_bwd_bf16<K, T>(const Problem&, const Inputs&, bool, const Launch&,                     \
                                         const Intra<__nv_bfloat16>&, const __nv_bfloat16*, const __nv_bfloat16*,   \
                                         const at::Tensor&, Grads&);
KDA_CHUNK_BWD_BF16(64, __nv_bfloat16)
KDA_CHUNK_BWD_BF16(128, __nv_bfloat16)
KDA_CHUNK_BWD_BF16(64, __half)
KDA_CHUNK_BWD_BF16(128, __half)
#undef KDA_CHUNK_BWD_BF16

}  // namespace kda_dsa_ops::kda
