// Argument checks shared by every launcher. Each message names the argument, what was
// expected and what was given, so that a user can act on it.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <initializer_list>
#include <string>
#include <vector>

#include "common/switches.h"

namespace kda_dsa_ops {

// Checks on the *values* of device tensors (index ranges, monotone offsets) need a copy to
// the host, i.e. a synchronisation. They always run on CPU tensors; on CUDA tensors they run
// only while enabled (KDA_DSA_OPS_CHECK_VALUES=1 or kda_dsa_ops.set_value_checks(True)).
// Disabled, CUDA kernels stay safe on bad values: they never touch memory out of bounds
// (see each op's documentation for what such values produce).
inline bool run_value_checks(const at::Tensor& t) { return !t.is_cuda() || switch_on(Switch::kValueChecks); }

inline std::string shape_str(const at::Tensor& t) { return c10::str(t.sizes()); }

inline void check_dim(const at::Tensor& t, int64_t dim, const char* name, const char* shape_doc) {
  TORCH_CHECK(t.dim() == dim, name, " must be ", dim, "-D ", shape_doc, ", got shape ", shape_str(t));
}

inline void check_dtype(const at::Tensor& t, std::initializer_list<at::ScalarType> allowed, const char* name) {
  for (auto s : allowed) {
    if (t.scalar_type() == s) return;
  }
  std::string list;
  for (auto s : allowed) list += std::string(list.empty() ? "" : ", ") + c10::toString(s);
  TORCH_CHECK(false, name, " must have dtype in {", list, "}, got ", t.scalar_type());
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* name, const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), name, " must be on the same device as ", ref_name, " (", ref.device(),
              "), got ", t.device());
}

// A host copy of an int32 tensor's values (value checks only: a synchronisation on CUDA).
inline std::vector<int32_t> host_values(const at::Tensor& t) {
  const at::Tensor h = t.to(at::kCPU).contiguous();
  return std::vector<int32_t>(h.data_ptr<int32_t>(), h.data_ptr<int32_t>() + h.numel());
}

// Every entry of an int32 index tensor lies in [lo, hi) (a value check).
inline void check_index_range(const at::Tensor& idx, int64_t lo, int64_t hi, const char* op, const char* name) {
  if (idx.numel() == 0 || !run_value_checks(idx)) return;
  const auto values = host_values(idx);
  const auto [mn, mx] = std::minmax_element(values.begin(), values.end());
  TORCH_CHECK(*mn >= lo && *mx < hi, op, ": ", name, " values must lie in [", lo, ", ", hi, "), got values in [", *mn,
              ", ", *mx, "]");
}

// cu_seqlens: int32 [N + 1] on ref's device, N >= 1; its values (a value check) start at 0, never
// decrease and end at total (the packed length, called total_name in messages). Returns N.
inline int64_t check_cu_seqlens(const at::Tensor& cu, int64_t total, const at::Tensor& ref, const char* op,
                                const char* name, const char* total_name) {
  TORCH_CHECK(cu.dim() == 1, op, ": ", name, " must be 1-D [N + 1], got shape ", shape_str(cu));
  TORCH_CHECK(cu.scalar_type() == at::kInt, op, ": ", name, " must have dtype Int (int32), got ", cu.scalar_type());
  check_same_device(cu, ref, name, "the inputs");
  TORCH_CHECK(cu.size(0) >= 2, op, ": ", name, " needs at least 2 entries (one sequence), got ", cu.size(0));
  if (run_value_checks(cu)) {
    const auto c = host_values(cu);
    TORCH_CHECK(c[0] == 0, op, ": ", name, " must start at 0, got ", c[0]);
    for (size_t i = 1; i < c.size(); ++i) {
      TORCH_CHECK(c[i] >= c[i - 1], op, ": ", name, " must be non-decreasing, got ", name, "[", i, "] = ", c[i],
                  " after ", c[i - 1]);
    }
    TORCH_CHECK(c.back() == total, op, ": ", name, " must end at ", total_name, " = ", total, ", got ", c.back());
  }
  return cu.size(0) - 1;
}

}  // namespace kda_dsa_ops
