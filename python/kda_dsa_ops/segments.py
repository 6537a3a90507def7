"""KDA over a sequence split along T into segments (the kernel side of context parallelism).

The recurrence is affine in the state: a segment that starts from S_start ends in

    S_end = M S_start + S_end(0)        (per sequence and value head; M [K, K], S [K, V])

where S_end(0) is its final state from a zero start and M its transition, the product over its
steps of (I - beta_t k_t k_t^T) diag(exp(g_t)) (k_t normalised when use_qk_l2norm_in_kernel). M
is what chunk_kda computes for v = 0 from the identity: one more pass of the same kernels, so its
gradient is theirs. A rank holding one segment computes its (M, S_end(0)) without any other rank,
the ranks exchange them (K (K + V) numbers per sequence and value head), segment_start_states
composes each segment's start state from its predecessors', and each rank runs chunk_kda from
its own start state: outputs, final state and every gradient are those of the unsplit sequence.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def transition_over(chunk_kda: Callable) -> Callable:
    """segment_transition computed by chunk_kda (kda_dsa_ops.chunk_kda: kda_dsa_ops.segment_transition;
    the reference's: kda_dsa_ops.reference.segment_transition)."""

    def segment_transition(k: Tensor, g: Tensor, beta: Tensor, use_qk_l2norm_in_kernel: bool = False,
                           matmul_precision: str | None = None, **options) -> Tensor:
        """The segment's transition M [B, HV, K, K] (float32; float64 for float64 inputs): its end
        state is M @ S_start + (its end state from a zero start). k [B, T, H, K], g [B, T, HV, K]
        and beta [B, T, HV] as chunk_kda takes them, with chunk_kda's gate and beta options (fla
        0.6's use_gate_in_kernel, A_log, ...). Differentiable w.r.t. k, g, beta and the gate's
        parameters."""
        B, T, H, K = k.shape
        HV = g.shape[2]
        acc = torch.float64 if k.dtype == torch.float64 else torch.float32
        eye = torch.eye(K, dtype=acc, device=k.device).expand(B, HV, K, K).contiguous()
        _, M = chunk_kda(torch.zeros_like(k), k, k.new_zeros(B, T, HV, K), g, beta, initial_state=eye,
                         output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                         matmul_precision=matmul_precision, **options)
        return M

    return segment_transition


def segment_start_states(transitions: list[Tensor], zero_start_finals: list[Tensor],
                         initial_state: Tensor | None = None) -> list[Tensor]:
    """Each segment's start state, in order: the first starts from initial_state (zeros if None),
    segment r + 1 from M_r @ start_r + zero_start_finals[r]. transitions [B, HV, K, K] and
    zero_start_finals [B, HV, K, V] of each segment, as segment_transition and chunk_kda's final
    state from a zero start give them. Differentiable (the gradient of a later segment's start
    reaches every earlier segment's transition and final state)."""
    if len(transitions) != len(zero_start_finals):
        raise ValueError(f"segment_start_states: {len(transitions)} transitions for {len(zero_start_finals)} "
                         "final states")
    if not transitions:
        return []
    start = torch.zeros_like(zero_start_finals[0]) if initial_state is None else initial_state
    starts = [start]
    for M, final in zip(transitions[:-1], zero_start_finals[:-1]):
        start = M @ start + final
        starts.append(start)
    return starts
