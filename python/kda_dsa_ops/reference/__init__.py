"""Pure-PyTorch, float64-capable definitions of every op: the ground truth for tests and benchmarks."""

from .dsa import (indexer_kl_loss, indexer_scores, kpool_indexer, lightning_indexer, lightning_indexer_bwd,
                  sparse_attn_bwd, sparse_attn_fwd)
from .kda import kda_recurrent, l2norm
from .moe import (expert_capacity, grouped_mm, grouped_mm_wgrad, moe_permute, moe_route, moe_unpermute,
                  route_scores)

__all__ = [
    "expert_capacity", "grouped_mm", "grouped_mm_wgrad", "indexer_kl_loss", "indexer_scores", "kda_recurrent",
    "kpool_indexer", "l2norm", "lightning_indexer", "lightning_indexer_bwd", "moe_permute", "moe_route", "moe_unpermute",
    "route_scores", "sparse_attn_bwd", "sparse_attn_fwd",
]
