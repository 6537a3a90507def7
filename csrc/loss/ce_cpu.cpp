// cross_entropy_rows_ on the CPU, one row per task, in the accumulation type (float64 for
// float64 logits, else float32).
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "common/dispatch.h"
#include "loss/ce.h"

namespace kda_dsa_ops::loss {

std::tuple<at::Tensor, at::Tensor> cross_entropy_rows_cpu(at::Tensor& logits, const at::Tensor& labels_in,
                                                          int64_t ignore_index, double scale, bool write_grad) {
  const RowsProblem p = check_ce_rows(logits, labels_in, ignore_index);
  const at::Tensor labels = labels_in.contiguous();
  at::Tensor loss, argmax = at::full({p.N}, -1, labels.options());
  int64_t* top = argmax.data_ptr<int64_t>();
  KDA_DISPATCH_CPU_FLOATING(logits.scalar_type(), "cross_entropy_rows_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    loss = at::zeros({p.N}, logits.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    scalar_t* x = logits.data_ptr<scalar_t>();
    const int64_t* lab = labels.data_ptr<int64_t>();
    acc_t* out = loss.data_ptr<acc_t>();
    at::parallel_for(0, p.N, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* row = x + r * p.V;
        const bool ignored = lab[r] == ignore_index;
        if (!ignored) {
          acc_t mx = -std::numeric_limits<acc_t>::infinity();
          for (int64_t c = 0; c < p.V; ++c) {  // the first largest; a NaN is passed over here, caught by the sum
            if (acc_t(row[c]) > mx) {
              mx = acc_t(row[c]);
              top[r] = c;
            }
          }
          // +inf: exp(inf - inf) is NaN, as on CUDA; all -inf: lse -inf, the loss NaN
          const acc_t shift = mx == -std::numeric_limits<acc_t>::infinity() ? acc_t(0) : mx;
          acc_t sum = 0;
          for (int64_t c = 0; c < p.V; ++c) sum += std::exp(acc_t(row[c]) - shift);
          const acc_t lse = std::log(sum) + shift;
          out[r] = lse - acc_t(row[lab[r]]);
          if (write_grad) {
            for (int64_t c = 0; c < p.V; ++c) {
              row[c] = static_cast<scalar_t>(acc_t(scale) * (std::exp(acc_t(row[c]) - lse) - acc_t(c == lab[r])));
            }
          }
        } else if (write_grad) {
          for (int64_t c = 0; c < p.V; ++c) row[c] = scalar_t(0);
        }
      }
    });
  });
  return {loss, argmax};
}

}  // namespace kda_dsa_ops::loss
