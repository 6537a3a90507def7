#include "common/tma.h"

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <mutex>
#include <string>

namespace kda_dsa_ops {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status);
    TORCH_CHECK(err == cudaSuccess && status == cudaDriverEntryPointSuccess && ptr != nullptr,
                "kda_dsa_ops: the CUDA driver has no cuTensorMapEncodeTiled (needs a CUDA 12+ driver)");
    fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  });
  return fn;
}

// The compute capability of t's device as 10 major + minor.
int device_sm(const at::Tensor& t) {
  int major = 0, minor = 0;
  const int device = t.get_device();
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return 10 * major + minor;
}

bool built_for_sm90a() { return std::string(KDA_DSA_OPS_CUDA_ARCHS).find("9.0a") != std::string::npos; }

}  // namespace

bool is_sm90(const at::Tensor& t) { return device_sm(t) == 90 && built_for_sm90a(); }

void check_sm90(const at::Tensor& t, const char* op) {
  const int sm = device_sm(t);
  TORCH_CHECK(sm == 90, op, ": the CUDA kernel needs a Hopper GPU (sm_90), got sm_", sm);
  TORCH_CHECK(built_for_sm90a(), op, ": this build has no sm_90a code (TORCH_CUDA_ARCH_LIST='",
              KDA_DSA_OPS_CUDA_ARCHS, "'); rebuild with TORCH_CUDA_ARCH_LIST=9.0a");
}

template <int kRank>
CUtensorMap make_tensor_map_sw128(const at::Tensor& t, const std::array<uint64_t, kRank>& dims,
                                  const std::array<uint64_t, kRank - 1>& strides,
                                  const std::array<uint32_t, kRank>& box, const char* name) {
  TORCH_CHECK(t.element_size() == 2, "kda_dsa_ops: TMA maps here are for 16-bit tensors, ", name, " has ",
              t.scalar_type());
  const auto dtype = t.scalar_type() == at::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
              " must start at a 16-byte aligned address for the TMA unit; call .contiguous() or clone()");
  std::array<cuuint64_t, kRank> gdim;
  std::array<cuuint64_t, kRank - 1> gstride;
  std::array<cuuint32_t, kRank> bdim, estride;
  for (int i = 0; i < kRank; ++i) {
    gdim[i] = dims[i];
    bdim[i] = box[i];
    estride[i] = 1;
  }
  for (int i = 0; i < kRank - 1; ++i) {
    gstride[i] = strides[i] * 2;
    TORCH_CHECK(gstride[i] % 16 == 0, name, ": stride ", strides[i],
                " (elements) must be a multiple of 8 for the TMA unit (16-byte aligned rows); pad the inner "
                "dimension to a multiple of 8");
  }
  CUtensorMap map;
  const CUresult res = encode_tiled_fn()(&map, dtype, kRank, t.data_ptr(), gdim.data(), gstride.data(), bdim.data(),
                                         estride.data(), CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                         CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(res == CUDA_SUCCESS, "kda_dsa_ops: cuTensorMapEncodeTiled failed (error ", static_cast<int>(res),
              ") for ", name, " of shape ", t.sizes(), " and strides ", t.strides());
  return map;
}

template CUtensorMap make_tensor_map_sw128<2>(const at::Tensor&, const std::array<uint64_t, 2>&,
                                              const std::array<uint64_t, 1>&, const std::array<uint32_t, 2>&,
                                              const char*);
template CUtensorMap make_tensor_map_sw128<3>(const at::Tensor&, const std::array<uint64_t, 3>&,
                                              const std::array<uint64_t, 2>&, const std::array<uint32_t, 3>&,
                                              const char*);

}  // namespace kda_dsa_ops
