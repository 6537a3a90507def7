"""Layers of the hybrid model on the ops (native kernels or their references)."""

from .backend import BACKENDS, Backend, get_backend
from .layers import GatedSparseAttention, KDAAttention, LatentMoE, LoRALinear, ShortConv, SwiGLU, positions_in_sequence
from .loss import chunked_linear_cross_entropy

__all__ = ["BACKENDS", "Backend", "GatedSparseAttention", "KDAAttention", "LatentMoE", "LoRALinear", "ShortConv",
           "SwiGLU", "chunked_linear_cross_entropy", "get_backend", "positions_in_sequence"]
