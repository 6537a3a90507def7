// KDA on the CPU: the chunked algorithm of kda_chunk.h, one task per (sequence, value head),
// chunks in order, the state in host memory; the op entry points for the CPU dispatch key.
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "common/dispatch.h"
#include "kda/kda.h"
#include "kda/kda_chunk.h"

namespace kda_dsa_ops::kda {

namespace {

// Where sequence n lies in the flattened [B*T] tokens.
std::vector<std::pair<int64_t, int64_t>> sequences(const Problem& p) {
  std::vector<std::pair<int64_t, int64_t>> seqs;
  if (p.cu_seqlens.defined()) {
    const int32_t* cu = p.cu_seqlens.data_ptr<int32_t>();
    for (int64_t n = 0; n < p.N; ++n) seqs.emplace_back(cu[n], cu[n + 1] - cu[n]);
  } else {
    for (int64_t n = 0; n < p.N; ++n) seqs.emplace_back(n * p.T, p.T);
  }
  return seqs;
}

// One chunk's working set for one value head, in host memory.
template <typename T>
struct ChunkWork {
  int K, V;
  std::vector<T> q, k, G, Glo, v, beta, A, Aqk, Minv, W, Ut, Qg, Kd, gC, Y;
  ChunkWork(int K_, int V_)
      : K(K_), V(V_), q(kChunk * K), k(kChunk * K), G(kChunk * K), Glo(kChunk * K), v(kChunk * V), beta(kChunk),
        A(kChunk * kChunk), Aqk(kChunk * kChunk), Minv(kChunk * kChunk), W(kChunk * K), Ut(kChunk * V), Qg(kChunk * K),
        Kd(kChunk * K), gC(K), Y(intra_scratch(K_)) {}

  Gates<T> gates() const { return {G.data(), Glo.data()}; }

  // Load steps [t0, t0 + L) of value head hv (query/key head h) and compute the intra-chunk terms;
  // for the forward (mark: V + 1 entries) with finite stand-ins for non-finite inputs.
  void load(const Problem& p, const Inputs& in, int64_t t0, int L, int64_t h, int64_t hv,
            unsigned char* mark = nullptr) {
    const T* qp = in.q.data_ptr<T>();
    const T* kp = in.k.data_ptr<T>();
    const T* vp = in.v.data_ptr<T>();
    const T* gp = in.g.data_ptr<T>();
    const T* bp = in.beta.data_ptr<T>();
    for (int t = 0; t < L; ++t) {
      const int64_t tok = t0 + t;
      std::copy_n(qp + (tok * p.H + h) * K, K, q.data() + t * K);
      std::copy_n(kp + (tok * p.H + h) * K, K, k.data() + t * K);
      std::copy_n(gp + (tok * p.HV + hv) * K, K, G.data() + t * K);
      std::copy_n(vp + (tok * p.HV + hv) * V, V, v.data() + t * V);
      beta[t] = bp[tok * p.HV + hv];
    }
    const SerialTeam tm;
    const ChunkDims d{L, K, V};
    if (mark != nullptr) {
      chunk_mark_nonfinite(tm, d, k.data(), G.data(), v.data(), beta.data(), reinterpret_cast<int*>(Y.data()), mark);
    }
    chunk_cumsum(tm, d, G.data(), Glo.data());
    chunk_intra(tm, d, q.data(), k.data(), gates(), v.data(), beta.data(), A.data(), Aqk.data(), Minv.data(), W.data(),
                Ut.data(), Qg.data(), Kd.data(), gC.data(), Y.data());
  }
};

template <typename T>
void fwd_impl(const Problem& p, const Inputs& in, at::Tensor& o, at::Tensor& final_state) {
  const auto seqs = sequences(p);
  const int K = static_cast<int>(p.K), V = static_cast<int>(p.V);
  const int64_t group = p.HV / p.H;
  T* op = o.data_ptr<T>();
  at::parallel_for(0, p.N * p.HV, 1, [&](int64_t begin, int64_t end) {
    ChunkWork<T> w(K, V);
    std::vector<T> S(K * V), U(kChunk * V);
    std::vector<unsigned char> mark(V + 1);
    const SerialTeam tm;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / p.HV, hv = task % p.HV;
      const auto [bos, len] = seqs[n];
      if (in.initial_state.defined()) {
        std::copy_n(in.initial_state.data_ptr<T>() + task * K * V, K * V, S.data());
      } else {
        std::fill(S.begin(), S.end(), T(0));
      }
      for (int64_t t0 = 0; t0 < len; t0 += kChunk) {
        const int L = static_cast<int>(std::min<int64_t>(kChunk, len - t0));
        w.load(p, in, bos + t0, L, hv / group, hv, mark.data());
        chunk_state_fwd(tm, ChunkDims{L, K, V}, static_cast<T>(p.scale), w.W.data(), w.Ut.data(), V, w.Qg.data(),
                        w.Kd.data(), w.Aqk.data(), w.gC.data(), S.data(), V, U.data(),
                        op + ((bos + t0) * p.HV + hv) * V, static_cast<int>(p.HV * V),
                        mark[V] < L ? mark.data() : nullptr);
      }
      if (final_state.defined()) std::copy_n(S.data(), K * V, final_state.data_ptr<T>() + task * K * V);
    }
  });
}

template <typename T>
void bwd_impl(const Problem& p, const Inputs& in, const at::Tensor& grad_o, const at::Tensor& grad_final_state,
              Grads& gr) {
  const auto seqs = sequences(p);
  const int K = static_cast<int>(p.K), V = static_cast<int>(p.V);
  const int64_t group = p.HV / p.H;
  const T scale = static_cast<T>(p.scale);
  at::parallel_for(0, p.N * p.HV, 1, [&](int64_t begin, int64_t end) {
    ChunkWork<T> w(K, V);
    std::vector<T> S(K * V), dS(K * V), U(kChunk * V), dU(kChunk * V), dW(kChunk * K), ZW(kChunk * K),
        ZU(kChunk * V), dAqk(kChunk * kChunk), dA(kChunk * kChunk), last(K), kE(kChunk * K), qE(kChunk * K),
        Y(2 * kSub * K), dq(kChunk * K), dk(kChunk * K), dg(kChunk * K), dv(kChunk * V), dbeta(kChunk),
        dO(kChunk * V);
    const ChunkBwdScratch<T> sc{U.data(),   dU.data(),  dW.data(), ZW.data(), ZU.data(), dAqk.data(),
                                dA.data(),  last.data(), kE.data(), qE.data(), Y.data()};
    std::vector<T> starts;  // the start state of every chunk, recomputed
    const SerialTeam tm;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / p.HV, hv = task % p.HV, h = hv / group;
      const auto [bos, len] = seqs[n];
      const int64_t chunks = (len + kChunk - 1) / kChunk;
      starts.resize(static_cast<size_t>(chunks) * K * V);
      if (in.initial_state.defined()) {
        std::copy_n(in.initial_state.data_ptr<T>() + task * K * V, K * V, S.data());
      } else {
        std::fill(S.begin(), S.end(), T(0));
      }
      for (int64_t c = 0; c < chunks; ++c) {
        const int L = static_cast<int>(std::min<int64_t>(kChunk, len - c * kChunk));
        w.load(p, in, bos + c * kChunk, L, h, hv);
        std::copy_n(S.data(), K * V, starts.data() + c * K * V);
        chunk_state_fwd(tm, ChunkDims{L, K, V}, scale, w.W.data(), w.Ut.data(), V, w.Qg.data(), w.Kd.data(),
                        w.Aqk.data(), w.gC.data(), S.data(), V, U.data(), static_cast<T*>(nullptr), V);
      }
      if (grad_final_state.defined()) {
        std::copy_n(grad_final_state.data_ptr<T>() + task * K * V, K * V, dS.data());
      } else {
        std::fill(dS.begin(), dS.end(), T(0));
      }
      for (int64_t c = chunks - 1; c >= 0; --c) {
        const int L = static_cast<int>(std::min<int64_t>(kChunk, len - c * kChunk));
        const int64_t t0 = bos + c * kChunk;
        w.load(p, in, t0, L, h, hv);
        for (int t = 0; t < L; ++t) {
          std::copy_n(grad_o.data_ptr<T>() + ((t0 + t) * p.HV + hv) * V, V, dO.data() + t * V);
        }
        const ChunkDims d{L, K, V};
        chunk_bwd(tm, d, scale, w.q.data(), w.k.data(), w.gates(), w.v.data(), w.beta.data(), w.A.data(),
                  w.Aqk.data(), w.Minv.data(), w.W.data(), w.Ut.data(), w.Qg.data(), w.Kd.data(), w.gC.data(),
                  starts.data() + c * K * V, dS.data(), dO.data(), V, sc, dq.data(), dk.data(), dg.data(), dv.data(),
                  V, dbeta.data());
        chunk_state_bwd(tm, d, scale, w.W.data(), w.Qg.data(), w.Kd.data(), w.Aqk.data(), w.gC.data(), dO.data(), V,
                        dS.data(), V, dU.data());
        for (int t = 0; t < L; ++t) {
          const int64_t row = (t0 + t) * p.HV + hv;
          std::copy_n(dq.data() + t * K, K, gr.dq.data_ptr<T>() + row * K);
          std::copy_n(dk.data() + t * K, K, gr.dk.data_ptr<T>() + row * K);
          std::copy_n(dg.data() + t * K, K, gr.dg.data_ptr<T>() + row * K);
          std::copy_n(dv.data() + t * V, V, gr.dv.data_ptr<T>() + row * V);
          gr.dbeta.data_ptr<T>()[row] = dbeta[t];
        }
      }
      std::copy_n(dS.data(), K * V, gr.dinitial_state.data_ptr<T>() + task * K * V);
    }
  });
}

void fwd_kernel(const Problem& p, const Inputs& in, at::Tensor& o, at::Tensor& final_state) {
  if (o.scalar_type() == at::kDouble) {
    fwd_impl<double>(p, in, o, final_state);
  } else {
    fwd_impl<float>(p, in, o, final_state);
  }
}

void bwd_kernel(const Problem& p, const Inputs& in, const at::Tensor& grad_o, const at::Tensor& grad_final_state,
             Grads& grads) {
  if (grads.dq.scalar_type() == at::kDouble) {
    bwd_impl<double>(p, in, grad_o, grad_final_state, grads);
  } else {
    bwd_impl<float>(p, in, grad_o, grad_final_state, grads);
  }
}

constexpr double kL2NormEps = 1e-6;  // x / sqrt(sum(x^2) + eps), as reference/kda.py

// x in the accumulation type, divided by its norm per row when l2norm (rinv: 1 / norm).
at::Tensor normalised(const at::Tensor& x, bool l2norm, at::Tensor* rinv) {
  const at::Tensor xa = x.to(accumulation_type(x));
  if (!l2norm) return xa.contiguous();
  *rinv = at::rsqrt((xa * xa).sum(-1, true) + kL2NormEps);
  return (xa * *rinv).contiguous();
}

// Gradient w.r.t. the raw q (or k) from the per-value-head gradients w.r.t. the normalised one.
at::Tensor input_grad(const at::Tensor& d_per_vhead, const Problem& p, const at::Tensor& normed,
                      const at::Tensor& rinv, bool use_qk_l2norm, at::ScalarType dtype) {
  at::Tensor d = d_per_vhead.view({p.B, p.T, p.H, p.HV / p.H, p.K}).sum(3);
  if (use_qk_l2norm) d = (d - normed * (normed * d).sum(-1, true)) * rinv;
  return d.to(dtype);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> kda_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const at::Tensor& g, const at::Tensor& beta, double scale,
                                               const std::optional<at::Tensor>& initial_state,
                                               const std::optional<at::Tensor>& cu_seqlens, bool output_final_state,
                                               bool use_qk_l2norm, bool bf16_products,
                                               const std::optional<at::Tensor>& A_log,
                                               const std::optional<at::Tensor>& dt_bias, double lower_bound,
                                               double beta_scale) {
  const Problem p = check_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, bf16_products,
                              GateArgs{A_log, dt_bias, lower_bound, beta_scale});
  at::Tensor final_state = final_state_for(p, q, output_final_state);
  at::Tensor ht = output_final_state ? final_state : at::Tensor(), rinv_q, rinv_k;
  const auto [decay, b] = gated_inputs(p, g, beta, accumulation_type(q));
  const Inputs in = accumulation_inputs(normalised(q, use_qk_l2norm, &rinv_q), normalised(k, use_qk_l2norm, &rinv_k),
                                        v, decay, b, initial_state);
  at::Tensor o = at::empty({p.B, p.T, p.HV, p.V}, in.q.options());
  fwd_kernel(p, in, o, ht);
  return {o.to(q.scalar_type()), final_state};
}

BwdResult kda_bwd_cpu(const at::Tensor& grad_o, const std::optional<at::Tensor>& grad_final_state, const at::Tensor& q,
                      const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                      double scale, const std::optional<at::Tensor>& initial_state,
                      const std::optional<at::Tensor>& cu_seqlens, bool use_qk_l2norm, bool bf16_products,
                      const std::optional<at::Tensor>& A_log, const std::optional<at::Tensor>& dt_bias,
                      double lower_bound, double beta_scale) {
  at::Tensor dht, rinv_q, rinv_k;
  const Problem p = check_bwd(grad_o, grad_final_state, q, k, v, g, beta, scale, initial_state, cu_seqlens,
                              bf16_products, GateArgs{A_log, dt_bias, lower_bound, beta_scale}, dht);
  const auto [decay, b] = gated_inputs(p, g, beta, accumulation_type(q));
  const Inputs in = accumulation_inputs(normalised(q, use_qk_l2norm, &rinv_q), normalised(k, use_qk_l2norm, &rinv_k),
                                        v, decay, b, initial_state);
  const auto opts = in.q.options();
  Grads gr;
  gr.dinitial_state = at::empty({p.N, p.HV, p.K, p.V}, opts);
  gr.dv = at::empty({p.B, p.T, p.HV, p.V}, opts);
  gr.dq = at::empty({p.B, p.T, p.HV, p.K}, opts);
  gr.dk = at::empty({p.B, p.T, p.HV, p.K}, opts);
  gr.dg = at::empty({p.B, p.T, p.HV, p.K}, opts);
  gr.dbeta = at::empty({p.B, p.T, p.HV}, opts);
  bwd_kernel(p, in, grad_o.to(opts.dtype()).contiguous(), dht, gr);
  gate_grads(p, g, beta, gr);
  gr.dq = input_grad(gr.dq, p, in.q, rinv_q, use_qk_l2norm, q.scalar_type());
  gr.dk = input_grad(gr.dk, p, in.k, rinv_k, use_qk_l2norm, k.scalar_type());
  gr.dv = gr.dv.to(v.scalar_type());
  gr.dg = gr.dg.to(g.scalar_type());
  gr.dbeta = gr.dbeta.to(beta.scalar_type());
  return bwd_result(p, gr, initial_state.has_value(), opts);
}

}  // namespace kda_dsa_ops::kda
