// Cross-entropy over rows of logits, the core of the LM head's chunked linear cross-entropy
// (python/kda_dsa_ops/nn/loss.py): per row the loss lse(x) - x[label], the argmax (the first
// largest logit, NaNs left out) and, in place, the gradient scale * (softmax(x) - onehot(label));
// a row whose label is ignore_index has loss 0, argmax -1 and gradient 0. Argument checks shared
// by both backends (ce.cpp), each backend's implementation (ce_cpu.cpp, ce_cuda.cu). Semantics:
// python/kda_dsa_ops/reference/loss.py.
#pragma once

#include <ATen/ATen.h>

namespace kda_dsa_ops::loss {

// Rows N and classes V; checks shapes, dtypes, devices and (a value check) the labels' range.
struct RowsProblem {
  int64_t N, V;
};
RowsProblem check_ce_rows(const at::Tensor& logits, const at::Tensor& labels, int64_t ignore_index);

#define KDA_DSA_OPS_LOSS_ENTRIES(DEV)                                                                      \
  std::tuple<at::Tensor, at::Tensor> cross_entropy_rows_##DEV(at::Tensor& logits, const at::Tensor& labels,   \
                                                              int64_t ignore_index, double scale, bool write_grad);

KDA_DSA_OPS_LOSS_ENTRIES(cpu)
#ifdef KDA_DSA_OPS_WITH_CUDA
KDA_DSA_OPS_LOSS_ENTRIES(cuda)
#endif
#undef KDA_DSA_OPS_LOSS_ENTRIES

}  // namespace kda_dsa_ops::loss
