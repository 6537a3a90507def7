"""What the ops and their pure-PyTorch definitions (kda_dsa_ops.reference) share: the limits and
argument defaults of the op contracts, and which calls the kernels take (read by the model's
native backend and by onboard's report)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

MAX_TOPK = 2048  # keys per query of the indexer and sparse attention


def expert_capacity(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """Rows each expert may take: ceil(capacity_factor * num_tokens * topk / num_experts)."""
    if not 0 < capacity_factor < math.inf:
        raise ValueError(f"capacity_factor must be a finite number > 0, got {capacity_factor}")
    return int(math.ceil(capacity_factor * num_tokens * topk / num_experts))


def permute_capacity(ids: Tensor, num_experts: int, capacity: int | None, capacity_factor: float | None) -> int | None:
    """moe_permute's rows per expert: capacity, or from capacity_factor (not both); None keeps all."""
    if capacity is not None and capacity_factor is not None:
        raise ValueError("pass capacity or capacity_factor, not both")
    if capacity_factor is None:
        return capacity
    if ids.dim() != 2 or num_experts < 1:
        return 0  # the op rejects such ids / num_experts in its own words
    return expert_capacity(ids.shape[0], ids.shape[1], num_experts, capacity_factor)


def attention_defaults(q: Tensor, scale: float | None, dv: int | None) -> tuple[float, int]:
    """sparse_attention's scale (Dqk ** -0.5) and value width (512 for MLA's Dqk = 576, else Dqk)."""
    Dqk = q.shape[-1]
    if scale is None:  # Dqk = 0 is left to the op's own check
        scale = Dqk ** -0.5 if Dqk > 0 else 1.0
    return float(scale), (512 if Dqk == 576 else Dqk) if dv is None else dv


def dsa_kernels_take(device_type: str, dtype: torch.dtype, keys_per_query: int) -> bool:
    """Whether the indexer / sparse-attention kernels take a call: the CPU kernels any float dtype,
    the CUDA ones bf16 / fp16 (their tensor-core operands); at most MAX_TOPK keys per query."""
    return (device_type != "cuda" or dtype in (torch.bfloat16, torch.float16)) and keys_per_query <= MAX_TOPK
