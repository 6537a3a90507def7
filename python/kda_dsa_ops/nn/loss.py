"""The model's losses: chunked linear cross-entropy (mean CE of (h W^T) against labels without the
[T, vocab] logits ever existing whole; each chunk's logits are recomputed in the backward) and
the DSA indexer's KL loss."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .._dtypes import accumulation_dtype


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, labels: Tensor, chunk: int, ignore_index: int) -> Tensor:
        count = (labels != ignore_index).sum().clamp_min(1)
        total = h.new_zeros((), dtype=torch.float32 if h.dtype != torch.float64 else torch.float64)
        for s in range(0, h.shape[0], chunk):
            logits = (h[s:s + chunk] @ weight.t()).to(total.dtype)
            total = total + F.cross_entropy(logits, labels[s:s + chunk], ignore_index=ignore_index, reduction="sum")
        ctx.save_for_backward(h, weight, labels, count)
        ctx.chunk, ctx.ignore_index = chunk, ignore_index
        return total / count

    @staticmethod
    def backward(ctx, grad: Tensor):
        h, weight, labels, count = ctx.saved_tensors
        dh = torch.zeros_like(h) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(weight.shape, dtype=torch.float32 if weight.dtype != torch.float64 else torch.float64,
                         device=weight.device) if ctx.needs_input_grad[1] else None
        scale = grad / count
        for s in range(0, h.shape[0], ctx.chunk):
            hs, ls = h[s:s + ctx.chunk], labels[s:s + ctx.chunk]
            logits = (hs @ weight.t()).to(scale.dtype)
            d = torch.softmax(logits, dim=-1)
            valid = ls != ctx.ignore_index
            d[valid, ls[valid]] -= 1
            d = d * (valid[:, None] * scale)
            if dh is not None:
                dh[s:s + ctx.chunk] = (d.to(weight.dtype) @ weight).to(h.dtype)
            if dw is not None:
                dw += d.t().to(dw.dtype) @ hs.to(dw.dtype)
        return dh, (dw.to(weight.dtype) if dw is not None else None), None, None, None


def chunked_linear_cross_entropy(h: Tensor, weight: Tensor, labels: Tensor, chunk: int = 4096,
                                 ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy of softmax(h @ weight^T) against labels over the tokens whose label is
    not ignore_index. h [T, hidden], weight [vocab, hidden], labels [T] int64. Peak memory holds
    one [chunk, vocab] block of logits (fp32), in the forward and in the backward."""
    return _ChunkedLinearCE.apply(h, weight, labels, chunk, ignore_index)


def indexer_kl_loss(attn_p: Tensor, scores: Tensor, indices: Tensor) -> Tensor:
    """Mean over queries of KL(p || softmax(scores)) on each query's selected keys.

    attn_p [T,topk] is the main attention's probability mass on the selected keys (summed over
    heads); it is renormalised over the valid (index >= 0) entries here. Queries with no valid
    entry contribute zero.
    """
    acc = accumulation_dtype(scores)
    valid = indices >= 0
    p = torch.where(valid, attn_p.to(acc), torch.zeros((), dtype=acc, device=scores.device))
    p = p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(acc).tiny)
    logq = torch.log_softmax(scores.to(acc).masked_fill(~valid, -math.inf), dim=-1)
    terms = torch.where(p > 0, p * (torch.log(p) - logq), torch.zeros((), dtype=acc, device=scores.device))
    return terms.sum(-1).mean()
