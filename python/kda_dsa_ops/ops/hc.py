"""Hyper-connection ops (mHC): the per-token mixing of residual streams.

A typed wrapper over torch.ops.kda_dsa_ops.hc_mix, with its fake (meta) kernel and autograd.
Semantics are defined in kda_dsa_ops.reference.hc.
"""

from __future__ import annotations

import torch
from torch import Tensor

_ops = torch.ops.kda_dsa_ops


def hc_mix(x: Tensor, a: Tensor, z: Tensor | None = None, b: Tensor | None = None) -> Tensor:
    """y[t, i, :] = sum_j a[t, i, j] * x[t, j, :]  (+ b[t, i] * z[t, :]), in x's dtype.

    x [T, n, D]; a [T, m, n] (any float dtype, any strides; 1 <= n, m <= 8); z [T, D] in x's dtype
    and b [T, m] in a's dtype, together or not at all. fp32 accumulation (fp64 for fp64 inputs on
    the CPU), one rounding; CUDA takes bf16 / fp16 / fp32 x. Differentiable w.r.t. all four.
    """
    return _ops.hc_mix(x, a, z, b)


@torch.library.register_fake("kda_dsa_ops::hc_mix")
def _(x, a, z, b):
    return x.new_empty(x.shape[0], a.shape[1], x.shape[2])


@torch.library.register_fake("kda_dsa_ops::hc_mix_bwd")
def _(grad_y, x, a, z, b):
    return (x.new_empty(x.shape), a.new_empty(a.shape), x.new_empty(z.shape if z is not None else (0,)),
            a.new_empty(b.shape if b is not None else (0,)))


def _mix_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)
    ctx.add = inputs[2] is not None


def _mix_backward(ctx, grad_y):
    x, a, z, b = ctx.saved_tensors
    dx, da, dz, db = _ops.hc_mix_bwd(grad_y.contiguous(), x, a, z, b)
    return dx, da, dz if ctx.add else None, db if ctx.add else None


torch.library.register_autograd("kda_dsa_ops::hc_mix", _mix_backward, setup_context=_mix_setup)
