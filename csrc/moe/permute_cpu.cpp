// moe_permute / moe_unpermute on the CPU. The expert assignment (capacity, drop and reroute
// policies) is a sequential pass over the copies; the row gather/scatter runs in parallel.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "common/checks.h"
#include "common/dispatch.h"
#include "moe/moe.h"

namespace kda_dsa_ops::moe {
namespace {

// Rows of each expert (copy indices) in the order moe_permute lays them out.
std::vector<std::vector<int64_t>> assign_copies(const at::Tensor& ids, const std::optional<at::Tensor>& weights,
                                                int64_t E, int64_t capacity, Policy policy,
                                                const std::optional<at::Tensor>& fallback_ids) {
  const int64_t T = ids.size(0), k = ids.size(1), n = T * k;
  const at::Tensor ids_c = ids.contiguous();
  const int32_t* id = ids_c.data_ptr<int32_t>();
  const bool by_weight = capacity >= 0 && policy != Policy::kDropPosition;
  std::vector<double> priority;  // weight with NaN ranked last
  if (by_weight) {
    const at::Tensor w = weights->to(at::kDouble).contiguous();
    const double* wp = w.data_ptr<double>();
    priority.resize(n);
    for (int64_t c = 0; c < n; ++c) priority[c] = std::isnan(wp[c]) ? -std::numeric_limits<double>::infinity() : wp[c];
  }
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  auto expert_of = [&](int64_t c) -> int64_t { return id[c] >= 0 && id[c] < E ? id[c] : E; };
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    const int64_t ex = expert_of(x), ey = expert_of(y);
    if (ex != ey) return ex < ey;
    return by_weight && priority[x] > priority[y];
  });
  std::vector<std::vector<int64_t>> segments(E);
  std::vector<char> overflow(n, 0);
  for (int64_t c : order) {
    const int64_t e = expert_of(c);
    if (e == E) continue;
    if (capacity < 0 || static_cast<int64_t>(segments[e].size()) < capacity) {
      segments[e].push_back(c);
    } else {
      overflow[c] = 1;
    }
  }
  if (capacity < 0 || policy != Policy::kReroute) return segments;
  const at::Tensor fb = fallback_ids->contiguous();
  const int32_t* fp = fb.data_ptr<int32_t>();
  const int64_t F = fb.size(1);
  std::vector<int64_t> room(E);
  for (int64_t e = 0; e < E; ++e) room[e] = capacity - static_cast<int64_t>(segments[e].size());
  int64_t cursor_token = -1, cursor = 0;
  for (int64_t c = 0; c < n; ++c) {
    if (!overflow[c]) continue;
    const int64_t t = c / k;
    if (t != cursor_token) cursor_token = t, cursor = 0;
    while (cursor < F) {
      const int32_t e = fp[t * F + cursor++];
      if (e >= 0 && e < E && room[e] > 0) {
        --room[e];
        segments[e].push_back(c);
        break;
      }
    }
  }
  return segments;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> permute_cpu(const at::Tensor& x_in, const at::Tensor& ids,
                                                           const std::optional<at::Tensor>& weights,
                                                           int64_t num_experts, int64_t capacity,
                                                           c10::string_view policy_name,
                                                           const std::optional<at::Tensor>& fallback_ids) {
  const Policy policy = parse_policy(policy_name);
  check_permute(x_in, ids, weights, num_experts, capacity, policy, fallback_ids);
  const at::Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), D = x.size(1), k = ids.size(1);
  const int64_t M = permute_rows(T, k, num_experts, capacity);
  const auto segments = assign_copies(ids, weights, num_experts, capacity, policy, fallback_ids);

  at::Tensor row_map = at::full({M}, -1, ids.options());
  at::Tensor offs = at::empty({num_experts}, ids.options());
  int32_t* rp = row_map.data_ptr<int32_t>();
  int32_t* op = offs.data_ptr<int32_t>();
  int64_t row = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    for (int64_t c : segments[e]) rp[row++] = static_cast<int32_t>(c);
    op[e] = static_cast<int32_t>(row);
  }
  at::Tensor x_sorted = at::empty({M, D}, x.options());
  const int64_t row_bytes = D * x.element_size();
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* sp = static_cast<char*>(x_sorted.data_ptr());
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      if (rp[m] >= 0) {
        std::memcpy(sp + m * row_bytes, xp + (rp[m] / k) * row_bytes, row_bytes);
      } else {
        std::memset(sp + m * row_bytes, 0, row_bytes);
      }
    }
  });
  return {x_sorted, row_map, offs};
}

namespace {

// Row of y_sorted holding each copy (t*k + j), or -1 when the copy was dropped.
std::vector<int64_t> copy_rows(const at::Tensor& row_map, int64_t copies) {
  std::vector<int64_t> rows(copies, -1);
  const at::Tensor rm = row_map.contiguous();
  const int32_t* rp = rm.data_ptr<int32_t>();
  for (int64_t m = 0; m < rm.size(0); ++m) {
    if (rp[m] >= 0 && rp[m] < copies) rows[rp[m]] = m;
  }
  return rows;
}

}  // namespace

at::Tensor unpermute_cpu(const at::Tensor& y_sorted_in, const at::Tensor& row_map, const at::Tensor& weights_in,
                         int64_t num_tokens) {
  check_unpermute(y_sorted_in, row_map, weights_in, num_tokens);
  const at::Tensor ys = y_sorted_in.contiguous();
  const int64_t D = ys.size(1), k = weights_in.size(1);
  const auto rows = copy_rows(row_map, num_tokens * k);
  at::Tensor y = at::empty({num_tokens, D}, ys.options());
  KDA_DISPATCH_CPU_FLOATING(ys.scalar_type(), "moe_unpermute_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const at::Tensor w = weights_in.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();
    const acc_t* wp = w.data_ptr<acc_t>();
    const scalar_t* sp = ys.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> acc(D);
      for (int64_t t = begin; t < end; ++t) {
        std::fill(acc.begin(), acc.end(), acc_t(0));
        for (int64_t j = 0; j < k; ++j) {
          const int64_t m = rows[t * k + j];
          if (m < 0) continue;
          const acc_t wj = wp[t * k + j];
          for (int64_t d = 0; d < D; ++d) acc[d] += wj * static_cast<acc_t>(sp[m * D + d]);
        }
        for (int64_t d = 0; d < D; ++d) yp[t * D + d] = static_cast<scalar_t>(acc[d]);
      }
    });
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> unpermute_bwd_cpu(const at::Tensor& grad_y_in, const at::Tensor& y_sorted_in,
                                                     const at::Tensor& row_map_in, const at::Tensor& weights_in) {
  check_unpermute_bwd(grad_y_in, y_sorted_in, row_map_in, weights_in);
  const at::Tensor gy = grad_y_in.contiguous();
  const at::Tensor ys = y_sorted_in.contiguous();
  const at::Tensor rm = row_map_in.contiguous();
  const int64_t M = ys.size(0), D = ys.size(1), k = weights_in.size(1);
  const int64_t copies = weights_in.numel();
  at::Tensor grad_ys = at::empty_like(ys);
  at::Tensor grad_w = at::zeros(weights_in.sizes(), weights_in.options());  // contiguous, as on CUDA
  KDA_DISPATCH_CPU_FLOATING(ys.scalar_type(), "moe_unpermute_bwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const at::Tensor w = weights_in.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();
    at::Tensor gw = at::zeros({copies}, w.options());
    const acc_t* wp = w.data_ptr<acc_t>();
    acc_t* gwp = gw.data_ptr<acc_t>();
    const int32_t* rp = rm.data_ptr<int32_t>();
    const scalar_t* gyp = gy.data_ptr<scalar_t>();
    const scalar_t* sp = ys.data_ptr<scalar_t>();
    scalar_t* gsp = grad_ys.data_ptr<scalar_t>();
    // Each copy has at most one row, so the per-row writes into gw never collide.
    at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        const int64_t c = rp[m];
        if (c < 0 || c >= copies) {
          for (int64_t d = 0; d < D; ++d) gsp[m * D + d] = scalar_t(0);
          continue;
        }
        const int64_t t = c / k;
        acc_t dot = 0;
        for (int64_t d = 0; d < D; ++d) {
          const acc_t g = static_cast<acc_t>(gyp[t * D + d]);
          dot += g * static_cast<acc_t>(sp[m * D + d]);
          gsp[m * D + d] = static_cast<scalar_t>(wp[c] * g);
        }
        gwp[c] = dot;
      }
    });
    grad_w.copy_(gw.view_as(grad_w));
  });
  return {grad_ys, grad_w};
}

}  // namespace kda_dsa_ops::moe
