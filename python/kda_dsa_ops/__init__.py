"""kda_dsa_ops: CUDA kernels for hybrid KDA / gated-DSA sparse-attention MoE models.

The ops live in torch.ops.kda_dsa_ops; the functions here are their typed wrappers.
"""

import torch  # noqa: F401  (the native library needs torch loaded first)

from . import _C
from .ops import (chunk_kda, cross_entropy_rows_, grouped_mm, grouped_mm_wgrad, hc_mix, kpool_indexer,
                  lightning_indexer, moe_permute, moe_route, moe_unpermute, segment_start_states, segment_transition,
                  short_conv, sparse_attention, swiglu)

from .onboard import from_pretrained  # noqa: E402  (after the ops: the model is built on them)

__version__ = _C.build_info()["version"]


def build_info() -> dict:
    """What this build holds: {"version", "backends": ["cpu", "cuda"?], "cuda_archs": [...]}."""
    info = _C.build_info()
    return {
        "version": info["version"],
        "backends": info["backends"].split(","),
        "cuda_archs": [a for a in info["cuda_archs"].replace(";", " ").split() if a],
    }


def cuda_available() -> bool:
    """True when the CUDA kernels were built and a CUDA device is present."""
    return "cuda" in build_info()["backends"] and torch.cuda.is_available()


def value_checks_enabled() -> bool:
    """Whether value checks (index ranges, monotone offsets) run on CUDA tensors.

    They always run on CPU tensors. On CUDA they cost a host synchronisation, so they are off
    unless KDA_DSA_OPS_CHECK_VALUES=1 is set or set_value_checks(True) is called; when off, the
    CUDA kernels still never read or write out of bounds on bad values.
    """
    return _C.switch("value_checks")


def set_value_checks(enabled: bool) -> None:
    """Turn value checks on CUDA tensors on or off (see value_checks_enabled)."""
    _C.set_switch("value_checks", bool(enabled))


def portable_sfa_enabled() -> bool:
    """Whether sparse_attention's MLA layouts (Dqk 576 or 512, dv 512, one kv head) take the portable
    mma.sync kernels on Hopper too, instead of the wgmma forward and backward; other GPUs always
    take them.

    Off unless KDA_DSA_OPS_PORTABLE_SFA=1 is set or set_portable_sfa(True) is called."""
    return _C.switch("portable_sfa")


def set_portable_sfa(enabled: bool) -> None:
    """Turn the portable sparse-attention kernel on Hopper on or off (see portable_sfa_enabled)."""
    _C.set_switch("portable_sfa", bool(enabled))


__all__ = [
    "build_info", "chunk_kda", "cross_entropy_rows_", "cuda_available", "from_pretrained", "grouped_mm",
    "grouped_mm_wgrad", "hc_mix", "kpool_indexer", "lightning_indexer", "moe_permute", "moe_route", "moe_unpermute", "portable_sfa_enabled",
    "segment_start_states", "segment_transition", "set_portable_sfa", "set_value_checks", "short_conv", "sparse_attention",
    "swiglu",
    "value_checks_enabled",
]
