// cross_entropy_rows_ on the GPU: one block per row, two passes over it. The first keeps an
// online (max, its first index, sum of exp) per thread over 16-byte vectors and combines them over
// the block; the second overwrites the row with scale * (exp(x - lse) - onehot). All in fp32; a
// label outside [0, V) (value checks off) is treated as ignore_index, so nothing outside the row
// is read.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "common/device.cuh"
#include "common/dispatch.h"
#include "loss/ce.h"

namespace kda_dsa_ops::loss {

namespace {

constexpr int kThreads = 512, kWarps = kThreads / kWarpSize;

struct CeArgs {
  void* logits;
  const int64_t* labels;
  float* loss;
  int64_t* argmax;
  int64_t V, ignore_index;
  float scale;
  bool write_grad, vec;
};

// (m, i, s): a running max, the first index holding it (-1 while m is -inf) and the sum of
// exp(x - m); merging two keeps the larger max and, on a tie, the smaller index. A NaN in s stays
// (a NaN logit, or +inf: exp(inf - inf)), so the row's loss and gradient are NaN.
__device__ __forceinline__ void merge(float& m, int64_t& i, float& s, float m2, int64_t i2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) {  // nothing above -inf yet: s is 0, or NaN
    s += s2;
    return;
  }
  s = s * expf(m - mx) + s2 * expf(m2 - mx);
  i = m2 > m || (m2 == m && i2 < i) ? i2 : i;
  m = mx;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) ce_rows_kernel(const __grid_constant__ CeArgs a) {
  constexpr int kVec = 16 / sizeof(T);
  __shared__ float red_m[kWarps], red_s[kWarps];
  __shared__ int64_t red_i[kWarps];
  const int64_t r = blockIdx.x, V = a.V, label = a.labels[r];
  T* row = static_cast<T*>(a.logits) + r * V;
  const bool ignored = label == a.ignore_index || label < 0 || label >= V;
  const int64_t step = int64_t{kThreads} * kVec;
  if (ignored) {
    if (a.write_grad) {
      for (int64_t c = threadIdx.x; c < V; c += kThreads) row[c] = from_float<T>(0.f);
    }
    if (threadIdx.x == 0) {
      a.loss[r] = 0.f;
      a.argmax[r] = -1;
    }
    return;
  }
  float m = -INFINITY, s = 0.f;
  int64_t i = -1;
  if (a.vec) {
    for (int64_t c = int64_t{threadIdx.x} * kVec; c < V; c += step) {
      const Pack<T, kVec> x = *reinterpret_cast<const Pack<T, kVec>*>(row + c);
      float mv = -INFINITY, sv = 0.f;
      int64_t iv = -1;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {  // a NaN is passed over
        if (to_float(x.v[e]) > mv) {
          mv = to_float(x.v[e]);
          iv = c + e;
        }
      }
      if (mv != -INFINITY) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) sv += expf(to_float(x.v[e]) - mv);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) sv += to_float(x.v[e]) != to_float(x.v[e]) ? NAN : 0.f;  // keep a NaN
      }
      merge(m, i, s, mv, iv, sv);
    }
  } else {
    for (int64_t c = threadIdx.x; c < V; c += kThreads) {
      const float v = to_float(row[c]);
      const bool above = v > -INFINITY;  // (false for a NaN)
      merge(m, i, s, above ? v : -INFINITY, above ? c : -1, v != v ? NAN : (above ? 1.f : 0.f));
    }
  }
#pragma unroll
  for (int d = kWarpSize / 2; d > 0; d /= 2) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, d), s2 = __shfl_xor_sync(0xffffffffu, s, d);
    merge(m, i, s, m2, __shfl_xor_sync(0xffffffffu, i, d), s2);
  }
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  if (lane == 0) {
    red_m[warp] = m;
    red_i[warp] = i;
    red_s[warp] = s;
  }
  __syncthreads();
  m = red_m[0];
  i = red_i[0];
  s = red_s[0];
  for (int w = 1; w < kWarps; ++w) merge(m, i, s, red_m[w], red_i[w], red_s[w]);  // the same order in every thread
  const float lse = m + logf(s);
  if (threadIdx.x == 0) {
    a.loss[r] = lse - to_float(row[label]);
    a.argmax[r] = i;
  }
  if (!a.write_grad) return;
  __syncthreads();  // row[label] is read before it is overwritten
  if (a.vec) {
    for (int64_t c = int64_t{threadIdx.x} * kVec; c < V; c += step) {
      Pack<T, kVec> x = *reinterpret_cast<const Pack<T, kVec>*>(row + c);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        x.v[e] = from_float<T>(a.scale * (expf(to_float(x.v[e]) - lse) - (c + e == label ? 1.f : 0.f)));
      }
      *reinterpret_cast<Pack<T, kVec>*>(row + c) = x;
    }
  } else {
    for (int64_t c = threadIdx.x; c < V; c += kThreads) {
      row[c] = from_float<T>(a.scale * (expf(to_float(row[c]) - lse) - (c == label ? 1.f : 0.f)));
    }
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> cross_entropy_rows_cuda(at::Tensor& logits, const at::Tensor& labels_in,
                                                           int64_t ignore_index, double scale, bool write_grad) {
  const RowsProblem p = check_ce_rows(logits, labels_in, ignore_index);
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor labels = labels_in.contiguous();
  at::Tensor loss = at::empty({p.N}, logits.options().dtype(at::kFloat)), argmax = at::empty({p.N}, labels.options());
  if (p.N == 0) return {loss, argmax};
  KDA_DISPATCH_CUDA_FLOATING(logits.scalar_type(), "cross_entropy_rows_", [&] {
    constexpr int kVec = 16 / sizeof(scalar_t);
    const bool vec = rows_vectorised<kVec, scalar_t>(p.V, {logits.data_ptr()});
    const CeArgs a{logits.data_ptr(), labels.data_ptr<int64_t>(), loss.data_ptr<float>(), argmax.data_ptr<int64_t>(),
                   p.V, ignore_index, static_cast<float>(scale), write_grad, vec};
    ce_rows_kernel<scalar_t><<<p.N, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {loss, argmax};
}

}  // namespace kda_dsa_ops::loss
