// Every schema of torch.ops.kda_dsa_ops, and the registration of each backend's kernels.
// The Python module _C exists to load this library; it also reports how it was built.
#include <Python.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "act/act.h"
#include "common/checks.h"
#include "dsa/dsa.h"
#include "hc/hc.h"
#include "kda/kda.h"
#include "loss/ce.h"
#include "moe/moe.h"

namespace kda_dsa_ops {

namespace {
struct SwitchEntry {
  const char* name;
  const char* env;
  std::atomic<bool> on;
};
constexpr int kSwitches = static_cast<int>(Switch::kPortableSfa) + 1;
// In the order of Switch; each starts from its environment variable ("" and "0" are off).
SwitchEntry* switches() {
  static SwitchEntry table[kSwitches] = {{"value_checks", "KDA_DSA_OPS_CHECK_VALUES", {false}},
                                         {"portable_sfa", "KDA_DSA_OPS_PORTABLE_SFA", {false}}};
  static const bool read = [] {
    for (auto& e : table) {
      const char* v = std::getenv(e.env);
      e.on = v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
    }
    return true;
  }();
  (void)read;
  return table;
}

SwitchEntry* switch_named(const char* name) {
  for (int i = 0; i < kSwitches; ++i) {
    if (std::strcmp(switches()[i].name, name) == 0) return &switches()[i];
  }
  return nullptr;
}
}  // namespace

bool switch_on(Switch s) { return switches()[static_cast<int>(s)].on.load(std::memory_order_relaxed); }
void set_switch(Switch s, bool on) { switches()[static_cast<int>(s)].on.store(on, std::memory_order_relaxed); }

}  // namespace kda_dsa_ops

TORCH_LIBRARY(kda_dsa_ops, m) {
  // KDA, chunked: o [B,T,HV,V] in q's dtype; final_state [N,HV,K,V] fp32 (fp64 for fp64 inputs), [0] when not asked for.
  // With A_log, g is the raw gate (fla 0.6's use_gate_in_kernel: dt_bias, lower_bound 0 for the softplus gate);
  // beta_scale 1 or 2: beta is raw, beta_scale * sigmoid(beta) (kda/kda.h, Gate).
  m.def("kda_fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor? initial_state, "
        "Tensor? cu_seqlens, bool output_final_state, bool use_qk_l2norm, bool bf16_products=False, "
        "Tensor? A_log=None, Tensor? dt_bias=None, float lower_bound=0., float beta_scale=0.) -> (Tensor, Tensor)");
  // (dq, dk, dv, dg, dbeta, dinitial_state, dA_log, ddt_bias); dinitial_state is [0] without an initial_state,
  // dA_log [HV] and ddt_bias [HV*K] (accumulation type) are [0] without A_log, dt_bias.
  m.def("kda_bwd(Tensor grad_o, Tensor? grad_final_state, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
        "float scale, Tensor? initial_state, Tensor? cu_seqlens, bool use_qk_l2norm, bool bf16_products=False, "
        "Tensor? A_log=None, Tensor? dt_bias=None, float lower_bound=0., float beta_scale=0.) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
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
  // Hyper-connections: y [T,m,D] = a [T,m,n] applied to x [T,n,D] per token (+ b[..., None] * z[:, None]).
  m.def("hc_mix(Tensor x, Tensor a, Tensor? z, Tensor? b) -> Tensor");
  // (dx, da, dz, db); dz and db are [0] without z, b.
  m.def("hc_mix_bwd(Tensor grad_y, Tensor x, Tensor a, Tensor? z, Tensor? b) -> (Tensor, Tensor, Tensor, Tensor)");
  // Cross-entropy per row of logits [N,V]: loss [N] (accumulation type) and argmax [N] int64 (-1: ignored or
  // no logit above -inf); with write_grad the logits become scale * (softmax - onehot) in place.
  m.def("cross_entropy_rows_(Tensor(a!) logits, Tensor labels, int ignore_index, float scale, bool write_grad) "
        "-> (Tensor, Tensor)");
  // Short causal depthwise convolution + SiLU over packed sequences: x [T,C], weight [C,W], pos [T], halo [W-1,C].
  m.def("short_conv(Tensor x, Tensor weight, Tensor pos, Tensor? halo) -> Tensor");
  // (dx, dweight, dhalo); dweight is [0] without weight_grad, dhalo [0] without a halo.
  m.def("short_conv_bwd(Tensor grad_y, Tensor x, Tensor weight, Tensor pos, Tensor? halo, bool weight_grad) "
        "-> (Tensor, Tensor, Tensor)");
  // SwiGLU of gate_up [...,2F] = [gate, up] -> [...,F]; limit > 0: GLM-5.3's clamps first.
  m.def("swiglu(Tensor gate_up, float limit) -> Tensor");
  m.def("swiglu_bwd(Tensor grad_h, Tensor gate_up, float limit) -> Tensor");
}

// One implementation per dispatch key, each checking its arguments (kda.cpp, dsa.cpp, moe_args.cpp, hc.cpp,
// ce.cpp, act.cpp).
TORCH_LIBRARY_IMPL(kda_dsa_ops, CPU, m) {
  using namespace kda_dsa_ops;
  m.impl("kda_fwd", &kda::kda_fwd_cpu);
  m.impl("kda_bwd", &kda::kda_bwd_cpu);
  m.impl("lightning_indexer_fwd", &dsa::lightning_indexer_fwd_cpu);
  m.impl("lightning_indexer_bwd", &dsa::lightning_indexer_bwd_cpu);
  m.impl("sparse_attn_fwd", &dsa::sparse_attn_fwd_cpu);
  m.impl("sparse_attn_bwd", &dsa::sparse_attn_bwd_cpu);
  m.impl("moe_route", &moe::route_cpu);
  m.impl("moe_route_bwd", &moe::route_bwd_cpu);
  m.impl("moe_permute", &moe::permute_cpu);
  m.impl("moe_unpermute", &moe::unpermute_cpu);
  m.impl("moe_unpermute_bwd", &moe::unpermute_bwd_cpu);
  m.impl("grouped_mm", &moe::grouped_mm_cpu);
  m.impl("grouped_mm_wgrad", &moe::grouped_mm_wgrad_cpu);
  m.impl("hc_mix", &hc::hc_mix_cpu);
  m.impl("hc_mix_bwd", &hc::hc_mix_bwd_cpu);
  m.impl("cross_entropy_rows_", &loss::cross_entropy_rows_cpu);
  m.impl("short_conv", &act::short_conv_cpu);
  m.impl("short_conv_bwd", &act::short_conv_bwd_cpu);
  m.impl("swiglu", &act::swiglu_cpu);
  m.impl("swiglu_bwd", &act::swiglu_bwd_cpu);
}

#ifdef KDA_DSA_OPS_WITH_CUDA
TORCH_LIBRARY_IMPL(kda_dsa_ops, CUDA, m) {
  using namespace kda_dsa_ops;
  m.impl("kda_fwd", &kda::kda_fwd_cuda);
  m.impl("kda_bwd", &kda::kda_bwd_cuda);
  m.impl("lightning_indexer_fwd", &dsa::lightning_indexer_fwd_cuda);
  m.impl("lightning_indexer_bwd", &dsa::lightning_indexer_bwd_cuda);
  m.impl("sparse_attn_fwd", &dsa::sparse_attn_fwd_cuda);
  m.impl("sparse_attn_bwd", &dsa::sparse_attn_bwd_cuda);
  m.impl("moe_route", &moe::route_cuda);
  m.impl("moe_route_bwd", &moe::route_bwd_cuda);
  m.impl("moe_permute", &moe::permute_cuda);
  m.impl("moe_unpermute", &moe::unpermute_cuda);
  m.impl("moe_unpermute_bwd", &moe::unpermute_bwd_cuda);
  m.impl("grouped_mm", &moe::grouped_mm_cuda);
  m.impl("grouped_mm_wgrad", &moe::grouped_mm_wgrad_cuda);
  m.impl("hc_mix", &hc::hc_mix_cuda);
  m.impl("hc_mix_bwd", &hc::hc_mix_bwd_cuda);
  m.impl("cross_entropy_rows_", &loss::cross_entropy_rows_cuda);
  m.impl("short_conv", &act::short_conv_cuda);
  m.impl("short_conv_bwd", &act::short_conv_bwd_cuda);
  m.impl("swiglu", &act::swiglu_cuda);
  m.impl("swiglu_bwd", &act::swiglu_bwd_cuda);
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

// _C.switch(name) -> bool and _C.set_switch(name, on): the switches of common/switches.h.
kda_dsa_ops::SwitchEntry* switch_arg(PyObject* name) {
  PyObject* ascii = PyUnicode_Check(name) ? PyUnicode_AsASCIIString(name) : nullptr;  // the limited API's way
  PyErr_Clear();
  kda_dsa_ops::SwitchEntry* e = ascii != nullptr ? kda_dsa_ops::switch_named(PyBytes_AsString(ascii)) : nullptr;
  Py_XDECREF(ascii);
  if (e == nullptr) PyErr_SetString(PyExc_ValueError, "unknown switch: the switches are 'value_checks', 'portable_sfa'");
  return e;
}

PyObject* get_switch(PyObject*, PyObject* name) {
  kda_dsa_ops::SwitchEntry* e = switch_arg(name);
  if (e == nullptr) return nullptr;
  return PyBool_FromLong(e->on.load());
}

PyObject* set_switch(PyObject*, PyObject* args) {
  PyObject *name, *value;
  if (!PyArg_UnpackTuple(args, "set_switch", 2, 2, &name, &value)) return nullptr;
  kda_dsa_ops::SwitchEntry* e = switch_arg(name);
  const int on = e != nullptr ? PyObject_IsTrue(value) : -1;
  if (on < 0) return nullptr;
  e->on.store(on != 0);
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"build_info", build_info, METH_NOARGS, "Version, backends and CUDA archs this build holds."},
    {"switch", get_switch, METH_O, "Whether the named run-time switch is on."},
    {"set_switch", set_switch, METH_VARARGS, "Turn the named run-time switch on or off."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_C", "kda_dsa_ops native library", -1, kMethods,
                       nullptr, nullptr, nullptr, nullptr};

}  // namespace

extern "C" PyObject* PyInit__C(void) { return PyModule_Create(&kModule); }
