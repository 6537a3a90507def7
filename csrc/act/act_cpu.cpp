// The fused activations on the CPU: every product and sum in the accumulation type (float64 for
// float64 inputs, else float32), one rounding per output; tokens (rows) split over tasks.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "act/act.h"
#include "common/dispatch.h"

namespace kda_dsa_ops::act {

namespace {

template <typename acc_t>
acc_t sigmoid(acc_t z) {
  return acc_t(1) / (acc_t(1) + std::exp(-z));
}

// silu'(z) = s (1 + z (1 - s)), s = sigmoid(z)
template <typename acc_t>
acc_t silu_grad(acc_t z) {
  const acc_t s = sigmoid(z);
  return s * (acc_t(1) + z * (acc_t(1) - s));
}

// The convolution over the kernels' inputs: row s of the batch (s < 0: the halo's row s + W - 1,
// or zeros), whether tap j of token t is taken (within its sequence, or j = 0), and z[t, c].
template <typename scalar_t, typename acc_t>
struct ConvView {
  const scalar_t* x;
  const scalar_t* halo;
  const acc_t* w;
  const int64_t* pos;
  int64_t C, W;

  ConvView(const ConvProblem& p, const ConvInputs& in)
      : x(in.x.data_ptr<scalar_t>()), halo(p.halo ? in.halo.data_ptr<scalar_t>() : nullptr),
        w(in.w.data_ptr<acc_t>()), pos(in.pos.data_ptr<int64_t>()), C(p.C), W(p.W) {}
  acc_t row(int64_t s, int64_t c) const {
    if (s >= 0) return acc_t(x[s * C + c]);
    return halo != nullptr ? acc_t(halo[(s + W - 1) * C + c]) : acc_t(0);
  }
  bool tap(int64_t j, int64_t t) const { return j == 0 || pos[t] >= j; }
  acc_t z(int64_t t, int64_t c) const {
    acc_t sum = 0;
    for (int64_t j = 0; j < W; ++j) {
      if (tap(j, t)) sum += w[c * W + j] * row(t - j, c);
    }
    return sum;
  }
};

// GLM-5.3's clamps with lim > 0: gate from above, up to [-lim, lim] (comparisons that keep NaN,
// as torch.clamp does).
template <typename acc_t>
void clamp_glu(acc_t& g, acc_t& u, acc_t lim) {
  if (lim > 0) {
    g = g > lim ? lim : g;
    u = u > lim ? lim : (u < -lim ? -lim : u);
  }
}

}  // namespace

at::Tensor short_conv_cpu(const at::Tensor& x_in, const at::Tensor& weight_in, const at::Tensor& pos_in,
                          const std::optional<at::Tensor>& halo_in) {
  const ConvProblem p = check_conv(x_in, weight_in, pos_in, halo_in, "short_conv");
  at::Tensor y = at::empty({p.T, p.C}, x_in.options());
  KDA_DISPATCH_CPU_FLOATING(x_in.scalar_type(), "short_conv_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const ConvInputs in = conv_inputs(x_in, weight_in, pos_in, halo_in, c10::CppTypeToScalarType<acc_t>::value);
    const ConvView<scalar_t, acc_t> v(p, in);
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, p.T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t c = 0; c < p.C; ++c) {
          const acc_t z = v.z(t, c);
          yp[t * p.C + c] = static_cast<scalar_t>(z * sigmoid(z));
        }
      }
    });
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> short_conv_bwd_cpu(const at::Tensor& grad_y_in, const at::Tensor& x_in,
                                                                  const at::Tensor& weight_in,
                                                                  const at::Tensor& pos_in,
                                                                  const std::optional<at::Tensor>& halo_in,
                                                                  bool weight_grad) {
  const ConvProblem p = check_conv_bwd(grad_y_in, x_in, weight_in, pos_in, halo_in);
  const at::Tensor gy = grad_y_in.contiguous();
  at::Tensor dx = at::empty({p.T, p.C}, gy.options());
  at::Tensor dhalo = p.halo ? at::empty({p.W - 1, p.C}, gy.options()) : at::zeros({0}, gy.options());
  at::Tensor dw;
  KDA_DISPATCH_CPU_FLOATING(gy.scalar_type(), "short_conv_bwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const ConvInputs in = conv_inputs(x_in, weight_in, pos_in, halo_in, c10::CppTypeToScalarType<acc_t>::value);
    const ConvView<scalar_t, acc_t> v(p, in);
    const scalar_t* gp = gy.data_ptr<scalar_t>();
    // dz = grad_y silu'(z), z recomputed
    at::Tensor dz_t = at::empty({p.T, p.C}, in.w.options());
    acc_t* dz = dz_t.data_ptr<acc_t>();
    at::parallel_for(0, p.T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t c = 0; c < p.C; ++c) {
          dz[t * p.C + c] = acc_t(gp[t * p.C + c]) * silu_grad(v.z(t, c));
        }
      }
    });
    // row s (s < 0: the halo's) gets w[c, j] dz[s + j] from every tap that reads it
    scalar_t* dxp = dx.data_ptr<scalar_t>();
    scalar_t* dhp = p.halo ? dhalo.data_ptr<scalar_t>() : nullptr;
    const int64_t first = p.halo ? -(p.W - 1) : 0;
    at::parallel_for(0, p.T - first, 16, [&](int64_t begin, int64_t end) {
      for (int64_t s = begin + first; s < end + first; ++s) {
        scalar_t* out = s >= 0 ? dxp + s * p.C : dhp + (s + p.W - 1) * p.C;
        for (int64_t c = 0; c < p.C; ++c) {
          acc_t sum = 0;
          for (int64_t j = 0; j < p.W && s + j < p.T; ++j) {
            if (s + j >= 0 && v.tap(j, s + j)) sum += v.w[c * p.W + j] * dz[(s + j) * p.C + c];
          }
          out[c] = static_cast<scalar_t>(sum);
        }
      }
    });
    if (!weight_grad) {
      dw = at::zeros({0}, weight_in.options());
      return;
    }
    // dw[c, j] = sum_t dz[t, c] x[t - j, c] over the taps taken, per channel in token order
    at::Tensor dw_acc = at::empty({p.C, p.W}, in.w.options());
    acc_t* dwp = dw_acc.data_ptr<acc_t>();
    at::parallel_for(0, p.C, 16, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        for (int64_t j = 0; j < p.W; ++j) {
          acc_t sum = 0;
          for (int64_t t = 0; t < p.T; ++t) {
            if (v.tap(j, t)) sum += dz[t * p.C + c] * v.row(t - j, c);
          }
          dwp[c * p.W + j] = sum;
        }
      }
    });
    dw = dw_acc.to(weight_in.scalar_type());
  });
  return {dx, dw, dhalo};
}

at::Tensor swiglu_cpu(const at::Tensor& gate_up_in, double limit) {
  const GluProblem p = check_swiglu(gate_up_in, limit, "swiglu");
  const at::Tensor gu = gate_up_in.contiguous();
  at::Tensor h = at::empty(glu_out_shape(gu), gu.options());
  KDA_DISPATCH_CPU_FLOATING(gu.scalar_type(), "swiglu_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* in = gu.data_ptr<scalar_t>();
    scalar_t* out = h.data_ptr<scalar_t>();
    const acc_t lim = static_cast<acc_t>(limit);
    at::parallel_for(0, p.N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        for (int64_t f = 0; f < p.F; ++f) {
          acc_t g = acc_t(in[n * 2 * p.F + f]), u = acc_t(in[n * 2 * p.F + p.F + f]);
          clamp_glu(g, u, lim);
          out[n * p.F + f] = static_cast<scalar_t>(g * sigmoid(g) * u);
        }
      }
    });
  });
  return h;
}

at::Tensor swiglu_bwd_cpu(const at::Tensor& grad_h_in, const at::Tensor& gate_up_in, double limit) {
  const GluProblem p = check_swiglu_bwd(grad_h_in, gate_up_in, limit);
  const at::Tensor gu = gate_up_in.contiguous(), gh = grad_h_in.contiguous();
  at::Tensor d = at::empty(gu.sizes(), gu.options());
  KDA_DISPATCH_CPU_FLOATING(gu.scalar_type(), "swiglu_bwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* in = gu.data_ptr<scalar_t>();
    const scalar_t* gp = gh.data_ptr<scalar_t>();
    scalar_t* out = d.data_ptr<scalar_t>();
    const acc_t lim = static_cast<acc_t>(limit);
    at::parallel_for(0, p.N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        for (int64_t f = 0; f < p.F; ++f) {
          acc_t g = acc_t(in[n * 2 * p.F + f]), u = acc_t(in[n * 2 * p.F + p.F + f]);
          const acc_t dh = acc_t(gp[n * p.F + f]);
          // the clamps' gradient passes strictly inside their bounds (zero on them, as torch.clamp's)
          const bool g_in = limit == 0 || g < lim, u_in = limit == 0 || (u > -lim && u < lim);
          clamp_glu(g, u, lim);
          out[n * 2 * p.F + f] = static_cast<scalar_t>(g_in ? dh * u * silu_grad(g) : acc_t(0));
          out[n * 2 * p.F + p.F + f] = static_cast<scalar_t>(u_in ? dh * g * sigmoid(g) : acc_t(0));
        }
      }
    });
  });
  return d;
}

}  // namespace kda_dsa_ops::act
