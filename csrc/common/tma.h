// Host side of the Hopper kernels: the check that the device and the build have sm_90a, and the
// creation of TMA tensor maps (CUtensorMap) for 16-bit operands with 128-byte swizzle. The
// driver entry point is looked up through the runtime, so nothing links libcuda.
#pragma once

#include <ATen/ATen.h>
#include <cuda.h>

#include <array>
#include <cstdint>

namespace kda_dsa_ops {

// Whether `t` is on an sm_90 device and this build has sm_90a code (wgmma, TMA); check_sm90
// raises where not.
bool is_sm90(const at::Tensor& t);
void check_sm90(const at::Tensor& t, const char* op);

// A tiled tensor map over `t`'s storage. dims/box are innermost first (dims[0] is the
// contiguous dimension); strides are in elements for dims 1..rank-1. Out-of-bounds reads of
// a box are filled with zeros.
template <int kRank>
CUtensorMap make_tensor_map_sw128(const at::Tensor& t, const std::array<uint64_t, kRank>& dims,
                                  const std::array<uint64_t, kRank - 1>& strides,
                                  const std::array<uint32_t, kRank>& box, const char* name);

}  // namespace kda_dsa_ops
