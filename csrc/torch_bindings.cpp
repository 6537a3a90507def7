// Every schema of torch.ops.kda_dsa_ops, and the registration of each backend's kernels.
// The Python module _C exists to load this library; it also reports how it was built.
#include <Python.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "common/checks.h"
#include "dsa/dsa.h"
#include "kda/kda.h"
#include "moe/moe.h"

namespace kda_dsa_ops {

namespace {
std::atomic<bool>& value_checks_flag() {
  static std::atomic<bool> flag{[] {
    const char* env = std::getenv("KDA_DSA_OPS_CHECK_VALUES");
    return env != nullptr && std::strcmp(env, "0") != 0 && env[0] != '\0';
  }()};
  return flag;
}
}  // namespace

bool value_checks_enabled() { return value_checks_flag().load(std::memory_order_relaxed); }
void set_value_checks(bool enabled) { value_checks_flag().store(enabled, std::memory_order_relaxed); }

}  // namespace kda_dsa_ops

TORCH_LIBRARY(kda_dsa_ops, m) {
  // KDA, chunked: o [B,T,HV,V] in q's dtype; final_state [N,HV,K,V] fp32 (fp64 for fp64 inputs), [0] when not asked for.
  m.def("kda_fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor? initial_state, "
        "Tensor? cu_seqlens, bool output_final_state, bool use_qk_l2norm, bool bf16_products=False) -> (Tensor, Tensor)");
  // (dq, dk, dv, dg, dbeta, dinitial_state); dinitial_state is [0] without an initial_state.
  m.def("kda_bwd(Tensor grad_o, Tensor? grad_final_state, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
        "float scale, Tensor? initial_state, Tensor? cu_seqlens, bool use_qk_l2norm, bool bf16_products=False) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // Lightning indexer: indices [T,topk] int32 (-1 past the visible keys), scores [T,topk] fp32.
  m.def("lightning_indexer_fwd(Tensor q, Tensor k, Tensor w, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int topk) "
        "-> (Tensor, Tensor)");
  m.def("lightning_indexer_bwd(Tensor q, Tensor k, Tensor w, Tensor indices, Tensor grad_scores) "
        "-> (Tensor, Tensor, Tensor)");
  // Sparse attention: o [T,H,dv], lse [T,H] fp32, p [T,Hkv,topk] fp32 ([0] unless return_p).
  // deterministic only travels to the backward: bitwise-reproducible dkv.
  m.def("sparse_attn_fwd(Tensor q, Tensor kv, Tensor indices, float scale, int dv, Tensor? gate, bool return_p, "
        "bool deterministic=False) "
        "-> (Tensor, Tensor, Tensor)");
  // (dq, dkv, dgate); dgate is [0] without a gate.
  m.def("sparse_attn_bwd(Tensor grad_o, Tensor q, Tensor kv, Tensor indices, Tensor o, Tensor lse, float scale, "
        "int dv, Tensor? gate, bool deterministic) -> (Tensor, Tensor, Tensor)");
  // MoE routing: weights [T,k] fp32, ids [T,k] int32; n_group > 1: group-limited (topk_group of n_group groups).
  m.def("moe_route(Tensor logits, Tensor? bias, int k, str score_fn, bool renorm, float scale, int n_group=1, "
        "int topk_group=1) -> (Tensor, Tensor)");
  m.def("moe_route_bwd(Tensor grad_weights, Tensor logits, Tensor ids, str score_fn, bool renorm, float scale) -> Tensor");
  // MoE permutation: x_sorted [M,D], row_map [M] int32, offs [E] int32.
  m.def("moe_permute(Tensor x, Tensor ids, Tensor? weights, int num_experts, int capacity, str policy, "
        "Tensor? fallback_ids) -> (Tensor, Tensor, Tensor)");
  m.def("moe_unpermute(Tensor y_sorted, Tensor row_map, Tensor weights, int num_tokens) -> Tensor");
  m.def("moe_unpermute_bwd(Tensor grad_y, Tensor y_sorted, Tensor row_map, Tensor weights) -> (Tensor, Tensor)");
  // Grouped expert GEMM, torch._grouped_mm semantics (2-D a, 3-D b; 2-D a, 2-D dy for the weight gradient).
  m.def("grouped_mm(Tensor a, Tensor b, Tensor offs) -> Tensor");
  m.def("grouped_mm_wgrad(Tensor a, Tensor dy, Tensor offs) -> Tensor");
}

namespace {
// Entry points that check their arguments once and pick the backend by the inputs' device:
// the same functions serve the CPU and the CUDA keys.
void register_device_dispatching(torch::Library& m) {
  m.impl("kda_fwd", &kda_dsa_ops::kda::kda_fwd);
  m.impl("kda_bwd", &kda_dsa_ops::kda::kda_bwd);
  m.impl("lightning_indexer_fwd", &kda_dsa_ops::dsa::lightning_indexer_fwd);
  m.impl("lightning_indexer_bwd", &kda_dsa_ops::dsa::lightning_indexer_bwd);
  m.impl("sparse_attn_fwd", &kda_dsa_ops::dsa::sparse_attn_fwd);
  m.impl("sparse_attn_bwd", &kda_dsa_ops::dsa::sparse_attn_bwd);
}
}  // namespace

TORCH_LIBRARY_IMPL(kda_dsa_ops, CPU, m) {
  using namespace kda_dsa_ops::moe;
  register_device_dispatching(m);
  m.impl("moe_route", &route_cpu);
  m.impl("moe_route_bwd", &route_bwd_cpu);
  m.impl("moe_permute", &permute_cpu);
  m.impl("moe_unpermute", &unpermute_cpu);
  m.impl("moe_unpermute_bwd", &unpermute_bwd_cpu);
  m.impl("grouped_mm", &grouped_mm_cpu);
  m.impl("grouped_mm_wgrad", &grouped_mm_wgrad_cpu);
}

#ifdef KDA_DSA_OPS_WITH_CUDA
TORCH_LIBRARY_IMPL(kda_dsa_ops, CUDA, m) {
  using namespace kda_dsa_ops::moe;
  register_device_dispatching(m);
  m.impl("moe_route", &route_cuda);
  m.impl("moe_route_bwd", &route_bwd_cuda);
  m.impl("moe_permute", &permute_cuda);
  m.impl("moe_unpermute", &unpermute_cuda);
  m.impl("moe_unpermute_bwd", &unpermute_bwd_cuda);
  m.impl("grouped_mm", &grouped_mm_cuda);
  m.impl("grouped_mm_wgrad", &grouped_mm_wgrad_cuda);
}
#endif

namespace {

#ifdef KDA_DSA_OPS_WITH_CUDA
constexpr const char* kBackends = "cpu,cuda";
#else
constexpr const char* kBackends = "cpu";
#endif

PyObject* build_info(PyObject*, PyObject*) {
  return Py_BuildValue("{s:s,s:s,s:s}", "version", KDA_DSA_OPS_VERSION, "backends", kBackends, "cuda_archs",
                       KDA_DSA_OPS_CUDA_ARCHS);
}

PyObject* get_value_checks(PyObject*, PyObject*) { return PyBool_FromLong(kda_dsa_ops::value_checks_enabled()); }

PyObject* set_value_checks(PyObject*, PyObject* arg) {
  const int enabled = PyObject_IsTrue(arg);
  if (enabled < 0) return nullptr;
  kda_dsa_ops::set_value_checks(enabled != 0);
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"build_info", build_info, METH_NOARGS, "Version, backends and CUDA archs this build holds."},
    {"value_checks", get_value_checks, METH_NOARGS, "Whether value checks run on CUDA tensors."},
    {"set_value_checks", set_value_checks, METH_O, "Turn value checks on CUDA tensors on or off."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_C", "kda_dsa_ops native library", -1, kMethods,
                       nullptr, nullptr, nullptr, nullptr};

}  // namespace

extern "C" PyObject* PyInit__C(void) { return PyModule_Create(&kModule); }
