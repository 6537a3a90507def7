"""Pure-PyTorch KDA (Kimi Delta Attention): the naive recurrence, step by step.

Per sequence, value head hv (query/key head h = hv // (HV // H)) and step t, with the state
S in R^{K x V} kept in float32 (float64 for float64 inputs):
    S' = Diag(exp(g_t)) S_{t-1}
    S_t = S' + beta_t k_t (v_t - S'^T k_t)^T
    o_t = scale * S_t^T q_t
With flash-linear-attention 0.6's in-kernel options, g is the raw gate that kda_gate maps to the
log-decay, and beta the raw value that sigmoid (times 2 with allow_neg_eigval) maps to beta.
"""

from __future__ import annotations

import torch

from .._dtypes import accumulation_dtype

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dimension."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def kda_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None,
             lower_bound: float | None = None) -> torch.Tensor:
    """The log-decay from the raw gate g [B,T,HV,K]: with x = g + dt_bias (dt_bias [HV*K] or
    [HV,K]) and a = exp(A_log) (A_log [HV]), -a * softplus(x) (softplus(x) = x above 20), or, with
    lower_bound, lower_bound * sigmoid(a * x) (bounded below by lower_bound)."""
    HV, K = g.shape[-2], g.shape[-1]
    x = g if dt_bias is None else g + dt_bias.reshape(HV, K).to(g.dtype)
    a = A_log.to(g.dtype).exp()[:, None]
    if lower_bound is None:
        return -a * torch.where(x > 20, x, torch.log1p(torch.exp(torch.minimum(x, x.new_tensor(20.0)))))
    return lower_bound * torch.sigmoid(a * x)


def _sequences(B: int, T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of every sequence."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    if B != 1:
        raise ValueError(f"cu_seqlens needs packed input with B == 1, got B = {B}")
    bounds = cu_seqlens.tolist()
    return [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
              use_qk_l2norm_in_kernel: bool = False, cu_seqlens: torch.Tensor | None = None,
              matmul_precision: str | None = None, *, use_gate_in_kernel: bool = False,
              A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
              lower_bound: float | None = None, safe_gate: bool = False, use_beta_sigmoid_in_kernel: bool = False,
              allow_neg_eigval: bool = False, state_v_first: bool = False,
              cu_seqlens_cpu: torch.Tensor | None = None,
              disable_recompute: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """o [B,T,HV,V] (input dtype) and the final state [N,HV,K,V] (fp32/fp64) or None, by the
    recurrence step by step (kda_dsa_ops.chunk_kda's contract; matmul_precision, safe_gate,
    cu_seqlens_cpu and disable_recompute change nothing here: every product is in the
    accumulation dtype).

    q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K] log-decay (the raw gate with use_gate_in_kernel:
    kda_gate); beta [B,T,HV] (raw with use_beta_sigmoid_in_kernel: sigmoid, times 2 with
    allow_neg_eigval); initial_state [N,HV,K,V] ([N,HV,V,K] and so the final state with
    state_v_first) with N the number of sequences (B, or len(cu_seqlens) - 1).
    """
    if use_gate_in_kernel:
        g = kda_gate(g.to(accumulation_dtype(q)), A_log, dt_bias, lower_bound)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.to(accumulation_dtype(q))) * (2.0 if allow_neg_eigval else 1.0)
    if state_v_first:
        initial_state = None if initial_state is None else initial_state.transpose(-1, -2)
        o, final = chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                             cu_seqlens)
        return o, None if final is None else final.transpose(-1, -2)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of query/key heads ({H})")
    acc = accumulation_dtype(q)
    scale = K ** -0.5 if scale is None else scale
    group = HV // H
    qa, ka = q.to(acc), k.to(acc)
    if use_qk_l2norm_in_kernel:
        qa, ka = l2norm(qa), l2norm(ka)
    qa = qa.repeat_interleave(group, dim=2)
    ka = ka.repeat_interleave(group, dim=2)
    va, ga, ba = v.to(acc), g.to(acc), beta.to(acc)
    seqs = _sequences(B, T, cu_seqlens)
    o = torch.zeros(B, T, HV, V, dtype=acc, device=q.device)
    finals = []
    for n, (b, start, end) in enumerate(seqs):
        S = (initial_state[n].to(acc).clone() if initial_state is not None
             else torch.zeros(HV, K, V, dtype=acc, device=q.device))
        for t in range(start, end):
            S = S * ga[b, t].exp()[:, :, None]
            kt = ka[b, t]
            residual = va[b, t] - torch.einsum("hkv,hk->hv", S, kt)
            S = S + ba[b, t][:, None, None] * kt[:, :, None] * residual[:, None, :]
            o[b, t] = scale * torch.einsum("hkv,hk->hv", S, qa[b, t])
        finals.append(S)
    final = torch.stack(finals) if output_final_state else None
    return o.to(q.dtype), final
