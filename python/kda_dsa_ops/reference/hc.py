"""Hyper-connections (mHC, GLM-5.3) in PyTorch: the definition of hc_mix, the per-token mixing
of residual streams that kda_dsa_ops.hc_mix computes."""

from __future__ import annotations

import torch
from torch import Tensor

from .._dtypes import accumulation_dtype


def hc_mix(x: Tensor, a: Tensor, z: Tensor | None = None, b: Tensor | None = None) -> Tensor:
    """y[t, i, :] = sum_j a[t, i, j] * x[t, j, :]  (+ b[t, i] * z[t, :]), in x's dtype.

    x [T, n, D] streams; a [T, m, n] each token's mixing matrix (any float dtype, 1 <= n, m <= 8);
    z [T, D] (x's dtype) and b [T, m] (a's dtype) come together or not at all. Products and sums
    in the accumulation dtype (float64 for float64 x, else float32), rounded once. Collapsing the
    streams into a block's input is m = 1 (a = pre[:, None]); mixing the block's output back into
    them is a = comb^T, z = the output, b = post. Differentiable w.r.t. x, a, z and b.
    """
    if (z is None) != (b is None):
        raise ValueError("hc_mix: z and b come together")
    acc = accumulation_dtype(x)
    y = torch.einsum("tij,tjd->tid", a.to(acc), x.to(acc))
    if z is not None:
        y = y + b.to(acc)[..., None] * z.to(acc)[:, None]
    return y.to(x.dtype)
