"""Activations fused with what surrounds them: KDA's short causal convolution + SiLU over packed
sequences, and SwiGLU (with GLM-5.3's clamps). Typed wrappers over torch.ops.kda_dsa_ops.short_conv
and .swiglu, with their fake (meta) kernels and autograd. Semantics are defined in
kda_dsa_ops.reference.act.
"""

from __future__ import annotations

import torch
from torch import Tensor

_ops = torch.ops.kda_dsa_ops


def short_conv(x: Tensor, weight: Tensor, pos: Tensor, halo: Tensor | None = None) -> Tensor:
    """y[t, c] = silu(sum_{j < W} weight[c, j] x[t - j, c]) over the taps j = 0 and j <= pos[t]
    (never across a sequence's start), in x's dtype.

    x [T, C] packed tokens; weight [C, W] (1 <= W <= 8, any float dtype); pos [T] int64 / int32,
    each token's position within its sequence; halo [W - 1, C] in x's dtype: the rows before x
    (context parallelism's previous share; zeros when None). fp32 accumulation (fp64 for fp64 on
    the CPU), one rounding; CUDA takes bf16 / fp16 / fp32. Differentiable w.r.t. x, weight and halo.
    """
    return _ops.short_conv(x, weight, pos, halo)


def swiglu(gate_up: Tensor, limit: float = 0.0) -> Tensor:
    """silu(gate) * up of gate_up [..., 2F] = [gate, up] -> [..., F] in gate_up's dtype; limit > 0
    (GLM-5.3) first clamps gate from above at limit and up to [-limit, limit]. fp32 math (fp64 for
    fp64 on the CPU), one rounding. Differentiable w.r.t. gate_up (the clamps pass the gradient
    strictly inside their bounds, zero on them, as torch.clamp's gradient)."""
    return _ops.swiglu(gate_up, float(limit))


@torch.library.register_fake("kda_dsa_ops::short_conv")
def _(x, weight, pos, halo):
    return x.new_empty(x.shape)


@torch.library.register_fake("kda_dsa_ops::short_conv_bwd")
def _(grad_y, x, weight, pos, halo, weight_grad):
    return (x.new_empty(x.shape), weight.new_empty(weight.shape if weight_grad else (0,)),
            x.new_empty(halo.shape if halo is not None else (0,)))


@torch.library.register_fake("kda_dsa_ops::swiglu")
def _(gate_up, limit):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@torch.library.register_fake("kda_dsa_ops::swiglu_bwd")
def _(grad_h, gate_up, limit):
    return gate_up.new_empty(gate_up.shape)


def _conv_setup(ctx, inputs, output):
    x, weight, pos, halo = inputs
    ctx.save_for_backward(x, weight, pos, halo)
    ctx.with_halo = halo is not None


def _conv_backward(ctx, grad_y):
    x, weight, pos, halo = ctx.saved_tensors
    dx, dw, dhalo = _ops.short_conv_bwd(grad_y.contiguous(), x, weight, pos, halo, ctx.needs_input_grad[1])
    return dx, dw if ctx.needs_input_grad[1] else None, None, dhalo if ctx.with_halo else None


def _glu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.limit = inputs[1]


def _glu_backward(ctx, grad_h):
    (gate_up,) = ctx.saved_tensors
    return _ops.swiglu_bwd(grad_h.contiguous(), gate_up, ctx.limit), None


torch.library.register_autograd("kda_dsa_ops::short_conv", _conv_backward, setup_context=_conv_setup)
torch.library.register_autograd("kda_dsa_ops::swiglu", _glu_backward, setup_context=_glu_setup)
