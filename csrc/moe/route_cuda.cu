// moe_route on CUDA. One warp per token: lane l holds the scores of experts l, l+32, ...
// (kPerLane of them) in registers; k rounds of a warp arg-max pick the experts (ties to the
// lower index, NaN keys last); the chosen ids and scores go straight to memory, then the
// weights are renormalised in place. The backward recomputes the scores the same way.
#include "common/checks.h"
#include "common/device.cuh"
#include "common/dispatch.h"
#include "moe/moe.h"

#include <limits>

namespace kda_dsa_ops::moe {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxExperts = 2048;

template <typename T, int kPerLane>
__device__ __forceinline__ void warp_scores(const T* logits, int E, ScoreFn fn, float (&s)[kPerLane]) {
  const int lane = threadIdx.x % kWarpSize;
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = i * kWarpSize + lane;
    s[i] = e < E ? to_float(logits[e]) : -INFINITY;
    mx = fmaxf(mx, s[i]);
  }
  if (fn == ScoreFn::kSigmoid) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) s[i] = 1.f / (1.f + expf(-s[i]));
    return;
  }
  mx = warp_reduce(mx, MaxOp{});
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    s[i] = i * kWarpSize + lane < E ? expf(s[i] - mx) : 0.f;
    sum += s[i];
  }
  sum = warp_reduce(sum, SumOp{});
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) s[i] /= sum;
}

template <typename T, int kPerLane>
__global__ void __launch_bounds__(kWarpsPerBlock * kWarpSize) route_kernel(
    const T* __restrict__ logits, const float* __restrict__ bias, int T_, int E, int k, ScoreFn fn, bool renorm,
    float scale, float* __restrict__ weights, int* __restrict__ ids) {
  const int t = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (t >= T_) return;
  float s[kPerLane], key[kPerLane];
  warp_scores<T, kPerLane>(logits + static_cast<int64_t>(t) * E, E, fn, s);
  uint64_t taken = 0;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = i * kWarpSize + lane;
    const float v = e < E ? s[i] + (bias ? bias[e] : 0.f) : -INFINITY;
    key[i] = isnan(v) ? -INFINITY : v;
    if (e >= E) taken |= 1ull << i;
  }
  float* w_out = weights + static_cast<int64_t>(t) * k;
  int* id_out = ids + static_cast<int64_t>(t) * k;
  float sum = 0.f;
  for (int j = 0; j < k; ++j) {
    float best = -INFINITY, best_score = 0.f;
    int best_e = INT_MAX, best_i = -1;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (!((taken >> i) & 1) && (best_i < 0 || key[i] > best)) {
        best = key[i];
        best_e = i * kWarpSize + lane;
        best_i = i;
        best_score = s[i];
      }
    }
#pragma unroll
    for (int d = kWarpSize / 2; d > 0; d /= 2) {
      const float o_key = __shfl_xor_sync(0xffffffffu, best, d);
      const int o_e = __shfl_xor_sync(0xffffffffu, best_e, d);
      const float o_score = __shfl_xor_sync(0xffffffffu, best_score, d);
      if (o_e != INT_MAX && (best_e == INT_MAX || o_key > best || (o_key == best && o_e < best_e))) {
        best = o_key;
        best_e = o_e;
        best_score = o_score;
      }
    }
    if (best_e % kWarpSize == lane) {
      taken |= 1ull << (best_e / kWarpSize);
      id_out[j] = best_e;
      w_out[j] = best_score;
    }
    sum += best_score;
  }
  const float norm = renorm ? scale / (sum + static_cast<float>(kRenormEps)) : scale;
  __syncwarp();
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
  float s[kPerLane];
  warp_scores<T, kPerLane>(logits + static_cast<int64_t>(t) * E, E, fn, s);
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
    out[e] = from_float<T>(fn == ScoreFn::kSigmoid ? ds * s[i] * (1.f - s[i]) : s[i] * (ds - dot));
  }
}

// Calls f.template operator()<kPerLane>() with the smallest power of two >= ceil(E / 32).
template <typename F>
void dispatch_per_lane(int64_t E, F&& f) {
  const int64_t per_lane = ceil_div(E, kWarpSize);
  if (per_lane <= 1) return f.template operator()<1>();
  if (per_lane <= 2) return f.template operator()<2>();
  if (per_lane <= 4) return f.template operator()<4>();
  if (per_lane <= 8) return f.template operator()<8>();
  if (per_lane <= 16) return f.template operator()<16>();
  if (per_lane <= 32) return f.template operator()<32>();
  return f.template operator()<64>();
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
    dispatch_per_lane(E, [&]<int kPerLane>() {
      route_kernel<scalar_t, kPerLane><<<grid, kWarpsPerBlock * kWarpSize, 0, stream>>>(
          static_cast<const scalar_t*>(logits.data_ptr()), bias.defined() ? bias.data_ptr<float>() : nullptr, T, E,
          k, fn, renorm, static_cast<float>(scale), weights.data_ptr<float>(), ids.data_ptr<int>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
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
  at::Tensor grad_logits = at::empty_like(logits);
  if (T == 0) return grad_logits;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(ceil_div(T, kWarpsPerBlock));
  const size_t smem = static_cast<size_t>(kWarpsPerBlock) * 2 * E * sizeof(float);
  KDA_DISPATCH_CUDA_FLOATING(logits.scalar_type(), "moe_route_bwd", [&] {
    dispatch_per_lane(E, [&]<int kPerLane>() {
      const auto kernel = route_bwd_kernel<scalar_t, kPerLane>;
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
      kernel<<<grid, kWarpsPerBlock * kWarpSize, smem, stream>>>(
          gw.data_ptr<float>(), static_cast<const scalar_t*>(logits.data_ptr()), ids.data_ptr<int>(), T, E, k, fn,
          renorm, static_cast<float>(scale), static_cast<scalar_t*>(grad_logits.data_ptr()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return grad_logits;
}

}  // namespace kda_dsa_ops::moe
