// DSA on CUDA: the op entry points for the CUDA dispatch key. Each checks its arguments (dsa.cpp,
// then what the CUDA kernels take), brings the inputs to the kernels' form (16-bit operands,
// 16-byte aligned rows, fp32 weights and gradients) and calls the kernel's launcher
// (dsa_cuda.cuh lists them).
#include "common/checks.h"
#include "dsa/dsa_cuda.cuh"

namespace kda_dsa_ops::dsa {

namespace {

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

// The mma.sync kernels' split (QueryPack): the largest share of its slots that a packed block's union
// keeps and stays packed. A block of 16 rows does a query's work at 0.57 (forward) and 0.46
// (backward) of the time of a block of 64 (H200, 128 / 128, measured).
constexpr double kFwdSplit = 0.5, kBwdSplit = 0.4;
// The forward at 8 or 16 heads a kv head with Dqk <= 128 (gqa_fwd_cuda.cu): packed blocks up to the
// split stay packed (at 8 heads on the GQA packed kernel, at 16 on attn_fwd_cuda.cu's), the others
// run unpacked on the GQA kernel (H200, 128 / 128, T 4096, Tk 8192, 4 kv heads). At 8 heads, with
// the packed kernel's steps over all 128 dims, the forward took on random sets (unions at 0.45)
// 1.57 ms at a split of 0.4 and 1.48 at 0.5 to 1 (every block packed); on the causal sets of an
// 8192-token sequence 2.34 / 2.24; window sets 1.25 either way.
// At 16 heads (the same run): random and window sets 1.72 ms at every split from 0.01 to 0.4 (their
// unions are longer), the causal sets 3.32 / 3.12 / 3.18 / 3.38 ms at 0.01 / 0.2 / 0.3 / 0.4. (A
// block of 4 queries with topk keys each keeps at least a quarter of its slots: at 0.2 only blocks
// of queries with fewer keys, a sequence's first, stay packed.)
constexpr double kGqa8FwdSplit = 0.6, kGqa16FwdSplit = 0.2;
// The backward at 8 heads a kv head with Dqk <= 128: its unpacked blocks hold 8 rows of 16. With
// the packed blocks' slot data read in one round trip a tile (H200, 128 / 128, 4 kv heads, T 4096,
// random sets over Tk keys, split 0.4 / 0.5 / 0.7): Tk 8192 (unions at 0.45) 8.35 / 7.99 / 7.99 ms,
// Tk 12288 (0.575) 8.35 / 8.35 / 10.12, Tk 16384 (0.656) 8.35 / 8.35 / 11.51; the model's causal
// sets over 8192 tokens 8.81 / 8.44 (0.45: 8.68) ms, where no block is left to a second launch.
constexpr double kGqa8BwdSplit = 0.5;

// The (query, slot) probabilities of a packed Hopper MLA forward ([blocks, group, group x topk], by
// union slot) in the call's slots: [T, 1, topk], 0 where a slot has no key.
at::Tensor unpack_probs(const QueryPack& pk, const at::Tensor& packed) {
  const at::Tensor slot = pk.slot_of.squeeze(1);
  const at::Tensor rows = packed.view({-1, packed.size(2)}).narrow(0, 0, slot.size(0));
  return rows.gather(1, slot.clamp_min(0)).masked_fill_(slot.lt(0), 0.).unsqueeze(1);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> lightning_indexer_fwd_cuda(const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& w, const at::Tensor& cu_seqlens_q,
                                                              const at::Tensor& cu_seqlens_k, int64_t topk) {
  const IndexerProblem p = check_indexer_fwd(q, k, w, cu_seqlens_q, cu_seqlens_k, topk);
  check_indexer_cuda(IndexerShapes{p.T, p.Tk, p.Hi, p.Di}, q, "lightning_indexer");
  at::Tensor indices = at::empty({p.T, topk}, q.options().dtype(at::kInt));
  at::Tensor scores = at::empty({p.T, topk}, q.options().dtype(at::kFloat));
  indexer_fwd_cuda(p, rows16(q), rows16(k), contiguous_as(w, at::kFloat), indices, scores);
  return {indices, scores};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lightning_indexer_bwd_cuda(const at::Tensor& q, const at::Tensor& k,
                                                                          const at::Tensor& w,
                                                                          const at::Tensor& indices,
                                                                          const at::Tensor& grad_scores) {
  const IndexerShapes s = check_indexer_bwd(q, k, w, indices, grad_scores);
  check_indexer_cuda(s, q, "lightning_indexer_bwd");
  at::Tensor dq = at::empty({s.T, s.Hi, s.Di}, q.options());
  at::Tensor dk = at::zeros({s.Tk, s.Di}, q.options().dtype(at::kFloat));
  at::Tensor dw = at::zeros({s.T, s.Hi}, q.options().dtype(at::kFloat));
  indexer_bwd_cuda(rows16(q), rows16(k), contiguous_as(w, at::kFloat), indices.contiguous(),
                   contiguous_as(grad_scores, at::kFloat), dq, dk, dw);
  return {dq, dk.to(k.scalar_type()), dw.to(w.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_attn_fwd_cuda(const at::Tensor& q, const at::Tensor& kv,
                                                                    const at::Tensor& indices, double scale,
                                                                    int64_t dv, const std::optional<at::Tensor>& gate,
                                                                    bool return_p, bool deterministic) {
  const AttnProblem p = check_attn_fwd(q, kv, indices, scale, dv, gate);
  (void)deterministic;  // a flag for the backward (autograd keeps it); the forward always is
  check_attn_cuda(p, q, "sparse_attn_fwd");
  at::Tensor o = at::empty({p.T, p.H, dv}, q.options());
  at::Tensor lse = at::empty({p.T, p.H}, q.options().dtype(at::kFloat));
  const double split = !gqa_fwd_takes(p) ? kFwdSplit : p.H / p.Hkv == 8 ? kGqa8FwdSplit : kGqa16FwdSplit;
  const QueryPack pk = pack_queries(p, q, indices.contiguous(), return_p, split);
  const AttnProblem& kp = pk.problem;
  // packed: every (block, query, slot up to the block's length) is written
  at::Tensor probs = !return_p ? at::Tensor()
                     : pk.group > 1 ? at::empty({kp.T, pk.group, kp.topk}, q.options().dtype(at::kFloat))
                                    : at::zeros({p.T, p.Hkv, p.topk}, q.options().dtype(at::kFloat));
  attn_fwd_cuda(pk, rows16(q), rows16(kv), gate.has_value() ? gate->to(q.scalar_type()).contiguous() : at::Tensor(),
                o, lse, probs);
  if (!return_p) return {o, lse, at::empty({0}, q.options().dtype(at::kFloat))};
  return {o, lse, pk.group > 1 ? unpack_probs(pk, probs) : probs};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_attn_bwd_cuda(const at::Tensor& grad_o, const at::Tensor& q,
                                                                    const at::Tensor& kv, const at::Tensor& indices,
                                                                    const at::Tensor& o, const at::Tensor& lse,
                                                                    double scale, int64_t dv,
                                                                    const std::optional<at::Tensor>& gate,
                                                                    bool deterministic) {
  const AttnProblem p = check_attn_bwd(grad_o, q, kv, indices, o, lse, scale, dv, gate);
  check_attn_cuda(p, q, "sparse_attn_bwd");
  const auto half = q.scalar_type();
  at::Tensor dq = at::empty({p.T, p.H, p.Dqk}, q.options());
  at::Tensor dkv = at::zeros({p.Tk * p.Hkv + 1, p.Dqk}, q.options().dtype(at::kFloat));
  at::Tensor dgate = gate.has_value() ? at::empty({p.T, p.H, dv}, q.options()) : at::Tensor();
  const double split = p.Dqk <= 128 && p.H == 8 * p.Hkv ? kGqa8BwdSplit : kBwdSplit;
  const QueryPack pk = pack_queries(p, q, indices.contiguous(), false, deterministic ? 0. : split);
  attn_bwd_cuda(pk, rows16(grad_o.to(half)), rows16(q), rows16(kv), rows16(o.to(half)), lse.to(at::kFloat).contiguous(),
                gate.has_value() ? rows16(gate->to(half)) : at::Tensor(), deterministic, dq, dkv, dgate);
  return {dq, dkv.narrow(0, 0, p.Tk * p.Hkv).view({p.Tk, p.Hkv, p.Dqk}).to(kv.scalar_type()),
          gate.has_value() ? dgate.to(gate->scalar_type()) : at::empty({0}, q.options())};
}

}  // namespace kda_dsa_ops::dsa
