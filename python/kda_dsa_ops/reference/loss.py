"""The LM head's cross-entropy over rows of logits in PyTorch: the definition of
kda_dsa_ops.cross_entropy_rows_."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._dtypes import accumulation_dtype


def cross_entropy_rows_(logits: Tensor, labels: Tensor, ignore_index: int = -100, scale: float = 1.0,
                        write_grad: bool = True) -> tuple[Tensor, Tensor]:
    """Per row r: loss[r] = lse(x[r]) - x[r, labels[r]] (0 where labels[r] == ignore_index), in the
    accumulation dtype (float64 for float64 logits, else float32), and argmax[r] (int64), the first
    index of the row's largest logit with NaNs left out: the prediction, read in the same pass (-1
    on an ignored row and where no logit is above -inf). With write_grad the logits are
    overwritten with the loss's gradient, scale * (softmax(x[r]) - onehot(labels[r])) (zeros on an
    ignored row). lse = m + log(sum(exp(x - m))) with m the row's max: a NaN or +inf logit makes
    its row NaN, a row of -inf only gives a NaN loss. logits [N, V] contiguous, labels [N] int64
    in [0, V) or ignore_index. Not differentiable: it is the forward and backward of the chunked
    linear cross-entropy in one pass (nn.chunked_linear_cross_entropy)."""
    acc = accumulation_dtype(logits)
    x = logits.to(acc)
    valid = labels != ignore_index
    if valid.any() and (labels[valid].min() < 0 or labels[valid].max() >= logits.shape[1]):
        raise ValueError(f"labels must lie in [0, {logits.shape[1]}) or equal ignore_index ({ignore_index})")
    m = x.amax(-1, keepdim=True) if x.shape[1] else x.new_zeros(x.shape[0], 1)
    m = torch.where(m == -math.inf, torch.zeros((), dtype=acc, device=x.device), m)
    lse = m + torch.log(torch.exp(x - m).sum(-1, keepdim=True))
    picked = x.gather(1, torch.where(valid, labels, 0)[:, None])
    loss = torch.where(valid, (lse - picked)[:, 0], torch.zeros((), dtype=acc, device=x.device))
    argmax = torch.full_like(labels, -1)
    if x.shape[1]:  # (with no classes there are no rows)
        finite = torch.where(torch.isnan(x), -math.inf, x)  # torch's argmax takes a row's first largest
        argmax = torch.where(valid & (finite.amax(-1) > -math.inf), finite.argmax(-1), argmax)
    if write_grad:
        grad = torch.exp(x - lse)
        grad[valid, labels[valid]] -= 1
        logits.copy_(torch.where(valid[:, None], grad * scale, torch.zeros((), dtype=acc, device=x.device)))
    return loss, argmax
