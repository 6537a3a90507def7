// The DSA ops' argument checks, shared by the CPU and CUDA entry points (dsa_cpu.cpp, dsa_cuda.cu).
#include "dsa/dsa.h"

#include <cmath>

#include "common/checks.h"

namespace kda_dsa_ops::dsa {

namespace {

constexpr auto kFloating = {at::kBFloat16, at::kHalf, at::kFloat, at::kDouble};

void check_topk(int64_t topk, const char* op, int64_t limit = kMaxTopk) {
  TORCH_CHECK(topk >= 1 && topk <= limit, op, ": topk must be in [1, ", limit, "], got ", topk);
}

IndexerShapes check_indexer_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w, const char* op) {
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


AttnProblem check_attn_shapes(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& indices, double scale,
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
  check_topk(p.topk, op, kMaxKeys);
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

IndexerProblem check_indexer_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w,
                                 const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t topk) {
  constexpr const char* op = "lightning_indexer";
  const IndexerShapes s = check_indexer_shapes(q, k, w, op);
  check_topk(topk, op);
  const int64_t N = check_cu_seqlens(cu_seqlens_q, s.T, q, op, "cu_seqlens_q", "T");
  TORCH_CHECK(check_cu_seqlens(cu_seqlens_k, s.Tk, q, op, "cu_seqlens_k", "Tk") == N, op,
              ": cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got ", N, " and ",
              cu_seqlens_k.size(0) - 1);
  return IndexerProblem{s.T, s.Tk, s.Hi, s.Di, N, topk, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()};
}

IndexerShapes check_indexer_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w,
                                const at::Tensor& indices, const at::Tensor& grad_scores) {
  constexpr const char* op = "lightning_indexer_bwd";
  const IndexerShapes s = check_indexer_shapes(q, k, w, op);
  check_dim(indices, 2, "indices", "[T, topk]");
  check_dtype(indices, {at::kInt}, "indices");
  check_same_device(indices, q, "indices", "q");
  check_same_device(grad_scores, q, "grad_scores", "q");
  TORCH_CHECK(indices.size(0) == s.T, op, ": indices must be [T, topk] with T = ", s.T, ", got ", shape_str(indices));
  TORCH_CHECK(grad_scores.sizes() == indices.sizes(), op, ": grad_scores must have the shape of indices ",
              shape_str(indices), ", got ", shape_str(grad_scores));
  check_topk(indices.size(1), op);
  check_index_range(indices, -1, s.Tk, op, "indices");
  return s;
}

AttnProblem check_attn_fwd(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& indices, double scale,
                           int64_t dv, const std::optional<at::Tensor>& gate) {
  return check_attn_shapes(q, kv, indices, scale, dv, gate, "sparse_attn_fwd");
}

AttnProblem check_attn_bwd(const at::Tensor& grad_o, const at::Tensor& q, const at::Tensor& kv,
                           const at::Tensor& indices, const at::Tensor& o, const at::Tensor& lse, double scale,
                           int64_t dv, const std::optional<at::Tensor>& gate) {
  constexpr const char* op = "sparse_attn_bwd";
  const AttnProblem p = check_attn_shapes(q, kv, indices, scale, dv, gate, op);
  for (const auto* t : {&grad_o, &o}) {
    TORCH_CHECK(t->sizes() == at::IntArrayRef({p.T, p.H, dv}), op, ": grad_o and o must be [T, H, dv] = [", p.T, ", ",
                p.H, ", ", dv, "], got ", shape_str(*t));
    check_same_device(*t, q, "grad_o and o", "q");
  }
  TORCH_CHECK(lse.sizes() == at::IntArrayRef({p.T, p.H}), op, ": lse must be [T, H] = [", p.T, ", ", p.H, "], got ",
              shape_str(lse));
  check_same_device(lse, q, "lse", "q");
  return p;
}

}  // namespace kda_dsa_ops::dsa
