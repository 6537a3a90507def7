"""KDA (Kimi Delta Attention): the chunked gated delta rule, forward and backward.

chunk_kda is argument-compatible with flash-linear-attention's chunk_kda. Semantics are defined
in kda_dsa_ops.reference.kda (the naive recurrence).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import _C
from .._dtypes import accumulation_dtype

_ops = torch.ops.kda_dsa_ops
_PRECISIONS = ("highest", "high", "medium")


def chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
              initial_state: Tensor | None = None, output_final_state: bool = False,
              use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Tensor | None = None,
              matmul_precision: str | None = None, *, use_gate_in_kernel: bool = False, A_log: Tensor | None = None,
              dt_bias: Tensor | None = None, lower_bound: float | None = None, safe_gate: bool = False,
              use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False, state_v_first: bool = False,
              cu_seqlens_cpu: Tensor | None = None, disable_recompute: bool = False,
              **kwargs) -> tuple[Tensor, Tensor | None]:
    """Gated delta-rule linear attention with a per-channel decay, chunk by chunk.

    q, k [B, T, H, K]; v [B, T, HV, V] with HV a multiple of H (grouped value heads); g [B, T, HV, K]
    the log-decay (natural log, <= 0; -inf resets the state; values below -128 count as -128, whose
    exp is zero in fp32; float32 or the dtype of q); beta [B, T, HV] in [0, 2] (float32 or the dtype
    of q). q, k, v in bfloat16, float16, float32 (or float64 on CPU). K, V <= 128.
    scale defaults to K ** -0.5. initial_state [N, HV, K, V] float32 (N = B, or the number of
    sequences). cu_seqlens int32 (or int64, below 2^31) [N + 1] packs N sequences of any length
    into B == 1. g above 0 and beta outside [0, 2] are outside the contract (the chunk's products
    grow with exp(g) and beta, and overflow where a short recurrence may not): an error on CPU
    tensors, and on CUDA ones with kda_dsa_ops.set_value_checks(True); unchecked, the outputs are
    undefined (typically NaN).

    Non-finite inputs: a NaN or inf in k, g or beta at step t makes the outputs from step t to the
    end of its sequence and the final state NaN; one in v[t, j] does so for value column j; one in
    q[t] for o[t]. The outputs before step t are those of the finite inputs, as in the recurrence.
    use_qk_l2norm_in_kernel normalises q and k per head (x / sqrt(|x|^2 + 1e-6)).
    Returns o [B, T, HV, V] in q's dtype and the final state [N, HV, K, V] float32 (None unless
    output_final_state). Differentiable w.r.t. q, k, v, g, beta and initial_state.

    matmul_precision ("highest", "high", "medium") sets the precision of the CUDA kernels'
    internal fp32 products. By default bf16 / fp16 inputs take bf16 operands with fp32
    accumulation and fp32 state (flash-linear-attention's precision, as "medium"); fp32 inputs
    follow torch.get_float32_matmul_precision(), as torch's fp32 matmuls do. "highest" and "high"
    compute the products as 3xTF32 (fp32 accuracy; opt-in for bf16 / fp16 inputs, on an H200 about
    9x slower forward and 6x slower forward+backward at K, V in {64, 128}); "medium" rounds their
    operands to bfloat16, so that every output, gradient and the final state carry bf16 rounding
    (relative RMS <~ 5e-3 at K, V = 64, 128). The CPU kernels always compute in the accumulation
    type.

    flash-linear-attention 0.6's options, with its meaning: use_gate_in_kernel takes g as the raw
    gate and A_log [HV], dt_bias [HV * K] (optional): the log-decay is -exp(A_log) * softplus(g +
    dt_bias), or with lower_bound (< 0) lower_bound * sigmoid(exp(A_log) * (g + dt_bias));
    safe_gate (fla's kernel choice for a bounded gate) needs lower_bound and changes nothing else
    here (every exponential these kernels take is of a non-positive number anyway).
    use_beta_sigmoid_in_kernel takes beta raw: sigmoid(beta), times 2 with allow_neg_eigval.
    The bf16 kernels compute both where they load g and beta, and their backward gives the
    gradients w.r.t. the raw g, beta and A_log, dt_bias (the CPU kernels and the 3xTF32 / fp32
    family transform their inputs first, in the accumulation type, and apply the chain rule after).
    state_v_first: initial_state and the final state are [N, HV, V, K]. cu_seqlens_cpu (a host copy
    of cu_seqlens) and disable_recompute (fla's memory / time trade) are accepted and not needed.
    Other fla arguments (cp_context, use_graph, return_intermediate_states, chunk_size, ...) raise
    a TypeError naming them.
    """
    if kwargs:
        raise TypeError(f"chunk_kda: unsupported arguments {sorted(kwargs)} (this implementation takes q, k, v, g, "
                        "beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, "
                        "matmul_precision and fla 0.6's use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate, "
                        "use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens_cpu, "
                        "disable_recompute)")
    if use_gate_in_kernel:
        gate = _gate_args(g, A_log, dt_bias, lower_bound, safe_gate)
    elif A_log is not None or dt_bias is not None or lower_bound is not None or safe_gate:
        raise ValueError("chunk_kda: A_log, dt_bias, lower_bound and safe_gate belong to use_gate_in_kernel=True")
    else:
        gate = (None, None, 0.0)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("chunk_kda: allow_neg_eigval (beta = 2 sigmoid(beta)) needs use_beta_sigmoid_in_kernel=True")
    beta_scale = (2.0 if allow_neg_eigval else 1.0) if use_beta_sigmoid_in_kernel else 0.0
    if cu_seqlens_cpu is not None and (cu_seqlens is None or cu_seqlens_cpu.shape != cu_seqlens.shape):
        raise ValueError("chunk_kda: cu_seqlens_cpu is a host copy of cu_seqlens and needs it, of the same shape")
    del disable_recompute  # fla's memory / time trade; these kernels keep no [T]-sized state to recompute
    if state_v_first:
        initial_state = None if initial_state is None else initial_state.transpose(-1, -2).contiguous()
    precision = default_precision(q.dtype) if matmul_precision is None else matmul_precision
    if precision not in _PRECISIONS:
        raise ValueError(f"chunk_kda: matmul_precision must be one of {_PRECISIONS}, got {precision!r}")
    if scale is None:  # K = 0 is left to the op's own check
        scale = q.shape[-1] ** -0.5 if q.shape[-1] > 0 else 1.0
    if cu_seqlens is not None and cu_seqlens.dtype == torch.int64:
        cu_seqlens = _int32_offsets(cu_seqlens)
    args = (float(scale), use_qk_l2norm_in_kernel, precision == "medium")
    windows = _windows(q.shape[0] * v.shape[2], q.shape[1])
    if windows is None:
        o, final_state = _ops.kda_fwd(q, k, v, g, beta, args[0], initial_state, cu_seqlens, output_final_state,
                                      *args[1:], *gate, beta_scale)
    else:
        o, final_state = _Windows.apply(q, k, v, g, beta, initial_state, cu_seqlens, windows, args, *gate,
                                        beta_scale)
    if not output_final_state:
        return o, None
    return o, final_state.transpose(-1, -2) if state_v_first else final_state


# A call of more than 2 * WINDOW_TOKEN_HEADS tokens x value heads runs as windows along T of about
# WINDOW_TOKEN_HEADS each (the kernels' workspaces are sized by the tokens of one call: ~5.3 KB per
# token and value head in the bf16 backward at K = V = 128).
WINDOW_TOKEN_HEADS = 1 << 20


def _windows(heads: int, T: int) -> tuple[tuple[int, int], ...] | None:
    """[a, b) token ranges along T (multiples of the 64-token chunk) for a call whose B * HV is
    `heads`, or None when it runs as one."""
    length = max(64, WINDOW_TOKEN_HEADS // max(heads, 1) // 64 * 64)
    if T <= 2 * length:
        return None
    return tuple((a, min(a + length, T)) for a in range(0, T, length))


class _Windows(torch.autograd.Function):
    """chunk_kda as windows along T: each window's kda_fwd starts from the previous window's final
    states (every sequence's: one still running carries on, one not yet begun or already ended
    passes its state through a window it has no tokens in), kda_bwd runs the windows backwards
    with the next window's initial-state gradient as its final-state gradient. The same
    recurrence, workspaces of one window; outputs and gradients written into whole tensors (the
    gate's parameters' gradients summed over the windows)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, cu_seqlens, windows, args, A_log, dt_bias, lower_bound,
                beta_scale):
        scale, l2norm, bf16 = args
        gate = (A_log, dt_bias, lower_bound, beta_scale)
        o = q.new_empty(q.shape[0], q.shape[1], v.shape[2], v.shape[3])
        starts, state = [], initial_state
        for a, b in windows:
            starts.append(state)
            o_w, state = _ops.kda_fwd(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], scale, state,
                                      _window_offsets(cu_seqlens, a, b), True, l2norm, bf16, *gate)
            o[:, a:b].copy_(o_w)
        ctx.save_for_backward(q, k, v, g, beta, cu_seqlens, A_log, dt_bias, *starts)
        ctx.windows, ctx.args, ctx.gate = windows, args, (lower_bound, beta_scale)
        return o, state

    @staticmethod
    def backward(ctx, grad_o, grad_final_state):
        q, k, v, g, beta, cu_seqlens, A_log, dt_bias, *starts = ctx.saved_tensors
        scale, l2norm, bf16 = ctx.args
        grads = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v, g, beta)]
        d_gate = [None, None]
        d_state = grad_final_state
        for (a, b), start in reversed(list(zip(ctx.windows, starts))):
            *parts, dh0, dA_log, ddt_bias = _ops.kda_bwd(
                grad_o[:, a:b].contiguous(), d_state, q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], scale,
                start, _window_offsets(cu_seqlens, a, b), l2norm, bf16, A_log, dt_bias, *ctx.gate)
            for whole, part in zip(grads, parts):
                whole[:, a:b].copy_(part)
            d_gate = [_summed(d_gate[0], dA_log, A_log), _summed(d_gate[1], ddt_bias, dt_bias)]
            d_state = dh0 if start is not None else None
        return (*grads, d_state, None, None, None, *d_gate, None, None)


def _summed(total: Tensor | None, part: Tensor, param: Tensor | None) -> Tensor | None:
    """A gate parameter's gradient summed over windows (None where the parameter is absent)."""
    if param is None:
        return None
    part = part.reshape(param.shape).to(param.dtype)
    return part if total is None else total + part


def _window_offsets(cu_seqlens: Tensor | None, a: int, b: int) -> Tensor | None:
    """cu_seqlens of the tokens [a, b) of a packed batch: every sequence, those outside empty."""
    return None if cu_seqlens is None else (cu_seqlens.clamp(a, b) - a).to(torch.int32)


def _gate_args(g: Tensor, A_log: Tensor | None, dt_bias: Tensor | None, lower_bound: float | None,
               safe_gate: bool) -> tuple[Tensor, Tensor | None, float]:
    """fla 0.6's in-kernel gate's arguments (chunk_kda's docstring) as the op takes them: A_log
    [HV], dt_bias [HV * K] or None, lower_bound (0 for the softplus gate)."""
    HV, K = g.shape[-2], g.shape[-1]
    if A_log is None or A_log.numel() != HV:
        raise ValueError(f"chunk_kda: use_gate_in_kernel needs A_log with one value per value head ({HV}), got "
                         f"{None if A_log is None else tuple(A_log.shape)}")
    if dt_bias is not None and dt_bias.numel() != HV * K:
        raise ValueError(f"chunk_kda: dt_bias must hold HV * K = {HV * K} values, got {tuple(dt_bias.shape)}")
    if safe_gate and lower_bound is None:
        raise ValueError("chunk_kda: safe_gate needs lower_bound (the gate's lower bound, < 0)")
    if lower_bound is not None and not -math.inf < lower_bound < 0:
        raise ValueError(f"chunk_kda: lower_bound must be a finite number < 0, got {lower_bound}")
    return (A_log.reshape(HV), None if dt_bias is None else dt_bias.reshape(HV * K),
            0.0 if lower_bound is None else float(lower_bound))


def _int32_offsets(cu_seqlens: Tensor) -> Tensor:
    """int64 cu_seqlens as the op's int32, its values checked first where values are checked (CPU
    tensors, or kda_dsa_ops.set_value_checks(True)): a cast would wrap those past 2^31."""
    if cu_seqlens.numel() > 0 and (not cu_seqlens.is_cuda or _C.switch("value_checks")):
        lo, hi = int(cu_seqlens.min()), int(cu_seqlens.max())
        if lo < 0 or hi >= 2 ** 31:
            raise ValueError(f"chunk_kda: cu_seqlens values must lie in [0, 2^31) (int32 offsets), got values in "
                             f"[{lo}, {hi}]")
    return cu_seqlens.to(torch.int32)


def default_precision(dtype: torch.dtype) -> str:
    """chunk_kda's matmul_precision when none is given: "medium" (bf16 operands) for bf16 / fp16
    inputs, torch's fp32 matmul precision otherwise."""
    return "medium" if dtype in (torch.bfloat16, torch.float16) else _torch_matmul_precision()


@torch.compiler.assume_constant_result
def _torch_matmul_precision() -> str:
    """torch's fp32 matmul precision (a constant of the graph under torch.compile)."""
    return torch.get_float32_matmul_precision()


def _num_sequences(q: Tensor, cu_seqlens: Tensor | None) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


@torch.library.register_fake("kda_dsa_ops::kda_fwd")
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, use_qk_l2norm, bf16_products=False,
      A_log=None, dt_bias=None, lower_bound=0.0, beta_scale=0.0):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    shape = (_num_sequences(q, cu_seqlens), HV, K, V) if output_final_state else (0,)
    return q.new_empty(B, T, HV, V), q.new_empty(shape, dtype=accumulation_dtype(q))


@torch.library.register_fake("kda_dsa_ops::kda_bwd")
def _(grad_o, grad_final_state, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm,
      bf16_products=False, A_log=None, dt_bias=None, lower_bound=0.0, beta_scale=0.0):
    # the kernels return contiguous gradients whatever the inputs' strides (new_empty: contiguous)
    acc = accumulation_dtype(q)
    dh0 = initial_state.new_empty(initial_state.shape) if initial_state is not None else q.new_empty(0, dtype=acc)
    d_gate = [q.new_empty(0 if x is None else x.numel(), dtype=acc) for x in (A_log, dt_bias)]
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
            beta.new_empty(beta.shape), dh0, *d_gate)


def _kda_setup(ctx, inputs, output):
    (q, k, v, g, beta, scale, initial_state, cu_seqlens, _, use_qk_l2norm, bf16_products, A_log, dt_bias, lower_bound,
     beta_scale) = inputs  # (torch fills in the defaults)
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias)
    ctx.scale, ctx.use_qk_l2norm, ctx.bf16_products = scale, use_qk_l2norm, bf16_products
    ctx.gate = (lower_bound, beta_scale)


def _kda_backward(ctx, grad_o, grad_final_state):
    q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias = ctx.saved_tensors
    if grad_final_state is not None and grad_final_state.numel() == 0:
        grad_final_state = None
    dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias = _ops.kda_bwd(
        grad_o.contiguous(), grad_final_state, q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens,
        ctx.use_qk_l2norm, ctx.bf16_products, A_log, dt_bias, *ctx.gate)
    return (dq, dk, dv, dg, dbeta, None, (dh0 if initial_state is not None else None), None, None, None, None,
            _summed(None, dA_log, A_log), _summed(None, ddt_bias, dt_bias), None, None)


torch.library.register_autograd("kda_dsa_ops::kda_fwd", _kda_backward, setup_context=_kda_setup)
