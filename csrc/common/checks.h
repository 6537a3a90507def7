// Argument checks shared by every launcher. Each message names the argument, what was
// expected and what was given, so that a user can act on it.
#pragma once

#include <ATen/ATen.h>

#include <initializer_list>
#include <string>

namespace kda_dsa_ops {

// Checks on the *values* of device tensors (index ranges, monotone offsets) need a copy to
// the host, i.e. a synchronisation. They always run on CPU tensors; on CUDA tensors they run
// only while enabled (KDA_DSA_OPS_CHECK_VALUES=1 or kda_dsa_ops.set_value_checks(True)).
// Disabled, CUDA kernels stay safe on bad values: they never touch memory out of bounds
// (see each op's documentation for what such values produce).
bool value_checks_enabled();
void set_value_checks(bool enabled);
inline bool run_value_checks(const at::Tensor& t) { return !t.is_cuda() || value_checks_enabled(); }

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

}  // namespace kda_dsa_ops
