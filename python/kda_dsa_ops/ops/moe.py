"""MoE ops: expert routing, permutation by expert and the grouped expert GEMM.

Thin typed wrappers over torch.ops.kda_dsa_ops.*, with their fake (meta) kernels and autograd.
Semantics are defined in kda_dsa_ops.reference.moe.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._dtypes import accumulation_dtype
from ..contracts import permute_capacity

_ops = torch.ops.kda_dsa_ops


def moe_route(logits: Tensor, k: int, bias: Tensor | None = None, score_fn: str = "sigmoid",
              renorm: bool = True, scale: float = 1.0, n_group: int = 1, topk_group: int = 1) -> tuple[Tensor, Tensor]:
    """Pick k experts per token.

    logits [T, E] (fp32/bf16/fp16); bias [E] fp32, added to the scores for selection only.
    score_fn: "sigmoid" or "softmax" (computed in fp32). Ties go to the lower expert index.
    n_group > 1: group-limited routing (DeepSeek-V3): the E experts form n_group groups of
    consecutive ids (at most 64 groups, each of >= 2 experts), each scored by the sum of its two
    best keys (score + bias); only the experts of the topk_group best groups may be chosen.
    Returns weights [T, k] fp32 (the chosen scores, divided by their sum when renorm, times
    scale; differentiable w.r.t. logits) and ids [T, k] int32 in rank order.
    """
    return _ops.moe_route(logits, bias, k, score_fn, renorm, scale, n_group, topk_group)


def moe_permute(x: Tensor, ids: Tensor, num_experts: int, weights: Tensor | None = None,
                capacity: int | None = None, capacity_factor: float | None = None,
                policy: str = "drop_probs", fallback_ids: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Sort the token copies x[t] (one per ids[t, j]) by expert, without a host synchronisation.

    x [T, D]; ids [T, k] int32; weights [T, k] fp32 (needed to rank copies for drop_probs and
    reroute). capacity (rows per expert) or capacity_factor (capacity = ceil(cf * T * k / E));
    neither: keep every copy. policy: "drop_probs" keeps each expert's highest-weight copies,
    "drop_position" its earliest, "reroute" sends an overflowing copy to the first expert of
    fallback_ids[t] ([T, F] int32, -1 = none) with room left.
    Returns x_sorted [M, D], row_map [M] int32 (copy index t*k + j of each row, -1 for unused
    rows) and offs [E] int32 (cumulative rows per expert), ready for grouped_mm. M = T*k, or
    min(T*k, E*capacity) with a capacity. Differentiable w.r.t. x.
    """
    capacity = permute_capacity(ids, num_experts, capacity, capacity_factor)
    return _ops.moe_permute(x, ids, weights, num_experts, -1 if capacity is None else capacity, policy,
                            fallback_ids)


def moe_unpermute(y_sorted: Tensor, row_map: Tensor, weights: Tensor, num_tokens: int) -> Tensor:
    """Combine expert outputs: y[t] = sum_j weights[t, j] * y_sorted[row of copy t*k+j].

    y_sorted [M, D]; row_map [M] int32 from moe_permute; weights [T, k] fp32. Dropped copies add
    nothing. Accumulates in fp32 in a fixed order (deterministic). Differentiable w.r.t.
    y_sorted and weights.
    """
    return _ops.moe_unpermute(y_sorted, row_map, weights, num_tokens)


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """out[r] = a[r] @ b[e] for the rows r of expert e, [offs[e-1], offs[e]) (offs[-1] = 0).

    a [M, K]; b [E, K, N] row-major or the transpose view of an [E, N, K] tensor; offs [E] int32
    cumulative (any counts, zero included). Rows past offs[-1] are zero. bf16/fp16 on CUDA
    (fp32 accumulation); the CUDA kernel needs 16-byte aligned rows (K, N multiples of 8).
    Same semantics as torch._grouped_mm. Differentiable w.r.t. a and b.
    """
    return _ops.grouped_mm(a, b, offs)


def grouped_mm_wgrad(a: Tensor, dy: Tensor, offs: Tensor) -> Tensor:
    """Weight gradient of grouped_mm: out[e] = a[rows of e]^T @ dy[rows of e], [E, K, N]."""
    return _ops.grouped_mm_wgrad(a, dy, offs)


@torch.library.register_fake("kda_dsa_ops::moe_route")
def _(logits, bias, k, score_fn, renorm, scale, n_group=1, topk_group=1):
    T = logits.shape[0]
    return logits.new_empty(T, k, dtype=accumulation_dtype(logits)), logits.new_empty(T, k, dtype=torch.int32)


@torch.library.register_fake("kda_dsa_ops::moe_route_bwd")
def _(grad_weights, logits, ids, score_fn, renorm, scale):
    return logits.new_empty(logits.shape)


@torch.library.register_fake("kda_dsa_ops::moe_permute")
def _(x, ids, weights, num_experts, capacity, policy, fallback_ids):
    copies = ids.shape[0] * ids.shape[1]
    rows = copies if capacity < 0 else min(copies, num_experts * capacity)
    return (x.new_empty(rows, x.shape[1]), ids.new_empty(rows), ids.new_empty(num_experts))


@torch.library.register_fake("kda_dsa_ops::moe_unpermute")
def _(y_sorted, row_map, weights, num_tokens):
    return y_sorted.new_empty(num_tokens, y_sorted.shape[1])


@torch.library.register_fake("kda_dsa_ops::moe_unpermute_bwd")
def _(grad_y, y_sorted, row_map, weights):
    return y_sorted.new_empty(y_sorted.shape), weights.new_empty(weights.shape)


@torch.library.register_fake("kda_dsa_ops::grouped_mm")
def _(a, b, offs):
    return a.new_empty(a.shape[0], b.shape[2])


@torch.library.register_fake("kda_dsa_ops::grouped_mm_wgrad")
def _(a, dy, offs):
    return a.new_empty(offs.shape[0], a.shape[1], dy.shape[1])


def _route_setup(ctx, inputs, output):
    logits, _, _, score_fn, renorm, scale = inputs[:6]
    ctx.save_for_backward(logits, output[1])
    ctx.args = (score_fn, renorm, scale)


def _route_backward(ctx, grad_weights, grad_ids):
    logits, ids = ctx.saved_tensors
    grad_logits = _ops.moe_route_bwd(grad_weights.contiguous(), logits, ids, *ctx.args)
    return grad_logits, None, None, None, None, None, None, None


def _permute_setup(ctx, inputs, output):
    x, ids = inputs[0], inputs[1]
    ctx.save_for_backward(output[1])
    ctx.num_tokens, ctx.topk = x.shape[0], ids.shape[1]


def _permute_backward(ctx, grad_x_sorted, grad_row_map, grad_offs):
    (row_map,) = ctx.saved_tensors
    ones = torch.ones(ctx.num_tokens, ctx.topk, dtype=torch.float32, device=grad_x_sorted.device)
    return _ops.moe_unpermute(grad_x_sorted.contiguous(), row_map, ones, ctx.num_tokens), None, None, None, None, None, None


def _unpermute_setup(ctx, inputs, output):
    y_sorted, row_map, weights, _ = inputs
    ctx.save_for_backward(y_sorted, row_map, weights)


def _unpermute_backward(ctx, grad_y):
    y_sorted, row_map, weights = ctx.saved_tensors
    grad_ys, grad_w = _ops.moe_unpermute_bwd(grad_y.contiguous(), y_sorted, row_map, weights)
    return grad_ys, None, grad_w, None


def _grouped_mm_setup(ctx, inputs, output):
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


def _grouped_mm_backward(ctx, grad_out):
    a, b, offs = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    grad_a = _ops.grouped_mm(grad_out, b.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    grad_b = _ops.grouped_mm_wgrad(a, grad_out, offs) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


torch.library.register_autograd("kda_dsa_ops::moe_route", _route_backward, setup_context=_route_setup)
torch.library.register_autograd("kda_dsa_ops::moe_permute", _permute_backward, setup_context=_permute_setup)
torch.library.register_autograd("kda_dsa_ops::moe_unpermute", _unpermute_backward, setup_context=_unpermute_setup)
torch.library.register_autograd("kda_dsa_ops::grouped_mm", _grouped_mm_backward, setup_context=_grouped_mm_setup)
