// moe_route on the CPU: per token, scores = sigmoid/softmax(logits) in fp32 (fp64 for fp64
// logits), top-k of scores + bias (ties: lower expert index; NaN ranks last), weights = the
// chosen scores, renormalised and scaled. Group-limited (n_group > 1): only the experts of the
// topk_group groups with the largest sums of their two best keys compete (ties: lower group).
// The backward recomputes the scores.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "common/checks.h"
#include "common/dispatch.h"
#include "moe/moe.h"

namespace kda_dsa_ops::moe {
namespace {

template <typename scalar_t, typename acc_t>
void token_scores(const scalar_t* logits, int64_t E, ScoreFn fn, acc_t* scores) {
  if (fn == ScoreFn::kSigmoid) {
    for (int64_t e = 0; e < E; ++e) scores[e] = acc_t(1) / (acc_t(1) + std::exp(-static_cast<acc_t>(logits[e])));
    return;
  }
  acc_t mx = -std::numeric_limits<acc_t>::infinity();
  for (int64_t e = 0; e < E; ++e) mx = std::max(mx, static_cast<acc_t>(logits[e]));
  acc_t sum = 0;
  for (int64_t e = 0; e < E; ++e) {
    scores[e] = std::exp(static_cast<acc_t>(logits[e]) - mx);
    sum += scores[e];
  }
  for (int64_t e = 0; e < E; ++e) scores[e] /= sum;
}

// Closes (key = -inf) every expert outside the topk_group best groups of n_group.
template <typename acc_t>
void limit_to_groups(acc_t* key, int64_t E, int64_t n_group, int64_t topk_group, std::vector<acc_t>& group_score,
                     std::vector<int32_t>& group_order) {
  const int64_t size = E / n_group;
  for (int64_t g = 0; g < n_group; ++g) {
    acc_t first = -std::numeric_limits<acc_t>::infinity(), second = first;
    for (int64_t e = g * size; e < (g + 1) * size; ++e) {
      if (key[e] > first) {
        second = first;
        first = key[e];
      } else if (key[e] > second) {
        second = key[e];
      }
    }
    group_score[g] = first + second;
  }
  std::iota(group_order.begin(), group_order.end(), 0);
  std::partial_sort(group_order.begin(), group_order.begin() + topk_group, group_order.end(),
                    [&](int32_t x, int32_t y) {
                      return group_score[x] > group_score[y] || (group_score[x] == group_score[y] && x < y);
                    });
  uint64_t open = 0;
  for (int64_t j = 0; j < topk_group; ++j) open |= uint64_t{1} << group_order[j];
  for (int64_t e = 0; e < E; ++e) {
    if (!((open >> (e / size)) & 1)) key[e] = -std::numeric_limits<acc_t>::infinity();
  }
}

at::ScalarType weight_dtype(const at::Tensor& logits) {
  return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> route_cpu(const at::Tensor& logits_in, const std::optional<at::Tensor>& bias_in,
                                             int64_t k, c10::string_view score_fn, bool renorm, double scale,
                                             int64_t n_group, int64_t topk_group) {
  check_route(logits_in, bias_in, k, n_group, topk_group);
  const ScoreFn fn = parse_score_fn(score_fn);
  const at::Tensor logits = logits_in.contiguous();
  const int64_t T = logits.size(0), E = logits.size(1);
  at::Tensor weights = at::empty({T, k}, logits.options().dtype(weight_dtype(logits)));
  at::Tensor ids = at::empty({T, k}, logits.options().dtype(at::kInt));
  KDA_DISPATCH_CPU_FLOATING(logits.scalar_type(), "moe_route_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const at::Tensor bias = bias_in ? bias_in->to(c10::CppTypeToScalarType<acc_t>::value).contiguous() : at::Tensor();
    const acc_t* bias_p = bias.defined() ? bias.data_ptr<acc_t>() : nullptr;
    const scalar_t* lp = logits.data_ptr<scalar_t>();
    acc_t* wp = weights.data_ptr<acc_t>();
    int32_t* ip = ids.data_ptr<int32_t>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> scores(E), key(E);
      std::vector<int32_t> order(E), group_order(n_group);
      std::vector<acc_t> group_score(n_group);
      for (int64_t t = begin; t < end; ++t) {
        token_scores(lp + t * E, E, fn, scores.data());
        for (int64_t e = 0; e < E; ++e) {
          const acc_t v = bias_p ? scores[e] + bias_p[e] : scores[e];
          key[e] = std::isnan(v) ? -std::numeric_limits<acc_t>::infinity() : v;
        }
        if (n_group > 1) limit_to_groups(key.data(), E, n_group, topk_group, group_score, group_order);
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t x, int32_t y) {
          return key[x] > key[y] || (key[x] == key[y] && x < y);
        });
        acc_t sum = 0;
        for (int64_t j = 0; j < k; ++j) sum += scores[order[j]];
        const acc_t norm = renorm ? acc_t(scale) / (sum + acc_t(kRenormEps)) : acc_t(scale);
        for (int64_t j = 0; j < k; ++j) {
          ip[t * k + j] = order[j];
          wp[t * k + j] = scores[order[j]] * norm;
        }
      }
    });
  });
  return {weights, ids};
}

at::Tensor route_bwd_cpu(const at::Tensor& grad_weights_in, const at::Tensor& logits_in, const at::Tensor& ids_in,
                         c10::string_view score_fn, bool renorm, double scale) {
  check_route_bwd(grad_weights_in, logits_in, ids_in);
  const ScoreFn fn = parse_score_fn(score_fn);
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor ids = ids_in.contiguous();
  const int64_t T = logits.size(0), E = logits.size(1), k = ids.size(1);
  at::Tensor grad_logits = at::empty_like(logits);
  KDA_DISPATCH_CPU_FLOATING(logits.scalar_type(), "moe_route_bwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const at::Tensor gw = grad_weights_in.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();
    const scalar_t* lp = logits.data_ptr<scalar_t>();
    const acc_t* gp = gw.data_ptr<acc_t>();
    const int32_t* ip = ids.data_ptr<int32_t>();
    scalar_t* op = grad_logits.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> scores(E), dscores(E);
      for (int64_t t = begin; t < end; ++t) {
        token_scores(lp + t * E, E, fn, scores.data());
        const int32_t* id = ip + t * k;
        const acc_t* g = gp + t * k;
        acc_t sum = 0, gsum = 0;  // sum of chosen scores u_j, and sum of g_j * u_j
        for (int64_t j = 0; j < k; ++j) {
          sum += scores[id[j]];
          gsum += g[j] * scores[id[j]];
        }
        // w_j = scale * u_j / D with D = sum + eps: dL/du_j = scale * (g_j / D - gsum / D^2).
        const acc_t denom = sum + acc_t(kRenormEps);
        std::fill(dscores.begin(), dscores.end(), acc_t(0));
        for (int64_t j = 0; j < k; ++j) {
          dscores[id[j]] += renorm ? acc_t(scale) * (g[j] / denom - gsum / (denom * denom)) : acc_t(scale) * g[j];
        }
        if (fn == ScoreFn::kSigmoid) {
          // d sigmoid / dx = q / (1 + q)^2 with q = exp(-|x|): no cancellation near saturation.
          // Experts not chosen get exactly zero, whatever their logit (NaN included).
          for (int64_t e = 0; e < E; ++e) {
            const acc_t q = std::exp(-std::abs(static_cast<acc_t>(lp[t * E + e])));
            op[t * E + e] = dscores[e] == 0 ? scalar_t(0) : static_cast<scalar_t>(dscores[e] * q / ((1 + q) * (1 + q)));
          }
        } else {
          acc_t dot = 0;
          for (int64_t e = 0; e < E; ++e) dot += dscores[e] * scores[e];
          for (int64_t e = 0; e < E; ++e) op[t * E + e] = static_cast<scalar_t>(scores[e] * (dscores[e] - dot));
        }
      }
    });
  });
  return grad_logits;
}

}  // namespace kda_dsa_ops::moe
