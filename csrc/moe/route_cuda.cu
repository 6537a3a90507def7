// moe_route on CUDA. One warp per token: lane l holds the scores of experts l, l+32, ...
// (kPerLane of them) in registers. Selection (ties to the lower index, NaN keys last): the
// k-th largest of the 32 lane maxima bounds the k-th largest key from below, so only keys at or
// above it can be chosen; those few candidates are sorted as (key, index) pairs by one warp
// bitonic sort. When k > 32 or too many keys tie at the bound, k rounds of a warp arg-max
// select instead. The chosen scores are recomputed from their logits, renormalised and scaled.
// The backward recomputes the scores the same way: for softmax scores every expert's, for
// sigmoid scores (each depending on its own logit alone) only the chosen ones, written with the
// zeros of the rest in one pass.
#include "common/checks.h"
#include "common/device.cuh"
#include "common/dispatch.h"
#include "moe/moe.h"

#include <limits>
#include <type_traits>

namespace kda_dsa_ops::moe {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxExperts = 2048;
constexpr int kCandidates = 64;  // per warp: keys at or above the bound, sorted 2 per lane
constexpr float kLog2e = 1.4426950408889634f;

struct SoftmaxStats {
  float max = 0.f, inv_sum = 1.f;  // the row's maximum logit and 1 / sum(exp(x - max))
};

// 2^x and 1/x on the MUFU unit with denormals flushed (exp2f / __fdividef add a range check
// and rescale around every call to honour denormals, ~4 instructions per score).
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcp_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The score of one logit, computed exactly as warp_scores computes it: hardware exp2 and
// reciprocal (relative error near 1e-6 for |x| <= 16, far below what separates experts; the
// correctly rounded __frcp_rn wrapped every score in a slow-path branch: 5% of the forward).
template <ScoreFn kFn>
__device__ __forceinline__ float score_of(float x, SoftmaxStats st) {
  return kFn == ScoreFn::kSigmoid ? rcp_ftz(1.f + exp2_ftz(-kLog2e * x)) : exp2_ftz(kLog2e * (x - st.max)) * st.inv_sum;
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

// Selection keys of one token: score + bias, -inf for NaN and for slots past E (the fast
// selection takes only keys above -inf; select_by_rounds tells the slots past E apart).
// Sigmoid scores need no row statistics: one pass, each slot's bounds check made once.
template <typename T, int kPerLane, ScoreFn kFn>
__device__ __forceinline__ SoftmaxStats warp_keys(const T* row, const float* bias, int E, float (&key)[kPerLane]) {
  const int lane = threadIdx.x % kWarpSize;
  SoftmaxStats st;
  if constexpr (kFn == ScoreFn::kSoftmax) st = warp_scores<T, kPerLane, kFn>(row, E, key);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = i * kWarpSize + lane;
    const bool valid = e < E;
    const float score = kFn == ScoreFn::kSigmoid ? score_of<kFn>(valid ? to_float(row[e]) : 0.f, st) : key[i];
    key[i] = valid ? fmaxf(score + (bias != nullptr ? bias[e] : 0.f), -INFINITY) : -INFINITY;  // NaN -> -inf
  }
  return st;
}

// k rounds of a warp arg-max over the token's keys (recomputed here: the rare path keeps its
// registers out of the common one); ids[j] receives the j-th pick (any k <= E).
template <typename T, int kPerLane, ScoreFn kFn>
__device__ __noinline__ void select_by_rounds(const T* row, const float* bias, int E, int k, int* __restrict__ ids) {
  const int lane = threadIdx.x % kWarpSize;
  float key[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) key[i] = -INFINITY;
  warp_keys<T, kPerLane, kFn>(row, bias, E, key);
  uint64_t taken = 0;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    if (i * kWarpSize + lane >= E) taken |= 1ull << i;
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
#pragma unroll
    for (int d = kWarpSize / 2; d > 0; d /= 2) {
      const float o_key = __shfl_xor_sync(0xffffffffu, best, d);
      const int o_e = __shfl_xor_sync(0xffffffffu, best_e, d);
      if (o_e != INT_MAX && (best_e == INT_MAX || o_key > best || (o_key == best && o_e < best_e))) {
        best = o_key;
        best_e = o_e;
      }
    }
    if (best_e % kWarpSize == lane) {
      taken |= 1ull << (best_e / kWarpSize);
      ids[j] = best_e;
    }
  }
}

// Up to 32 keys per lane the kernel is held to 80 registers (6 blocks, 24 warps per SM), measured
// 8% faster than at 128 registers and 16 warps; more keys per lane keep their registers.
template <typename T, int kPerLane, ScoreFn kFn>
__global__ void __launch_bounds__(kWarpsPerBlock * kWarpSize, kPerLane <= 32 ? 6 : 1) route_kernel(
    const T* __restrict__ logits, const float* __restrict__ bias, int T_, int E, int k, bool renorm, float scale,
    float* __restrict__ weights, int* __restrict__ ids) {
  __shared__ int2 candidates[kWarpsPerBlock][kCandidates];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int t = blockIdx.x * kWarpsPerBlock + warp;
  if (t >= T_) return;
  const T* row = logits + static_cast<int64_t>(t) * E;
  float key[kPerLane];
  const SoftmaxStats st = warp_keys<T, kPerLane, kFn>(row, bias, E, key);
  float lane_max = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) lane_max = fmaxf(lane_max, key[i]);
  int* id_out = ids + static_cast<int64_t>(t) * k;
  float* w_out = weights + static_cast<int64_t>(t) * k;

  bool selected = false;
  int chosen = 0;  // lane j < k: the j-th pick
  if (k <= kWarpSize) {
    // Keys at or above the bound are finite, so none of them is a slot past E.
    const float bound = __shfl_sync(0xffffffffu, warp_sort32<false>(lane_max), k - 1);
    int count = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) count += key[i] >= bound;
    const int inclusive = warp_inclusive_scan(count, SumOp{});
    const int total = __shfl_sync(0xffffffffu, inclusive, kWarpSize - 1);
    if (bound > -INFINITY && total <= kCandidates) {
      int2* cand = candidates[warp];
      int pos = inclusive - count;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        if (key[i] >= bound) cand[pos++] = make_int2(__float_as_int(key[i]), i * kWarpSize + lane);
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
      chosen = static_cast<int>(lo & 0xffffffffu);
      selected = true;
    }
  }
  if (selected) {
    const float w = lane < k ? score_of<kFn>(to_float(row[chosen]), st) : 0.f;
    const float sum = warp_reduce(w, SumOp{});
    const float norm = renorm ? scale / (sum + static_cast<float>(kRenormEps)) : scale;
    if (lane < k) {
      id_out[lane] = chosen;
      w_out[lane] = w * norm;
    }
    return;
  }
  select_by_rounds<T, kPerLane, kFn>(row, bias, E, k, id_out);
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
                                              int64_t k, c10::string_view score_fn, bool renorm, double scale) {
  check_route(logits_in, bias_in, k);
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
  const dim3 grid(ceil_div(T, kWarpsPerBlock));
  KDA_DISPATCH_CUDA_FLOATING(logits.scalar_type(), "moe_route", [&] {
    dispatch_per_lane(E, [&](auto per_lane) {
      constexpr int kPerLane = decltype(per_lane)::value;
      const auto launch = [&](auto kernel) {
        kernel<<<grid, kWarpsPerBlock * kWarpSize, 0, stream>>>(
            static_cast<const scalar_t*>(logits.data_ptr()), bias.defined() ? bias.data_ptr<float>() : nullptr, T, E,
            k, renorm, static_cast<float>(scale), weights.data_ptr<float>(), ids.data_ptr<int>());
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
