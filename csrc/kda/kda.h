// KDA (Kimi Delta Attention): the chunked forward and backward. Each backend's op entry points
// (kda_cpu.cpp, kda_cuda.cu) check the arguments (kda.cpp), bring the inputs to what its kernels
// take (the accumulation type: fp32, fp64 for fp64 inputs, q and k L2-normalised when asked; the
// bf16 kernels: the raw inputs), run the chunked algorithm of kda_chunk.h and cast the results
// back. Semantics: reference/kda.py.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <utility>

namespace kda_dsa_ops::kda {

// Widest key / value head the kernels take.
constexpr int64_t kMaxHeadDim = 128;

// flash-linear-attention 0.6's in-kernel gate and beta (chunk_kda's use_gate_in_kernel,
// use_beta_sigmoid_in_kernel): with x = g + dt_bias and a = exp(A_log), the log-decay is
// -a softplus(x) (lower_bound 0) or lower_bound sigmoid(a x) (lower_bound < 0); beta is
// beta_scale sigmoid(beta) where beta_scale is 1 or 2 (0: beta as given). The bf16 CUDA kernels
// compute them where they load g and beta; the CPU kernel and the generic CUDA family take the
// transformed inputs (gated_inputs) and the chain rule after (gate_grads).
struct Gate {
  at::Tensor A_log, dt_bias;  // [HV], [HV * K] in the accumulation type, contiguous; undefined: g is the log-decay
  double lower_bound = 0, beta_scale = 0;
  bool on() const { return A_log.defined(); }
};

// Sizes of a call. Sequence n covers the flattened tokens [bos(n), bos(n) + len(n)) of [B*T]:
// the rows of the batch, or the segments of cu_seqlens (B == 1).
struct Problem {
  int64_t B, T, H, HV, K, V, N;
  double scale;
  at::Tensor cu_seqlens;  // int32 [N+1] on the inputs' device, or undefined
  bool bf16_products;     // CUDA: products on bf16 operands (matmul precision "medium"), else 3xTF32
  Gate gate;
};

// Inputs of the backends: accumulation-type, contiguous; q, k already normalised.
struct Inputs {
  at::Tensor q, k, v, g, beta, initial_state;  // initial_state undefined when absent
};

// Gradients w.r.t. the normalised q, k per value head ([B,T,HV,K]), v, g, beta, initial state
// (the CPU kernel's); the CUDA kernels write the op's gradients directly (kda_cuda.cu).
struct Grads {
  at::Tensor dq, dk, dv, dg, dbeta, dinitial_state;
  at::Tensor dA_log, ddt_bias;  // with the in-kernel gate: [HV], [HV * K] in the accumulation type
};

// The gate's arguments of both ops' schemas.
struct GateArgs {
  const std::optional<at::Tensor>& A_log;
  const std::optional<at::Tensor>& dt_bias;
  double lower_bound, beta_scale;
};

// The backward's results: (dq, dk, dv, dg, dbeta, dinitial_state, dA_log, ddt_bias); the last
// three are [0] where there is no initial state or in-kernel gate.
using BwdResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                             at::Tensor>;

// The op entry points, one per dispatch key (kda_cpu.cpp, kda_cuda.cu), with the schema's
// arguments; torch_bindings.cpp registers them.
#define KDA_DSA_OPS_KDA_ENTRIES(DEV)                                                                                   \
  std::tuple<at::Tensor, at::Tensor> kda_fwd_##DEV(                                                                    \
      const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,      \
      double scale, const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu_seqlens,       \
      bool output_final_state, bool use_qk_l2norm, bool bf16_products, const std::optional<at::Tensor>& A_log,         \
      const std::optional<at::Tensor>& dt_bias, double lower_bound, double beta_scale);                                \
  BwdResult kda_bwd_##DEV(const at::Tensor& grad_o, const std::optional<at::Tensor>& grad_final_state,                 \
                          const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,          \
                          const at::Tensor& beta, double scale, const std::optional<at::Tensor>& initial_state,        \
                          const std::optional<at::Tensor>& cu_seqlens, bool use_qk_l2norm, bool bf16_products,         \
                          const std::optional<at::Tensor>& A_log, const std::optional<at::Tensor>& dt_bias,            \
                          double lower_bound, double beta_scale);

KDA_DSA_OPS_KDA_ENTRIES(cpu)
#ifdef KDA_DSA_OPS_WITH_CUDA
KDA_DSA_OPS_KDA_ENTRIES(cuda)
#endif
#undef KDA_DSA_OPS_KDA_ENTRIES

// The checks both entry points make (kda.cpp). check_fwd: shapes, dtypes, devices, cu_seqlens, the
// gate's arguments and the contract's values (g <= 0, beta in [0, 2] where they are given as such:
// value checks). check_bwd: the forward's shape checks and grad_o's, grad_final_state's; dht
// receives it in the accumulation type (undefined when absent or empty).
Problem check_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                  const at::Tensor& beta, double scale, const std::optional<at::Tensor>& initial_state,
                  const std::optional<at::Tensor>& cu_seqlens, bool bf16_products, const GateArgs& gate);
Problem check_bwd(const at::Tensor& grad_o, const std::optional<at::Tensor>& grad_final_state, const at::Tensor& q,
                  const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, double scale,
                  const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu_seqlens,
                  bool bf16_products, const GateArgs& gate, at::Tensor& dht);
// The log-decay and beta the recurrence takes, from the op's g and beta (the accumulation type;
// as given without the in-kernel options).
std::pair<at::Tensor, at::Tensor> gated_inputs(const Problem& p, const at::Tensor& g, const at::Tensor& beta,
                                               at::ScalarType acc);
// The chain rule from the gradients w.r.t. the log-decay and beta (gr.dg, gr.dbeta, [B,T,HV,K],
// [B,T,HV]) to those w.r.t. the op's g, beta, A_log and dt_bias (into gr).
void gate_grads(const Problem& p, const at::Tensor& g, const at::Tensor& beta, Grads& gr);
// The results of kda_bwd from gr (dq .. dbeta in their output types already).
BwdResult bwd_result(const Problem& p, const Grads& gr, bool has_initial_state, const at::TensorOptions& acc);
// The forward's final_state output: [N,HV,K,V] in the accumulation type, [0] when not asked for.
at::Tensor final_state_for(const Problem& p, const at::Tensor& q, bool output_final_state);
// The backends' Inputs from the normalised qn, kn (accumulation type, contiguous).
Inputs accumulation_inputs(const at::Tensor& qn, const at::Tensor& kn, const at::Tensor& v, const at::Tensor& g,
                           const at::Tensor& beta, const std::optional<at::Tensor>& initial_state);

}  // namespace kda_dsa_ops::kda
