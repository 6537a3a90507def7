"""Parallel layer: the (dp, ep) device mesh, expert parallelism and FSDP2 for the rest; context
parallelism (one batch split along T)."""

from .cp import ContextParallel
from .ep import (ExpertGroup, apply_fsdp, build_mesh, check_layout, clip_grad_norm, expert_params, is_expert_param,
                 optimizer_groups, reduce_expert_gradients, shard_experts)

__all__ = ["ContextParallel", "ExpertGroup", "apply_fsdp", "build_mesh", "check_layout", "clip_grad_norm",
           "expert_params", "is_expert_param", "optimizer_groups", "reduce_expert_gradients", "shard_experts"]
