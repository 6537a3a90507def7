"""Parallel layer: the (dp, ep) device mesh and expert parallelism."""

from .ep import ExpertGroup, average_gradients, build_mesh, is_expert_param, shard_experts

__all__ = ["ExpertGroup", "average_gradients", "build_mesh", "is_expert_param", "shard_experts"]
