"""The model's losses: chunked linear cross-entropy (mean CE of (h W^T) against labels without the
[T, vocab] logits ever existing whole; the gradient is computed with the loss, a chunk at a time,
by cross_entropy_rows_) and the DSA indexer's KL loss."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import ops
from .._dtypes import accumulation_dtype


class _ChunkedLinearCE(torch.autograd.Function):
    """Forward: per chunk, the logits (in h's dtype: bf16 operands, fp32 accumulation), then rows()
    turns them into the loss, the predictions and, in place, the gradient of the summed loss, which
    gives dh (and dW, summed over the chunks in fp32) right away; the backward only scales them."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, labels: Tensor, chunk: int, ignore_index: int, want_dh: bool,
                want_dw: bool, rows) -> tuple[Tensor, Tensor]:
        acc = accumulation_dtype(h)
        valid = labels != ignore_index
        count = valid.sum().clamp_min(1)
        total, hits = h.new_zeros((), dtype=acc), h.new_zeros((), dtype=torch.int64)
        dh = torch.empty_like(h) if want_dh else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_dw else None
        for s in range(0, h.shape[0], chunk):
            hs, ls = h[s:s + chunk], labels[s:s + chunk]
            logits = hs @ weight.t()
            loss, predicted = rows(logits, ls, ignore_index, 1.0, want_dh or want_dw)
            total, hits = total + loss.sum(), hits + ((predicted == ls) & valid[s:s + chunk]).sum()
            if dh is not None:
                dh[s:s + chunk] = logits @ weight
            if dw is not None:
                _add_product(dw, logits.t(), hs)
            del logits  # before the next chunk's: one [chunk, vocab] block at a time
        ctx.save_for_backward(dh, dw, count)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(hits)
        return total / count, hits.to(torch.float32) / count.to(torch.float32)

    @staticmethod
    def backward(ctx, grad: Tensor, grad_hits: Tensor):
        dh, dw, count = ctx.saved_tensors
        scale = grad / count
        dw_out = None
        if dw is not None:  # scaled straight into the weight's dtype: no second fp32 [vocab, hidden]
            dw_out = torch.mul(dw, scale, out=torch.empty(dw.shape, dtype=ctx.weight_dtype, device=dw.device))
        return (dh * scale).to(dh.dtype) if dh is not None else None, dw_out, None, None, None, None, None, None


def _add_product(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b with acc in the accumulation dtype: on CUDA the product is summed into acc by
    the GEMM itself (out_dtype), with no [vocab, hidden] temporary in a's dtype."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif a.is_cuda:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += a @ b


def chunked_linear_cross_entropy(h: Tensor, weight: Tensor, labels: Tensor, chunk: int = 4096,
                                 ignore_index: int = -100, rows=None, with_accuracy: bool = False):
    """Mean cross-entropy of softmax(h @ weight^T) against labels over the tokens whose label is
    not ignore_index. h [T, hidden], weight [vocab, hidden], labels [T] int64. Peak memory holds
    one [chunk, vocab] block of logits in h's dtype; where a gradient is wanted it is computed in
    the forward (no second pass over the logits). rows: cross_entropy_rows_ as the backend gives it
    (default: the kernels). with_accuracy: also the share of labelled tokens whose argmax logit
    is the label (from the same logits), as (loss, accuracy)."""
    grad = torch.is_grad_enabled()
    loss, accuracy = _ChunkedLinearCE.apply(h, weight, labels, chunk, ignore_index, grad and h.requires_grad,
                                            grad and weight.requires_grad, rows or ops.cross_entropy_rows_)
    return (loss, accuracy) if with_accuracy else loss


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
