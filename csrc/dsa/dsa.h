// DSA ops: the lightning indexer (LI: fused scoring + top-k), sparse attention over the selected
// keys with an output gate (SFA) and its gradient (SFAG). The entry points (dsa.cpp) check the
// arguments and bring the inputs to the accumulation type (fp32, fp64 for fp64 inputs); each
// backend computes on those; the entry points cast the results back. Semantics:
// python/kda_dsa_ops/reference/dsa.py.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace kda_dsa_ops::dsa {

constexpr int64_t kMaxTopk = 2048;

// Lightning indexer. Inputs in the accumulation type; seq_of_query[t] / seq bounds on the host
// (CPU backend). indices [T, topk] int32 and scores [T, topk] are written.
struct IndexerProblem {
  int64_t T, Tk, Hi, Di, N, topk;
  at::Tensor cu_q, cu_k;  // int32 [N + 1], on the inputs' device
};
void indexer_fwd_cpu(const IndexerProblem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& w,
                     at::Tensor& indices, at::Tensor& scores);
void indexer_bwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w, const at::Tensor& indices,
                     const at::Tensor& grad_scores, at::Tensor& dq, at::Tensor& dk, at::Tensor& dw);

// Sparse attention: T queries of H heads, Tk rows of Hkv kv heads, topk indices per (query, kv head).
struct AttnProblem {
  int64_t T, H, Hkv, Tk, Dqk, dv, topk;
  double scale;
};
void attn_fwd_cpu(const AttnProblem& p, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& indices,
                  const at::Tensor& gate, at::Tensor& o, at::Tensor& lse, at::Tensor& probs);
void attn_bwd_cpu(const AttnProblem& p, const at::Tensor& grad_o, const at::Tensor& q, const at::Tensor& kv,
                  const at::Tensor& indices, const at::Tensor& o, const at::Tensor& lse, const at::Tensor& gate,
                  at::Tensor& dq, at::Tensor& dkv, at::Tensor& dgate);

#ifdef KDA_DSA_OPS_WITH_CUDA
// CUDA: q, k, kv, gate, grad_o, o in bf16 or fp16 (contiguous), w, grad_scores and lse fp32;
// dk and dkv are fp32 accumulation buffers (dkv with one spare row past Tk * Hkv), the other
// outputs take q's dtype (indexer dw: fp32).
void indexer_fwd_cuda(const IndexerProblem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& w,
                      at::Tensor& indices, at::Tensor& scores);
void indexer_bwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w, const at::Tensor& indices,
                      const at::Tensor& grad_scores, at::Tensor& dq, at::Tensor& dk, at::Tensor& dw);
void attn_fwd_cuda(const AttnProblem& p, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& indices,
                   const at::Tensor& gate, at::Tensor& o, at::Tensor& lse, at::Tensor& probs);
void attn_bwd_cuda(const AttnProblem& p, const at::Tensor& grad_o, const at::Tensor& q, const at::Tensor& kv,
                   const at::Tensor& indices, const at::Tensor& o, const at::Tensor& lse, const at::Tensor& gate,
                   bool deterministic, at::Tensor& dq, at::Tensor& dkv, at::Tensor& dgate);
#endif

std::tuple<at::Tensor, at::Tensor> lightning_indexer_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w,
                                                         const at::Tensor& cu_seqlens_q,
                                                         const at::Tensor& cu_seqlens_k, int64_t topk);
std::tuple<at::Tensor, at::Tensor, at::Tensor> lightning_indexer_bwd(const at::Tensor& q, const at::Tensor& k,
                                                                     const at::Tensor& w, const at::Tensor& indices,
                                                                     const at::Tensor& grad_scores);
std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_attn_fwd(const at::Tensor& q, const at::Tensor& kv,
                                                               const at::Tensor& indices, double scale, int64_t dv,
                                                               const std::optional<at::Tensor>& gate, bool return_p,
                                                               bool deterministic);
std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_attn_bwd(const at::Tensor& grad_o, const at::Tensor& q,
                                                               const at::Tensor& kv, const at::Tensor& indices,
                                                               const at::Tensor& o, const at::Tensor& lse,
                                                               double scale, int64_t dv,
                                                               const std::optional<at::Tensor>& gate,
                                                               bool deterministic);

}  // namespace kda_dsa_ops::dsa
