// KDA on CUDA: the op entry points for the CUDA dispatch key, and the forward and backward as
// sequences of the stages of kda_cuda.cuh (the chunked algorithm of kda_chunk.h run by thread
// blocks); the row kernel of the generic family's input preparation.
//   generic forward    intra (fp32 terms) -> state forward (o, final state)
//   generic backward   intra -> state forward (start states) -> state backward (end-state
//                      gradients) -> chunk backward -> finishing pass
//   bf16 forward       intra_bf16 on the raw inputs -> state forward on bf16 terms (o in q's type)
//   bf16 backward      intra_bf16 -> both state passes on bf16 terms -> the three chunk kernels
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <type_traits>

#include "common/checks.h"
#include "kda/kda_cuda.cuh"

namespace kda_dsa_ops::kda {

namespace {

// Rows of K (<= 128) elements: out = x r in fp32 (load_row's r); a warp per row.
__global__ void __launch_bounds__(32 * kRowWarps) l2norm_rows_kernel(const void* x, Elem e, int64_t rows, int K,
                                                                    bool l2norm, float* out) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (row >= rows) return;
  float xs[kMaxHeadDim / 32];
  const float r = load_row(x, row * K, K, e, l2norm, xs);
#pragma unroll
  for (int i = 0; i < kMaxHeadDim / 32; ++i) {
    if (lane + 32 * i < K) out[row * K + lane + 32 * i] = xs[i] * r;
  }
}

// x [..., K] (K <= 128) in fp32, divided by sqrt(|x|^2 + 1e-6) per row when l2norm.
at::Tensor l2norm_rows_cuda(const at::Tensor& x, bool l2norm) {
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  const int64_t K = x.size(-1), rows = K > 0 ? x.numel() / K : 0;
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  if (rows > 0) {
    l2norm_rows_kernel<<<static_cast<unsigned>(ceil_div(rows, int64_t{kRowWarps})), 32 * kRowWarps, 0,
                         c10::cuda::getCurrentCUDAStream(x.get_device()).stream()>>>(
        xc.data_ptr(), elem_of(xc, "kda"), rows, static_cast<int>(K), l2norm, out.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

Launch launch_setup(const Problem& p, const at::Tensor& ref) {
  elem_of(ref, "kda");  // float64 is the CPU kernel's
  const int64_t tokens = p.B * p.T;
  // Upper bound of the chunk count that needs no look at cu_seqlens: sum ceil(len/64) <= T/64 + N.
  const int64_t slots = p.cu_seqlens.defined() ? tokens / kChunk + p.N : p.N * ((p.T + kChunk - 1) / kChunk);
  const int32_t* cu = p.cu_seqlens.defined() ? p.cu_seqlens.data_ptr<int32_t>() : nullptr;
  return Launch{Seqs{cu, p.N, p.T, tokens, slots}, c10::cuda::getCurrentCUDAStream(ref.get_device()).stream()};
}

// f(std::integral_constant<int, K>, T{}) for the bf16 kernels' head size K and input type T.
template <typename F>
void with_bf16_types(const Problem& p, const at::Tensor& q, F f) {
  const auto run = [&](auto tag) {
    if (p.K == 128) {
      f(std::integral_constant<int, 128>{}, tag);
    } else {
      f(std::integral_constant<int, 64>{}, tag);
    }
  };
  if (q.scalar_type() == at::kBFloat16) {
    run(__nv_bfloat16{});
  } else {
    run(__half{});
  }
}

template <int kK, typename T>
void run_fwd_bf16(const Problem& p, const Inputs& raw, bool l2norm, const Launch& l, T* o, float* ht) {
  std::vector<at::Tensor> keep;
  const Intra<__nv_bfloat16> w = run_intra_bf16<kK, T>(p, raw, l2norm, l, false, keep);
  if (p.N > 0) run_state_fwd_bf16<kK, T>(p, l, w, raw, o, ht, nullptr);
}

// dOs = scale dO in bf16.
template <int kK, typename T>
void run_bwd_bf16(const Problem& p, const Inputs& raw, bool l2norm, const Launch& l, const at::Tensor& dOs,
                  const float* dht, Grads& gr) {
  std::vector<at::Tensor> keep;
  const Intra<__nv_bfloat16> intra = run_intra_bf16<kK, T>(p, raw, l2norm, l, true, keep);
  using bf16 = __nv_bfloat16;
  const at::Tensor starts =
      at::empty({std::max<int64_t>(1, p.HV * l.seqs.slots * kK * p.V)}, raw.q.options().dtype(at::kBFloat16));
  const at::Tensor dends = at::empty_like(starts);
  bf16* s0 = static_cast<bf16*>(starts.data_ptr());
  bf16* ds1 = static_cast<bf16*>(dends.data_ptr());
  if (p.N > 0) {
    run_state_fwd_bf16<kK, float>(p, l, intra, raw, nullptr, nullptr, s0);
    run_state_bwd_bf16<kK>(p, l, intra, dOs, dht, ds1, gr.dinitial_state.data_ptr<float>());
  }
  run_chunk_bwd_bf16<kK, T>(p, raw, l2norm, l, intra, s0, ds1, dOs, gr);
}

// The inputs as the bf16 kernels take them: contiguous, with 16-byte aligned rows for their bulk
// copies (a view may start anywhere).
Inputs raw_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                  const at::Tensor& beta, const std::optional<at::Tensor>& initial_state) {
  const auto aligned = [](const at::Tensor& x) {
    at::Tensor c = x.contiguous();
    return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
  };
  return Inputs{aligned(q), aligned(k), aligned(v), aligned(g), beta.contiguous(),
                initial_state.has_value() ? initial_state->contiguous() : at::Tensor()};
}

void fwd_cuda(const Problem& p, const Inputs& in, at::Tensor& o, at::Tensor& final_state) {
  const c10::cuda::CUDAGuard guard(in.q.device());
  const Launch l = launch_setup(p, in.q);
  std::vector<at::Tensor> keep;
  const Intra<float> intra = run_intra(p, in, l, false, keep);
  if (p.N == 0) return;
  run_state_fwd(p, l, intra, in.initial_state.defined() ? in.initial_state.data_ptr<float>() : nullptr,
                o.data_ptr<float>(), final_state.defined() ? final_state.data_ptr<float>() : nullptr, nullptr);
}

// The bf16 family's reach: bf16-product mode with bf16 / fp16 q, k, v and K, V in {64, 128}.
bool bf16_fwd_supported(const Problem& p, const at::Tensor& q) {
  return q.is_cuda() && p.bf16_products && (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf) &&
         (p.K == 64 || p.K == 128) && (p.V == 64 || p.V == 128);
}

void fwd_cuda_bf16(const Problem& p, const Inputs& raw, bool l2norm, at::Tensor& o, at::Tensor& final_state) {
  const c10::cuda::CUDAGuard guard(raw.q.device());
  const Launch l = launch_setup(p, raw.q);
  float* ht = final_state.defined() ? final_state.data_ptr<float>() : nullptr;
  with_bf16_types(p, raw.q, [&](auto k, auto tag) {
    using T = decltype(tag);
    run_fwd_bf16<decltype(k)::value, T>(p, raw, l2norm, l, static_cast<T*>(o.data_ptr()), ht);
  });
}

void bwd_cuda_bf16(const Problem& p, const Inputs& raw, bool l2norm, const at::Tensor& dOs,
                   const at::Tensor& grad_final_state, Grads& gr) {
  const c10::cuda::CUDAGuard guard(raw.q.device());
  const Launch l = launch_setup(p, raw.q);
  const float* dht = grad_final_state.defined() ? grad_final_state.data_ptr<float>() : nullptr;
  with_bf16_types(p, raw.q, [&](auto k, auto tag) {
    run_bwd_bf16<decltype(k)::value, decltype(tag)>(p, raw, l2norm, l, dOs, dht, gr);
  });
}

void bwd_cuda(const Problem& p, const Inputs& in, const at::Tensor& q, const at::Tensor& k, bool l2norm,
              const at::Tensor& grad_o, const at::Tensor& grad_final_state, Grads& gr) {
  const c10::cuda::CUDAGuard guard(in.q.device());
  const Launch l = launch_setup(p, in.q);
  std::vector<at::Tensor> keep;
  const Intra<float> intra = run_intra(p, in, l, true, keep);
  const at::Tensor starts = at::empty({std::max<int64_t>(1, p.HV * l.seqs.slots * p.K * p.V)}, in.q.options());
  const at::Tensor dends = at::empty_like(starts);
  if (p.N > 0) {
    run_state_fwd(p, l, intra, in.initial_state.defined() ? in.initial_state.data_ptr<float>() : nullptr, nullptr,
                  nullptr, starts.data_ptr<float>());
    run_state_bwd(p, l, intra, grad_o.data_ptr<float>(),
                  grad_final_state.defined() ? grad_final_state.data_ptr<float>() : nullptr, dends.data_ptr<float>(),
                  gr.dinitial_state.data_ptr<float>());
  }
  if (p.HV * l.seqs.tokens == 0) return;
  run_chunk_bwd(p, in, l, intra, starts.data_ptr<float>(), dends.data_ptr<float>(), grad_o, q, k, l2norm, gr);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> kda_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const at::Tensor& g, const at::Tensor& beta, double scale,
                                                const std::optional<at::Tensor>& initial_state,
                                                const std::optional<at::Tensor>& cu_seqlens, bool output_final_state,
                                                bool use_qk_l2norm, bool bf16_products,
                                                const std::optional<at::Tensor>& A_log,
                                                const std::optional<at::Tensor>& dt_bias, double lower_bound,
                                                double beta_scale) {
  const Problem p = check_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, bf16_products,
                              GateArgs{A_log, dt_bias, lower_bound, beta_scale});
  at::Tensor final_state = final_state_for(p, q, output_final_state);
  at::Tensor ht = output_final_state ? final_state : at::Tensor();
  if (bf16_fwd_supported(p, q)) {  // the gate and beta in the kernels
    at::Tensor o = at::empty({p.B, p.T, p.HV, p.V}, q.options());
    fwd_cuda_bf16(p, raw_inputs(q, k, v, g, beta, initial_state), use_qk_l2norm, o, ht);
    return {o, final_state};
  }
  const auto [decay, b] = gated_inputs(p, g, beta, at::kFloat);
  const Inputs in = accumulation_inputs(l2norm_rows_cuda(q, use_qk_l2norm), l2norm_rows_cuda(k, use_qk_l2norm), v,
                                        decay, b, initial_state);
  at::Tensor o = at::empty({p.B, p.T, p.HV, p.V}, in.q.options());
  fwd_cuda(p, in, o, ht);
  return {o.to(q.scalar_type()), final_state};
}

// The gradients come out as the op returns them: dq, dk [B,T,H,K] in q's dtype (w.r.t. the raw
// q, k: through the normalisation when l2norm), dg, dbeta in the dtypes of g, beta (w.r.t. the
// raw ones with the in-kernel gate, beta), dinitial_state, dA_log, ddt_bias in fp32; dv in v's
// dtype (bf16 family) or fp32 (cast here).
BwdResult kda_bwd_cuda(const at::Tensor& grad_o, const std::optional<at::Tensor>& grad_final_state,
                       const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                       const at::Tensor& beta, double scale, const std::optional<at::Tensor>& initial_state,
                       const std::optional<at::Tensor>& cu_seqlens, bool use_qk_l2norm, bool bf16_products,
                       const std::optional<at::Tensor>& A_log, const std::optional<at::Tensor>& dt_bias,
                       double lower_bound, double beta_scale) {
  at::Tensor dht;
  const Problem p = check_bwd(grad_o, grad_final_state, q, k, v, g, beta, scale, initial_state, cu_seqlens,
                              bf16_products, GateArgs{A_log, dt_bias, lower_bound, beta_scale}, dht);
  const auto f32 = q.options().dtype(at::kFloat);
  Grads gr;
  gr.dinitial_state = at::empty({p.N, p.HV, p.K, p.V}, f32);
  gr.dq = at::empty(q.sizes(), q.options());
  gr.dk = at::empty(k.sizes(), k.options());
  if (bf16_fwd_supported(p, q)) {  // the gate's and beta's chain rule in the kernels
    gr.dg = at::empty(g.sizes(), g.options());
    gr.dbeta = at::empty(beta.sizes(), beta.options());
    if (p.gate.on()) {  // (the kernels' sums replace them where there are tokens)
      gr.dA_log = at::zeros({p.HV}, f32);
      gr.ddt_bias = at::zeros({p.HV * p.K}, f32);
    }
    // scale dO in bf16, rounded once from the product
    const at::Tensor dOs =
        (grad_o.scalar_type() == at::kBFloat16 ? grad_o * p.scale : grad_o.to(at::kFloat) * p.scale)
            .to(at::kBFloat16)
            .contiguous();
    gr.dv = at::empty(v.sizes(), v.options());
    bwd_cuda_bf16(p, raw_inputs(q, k, v, g, beta, initial_state), use_qk_l2norm, dOs, dht, gr);
    return bwd_result(p, gr, initial_state.has_value(), f32);
  }
  // w.r.t. the log-decay and beta first where the gate, beta are transformed here
  gr.dg = at::empty(g.sizes(), p.gate.on() ? f32 : g.options());
  gr.dbeta = at::empty(beta.sizes(), p.gate.beta_scale != 0 ? f32 : beta.options());
  const auto [decay, b] = gated_inputs(p, g, beta, at::kFloat);
  const Inputs in = accumulation_inputs(l2norm_rows_cuda(q, use_qk_l2norm), l2norm_rows_cuda(k, use_qk_l2norm), v,
                                        decay, b, initial_state);
  gr.dv = at::empty({p.B, p.T, p.HV, p.V}, f32);
  bwd_cuda(p, in, q.contiguous(), k.contiguous(), use_qk_l2norm, grad_o.to(at::kFloat).contiguous(), dht, gr);
  gate_grads(p, g, beta, gr);
  gr.dv = gr.dv.to(v.scalar_type());
  gr.dg = gr.dg.to(g.scalar_type());
  gr.dbeta = gr.dbeta.to(beta.scalar_type());
  return bwd_result(p, gr, initial_state.has_value(), f32);
}

}  // namespace kda_dsa_ops::kda
