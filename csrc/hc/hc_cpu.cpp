// hc_mix on the CPU: every product and sum in the accumulation type (float64 for float64 x, else
// float32), one token per task.
#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>

#include <vector>

#include "common/dispatch.h"
#include "hc/hc.h"

namespace kda_dsa_ops::hc {

at::Tensor hc_mix_cpu(const at::Tensor& x_in, const at::Tensor& a_in, const std::optional<at::Tensor>& z_in,
                      const std::optional<at::Tensor>& b_in) {
  const MixProblem p = check_mix(x_in, a_in, z_in, b_in, "hc_mix");
  at::Tensor y = at::empty({p.T, p.m, p.D}, x_in.options());
  KDA_DISPATCH_CPU_FLOATING(x_in.scalar_type(), "hc_mix_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto [x, a, z, b] = mix_inputs(p, x_in, a_in, z_in, b_in, c10::CppTypeToScalarType<acc_t>::value);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const acc_t* ap = a.data_ptr<acc_t>();
    const scalar_t* zp = p.add ? z.data_ptr<scalar_t>() : nullptr;
    const acc_t* bp = p.add ? b.data_ptr<acc_t>() : nullptr;
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, p.T, 16, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> row(p.D);
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t i = 0; i < p.m; ++i) {
          for (int64_t d = 0; d < p.D; ++d) row[d] = p.add ? bp[t * p.m + i] * acc_t(zp[t * p.D + d]) : acc_t(0);
          for (int64_t j = 0; j < p.n; ++j) {
            const acc_t w = ap[(t * p.m + i) * p.n + j];
            const scalar_t* xr = xp + (t * p.n + j) * p.D;
            for (int64_t d = 0; d < p.D; ++d) row[d] += w * acc_t(xr[d]);
          }
          for (int64_t d = 0; d < p.D; ++d) yp[(t * p.m + i) * p.D + d] = static_cast<scalar_t>(row[d]);
        }
      }
    });
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hc_mix_bwd_cpu(const at::Tensor& grad_y_in,
                                                                          const at::Tensor& x_in,
                                                                          const at::Tensor& a_in,
                                                                          const std::optional<at::Tensor>& z_in,
                                                                          const std::optional<at::Tensor>& b_in) {
  const MixProblem p = check_mix_bwd(grad_y_in, x_in, a_in, z_in, b_in);
  const at::Tensor gy = grad_y_in.contiguous();
  at::Tensor dx = at::empty({p.T, p.n, p.D}, gy.options());
  at::Tensor dz = p.add ? at::empty({p.T, p.D}, gy.options()) : at::zeros({0}, gy.options());
  at::Tensor da, db;
  KDA_DISPATCH_CPU_FLOATING(gy.scalar_type(), "hc_mix_bwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto [x, a, z, b] = mix_inputs(p, x_in, a_in, z_in, b_in, c10::CppTypeToScalarType<acc_t>::value);
    at::Tensor da_acc = at::empty({p.T, p.m, p.n}, a.options());
    at::Tensor db_acc = at::empty({p.T, p.add ? p.m : 0}, a.options());
    const scalar_t* gp = gy.data_ptr<scalar_t>();
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const acc_t* ap = a.data_ptr<acc_t>();
    const scalar_t* zp = p.add ? z.data_ptr<scalar_t>() : nullptr;
    const acc_t* bp = p.add ? b.data_ptr<acc_t>() : nullptr;
    scalar_t* dxp = dx.data_ptr<scalar_t>();
    scalar_t* dzp = p.add ? dz.data_ptr<scalar_t>() : nullptr;
    acc_t* dap = da_acc.data_ptr<acc_t>();
    acc_t* dbp = db_acc.data_ptr<acc_t>();
    at::parallel_for(0, p.T, 16, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> row(p.D);
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* g = gp + t * p.m * p.D;
        for (int64_t j = 0; j < p.n; ++j) {  // dx[j] = sum_i a[i, j] g[i]; da[i, j] = <g[i], x[j]>
          const scalar_t* xr = xp + (t * p.n + j) * p.D;
          std::fill(row.begin(), row.end(), acc_t(0));
          for (int64_t i = 0; i < p.m; ++i) {
            const acc_t w = ap[(t * p.m + i) * p.n + j];
            acc_t dot = 0;
            for (int64_t d = 0; d < p.D; ++d) {
              row[d] += w * acc_t(g[i * p.D + d]);
              dot += acc_t(g[i * p.D + d]) * acc_t(xr[d]);
            }
            dap[(t * p.m + i) * p.n + j] = dot;
          }
          for (int64_t d = 0; d < p.D; ++d) dxp[(t * p.n + j) * p.D + d] = static_cast<scalar_t>(row[d]);
        }
        if (!p.add) continue;
        std::fill(row.begin(), row.end(), acc_t(0));  // dz = sum_i b[i] g[i]; db[i] = <g[i], z>
        for (int64_t i = 0; i < p.m; ++i) {
          const acc_t w = bp[t * p.m + i];
          acc_t dot = 0;
          for (int64_t d = 0; d < p.D; ++d) {
            row[d] += w * acc_t(g[i * p.D + d]);
            dot += acc_t(g[i * p.D + d]) * acc_t(zp[t * p.D + d]);
          }
          dbp[t * p.m + i] = dot;
        }
        for (int64_t d = 0; d < p.D; ++d) dzp[t * p.D + d] = static_cast<scalar_t>(row[d]);
      }
    });
    da = da_acc.to(a_in.scalar_type());
    db = p.add ? db_acc.to(b_in->scalar_type()) : at::zeros({0}, a_in.options());
  });
  return {dx, da, dz, db};
}

}  // namespace kda_dsa_ops::hc
