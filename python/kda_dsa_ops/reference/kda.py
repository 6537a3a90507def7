"""Pure-PyTorch KDA (Kimi Delta Attention): the naive recurrence, step by step.

Per sequence, value head hv (query/key head h = hv // (HV // H)) and step t, with the state
S in R^{K x V} kept in float32 (float64 for float64 inputs):
    S' = Diag(exp(g_t)) S_{t-1}
    S_t = S' + beta_t k_t (v_t - S'^T k_t)^T
    o_t = scale * S_t^T q_t
"""

from __future__ import annotations

import torch

from .._dtypes import accumulation_dtype

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dimension."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


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
              matmul_precision: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """o [B,T,HV,V] (input dtype) and the final state [N,HV,K,V] (fp32/fp64) or None, by the
    recurrence step by step (kda_dsa_ops.chunk_kda's contract; matmul_precision changes nothing
    here: every product is in the accumulation dtype).

    q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K] log-decay; beta [B,T,HV];
    initial_state [N,HV,K,V] with N the number of sequences (B, or len(cu_seqlens) - 1).
    """
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
