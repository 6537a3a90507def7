// KDA (Kimi Delta Attention): the chunked forward and backward. The op entry points (kda.cpp)
// check the arguments and bring the inputs to the accumulation type (fp32, fp64 for fp64
// inputs), L2-normalising q and k when asked; each backend runs the chunked algorithm of
// kda_chunk.h on those; the entry points cast the results back. Semantics: reference/kda.py.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace kda_dsa_ops::kda {

// Widest key / value head the kernels take.
constexpr int64_t kMaxHeadDim = 128;

// Sizes of a call. Sequence n covers the flattened tokens [bos(n), bos(n) + len(n)) of [B*T]:
// the rows of the batch, or the segments of cu_seqlens (B == 1).
struct Problem {
  int64_t B, T, H, HV, K, V, N;
  double scale;
  at::Tensor cu_seqlens;  // int32 [N+1] on the inputs' device, or undefined
  bool bf16_products;     // CUDA: products on bf16 operands (matmul precision "medium"), else 3xTF32
};

// Inputs of the backends: accumulation-type, contiguous; q, k already normalised.
struct Inputs {
  at::Tensor q, k, v, g, beta, initial_state;  // initial_state undefined when absent
};

// o [B,T,HV,V] and final_state [N,HV,K,V] (undefined when not asked for), accumulation type.
void fwd_cpu(const Problem& p, const Inputs& in, at::Tensor& o, at::Tensor& final_state);
// Gradients w.r.t. the normalised q, k per value head ([B,T,HV,K]), v, g, beta, initial state.
struct Grads {
  at::Tensor dq, dk, dv, dg, dbeta, dinitial_state;
};
void bwd_cpu(const Problem& p, const Inputs& in, const at::Tensor& grad_o, const at::Tensor& grad_final_state,
             Grads& grads);
#ifdef KDA_DSA_OPS_WITH_CUDA
void fwd_cuda(const Problem& p, const Inputs& in, at::Tensor& o, at::Tensor& final_state);
// The bf16 forward: bf16-product mode on CUDA with bf16 / fp16 q, k, v and K, V in {64, 128}. It
// takes the op's inputs as given (contiguous, 16-byte aligned, not normalised; g and beta float32
// or q's dtype) and writes o [B,T,HV,V] in q's dtype.
bool bf16_fwd_supported(const Problem& p, const at::Tensor& q);
void fwd_cuda_bf16(const Problem& p, const Inputs& raw, bool l2norm, at::Tensor& o, at::Tensor& final_state);
// The CUDA backward writes the op's gradients directly: grads.dq, dk [B,T,H,K] in q's dtype
// (w.r.t. the raw q, k: through the normalisation when l2norm), dg, dbeta in the dtypes of g,
// beta, and dinitial_state in fp32. bwd_cuda: on the prepared inputs (q, k: the raw ones,
// contiguous), grad_o and dv in fp32. bwd_cuda_bf16 (where bf16_fwd_supported): on the raw inputs
// as for fwd_cuda_bf16, with dOs = scale grad_o in bf16; dv in v's dtype.
void bwd_cuda(const Problem& p, const Inputs& in, const at::Tensor& q, const at::Tensor& k, bool l2norm,
              const at::Tensor& grad_o, const at::Tensor& grad_final_state, Grads& grads);
void bwd_cuda_bf16(const Problem& p, const Inputs& raw, bool l2norm, const at::Tensor& dOs,
                   const at::Tensor& grad_final_state, Grads& grads);
// x [..., K] (K <= 128) to fp32, divided by sqrt(|x|^2 + 1e-6) per row when l2norm.
at::Tensor l2norm_rows_cuda(const at::Tensor& x, bool l2norm);
#endif

std::tuple<at::Tensor, at::Tensor> kda_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& g, const at::Tensor& beta, double scale,
                                           const std::optional<at::Tensor>& initial_state,
                                           const std::optional<at::Tensor>& cu_seqlens, bool output_final_state,
                                           bool use_qk_l2norm, bool bf16_products);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> kda_bwd(
    const at::Tensor& grad_o, const std::optional<at::Tensor>& grad_final_state, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, double scale,
    const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu_seqlens, bool use_qk_l2norm,
    bool bf16_products);

}  // namespace kda_dsa_ops::kda
