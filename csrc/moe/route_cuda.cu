// moe_route on CUDA. One warp per token, its row staged in shared memory: lane l holds the
// keys (score + bias) of kPerLane experts in registers, in 16-byte vectors. Selection (ties to
// the lower index, NaN keys last): the k-th largest of the 32 lane maxima bounds the k-th
// largest key from below, so only keys at or above it can be chosen; those few candidates are
// sorted as (key, index) pairs by one warp bitonic sort. When k > 32 or too many keys tie at the
// bound, k rounds of a warp arg-max select instead. The chosen scores are recomputed from their
// logits, renormalised and scaled. The backward recomputes the scores the same way: for softmax
// scores every expert's, for sigmoid scores (each depending on its own logit alone) only the
// chosen ones, written with the zeros of the rest in one pass. Group-limited routing (n_group
// > 1): lane l scores groups l and l + 32 by their two best keys (read back from the staged
// row), topk_group rounds of a warp arg-max open the best groups, and the keys of every other
// expert become -inf before the selection.
#include "common/checks.h"
#include "common/device.cuh"
#include "common/dispatch.h"
#include "common/hopper.cuh"
#include "moe/moe.h"

#include <algorithm>
#include <limits>
#include <type_traits>

namespace kda_dsa_ops::moe {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxExperts = 2048;
constexpr int kCandidates = 64;  // per warp: keys at or above the bound, sorted 2 per lane

struct SoftmaxStats {
  float max = 0.f, inv_sum = 1.f;  // the row's maximum logit and 1 / sum(exp(x - max))
};

// The score of one logit, computed exactly as warp_scores computes it: hardware exp2 and
// reciprocal (relative error near 1e-6 for |x| <= 16, far below what separates experts; the
// correctly rounded __frcp_rn wrapped every score in a slow-path branch: 5% of the forward).
template <ScoreFn kFn>
__device__ __forceinline__ float score_of(float x, SoftmaxStats st) {
  return kFn == ScoreFn::kSigmoid ? rcp_ftz(1.f + exp2_ftz(-kLog2e * x)) : exp2_ftz(kLog2e * (x - st.max)) * st.inv_sum;
}

// The selection key of one slot: score plus bias, the sum kept apart from the score's product
// (no fused multiply-add) so that every recomputation of a key gives the same bits.
template <ScoreFn kFn>
__device__ __forceinline__ float key_of(float x, float bias, SoftmaxStats st) {
  return __fadd_rn(score_of<kFn>(x, st), bias);
}

// The scores of one token: lane l holds experts l, l + 32, ... in s (slots past E: 0).
template <typename T, int kPerLane, ScoreFn kFn>
__device__ __forceinline__ SoftmaxStats warp_scores(const T* logits, int E, float (&s)[kPerLane]) {
  const int lane = threadIdx.x % kWarpSize;
  SoftmaxStats st;
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = i * kWarpSize + lane;
    s[i] = e < E ? to_float(logits[e]) : -INFINITY;
    mx = fmaxf(mx, s[i]);
  }
  if constexpr (kFn == ScoreFn::kSoftmax) {
    st.max = warp_reduce(mx, MaxOp{});
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) sum += i * kWarpSize + lane < E ? exp2_ftz(kLog2e * (s[i] - st.max)) : 0.f;
    st.inv_sum = __frcp_rn(warp_reduce(sum, SumOp{}));
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    s[i] = i * kWarpSize + lane < E ? score_of<kFn>(s[i], st) : 0.f;
  }
  return st;
}

// Bitonic sort across the warp, one value per lane, ascending (or descending).
template <bool kAscending, typename V>
__device__ __forceinline__ V warp_sort32(V v) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int size = 2; size <= kWarpSize; size *= 2) {
#pragma unroll
    for (int stride = size / 2; stride > 0; stride /= 2) {
      const V other = __shfl_xor_sync(0xffffffffu, v, stride);
      const bool keep_smaller = ((lane & stride) == 0) == (((lane & size) == 0) == kAscending);
      v = keep_smaller == (v < other) ? v : other;
    }
  }
  return v;
}

// Bitonic sort of 64 values across the warp, ascending: element `lane` in lo, `lane + 32` in hi.
__device__ __forceinline__ void warp_sort64_ascending(uint64_t& lo, uint64_t& hi) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int size = 2; size <= 2 * kWarpSize; size *= 2) {
#pragma unroll
    for (int stride = size / 2; stride > 0; stride /= 2) {
      if (stride == kWarpSize) {  // elements lane and lane + 32 meet in the same lane
        const uint64_t a = lo < hi ? lo : hi, b = lo < hi ? hi : lo;
        lo = a;
        hi = b;
        continue;
      }
      const bool lower = (lane & stride) == 0;
      const uint64_t other_lo = __shfl_xor_sync(0xffffffffu, lo, stride);
      const uint64_t other_hi = __shfl_xor_sync(0xffffffffu, hi, stride);
      const bool asc_lo = (lane & size) == 0, asc_hi = ((lane + kWarpSize) & size) == 0;
      lo = (lower == asc_lo) == (lo < other_lo) ? lo : other_lo;
      hi = (lower == asc_hi) == (hi < other_hi) ? hi : other_hi;
    }
  }
}

// The warp's best (value, index) pair, ties to the lower index; index INT_MAX: a lane with none.
// Every lane returns the winner.
__device__ __forceinline__ void warp_argmax(float& best, int& best_i) {
#pragma unroll
  for (int d = kWarpSize / 2; d > 0; d /= 2) {
    const float o_value = __shfl_xor_sync(0xffffffffu, best, d);
    const int o_i = __shfl_xor_sync(0xffffffffu, best_i, d);
    if (o_i != INT_MAX && (best_i == INT_MAX || o_value > best || (o_value == best && o_i < best_i))) {
      best = o_value;
      best_i = o_i;
    }
  }
}

// Groups of `size` consecutive experts; bit g of `open` set: group g may be chosen from.
struct Groups {
  int size = 0;  // 0: no group limit
  uint64_t open = ~0ull;
  __device__ bool closed(int e) const { return size != 0 && !((open >> (e / size)) & 1); }
};

// The groups whose two best keys (score + bias, NaN as -inf) sum highest, ties to the lower group.
template <typename T, ScoreFn kFn>
__device__ __forceinline__ Groups open_groups(const T* row, const float* bias_s, int E, int n_group, int topk_group,
                                              SoftmaxStats st) {
  const int lane = threadIdx.x % kWarpSize, size = E / n_group;
  float group_score[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int g = h * kWarpSize + lane;
    float first = -INFINITY, second = -INFINITY;
    for (int e = g * size; g < n_group && e < (g + 1) * size; ++e) {
      const float v = key_of<kFn>(to_float(row[e]), bias_s[e], st);
      if (v > first) {
        second = first;
        first = v;
      } else if (v > second) {
        second = v;
      }
    }
    group_score[h] = g < n_group ? first + second : NAN;  // NaN: no such group
  }
  Groups groups{size, 0};
  for (int j = 0; j < topk_group; ++j) {
    float best = NAN;
    int best_g = INT_MAX;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int g = h * kWarpSize + lane;
      const bool candidate = g < n_group && !((groups.open >> g) & 1);
      if (candidate && (best_g == INT_MAX || group_score[h] > best)) {
        best = group_score[h];
        best_g = g;
      }
    }
    warp_argmax(best, best_g);
    groups.open |= 1ull << best_g;
  }
  return groups;
}

// k rounds of a warp arg-max over the token's keys (score + bias, NaN ranking last), computed
// here so that the rare path keeps its registers out of the common one; ids[j] receives the
// j-th pick (any k <= E). The row may be in shared or global memory.
template <typename T, int kPerLane, ScoreFn kFn>
__device__ __noinline__ void select_by_rounds(const T* row, const float* bias, int E, int k, Groups groups,
                                              int* __restrict__ ids) {
  const int lane = threadIdx.x % kWarpSize;
  float key[kPerLane];
  warp_scores<T, kPerLane, kFn>(row, E, key);
  uint64_t taken = 0;  // slots past E are never picked
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = i * kWarpSize + lane;
    if (e < E) {
      key[i] = groups.closed(e) ? -INFINITY : fmaxf(__fadd_rn(key[i], bias != nullptr ? bias[e] : 0.f), -INFINITY);
    } else {
      taken |= 1ull << i;
    }
  }
  for (int j = 0; j < k; ++j) {
    float best = -INFINITY;
    int best_e = INT_MAX;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (!((taken >> i) & 1) && (best_e == INT_MAX || key[i] > best)) {
        best = key[i];
        best_e = i * kWarpSize + lane;
      }
    }
    warp_argmax(best, best_e);
    if (best_e % kWarpSize == lane) {
      taken |= 1ull << (best_e / kWarpSize);
      ids[j] = best_e;
    }
  }
}

// The forward stages each token's row in shared memory. A warp owns two row buffers and, when
// rows are 16-byte aligned, fetches its next token's row with one bulk copy while it selects for
// the current one (otherwise its lanes copy the row first). Rows and the bias are padded with
// -inf to whole groups of 16-byte vectors: a padded slot's key is -inf, so the key pass reads
// vectors and checks no bounds.
template <typename T, int kPerLane>
struct StagedRow {
  static constexpr int kVec = std::min<int>(16 / sizeof(T), kPerLane);  // slots per vector
  static constexpr int kGroups = kPerLane / kVec;
  // Slot i of a lane is expert (i / kVec * 32 + lane) * kVec + i % kVec.
  __device__ static int expert(int i, int lane) { return (i / kVec * kWarpSize + lane) * kVec + i % kVec; }
  __host__ __device__ static int groups(int E) { return static_cast<int>(ceil_div(E, kWarpSize * kVec)); }
  __host__ __device__ static int padded(int E) { return groups(E) * kWarpSize * kVec; }
  // Bytes of shared memory per block: the bias, two rows and the candidates per warp, two
  // mbarriers per warp.
  static size_t smem_bytes(int E) {
    return padded(E) * (sizeof(float) + kWarpsPerBlock * 2 * sizeof(T)) +
           kWarpsPerBlock * (kCandidates * sizeof(int2) + 2 * sizeof(uint64_t));
  }
};

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}

// One token, its row staged in shared memory; writes the token's k weights and ids.
template <typename T, int kPerLane, ScoreFn kFn>
__device__ __forceinline__ void route_token(const T* row, const float* bias_s, const float* bias, int E, int k,
                                            int n_group, int topk_group, bool renorm, float scale, int2* cand,
                                            float* w_out, int* id_out) {
  using Row = StagedRow<T, kPerLane>;
  constexpr int kVec = Row::kVec;
  using Mask = std::conditional_t<(kPerLane > 32), uint64_t, uint32_t>;
  const int lane = threadIdx.x % kWarpSize, groups = Row::groups(E);
  SoftmaxStats st;
  if constexpr (kFn == ScoreFn::kSoftmax) {  // padded slots: exp2(-inf) = 0
    float mx = -INFINITY, sum = 0.f;
#pragma unroll
    for (int g = 0; g < Row::kGroups; ++g) {
      if (g >= groups) continue;
      const auto x = load_pack<T, kVec>(row + (g * kWarpSize + lane) * kVec);
#pragma unroll
      for (int j = 0; j < kVec; ++j) mx = fmaxf(mx, to_float(x.v[j]));
    }
    st.max = warp_reduce(mx, MaxOp{});
#pragma unroll
    for (int g = 0; g < Row::kGroups; ++g) {
      if (g >= groups) continue;
      const auto x = load_pack<T, kVec>(row + (g * kWarpSize + lane) * kVec);
#pragma unroll
      for (int j = 0; j < kVec; ++j) sum += exp2_ftz(kLog2e * (to_float(x.v[j]) - st.max));
    }
    st.inv_sum = __frcp_rn(warp_reduce(sum, SumOp{}));
  }
  const Groups open = n_group > 1 ? open_groups<T, kFn>(row, bias_s, E, n_group, topk_group, st) : Groups{};
  float key[kPerLane];  // slots of groups past `groups` are never read
  float lane_max = -INFINITY;  // fmaxf passes over NaN keys: they never reach the candidates
#pragma unroll
  for (int g = 0; g < Row::kGroups; ++g) {
    if (g >= groups) continue;
    const auto x = load_pack<T, kVec>(row + (g * kWarpSize + lane) * kVec);
    const auto b = load_pack<float, kVec>(bias_s + (g * kWarpSize + lane) * kVec);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const bool closed = open.closed(Row::expert(g * kVec + j, lane));
      key[g * kVec + j] = closed ? -INFINITY : key_of<kFn>(to_float(x.v[j]), b.v[j], st);
      lane_max = fmaxf(lane_max, key[g * kVec + j]);
    }
  }
  if (k <= kWarpSize) {
    // Keys at or above the bound are not NaN and, when the bound is above -inf, not padding.
    const float bound = __shfl_sync(0xffffffffu, warp_sort32<false>(lane_max), k - 1);
    Mask mask = 0;
#pragma unroll
    for (int g = 0; g < Row::kGroups; ++g) {
      if (g >= groups) continue;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        if (key[g * kVec + j] >= bound) mask |= Mask{1} << (g * kVec + j);
      }
    }
    const int count = kPerLane > 32 ? __popcll(mask) : __popc(static_cast<uint32_t>(mask));
    const int inclusive = warp_inclusive_scan(count, SumOp{});
    const int total = __shfl_sync(0xffffffffu, inclusive, kWarpSize - 1);
    if (bound > -INFINITY && total <= kCandidates) {
      // Each candidate's key is recomputed from the row: the same operations give the same bits.
      int pos = inclusive - count;
      while (mask != 0) {
        const int i = kPerLane > 32 ? __ffsll(mask) - 1 : __ffs(static_cast<uint32_t>(mask)) - 1;
        mask &= mask - 1;
        const int e = Row::expert(i, lane);
        cand[pos++] = make_int2(__float_as_int(key_of<kFn>(to_float(row[e]), bias_s[e], st)), e);
      }
      __syncwarp();
      auto sort_key = [&](int j) {
        const int2 c = cand[j];
        return (static_cast<uint64_t>(descending_bits(__int_as_float(c.x))) << 32) | static_cast<uint32_t>(c.y);
      };
      uint64_t lo = lane < total ? sort_key(lane) : ~0ull;
      if (total <= kWarpSize) {
        lo = warp_sort32<true>(lo);
      } else {
        uint64_t hi = lane + kWarpSize < total ? sort_key(lane + kWarpSize) : ~0ull;
        warp_sort64_ascending(lo, hi);
      }
      const int chosen = static_cast<int>(lo & 0xffffffffu);
      const float w = lane < k ? score_of<kFn>(to_float(row[chosen]), st) : 0.f;
      const float sum = warp_reduce(w, SumOp{});
      const float norm = renorm ? scale / (sum + static_cast<float>(kRenormEps)) : scale;
      if (lane < k) {
        id_out[lane] = chosen;
        w_out[lane] = w * norm;
      }
      return;
    }
  }
  select_by_rounds<T, kPerLane, kFn>(row, bias, E, k, open, id_out);
  __syncwarp();
  float sum = 0.f;
  for (int j = lane; j < k; j += kWarpSize) {
    const float w = score_of<kFn>(to_float(row[id_out[j]]), st);
    w_out[j] = w;
    sum += w;
  }
  sum = warp_reduce(sum, SumOp{});
  const float norm = renorm ? scale / (sum + static_cast<float>(kRenormEps)) : scale;
  for (int j = lane; j < k; j += kWarpSize) w_out[j] *= norm;
}

// Warps walk tokens blockIdx.x * 4 + warp, then + gridDim.x * 4, ... (the grid fills the GPU
// once). Up to 32 keys per lane the kernel is held to 96 registers (5 blocks, 20 warps per SM; at
// 80 the keys spilled); more keys per lane keep their registers.
template <typename T, int kPerLane, ScoreFn kFn>
__global__ void __launch_bounds__(kWarpsPerBlock * kWarpSize, kPerLane <= 32 ? 5 : 1) route_kernel(
    const T* __restrict__ logits, const float* __restrict__ bias, int T_, int E, int k, int n_group, int topk_group,
    bool renorm, float scale, bool bulk, float* __restrict__ weights, int* __restrict__ ids) {
  using Row = StagedRow<T, kPerLane>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int padded = Row::padded(E);
  float* bias_s = reinterpret_cast<float*>(smem);
  T* all_rows = reinterpret_cast<T*>(bias_s + padded);
  int2* all_cand = reinterpret_cast<int2*>(all_rows + kWarpsPerBlock * 2 * padded);
  T* rows = all_rows + warp * 2 * padded;
  int2* cand = all_cand + warp * kCandidates;
  uint64_t* bars = reinterpret_cast<uint64_t*>(all_cand + kWarpsPerBlock * kCandidates) + warp * 2;
#ifndef KDA_SM90A_ENABLED
  bulk = false;  // bulk copies and their mbarriers: sm_90a builds
#endif
  for (int i = threadIdx.x; i < padded; i += blockDim.x) {
    bias_s[i] = i >= E ? -INFINITY : bias != nullptr ? bias[i] : 0.f;
  }
  for (int i = E + lane; i < padded; i += kWarpSize) rows[i] = rows[padded + i] = from_float<T>(-INFINITY);
#ifdef KDA_SM90A_ENABLED
  if (bulk && lane == 0) {
    sm90::mbar_init(bars, 1);
    sm90::mbar_init(bars + 1, 1);
    sm90::mbar_init_fence();
  }
#endif
  __syncthreads();
  const int stride = gridDim.x * kWarpsPerBlock;
  const auto fetch = [&](int t, int s) {
#ifdef KDA_SM90A_ENABLED
    const uint32_t bytes = static_cast<uint32_t>(E * sizeof(T));
    sm90::mbar_arrive_expect_tx(bars + s, bytes);
    sm90::bulk_load(rows + s * padded, logits + static_cast<int64_t>(t) * E, bytes, bars + s);
#endif
  };
  int t = blockIdx.x * kWarpsPerBlock + warp;
  if (bulk && lane == 0 && t < T_) fetch(t, 0);
  for (int iter = 0; t < T_; t += stride, ++iter) {
    const int s = iter & 1;
    T* row = rows + s * padded;
    if (bulk) {
      if (lane == 0 && t + stride < T_) fetch(t + stride, s ^ 1);  // its buffer was read last token
#ifdef KDA_SM90A_ENABLED
      sm90::mbar_wait(bars + s, (iter >> 1) & 1);
#endif
    } else {
      const T* src = logits + static_cast<int64_t>(t) * E;
      for (int i = lane; i < E; i += kWarpSize) row[i] = src[i];
      __syncwarp();
    }
    route_token<T, kPerLane, kFn>(row, bias_s, bias, E, k, n_group, topk_group, renorm, scale, cand,
                                  weights + static_cast<int64_t>(t) * k, ids + static_cast<int64_t>(t) * k);
    __syncwarp();  // every lane is done with the row and the candidates before they are rewritten
  }
}

// Per warp, shared memory holds the token's scores and their gradients ([2, E] floats), so
// that the chosen experts can be looked up and scattered to by index.
template <typename T, int kPerLane>
__global__ void __launch_bounds__(kWarpsPerBlock * kWarpSize) route_bwd_kernel(
    const float* __restrict__ grad_weights, const T* __restrict__ logits, const int* __restrict__ ids, int T_, int E,
    int k, ScoreFn fn, bool renorm, float scale, T* __restrict__ grad_logits) {
  extern __shared__ float shared[];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int t = blockIdx.x * kWarpsPerBlock + warp;
  if (t >= T_) return;
  float* scores = shared + static_cast<int64_t>(warp) * 2 * E;
  float* dscores = scores + E;
  const T* row = logits + static_cast<int64_t>(t) * E;
  float s[kPerLane];
  if (fn == ScoreFn::kSigmoid) {
    warp_scores<T, kPerLane, ScoreFn::kSigmoid>(row, E, s);
  } else {
    warp_scores<T, kPerLane, ScoreFn::kSoftmax>(row, E, s);
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = i * kWarpSize + lane;
    if (e < E) {
      scores[e] = s[i];
      dscores[e] = 0.f;
    }
  }
  __syncwarp();
  const int* id = ids + static_cast<int64_t>(t) * k;
  const float* g = grad_weights + static_cast<int64_t>(t) * k;
  float sum = 0.f, gsum = 0.f;  // sum of chosen scores u_j, and sum of g_j * u_j
  for (int j = lane; j < k; j += kWarpSize) {
    const int e = id[j];
    const float u = e >= 0 && e < E ? scores[e] : 0.f;
    sum += u;
    gsum += g[j] * u;
  }
  sum = warp_reduce(sum, SumOp{});
  gsum = warp_reduce(gsum, SumOp{});
  // w_j = scale * u_j / D with D = sum + eps: dL/du_j = scale * (g_j / D - gsum / D^2).
  const float denom = sum + static_cast<float>(kRenormEps);
  for (int j = lane; j < k; j += kWarpSize) {
    const int e = id[j];
    if (e >= 0 && e < E) atomicAdd(dscores + e, renorm ? scale * (g[j] / denom - gsum / (denom * denom)) : scale * g[j]);
  }
  __syncwarp();
  T* out = grad_logits + static_cast<int64_t>(t) * E;
  float dot = 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = i * kWarpSize + lane;
    if (e < E) dot += dscores[e] * s[i];
  }
  if (fn == ScoreFn::kSoftmax) dot = warp_reduce(dot, SumOp{});
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = i * kWarpSize + lane;
    if (e >= E) continue;
    const float ds = dscores[e];
    out[e] = from_float<T>(fn == ScoreFn::kSigmoid ? (ds == 0.f ? 0.f : ds * sigmoid_grad(to_float(row[e])))
                                                   : s[i] * (ds - dot));
  }
}

// Sigmoid scores, k <= 32: the gradient is zero but at the chosen experts, so only the chosen
// logits are read. One warp per token, lane j holds choice j; a repeated expert gets the sum of
// its choices' gradients (in choice order), placed by its first lane into the warp's [E] row in
// shared memory, which then goes out whole, zeros included, in coalesced stores.
template <typename T>
__global__ void __launch_bounds__(kWarpsPerBlock * kWarpSize) route_bwd_sigmoid_kernel(
    const float* __restrict__ grad_weights, const T* __restrict__ logits, const int* __restrict__ ids, int T_, int E,
    int k, bool renorm, float scale, T* __restrict__ grad_logits) {
  extern __shared__ float shared[];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int t = blockIdx.x * kWarpsPerBlock + warp;
  if (t >= T_) return;
  float* dx = shared + static_cast<int64_t>(warp) * E;
  for (int e = lane; e < E; e += kWarpSize) dx[e] = 0.f;
  const int64_t row = static_cast<int64_t>(t) * E;
  const int e = lane < k ? ids[static_cast<int64_t>(t) * k + lane] : -1;
  const bool valid = e >= 0 && e < E;
  const float x = valid ? to_float(logits[row + e]) : 0.f;
  const float g = lane < k ? grad_weights[static_cast<int64_t>(t) * k + lane] : 0.f;
  const float u = valid ? score_of<ScoreFn::kSigmoid>(x, SoftmaxStats{}) : 0.f;
  const float sum = warp_reduce(u, SumOp{}), gsum = warp_reduce(g * u, SumOp{});
  // As route_bwd_kernel: dL/du_j = scale * (g_j / D - gsum / D^2), D = sum + eps.
  const float denom = sum + static_cast<float>(kRenormEps);
  const float ds = valid ? (renorm ? scale * (g / denom - gsum / (denom * denom)) : scale * g) : 0.f;
  float total = 0.f;
  bool first = true;
  for (int j = 0; j < k; ++j) {
    const int ej = __shfl_sync(0xffffffffu, e, j);
    const float dj = __shfl_sync(0xffffffffu, ds, j);
    if (ej == e) {
      total += dj;
      first = first && j >= lane;
    }
  }
  __syncwarp();
  if (valid && first) dx[e] = total * sigmoid_grad(x);
  __syncwarp();
  for (int i = lane; i < E; i += kWarpSize) grad_logits[row + i] = from_float<T>(dx[i]);
}

// Calls f(std::integral_constant<int, P>) with P the smallest power of two >= ceil(E / 32).
template <typename F>
void dispatch_per_lane(int64_t E, F&& f) {
  const int64_t per_lane = ceil_div(E, kWarpSize);
  if (per_lane <= 1) return f(std::integral_constant<int, 1>{});
  if (per_lane <= 2) return f(std::integral_constant<int, 2>{});
  if (per_lane <= 4) return f(std::integral_constant<int, 4>{});
  if (per_lane <= 8) return f(std::integral_constant<int, 8>{});
  if (per_lane <= 16) return f(std::integral_constant<int, 16>{});
  if (per_lane <= 32) return f(std::integral_constant<int, 32>{});
  return f(std::integral_constant<int, 64>{});
}

void check_cuda_route(const at::Tensor& logits) {
  TORCH_CHECK(logits.size(1) <= kMaxExperts, "moe_route: the CUDA kernel takes at most ", kMaxExperts,
              " experts, got E = ", logits.size(1));
  TORCH_CHECK(logits.size(0) < std::numeric_limits<int32_t>::max(), "moe_route: T = ", logits.size(0),
              " tokens exceed int32");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> route_cuda(const at::Tensor& logits_in, const std::optional<at::Tensor>& bias_in,
                                              int64_t k, c10::string_view score_fn, bool renorm, double scale,
                                              int64_t n_group, int64_t topk_group) {
  check_route(logits_in, bias_in, k, n_group, topk_group);
  check_cuda_route(logits_in);
  const ScoreFn fn = parse_score_fn(score_fn);
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor bias = bias_in ? bias_in->to(at::kFloat).contiguous() : at::Tensor();
  const int64_t T = logits.size(0), E = logits.size(1);
  at::Tensor weights = at::empty({T, k}, logits.options().dtype(at::kFloat));
  at::Tensor ids = at::empty({T, k}, logits.options().dtype(at::kInt));
  if (T == 0) return {weights, ids};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  KDA_DISPATCH_CUDA_FLOATING(logits.scalar_type(), "moe_route", [&] {
    dispatch_per_lane(E, [&](auto per_lane) {
      constexpr int kPerLane = decltype(per_lane)::value;
      const bool bulk = E * sizeof(scalar_t) % 16 == 0 && reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16 == 0;
      const size_t smem = StagedRow<scalar_t, kPerLane>::smem_bytes(static_cast<int>(E));
      const auto launch = [&](auto kernel) {
        set_smem(kernel, smem);
        int blocks_per_sm = 0;
        C10_CUDA_CHECK(
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, kWarpsPerBlock * kWarpSize, smem));
        const int64_t fill = static_cast<int64_t>(std::max(blocks_per_sm, 1)) * num_sms(logits.get_device());
        kernel<<<std::min(ceil_div(T, kWarpsPerBlock), fill), kWarpsPerBlock * kWarpSize, smem, stream>>>(
            static_cast<const scalar_t*>(logits.data_ptr()), bias.defined() ? bias.data_ptr<float>() : nullptr, T, E,
            k, static_cast<int>(n_group), static_cast<int>(topk_group), renorm, static_cast<float>(scale), bulk,
            weights.data_ptr<float>(), ids.data_ptr<int>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      if (fn == ScoreFn::kSigmoid) {
        launch(route_kernel<scalar_t, kPerLane, ScoreFn::kSigmoid>);
      } else {
        launch(route_kernel<scalar_t, kPerLane, ScoreFn::kSoftmax>);
      }
    });
  });
  return {weights, ids};
}

at::Tensor route_bwd_cuda(const at::Tensor& grad_weights_in, const at::Tensor& logits_in, const at::Tensor& ids_in,
                          c10::string_view score_fn, bool renorm, double scale) {
  check_route_bwd(grad_weights_in, logits_in, ids_in);
  check_cuda_route(logits_in);
  const ScoreFn fn = parse_score_fn(score_fn);
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor ids = ids_in.contiguous();
  const at::Tensor gw = grad_weights_in.to(at::kFloat).contiguous();
  const int64_t T = logits.size(0), E = logits.size(1), k = ids.size(1);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(ceil_div(T, kWarpsPerBlock));
  at::Tensor grad_logits = at::empty_like(logits);
  if (T == 0) return grad_logits;
  if (fn == ScoreFn::kSigmoid && k <= kWarpSize) {
    const size_t smem = static_cast<size_t>(kWarpsPerBlock) * E * sizeof(float);
    KDA_DISPATCH_CUDA_FLOATING(logits.scalar_type(), "moe_route_bwd", [&] {
      const auto kernel = route_bwd_sigmoid_kernel<scalar_t>;
      set_smem(kernel, smem);
      kernel<<<grid, kWarpsPerBlock * kWarpSize, smem, stream>>>(
          gw.data_ptr<float>(), static_cast<const scalar_t*>(logits.data_ptr()), ids.data_ptr<int>(), T, E, k, renorm,
          static_cast<float>(scale), static_cast<scalar_t*>(grad_logits.data_ptr()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    return grad_logits;
  }
  const size_t smem = static_cast<size_t>(kWarpsPerBlock) * 2 * E * sizeof(float);
  KDA_DISPATCH_CUDA_FLOATING(logits.scalar_type(), "moe_route_bwd", [&] {
    dispatch_per_lane(E, [&](auto per_lane) {
      constexpr int kPerLane = decltype(per_lane)::value;
      const auto kernel = route_bwd_kernel<scalar_t, kPerLane>;
      set_smem(kernel, smem);
      kernel<<<grid, kWarpsPerBlock * kWarpSize, smem, stream>>>(
          gw.data_ptr<float>(), static_cast<const scalar_t*>(logits.data_ptr()), ids.data_ptr<int>(), T, E, k, fn,
          renorm, static_cast<float>(scale), static_cast<scalar_t*>(grad_logits.data_ptr()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return grad_logits;
}

}  // namespace kda_dsa_ops::moe
