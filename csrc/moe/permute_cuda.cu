// moe_permute / moe_unpermute on CUDA, with no host synchronisation.
//
// permute: (1) key every copy c = t*k+j by (expert, priority) and count copies per expert;
// (2) stable radix sort of the keys (copy order breaks ties, so the result is deterministic);
// (3) one block turns the counts into each expert's kept rows and output offsets; for
// 'reroute', the overflowing copies are compacted in copy order and one block assigns them
// to fallback experts sequentially (the policy is sequential by definition); (4) the row map
// and copy maps are scattered, and each token's row is read once and written to the rows of its
// kept copies with 16-byte accesses (a gather by output row would read each row k times).
// unpermute: invert the row map, then each token sums its k rows in fp32 in slot order.
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_select.cuh>

#include <limits>
#include <type_traits>

#include "common/checks.h"
#include "common/device.cuh"
#include "common/dispatch.h"
#include "moe/moe.h"

namespace kda_dsa_ops::moe {
namespace {

constexpr int kScanThreads = 1024;
constexpr int kRowThreads = 128;
constexpr int kMaxFallback = 32;          // fallback experts per token read by the reroute pass
constexpr int kRerouteWindow = 1024;      // overflowing copies staged in shared memory at once

__global__ void permute_keys_kernel(const int* __restrict__ ids, const float* __restrict__ weights, int64_t n, int E,
                                    bool by_weight, uint64_t* __restrict__ keys, int* __restrict__ copies,
                                    int* __restrict__ counts) {
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < n;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int e = ids[c];
    const bool valid = e >= 0 && e < E;
    const uint64_t expert = valid ? static_cast<uint64_t>(e) : static_cast<uint64_t>(E);
    keys[c] = by_weight ? (expert << 32) | descending_bits(weights[c]) : expert;
    copies[c] = static_cast<int>(c);
    if (valid) atomicAdd(counts + e, 1);
  }
}

// seg_start: first sorted position of each expert; kept = min(count, capacity). Without a
// reroute pass the output offsets follow directly.
__global__ void __launch_bounds__(kScanThreads) permute_plan_kernel(const int* __restrict__ counts, int E,
                                                                    int capacity, bool finalize,
                                                                    int* __restrict__ seg_start,
                                                                    int* __restrict__ kept,
                                                                    int* __restrict__ out_start,
                                                                    int* __restrict__ offs) {
  block_scan_sum(E, [&](int e) { return counts[e]; }, [&](int e, int excl, int) {
    seg_start[e] = excl;
    kept[e] = capacity < 0 ? counts[e] : min(counts[e], capacity);
  });
  __syncthreads();
  if (!finalize) return;
  block_scan_sum(E, [&](int e) { return kept[e]; }, [&](int e, int excl, int incl) {
    out_start[e] = excl;
    offs[e] = incl;
  });
}

__global__ void mark_overflow_kernel(const uint64_t* __restrict__ sorted_keys, const int* __restrict__ sorted_copies,
                                     int64_t n, int E, bool by_weight, const int* __restrict__ seg_start,
                                     const int* __restrict__ kept, uint8_t* __restrict__ overflow) {
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < n;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int e = static_cast<int>(by_weight ? sorted_keys[p] >> 32 : sorted_keys[p]);
    overflow[sorted_copies[p]] = e < E && p - seg_start[e] >= kept[e];
  }
}

// One block: overflowing copies, in copy order, take the first fallback expert of their token
// with room left, continuing from where the token's previous overflowing copy stopped. The pass
// is sequential by definition; one warp runs it, lane j looking at fallback j (F <= 32) so that a
// copy costs one round of shared-memory reads and a ballot instead of a scan.
__global__ void __launch_bounds__(kScanThreads) reroute_kernel(
    const int* __restrict__ overflow_copies, const int* __restrict__ num_overflow, const int* __restrict__ fallback,
    int F, int k, int E, int capacity, const int* __restrict__ kept, int* __restrict__ assigned_expert,
    int* __restrict__ assigned_slot, int* __restrict__ out_start,
    int* __restrict__ offs) {
  extern __shared__ int shared[];
  int* room = shared;                              // [E]
  int* taken = room + E;                           // [E] rerouted copies per expert
  int* tokens = taken + E;                         // [kRerouteWindow]
  int* candidates = tokens + kRerouteWindow;       // [kRerouteWindow * F]
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    room[e] = capacity - kept[e];
    taken[e] = 0;
  }
  const int total = *num_overflow;
  const int lane = static_cast<int>(threadIdx.x);
  int token = -1, cursor = 0;  // the first warp's state, carried across windows
  for (int base = 0; base < total; base += kRerouteWindow) {
    const int count = min(kRerouteWindow, total - base);
    __syncthreads();
    for (int i = threadIdx.x; i < count; i += blockDim.x) tokens[i] = overflow_copies[base + i] / k;
    for (int i = threadIdx.x; i < count * F; i += blockDim.x) {
      const int c = overflow_copies[base + i / F];
      const int e = fallback[static_cast<int64_t>(c / k) * F + i % F];
      candidates[i] = e >= 0 && e < E ? e : -1;
    }
    __syncthreads();
    if (threadIdx.x >= kWarpSize) continue;
    for (int i = 0; i < count; ++i) {
      const int t = tokens[i];
      if (t != token) token = t, cursor = 0;
      const int e = lane < F ? candidates[i * F + lane] : -1;
      const unsigned open = __ballot_sync(~0u, lane >= cursor && e >= 0 && room[e] > 0);
      const int first = open != 0 ? __ffs(open) - 1 : -1;
      if (lane == first) {
        --room[e];
        assigned_expert[base + i] = e;
        assigned_slot[base + i] = taken[e]++;
      } else if (first < 0 && lane == 0) {
        assigned_expert[base + i] = -1;
        assigned_slot[base + i] = -1;
      }
      cursor = first < 0 ? F : first + 1;
      __syncwarp();
    }
  }
  __syncthreads();
  block_scan_sum(E, [&](int e) { return kept[e] + taken[e]; }, [&](int e, int excl, int incl) {
    out_start[e] = excl;
    offs[e] = incl;
  });
}

// Row map and copy map of the kept copies; every copy's entry of copy_row is written (-1 unless
// kept), so this runs before scatter_rerouted_kernel.
__global__ void scatter_kept_kernel(const uint64_t* __restrict__ sorted_keys, const int* __restrict__ sorted_copies,
                                    int64_t n, int E, bool by_weight, const int* __restrict__ seg_start,
                                    const int* __restrict__ kept, const int* __restrict__ out_start,
                                    int* __restrict__ row_map, int* __restrict__ copy_row) {
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < n;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int e = static_cast<int>(by_weight ? sorted_keys[p] >> 32 : sorted_keys[p]);
    const int c = sorted_copies[p];
    int row = -1;
    if (e < E) {
      const int rank = static_cast<int>(p - seg_start[e]);
      if (rank < kept[e]) row = out_start[e] + rank;
    }
    if (row >= 0) row_map[row] = c;
    copy_row[c] = row;
  }
}

__global__ void scatter_rerouted_kernel(const int* __restrict__ overflow_copies, const int* __restrict__ num_overflow,
                                        const int* __restrict__ assigned_expert,
                                        const int* __restrict__ assigned_slot, const int* __restrict__ kept,
                                        const int* __restrict__ out_start, int* __restrict__ row_map,
                                        int* __restrict__ copy_row) {
  const int total = *num_overflow;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const int e = assigned_expert[i];
    if (e < 0) continue;
    const int row = out_start[e] + kept[e] + assigned_slot[i], c = overflow_copies[i];
    row_map[row] = c;
    copy_row[c] = row;
  }
}

template <int kVec>
using RowVec = std::conditional_t<kVec == 16, uint4, uint16_t>;

// One block per token: its row of x read once, written to the rows of its kept copies.
template <int kVec>
__global__ void __launch_bounds__(kRowThreads) scatter_rows_kernel(const char* __restrict__ x, char* __restrict__ out,
                                                                   int64_t row_bytes, const int* __restrict__ copy_row,
                                                                   int k) {
  using Vec = RowVec<kVec>;
  const int64_t t = blockIdx.x, n = row_bytes / sizeof(Vec);
  const Vec* in = reinterpret_cast<const Vec*>(x + t * row_bytes);
  const int* rows = copy_row + t * k;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const Vec v = in[i];
    for (int j = 0; j < k; ++j) {
      const int m = __ldg(rows + j);
      if (m >= 0) reinterpret_cast<Vec*>(out + m * row_bytes)[i] = v;
    }
  }
}

// Rows [offs[E-1], M) hold no copy: zeros.
template <int kVec>
__global__ void zero_rows_kernel(char* __restrict__ out, int64_t row_bytes, int64_t M, const int* __restrict__ offs,
                                 int E) {
  using Vec = RowVec<kVec>;
  const int64_t first = offs[E - 1], n = (M - first) * (row_bytes / static_cast<int64_t>(sizeof(Vec)));
  Vec* dst = reinterpret_cast<Vec*>(out + first * row_bytes);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = Vec{};
  }
}

template <typename F>
void launch_rows(int64_t row_bytes, const void* a, const void* b, F&& f) {
  const bool vec16 = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(a) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(b) % 16 == 0;
  if (vec16) {
    f(std::integral_constant<int, 16>{});
  } else {
    f(std::integral_constant<int, 2>{});
  }
}

int grid_for(int64_t n, int threads) {
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(ceil_div(n, threads), 1), 65535));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> permute_cuda(const at::Tensor& x_in, const at::Tensor& ids_in,
                                                            const std::optional<at::Tensor>& weights_in,
                                                            int64_t num_experts, int64_t capacity,
                                                            c10::string_view policy_name,
                                                            const std::optional<at::Tensor>& fallback_in) {
  const Policy policy = parse_policy(policy_name);
  check_permute(x_in, ids_in, weights_in, num_experts, capacity, policy, fallback_in);
  TORCH_CHECK(num_experts < std::numeric_limits<int32_t>::max() / 2, "moe_permute: num_experts too large");
  const bool by_weight = capacity >= 0 && policy != Policy::kDropPosition;
  const bool reroute = capacity >= 0 && policy == Policy::kReroute;
  if (reroute) {
    TORCH_CHECK(fallback_in->size(1) <= kMaxFallback, "moe_permute: the CUDA reroute pass reads at most ",
                kMaxFallback, " fallback experts per token, got F = ", fallback_in->size(1));
  }
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor x = x_in.contiguous();
  const at::Tensor ids = ids_in.contiguous();
  const int64_t T = x.size(0), D = x.size(1), k = ids.size(1), n = T * k;
  const int E = static_cast<int>(num_experts);
  const int64_t M = permute_rows(T, k, num_experts, capacity);
  const auto int_opts = ids.options();

  at::Tensor x_sorted = at::empty({M, D}, x.options());
  at::Tensor row_map = at::full({M}, -1, int_opts);
  at::Tensor copy_row = at::empty({n}, int_opts);  // the row of each copy, -1 if dropped
  at::Tensor offs = at::empty({E}, int_opts);
  at::Tensor counts = at::zeros({E}, int_opts);
  at::Tensor plan = at::empty({3, E}, int_opts);  // seg_start, kept, out_start
  int* seg_start = plan[0].data_ptr<int>();
  int* kept = plan[1].data_ptr<int>();
  int* out_start = plan[2].data_ptr<int>();
  if (n > 0) {
    const at::Tensor weights = by_weight ? weights_in->to(at::kFloat).contiguous() : at::Tensor();
    at::Tensor keys = at::empty({2, n}, ids.options().dtype(at::kLong));
    at::Tensor copies = at::empty({2, n}, int_opts);
    auto* keys_in = reinterpret_cast<uint64_t*>(keys[0].data_ptr());
    auto* keys_out = reinterpret_cast<uint64_t*>(keys[1].data_ptr());
    int* copies_in = copies[0].data_ptr<int>();
    int* copies_out = copies[1].data_ptr<int>();
    permute_keys_kernel<<<grid_for(n, 256), 256, 0, stream>>>(ids.data_ptr<int>(),
                                                              by_weight ? weights.data_ptr<float>() : nullptr, n, E,
                                                              by_weight, keys_in, copies_in, counts.data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    int expert_bits = 1;
    while ((int64_t{1} << expert_bits) <= num_experts) ++expert_bits;
    const int end_bit = by_weight ? 32 + expert_bits : expert_bits;
    size_t temp_bytes = 0;
    C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, keys_out, copies_in, copies_out,
                                                   static_cast<int>(n), 0, end_bit, stream));
    at::Tensor temp = at::empty({static_cast<int64_t>(temp_bytes)}, ids.options().dtype(at::kByte));
    C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data_ptr(), temp_bytes, keys_in, keys_out, copies_in,
                                                   copies_out, static_cast<int>(n), 0, end_bit, stream));
    permute_plan_kernel<<<1, kScanThreads, 0, stream>>>(counts.data_ptr<int>(), E, static_cast<int>(capacity),
                                                         !reroute, seg_start, kept, out_start, offs.data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    at::Tensor overflow_copies, assigned;  // reroute: the overflowing copies (then their count), their places
    if (reroute) {
      const at::Tensor fallback = fallback_in->contiguous();
      const int F = static_cast<int>(fallback.size(1));
      at::Tensor overflow = at::empty({n}, ids.options().dtype(at::kByte));
      overflow_copies = at::empty({n + 1}, int_opts);
      assigned = at::empty({2, n}, int_opts);
      int* num_overflow = overflow_copies.data_ptr<int>() + n;
      mark_overflow_kernel<<<grid_for(n, 256), 256, 0, stream>>>(keys_out, copies_out, n, E, by_weight, seg_start,
                                                                 kept, overflow.data_ptr<uint8_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      size_t select_bytes = 0;
      const int* copy_index = copies_in;  // still 0..n-1: the sort wrote to copies_out
      C10_CUDA_CHECK(cub::DeviceSelect::Flagged(nullptr, select_bytes, copy_index, overflow.data_ptr<uint8_t>(),
                                                overflow_copies.data_ptr<int>(), num_overflow, static_cast<int>(n),
                                                stream));
      at::Tensor select_temp = at::empty({static_cast<int64_t>(select_bytes)}, ids.options().dtype(at::kByte));
      C10_CUDA_CHECK(cub::DeviceSelect::Flagged(select_temp.data_ptr(), select_bytes, copy_index,
                                                overflow.data_ptr<uint8_t>(), overflow_copies.data_ptr<int>(),
                                                num_overflow, static_cast<int>(n), stream));
      const size_t smem = (2 * static_cast<size_t>(E) + static_cast<size_t>(kRerouteWindow) * (F + 1)) * sizeof(int);
      TORCH_CHECK(smem <= 200 * 1024, "moe_permute: reroute with E = ", E, " and F = ", F,
                  " needs more shared memory than a block has; use fewer fallback experts");
      set_smem(reroute_kernel, smem);
      reroute_kernel<<<1, kScanThreads, smem, stream>>>(
          overflow_copies.data_ptr<int>(), num_overflow, fallback.data_ptr<int>(), F, static_cast<int>(k), E,
          static_cast<int>(capacity), kept, assigned[0].data_ptr<int>(), assigned[1].data_ptr<int>(), out_start,
          offs.data_ptr<int>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    scatter_kept_kernel<<<grid_for(n, 256), 256, 0, stream>>>(keys_out, copies_out, n, E, by_weight, seg_start, kept,
                                                              out_start, row_map.data_ptr<int>(),
                                                              copy_row.data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (reroute) {
      scatter_rerouted_kernel<<<grid_for(n, 256), 256, 0, stream>>>(
          overflow_copies.data_ptr<int>(), overflow_copies.data_ptr<int>() + n, assigned[0].data_ptr<int>(),
          assigned[1].data_ptr<int>(), kept, out_start, row_map.data_ptr<int>(), copy_row.data_ptr<int>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  } else {
    offs.zero_();
  }
  if (M > 0 && D > 0) {
    const int64_t row_bytes = D * x.element_size();
    launch_rows(row_bytes, x.data_ptr(), x_sorted.data_ptr(), [&](auto vec) {
      constexpr int kVec = decltype(vec)::value;
      auto* out = static_cast<char*>(x_sorted.data_ptr());
      if (n > 0) {
        scatter_rows_kernel<kVec><<<T, kRowThreads, 0, stream>>>(static_cast<const char*>(x.data_ptr()), out,
                                                                  row_bytes, copy_row.data_ptr<int>(),
                                                                  static_cast<int>(k));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      const int zero_blocks = std::min(grid_for(M * row_bytes / kVec, 256), 1024);  // grid-stride
      zero_rows_kernel<kVec><<<zero_blocks, 256, 0, stream>>>(out, row_bytes, M, offs.data_ptr<int>(), E);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return {x_sorted, row_map, offs};
}

namespace {

__global__ void invert_row_map_kernel(const int* __restrict__ row_map, int64_t M, int64_t copies,
                                      int* __restrict__ copy_row) {
  for (int64_t m = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; m < M;
       m += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int c = row_map[m];
    if (c >= 0 && c < copies) copy_row[c] = static_cast<int>(m);
  }
}

// y[t] = sum_j w[t,j] * y_sorted[copy_row[t*k+j]]: one block per token, 8 channels per access.
template <typename T, int kVec>
__global__ void __launch_bounds__(kRowThreads) combine_kernel(const T* __restrict__ ys, const int* __restrict__ copy_row,
                                                              const float* __restrict__ w, int64_t D, int k,
                                                              T* __restrict__ y) {
  const int64_t t = blockIdx.x;
  for (int64_t d0 = threadIdx.x * kVec; d0 < D; d0 += blockDim.x * kVec) {
    float acc[kVec] = {};
    for (int j = 0; j < k; ++j) {
      const int m = copy_row[t * k + j];
      if (m < 0) continue;
      const float wj = w[t * k + j];
      T v[kVec];
      if constexpr (kVec == 8) {
        *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(ys + m * D + d0);
      } else {
        v[0] = ys[m * D + d0];
      }
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[i] += wj * to_float(v[i]);
    }
    T out[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) out[i] = from_float<T>(acc[i]);
    if constexpr (kVec == 8) {
      *reinterpret_cast<uint4*>(y + t * D + d0) = *reinterpret_cast<const uint4*>(out);
    } else {
      y[t * D + d0] = out[0];
    }
  }
}

// grad_ys[m] = w[c] * dy[t]; grad_w[c] = <dy[t], ys[m]> (c = row_map[m], t = c / k).
template <typename T>
__global__ void __launch_bounds__(kRowThreads) combine_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ ys,
                                                                  const int* __restrict__ row_map,
                                                                  const float* __restrict__ w, int64_t D, int k,
                                                                  int64_t copies, T* __restrict__ grad_ys,
                                                                  float* __restrict__ grad_w) {
  __shared__ float warp_sums[kRowThreads / kWarpSize];
  const int64_t m = blockIdx.x;
  const int c = row_map[m];
  T* g_row = grad_ys + m * D;
  if (c < 0 || c >= copies) {
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) g_row[d] = from_float<T>(0.f);
    return;
  }
  const T* dy_row = dy + static_cast<int64_t>(c / k) * D;
  const T* y_row = ys + m * D;
  const float wc = w[c];
  float dot = 0.f;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    const float g = to_float(dy_row[d]);
    dot += g * to_float(y_row[d]);
    g_row[d] = from_float<T>(wc * g);
  }
  dot = warp_reduce(dot, SumOp{});
  if (threadIdx.x % kWarpSize == 0) warp_sums[threadIdx.x / kWarpSize] = dot;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (int i = 0; i < kRowThreads / kWarpSize; ++i) total += warp_sums[i];
    grad_w[c] = total;
  }
}

}  // namespace

at::Tensor unpermute_cuda(const at::Tensor& y_sorted_in, const at::Tensor& row_map_in, const at::Tensor& weights_in,
                          int64_t num_tokens) {
  check_unpermute(y_sorted_in, row_map_in, weights_in, num_tokens);
  const c10::cuda::CUDAGuard guard(y_sorted_in.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor ys = y_sorted_in.contiguous();
  const at::Tensor row_map = row_map_in.contiguous();
  const at::Tensor w = weights_in.to(at::kFloat).contiguous();
  const int64_t M = ys.size(0), D = ys.size(1), k = w.size(1), copies = num_tokens * k;
  at::Tensor y = at::empty({num_tokens, D}, ys.options());
  if (num_tokens == 0 || D == 0) return y;
  at::Tensor copy_row = at::full({copies}, -1, row_map.options());
  if (M > 0) {
    invert_row_map_kernel<<<grid_for(M, 256), 256, 0, stream>>>(row_map.data_ptr<int>(), M, copies,
                                                                copy_row.data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  KDA_DISPATCH_CUDA_FLOATING(ys.scalar_type(), "moe_unpermute", [&] {
    const bool vec = D % 8 == 0 && sizeof(scalar_t) == 2 && reinterpret_cast<uintptr_t>(ys.data_ptr()) % 16 == 0;
    auto launch = [&](auto vec_width) {
      constexpr int kVec = decltype(vec_width)::value;
      combine_kernel<scalar_t, kVec><<<num_tokens, kRowThreads, 0, stream>>>(
          static_cast<const scalar_t*>(ys.data_ptr()), copy_row.data_ptr<int>(), w.data_ptr<float>(), D,
          static_cast<int>(k), static_cast<scalar_t*>(y.data_ptr()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (vec) {
      launch(std::integral_constant<int, 8>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> unpermute_bwd_cuda(const at::Tensor& grad_y_in, const at::Tensor& y_sorted_in,
                                                      const at::Tensor& row_map_in, const at::Tensor& weights_in) {
  check_unpermute_bwd(grad_y_in, y_sorted_in, row_map_in, weights_in);
  const c10::cuda::CUDAGuard guard(y_sorted_in.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor dy = grad_y_in.contiguous();
  const at::Tensor ys = y_sorted_in.contiguous();
  const at::Tensor row_map = row_map_in.contiguous();
  const at::Tensor w = weights_in.to(at::kFloat).contiguous();
  const int64_t M = ys.size(0), D = ys.size(1), k = w.size(1);
  at::Tensor grad_ys = at::empty_like(ys);
  at::Tensor grad_w = at::zeros({w.numel()}, w.options());
  if (M > 0) {
    KDA_DISPATCH_CUDA_FLOATING(ys.scalar_type(), "moe_unpermute_bwd", [&] {
      combine_bwd_kernel<scalar_t><<<M, kRowThreads, 0, stream>>>(
          static_cast<const scalar_t*>(dy.data_ptr()), static_cast<const scalar_t*>(ys.data_ptr()),
          row_map.data_ptr<int>(), w.data_ptr<float>(), D, static_cast<int>(k), w.numel(),
          static_cast<scalar_t*>(grad_ys.data_ptr()), grad_w.data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return {grad_ys, grad_w.view(weights_in.sizes()).to(weights_in.scalar_type())};
}

}  // namespace kda_dsa_ops::moe
