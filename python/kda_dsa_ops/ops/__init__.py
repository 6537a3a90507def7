"""Typed wrappers over torch.ops.kda_dsa_ops.*, with fake kernels and autograd."""

from .moe import grouped_mm, grouped_mm_wgrad, moe_permute, moe_route, moe_unpermute

__all__ = ["grouped_mm", "grouped_mm_wgrad", "moe_permute", "moe_route", "moe_unpermute"]
