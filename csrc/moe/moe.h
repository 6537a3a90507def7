// MoE ops: routing, permutation by expert, grouped expert GEMM. Declarations of the argument
// checks shared by both backends and of each backend's implementation. Semantics: the
// docstrings of python/kda_dsa_ops/reference/moe.py.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace kda_dsa_ops::moe {

enum class ScoreFn { kSigmoid, kSoftmax };
enum class Policy { kDropProbs, kDropPosition, kReroute };

// Denominator guard of the renormalised routing weights: w / (sum(w) + kRenormEps).
constexpr double kRenormEps = 1e-20;
// Group-limited routing: groups are tracked as bits of a 64-bit mask.
constexpr int64_t kMaxGroups = 64;

ScoreFn parse_score_fn(c10::string_view name);
Policy parse_policy(c10::string_view name);

// Shape/dtype/device checks (free) and value checks (index ranges: see run_value_checks).
void check_route(const at::Tensor& logits, const std::optional<at::Tensor>& bias, int64_t k, int64_t n_group = 1,
                 int64_t topk_group = 1);
void check_route_bwd(const at::Tensor& grad_weights, const at::Tensor& logits, const at::Tensor& ids);
void check_permute(const at::Tensor& x, const at::Tensor& ids, const std::optional<at::Tensor>& weights,
                   int64_t num_experts, int64_t capacity, Policy policy,
                   const std::optional<at::Tensor>& fallback_ids);
void check_unpermute(const at::Tensor& y_sorted, const at::Tensor& row_map, const at::Tensor& weights,
                     int64_t num_tokens);
void check_unpermute_bwd(const at::Tensor& grad_y, const at::Tensor& y_sorted, const at::Tensor& row_map,
                         const at::Tensor& weights);
void check_grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs);
void check_grouped_mm_wgrad(const at::Tensor& a, const at::Tensor& dy, const at::Tensor& offs);

// Rows of moe_permute's outputs: T*k, or min(T*k, E*capacity) with a capacity (capacity >= 0).
int64_t permute_rows(int64_t num_tokens, int64_t topk, int64_t num_experts, int64_t capacity);

std::tuple<at::Tensor, at::Tensor> route_cpu(const at::Tensor& logits, const std::optional<at::Tensor>& bias,
                                             int64_t k, c10::string_view score_fn, bool renorm, double scale,
                                             int64_t n_group, int64_t topk_group);
at::Tensor route_bwd_cpu(const at::Tensor& grad_weights, const at::Tensor& logits, const at::Tensor& ids,
                         c10::string_view score_fn, bool renorm, double scale);
std::tuple<at::Tensor, at::Tensor, at::Tensor> permute_cpu(const at::Tensor& x, const at::Tensor& ids,
                                                           const std::optional<at::Tensor>& weights,
                                                           int64_t num_experts, int64_t capacity,
                                                           c10::string_view policy,
                                                           const std::optional<at::Tensor>& fallback_ids);
at::Tensor unpermute_cpu(const at::Tensor& y_sorted, const at::Tensor& row_map, const at::Tensor& weights,
                         int64_t num_tokens);
std::tuple<at::Tensor, at::Tensor> unpermute_bwd_cpu(const at::Tensor& grad_y, const at::Tensor& y_sorted,
                                                     const at::Tensor& row_map, const at::Tensor& weights);
at::Tensor grouped_mm_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs);
at::Tensor grouped_mm_wgrad_cpu(const at::Tensor& a, const at::Tensor& dy, const at::Tensor& offs);

#ifdef KDA_DSA_OPS_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> route_cuda(const at::Tensor& logits, const std::optional<at::Tensor>& bias,
                                              int64_t k, c10::string_view score_fn, bool renorm, double scale,
                                              int64_t n_group, int64_t topk_group);
at::Tensor route_bwd_cuda(const at::Tensor& grad_weights, const at::Tensor& logits, const at::Tensor& ids,
                          c10::string_view score_fn, bool renorm, double scale);
std::tuple<at::Tensor, at::Tensor, at::Tensor> permute_cuda(const at::Tensor& x, const at::Tensor& ids,
                                                            const std::optional<at::Tensor>& weights,
                                                            int64_t num_experts, int64_t capacity,
                                                            c10::string_view policy,
                                                            const std::optional<at::Tensor>& fallback_ids);
at::Tensor unpermute_cuda(const at::Tensor& y_sorted, const at::Tensor& row_map, const at::Tensor& weights,
                          int64_t num_tokens);
std::tuple<at::Tensor, at::Tensor> unpermute_bwd_cuda(const at::Tensor& grad_y, const at::Tensor& y_sorted,
                                                      const at::Tensor& row_map, const at::Tensor& weights);
at::Tensor grouped_mm_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs);
at::Tensor grouped_mm_wgrad_cuda(const at::Tensor& a, const at::Tensor& dy, const at::Tensor& offs);
#endif

}  // namespace kda_dsa_ops::moe
