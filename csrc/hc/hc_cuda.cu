// hc_mix on the GPU. Both kernels are memory-bound: one block per token walks its D channels in
// steps of kCols per thread (16-byte loads where the rows allow), the token's mixing matrix and
// added weights in shared memory (fp32), every product and sum in fp32. The backward's da and db
// (dot products over D) are summed per thread, then over the block in a fixed order.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <type_traits>

#include "common/device.cuh"
#include "common/dispatch.h"
#include "hc/hc.h"

namespace kda_dsa_ops::hc {

namespace {

constexpr int kThreads = 128;

// kS: the register arrays' capacity in streams (4 or 8; n, m <= kS); kCols channels per thread
// and step, so that a step holds 32 values of one operand per thread.
template <int kS>
constexpr int kCols = 32 / kS;

struct MixArgs {
  const void* x;      // [T, n, D]
  const float* a;     // [T, m, n]
  const void* z;      // [T, D] or null
  const float* b;     // [T, m] or null
  const void* grad;   // [T, m, D] (backward)
  void* y;            // forward: [T, m, D]; backward: dx [T, n, D]
  void* dz;           // [T, D] (backward, with z)
  float* da;          // [T, m, n] (backward)
  float* db;          // [T, m] (backward, with z)
  int64_t D;
  int n, m;
  bool vec;
};

// The token's a (rows of kS) and b into shared memory.
template <int kS>
__device__ __forceinline__ void load_weights(const MixArgs& p, int64_t t, float* sa, float* sb) {
  for (int k = threadIdx.x; k < p.m * p.n; k += kThreads) sa[k / p.n * kS + k % p.n] = p.a[t * p.m * p.n + k];
  if (p.b != nullptr) {
    for (int k = threadIdx.x; k < p.m; k += kThreads) sb[k] = p.b[t * p.m + k];
  }
  __syncthreads();
}

template <typename T, int kS>
__global__ void __launch_bounds__(kThreads) hc_mix_kernel(const __grid_constant__ MixArgs p) {
  constexpr int C = kCols<kS>;
  __shared__ float sa[kS * kS], sb[kS];
  const int64_t t = blockIdx.x, D = p.D;
  load_weights<kS>(p, t, sa, sb);
  const T* x = static_cast<const T*>(p.x) + t * p.n * D;
  const T* z = p.z != nullptr ? static_cast<const T*>(p.z) + t * D : nullptr;
  T* y = static_cast<T*>(p.y) + t * p.m * D;
  for (int64_t d = int64_t{threadIdx.x} * C; d < D; d += kThreads * C) {
    float xs[kS][C], zs[C];
#pragma unroll
    for (int j = 0; j < kS; ++j) {
      if (j < p.n) load_cols<T, C>(x + j * D, d, D, p.vec, xs[j]);
    }
    if (z != nullptr) load_cols<T, C>(z, d, D, p.vec, zs);
#pragma unroll
    for (int i = 0; i < kS; ++i) {
      if (i >= p.m) break;
      float acc[C];
#pragma unroll
      for (int e = 0; e < C; ++e) acc[e] = z != nullptr ? sb[i] * zs[e] : 0.f;
#pragma unroll
      for (int j = 0; j < kS; ++j) {
        if (j < p.n) {
#pragma unroll
          for (int e = 0; e < C; ++e) acc[e] += sa[i * kS + j] * xs[j][e];
        }
      }
      store_cols<T, C>(y + i * D, d, D, p.vec, acc);
    }
  }
}

// One input row's part of the backward over channels d .. d + C: out = sum_i w[i * kStride] g[i]
// (dx[j] from a's column j, or dz from b) and sums[i * kStride] += <g[i], row> (da's column j, or
// db). Unrolled with constant offsets, sums stays in registers.
template <typename T, int kS, int kStride, int C>
__device__ __forceinline__ void row_grads(const T* row, T* out, int64_t d, int64_t D, const MixArgs& p,
                                          const float (&gs)[kS][C], const float* w, float* sums) {
  float xs[C], acc[C];
  load_cols<T, C>(row, d, D, p.vec, xs);
#pragma unroll
  for (int e = 0; e < C; ++e) acc[e] = 0.f;
#pragma unroll
  for (int i = 0; i < kS; ++i) {
    if (i < p.m) {
#pragma unroll
      for (int e = 0; e < C; ++e) {
        acc[e] += w[i * kStride] * gs[i][e];
        sums[i * kStride] += gs[i][e] * xs[e];
      }
    }
  }
  store_cols<T, C>(out, d, D, p.vec, acc);
}

// dx[j] = sum_i a[i, j] g[i], da[i, j] = <g[i], x[j]>; with z: dz = sum_i b[i] g[i], db[i] = <g[i], z>.
template <typename T, int kS>
__global__ void __launch_bounds__(kThreads) hc_mix_bwd_kernel(const __grid_constant__ MixArgs p) {
  constexpr int C = kCols<kS>, kSums = kS * kS + kS, kWarps = kThreads / kWarpSize;
  __shared__ float sa[kS * kS], sb[kS], partial[kWarps][kSums];
  const int64_t t = blockIdx.x, D = p.D;
  load_weights<kS>(p, t, sa, sb);
  const T* g = static_cast<const T*>(p.grad) + t * p.m * D;
  const T* x = static_cast<const T*>(p.x) + t * p.n * D;
  const T* z = p.z != nullptr ? static_cast<const T*>(p.z) + t * D : nullptr;
  T* dx = static_cast<T*>(p.y) + t * p.n * D;
  T* dz = p.z != nullptr ? static_cast<T*>(p.dz) + t * D : nullptr;
  float sums[kSums];  // da[i][j] at i * kS + j, db[i] at kS * kS + i
#pragma unroll
  for (int k = 0; k < kSums; ++k) sums[k] = 0.f;
  for (int64_t d = int64_t{threadIdx.x} * C; d < D; d += kThreads * C) {
    float gs[kS][C];
#pragma unroll
    for (int i = 0; i < kS; ++i) {
      if (i < p.m) load_cols<T, C>(g + i * D, d, D, p.vec, gs[i]);
    }
#pragma unroll
    for (int j = 0; j < kS; ++j) {
      if (j >= p.n) break;
      row_grads<T, kS, kS>(x + j * D, dx + j * D, d, D, p, gs, sa + j, sums + j);
    }
    if (z != nullptr) row_grads<T, kS, 1>(z, dz, d, D, p, gs, sb, sums + kS * kS);
  }
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
#pragma unroll
  for (int k = 0; k < kSums; ++k) {
    const float v = warp_reduce(sums[k], SumOp{});
    if (lane == 0) partial[warp][k] = v;
  }
  __syncthreads();
  for (int k = threadIdx.x; k < kSums; k += kThreads) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) v += partial[w][k];
    if (k < kS * kS) {
      const int i = k / kS, j = k % kS;
      if (i < p.m && j < p.n) p.da[(t * p.m + i) * p.n + j] = v;
    } else if (p.db != nullptr && k - kS * kS < p.m) {
      p.db[t * p.m + k - kS * kS] = v;
    }
  }
}

// Launches kernel<scalar_t, kS> with kS = 4 when n and m allow, else 8; p.vec set for the
// tensors' rows.
template <typename F>
void with_streams(const MixProblem& q, F&& f) {
  if (q.n <= 4 && q.m <= 4) {
    f(std::integral_constant<int, 4>{});
  } else {
    f(std::integral_constant<int, 8>{});
  }
}

}  // namespace

at::Tensor hc_mix_cuda(const at::Tensor& x_in, const at::Tensor& a_in, const std::optional<at::Tensor>& z_in,
                       const std::optional<at::Tensor>& b_in) {
  const MixProblem q = check_mix(x_in, a_in, z_in, b_in, "hc_mix");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto [x, a, z, b] = mix_inputs(q, x_in, a_in, z_in, b_in, at::kFloat);
  at::Tensor y = at::empty({q.T, q.m, q.D}, x.options());
  if (q.T == 0 || q.D == 0) return y;
  KDA_DISPATCH_CUDA_FLOATING(x.scalar_type(), "hc_mix", [&] {
    with_streams(q, [&](auto streams) {
      constexpr int kS = decltype(streams)::value;
      MixArgs p{x.data_ptr(), a.data_ptr<float>(), q.add ? z.data_ptr() : nullptr,
                q.add ? b.data_ptr<float>() : nullptr, nullptr, y.data_ptr(), nullptr, nullptr, nullptr,
                q.D, static_cast<int>(q.n), static_cast<int>(q.m), false};
      p.vec = rows_vectorised<kCols<kS>, scalar_t>(q.D, {p.x, p.z, p.y});
      hc_mix_kernel<scalar_t, kS><<<q.T, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hc_mix_bwd_cuda(const at::Tensor& grad_y_in,
                                                                           const at::Tensor& x_in,
                                                                           const at::Tensor& a_in,
                                                                           const std::optional<at::Tensor>& z_in,
                                                                           const std::optional<at::Tensor>& b_in) {
  const MixProblem q = check_mix_bwd(grad_y_in, x_in, a_in, z_in, b_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor gy = grad_y_in.contiguous();
  const auto [x, a, z, b] = mix_inputs(q, x_in, a_in, z_in, b_in, at::kFloat);
  at::Tensor dx = at::empty({q.T, q.n, q.D}, x.options());
  at::Tensor dz = q.add ? at::empty({q.T, q.D}, x.options()) : at::zeros({0}, x.options());
  // zeros: with D = 0 the dot products are empty sums
  at::Tensor da = at::zeros({q.T, q.m, q.n}, a.options());
  at::Tensor db = at::zeros({q.add ? q.T : 0, q.add ? q.m : 0}, a.options());
  if (q.T > 0) {
    KDA_DISPATCH_CUDA_FLOATING(x.scalar_type(), "hc_mix_bwd", [&] {
      with_streams(q, [&](auto streams) {
        constexpr int kS = decltype(streams)::value;
        MixArgs p{x.data_ptr(), a.data_ptr<float>(), q.add ? z.data_ptr() : nullptr,
                  q.add ? b.data_ptr<float>() : nullptr, gy.data_ptr(), dx.data_ptr(),
                  q.add ? dz.data_ptr() : nullptr, da.data_ptr<float>(), q.add ? db.data_ptr<float>() : nullptr,
                  q.D, static_cast<int>(q.n), static_cast<int>(q.m), false};
        p.vec = rows_vectorised<kCols<kS>, scalar_t>(q.D, {p.x, p.z, p.grad, p.y, p.dz});
        hc_mix_bwd_kernel<scalar_t, kS><<<q.T, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(p);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  }
  return {dx, da.to(a_in.scalar_type()), dz,
          q.add ? db.to(b_in->scalar_type()) : at::zeros({0}, a_in.options())};
}

}  // namespace kda_dsa_ops::hc
