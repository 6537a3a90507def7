// KDA op entry points, shared by the CPU and CUDA backends: argument checks, the inputs in the
// accumulation type (with the q/k L2 normalisation and its gradient), casts of the results.
#include "kda/kda.h"

#include <cmath>

#include "common/checks.h"
#include "common/dispatch.h"

namespace kda_dsa_ops::kda {

namespace {

constexpr double kL2NormEps = 1e-6;  // x / sqrt(sum(x^2) + eps), as reference/kda.py

Problem check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                     const at::Tensor& beta, double scale, const std::optional<at::Tensor>& initial_state,
                     const std::optional<at::Tensor>& cu_seqlens, bool bf16_products) {
  check_dim(q, 4, "q", "[B, T, H, K]");
  check_dim(k, 4, "k", "[B, T, H, K]");
  check_dim(v, 4, "v", "[B, T, HV, V]");
  check_dim(g, 4, "g", "[B, T, HV, K]");
  check_dim(beta, 3, "beta", "[B, T, HV]");
  check_dtype(q, {at::kBFloat16, at::kHalf, at::kFloat, at::kDouble}, "q");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "kda: q, k and v must share one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
              v.scalar_type());
  TORCH_CHECK(g.scalar_type() == at::kFloat || g.scalar_type() == q.scalar_type(),
              "kda: g must be float32 or the dtype of q (", q.scalar_type(), "), got ", g.scalar_type());
  TORCH_CHECK(beta.scalar_type() == at::kFloat || beta.scalar_type() == q.scalar_type(),
              "kda: beta must be float32 or the dtype of q (", q.scalar_type(), "), got ", beta.scalar_type());
  for (const auto* t : {&k, &v, &g, &beta}) check_same_device(*t, q, "kda: every input", "q");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3);
  const int64_t HV = v.size(2), V = v.size(3);
  TORCH_CHECK(k.sizes() == q.sizes(), "kda: k must have the shape of q ", shape_str(q), ", got ", shape_str(k));
  TORCH_CHECK(v.size(0) == B && v.size(1) == T, "kda: v must be [B, T, HV, V] with B, T of q ", shape_str(q),
              ", got ", shape_str(v));
  TORCH_CHECK(H > 0 && HV % H == 0, "kda: value heads HV (", HV, ") must be a positive multiple of the query/key heads H (",
              H, ")");
  TORCH_CHECK(K >= 1 && K <= kMaxHeadDim && V >= 1 && V <= kMaxHeadDim, "kda: head dims K (", K, ") and V (", V,
              ") must lie in [1, ", kMaxHeadDim, "]");
  TORCH_CHECK(g.sizes() == at::IntArrayRef({B, T, HV, K}), "kda: g must be [B, T, HV, K] = [", B, ", ", T, ", ", HV,
              ", ", K, "], got ", shape_str(g));
  TORCH_CHECK(beta.sizes() == at::IntArrayRef({B, T, HV}), "kda: beta must be [B, T, HV] = [", B, ", ", T, ", ", HV,
              "], got ", shape_str(beta));
  TORCH_CHECK(std::isfinite(scale), "kda: scale must be finite, got ", scale);
  int64_t N = B;
  at::Tensor cu;
  if (cu_seqlens.has_value()) {
    TORCH_CHECK(B == 1, "kda: cu_seqlens needs packed input with B == 1, got B = ", B);
    cu = cu_seqlens->contiguous();
    N = check_cu_seqlens(cu, T, q, "kda", "cu_seqlens", "T");
  }
  if (initial_state.has_value()) {
    const at::Tensor& h0 = *initial_state;
    check_same_device(h0, q, "initial_state", "q");
    TORCH_CHECK(h0.scalar_type() == accumulation_type(q), "kda: initial_state must be ",
                accumulation_type(q) == at::kDouble ? "float64" : "float32", " (the state's dtype), got ", h0.scalar_type());
    TORCH_CHECK(h0.sizes() == at::IntArrayRef({N, HV, K, V}), "kda: initial_state must be [N, HV, K, V] = [", N, ", ",
                HV, ", ", K, ", ", V, "] (N = number of sequences), got ", shape_str(h0));
  }
  return Problem{B, T, H, HV, K, V, N, scale, cu, bf16_products};
}

// The backends' inputs; rinv_q / rinv_k receive 1/||x|| when normalising (for the backward).
Inputs prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
               const at::Tensor& beta, const std::optional<at::Tensor>& initial_state, bool use_qk_l2norm,
               at::Tensor* rinv_q = nullptr, at::Tensor* rinv_k = nullptr) {
  const auto acc = accumulation_type(q);
  auto norm = [&](const at::Tensor& x, at::Tensor* rinv) {
#ifdef KDA_DSA_OPS_WITH_CUDA
    if (x.is_cuda()) return l2norm_rows_cuda(x, use_qk_l2norm);
#endif
    at::Tensor xa = x.to(acc);
    if (!use_qk_l2norm) return xa.contiguous();
    at::Tensor r = at::rsqrt((xa * xa).sum(-1, true) + kL2NormEps);
    if (rinv != nullptr) *rinv = r;
    return (xa * r).contiguous();
  };
  Inputs in;
  in.q = norm(q, rinv_q);
  in.k = norm(k, rinv_k);
  in.v = v.to(acc).contiguous();
  in.g = g.to(acc).contiguous();
  in.beta = beta.to(acc).contiguous();
  if (initial_state.has_value()) in.initial_state = initial_state->contiguous();
  return in;
}

#ifdef KDA_DSA_OPS_WITH_CUDA
// The inputs as the bf16 kernels take them: contiguous, with 16-byte aligned rows for their bulk
// copies (a view may start anywhere).
Inputs raw_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                  const at::Tensor& beta, const std::optional<at::Tensor>& initial_state) {
  const auto aligned = [](const at::Tensor& x) {
    at::Tensor c = x.contiguous();
    return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
  };
  return Inputs{aligned(q), aligned(k), aligned(v), aligned(g), beta.contiguous(),
                initial_state.has_value() ? initial_state->contiguous() : at::Tensor()};
}
#endif

// Gradient w.r.t. the raw q (or k) from the per-value-head gradients w.r.t. the normalised one.
at::Tensor input_grad(const at::Tensor& d_per_vhead, const Problem& p, const at::Tensor& normed,
                      const at::Tensor& rinv, bool use_qk_l2norm, at::ScalarType dtype) {
  at::Tensor d = d_per_vhead.view({p.B, p.T, p.H, p.HV / p.H, p.K}).sum(3);
  if (use_qk_l2norm) d = (d - normed * (normed * d).sum(-1, true)) * rinv;
  return d.to(dtype);
}

// The contract's values (a value check): g <= 0 (-inf allowed) and beta in [0, 2]. NaN passes (its
// rule is the forward's, see kda_chunk.h).
void check_values(const at::Tensor& g, const at::Tensor& beta) {
  if (!run_value_checks(g)) return;
  const at::Tensor g_over = g > 0, b_out = (beta < 0).logical_or(beta > 2);
  TORCH_CHECK(!g_over.any().item<bool>(), "kda: g is a log-decay and must be <= 0 (-inf allowed), got ",
              g_over.sum().item<int64_t>(), " values above 0, up to ", g.masked_select(g_over).max().item<double>());
  TORCH_CHECK(!b_out.any().item<bool>(), "kda: beta must lie in [0, 2], got ", b_out.sum().item<int64_t>(),
              " values outside, in [", beta.masked_select(b_out).min().item<double>(), ", ",
              beta.masked_select(b_out).max().item<double>(), "]");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> kda_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& g, const at::Tensor& beta, double scale,
                                           const std::optional<at::Tensor>& initial_state,
                                           const std::optional<at::Tensor>& cu_seqlens, bool output_final_state,
                                           bool use_qk_l2norm, bool bf16_products) {
  const Problem p = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, bf16_products);
  check_values(g, beta);
  const auto acc = accumulation_type(q);
  at::Tensor final_state =
      output_final_state ? at::empty({p.N, p.HV, p.K, p.V}, q.options().dtype(acc)) : at::empty({0}, q.options().dtype(acc));
  at::Tensor ht = output_final_state ? final_state : at::Tensor();
#ifdef KDA_DSA_OPS_WITH_CUDA
  if (bf16_fwd_supported(p, q)) {
    const Inputs raw = raw_inputs(q, k, v, g, beta, initial_state);
    at::Tensor o = at::empty({p.B, p.T, p.HV, p.V}, q.options());
    fwd_cuda_bf16(p, raw, use_qk_l2norm, o, ht);
    return {o, final_state};
  }
#endif
  const Inputs in = prepare(q, k, v, g, beta, initial_state, use_qk_l2norm);
  at::Tensor o = at::empty({p.B, p.T, p.HV, p.V}, q.options().dtype(acc));
#ifdef KDA_DSA_OPS_WITH_CUDA
  (q.is_cuda() ? fwd_cuda : fwd_cpu)(p, in, o, ht);
#else
  fwd_cpu(p, in, o, ht);
#endif
  return {o.to(q.scalar_type()), final_state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> kda_bwd(
    const at::Tensor& grad_o, const std::optional<at::Tensor>& grad_final_state, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, double scale,
    const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu_seqlens, bool use_qk_l2norm,
    bool bf16_products) {
  const Problem p = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, bf16_products);
  TORCH_CHECK(grad_o.sizes() == v.sizes(), "kda_bwd: grad_o must have the shape of o ", shape_str(v), ", got ",
              shape_str(grad_o));
  check_same_device(grad_o, q, "grad_o", "q");
  const auto acc = accumulation_type(q);
  at::Tensor dht;
  if (grad_final_state.has_value() && grad_final_state->numel() > 0) {
    TORCH_CHECK(grad_final_state->sizes() == at::IntArrayRef({p.N, p.HV, p.K, p.V}),
                "kda_bwd: grad_final_state must be [N, HV, K, V] = [", p.N, ", ", p.HV, ", ", p.K, ", ", p.V,
                "], got ", shape_str(*grad_final_state));
    check_same_device(*grad_final_state, q, "grad_final_state", "q");
    dht = grad_final_state->to(acc).contiguous();
  }
  const auto opts = q.options().dtype(acc);
  Grads gr;
  gr.dinitial_state = at::empty({p.N, p.HV, p.K, p.V}, opts);
  at::Tensor dh0 = initial_state.has_value() ? gr.dinitial_state : at::empty({0}, opts);
#ifdef KDA_DSA_OPS_WITH_CUDA
  if (q.is_cuda()) {
    gr.dq = at::empty(q.sizes(), q.options());
    gr.dk = at::empty(k.sizes(), k.options());
    gr.dg = at::empty(g.sizes(), g.options());
    gr.dbeta = at::empty(beta.sizes(), beta.options());
    if (bf16_fwd_supported(p, q)) {
      // scale dO in bf16, rounded once from the product
      const at::Tensor dOs =
          (grad_o.scalar_type() == at::kBFloat16 ? grad_o * p.scale : grad_o.to(at::kFloat) * p.scale)
              .to(at::kBFloat16)
              .contiguous();
      gr.dv = at::empty(v.sizes(), v.options());
      bwd_cuda_bf16(p, raw_inputs(q, k, v, g, beta, initial_state), use_qk_l2norm, dOs, dht, gr);
      return {gr.dq, gr.dk, gr.dv, gr.dg, gr.dbeta, dh0};
    }
    const Inputs in = prepare(q, k, v, g, beta, initial_state, use_qk_l2norm);
    gr.dv = at::empty({p.B, p.T, p.HV, p.V}, opts);
    bwd_cuda(p, in, q.contiguous(), k.contiguous(), use_qk_l2norm, grad_o.to(acc).contiguous(), dht, gr);
    return {gr.dq, gr.dk, gr.dv.to(v.scalar_type()), gr.dg, gr.dbeta, dh0};
  }
#endif
  at::Tensor rinv_q, rinv_k;
  const Inputs in = prepare(q, k, v, g, beta, initial_state, use_qk_l2norm, &rinv_q, &rinv_k);
  const at::Tensor dO = grad_o.to(acc).contiguous();
  gr.dv = at::empty({p.B, p.T, p.HV, p.V}, opts);
  gr.dq = at::empty({p.B, p.T, p.HV, p.K}, opts);
  gr.dk = at::empty({p.B, p.T, p.HV, p.K}, opts);
  gr.dg = at::empty({p.B, p.T, p.HV, p.K}, opts);
  gr.dbeta = at::empty({p.B, p.T, p.HV}, opts);
  bwd_cpu(p, in, dO, dht, gr);
  return {input_grad(gr.dq, p, in.q, rinv_q, use_qk_l2norm, q.scalar_type()),
          input_grad(gr.dk, p, in.k, rinv_k, use_qk_l2norm, k.scalar_type()),
          gr.dv.to(v.scalar_type()),
          gr.dg.to(g.scalar_type()),
          gr.dbeta.to(beta.scalar_type()),
          dh0};
}

}  // namespace kda_dsa_ops::kda
