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
  return Problem{B, T, H, HV, K, V, N, scale, cu, bf16_products};
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

Problem check_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                  const at::Tensor& beta, double scale, const std::optional<at::Tensor>& initial_state,
                  const std::optional<at::Tensor>& cu_seqlens, bool bf16_products) {
  const Problem p = check_shapes(q, k, v, g, beta, scale, initial_state, cu_seqlens, bf16_products);
  check_values(g, beta);
  return p;
}

Problem check_bwd(const at::Tensor& grad_o, const std::optional<at::Tensor>& grad_final_state, const at::Tensor& q,
                  const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, double scale,
                  const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu_seqlens,
                  bool bf16_products, at::Tensor& dht) {
  const Problem p = check_shapes(q, k, v, g, beta, scale, initial_state, cu_seqlens, bf16_products);
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

}  // namespace kda_dsa_ops::kda
