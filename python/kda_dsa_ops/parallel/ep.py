"""Expert parallelism: the experts of every LatentMoE split over the ranks of an `ep` group;
token copies travel to the rank of their expert and back by all_to_all_single with uneven
splits (autograd-aware), inside a 2-D mesh (dp, ep) whose ranks each hold their own tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def check_layout(world_size: int, ep: int, experts: int) -> None:
    """Raises ValueError unless world_size = dp x ep and every rank can hold experts / ep experts."""
    if ep < 1 or world_size % ep:
        raise ValueError(f"the world size ({world_size}) must be a multiple of ep ({ep}): the mesh is dp x ep")
    if experts % ep:
        raise ValueError(f"experts ({experts}) must be divisible by ep ({ep}): every rank holds the same number of "
                         "experts (no expert holes)")


def build_mesh(world_size: int, ep: int, experts: int, device_type: str = "cpu") -> DeviceMesh:
    """The (dp, ep) mesh over world_size ranks (check_layout first)."""
    check_layout(world_size, ep, experts)
    return init_device_mesh(device_type, (world_size // ep, ep), mesh_dim_names=("dp", "ep"))


@dataclass
class ExpertGroup:
    """The ep ranks that exchange tokens; this rank holds experts [rank * local, (rank + 1) * local)."""

    group: dist.ProcessGroup
    size: int
    rank: int
    experts: int
    world: dist.ProcessGroup  # every rank: the loads of all tokens

    @property
    def local(self) -> int:
        return self.experts // self.size

    def total_load(self, load: Tensor) -> Tensor:
        dist.all_reduce(load, group=self.world)
        return load

    def dispatch_combine(self, z: Tensor, ids: Tensor, weights: Tensor, moe: nn.Module, backend) -> Tensor:
        """y[t] = sum_j weights[t, j] * expert_{ids[t, j]}(z[t]), the experts spread over the group."""
        T, k = ids.shape
        dest = torch.div(ids.flatten().long(), self.local, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)                 # copies grouped by destination rank
        send_counts = torch.bincount(dest, minlength=self.size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        received = dist_fn.all_to_all_single(z.new_empty(sum(recv), z.shape[1]), z[order // k], recv, send,
                                             group=self.group)
        local_ids = (ids.flatten().long() % self.local)[order].to(torch.int32)
        received_ids = torch.empty(sum(recv), dtype=torch.int32, device=z.device)
        dist.all_to_all_single(received_ids, local_ids, recv, send, group=self.group)
        rows = received.shape[0]
        if rows:
            xs, row_map, offs = backend.permute(received, received_ids[:, None], self.local, None, None, "drop_probs")
            ones = torch.ones(rows, 1, dtype=weights.dtype, device=z.device)
            out = backend.unpermute(moe.experts(xs, offs, backend), row_map, ones, rows)
        else:  # nothing routed here: an empty result that still ties the experts into the graph
            out = received + 0 * (moe.w_gate_up.sum() + moe.w_down.sum()).to(received.dtype)
        back = dist_fn.all_to_all_single(z.new_empty(sum(send), z.shape[1]), out, send, recv, group=self.group)
        return backend.unpermute(back, order.to(torch.int32), weights, T)


def shard_experts(model: nn.Module, mesh: DeviceMesh) -> None:
    """Keep this rank's slice of every LatentMoE's experts and route their tokens over mesh["ep"]."""
    ep_mesh = mesh["ep"]
    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for module in model.modules():
        if hasattr(module, "expert_group") and hasattr(module, "w_gate_up"):
            local = module.E // size
            keep = slice(rank * local, (rank + 1) * local)
            for name in ("w_gate_up", "w_down"):
                old = getattr(module, name)
                setattr(module, name, nn.Parameter(old.detach()[keep].clone(), requires_grad=old.requires_grad))
            module.expert_group = ExpertGroup(ep_mesh.get_group(), size, rank, module.E, dist.group.WORLD)


def is_expert_param(name: str) -> bool:
    return name.endswith("w_gate_up") or name.endswith("w_down")


def expert_params(model: nn.Module) -> set[nn.Parameter]:
    return {p for name, p in model.named_parameters() if is_expert_param(name)}


def apply_fsdp(model: nn.Module) -> None:
    """FSDP2: every parameter but the experts' sharded over all ranks, one unit per block and the
    root; gradients of the sharded parameters are averaged over the ranks by the reduce-scatter."""
    from torch.distributed.fsdp import fully_shard

    device_type = next(model.parameters()).device.type
    flat = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    experts = expert_params(model)
    for block in getattr(model, "blocks", []):
        fully_shard(block, mesh=flat, ignored_params=experts)
    fully_shard(model, mesh=flat, ignored_params=experts)


def reduce_expert_gradients(model: nn.Module, mesh: DeviceMesh) -> None:
    """Each expert's gradient, summed over its replicas (the dp dimension of the mesh) and divided
    by the world size: it saw the tokens of its whole ep group, and the loss is the mean over all
    ranks' tokens (FSDP averages the other gradients the same way)."""
    world = dist.get_world_size()
    for name, p in model.named_parameters():
        if p.grad is not None and is_expert_param(name):
            dist.all_reduce(p.grad, group=mesh["dp"].get_group())
            p.grad /= world
