"""The LM head's cross-entropy over rows of logits: a typed wrapper over
torch.ops.kda_dsa_ops.cross_entropy_rows_ and its fake kernel. Semantics are defined in
kda_dsa_ops.reference.loss; the chunked linear cross-entropy (nn.chunked_linear_cross_entropy)
is built on it."""

from __future__ import annotations

import torch
from torch import Tensor

from .._dtypes import accumulation_dtype

_ops = torch.ops.kda_dsa_ops


def cross_entropy_rows_(logits: Tensor, labels: Tensor, ignore_index: int = -100, scale: float = 1.0,
                        write_grad: bool = True) -> tuple[Tensor, Tensor]:
    """Per row r: loss[r] = lse(x[r]) - x[r, labels[r]] (0 where labels[r] == ignore_index), fp32
    (fp64 for fp64 logits), and argmax[r] int64, the row's prediction from the same pass (the first
    index of its largest logit, NaNs left out; -1 on an ignored row or one with no logit above
    -inf); with write_grad the logits are overwritten in place with
    scale * (softmax(x[r]) - onehot(labels[r])) (zeros on an ignored row). logits [N, V]
    contiguous (bf16 / fp16 / fp32, fp64 on the CPU), labels [N] int64 in [0, V) or ignore_index
    (a value check; without value checks the CUDA kernel treats a label out of range as ignored).
    A NaN or +inf logit makes its row NaN. Not differentiable."""
    return _ops.cross_entropy_rows_(logits, labels, ignore_index, scale, write_grad)


@torch.library.register_fake("kda_dsa_ops::cross_entropy_rows_")
def _(logits, labels, ignore_index, scale, write_grad):
    return (logits.new_empty(logits.shape[0], dtype=accumulation_dtype(logits)),
            labels.new_empty(logits.shape[0]))
