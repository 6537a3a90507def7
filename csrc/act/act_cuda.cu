// The fused activations on the GPU, memory-bound kernels with every product and sum in fp32.
//   short_conv: each thread owns kCols channels (one 16-byte load per row where the rows allow)
//   and walks kRows tokens, the last W rows of x in registers, so x is read once (plus W - 1 rows
//   per kRows) and y written once. The backward walks its rows again with dz = grad_y silu'(z)
//   recomputed from that window, emits each dx row once the W dz rows it needs are in registers
//   (a delay of kW - 1 rows), and sums the weight gradient per thread and then per row slot
//   (partials [slots, W, C], reduced in a fixed order: deterministic, no atomics).
//   swiglu: one pass over gate_up, kCols values of gate and of up per thread.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "act/act.h"
#include "common/device.cuh"
#include "common/dispatch.h"

namespace kda_dsa_ops::act {

namespace {

constexpr int kThreads = 128;
constexpr int kRows = 64;             // tokens per thread in short_conv
constexpr int64_t kMaxGridY = 65535;  // row chunks beyond it: grid-stride
constexpr int kWeightSlots = 256;     // the backward's row slots (weight-gradient partials)

// kW: the register windows' capacity in taps (4 or 8; W <= kW); kCols channels per thread so
// that a window holds 32 values.
template <int kW>
constexpr int kCols = 32 / kW;

// accurate expf: the kernels are memory-bound, and fp32 outputs are held to fp32 rounding
__device__ __forceinline__ float sigmoid_f(float z) { return 1.f / (1.f + expf(-z)); }

__device__ __forceinline__ float silu_grad_f(float z) {
  const float s = sigmoid_f(z);
  return s * (1.f + z * (1.f - s));
}

struct ConvArgs {
  const void* x;      // [T, C]
  const void* halo;   // [W - 1, C] or null
  const float* w;     // [C, W]
  const int64_t* pos; // [T]
  const void* grad;   // [T, C] (backward)
  void* y;            // forward: y [T, C]; backward: dx [T, C]
  void* dhalo;        // [W - 1, C] (backward, with a halo)
  float* dw;          // [slots, W, C] (backward, with the weight gradient)
  int64_t T, C;
  int W;
  bool vec;
};

// Row s of the batch at channels c .. c + C (s < 0: the halo's row s + W - 1, or zeros).
template <typename T, int C>
__device__ __forceinline__ void load_row(const ConvArgs& p, int64_t s, int64_t c, float (&out)[C]) {
  if (s >= 0) {
    load_cols<T, C>(static_cast<const T*>(p.x) + s * p.C, c, p.C, p.vec, out);
  } else if (p.halo != nullptr) {
    load_cols<T, C>(static_cast<const T*>(p.halo) + (s + p.W - 1) * p.C, c, p.C, p.vec, out);
  } else {
#pragma unroll
    for (int e = 0; e < C; ++e) out[e] = 0.f;
  }
}

template <int kW, int C>
__device__ __forceinline__ void load_weights(const ConvArgs& p, int64_t c, float (&w)[kW][C]) {
#pragma unroll
  for (int j = 0; j < kW; ++j) {
#pragma unroll
    for (int e = 0; e < C; ++e) w[j][e] = j < p.W && c + e < p.C ? p.w[(c + e) * p.W + j] : 0.f;
  }
}

// The window before token t0: win[j - 1] = x[t0 - j] for 1 <= j < W (zeros elsewhere), so that
// the walk's first shift puts x[t0 - j] at win[j] before x[t0] is loaded into win[0].
template <typename T, int kW, int C>
__device__ __forceinline__ void prime_window(const ConvArgs& p, int64_t t0, int64_t c, float (&win)[kW][C]) {
#pragma unroll
  for (int j = 1; j <= kW; ++j) {
    if (j < p.W) {
      load_row<T, C>(p, t0 - j, c, win[j - 1]);
    } else {
#pragma unroll
      for (int e = 0; e < C; ++e) win[j - 1][e] = 0.f;
    }
  }
}

template <int kW, typename V>
__device__ __forceinline__ void shift(V (&win)[kW]) {
#pragma unroll
  for (int j = kW - 1; j > 0; --j) {
    if constexpr (std::is_array_v<V>) {
#pragma unroll
      for (int e = 0; e < static_cast<int>(std::extent_v<V>); ++e) win[j][e] = win[j - 1][e];
    } else {
      win[j] = win[j - 1];
    }
  }
}

// z = sum_j w[j] win[j] over the taps token t (position pos) takes.
template <int kW, int C>
__device__ __forceinline__ void conv_at(const ConvArgs& p, int64_t pos, const float (&w)[kW][C],
                                        const float (&win)[kW][C], float (&z)[C]) {
#pragma unroll
  for (int e = 0; e < C; ++e) z[e] = 0.f;
#pragma unroll
  for (int j = 0; j < kW; ++j) {
    if (j < p.W && (j == 0 || pos >= j)) {
#pragma unroll
      for (int e = 0; e < C; ++e) z[e] += w[j][e] * win[j][e];
    }
  }
}

template <typename T, int kW>
__global__ void __launch_bounds__(kThreads) short_conv_kernel(const __grid_constant__ ConvArgs p) {
  constexpr int C = kCols<kW>;
  const int64_t c = (int64_t{blockIdx.x} * kThreads + threadIdx.x) * C;
  if (c >= p.C) return;
  float w[kW][C];
  load_weights<kW>(p, c, w);
  for (int64_t t0 = int64_t{blockIdx.y} * kRows; t0 < p.T; t0 += int64_t{gridDim.y} * kRows) {
    float win[kW][C];
    prime_window<T, kW>(p, t0, c, win);
    const int64_t t1 = std::min<int64_t>(t0 + kRows, p.T);
    for (int64_t t = t0; t < t1; ++t) {
      shift<kW>(win);
      load_row<T, C>(p, t, c, win[0]);
      float z[C];
      conv_at<kW>(p, p.pos[t], w, win, z);
#pragma unroll
      for (int e = 0; e < C; ++e) z[e] *= sigmoid_f(z[e]);
      store_cols<T, C>(static_cast<T*>(p.y) + t * p.C, c, p.C, p.vec, z);
    }
  }
}

// dx[s] = sum_j w[j] dz[s + j] over the taps token s + j takes; rows s < 0 go to the halo's
// gradient. Row slot blockIdx.y walks chunks blockIdx.y, + gridDim.y, ...
template <typename T, int kW>
__global__ void __launch_bounds__(kThreads) short_conv_bwd_kernel(const __grid_constant__ ConvArgs p) {
  constexpr int C = kCols<kW>;
  const int64_t c = (int64_t{blockIdx.x} * kThreads + threadIdx.x) * C;
  if (c >= p.C) return;
  float w[kW][C], dw[kW][C];
  load_weights<kW>(p, c, w);
#pragma unroll
  for (int j = 0; j < kW; ++j) {
#pragma unroll
    for (int e = 0; e < C; ++e) dw[j][e] = 0.f;
  }
  for (int64_t t0 = int64_t{blockIdx.y} * kRows; t0 < p.T; t0 += int64_t{gridDim.y} * kRows) {
    const int64_t t1 = std::min<int64_t>(t0 + kRows, p.T);
    // the first row whose gradient this chunk writes: the halo's first for the batch's first chunk
    const int64_t first = t0 == 0 && p.dhalo != nullptr ? -(p.W - 1) : t0;
    float win[kW][C], dzw[kW][C];  // win[j] = x[t - j], dzw[k] = dz[t - k]
    int64_t posw[kW];              // posw[k] = pos[t - k]
    prime_window<T, kW>(p, t0, c, win);
#pragma unroll
    for (int k = 0; k < kW; ++k) {
      posw[k] = 0;
#pragma unroll
      for (int e = 0; e < C; ++e) dzw[k][e] = 0.f;
    }
    for (int64_t t = t0; t < t1 + kW - 1; ++t) {
      shift<kW>(win);
      shift<kW>(dzw);
      shift<kW>(posw);
      if (t < p.T) {
        load_row<T, C>(p, t, c, win[0]);
        posw[0] = p.pos[t];
        float z[C], g[C];
        conv_at<kW>(p, posw[0], w, win, z);
        load_cols<T, C>(static_cast<const T*>(p.grad) + t * p.C, c, p.C, p.vec, g);
#pragma unroll
        for (int e = 0; e < C; ++e) dzw[0][e] = g[e] * silu_grad_f(z[e]);
        if (t < t1 && p.dw != nullptr) {
#pragma unroll
          for (int j = 0; j < kW; ++j) {
            if (j < p.W && (j == 0 || posw[0] >= j)) {
#pragma unroll
              for (int e = 0; e < C; ++e) dw[j][e] += dzw[0][e] * win[j][e];
            }
          }
        }
      } else {
        posw[0] = 0;
#pragma unroll
        for (int e = 0; e < C; ++e) dzw[0][e] = 0.f;
      }
      const int64_t s = t - (kW - 1);  // its dz rows s .. s + W - 1 are in dzw[kW - 1 - j]
      if (s < first || s >= t1) continue;
      float dx[C];
#pragma unroll
      for (int e = 0; e < C; ++e) dx[e] = 0.f;
#pragma unroll
      for (int j = 0; j < kW; ++j) {
        if (j < p.W && (j == 0 || posw[kW - 1 - j] >= j)) {
#pragma unroll
          for (int e = 0; e < C; ++e) dx[e] += w[j][e] * dzw[kW - 1 - j][e];
        }
      }
      T* out = s >= 0 ? static_cast<T*>(p.y) + s * p.C : static_cast<T*>(p.dhalo) + (s + p.W - 1) * p.C;
      store_cols<T, C>(out, c, p.C, p.vec, dx);
    }
  }
  if (p.dw == nullptr) return;
#pragma unroll
  for (int j = 0; j < kW; ++j) {
    if (j >= p.W) break;
#pragma unroll
    for (int e = 0; e < C; ++e) {
      if (c + e < p.C) p.dw[(int64_t{blockIdx.y} * p.W + j) * p.C + c + e] = dw[j][e];
    }
  }
}

template <typename F>
void with_width(int64_t W, F&& f) {
  if (W <= 4) {
    f(std::integral_constant<int, 4>{});
  } else {
    f(std::integral_constant<int, 8>{});
  }
}

template <int kW>
dim3 conv_grid(const ConvProblem& q, int64_t max_y) {
  return dim3(static_cast<unsigned>(ceil_div(q.C, int64_t{kThreads} * kCols<kW>)),
              static_cast<unsigned>(std::min(ceil_div(q.T, kRows), max_y)));
}

struct GluArgs {
  const void* gate_up;  // [N, 2F]
  const void* grad;     // [N, F] (backward)
  void* out;            // forward: h [N, F]; backward: d gate_up [N, 2F]
  int64_t N, F;
  float limit;          // 0: no clamps
};

// The clamps (comparisons that keep NaN, as torch.clamp does).
__device__ __forceinline__ float clamp_gate(float g, float limit) { return limit > 0 && g > limit ? limit : g; }
__device__ __forceinline__ float clamp_up(float u, float limit) {
  return limit > 0 ? (u > limit ? limit : (u < -limit ? -limit : u)) : u;
}

// Each thread: C consecutive values of one row's gate and up (C = 8 where F and the rows allow,
// else 1), grid-stride.
template <typename T, int C, bool kBackward>
__global__ void __launch_bounds__(kThreads) swiglu_kernel(const __grid_constant__ GluArgs p) {
  const int64_t per_row = p.F / C, total = p.N * per_row;
  for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < total; i += int64_t{gridDim.x} * kThreads) {
    const int64_t n = i / per_row, f = (i % per_row) * C;
    const T* row = static_cast<const T*>(p.gate_up) + n * 2 * p.F;
    float g[C], u[C];
    load_cols<T, C>(row, f, p.F, true, g);
    load_cols<T, C>(row + p.F, f, p.F, true, u);
    if constexpr (!kBackward) {
      float h[C];
#pragma unroll
      for (int e = 0; e < C; ++e) {
        const float gc = clamp_gate(g[e], p.limit);
        h[e] = gc * sigmoid_f(gc) * clamp_up(u[e], p.limit);
      }
      store_cols<T, C>(static_cast<T*>(p.out) + n * p.F, f, p.F, true, h);
    } else {
      float dh[C], dg[C], du[C];
      load_cols<T, C>(static_cast<const T*>(p.grad) + n * p.F, f, p.F, true, dh);
#pragma unroll
      for (int e = 0; e < C; ++e) {
        // the clamps' gradient passes strictly inside their bounds (zero on them, as torch.clamp's)
        const bool g_in = p.limit == 0 || g[e] < p.limit, u_in = p.limit == 0 || (u[e] > -p.limit && u[e] < p.limit);
        const float gc = clamp_gate(g[e], p.limit), uc = clamp_up(u[e], p.limit);
        dg[e] = g_in ? dh[e] * uc * silu_grad_f(gc) : 0.f;
        du[e] = u_in ? dh[e] * gc * sigmoid_f(gc) : 0.f;
      }
      T* out = static_cast<T*>(p.out) + n * 2 * p.F;
      store_cols<T, C>(out, f, p.F, true, dg);
      store_cols<T, C>(out + p.F, f, p.F, true, du);
    }
  }
}

template <bool kBackward>
void launch_swiglu(const GluProblem& q, const at::Tensor& gu, const void* grad, void* out, double limit) {
  if (q.N == 0 || q.F == 0) return;
  const int sms = num_sms(gu.get_device());
  KDA_DISPATCH_CUDA_FLOATING(gu.scalar_type(), "swiglu", [&] {
    const GluArgs p{gu.data_ptr(), grad, out, q.N, q.F, static_cast<float>(limit)};
    auto launch = [&](auto kernel, int64_t per_thread) {
      const int64_t blocks = std::min<int64_t>(ceil_div(q.N * q.F / per_thread, kThreads), int64_t{sms} * 16);
      kernel<<<static_cast<unsigned>(blocks), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (rows_vectorised<8, scalar_t>(q.F, {p.gate_up, p.grad, p.out})) {
      launch(swiglu_kernel<scalar_t, 8, kBackward>, 8);
    } else {
      launch(swiglu_kernel<scalar_t, 1, kBackward>, 1);
    }
  });
}

}  // namespace

at::Tensor short_conv_cuda(const at::Tensor& x_in, const at::Tensor& weight_in, const at::Tensor& pos_in,
                           const std::optional<at::Tensor>& halo_in) {
  const ConvProblem q = check_conv(x_in, weight_in, pos_in, halo_in, "short_conv");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto [x, w, pos, halo] = conv_inputs(x_in, weight_in, pos_in, halo_in, at::kFloat);
  at::Tensor y = at::empty({q.T, q.C}, x.options());
  if (q.T == 0 || q.C == 0) return y;
  KDA_DISPATCH_CUDA_FLOATING(x.scalar_type(), "short_conv", [&] {
    with_width(q.W, [&](auto width) {
      constexpr int kW = decltype(width)::value;
      ConvArgs p{x.data_ptr(), q.halo ? halo.data_ptr() : nullptr, w.data_ptr<float>(), pos.data_ptr<int64_t>(),
                 nullptr, y.data_ptr(), nullptr, nullptr, q.T, q.C, static_cast<int>(q.W), false};
      p.vec = rows_vectorised<kCols<kW>, scalar_t>(q.C, {p.x, p.halo, p.y});
      short_conv_kernel<scalar_t, kW><<<conv_grid<kW>(q, kMaxGridY), kThreads, 0,
                                        c10::cuda::getCurrentCUDAStream()>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> short_conv_bwd_cuda(const at::Tensor& grad_y_in,
                                                                   const at::Tensor& x_in,
                                                                   const at::Tensor& weight_in,
                                                                   const at::Tensor& pos_in,
                                                                   const std::optional<at::Tensor>& halo_in,
                                                                   bool weight_grad) {
  const ConvProblem q = check_conv_bwd(grad_y_in, x_in, weight_in, pos_in, halo_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor gy = grad_y_in.contiguous();
  const auto [x, w, pos, halo] = conv_inputs(x_in, weight_in, pos_in, halo_in, at::kFloat);
  at::Tensor dx = at::empty({q.T, q.C}, x.options());
  // zeros: the halo's rows no token reaches (W - 1 > T) get no store
  at::Tensor dhalo = q.halo ? at::zeros({q.W - 1, q.C}, x.options()) : at::zeros({0}, x.options());
  const int64_t slots = std::min<int64_t>(ceil_div(q.T, kRows), kWeightSlots);
  at::Tensor dw_part = at::zeros({weight_grad ? std::max<int64_t>(slots, 1) : 0, q.W, q.C}, w.options());
  if (q.T > 0 && q.C > 0) {
    KDA_DISPATCH_CUDA_FLOATING(x.scalar_type(), "short_conv_bwd", [&] {
      with_width(q.W, [&](auto width) {
        constexpr int kW = decltype(width)::value;
        ConvArgs p{x.data_ptr(), q.halo ? halo.data_ptr() : nullptr, w.data_ptr<float>(), pos.data_ptr<int64_t>(),
                   gy.data_ptr(), dx.data_ptr(), q.halo ? dhalo.data_ptr() : nullptr,
                   weight_grad ? dw_part.data_ptr<float>() : nullptr, q.T, q.C, static_cast<int>(q.W), false};
        p.vec = rows_vectorised<kCols<kW>, scalar_t>(q.C, {p.x, p.halo, p.grad, p.y, p.dhalo});
        short_conv_bwd_kernel<scalar_t, kW><<<conv_grid<kW>(q, slots), kThreads, 0,
                                              c10::cuda::getCurrentCUDAStream()>>>(p);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  }
  at::Tensor dw = weight_grad ? dw_part.sum(0).t().to(weight_in.scalar_type()).contiguous()
                              : at::zeros({0}, weight_in.options());
  return {dx, dw, dhalo};
}

at::Tensor swiglu_cuda(const at::Tensor& gate_up_in, double limit) {
  const GluProblem q = check_swiglu(gate_up_in, limit, "swiglu");
  const c10::cuda::CUDAGuard guard(gate_up_in.device());
  const at::Tensor gu = gate_up_in.contiguous();
  at::Tensor h = at::empty(glu_out_shape(gu), gu.options());
  launch_swiglu<false>(q, gu, nullptr, h.data_ptr(), limit);
  return h;
}

at::Tensor swiglu_bwd_cuda(const at::Tensor& grad_h_in, const at::Tensor& gate_up_in, double limit) {
  const GluProblem q = check_swiglu_bwd(grad_h_in, gate_up_in, limit);
  const c10::cuda::CUDAGuard guard(gate_up_in.device());
  const at::Tensor gu = gate_up_in.contiguous(), gh = grad_h_in.contiguous();
  at::Tensor d = at::empty(gu.sizes(), gu.options());
  launch_swiglu<true>(q, gu, gh.data_ptr(), d.data_ptr(), limit);
  return d;
}

}  // namespace kda_dsa_ops::act
