"""The ops a layer calls, native or reference, behind one interface: switching a model between
the kernels and the pure-PyTorch definitions is one argument (`backend="native"|"reference"`).
A backend is a module of ops under their public names and signatures: kda_dsa_ops (the kernels)
or kda_dsa_ops.reference; the native one sends the DSA calls its kernels do not take
(contracts.indexer_kernel_refuses / attention_kernel_refuses: fp32 on a GPU, more than MAX_TOPK
keys per query, head sizes the CUDA kernels lack) to the reference.
"""

from __future__ import annotations

from types import SimpleNamespace

from .. import ops
from .. import reference as R
from ..contracts import attention_defaults, attention_kernel_refuses, indexer_kernel_refuses

OPS = ("chunk_kda", "segment_transition", "lightning_indexer", "kpool_indexer", "sparse_attention", "moe_route",
       "moe_permute", "moe_unpermute", "grouped_mm", "hc_mix", "cross_entropy_rows_", "short_conv", "swiglu")


class Backend(SimpleNamespace):
    """name and the OPS, each with kda_dsa_ops.<op>'s signature."""


def _lightning_indexer(q, k, w, cu_seqlens_q, cu_seqlens_k, topk):
    refused = q.dim() == 3 and indexer_kernel_refuses(q.device.type, q.dtype, topk, q.shape[1], q.shape[2])
    return (R.lightning_indexer if refused else ops.lightning_indexer)(q, k, w, cu_seqlens_q, cu_seqlens_k, topk)


def _kpool_indexer(q, k, gate, ape, w, cu_seqlens, topk, kpool, tail=True, cu_seqlens_k=None, with_scores=False):
    refused = q.dim() == 3 and indexer_kernel_refuses(q.device.type, q.dtype, max(topk // kpool, 1), q.shape[1],
                                                      q.shape[2])
    return (R.kpool_indexer if refused or q.is_meta else ops.kpool_indexer)(q, k, gate, ape, w, cu_seqlens, topk,
                                                                            kpool, tail, cu_seqlens_k, with_scores)


def _sparse_attention(q, kv, indices, scale=None, dv=None, gate=None, return_p=False, deterministic=False):
    refused = q.dim() == 3 and attention_kernel_refuses(q.device.type, q.dtype, indices.shape[-1], q.shape[-1],
                                                        attention_defaults(q, scale, dv)[1])
    return (R.sparse_attention if refused else ops.sparse_attention)(q, kv, indices, scale, dv, gate, return_p,
                                                                      deterministic)


NATIVE = Backend(name="native", **{op: getattr(ops, op) for op in OPS}
                 | {"lightning_indexer": _lightning_indexer, "kpool_indexer": _kpool_indexer,
                    "sparse_attention": _sparse_attention})
REFERENCE = Backend(name="reference", **{op: getattr(R, op) for op in OPS})

BACKENDS = {"native": NATIVE, "reference": REFERENCE}


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {name!r}")
    return BACKENDS[name]
