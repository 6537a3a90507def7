// The KDA ops' argument checks, shared by the CPU and CUDA entry points (kda_cpu.cpp,
// kda_cuda.cu): shapes, dtypes, devices, cu_seqlens and the contract's values; the inputs in the
// accumulation type for the kernels that take them so.
#include <cmath>

#include "common/checks.h"
#include "common/dispatch.h"
#include "kda/kda.h"

namespace kda_dsa_ops::kda {

namespace {

Problem check_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
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
  return Problem{B, T, H, HV, K, V, N, scale, cu, bf16_products, Gate{}};
}

// The in-kernel gate's arguments: A_log [HV] (any shape of HV values), dt_bias HV * K values (needs
// A_log), lower_bound 0 (the softplus gate) or finite and < 0 (needs A_log), beta_scale 0, 1 or 2.
Gate check_gate(const Problem& p, const at::Tensor& q, const GateArgs& a) {
  TORCH_CHECK(a.beta_scale == 0 || a.beta_scale == 1 || a.beta_scale == 2,
              "kda: beta_scale must be 0 (beta as given), 1 (sigmoid) or 2 (2 sigmoid), got ", a.beta_scale);
  Gate gate;
  gate.beta_scale = a.beta_scale;
  TORCH_CHECK(a.A_log.has_value() || (!a.dt_bias.has_value() && a.lower_bound == 0),
              "kda: dt_bias and lower_bound belong to the in-kernel gate, which A_log turns on");
  if (!a.A_log.has_value()) return gate;
  TORCH_CHECK(std::isfinite(a.lower_bound) && a.lower_bound <= 0,
              "kda: lower_bound must be 0 (the softplus gate) or a finite number < 0, got ", a.lower_bound);
  const auto acc = accumulation_type(q);
  const auto take = [&](const at::Tensor& t, int64_t n, const char* name) {
    check_same_device(t, q, name, "q");
    TORCH_CHECK(at::isFloatingType(t.scalar_type()), "kda: ", name, " must be a floating-point tensor, got ",
                t.scalar_type());
    TORCH_CHECK(t.numel() == n, "kda: ", name, " must hold ", n, " values, got shape ", shape_str(t));
    return t.to(acc).contiguous().view({n});
  };
  gate.A_log = take(*a.A_log, p.HV, "A_log (one value per value head)");
  if (a.dt_bias.has_value()) gate.dt_bias = take(*a.dt_bias, p.HV * p.K, "dt_bias (HV * K values)");
  gate.lower_bound = a.lower_bound;
  return gate;
}

// The contract's values (a value check): g <= 0 (-inf allowed) and beta in [0, 2] where they are
// given as such (the in-kernel gate and beta map any raw value into the contract). NaN passes
// (its rule is the forward's, see kda_chunk.h).
void check_values(const at::Tensor& g, const at::Tensor& beta, const Gate& gate) {
  if (!run_value_checks(g)) return;
  if (!gate.on()) {
    const at::Tensor g_over = g > 0;
    TORCH_CHECK(!g_over.any().item<bool>(), "kda: g is a log-decay and must be <= 0 (-inf allowed), got ",
                g_over.sum().item<int64_t>(), " values above 0, up to ", g.masked_select(g_over).max().item<double>());
  }
  if (gate.beta_scale == 0) {
    const at::Tensor b_out = (beta < 0).logical_or(beta > 2);
    TORCH_CHECK(!b_out.any().item<bool>(), "kda: beta must lie in [0, 2], got ", b_out.sum().item<int64_t>(),
                " values outside, in [", beta.masked_select(b_out).min().item<double>(), ", ",
                beta.masked_select(b_out).max().item<double>(), "]");
  }
}

// softplus(x), x itself above 20 (fla's threshold).
at::Tensor softplus20(const at::Tensor& x) { return at::where(x > 20, x, at::log1p(at::exp(at::clamp_max(x, 20)))); }

// The in-kernel gate's x = g + dt_bias [B,T,HV,K] and a = exp(A_log) [HV, 1], in its accumulation type.
std::pair<at::Tensor, at::Tensor> gate_x_a(const Problem& p, const at::Tensor& g) {
  const Gate& gate = p.gate;
  const at::Tensor x = g.to(gate.A_log.scalar_type());
  return {gate.dt_bias.defined() ? x + gate.dt_bias.view({p.HV, p.K}) : x, gate.A_log.exp().view({p.HV, 1})};
}

}  // namespace

Problem check_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                  const at::Tensor& beta, double scale, const std::optional<at::Tensor>& initial_state,
                  const std::optional<at::Tensor>& cu_seqlens, bool bf16_products, const GateArgs& gate) {
  Problem p = check_shapes(q, k, v, g, beta, scale, initial_state, cu_seqlens, bf16_products);
  p.gate = check_gate(p, q, gate);
  check_values(g, beta, p.gate);
  return p;
}

Problem check_bwd(const at::Tensor& grad_o, const std::optional<at::Tensor>& grad_final_state, const at::Tensor& q,
                  const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, double scale,
                  const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu_seqlens,
                  bool bf16_products, const GateArgs& gate, at::Tensor& dht) {
  Problem p = check_shapes(q, k, v, g, beta, scale, initial_state, cu_seqlens, bf16_products);
  p.gate = check_gate(p, q, gate);
  TORCH_CHECK(grad_o.sizes() == v.sizes(), "kda_bwd: grad_o must have the shape of o ", shape_str(v), ", got ",
              shape_str(grad_o));
  check_same_device(grad_o, q, "grad_o", "q");
  if (grad_final_state.has_value() && grad_final_state->numel() > 0) {
    TORCH_CHECK(grad_final_state->sizes() == at::IntArrayRef({p.N, p.HV, p.K, p.V}),
                "kda_bwd: grad_final_state must be [N, HV, K, V] = [", p.N, ", ", p.HV, ", ", p.K, ", ", p.V,
                "], got ", shape_str(*grad_final_state));
    check_same_device(*grad_final_state, q, "grad_final_state", "q");
    dht = grad_final_state->to(accumulation_type(q)).contiguous();
  }
  return p;
}

at::Tensor final_state_for(const Problem& p, const at::Tensor& q, bool output_final_state) {
  const auto opts = q.options().dtype(accumulation_type(q));
  return output_final_state ? at::empty({p.N, p.HV, p.K, p.V}, opts) : at::empty({0}, opts);
}

Inputs accumulation_inputs(const at::Tensor& qn, const at::Tensor& kn, const at::Tensor& v, const at::Tensor& g,
                           const at::Tensor& beta, const std::optional<at::Tensor>& initial_state) {
  const auto acc = qn.scalar_type();
  return Inputs{qn, kn, v.to(acc).contiguous(), g.to(acc).contiguous(), beta.to(acc).contiguous(),
                initial_state.has_value() ? initial_state->contiguous() : at::Tensor()};
}

std::pair<at::Tensor, at::Tensor> gated_inputs(const Problem& p, const at::Tensor& g, const at::Tensor& beta,
                                               at::ScalarType acc) {
  const Gate& gate = p.gate;
  at::Tensor decay = g, b = beta;
  if (gate.on()) {
    const auto [x, a] = gate_x_a(p, g);
    decay = gate.lower_bound == 0 ? -a * softplus20(x) : gate.lower_bound * at::sigmoid(a * x);
  }
  if (gate.beta_scale != 0) b = gate.beta_scale * at::sigmoid(beta.to(acc));
  return {decay, b};
}

void gate_grads(const Problem& p, const at::Tensor& g, const at::Tensor& beta, Grads& gr) {
  const Gate& gate = p.gate;
  if (gate.beta_scale != 0) {
    const at::Tensor s = at::sigmoid(beta.to(gr.dbeta.scalar_type()));
    gr.dbeta = gr.dbeta * (gate.beta_scale * s * (1 - s));
  }
  if (!gate.on()) return;
  const auto [x, a] = gate_x_a(p, g);
  const at::Tensor d = gr.dg.to(x.scalar_type());
  at::Tensor dx, da;  // per element: the gradients w.r.t. x and A_log
  if (gate.lower_bound == 0) {  // d/dx -a softplus(x) = -a sigmoid(x) (-a above 20); d/dA_log = the decay
    dx = d * -a * at::where(x > 20, at::ones_like(x), at::sigmoid(x));
    da = d * -a * softplus20(x);
  } else {  // d/dx lb sigmoid(a x) = lb a s (1 - s); d/dA_log = x d/dx
    const at::Tensor s = at::sigmoid(a * x);
    dx = d * (gate.lower_bound * a * s * (1 - s));
    da = dx * x;
  }
  gr.dg = dx;
  gr.dA_log = da.sum(at::IntArrayRef{0, 1, 3});
  gr.ddt_bias = dx.sum(at::IntArrayRef{0, 1}).reshape({p.HV * p.K});
}

BwdResult bwd_result(const Problem& p, const Grads& gr, bool has_initial_state, const at::TensorOptions& acc) {
  const auto none = [&] { return at::empty({0}, acc); };
  return {gr.dq,
          gr.dk,
          gr.dv,
          gr.dg,
          gr.dbeta,
          has_initial_state ? gr.dinitial_state : none(),
          p.gate.on() ? gr.dA_log : none(),
          p.gate.dt_bias.defined() ? gr.ddt_bias : none()};
}

}  // namespace kda_dsa_ops::kda
