// grouped_mm / grouped_mm_wgrad on the CPU: one matrix product per expert on its row range,
// accumulated in fp32 (fp64 for fp64 inputs).
#include "common/checks.h"
#include "moe/moe.h"

#include <vector>

namespace kda_dsa_ops::moe {
namespace {

at::ScalarType acc_dtype(const at::Tensor& t) { return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// Row range of each expert: [bounds[e], bounds[e+1]).
std::vector<int64_t> expert_bounds(const at::Tensor& offs) {
  const at::Tensor o = offs.to(at::kLong).contiguous();
  std::vector<int64_t> bounds(o.numel() + 1, 0);
  for (int64_t e = 0; e < o.numel(); ++e) bounds[e + 1] = o.data_ptr<int64_t>()[e];
  return bounds;
}

}  // namespace

at::Tensor grouped_mm_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
  check_grouped_mm(a, b, offs);
  const auto bounds = expert_bounds(offs);
  const int64_t E = b.size(0);
  at::Tensor out = at::zeros({a.size(0), b.size(2)}, a.options());
  for (int64_t e = 0; e < E; ++e) {
    if (bounds[e + 1] == bounds[e]) continue;
    const at::Tensor rows = a.slice(0, bounds[e], bounds[e + 1]).to(acc_dtype(a));
    out.slice(0, bounds[e], bounds[e + 1]).copy_(at::mm(rows, b[e].to(acc_dtype(a))));
  }
  return out;
}

at::Tensor grouped_mm_wgrad_cpu(const at::Tensor& a, const at::Tensor& dy, const at::Tensor& offs) {
  check_grouped_mm_wgrad(a, dy, offs);
  const auto bounds = expert_bounds(offs);
  const int64_t E = offs.size(0);
  at::Tensor out = at::zeros({E, a.size(1), dy.size(1)}, a.options());
  for (int64_t e = 0; e < E; ++e) {
    if (bounds[e + 1] == bounds[e]) continue;
    const at::Tensor rows_a = a.slice(0, bounds[e], bounds[e + 1]).to(acc_dtype(a));
    const at::Tensor rows_dy = dy.slice(0, bounds[e], bounds[e + 1]).to(acc_dtype(a));
    out[e].copy_(at::mm(rows_a.t(), rows_dy));
  }
  return out;
}

}  // namespace kda_dsa_ops::moe
