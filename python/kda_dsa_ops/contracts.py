"""What the ops and their pure-PyTorch definitions (kda_dsa_ops.reference) share: the limits and
argument defaults of the op contracts, and which calls the kernels take (*_kernel_refuses: read by
the model's native backend and by onboard's report)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

MAX_TOPK = 2048  # the indexer's topk
MAX_KEYS = 4096  # keys per (query, kv head) of sparse attention (a pooled selection and its tail)


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


def _dsa_kernel_refuses(device_type: str, dtype: torch.dtype, keys_per_query: int, limit: int) -> str | None:
    if keys_per_query > limit:
        return f"{keys_per_query} keys per query exceed the kernels' {limit}"
    if device_type == "cuda" and dtype not in (torch.bfloat16, torch.float16):
        return f"the CUDA kernels take bf16 / fp16, the model is {str(dtype).removeprefix('torch.')}"
    return None


def indexer_kernel_refuses(device_type: str, dtype: torch.dtype, topk: int, heads: int, dim: int) -> str | None:
    """Why the lightning-indexer kernels cannot take a call, or None. CPU: any float dtype and
    shape; CUDA: bf16 / fp16 (tensor-core operands), up to 64 heads of a dim that is a multiple of 8
    up to 128; both at most MAX_TOPK keys per query. The model's native backend sends a refused call
    to the reference; onboard's report prints the reason."""
    why = _dsa_kernel_refuses(device_type, dtype, topk, MAX_TOPK)
    if why is None and device_type == "cuda" and (heads > 64 or dim % 8 or not 8 <= dim <= 128):
        why = f"the CUDA indexer takes up to 64 heads of a multiple of 8 up to 128, got {heads} x {dim}"
    return why


def attention_kernel_refuses(device_type: str, dtype: torch.dtype, keys_per_query: int, dqk: int,
                             dv: int) -> str | None:
    """Why the sparse-attention kernels cannot take a call, or None. CPU: any float dtype and shape;
    CUDA: bf16 / fp16, Dqk a multiple of 8 up to 128 (GQA) or up to 576 with dv <= 512 (MLA); both at
    most MAX_KEYS keys per query."""
    why = _dsa_kernel_refuses(device_type, dtype, keys_per_query, MAX_KEYS)
    if why is None and device_type == "cuda" and (dqk % 8 or not (dqk <= 128 or (dqk <= 576 and dv <= 512))):
        why = f"the CUDA sparse attention takes Dqk <= 128, or <= 576 with dv <= 512 (multiples of 8), got {dqk} / {dv}"
    return why
