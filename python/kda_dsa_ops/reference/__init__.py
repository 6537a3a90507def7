"""Pure-PyTorch, float64-capable definitions of every op: the ground truth for tests and benchmarks.

Each public op has the name and signature of kda_dsa_ops.<op> (a model switches between the
kernels and these by switching modules); the backward references and the building blocks
(kda's l2norm, the indexer's scores, the k-pooled indexer, the routing scores) come beside them.
"""

from ..segments import segment_start_states, transition_over
from .act import short_conv, swiglu
from .dsa import (indexer_scores, kpool_indexer, lightning_indexer, lightning_indexer_bwd, sparse_attention,
                  sparse_attn_bwd)
from .hc import hc_mix
from .kda import chunk_kda, kda_gate, l2norm
from .loss import cross_entropy_rows_
from .moe import grouped_mm, grouped_mm_wgrad, moe_permute, moe_route, moe_unpermute, route_scores

segment_transition = transition_over(chunk_kda)

__all__ = [
    "chunk_kda", "cross_entropy_rows_", "grouped_mm", "grouped_mm_wgrad", "hc_mix", "indexer_scores", "kda_gate", "kpool_indexer", "l2norm",
    "lightning_indexer", "lightning_indexer_bwd", "moe_permute", "moe_route", "moe_unpermute", "route_scores",
    "segment_start_states", "segment_transition", "short_conv", "sparse_attention", "sparse_attn_bwd", "swiglu",
]
