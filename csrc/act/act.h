// Activations fused with what surrounds them, the memory-bound glue of the training step:
//   short_conv: KDA's short causal depthwise convolution over packed sequences, then SiLU,
//     y[t, c] = silu(sum_{j < W} w[c, j] x[t - j, c] [j = 0 or pos[t] >= j]),
//     rows before the batch taken from halo (context parallelism's previous share; zeros without);
//   swiglu: h = silu(gate) * up of gate_up = [gate, up], GLM-5.3's clamps with limit > 0
//     (gate from above, up to [-limit, limit]);
// and their gradients. Argument checks shared by both backends (act.cpp), each backend's
// implementation (act_cpu.cpp, act_cuda.cu). Semantics: python/kda_dsa_ops/reference/act.py.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>
#include <tuple>

namespace kda_dsa_ops::act {

constexpr int64_t kMaxConvWidth = 8;  // W

// T tokens, C channels, W taps; with or without a halo.
struct ConvProblem {
  int64_t T, C, W;
  bool halo;
};

ConvProblem check_conv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& pos,
                       const std::optional<at::Tensor>& halo, const char* op);
// The forward's checks, and grad_y [T, C] in x's dtype.
ConvProblem check_conv_bwd(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                           const at::Tensor& pos, const std::optional<at::Tensor>& halo);

// The inputs as both backends' kernels read them: x (and halo) contiguous, the weight [C, W]
// contiguous in `weights` (the accumulation type), pos contiguous int64; halo undefined without one.
struct ConvInputs {
  at::Tensor x, w, pos, halo;
};
ConvInputs conv_inputs(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& pos,
                       const std::optional<at::Tensor>& halo, at::ScalarType weights);

// gate_up [..., 2F] with a contiguous last dim: N rows of F.
struct GluProblem {
  int64_t N, F;
};
GluProblem check_swiglu(const at::Tensor& gate_up, double limit, const char* op);
// The forward's checks, and grad_h [..., F] in gate_up's dtype.
GluProblem check_swiglu_bwd(const at::Tensor& grad_h, const at::Tensor& gate_up, double limit);
// gate_up's shape with the last dim halved.
std::vector<int64_t> glu_out_shape(const at::Tensor& gate_up);

#define KDA_DSA_OPS_ACT_ENTRIES(DEV)                                                                        \
  at::Tensor short_conv_##DEV(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& pos,         \
                              const std::optional<at::Tensor>& halo);                                       \
  std::tuple<at::Tensor, at::Tensor, at::Tensor> short_conv_bwd_##DEV(                                      \
      const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& pos,       \
      const std::optional<at::Tensor>& halo, bool weight_grad);                                             \
  at::Tensor swiglu_##DEV(const at::Tensor& gate_up, double limit);                                         \
  at::Tensor swiglu_bwd_##DEV(const at::Tensor& grad_h, const at::Tensor& gate_up, double limit);

KDA_DSA_OPS_ACT_ENTRIES(cpu)
#ifdef KDA_DSA_OPS_WITH_CUDA
KDA_DSA_OPS_ACT_ENTRIES(cuda)
#endif
#undef KDA_DSA_OPS_ACT_ENTRIES

}  // namespace kda_dsa_ops::act
