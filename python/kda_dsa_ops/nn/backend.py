"""The ops a layer calls, native or reference, behind one interface: switching a model between
the kernels and the pure-PyTorch definitions is one argument (`backend="native"|"reference"`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .. import ops
from .. import reference as R


@dataclass(frozen=True)
class Backend:
    name: str
    # o [B,T,HV,V] = kda(q, k, v, g, beta, cu_seqlens); q/k L2-normalised inside.
    kda: Callable
    # (indices [T,topk], scores [T,topk]) = indexer(q, k, w, cu_seqlens_q, cu_seqlens_k, topk)
    indexer: Callable
    # (o [T,H,dv], p [T,Hkv,topk]) = sparse_attn(q, kv, indices, scale, dv, gate)
    sparse_attn: Callable
    # (weights [T,k], ids [T,k]) = route(logits, k, bias, renorm, scale, n_group, topk_group), sigmoid scores
    route: Callable
    # (x_sorted, row_map, offs) = permute(x, ids, num_experts, weights, capacity, policy)
    permute: Callable
    grouped_mm: Callable
    unpermute: Callable


def _native_kda(q, k, v, g, beta, cu_seqlens):
    return ops.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)[0]


def _reference_kda(q, k, v, g, beta, cu_seqlens):
    return R.kda_recurrent(q, k, v, g, beta, use_qk_l2norm=True, cu_seqlens=cu_seqlens)[0]


def _reference_sparse_attn(q, kv, indices, scale, dv, gate):
    o, _, p = R.sparse_attn_fwd(q, kv, indices, scale, dv, gate, return_p=True)
    return o, p


# The DSA CUDA kernels take bf16/fp16 operands: a model run in fp32 on a GPU takes their
# reference definitions (same interface, same results) for those two ops.
def _dsa_native(q):
    return not q.is_cuda or q.dtype in (torch.bfloat16, torch.float16)


def _native_indexer(q, k, w, cu_seqlens_q, cu_seqlens_k, topk):
    fn = ops.lightning_indexer if _dsa_native(q) else R.lightning_indexer
    return fn(q, k, w, cu_seqlens_q, cu_seqlens_k, topk)


def _native_sparse_attn(q, kv, indices, scale, dv, gate):
    if not _dsa_native(q) or indices.shape[-1] > R.dsa.MAX_TOPK:  # wider choices (GLM's pools + tail): reference
        return _reference_sparse_attn(q, kv, indices, scale, dv, gate)
    o, _, p = ops.sparse_attention(q, kv, indices, scale, dv, gate, return_p=True)
    return o, p


NATIVE = Backend(
    name="native", kda=_native_kda, indexer=_native_indexer, sparse_attn=_native_sparse_attn,
    route=lambda logits, k, bias, renorm, scale, n_group, topk_group: ops.moe_route(
        logits, k, bias, "sigmoid", renorm, scale, n_group, topk_group),
    permute=lambda x, ids, E, w, cap, policy: ops.moe_permute(x, ids, E, w, cap, policy=policy),
    grouped_mm=ops.grouped_mm, unpermute=ops.moe_unpermute)

REFERENCE = Backend(
    name="reference", kda=_reference_kda, indexer=R.lightning_indexer, sparse_attn=_reference_sparse_attn,
    route=lambda logits, k, bias, renorm, scale, n_group, topk_group: R.moe_route(
        logits, bias, k, "sigmoid", renorm, scale, n_group, topk_group),
    permute=lambda x, ids, E, w, cap, policy: R.moe_permute(x, ids, E, w, cap, policy),
    grouped_mm=R.grouped_mm, unpermute=R.moe_unpermute)

BACKENDS = {"native": NATIVE, "reference": REFERENCE}


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {name!r}")
    return BACKENDS[name]
