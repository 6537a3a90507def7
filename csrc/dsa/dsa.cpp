// DSA op entry points: argument checks, inputs in the accumulation type, casts of the results.
#include "dsa/dsa.h"

#include <cmath>

#include "common/checks.h"
#include "common/dispatch.h"

namespace kda_dsa_ops::dsa {

namespace {

constexpr auto kFloating = {at::kBFloat16, at::kHalf, at::kFloat, at::kDouble};

at::Tensor to_acc(const at::Tensor& t, at::ScalarType acc) { return t.to(acc).contiguous(); }

void check_topk(int64_t topk, const char* op) {
  TORCH_CHECK(topk >= 1 && topk <= kMaxTopk, op, ": topk must be in [1, ", kMaxTopk, "], got ", topk);
}

struct IndexerShapes {
  int64_t T, Tk, Hi, Di;
};

IndexerShapes check_indexer_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w, const char* op) {
  check_dim(q, 3, "q", "[T, Hi, Di]");
  check_dim(k, 2, "k", "[Tk, Di]");
  check_dim(w, 2, "w", "[T, Hi]");
  check_dtype(q, kFloating, "q");
  check_dtype(k, kFloating, "k");
  check_dtype(w, kFloating, "w");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), op, ": k must have the dtype of q (", q.scalar_type(), "), got ",
              k.scalar_type());
  check_same_device(k, q, "k", "q");
  check_same_device(w, q, "w", "q");
  const IndexerShapes s{q.size(0), k.size(0), q.size(1), q.size(2)};
  TORCH_CHECK(k.size(1) == s.Di, op, ": k must be [Tk, Di] with Di = ", s.Di, " (q's), got ", shape_str(k));
  TORCH_CHECK(w.size(0) == s.T && w.size(1) == s.Hi, op, ": w must be [T, Hi] = [", s.T, ", ", s.Hi, "], got ",
              shape_str(w));
  return s;
}

#ifdef KDA_DSA_OPS_WITH_CUDA
// Contiguous rows starting on a 16-byte boundary: the CUDA kernels copy rows in 16-byte pieces
// (a contiguous view at an odd element offset is copied).
at::Tensor rows16(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}

// The CUDA kernels take 16-bit operands (fp32 accumulation) and these head sizes.
void check_cuda_dtype(const at::Tensor& q, const char* op) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, op,
              ": the CUDA kernel takes bfloat16 or float16 inputs, got ", q.scalar_type(),
              " (float32/float64 run on CPU tensors or through kda_dsa_ops.reference)");
}

void check_indexer_cuda(const IndexerShapes& s, const at::Tensor& q, const char* op) {
  check_cuda_dtype(q, op);
  TORCH_CHECK(s.Hi <= 64, op, ": the CUDA kernel takes up to 64 indexer heads, got Hi = ", s.Hi);
  TORCH_CHECK(s.Di % 8 == 0 && s.Di >= 8 && s.Di <= 128, op,
              ": the CUDA kernel takes Di a multiple of 8 from 8 to 128, got Di = ", s.Di);
}

void check_attn_cuda(const AttnProblem& p, const at::Tensor& q, const char* op) {
  check_cuda_dtype(q, op);
  TORCH_CHECK(p.Dqk % 8 == 0 && (p.Dqk <= 128 || (p.Dqk <= 576 && p.dv <= 512)), op,
              ": the CUDA kernel takes Dqk a multiple of 8, up to 128 (GQA) or up to 576 with dv <= 512 (MLA), "
              "got Dqk = ", p.Dqk, ", dv = ", p.dv);
}
#endif

AttnProblem check_attn_inputs(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& indices, double scale,
                              int64_t dv, const std::optional<at::Tensor>& gate, const char* op) {
  check_dim(q, 3, "q", "[T, H, Dqk]");
  check_dim(kv, 3, "kv", "[Tk, Hkv, Dqk]");
  check_dim(indices, 3, "indices", "[T, Hkv, topk]");
  check_dtype(q, kFloating, "q");
  TORCH_CHECK(kv.scalar_type() == q.scalar_type(), op, ": kv must have the dtype of q (", q.scalar_type(), "), got ",
              kv.scalar_type());
  check_dtype(indices, {at::kInt}, "indices");
  check_same_device(kv, q, "kv", "q");
  check_same_device(indices, q, "indices", "q");
  const AttnProblem p{q.size(0), q.size(1), kv.size(1), kv.size(0), q.size(2), dv, indices.size(2), scale};
  TORCH_CHECK(p.Hkv >= 1 && p.H % p.Hkv == 0, op, ": query heads H (", p.H, ") must be a multiple of the kv heads Hkv (",
              p.Hkv, ")");
  TORCH_CHECK(kv.size(2) == p.Dqk, op, ": kv must be [Tk, Hkv, Dqk] with Dqk = ", p.Dqk, " (q's), got ",
              shape_str(kv));
  TORCH_CHECK(indices.size(0) == p.T && indices.size(1) == p.Hkv, op, ": indices must be [T, Hkv, topk] with T = ",
              p.T, ", Hkv = ", p.Hkv, ", got ", shape_str(indices));
  check_topk(p.topk, op);
  TORCH_CHECK(dv >= 1 && dv <= p.Dqk, op, ": dv must be in [1, Dqk = ", p.Dqk, "] (values are kv[..., :dv]), got ", dv);
  TORCH_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  if (gate.has_value()) {
    check_same_device(*gate, q, "gate", "q");
    check_dtype(*gate, kFloating, "gate");
    TORCH_CHECK(gate->sizes() == at::IntArrayRef({p.T, p.H, dv}), op, ": gate must be [T, H, dv] = [", p.T, ", ", p.H,
                ", ", dv, "], got ", shape_str(*gate));
  }
  check_index_range(indices, -1, p.Tk, op, "indices");
  return p;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> lightning_indexer_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w,
                                                         const at::Tensor& cu_seqlens_q,
                                                         const at::Tensor& cu_seqlens_k, int64_t topk) {
  constexpr const char* op = "lightning_indexer";
  const IndexerShapes s = check_indexer_inputs(q, k, w, op);
  check_topk(topk, op);
  const int64_t N = check_cu_seqlens(cu_seqlens_q, s.T, q, op, "cu_seqlens_q", "T");
  TORCH_CHECK(check_cu_seqlens(cu_seqlens_k, s.Tk, q, op, "cu_seqlens_k", "Tk") == N, op,
              ": cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got ", N, " and ",
              cu_seqlens_k.size(0) - 1);
  const auto acc = accumulation_type(q);
  const IndexerProblem p{s.T, s.Tk, s.Hi, s.Di, N, topk, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()};
  at::Tensor indices = at::empty({s.T, topk}, q.options().dtype(at::kInt));
  at::Tensor scores = at::empty({s.T, topk}, q.options().dtype(acc));
#ifdef KDA_DSA_OPS_WITH_CUDA
  if (q.is_cuda()) {
    check_indexer_cuda(s, q, op);
    indexer_fwd_cuda(p, rows16(q), rows16(k), to_acc(w, at::kFloat), indices, scores);
    return {indices, scores};
  }
#endif
  indexer_fwd_cpu(p, to_acc(q, acc), to_acc(k, acc), to_acc(w, acc), indices, scores);
  return {indices, scores};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lightning_indexer_bwd(const at::Tensor& q, const at::Tensor& k,
                                                                     const at::Tensor& w, const at::Tensor& indices,
                                                                     const at::Tensor& grad_scores) {
  constexpr const char* op = "lightning_indexer_bwd";
  const IndexerShapes s = check_indexer_inputs(q, k, w, op);
  check_dim(indices, 2, "indices", "[T, topk]");
  check_dtype(indices, {at::kInt}, "indices");
  check_same_device(indices, q, "indices", "q");
  check_same_device(grad_scores, q, "grad_scores", "q");
  TORCH_CHECK(indices.size(0) == s.T, op, ": indices must be [T, topk] with T = ", s.T, ", got ", shape_str(indices));
  TORCH_CHECK(grad_scores.sizes() == indices.sizes(), op, ": grad_scores must have the shape of indices ",
              shape_str(indices), ", got ", shape_str(grad_scores));
  check_topk(indices.size(1), op);
  check_index_range(indices, -1, s.Tk, op, "indices");
  const auto acc = accumulation_type(q);
  at::Tensor dk = at::zeros({s.Tk, s.Di}, q.options().dtype(acc));
  at::Tensor dw = at::zeros({s.T, s.Hi}, q.options().dtype(acc));
#ifdef KDA_DSA_OPS_WITH_CUDA
  if (q.is_cuda()) {
    check_indexer_cuda(s, q, op);
    at::Tensor dq = at::empty({s.T, s.Hi, s.Di}, q.options());
    indexer_bwd_cuda(rows16(q), rows16(k), to_acc(w, at::kFloat), indices.contiguous(),
                     to_acc(grad_scores, at::kFloat), dq, dk, dw);
    return {dq, dk.to(k.scalar_type()), dw.to(w.scalar_type())};
  }
#endif
  at::Tensor dq = at::zeros({s.T, s.Hi, s.Di}, q.options().dtype(acc));
  indexer_bwd_cpu(to_acc(q, acc), to_acc(k, acc), to_acc(w, acc), indices.contiguous(), to_acc(grad_scores, acc), dq,
                  dk, dw);
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dw.to(w.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_attn_fwd(const at::Tensor& q, const at::Tensor& kv,
                                                               const at::Tensor& indices, double scale, int64_t dv,
                                                               const std::optional<at::Tensor>& gate, bool return_p,
                                                               bool deterministic) {
  constexpr const char* op = "sparse_attn_fwd";
  const AttnProblem p = check_attn_inputs(q, kv, indices, scale, dv, gate, op);
  (void)deterministic;  // a flag for the backward (autograd keeps it); the forward always is
  const auto acc = accumulation_type(q);
#ifdef KDA_DSA_OPS_WITH_CUDA
  if (q.is_cuda()) {
    check_attn_cuda(p, q, op);
    at::Tensor o = at::empty({p.T, p.H, dv}, q.options());
    at::Tensor lse = at::empty({p.T, p.H}, q.options().dtype(at::kFloat));
    at::Tensor probs = return_p ? at::zeros({p.T, p.Hkv, p.topk}, q.options().dtype(at::kFloat)) : at::Tensor();
    attn_fwd_cuda(p, rows16(q), rows16(kv), indices.contiguous(),
                  gate.has_value() ? gate->to(q.scalar_type()).contiguous() : at::Tensor(), o, lse, probs);
    return {o, lse, return_p ? probs : at::empty({0}, q.options().dtype(at::kFloat))};
  }
#endif
  at::Tensor o = at::empty({p.T, p.H, dv}, q.options().dtype(acc));
  at::Tensor lse = at::empty({p.T, p.H}, q.options().dtype(acc));
  at::Tensor probs = return_p ? at::zeros({p.T, p.Hkv, p.topk}, q.options().dtype(acc)) : at::Tensor();
  attn_fwd_cpu(p, to_acc(q, acc), to_acc(kv, acc), indices.contiguous(),
               gate.has_value() ? to_acc(*gate, acc) : at::Tensor(), o, lse, probs);
  return {o.to(q.scalar_type()), lse, return_p ? probs : at::empty({0}, q.options().dtype(acc))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_attn_bwd(const at::Tensor& grad_o, const at::Tensor& q,
                                                               const at::Tensor& kv, const at::Tensor& indices,
                                                               const at::Tensor& o, const at::Tensor& lse,
                                                               double scale, int64_t dv,
                                                               const std::optional<at::Tensor>& gate,
                                                               bool deterministic) {
  constexpr const char* op = "sparse_attn_bwd";
  const AttnProblem p = check_attn_inputs(q, kv, indices, scale, dv, gate, op);
  for (const auto* t : {&grad_o, &o}) {
    TORCH_CHECK(t->sizes() == at::IntArrayRef({p.T, p.H, dv}), op, ": grad_o and o must be [T, H, dv] = [", p.T, ", ",
                p.H, ", ", dv, "], got ", shape_str(*t));
    check_same_device(*t, q, "grad_o and o", "q");
  }
  TORCH_CHECK(lse.sizes() == at::IntArrayRef({p.T, p.H}), op, ": lse must be [T, H] = [", p.T, ", ", p.H, "], got ",
              shape_str(lse));
  check_same_device(lse, q, "lse", "q");
#ifdef KDA_DSA_OPS_WITH_CUDA
  if (q.is_cuda()) {
    check_attn_cuda(p, q, op);
    const auto half = q.scalar_type();
    at::Tensor dq = at::empty({p.T, p.H, p.Dqk}, q.options());
    at::Tensor dkv = at::zeros({p.Tk * p.Hkv + 1, p.Dqk}, q.options().dtype(at::kFloat));
    at::Tensor dgate = gate.has_value() ? at::empty({p.T, p.H, dv}, q.options()) : at::Tensor();
    attn_bwd_cuda(p, grad_o.to(half).contiguous(), rows16(q), rows16(kv), indices.contiguous(),
                  o.to(half).contiguous(), lse.to(at::kFloat).contiguous(),
                  gate.has_value() ? gate->to(half).contiguous() : at::Tensor(), deterministic, dq, dkv, dgate);
    return {dq, dkv.narrow(0, 0, p.Tk * p.Hkv).view({p.Tk, p.Hkv, p.Dqk}).to(kv.scalar_type()),
            gate.has_value() ? dgate.to(gate->scalar_type()) : at::empty({0}, q.options())};
  }
#endif
  (void)deterministic;  // the CPU kernel accumulates dkv in one fixed order: always deterministic
  const auto acc = accumulation_type(q);
  at::Tensor dq = at::zeros({p.T, p.H, p.Dqk}, q.options().dtype(acc));
  at::Tensor dkv = at::zeros({p.Tk, p.Hkv, p.Dqk}, q.options().dtype(acc));
  at::Tensor dgate = gate.has_value() ? at::empty({p.T, p.H, dv}, q.options().dtype(acc)) : at::Tensor();
  attn_bwd_cpu(p, to_acc(grad_o, acc), to_acc(q, acc), to_acc(kv, acc), indices.contiguous(), to_acc(o, acc),
               to_acc(lse, acc), gate.has_value() ? to_acc(*gate, acc) : at::Tensor(), dq, dkv, dgate);
  return {dq.to(q.scalar_type()), dkv.to(kv.scalar_type()),
          gate.has_value() ? dgate.to(gate->scalar_type()) : at::empty({0}, q.options())};
}

}  // namespace kda_dsa_ops::dsa
