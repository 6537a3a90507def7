// Hyper-connections (mHC, GLM-5.3): hc_mix, the per-token mixing of residual streams,
//   y[t, i, :] = sum_j a[t, i, j] * x[t, j, :]  (+ b[t, i] * z[t, :]),
// which collapses the streams into a block's input (m = 1) and mixes the block's output back
// into them (m = n), and its gradient. Argument checks shared by both backends (hc.cpp), each
// backend's implementation (hc_cpu.cpp, hc_cuda.cu). Semantics: python/kda_dsa_ops/reference/hc.py.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace kda_dsa_ops::hc {

constexpr int64_t kMaxStreams = 8;  // n and m

// T tokens, n streams in, m out, D channels; with z and b (the added term) or without.
struct MixProblem {
  int64_t T, n, m, D;
  bool add;
};

MixProblem check_mix(const at::Tensor& x, const at::Tensor& a, const std::optional<at::Tensor>& z,
                     const std::optional<at::Tensor>& b, const char* op);
// The forward's checks, and grad_y [T, m, D] in x's dtype.
MixProblem check_mix_bwd(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& a,
                         const std::optional<at::Tensor>& z, const std::optional<at::Tensor>& b);

// The inputs as both backends' kernels read them: x and z contiguous, a and b contiguous in
// `weights` (the kernels' accumulation type); z and b undefined without the added term.
struct MixInputs {
  at::Tensor x, a, z, b;
};
MixInputs mix_inputs(const MixProblem& p, const at::Tensor& x, const at::Tensor& a, const std::optional<at::Tensor>& z,
                     const std::optional<at::Tensor>& b, at::ScalarType weights);

#define KDA_DSA_OPS_HC_ENTRIES(DEV)                                                                          \
  at::Tensor hc_mix_##DEV(const at::Tensor& x, const at::Tensor& a, const std::optional<at::Tensor>& z,      \
                          const std::optional<at::Tensor>& b);                                               \
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hc_mix_bwd_##DEV(                               \
      const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& a, const std::optional<at::Tensor>& z, \
      const std::optional<at::Tensor>& b);

KDA_DSA_OPS_HC_ENTRIES(cpu)
#ifdef KDA_DSA_OPS_WITH_CUDA
KDA_DSA_OPS_HC_ENTRIES(cuda)
#endif
#undef KDA_DSA_OPS_HC_ENTRIES

}  // namespace kda_dsa_ops::hc
