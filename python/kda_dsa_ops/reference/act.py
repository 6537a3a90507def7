"""The fused activations in PyTorch: the definitions of short_conv (KDA's short causal
convolution over packed sequences, then SiLU) and swiglu (with GLM-5.3's clamps), which
kda_dsa_ops.short_conv and kda_dsa_ops.swiglu compute."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._dtypes import accumulation_dtype


def short_conv(x: Tensor, weight: Tensor, pos: Tensor, halo: Tensor | None = None) -> Tensor:
    """y[t, c] = silu(sum_{j < W} weight[c, j] x[t - j, c]) over the taps j = 0 and j <= pos[t], in
    x's dtype. x [T, C]; weight [C, W]; pos [T] (each token's position within its sequence: a tap
    never reaches across a sequence's start); halo [W - 1, C], the rows before x (zeros when None).
    Products and sums in the accumulation dtype (float64 for float64 x, else float32), rounded once.
    """
    T, W = x.shape[0], weight.shape[1]
    if weight.shape[0] != x.shape[1] or pos.shape != (T,):
        raise ValueError(f"short_conv: x [T, C], weight [C, W], pos [T]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(pos.shape)}")
    acc = accumulation_dtype(x)
    before = x.new_zeros(W - 1, x.shape[1]) if halo is None else halo
    padded = torch.cat([before, x]).to(acc)
    w = weight.to(acc)
    z = padded[W - 1:] * w[:, 0]
    for j in range(1, W):
        z = z + padded[W - 1 - j:W - 1 - j + T] * (pos >= j)[:, None].to(acc) * w[:, j]
    return F.silu(z).to(x.dtype)


def swiglu(gate_up: Tensor, limit: float = 0.0) -> Tensor:
    """silu(gate) * up of gate_up [..., 2F] = [gate, up] -> [..., F] in gate_up's dtype; limit > 0
    (GLM-5.3) first clamps gate from above at limit and up to [-limit, limit], keeping NaN; the
    clamps' gradient passes strictly inside their bounds (zero on them, as torch.clamp's; written
    out with where so that it does not depend on torch's version). In the accumulation dtype,
    rounded once."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu: gate_up's last dim must be even, got {gate_up.shape[-1]}")
    gate, up = gate_up.to(accumulation_dtype(gate_up)).chunk(2, dim=-1)
    if limit > 0:
        gate = torch.where(gate >= limit, limit, gate)
        up = torch.where(up >= limit, limit, torch.where(up <= -limit, -limit, up))
    return (F.silu(gate) * up).to(gate_up.dtype)
