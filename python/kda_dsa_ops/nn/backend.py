"""The ops a layer calls, native or reference, behind one interface: switching a model between
the kernels and the pure-PyTorch definitions is one argument (`backend="native"|"reference"`).
A backend is a module of ops under their public names and signatures: kda_dsa_ops (the kernels)
or kda_dsa_ops.reference; the native one sends the DSA calls its kernels do not take
(contracts.dsa_kernels_take: fp32 on a GPU, more than MAX_TOPK keys per query) to the reference.
"""

from __future__ import annotations

from types import SimpleNamespace

from .. import ops
from .. import reference as R
from ..contracts import dsa_kernels_take

OPS = ("chunk_kda", "lightning_indexer", "sparse_attention", "moe_route", "moe_permute", "moe_unpermute",
       "grouped_mm")


class Backend(SimpleNamespace):
    """name and the OPS, each with kda_dsa_ops.<op>'s signature."""


def _lightning_indexer(q, k, w, cu_seqlens_q, cu_seqlens_k, topk):
    fn = ops.lightning_indexer if dsa_kernels_take(q.device.type, q.dtype, topk) else R.lightning_indexer
    return fn(q, k, w, cu_seqlens_q, cu_seqlens_k, topk)


def _sparse_attention(q, kv, indices, scale=None, dv=None, gate=None, return_p=False, deterministic=False):
    taken = dsa_kernels_take(q.device.type, q.dtype, indices.shape[-1])
    return (ops.sparse_attention if taken else R.sparse_attention)(q, kv, indices, scale, dv, gate, return_p,
                                                                  deterministic)


NATIVE = Backend(name="native", **{op: getattr(ops, op) for op in OPS}
                 | {"lightning_indexer": _lightning_indexer, "sparse_attention": _sparse_attention})
REFERENCE = Backend(name="reference", **{op: getattr(R, op) for op in OPS})

BACKENDS = {"native": NATIVE, "reference": REFERENCE}


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {name!r}")
    return BACKENDS[name]
