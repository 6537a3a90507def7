// The library's run-time switches, read one way: each starts from its environment variable (read
// once, when the library loads) and is then set from Python through _C.set_switch.
//   value_checks   KDA_DSA_OPS_CHECK_VALUES   value checks on CUDA tensors (checks.h);
//                                             kda_dsa_ops.set_value_checks
//   portable_sfa   KDA_DSA_OPS_PORTABLE_SFA   sparse attention's MLA layouts on the portable kernels
//                                             (forward and backward) on Hopper too;
//                                             kda_dsa_ops.set_portable_sfa
#pragma once

namespace kda_dsa_ops {

// A new switch goes last (torch_bindings.cpp sizes its table from the last one) and into the table.
enum class Switch : int { kValueChecks, kPortableSfa };

bool switch_on(Switch s);
void set_switch(Switch s, bool on);

}  // namespace kda_dsa_ops
