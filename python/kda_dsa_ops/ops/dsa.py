"""DSA ops: the lightning indexer (fused scoring + top-k) and gated sparse attention over the
selected keys, with their gradients. Semantics are defined in kda_dsa_ops.reference.dsa.

CPU tensors: every floating dtype (fp32 accumulation, fp64 for fp64). CUDA tensors: bf16 or fp16
q/k/kv (fp32 accumulation on the tensor cores), indexer heads Hi <= 64 with Di a multiple of 8
up to 128 (the indexer forward needs a Hopper GPU, sm_90), attention head dims Dqk <= 128 (GQA)
or Dqk <= 576 with dv <= 512 (MLA); other cases raise a clear error
(kda_dsa_ops.reference has the same functions in PyTorch). On CUDA, value checks of indices and
cu_seqlens need a host copy and run only with kda_dsa_ops.set_value_checks(True); unchecked,
an index outside [0, Tk) counts as -1 and keys outside [0, Tk) are never read.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._dtypes import accumulation_dtype
from ..contracts import attention_defaults

_ops = torch.ops.kda_dsa_ops


def lightning_indexer(q: Tensor, k: Tensor, w: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                      topk: int) -> tuple[Tensor, Tensor]:
    """Top-k visible keys per query by I[t, s] = sum_j w[t, j] relu(q[t, j] . k[s]).

    q [T, Hi, Di], k [Tk, Di], w [T, Hi]; cu_seqlens_q / cu_seqlens_k int32 [N + 1] pack N
    sequences (causal within each, bottom-right aligned: query i of a sequence with Lq queries
    and Lk keys sees keys j <= i + Lk - Lq). topk in [1, 2048]. The [T, Tk] score matrix is never
    formed. Returns indices [T, topk] int32 (absolute rows of k by score, descending, ties to the
    lower index, -1 past the visible keys) and scores [T, topk] fp32 (-inf where -1),
    differentiable w.r.t. q, k and w. A key whose score is not finite (a NaN in q . k included:
    the ReLU keeps it) is never selected.
    """
    return _ops.lightning_indexer_fwd(q, k, w, cu_seqlens_q, cu_seqlens_k, topk)


def kpool_indexer(q: Tensor, k: Tensor, gate: Tensor, ape: Tensor, w: Tensor, cu_seqlens: Tensor, topk: int,
                  kpool: int, tail: bool = True, cu_seqlens_k: Tensor | None = None,
                  with_scores: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """GLM-5.3's k-pooled indexer (reference.kpool_indexer's contract: the keys of the topk //
    kpool best complete pools visible to each query, then with tail the latest incomplete pool's)
    on the lightning-indexer kernel.

    A complete pool j is visible to the query at position t of its sequence when (j + 1) kpool - 1
    <= t, so the count visible to t is (t + 1) // kpool: it grows by one every kpool positions, not
    by one per query as the kernel's bottom-right rule does. Splitting each sequence's queries by
    the phase (t + 1) % kpool makes it one per query: the queries of one phase form a kernel
    sequence whose keys are the first (t_last + 1) // kpool pools (t_last its last query), and the
    kernel's rule gives each of them exactly its visible pools. The kpool phases take one copy of
    the pooled keys each (as many rows as there are keys), and the kernel scores each query against
    its visible pools only. Pooling (softmax-weighted averages), the phases' layout and the tail
    are torch, without a loop over sequences; indices [T, topk + (kpool - 1 if tail else 0)] int32,
    -1 padded. with_scores also returns the chosen pools' scores [T, topk // kpool] (fp32; float64
    for float64 inputs; -inf where no pool), the indexer kernel's scores put back in query order:
    differentiable w.r.t. q, k, gate, ape and w, through the indexer's backward kernel and the
    pooling's autograd.
    """
    T, dev = q.shape[0], q.device
    indices = torch.full((T, topk + (kpool - 1 if tail else 0)), -1, dtype=torch.int32, device=dev)
    scores = torch.full((T, topk // kpool), -math.inf, dtype=accumulation_dtype(q), device=dev)
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    lens, klens = cu_seqlens.diff().long(), cu_k.diff().long()
    N = lens.numel()
    seq = torch.repeat_interleave(torch.arange(N, device=dev), lens, output_size=T)  # each query's sequence
    kstart = cu_k[:-1].long()[seq]                                                    # its sequence's first key
    t = torch.arange(T, device=dev) - cu_seqlens[:-1].long()[seq] + (klens - lens)[seq]  # its position there
    n_best = topk // kpool
    if n_best > 0 and T > 0:
        # pooled keys of every sequence's complete pools, in order: pool j of a sequence averages
        # its kpool keys weighted by softmax(gate + ape) over the pool
        pools = klens // kpool
        first_pool = torch.cat([pools.new_zeros(1), pools.cumsum(0)])
        P = int(first_pool[-1])
        pool_seq = torch.repeat_interleave(torch.arange(N, device=dev), pools, output_size=P)
        rows = ((cu_k[:-1].long()[pool_seq] + (torch.arange(P, device=dev) - first_pool[pool_seq]) * kpool)[:, None]
                + torch.arange(kpool, device=dev)).flatten()
        acc = accumulation_dtype(q)
        weight = torch.softmax(gate[rows].to(acc).view(P, kpool, gate.shape[-1]) + ape.to(acc)[None], dim=1)
        pooled = (weight * k[rows].to(acc).view(P, kpool, k.shape[-1])).sum(1).to(k.dtype)
        # one kernel sequence per (sequence, phase), its queries in order: it sees the first pools
        # up to its last query's count
        segment = seq * kpool + (t + 1) % kpool
        order = torch.sort(segment, stable=True).indices
        S = N * kpool
        q_count = torch.bincount(segment, minlength=S)
        seen = torch.zeros(S, dtype=torch.long, device=dev).scatter_reduce(
            0, segment, torch.div(t + 1, kpool, rounding_mode="floor").clamp_min(0), "amax")
        cu_q, cu_seen = (torch.cat([x.new_zeros(1), x.cumsum(0)]) for x in (q_count, seen))
        K_rows = int(cu_seen[-1])
        if K_rows > 0:
            row_seg = torch.repeat_interleave(torch.arange(S, device=dev), seen, output_size=K_rows)
            key_rows = first_pool[row_seg // kpool] + torch.arange(K_rows, device=dev) - cu_seen[row_seg]
            best, best_scores = lightning_indexer(q[order], pooled[key_rows], w[order], cu_q.to(torch.int32),
                                                  cu_seen.to(torch.int32), n_best)
            if with_scores:
                scores = scores.index_put((order,), best_scores)
            pool = best.long() - cu_seen[segment[order]][:, None]             # pool index in its sequence
            tokens = (pool[..., None] * kpool + torch.arange(kpool, device=dev)).flatten(1) + kstart[order, None]
            chosen = (best >= 0).repeat_interleave(kpool, dim=1)
            indices[order, : n_best * kpool] = torch.where(chosen, tokens, -1).to(torch.int32)
    if tail and kpool > 1:  # the (t + 1) % kpool keys after the last complete pool, always chosen
        count = (t + 1) % kpool
        offset = torch.arange(kpool - 1, device=dev)
        tail_rows = (t + 1 - count)[:, None] + offset[None, :] + kstart[:, None]
        indices[:, topk:] = torch.where(offset[None, :] < count[:, None], tail_rows, -1).to(torch.int32)
    return (indices, scores) if with_scores else indices


def sparse_attention(q: Tensor, kv: Tensor, indices: Tensor, scale: float | None = None, dv: int | None = None,
                     gate: Tensor | None = None, return_p: bool = False,
                     deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """o = sigmoid(gate) * softmax(scale * q . k_sel) v_sel over each query's selected keys.

    q [T, H, Dqk]; kv [Tk, Hkv, Dqk] (MLA/MQA: Hkv = 1, Dqk = 576, values kv[..., :512]; GQA:
    Hkv > 1); indices [T, Hkv, topk] int32 rows of kv, -1 = none (a row with no key gives 0);
    query head h reads kv head h // (H // Hkv). scale defaults to Dqk ** -0.5; dv (the value
    width, kv[..., :dv]) to 512 when Dqk = 576, else Dqk. gate [T, H, dv] (optional).
    Returns o [T, H, dv] in q's dtype, lse [T, H] fp32 (natural log, -inf for a row with no key)
    and, with return_p, p [T, Hkv, topk] fp32: the probabilities summed over the heads of each kv
    head (for the indexer's KL loss). o is differentiable w.r.t. q, kv and gate; lse and p are
    not. Non-finite inputs give the reference's non-finite outputs: a NaN logit makes its row's o
    and lse NaN; an inf in a selected value channel reaches that channel (also with probability
    0); rows no query selects reach nothing. deterministic: bitwise-reproducible dkv (the CPU
    kernel always is; the CUDA kernel otherwise adds dkv with atomics, and with it stores each
    (query, key) term and sums them in index order: slower, more memory traffic). On an sm_90 GPU the MLA layout's forward takes
    a Hopper kernel (wgmma), return_p adding a second pass over the selected keys, and so does its
    backward with more than 16 heads; with 8, 16 or 32 heads both run 64 / H consecutive queries in
    one block, over the union of their selections, each query's rows masked to its own keys (the
    fewer keys neighbouring queries share, the longer the union).
    kda_dsa_ops.set_portable_sfa(True) (or KDA_DSA_OPS_PORTABLE_SFA=1 in the environment) keeps
    it on the portable kernel that other GPUs take (for comparison and testing).
    """
    scale, dv = attention_defaults(q, scale, dv)
    o, lse, p = _ops.sparse_attn_fwd(q, kv, indices, scale, dv, gate, return_p, deterministic)
    return o, lse, (p if return_p else None)


@torch.library.register_fake("kda_dsa_ops::lightning_indexer_fwd")
def _(q, k, w, cu_seqlens_q, cu_seqlens_k, topk):
    T = q.shape[0]
    return q.new_empty(T, topk, dtype=torch.int32), q.new_empty(T, topk, dtype=accumulation_dtype(q))


@torch.library.register_fake("kda_dsa_ops::lightning_indexer_bwd")
def _(q, k, w, indices, grad_scores):
    return q.new_empty(q.shape), k.new_empty(k.shape), w.new_empty(w.shape)


@torch.library.register_fake("kda_dsa_ops::sparse_attn_fwd")
def _(q, kv, indices, scale, dv, gate, return_p, deterministic=False):
    T, H, _ = q.shape
    p_shape = (T, kv.shape[1], indices.shape[2]) if return_p else (0,)
    return q.new_empty(T, H, dv), q.new_empty(T, H, dtype=accumulation_dtype(q)), q.new_empty(p_shape, dtype=accumulation_dtype(q))


@torch.library.register_fake("kda_dsa_ops::sparse_attn_bwd")
def _(grad_o, q, kv, indices, o, lse, scale, dv, gate, deterministic):
    dgate = gate.new_empty(gate.shape) if gate is not None else q.new_empty(0)
    return q.new_empty(q.shape), kv.new_empty(kv.shape), dgate


def _indexer_setup(ctx, inputs, output):
    q, k, w = inputs[:3]
    ctx.save_for_backward(q, k, w, output[0])
    ctx.mark_non_differentiable(output[0])


def _indexer_backward(ctx, grad_indices, grad_scores):
    q, k, w, indices = ctx.saved_tensors
    dq, dk, dw = _ops.lightning_indexer_bwd(q, k, w, indices, grad_scores.contiguous())
    return dq, dk, dw, None, None, None


def _attn_setup(ctx, inputs, output):
    q, kv, indices, scale, dv, gate, _, deterministic = inputs
    ctx.save_for_backward(q, kv, indices, gate, output[0], output[1])
    ctx.scale, ctx.dv, ctx.deterministic = scale, dv, deterministic
    ctx.mark_non_differentiable(output[1], output[2])


def _attn_backward(ctx, grad_o, grad_lse, grad_p):
    q, kv, indices, gate, o, lse = ctx.saved_tensors
    dq, dkv, dgate = _ops.sparse_attn_bwd(grad_o.contiguous(), q, kv, indices, o, lse, ctx.scale, ctx.dv, gate,
                                          ctx.deterministic)
    return dq, dkv, None, None, None, (dgate if gate is not None else None), None, None


torch.library.register_autograd("kda_dsa_ops::lightning_indexer_fwd", _indexer_backward, setup_context=_indexer_setup)
torch.library.register_autograd("kda_dsa_ops::sparse_attn_fwd", _attn_backward, setup_context=_attn_setup)
