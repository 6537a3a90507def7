"""Layers of the hybrid model on the ops (native kernels or their references)."""

from .backend import BACKENDS, Backend, get_backend
from .layers import (HyperConnection, KDAAttention, LatentMoE, LightningIndexer, LoRALinear, MLAttention, RMSNorm,
                     Rope, ShortConv, SwiGLU, freeze_all_but_adapters, positions_in_sequence, sequence_bounds)
from .loss import chunked_linear_cross_entropy, indexer_kl_loss

__all__ = ["BACKENDS", "Backend", "HyperConnection", "KDAAttention", "LatentMoE", "LightningIndexer", "LoRALinear",
           "MLAttention", "RMSNorm", "Rope", "ShortConv", "SwiGLU", "chunked_linear_cross_entropy",
           "freeze_all_but_adapters", "get_backend", "indexer_kl_loss", "positions_in_sequence", "sequence_bounds"]
