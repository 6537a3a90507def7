"""Pure-PyTorch DSA: the lightning indexer (LI), sparse attention (SFA) and its gradient (SFAG).

Causality within a packed sequence of Lq queries and Lk keys is bottom-right aligned: query i
(0-based in its sequence) sees keys j <= i + Lk - Lq.
"""

from __future__ import annotations

import math

import torch

from .._dtypes import accumulation_dtype
from ..contracts import MAX_TOPK, attention_defaults


def _segments(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """I[t, s] = sum_j w[t, j] * relu(q[t, j] . k[s]) for every pair: [T, Tk], accumulation dtype."""
    acc = accumulation_dtype(q)
    qk = torch.einsum("thd,sd->ths", q.to(acc), k.to(acc))
    return torch.einsum("ths,th->ts", qk.relu(), w.to(acc))


def lightning_indexer(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k visible keys per query by indexer score.

    q [T,Hi,Di], k [Tk,Di], w [T,Hi]. Returns indices [T,topk] int32 (absolute rows of k, sorted
    by score descending, ties to the lower index, -1 past the visible keys; a key whose score is
    not finite is never selected) and scores
    [T,topk] (fp32, fp64 for fp64 inputs; -inf where the index is -1).
    """
    if not 0 < topk <= MAX_TOPK:
        raise ValueError(f"topk must be in [1, {MAX_TOPK}], got {topk}")
    T = q.shape[0]
    acc = accumulation_dtype(q)
    indices = torch.full((T, topk), -1, dtype=torch.int32, device=q.device)
    scores = torch.full((T, topk), -math.inf, dtype=acc, device=q.device)
    for (qs, qe), (ks, ke) in zip(_segments(cu_seqlens_q), _segments(cu_seqlens_k)):
        Lq, Lk = qe - qs, ke - ks
        if Lq == 0 or Lk == 0:
            continue
        s = indexer_scores(q[qs:qe], k[ks:ke], w[qs:qe])
        visible = torch.arange(Lk, device=q.device)[None, :] <= torch.arange(Lq, device=q.device)[:, None] + (Lk - Lq)
        s = s.masked_fill(~(visible & torch.isfinite(s)), -math.inf)  # a non-finite score is never selected
        order = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :topk]
        top = s.gather(-1, order)
        n = order.shape[1]
        indices[qs:qe, :n] = torch.where(torch.isfinite(top), order + ks, -1).to(torch.int32)
        scores[qs:qe, :n] = top
    return indices, scores


def kpool_indexer(q: torch.Tensor, k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, w: torch.Tensor,
                  cu_seqlens: torch.Tensor, topk: int, kpool: int, tail: bool = True,
                  cu_seqlens_k: torch.Tensor | None = None,
                  with_scores: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """GLM-5.3's k-pooled indexer: the keys of the best pools, and the latest incomplete pool.

    Per sequence, keys form consecutive pools of kpool from its start; pool j's key is the
    per-channel average of its keys weighted by softmax over the pool of gate + ape (gate [Tk, Di]
    a projection of each key token, ape [kpool, Di] per position in the pool). I[t, j] = sum_h
    w[t, h] * ReLU(q[t, h] . pool_j); a complete pool is a candidate for query t when its last key
    is at or before t. The topk // kpool best candidates (ties to the lower pool) give their keys;
    with tail, the (t + 1) % kpool keys after the last complete pool follow (always chosen).
    cu_seqlens packs the queries and, unless cu_seqlens_k does, the keys; with more keys than
    queries in a sequence the queries are its last ones (bottom-right: query i of Lq sits at
    position i + Lk - Lq). Returns indices [T, topk + (kpool - 1 if tail else 0)] int32, absolute
    rows of k, -1 padded; with_scores also the chosen pools' scores [T, topk // kpool] (in the
    indices' pool order, -inf where no pool), differentiable w.r.t. q, k, gate, ape and w.
    """
    T = q.shape[0]
    acc = accumulation_dtype(q)
    width = topk + (kpool - 1 if tail else 0)
    indices = torch.full((T, width), -1, dtype=torch.int32, device=q.device)
    pools_per_query = topk // kpool
    scores = torch.full((T, pools_per_query), -math.inf, dtype=acc, device=q.device)
    if q.is_meta:  # shapes only (memory planning)
        return (indices, scores) if with_scores else indices
    key_segments = _segments(cu_seqlens if cu_seqlens_k is None else cu_seqlens_k)
    for (start, end), (kstart, kend) in zip(_segments(cu_seqlens), key_segments):
        L, Lk = end - start, kend - kstart
        pools = Lk // kpool
        t = torch.arange(Lk - L, Lk, device=q.device)  # the queries' positions in their sequence
        if pools and pools_per_query:
            keys = k[kstart:kstart + pools * kpool].to(acc).view(pools, kpool, -1)
            weight = torch.softmax((gate[kstart:kstart + pools * kpool].to(acc).view(pools, kpool, -1)
                                    + ape.to(acc)[None]), dim=1)
            pooled = (weight * keys).sum(1)                                       # [pools, Di]
            s = indexer_scores(q[start:end], pooled, w[start:end])                # [L, pools]
            candidate = (torch.arange(pools, device=q.device)[None, :] + 1) * kpool - 1 <= t[:, None]
            s = s.masked_fill(~(candidate & torch.isfinite(s)), -math.inf)
            n = min(pools_per_query, pools)
            best = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :n]          # [L, n]
            chosen = torch.isfinite(s.gather(-1, best))
            rows = (best[..., None] * kpool + torch.arange(kpool, device=q.device)).view(L, n * kpool) + kstart
            rows = torch.where(chosen.repeat_interleave(kpool, dim=1), rows, -1)
            indices[start:end, : n * kpool] = rows.to(torch.int32)
            if with_scores:
                scores[start:end, :n] = s.gather(-1, best)
        if tail and kpool > 1:
            count = (t + 1) % kpool                                              # keys past the last full pool
            offset = torch.arange(kpool - 1, device=q.device)
            rows = (t + 1 - count)[:, None] + offset[None, :] + kstart
            rows = torch.where(offset[None, :] < count[:, None], rows, -1)
            indices[start:end, topk:] = rows.to(torch.int32)
    return (indices, scores) if with_scores else indices


def lightning_indexer_bwd(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, indices: torch.Tensor,
                          grad_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dw) of sum(grad_scores * I[t, indices[t]]), -1 entries ignored."""
    acc = accumulation_dtype(q)
    qa, ka, wa, ga = q.to(acc), k.to(acc), w.to(acc), grad_scores.to(acc)
    valid = indices >= 0
    rows = indices.clamp(min=0).long()
    ga = torch.where(valid, ga, torch.zeros_like(ga))
    ks = ka[rows]                                            # [T, topk, Di]
    qk = torch.einsum("thd,tsd->ths", qa, ks)                # [T, Hi, topk]
    active = (qk > 0).to(acc)
    dw = torch.einsum("ts,ths->th", ga, qk.relu())
    coeff = ga[:, None, :] * wa[:, :, None] * active        # d I / d qk, [T, Hi, topk]
    dq = torch.einsum("ths,tsd->thd", coeff, ks)
    dk_sel = torch.einsum("ths,thd->tsd", coeff, qa)
    dk = torch.zeros_like(ka).index_add_(0, rows.reshape(-1), dk_sel.reshape(-1, ka.shape[1]))
    return dq.to(q.dtype), dk.to(k.dtype), dw.to(w.dtype)


def _selected_logits(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, dv: int):
    """Per kv head a: queries qg [T,Hkv,G,Dqk], selected keys [T,Hkv,topk,Dqk] and values
    [T,Hkv,topk,dv] (the values are kv[..., :dv]; zeros for -1 entries) and logits [T,Hkv,G,topk]
    (-1 entries: -inf)."""
    T, H, Dqk = q.shape
    Hkv = kv.shape[1]
    acc = accumulation_dtype(q)
    if kv.shape[0] == 0:  # no keys: every index is -1; one zero row to gather from
        kv = kv.new_zeros(1, Hkv, kv.shape[2])
    rows = indices.clamp(min=0).long()                                      # [T, Hkv, topk]
    k_sel = kv.to(acc)[rows, torch.arange(Hkv, device=kv.device)[None, :, None]]
    k_sel = k_sel.masked_fill((indices < 0)[..., None], 0.0)  # a row not selected reaches nothing
    qg = q.to(acc).reshape(T, Hkv, H // Hkv, Dqk)
    logits = torch.einsum("tagd,tasd->tags", qg, k_sel) * scale
    return qg, k_sel, k_sel[..., :dv], logits.masked_fill((indices < 0)[:, :, None, :], -math.inf)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float | None = None,
                     dv: int | None = None, gate: torch.Tensor | None = None, return_p: bool = False,
                     deterministic: bool = False):
    """Attention of each query over its selected keys (kda_dsa_ops.sparse_attention's contract;
    deterministic changes nothing here).

    q [T,H,Dqk], kv [Tk,Hkv,Dqk], indices [T,Hkv,topk] (-1: no key). Query head h reads kv head
    h // (H // Hkv). o = sigmoid(gate) * softmax(scale * q.k_sel) v_sel with v_sel = kv[..., :dv];
    scale defaults to Dqk ** -0.5, dv to 512 for Dqk = 576, else Dqk.
    Returns (o [T,H,dv] in q's dtype, lse [T,H] natural log (-inf for a row with no key, whose o is
    0), p [T,Hkv,topk] probabilities summed over the heads of each kv head, or None). A NaN logit
    makes its row's o and lse NaN; an inf value with probability 0 its channel of o.
    """
    T, H, _ = q.shape
    acc = accumulation_dtype(q)
    scale, dv = attention_defaults(q, scale, dv)
    _, _, v_sel, logits = _selected_logits(q, kv, indices, scale, dv)
    lse = torch.logsumexp(logits, dim=-1)                                   # [T, Hkv, G]
    probs = torch.where((lse == -math.inf)[..., None], torch.zeros((), dtype=acc, device=q.device),
                        torch.exp(logits - lse[..., None]))
    attn = torch.einsum("tags,tasd->tagd", probs, v_sel).reshape(T, H, dv)
    o = attn * torch.sigmoid(gate.to(acc)) if gate is not None else attn
    p = probs.sum(2) if return_p else None
    return o.to(q.dtype), lse.reshape(T, H), p


def sparse_attn_bwd(do: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                    lse: torch.Tensor, scale: float, dv: int, gate: torch.Tensor | None = None):
    """(dq, dkv, dgate) of sparse_attention, written out explicitly. dkv [Tk,Hkv,Dqk] collects the
    key gradient and, in its first dv channels, the value gradient; dgate is None without a gate."""
    T, H, Dqk = q.shape
    Hkv = kv.shape[1]
    G = H // Hkv
    acc = accumulation_dtype(q)
    qg, k_sel, v_sel, logits = _selected_logits(q, kv, indices, scale, dv)
    lse_g = lse.to(acc).reshape(T, Hkv, G)
    live = (indices >= 0)[:, :, None, :] & (lse_g != -math.inf)[..., None]
    probs = torch.where(live, torch.exp(logits - lse_g[..., None]), torch.zeros((), dtype=acc, device=q.device))
    attn = torch.einsum("tags,tasd->tagd", probs, v_sel)                    # ungated output
    d_attn = do.to(acc).reshape(T, Hkv, G, dv)
    dgate = None
    if gate is not None:
        sg = torch.sigmoid(gate.to(acc)).reshape(T, Hkv, G, dv)
        dgate = (d_attn * attn * sg * (1 - sg)).reshape(T, H, dv).to(gate.dtype)
        d_attn = d_attn * sg
    delta = (d_attn * attn).sum(-1, keepdim=True)                            # [T, Hkv, G, 1]
    dprobs = torch.einsum("tagd,tasd->tags", d_attn, v_sel)
    dlogits = probs * (dprobs - delta) * scale
    dq = torch.einsum("tags,tasd->tagd", dlogits, k_sel).reshape(T, H, Dqk)
    dk_sel = torch.einsum("tags,tagd->tasd", dlogits, qg)                    # [T, Hkv, topk, Dqk]
    dv_sel = torch.einsum("tags,tagd->tasd", probs, d_attn)                  # [T, Hkv, topk, dv]
    rows = indices.clamp(min=0).long()
    heads = torch.arange(Hkv, device=q.device)[None, :, None].expand_as(rows)
    keep = (indices >= 0)[..., None].to(acc)
    flat = (rows * Hkv + heads).reshape(-1)
    dkv = torch.zeros(kv.shape[0] * Hkv, kv.shape[2], dtype=acc, device=q.device)
    if kv.shape[0]:  # without keys every index is -1: nothing to add
        dkv.index_add_(0, flat, (dk_sel * keep).reshape(-1, kv.shape[2]))
        dv_rows = torch.zeros(kv.shape[0] * Hkv, dv, dtype=acc, device=q.device)
        dv_rows.index_add_(0, flat, (dv_sel * keep).reshape(-1, dv))
        dkv[:, :dv] += dv_rows
    return dq.to(q.dtype), dkv.reshape(kv.shape).to(kv.dtype), dgate
