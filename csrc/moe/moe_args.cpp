// Argument checks of the MoE ops, shared by the CPU and CUDA implementations.
#include "common/checks.h"
#include "moe/moe.h"

#include <algorithm>
#include <limits>
#include <vector>

namespace kda_dsa_ops::moe {

ScoreFn parse_score_fn(c10::string_view name) {
  if (name == "sigmoid") return ScoreFn::kSigmoid;
  if (name == "softmax") return ScoreFn::kSoftmax;
  TORCH_CHECK(false, "moe_route: score_fn must be 'sigmoid' or 'softmax', got '", std::string(name), "'");
}

Policy parse_policy(c10::string_view name) {
  if (name == "drop_probs") return Policy::kDropProbs;
  if (name == "drop_position") return Policy::kDropPosition;
  if (name == "reroute") return Policy::kReroute;
  TORCH_CHECK(false, "moe_permute: policy must be 'drop_probs', 'drop_position' or 'reroute', got '",
              std::string(name), "'");
}

namespace {

constexpr auto kFloatingTypes = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16};

// offs: int32 [E], non-decreasing, within [0, rows].
void check_offs(const at::Tensor& offs, int64_t num_experts, int64_t rows, const at::Tensor& ref, const char* op) {
  check_dim(offs, 1, "offs", "[E] (cumulative row counts per expert)");
  check_dtype(offs, {at::kInt}, "offs");
  check_same_device(offs, ref, "offs", "a");
  TORCH_CHECK(offs.size(0) == num_experts, op, ": offs must have one entry per expert (", num_experts,
              "), got ", offs.size(0));
  TORCH_CHECK(num_experts > 0, op, ": needs at least one expert");
  if (!run_value_checks(offs)) return;
  const auto values = host_values(offs);
  int64_t prev = 0;
  for (size_t e = 0; e < values.size(); ++e) {
    TORCH_CHECK(values[e] >= prev, op, ": offs must be non-decreasing and start at >= 0 (cumulative row counts), ",
                "got offs[", e, "] = ", values[e], " after ", prev);
    prev = values[e];
  }
  TORCH_CHECK(prev <= rows, op, ": offs[-1] = ", prev, " is past the ", rows, " rows of a");
}

}  // namespace

int64_t permute_rows(int64_t num_tokens, int64_t topk, int64_t num_experts, int64_t capacity) {
  const int64_t copies = num_tokens * topk;
  return capacity < 0 ? copies : std::min(copies, num_experts * capacity);
}

void check_route(const at::Tensor& logits, const std::optional<at::Tensor>& bias, int64_t k, int64_t n_group,
                 int64_t topk_group) {
  check_dim(logits, 2, "logits", "[T, E]");
  check_dtype(logits, kFloatingTypes, "logits");
  const int64_t E = logits.size(1);
  TORCH_CHECK(E > 0, "moe_route: logits needs at least one expert column");
  TORCH_CHECK(k >= 1 && k <= E, "moe_route: k must be in [1, E] with E = ", E, " experts, got k = ", k);
  TORCH_CHECK(n_group >= 1 && n_group <= kMaxGroups && E % n_group == 0,
              "moe_route: n_group must divide E = ", E, " and be in [1, ", kMaxGroups, "], got ", n_group);
  if (n_group > 1) {
    TORCH_CHECK(E / n_group >= 2, "moe_route: group-limited routing scores a group by its two best experts: "
                "groups need >= 2 experts, got E / n_group = ", E / n_group);
    TORCH_CHECK(topk_group >= 1 && topk_group <= n_group, "moe_route: topk_group must be in [1, n_group = ", n_group,
                "], got ", topk_group);
    TORCH_CHECK(k <= topk_group * (E / n_group), "moe_route: k = ", k, " exceeds the ", topk_group * (E / n_group),
                " experts of topk_group = ", topk_group, " groups");
  }
  if (bias) {
    check_dim(*bias, 1, "bias", "[E]");
    check_dtype(*bias, {at::kFloat, at::kDouble}, "bias");
    check_same_device(*bias, logits, "bias", "logits");
    TORCH_CHECK(bias->size(0) == E, "moe_route: bias must have E = ", E, " entries, got ", bias->size(0));
  }
}

void check_route_bwd(const at::Tensor& grad_weights, const at::Tensor& logits, const at::Tensor& ids) {
  check_route(logits, std::nullopt, ids.dim() == 2 ? std::max<int64_t>(ids.size(1), 1) : 1);
  check_dim(ids, 2, "ids", "[T, k]");
  check_dtype(ids, {at::kInt}, "ids");
  check_same_device(ids, logits, "ids", "logits");
  TORCH_CHECK(ids.size(0) == logits.size(0), "moe_route_bwd: ids must have T = ", logits.size(0), " rows, got ",
              ids.size(0));
  TORCH_CHECK(grad_weights.sizes() == ids.sizes(), "moe_route_bwd: grad_weights must have the shape of ids ",
              shape_str(ids), ", got ", shape_str(grad_weights));
  check_dtype(grad_weights, {at::kFloat, at::kDouble}, "grad_weights");
  check_same_device(grad_weights, logits, "grad_weights", "logits");
  check_index_range(ids, 0, logits.size(1), "moe_route_bwd", "ids");
}

void check_permute(const at::Tensor& x, const at::Tensor& ids, const std::optional<at::Tensor>& weights,
                   int64_t num_experts, int64_t capacity, Policy policy,
                   const std::optional<at::Tensor>& fallback_ids) {
  check_dim(x, 2, "x", "[T, D]");
  check_dtype(x, kFloatingTypes, "x");
  check_dim(ids, 2, "ids", "[T, k]");
  check_dtype(ids, {at::kInt}, "ids");
  check_same_device(ids, x, "ids", "x");
  TORCH_CHECK(ids.size(0) == x.size(0), "moe_permute: ids must have one row per token of x (", x.size(0),
              "), got ", ids.size(0));
  TORCH_CHECK(num_experts >= 1, "moe_permute: num_experts must be >= 1, got ", num_experts);
  TORCH_CHECK(capacity >= -1, "moe_permute: capacity must be >= 0, or -1 for none, got ", capacity);
  TORCH_CHECK(ids.numel() < std::numeric_limits<int32_t>::max(), "moe_permute: T*k = ", ids.numel(),
              " copies do not fit the int32 row map");
  const bool by_weight = capacity >= 0 && policy != Policy::kDropPosition;
  if (weights) {
    TORCH_CHECK(weights->sizes() == ids.sizes(), "moe_permute: weights must have the shape of ids ",
                shape_str(ids), ", got ", shape_str(*weights));
    check_dtype(*weights, {at::kFloat, at::kDouble}, "weights");
    check_same_device(*weights, x, "weights", "x");
  }
  TORCH_CHECK(!by_weight || weights, "moe_permute: policy '",
              policy == Policy::kReroute ? "reroute" : "drop_probs",
              "' with a capacity ranks copies by weight: pass weights");
  const bool reroute = capacity >= 0 && policy == Policy::kReroute;
  TORCH_CHECK(!reroute || fallback_ids, "moe_permute: policy 'reroute' needs fallback_ids [T, F] ",
              "(each token's next-best experts, e.g. ids columns k.. of moe_route with a larger k)");
  if (fallback_ids) {
    check_dim(*fallback_ids, 2, "fallback_ids", "[T, F]");
    check_dtype(*fallback_ids, {at::kInt}, "fallback_ids");
    check_same_device(*fallback_ids, x, "fallback_ids", "x");
    TORCH_CHECK(fallback_ids->size(0) == x.size(0), "moe_permute: fallback_ids must have one row per token (",
                x.size(0), "), got ", fallback_ids->size(0));
    check_index_range(*fallback_ids, -1, num_experts, "moe_permute", "fallback_ids");
  }
  check_index_range(ids, 0, num_experts, "moe_permute", "ids");
}

void check_unpermute(const at::Tensor& y_sorted, const at::Tensor& row_map, const at::Tensor& weights,
                     int64_t num_tokens) {
  check_dim(y_sorted, 2, "y_sorted", "[M, D]");
  check_dtype(y_sorted, kFloatingTypes, "y_sorted");
  check_dim(row_map, 1, "row_map", "[M]");
  check_dtype(row_map, {at::kInt}, "row_map");
  check_same_device(row_map, y_sorted, "row_map", "y_sorted");
  TORCH_CHECK(row_map.size(0) == y_sorted.size(0), "moe_unpermute: row_map must have one entry per row of y_sorted (",
              y_sorted.size(0), "), got ", row_map.size(0));
  check_dim(weights, 2, "weights", "[T, k]");
  check_dtype(weights, {at::kFloat, at::kDouble}, "weights");
  check_same_device(weights, y_sorted, "weights", "y_sorted");
  TORCH_CHECK(weights.size(0) == num_tokens, "moe_unpermute: weights must have num_tokens = ", num_tokens,
              " rows, got ", weights.size(0));
  check_index_range(row_map, -1, weights.numel(), "moe_unpermute", "row_map");
  if (row_map.numel() == 0 || !run_value_checks(row_map)) return;
  std::vector<char> seen(weights.numel(), 0);
  for (const int32_t c : host_values(row_map)) {
    if (c < 0) continue;
    TORCH_CHECK(!seen[c], "moe_unpermute: row_map must name each copy at most once (it is moe_permute's row_map), ",
                "copy ", c, " appears twice");
    seen[c] = 1;
  }
}

void check_unpermute_bwd(const at::Tensor& grad_y, const at::Tensor& y_sorted, const at::Tensor& row_map,
                         const at::Tensor& weights) {
  check_unpermute(y_sorted, row_map, weights, weights.dim() == 2 ? weights.size(0) : 0);
  check_dim(grad_y, 2, "grad_y", "[T, D]");
  TORCH_CHECK(grad_y.size(0) == weights.size(0) && grad_y.size(1) == y_sorted.size(1),
              "moe_unpermute_bwd: grad_y must be [T, D] = [", weights.size(0), ", ", y_sorted.size(1), "], got ",
              shape_str(grad_y));
  TORCH_CHECK(grad_y.scalar_type() == y_sorted.scalar_type(), "moe_unpermute_bwd: grad_y dtype ",
              grad_y.scalar_type(), " differs from y_sorted dtype ", y_sorted.scalar_type());
  check_same_device(grad_y, y_sorted, "grad_y", "y_sorted");
}

void check_grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
  check_dim(a, 2, "a", "[M, K]");
  check_dim(b, 3, "b", "[E, K, N]");
  check_dtype(a, kFloatingTypes, "a");
  TORCH_CHECK(b.scalar_type() == a.scalar_type(), "grouped_mm: b dtype ", b.scalar_type(), " differs from a dtype ",
              a.scalar_type());
  check_same_device(b, a, "b", "a");
  TORCH_CHECK(b.size(1) == a.size(1), "grouped_mm: b must be [E, K, N] with K = a.size(1) = ", a.size(1),
              ", got b of shape ", shape_str(b));
  TORCH_CHECK(a.size(0) < std::numeric_limits<int32_t>::max(), "grouped_mm: M = ", a.size(0), " rows exceed int32");
  check_offs(offs, b.size(0), a.size(0), a, "grouped_mm");
}

void check_grouped_mm_wgrad(const at::Tensor& a, const at::Tensor& dy, const at::Tensor& offs) {
  check_dim(a, 2, "a", "[M, K]");
  check_dim(dy, 2, "dy", "[M, N]");
  check_dtype(a, kFloatingTypes, "a");
  TORCH_CHECK(dy.scalar_type() == a.scalar_type(), "grouped_mm_wgrad: dy dtype ", dy.scalar_type(),
              " differs from a dtype ", a.scalar_type());
  check_same_device(dy, a, "dy", "a");
  TORCH_CHECK(dy.size(0) == a.size(0), "grouped_mm_wgrad: dy must have the M = ", a.size(0), " rows of a, got ",
              dy.size(0));
  TORCH_CHECK(a.size(0) < std::numeric_limits<int32_t>::max(), "grouped_mm_wgrad: M = ", a.size(0),
              " rows exceed int32");
  check_offs(offs, offs.dim() == 1 ? offs.size(0) : 0, a.size(0), a, "grouped_mm_wgrad");
}

}  // namespace kda_dsa_ops::moe
