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
                  kpool: int, tail: bool = True, cu_seqlens_k: Tensor | None = None) -> Tensor:
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
    are torch; indices [T, topk + (kpool - 1 if tail else 0)] int32, -1 padded, not
    differentiable.
    """
    T = q.shape[0]
    width = topk + (kpool - 1 if tail else 0)
    indices = torch.full((T, width), -1, dtype=torch.int32, device=q.device)
    n_best = topk // kpool
    bounds = cu_seqlens.tolist()
    kbounds = bounds if cu_seqlens_k is None else cu_seqlens_k.tolist()
    seqs = [(a, b, ka, kb) for a, b, ka, kb in zip(bounds[:-1], bounds[1:], kbounds[:-1], kbounds[1:])]
    dev = q.device
    arange = lambda *a: torch.arange(*a, device=dev)  # noqa: E731
    if n_best > 0 and T > 0:
        # pooled keys of every sequence's complete pools, in order: pool j of a sequence averages
        # its kpool keys weighted by softmax(gate + ape) over the pool
        pool_rows = [arange(ka, ka + (kb - ka) // kpool * kpool) for _, _, ka, kb in seqs]
        rows = torch.cat(pool_rows) if pool_rows else arange(0)
        acc = accumulation_dtype(q)
        weight = torch.softmax(gate[rows].to(acc).view(-1, kpool, gate.shape[-1]) + ape.to(acc)[None], dim=1)
        pooled = (weight * k[rows].to(acc).view(-1, kpool, k.shape[-1])).sum(1).to(k.dtype)
        first_pool = [0]
        for r in pool_rows:
            first_pool.append(first_pool[-1] + r.numel() // kpool)
        # one kernel sequence per (sequence, phase): its queries and the prefix of pools they see
        order, key_rows, cu_q, cu_k, key_base, seg_pool0 = [], [], [0], [0], [], []
        for n, (a, b, ka, kb) in enumerate(seqs):
            L, Lk = b - a, kb - ka
            for phase in range(kpool):
                # queries i with (i + Lk - L + 1) % kpool == phase
                i0 = (phase - 1 - (Lk - L)) % kpool
                idx = arange(a + i0, max(a + i0, b), kpool)
                last = i0 + (L - 1 - i0) // kpool * kpool  # the phase's last query (when i0 < L)
                seen = max(0, (last + Lk - L + 1) // kpool) if i0 < L else 0
                order.append(idx)
                key_rows.append(arange(first_pool[n], first_pool[n] + seen))
                cu_q.append(cu_q[-1] + idx.numel())
                cu_k.append(cu_k[-1] + seen)
                key_base.append(torch.full((idx.numel(),), ka, device=dev))     # the sequence's first key
                seg_pool0.append(torch.full((idx.numel(),), cu_k[-2], device=dev))  # the segment's first row
        order = torch.cat(order)
        key_rows = torch.cat(key_rows)
        if key_rows.numel() > 0:
            cu32 = lambda c: torch.tensor(c, dtype=torch.int32, device=dev)  # noqa: E731
            best, _ = lightning_indexer(q[order], pooled[key_rows].contiguous(), w[order], cu32(cu_q), cu32(cu_k),
                                        n_best)
            pool = best.long() - torch.cat(seg_pool0)[:, None]                 # pool index in its sequence
            tokens = (pool[..., None] * kpool + arange(kpool)).flatten(1) + torch.cat(key_base)[:, None]
            chosen = (best >= 0).repeat_interleave(kpool, dim=1)
            indices[order, : n_best * kpool] = torch.where(chosen, tokens, -1).to(torch.int32)
    if tail and kpool > 1:  # the (t + 1) % kpool keys after the last complete pool, always chosen
        for a, b, ka, kb in seqs:
            t = arange(kb - ka - (b - a), kb - ka)
            count = (t + 1) % kpool
            offset = arange(kpool - 1)
            tail_rows = (t + 1 - count)[:, None] + offset[None, :] + ka
            indices[a:b, topk:] = torch.where(offset[None, :] < count[:, None], tail_rows, -1).to(torch.int32)
    return indices


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
    a Hopper kernel (wgmma); return_p adds a second pass over the selected keys.
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
