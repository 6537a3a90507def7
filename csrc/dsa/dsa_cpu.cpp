// DSA on the CPU: the op entry points for the CPU dispatch key. The indexer scores one query's
// visible keys at a time (the [T, Tk] score matrix never exists) and keeps the top-k; attention
// runs over the selected keys only. Inputs in the accumulation type (fp32, fp64 for fp64).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/dispatch.h"
#include "dsa/dsa.h"

namespace kda_dsa_ops::dsa {

namespace {

template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  T acc = 0;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

template <typename T>
void indexer_fwd_impl(const IndexerProblem& p, const T* q, const T* k, const T* w, int32_t* indices, T* scores) {
  const int32_t* cu_q = p.cu_q.data_ptr<int32_t>();
  const int32_t* cu_k = p.cu_k.data_ptr<int32_t>();
  at::parallel_for(0, p.N, 1, [&](int64_t n0, int64_t n1) {
    std::vector<T> s;
    std::vector<int32_t> order;
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t qs = cu_q[n], Lq = cu_q[n + 1] - qs, ks = cu_k[n], Lk = cu_k[n + 1] - ks;
      for (int64_t i = 0; i < Lq; ++i) {
        const int64_t t = qs + i;
        // Bottom-right aligned causality: query i sees keys j <= i + Lk - Lq.
        const int64_t visible = std::max<int64_t>(0, std::min(Lk, i + Lk - Lq + 1));
        s.resize(visible);
        order.clear();
        for (int64_t j = 0; j < visible; ++j) {
          T acc = 0;
          for (int64_t h = 0; h < p.Hi; ++h) {
            const T d = dot(q + (t * p.Hi + h) * p.Di, k + (ks + j) * p.Di, p.Di);
            acc += w[t * p.Hi + h] * (d < T(0) ? T(0) : d);  // a ReLU that keeps NaN, as torch's
          }
          s[j] = acc;
          if (std::isfinite(acc)) order.push_back(static_cast<int32_t>(j));  // a non-finite score is never selected
        }
        const int64_t m = std::min<int64_t>(p.topk, order.size());
        // Score descending, ties to the lower index.
        std::partial_sort(order.begin(), order.begin() + m, order.end(),
                          [&](int32_t a, int32_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); });
        for (int64_t r = 0; r < p.topk; ++r) {
          const bool keep = r < m;
          indices[t * p.topk + r] = keep ? static_cast<int32_t>(ks + order[r]) : -1;
          scores[t * p.topk + r] = keep ? s[order[r]] : -std::numeric_limits<T>::infinity();
        }
      }
    }
  });
}

// f(h, key, g, d) for every (slot, head) of query t with a valid key, a non-zero gradient g and
// d = q[t, h] . k[key] > 0 (the terms with a gradient through the ReLU).
template <typename T, typename F>
void active_terms(int64_t t, int64_t Hi, int64_t Di, int64_t topk, const T* q, const T* k, const int32_t* indices,
                  const T* grad, F&& f) {
  for (int64_t r = 0; r < topk; ++r) {
    const int32_t key = indices[t * topk + r];
    const T g = grad[t * topk + r];
    if (key < 0 || g == T(0)) continue;
    for (int64_t h = 0; h < Hi; ++h) {
      const T d = dot(q + (t * Hi + h) * Di, k + key * Di, Di);
      if (d > T(0)) f(h, key, g, d);
    }
  }
}

template <typename T>
void indexer_bwd_impl(int64_t T_, int64_t Hi, int64_t Di, int64_t topk, const T* q, const T* k, const T* w,
                      const int32_t* indices, const T* grad, T* dq, T* dk, T* dw) {
  // dq, dw per query in parallel; dk in one pass in query order (deterministic).
  at::parallel_for(0, T_, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      active_terms(t, Hi, Di, topk, q, k, indices, grad, [&](int64_t h, int32_t key, T g, T d) {
        dw[t * Hi + h] += g * d;
        const T c = g * w[t * Hi + h];
        for (int64_t e = 0; e < Di; ++e) dq[(t * Hi + h) * Di + e] += c * k[key * Di + e];
      });
    }
  });
  for (int64_t t = 0; t < T_; ++t) {
    active_terms(t, Hi, Di, topk, q, k, indices, grad, [&](int64_t h, int32_t key, T g, T) {
      const T c = g * w[t * Hi + h];
      for (int64_t e = 0; e < Di; ++e) dk[key * Di + e] += c * q[(t * Hi + h) * Di + e];
    });
  }
}

template <typename T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// Softmax probabilities of one (query, head) over its selected keys, from the logits; returns lse
// (-inf for no key, every probability 0; NaN, every probability NaN, for a NaN logit; +inf for a
// +inf logit, whose probability is NaN).
template <typename T>
T softmax_row(const AttnProblem& p, const T* qh, const T* kv, const int32_t* idx, int64_t a, T* prob) {
  constexpr T kInf = std::numeric_limits<T>::infinity();
  T mx = -kInf;
  bool nan = false;
  for (int64_t r = 0; r < p.topk; ++r) {
    prob[r] = idx[r] >= 0 ? static_cast<T>(p.scale) * dot(qh, kv + (idx[r] * p.Hkv + a) * p.Dqk, p.Dqk) : -kInf;
    nan = nan || std::isnan(prob[r]);
    mx = std::max(mx, prob[r]);
  }
  if (nan || mx == kInf || mx == -kInf) {
    for (int64_t r = 0; r < p.topk; ++r) prob[r] = nan ? NAN : prob[r] == kInf ? NAN : T(0);
    return nan ? NAN : mx;
  }
  T sum = 0;
  for (int64_t r = 0; r < p.topk; ++r) sum += idx[r] >= 0 ? std::exp(prob[r] - mx) : T(0);
  const T lse = mx + std::log(sum);
  for (int64_t r = 0; r < p.topk; ++r) prob[r] = idx[r] >= 0 ? std::exp(prob[r] - lse) : T(0);
  return lse;
}

template <typename T>
void attn_fwd_impl(const AttnProblem& p, const T* q, const T* kv, const int32_t* indices, const T* gate, T* o, T* lse,
                   T* probs) {
  const int64_t G = p.H / p.Hkv;
  at::parallel_for(0, p.T * p.Hkv, 1, [&](int64_t b0, int64_t b1) {
    std::vector<T> prob(p.topk);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t t = b / p.Hkv, a = b % p.Hkv;
      const int32_t* idx = indices + b * p.topk;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = a * G + g;
        lse[t * p.H + h] = softmax_row(p, q + (t * p.H + h) * p.Dqk, kv, idx, a, prob.data());
        T* oh = o + (t * p.H + h) * p.dv;
        std::fill(oh, oh + p.dv, T(0));
        for (int64_t r = 0; r < p.topk; ++r) {
          if (idx[r] < 0) continue;  // (a probability 0 still meets an inf value: NaN, as in the reference)
          const T* v = kv + (idx[r] * p.Hkv + a) * p.Dqk;
          for (int64_t d = 0; d < p.dv; ++d) oh[d] += prob[r] * v[d];
          if (probs != nullptr) probs[b * p.topk + r] += prob[r];
        }
        if (gate != nullptr) {
          for (int64_t d = 0; d < p.dv; ++d) oh[d] *= sigmoid(gate[(t * p.H + h) * p.dv + d]);
        }
      }
    }
  });
}

// With the gated output o = sigmoid(gate) * attn: delta = sum(d_attn * attn) = sum(do * o) and
// dgate = do * attn * s (1 - s) = do * o * (1 - s).
template <typename T>
void attn_bwd_impl(const AttnProblem& p, const T* dout, const T* q, const T* kv, const int32_t* indices, const T* o,
                   const T* lse, const T* gate, T* dq, T* dkv, T* dgate) {
  const int64_t G = p.H / p.Hkv;
  std::vector<T> prob(p.topk), d_attn(p.dv);
  // One pass in (query, kv head, head, slot) order: dkv accumulates deterministically.
  for (int64_t b = 0; b < p.T * p.Hkv; ++b) {
    const int64_t t = b / p.Hkv, a = b % p.Hkv;
    const int32_t* idx = indices + b * p.topk;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t h = a * G + g, row = t * p.H + h;
      const T* qh = q + row * p.Dqk;
      const T l = lse[row];
      if (l == -std::numeric_limits<T>::infinity()) {  // no key (NaN stays NaN)
        if (dgate != nullptr) std::fill(dgate + row * p.dv, dgate + (row + 1) * p.dv, T(0));
        continue;
      }
      for (int64_t r = 0; r < p.topk; ++r) {
        prob[r] = idx[r] >= 0 ? std::exp(static_cast<T>(p.scale) * dot(qh, kv + (idx[r] * p.Hkv + a) * p.Dqk, p.Dqk) - l)
                              : T(0);
      }
      T delta = 0;
      for (int64_t d = 0; d < p.dv; ++d) {
        const T dd = dout[row * p.dv + d], od = o[row * p.dv + d];
        delta += dd * od;
        if (gate != nullptr) {
          const T sg = sigmoid(gate[row * p.dv + d]);
          dgate[row * p.dv + d] = dd * od * (T(1) - sg);
          d_attn[d] = dd * sg;
        } else {
          d_attn[d] = dd;
        }
      }
      for (int64_t r = 0; r < p.topk; ++r) {
        if (idx[r] < 0) continue;
        const T* kr = kv + (idx[r] * p.Hkv + a) * p.Dqk;
        T* dkr = dkv + (idx[r] * p.Hkv + a) * p.Dqk;
        const T dl = prob[r] * (dot(d_attn.data(), kr, p.dv) - delta) * static_cast<T>(p.scale);
        for (int64_t e = 0; e < p.Dqk; ++e) {
          dq[row * p.Dqk + e] += dl * kr[e];
          dkr[e] += dl * qh[e];
        }
        for (int64_t d = 0; d < p.dv; ++d) dkr[d] += prob[r] * d_attn[d];
      }
    }
  }
}

template <typename F>
void by_acc_type(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kDouble) {
    f(double{});
  } else {
    f(float{});
  }
}

template <typename T>
const T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

void indexer_fwd_cpu(const IndexerProblem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& w,
                     at::Tensor& indices, at::Tensor& scores) {
  by_acc_type(q, [&](auto zero) {
    using T = decltype(zero);
    indexer_fwd_impl<T>(p, q.data_ptr<T>(), k.data_ptr<T>(), w.data_ptr<T>(), indices.data_ptr<int32_t>(),
                        scores.data_ptr<T>());
  });
}

void indexer_bwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w, const at::Tensor& indices,
                     const at::Tensor& grad_scores, at::Tensor& dq, at::Tensor& dk, at::Tensor& dw) {
  by_acc_type(q, [&](auto zero) {
    using T = decltype(zero);
    indexer_bwd_impl<T>(q.size(0), q.size(1), q.size(2), indices.size(1), q.data_ptr<T>(), k.data_ptr<T>(),
                        w.data_ptr<T>(), indices.data_ptr<int32_t>(), grad_scores.data_ptr<T>(), dq.data_ptr<T>(),
                        dk.data_ptr<T>(), dw.data_ptr<T>());
  });
}

void attn_fwd_cpu(const AttnProblem& p, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& indices,
                  const at::Tensor& gate, at::Tensor& o, at::Tensor& lse, at::Tensor& probs) {
  by_acc_type(q, [&](auto zero) {
    using T = decltype(zero);
    attn_fwd_impl<T>(p, q.data_ptr<T>(), kv.data_ptr<T>(), indices.data_ptr<int32_t>(), ptr_or_null<T>(gate),
                     o.data_ptr<T>(), lse.data_ptr<T>(), probs.defined() ? probs.data_ptr<T>() : nullptr);
  });
}

void attn_bwd_cpu(const AttnProblem& p, const at::Tensor& grad_o, const at::Tensor& q, const at::Tensor& kv,
                  const at::Tensor& indices, const at::Tensor& o, const at::Tensor& lse, const at::Tensor& gate,
                  at::Tensor& dq, at::Tensor& dkv, at::Tensor& dgate) {
  by_acc_type(q, [&](auto zero) {
    using T = decltype(zero);
    attn_bwd_impl<T>(p, grad_o.data_ptr<T>(), q.data_ptr<T>(), kv.data_ptr<T>(), indices.data_ptr<int32_t>(),
                     o.data_ptr<T>(), lse.data_ptr<T>(), ptr_or_null<T>(gate), dq.data_ptr<T>(), dkv.data_ptr<T>(),
                     dgate.defined() ? dgate.data_ptr<T>() : nullptr);
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> lightning_indexer_fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& w, const at::Tensor& cu_seqlens_q,
                                                             const at::Tensor& cu_seqlens_k, int64_t topk) {
  const IndexerProblem p = check_indexer_fwd(q, k, w, cu_seqlens_q, cu_seqlens_k, topk);
  const auto acc = accumulation_type(q);
  at::Tensor indices = at::empty({p.T, topk}, q.options().dtype(at::kInt));
  at::Tensor scores = at::empty({p.T, topk}, q.options().dtype(acc));
  indexer_fwd_cpu(p, contiguous_as(q, acc), contiguous_as(k, acc), contiguous_as(w, acc), indices, scores);
  return {indices, scores};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lightning_indexer_bwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                                                         const at::Tensor& w, const at::Tensor& indices,
                                                                         const at::Tensor& grad_scores) {
  const IndexerShapes s = check_indexer_bwd(q, k, w, indices, grad_scores);
  const auto acc = accumulation_type(q);
  at::Tensor dq = at::zeros({s.T, s.Hi, s.Di}, q.options().dtype(acc));
  at::Tensor dk = at::zeros({s.Tk, s.Di}, q.options().dtype(acc));
  at::Tensor dw = at::zeros({s.T, s.Hi}, q.options().dtype(acc));
  indexer_bwd_cpu(contiguous_as(q, acc), contiguous_as(k, acc), contiguous_as(w, acc), indices.contiguous(),
                  contiguous_as(grad_scores, acc), dq, dk, dw);
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dw.to(w.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_attn_fwd_cpu(const at::Tensor& q, const at::Tensor& kv,
                                                                   const at::Tensor& indices, double scale, int64_t dv,
                                                                   const std::optional<at::Tensor>& gate,
                                                                   bool return_p, bool deterministic) {
  const AttnProblem p = check_attn_fwd(q, kv, indices, scale, dv, gate);
  (void)deterministic;  // a flag for the backward (autograd keeps it); the forward always is
  const auto acc = accumulation_type(q);
  at::Tensor o = at::empty({p.T, p.H, dv}, q.options().dtype(acc));
  at::Tensor lse = at::empty({p.T, p.H}, q.options().dtype(acc));
  at::Tensor probs = return_p ? at::zeros({p.T, p.Hkv, p.topk}, q.options().dtype(acc)) : at::Tensor();
  attn_fwd_cpu(p, contiguous_as(q, acc), contiguous_as(kv, acc), indices.contiguous(),
               gate.has_value() ? contiguous_as(*gate, acc) : at::Tensor(), o, lse, probs);
  return {o.to(q.scalar_type()), lse, return_p ? probs : at::empty({0}, q.options().dtype(acc))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_attn_bwd_cpu(const at::Tensor& grad_o, const at::Tensor& q,
                                                                   const at::Tensor& kv, const at::Tensor& indices,
                                                                   const at::Tensor& o, const at::Tensor& lse,
                                                                   double scale, int64_t dv,
                                                                   const std::optional<at::Tensor>& gate,
                                                                   bool deterministic) {
  const AttnProblem p = check_attn_bwd(grad_o, q, kv, indices, o, lse, scale, dv, gate);
  (void)deterministic;  // the CPU kernel accumulates dkv in one fixed order: always deterministic
  const auto acc = accumulation_type(q);
  at::Tensor dq = at::zeros({p.T, p.H, p.Dqk}, q.options().dtype(acc));
  at::Tensor dkv = at::zeros({p.Tk, p.Hkv, p.Dqk}, q.options().dtype(acc));
  at::Tensor dgate = gate.has_value() ? at::empty({p.T, p.H, dv}, q.options().dtype(acc)) : at::Tensor();
  attn_bwd_cpu(p, contiguous_as(grad_o, acc), contiguous_as(q, acc), contiguous_as(kv, acc), indices.contiguous(),
               contiguous_as(o, acc), contiguous_as(lse, acc),
               gate.has_value() ? contiguous_as(*gate, acc) : at::Tensor(), dq, dkv, dgate);
  return {dq.to(q.scalar_type()), dkv.to(kv.scalar_type()),
          gate.has_value() ? dgate.to(gate->scalar_type()) : at::empty({0}, q.options())};
}

}  // namespace kda_dsa_ops::dsa
