// The hyper-connection ops' argument checks, shared by the CPU and CUDA entry points.
#include "hc/hc.h"

#include "common/checks.h"

namespace kda_dsa_ops::hc {

namespace {
constexpr auto kFloating = {at::kBFloat16, at::kHalf, at::kFloat, at::kDouble};
}  // namespace

MixProblem check_mix(const at::Tensor& x, const at::Tensor& a, const std::optional<at::Tensor>& z,
                     const std::optional<at::Tensor>& b, const char* op) {
  check_dim(x, 3, "x", "[T, n, D] (n streams of D channels per token)");
  check_dim(a, 3, "a", "[T, m, n] (each token's mixing matrix)");
  check_dtype(x, kFloating, "x");
  check_dtype(a, kFloating, "a");
  check_same_device(a, x, "a", "x");
  const MixProblem p{x.size(0), x.size(1), a.size(1), x.size(2), z.has_value()};
  TORCH_CHECK(p.n >= 1 && p.n <= kMaxStreams, op, ": x must have 1 to ", kMaxStreams, " streams, got ", p.n);
  TORCH_CHECK(p.m >= 1 && p.m <= kMaxStreams, op, ": a must give 1 to ", kMaxStreams, " streams, got ", p.m);
  TORCH_CHECK(a.size(0) == p.T && a.size(2) == p.n, op, ": a must be [T, m, n] with T = ", p.T, ", n = ", p.n,
              " (x's), got ", shape_str(a));
  TORCH_CHECK(z.has_value() == b.has_value(), op, ": z and b come together (y += b[..., None] * z[:, None]), got ",
              z.has_value() ? "z without b" : "b without z");
  if (p.add) {
    check_dim(*z, 2, "z", "[T, D]");
    check_dim(*b, 2, "b", "[T, m]");
    check_same_device(*z, x, "z", "x");
    check_same_device(*b, x, "b", "x");
    TORCH_CHECK(z->scalar_type() == x.scalar_type(), op, ": z must have the dtype of x (", x.scalar_type(), "), got ",
                z->scalar_type());
    TORCH_CHECK(b->scalar_type() == a.scalar_type(), op, ": b must have the dtype of a (", a.scalar_type(), "), got ",
                b->scalar_type());
    TORCH_CHECK(z->size(0) == p.T && z->size(1) == p.D, op, ": z must be [T, D] = [", p.T, ", ", p.D, "], got ",
                shape_str(*z));
    TORCH_CHECK(b->size(0) == p.T && b->size(1) == p.m, op, ": b must be [T, m] = [", p.T, ", ", p.m, "], got ",
                shape_str(*b));
  }
  return p;
}

MixProblem check_mix_bwd(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& a,
                         const std::optional<at::Tensor>& z, const std::optional<at::Tensor>& b) {
  constexpr const char* op = "hc_mix_bwd";
  const MixProblem p = check_mix(x, a, z, b, op);
  check_same_device(grad_y, x, "grad_y", "x");
  TORCH_CHECK(grad_y.sizes() == at::IntArrayRef({p.T, p.m, p.D}), op, ": grad_y must be [T, m, D] = [", p.T, ", ", p.m,
              ", ", p.D, "], got ", shape_str(grad_y));
  TORCH_CHECK(grad_y.scalar_type() == x.scalar_type(), op, ": grad_y must have the dtype of x (", x.scalar_type(),
              "), got ", grad_y.scalar_type());
  return p;
}

MixInputs mix_inputs(const MixProblem& p, const at::Tensor& x, const at::Tensor& a, const std::optional<at::Tensor>& z,
                     const std::optional<at::Tensor>& b, at::ScalarType weights) {
  return {x.contiguous(), a.to(weights).contiguous(), p.add ? z->contiguous() : at::Tensor(),
          p.add ? b->to(weights).contiguous() : at::Tensor()};
}

}  // namespace kda_dsa_ops::hc
