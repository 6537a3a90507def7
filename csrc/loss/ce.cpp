// cross_entropy_rows_' argument checks, shared by the CPU and CUDA entry points.
#include "loss/ce.h"

#include "common/checks.h"

namespace kda_dsa_ops::loss {

RowsProblem check_ce_rows(const at::Tensor& logits, const at::Tensor& labels, int64_t ignore_index) {
  constexpr const char* op = "cross_entropy_rows_";
  check_dim(logits, 2, "logits", "[N, V]");
  check_dim(labels, 1, "labels", "[N]");
  check_dtype(logits, {at::kBFloat16, at::kHalf, at::kFloat, at::kDouble}, "logits");
  check_dtype(labels, {at::kLong}, "labels");
  check_same_device(labels, logits, "labels", "logits");
  TORCH_CHECK(logits.is_contiguous(), op, ": logits must be contiguous (they are overwritten with the gradient)");
  const RowsProblem p{logits.size(0), logits.size(1)};
  TORCH_CHECK(labels.size(0) == p.N, op, ": labels must have one entry per row of logits (", p.N, "), got ",
              labels.size(0));
  TORCH_CHECK(p.V >= 1 || p.N == 0, op, ": logits need at least one class, got shape ", shape_str(logits));
  if (p.N > 0 && run_value_checks(labels)) {
    const at::Tensor bad = labels.ne(ignore_index).logical_and(labels.lt(0).logical_or(labels.ge(p.V)));
    TORCH_CHECK(!bad.any().item<bool>(), op, ": labels must lie in [0, ", p.V, ") or equal ignore_index (",
                ignore_index, ")");
  }
  return p;
}

}  // namespace kda_dsa_ops::loss
