"""Typed wrappers over torch.ops.kda_dsa_ops.*, with fake kernels and autograd."""

from ..segments import segment_start_states, transition_over
from .act import short_conv, swiglu
from .dsa import kpool_indexer, lightning_indexer, sparse_attention
from .hc import hc_mix
from .kda import chunk_kda
from .loss import cross_entropy_rows_
from .moe import grouped_mm, grouped_mm_wgrad, moe_permute, moe_route, moe_unpermute

segment_transition = transition_over(chunk_kda)

__all__ = ["chunk_kda", "cross_entropy_rows_", "grouped_mm", "grouped_mm_wgrad", "hc_mix", "kpool_indexer",
           "lightning_indexer", "moe_permute", "moe_route", "moe_unpermute", "segment_start_states",
           "segment_transition", "short_conv", "sparse_attention", "swiglu"]
