// Sparse attention's forward at 8 or 16 query heads a kv head with Dqk <= 128 (GQA, mma.sync): the
// equations of attn_fwd_cuda.cu with the keys along the mma's rows, S^T = K Q^T and O^T += V^T P^T,
// so that a tile of 16 keys x 8 heads fills an m16n8k16 product whatever keys the neighbouring
// queries chose (a block of query rows would hold 8 or 16 of its 64 rows, or the union of several
// queries' selections).
// One block per (query, kv head) of four warps; each warp takes every fourth tile of 32 slots,
// gathered into its own two stages (cp.async, zeros for a slot without a key), and keeps its own
// online softmax: Q^T's fragments and O^T's accumulators stay in registers, P^T goes from the
// accumulators to the next product's operand by movmatrix. The warps' partial results are merged
// through shared memory at the end. With return_p a second pass sums the final probabilities over
// the heads. Occupancy bounds it (the stages' shared memory: three blocks an SM): with three stages
// a warp, two blocks an SM, 8 heads took 2.49 ms against 1.90 (T 4096, Tk 8192, 4 kv heads, H200,
// before the keys were loaded a tile ahead).
// Packed blocks whose queries share most keys stay on attn_fwd_cuda.cu's kernel (QueryPack's split).
#include <c10/cuda/CUDAGuard.h>

#include "common/dispatch.h"
#include "dsa/dsa_cuda.cuh"

namespace kda_dsa_ops::dsa {

namespace {

constexpr int kWarps = 4;
constexpr int kKeys = 32;       // slots of a warp's tile
constexpr int kM = kKeys / 16;  // its 16-key tiles of the products
constexpr int kStages = 2;      // a warp's tiles in flight
constexpr int kDim = 128;       // Dqk and dv, padded
constexpr int kLd = kDim + 8;
constexpr int kLdO = kDim + 4;  // the merge's rows (fp32, no bank conflicts)

template <int kG>
struct GqaShape {
  static constexpr int kN = kG / 8;  // 8-head tiles
  static constexpr size_t kRing = size_t{kWarps} * kStages * kKeys * kLd * 2;
  static constexpr size_t kQ = 16 * kLd * 2;
  static constexpr size_t kMerge = 2 * kWarps * kG * sizeof(float);  // each warp's maxima and sums
  static constexpr size_t kSmem = (kRing > kQ ? kRing : kQ) + kMerge;  // Q, then the ring
  static_assert(kWarps * kG * kLdO * sizeof(float) <= kRing, "the merge reuses the ring");
};

// The 8 x 8 16-bit matrix whose fragment (row lane / 4, cols 2 (lane % 4) ..) is x, transposed.
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

template <typename T, int kG>
__global__ void __launch_bounds__(kWarps * 32) gqa_fwd_kernel(AttnFwdArgs a) {
  using S = GqaShape<kG>;
  constexpr int kN = S::kN;
  extern __shared__ __align__(16) unsigned char smem[];
  T* ring = reinterpret_cast<T*>(smem);
  T* sQ = ring;  // until the fragments are loaded
  float* merge_m = reinterpret_cast<float*>(smem + (S::kSmem - S::kMerge));  // [kWarps][kG]
  float* merge_l = merge_m + kWarps * kG;                                     // [kWarps][kG]
  const int64_t t = blockIdx.x;
  if (attn_skips(a, t, blockIdx.y)) return;
  const int kvh = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int kd = round16(a.Dqk), kdv = round16(a.dv);
  const float sl2 = a.scale * kLog2e;
  const int64_t row0 = t * a.H + int64_t{kvh} * kG;  // q's row of head 0
  const int32_t* sel = a.indices + (t * a.Hkv + kvh) * a.topk;
  const T* q = static_cast<const T*>(a.q);
  const T* kv = static_cast<const T*>(a.kv);
  gather_rows(sQ, kLd, 16, a.Dqk, kDim, [&](int r) { return r < kG ? q + (row0 + r) * a.Dqk : nullptr; });
  cp_async_wait_all();
  __syncthreads();
  // Q^T as B fragments (dims x heads; zeros past Dqk and past the kG heads).
  uint32_t qb[kDim / 16][kN][2];
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
  __syncthreads();

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
      const int piece = lane % 16;
#pragma unroll
      for (int r = 0; r < kKeys / 2; ++r) {
        const int k = __shfl_sync(~0u, ok ? key : -1, 2 * r + lane / 16);
        const bool valid = k >= 0 && piece * 8 < a.Dqk;
        const T* src = kv + (int64_t{valid ? k : 0} * a.Hkv + kvh) * a.Dqk + (valid ? piece * 8 : 0);
        cp_async_16_zfill(dst + (2 * r + lane / 16) * kLd + piece * 8, src, valid);
      }
    }
    cp_async_commit();
    return mask;
  };
  // f(tile's rows, its mask, i) for each of the warp's tiles, kStages - 1 of them in flight ahead
  // and the keys of the next one loaded.
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
      f(my_ring + (i % kStages) * kKeys * kLd, masks[0], i);
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) masks[s] = masks[s + 1];
    }
    cp_async_wait<0>();
  };
  // The tile's logits in log2 units, S^T for keys 16 m + g (+ 8) and heads 8 n + 2 c (+ 1); -inf
  // where the slot has no key.
  // (the even and odd 16-dim steps into separate sums: two chains of dependent products a tile)
  const auto logits = [&](float (&s)[kM][kN][4], const T* tile, uint32_t mask) {
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
      if (kk * 16 >= kd) break;
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        uint32_t af[4];
        load_a(af, tile, kLd, 16 * m, kk * 16);
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
  };

  // The thread's heads 8 n + 2 c + h: running maxima (equal over g), its own keys' sums.
  float m_run[kN][2], l_run[kN][2];
  float o_acc[kDim / 16][kN][4] = {};  // O^T: dims 16 d + g (+ 8), heads 8 n + 2 c (+ 1)
#pragma unroll
  for (int n = 0; n < kN; ++n) {
    for (int h = 0; h < 2; ++h) {
      m_run[n][h] = -INFINITY;
      l_run[n][h] = 0.f;
    }
  }
  each_tile([&](const T* tile, uint32_t mask, int) {
    float s[kM][kN][4];
    logits(s, tile, mask);
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
      if (d * 16 >= kdv) break;
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        uint32_t va[4];
        load_a_trans(va, tile, kLd, d * 16, 16 * m);
#pragma unroll
        for (int n = 0; n < kN; ++n) mma_16816<T>(o_acc[d][n], va, pb[m][n][0], pb[m][n][1]);
      }
    }
  });

  // The merge: each warp's maxima and sums, then its O^T scaled to the block's maxima and sums.
#pragma unroll
  for (int n = 0; n < kN; ++n) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l_run[n][h] += __shfl_xor_sync(~0u, l_run[n][h], 4);
      l_run[n][h] += __shfl_xor_sync(~0u, l_run[n][h], 8);
      l_run[n][h] += __shfl_xor_sync(~0u, l_run[n][h], 16);
      if (g == 0) {
        merge_m[warp * kG + 8 * n + 2 * c + h] = m_run[n][h];
        merge_l[warp * kG + 8 * n + 2 * c + h] = l_run[n][h];
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
        o[0] = o_acc[d][n][h] * f;
        o[8] = o_acc[d][n][h + 2] * f;
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
  each_tile([&](const T* tile, uint32_t mask, int i) {
    float s[kM][kN][4];
    logits(s, tile, mask);
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

bool gqa_fwd_takes(const AttnProblem& p) {
  const int64_t G = p.Hkv > 0 ? p.H / p.Hkv : 0;
  return (G == 8 || G == 16) && p.Dqk <= kDim;
}

void gqa_fwd_cuda(const QueryPack& pk, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& gate,
                  at::Tensor& o, at::Tensor& lse, at::Tensor& probs) {
  const AttnProblem& p = pk.problem;
  const c10::cuda::CUDAGuard guard(q.device());
  KDA_DISPATCH_CUDA_HALF(q.scalar_type(), "sparse_attn_fwd", [&] {
    const auto run = [&](auto heads) {
      constexpr int kG = decltype(heads)::value;
      AttnFwdArgs a{attn_args(pk, q, kv, gate, kG), o.data_ptr(), lse.data_ptr<float>(),
                    probs.defined() ? probs.data_ptr<float>() : nullptr};
      launch(gqa_fwd_kernel<scalar_t, kG>, dim3(p.T, p.Hkv), kWarps * 32, GqaShape<kG>::kSmem, a);
    };
    if (p.H / p.Hkv == 8) {
      run(std::integral_constant<int, 8>{});
    } else {
      run(std::integral_constant<int, 16>{});
    }
  });
}

}  // namespace kda_dsa_ops::dsa
