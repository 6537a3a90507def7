// The fused activations' argument checks, shared by the CPU and CUDA entry points.
#include "act/act.h"

#include <cmath>

#include "common/checks.h"

namespace kda_dsa_ops::act {

namespace {
constexpr auto kFloating = {at::kBFloat16, at::kHalf, at::kFloat, at::kDouble};
}  // namespace

ConvProblem check_conv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& pos,
                       const std::optional<at::Tensor>& halo, const char* op) {
  check_dim(x, 2, "x", "[T, C] (packed tokens, channels)");
  check_dim(weight, 2, "weight", "[C, W] (each channel's taps)");
  check_dim(pos, 1, "pos", "[T] (each token's position within its sequence)");
  check_dtype(x, kFloating, "x");
  check_dtype(weight, kFloating, "weight");
  check_dtype(pos, {at::kLong, at::kInt}, "pos");
  check_same_device(weight, x, "weight", "x");
  check_same_device(pos, x, "pos", "x");
  const ConvProblem p{x.size(0), x.size(1), weight.size(1), halo.has_value()};
  TORCH_CHECK(weight.size(0) == p.C, op, ": weight must be [C, W] with C = ", p.C, " (x's channels), got ",
              shape_str(weight));
  TORCH_CHECK(p.W >= 1 && p.W <= kMaxConvWidth, op, ": the convolution takes 1 to ", kMaxConvWidth,
              " taps (weight [C, W]), got W = ", p.W);
  TORCH_CHECK(pos.size(0) == p.T, op, ": pos must be [T] with T = ", p.T, " (x's tokens), got ", shape_str(pos));
  if (p.halo) {
    check_same_device(*halo, x, "halo", "x");
    TORCH_CHECK(halo->scalar_type() == x.scalar_type(), op, ": halo must have the dtype of x (", x.scalar_type(),
                "), got ", halo->scalar_type());
    TORCH_CHECK(halo->dim() == 2 && halo->size(0) == p.W - 1 && halo->size(1) == p.C, op,
                ": halo must be [W - 1, C] = [", p.W - 1, ", ", p.C, "] (the rows before x), got ", shape_str(*halo));
  }
  return p;
}

ConvProblem check_conv_bwd(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                           const at::Tensor& pos, const std::optional<at::Tensor>& halo) {
  constexpr const char* op = "short_conv_bwd";
  const ConvProblem p = check_conv(x, weight, pos, halo, op);
  check_same_device(grad_y, x, "grad_y", "x");
  TORCH_CHECK(grad_y.sizes() == x.sizes(), op, ": grad_y must be [T, C] = ", shape_str(x), ", got ",
              shape_str(grad_y));
  TORCH_CHECK(grad_y.scalar_type() == x.scalar_type(), op, ": grad_y must have the dtype of x (", x.scalar_type(),
              "), got ", grad_y.scalar_type());
  return p;
}

ConvInputs conv_inputs(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& pos,
                       const std::optional<at::Tensor>& halo, at::ScalarType weights) {
  return {x.contiguous(), weight.to(weights).contiguous(), pos.to(at::kLong).contiguous(),
          halo.has_value() ? halo->contiguous() : at::Tensor()};
}

GluProblem check_swiglu(const at::Tensor& gate_up, double limit, const char* op) {
  check_dtype(gate_up, kFloating, "gate_up");
  TORCH_CHECK(gate_up.dim() >= 1, op, ": gate_up must have a last dim [..., 2F] ([gate, up]), got a 0-D tensor");
  const int64_t width = gate_up.size(-1);
  TORCH_CHECK(width % 2 == 0, op, ": gate_up's last dim must be even ([gate, up] of F each), got ", width);
  TORCH_CHECK(limit >= 0 && std::isfinite(limit), op, ": limit must be finite and >= 0 (0: no clamps), got ", limit);
  return {width == 0 ? 0 : gate_up.numel() / width, width / 2};
}

GluProblem check_swiglu_bwd(const at::Tensor& grad_h, const at::Tensor& gate_up, double limit) {
  constexpr const char* op = "swiglu_bwd";
  const GluProblem p = check_swiglu(gate_up, limit, op);
  check_same_device(grad_h, gate_up, "grad_h", "gate_up");
  TORCH_CHECK(grad_h.sizes() == at::IntArrayRef(glu_out_shape(gate_up)), op, ": grad_h must be [..., F] = ",
              c10::str(at::IntArrayRef(glu_out_shape(gate_up))), ", got ", shape_str(grad_h));
  TORCH_CHECK(grad_h.scalar_type() == gate_up.scalar_type(), op, ": grad_h must have the dtype of gate_up (",
              gate_up.scalar_type(), "), got ", grad_h.scalar_type());
  return p;
}

std::vector<int64_t> glu_out_shape(const at::Tensor& gate_up) {
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() /= 2;
  return shape;
}

}  // namespace kda_dsa_ops::act
