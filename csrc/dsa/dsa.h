// DSA ops: the lightning indexer (LI: fused scoring + top-k), sparse attention over the selected
// keys with an output gate (SFA) and its gradient (SFAG). Each backend's op entry points
// (dsa_cpu.cpp, dsa_cuda.cu) check the arguments (dsa.cpp), bring the inputs to what its kernels
// take (CPU: the accumulation type, fp32 or fp64; CUDA: bf16 / fp16 operands) and cast the
// results back. Semantics: python/kda_dsa_ops/reference/dsa.py.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace kda_dsa_ops::dsa {

constexpr int64_t kMaxTopk = 2048;  // the indexer's topk
constexpr int64_t kMaxKeys = 4096;  // keys per (query, kv head) of sparse attention (GLM-5.3's
                                    // pooled selection with its tail: 2048 + kpool - 1)

// Sizes of an indexer call: T queries of Hi heads of Di, Tk keys.
struct IndexerShapes {
  int64_t T, Tk, Hi, Di;
};
// The forward's: N sequences (cu_seqlens_q / _k, int32 [N + 1] on the inputs' device), topk.
struct IndexerProblem {
  int64_t T, Tk, Hi, Di, N, topk;
  at::Tensor cu_q, cu_k;
};
// Sparse attention: T queries of H heads, Tk rows of Hkv kv heads, topk indices per (query, kv head).
struct AttnProblem {
  int64_t T, H, Hkv, Tk, Dqk, dv, topk;
  double scale;
};

// The checks both backends' entry points make (dsa.cpp): shapes, dtypes, devices, topk,
// cu_seqlens and index ranges (value checks).
IndexerProblem check_indexer_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w,
                                 const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t topk);
IndexerShapes check_indexer_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w,
                                const at::Tensor& indices, const at::Tensor& grad_scores);
AttnProblem check_attn_fwd(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& indices, double scale,
                           int64_t dv, const std::optional<at::Tensor>& gate);
AttnProblem check_attn_bwd(const at::Tensor& grad_o, const at::Tensor& q, const at::Tensor& kv,
                           const at::Tensor& indices, const at::Tensor& o, const at::Tensor& lse, double scale,
                           int64_t dv, const std::optional<at::Tensor>& gate);

inline at::Tensor contiguous_as(const at::Tensor& t, at::ScalarType type) { return t.to(type).contiguous(); }

// The op entry points, one per dispatch key, with the schema's arguments; torch_bindings.cpp
// registers them.
#define KDA_DSA_OPS_DSA_ENTRIES(DEV)                                                                             \
  std::tuple<at::Tensor, at::Tensor> lightning_indexer_fwd_##DEV(const at::Tensor& q, const at::Tensor& k,        \
                                                                 const at::Tensor& w, const at::Tensor& cu_seqlens_q, \
                                                                 const at::Tensor& cu_seqlens_k, int64_t topk);   \
  std::tuple<at::Tensor, at::Tensor, at::Tensor> lightning_indexer_bwd_##DEV(                                      \
      const at::Tensor& q, const at::Tensor& k, const at::Tensor& w, const at::Tensor& indices,                    \
      const at::Tensor& grad_scores);                                                                             \
  std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_attn_fwd_##DEV(                                            \
      const at::Tensor& q, const at::Tensor& kv, const at::Tensor& indices, double scale, int64_t dv,              \
      const std::optional<at::Tensor>& gate, bool return_p, bool deterministic);                                  \
  std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_attn_bwd_##DEV(                                            \
      const at::Tensor& grad_o, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& indices,              \
      const at::Tensor& o, const at::Tensor& lse, double scale, int64_t dv, const std::optional<at::Tensor>& gate, \
      bool deterministic);
KDA_DSA_OPS_DSA_ENTRIES(cpu)
#ifdef KDA_DSA_OPS_WITH_CUDA
KDA_DSA_OPS_DSA_ENTRIES(cuda)
#endif
#undef KDA_DSA_OPS_DSA_ENTRIES

}  // namespace kda_dsa_ops::dsa
