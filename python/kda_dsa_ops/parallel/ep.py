"""Expert parallelism: the experts of every LatentMoE split over the ranks of an `ep` group;
token copies travel to the rank of their expert and back by all_to_all_single with uneven
splits (autograd-aware), inside a 2-D mesh (dp, ep) whose ranks each hold their own tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
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


class _Pending:
    """An all-to-all in flight."""

    work = None


class _AllToAllStart(torch.autograd.Function):
    """Launches an all_to_all_single without waiting (the result must pass _AllToAllWait before it
    is read); its backward sends the gradient back the reverse way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, pending):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        pending.work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group, async_op=True)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None, None


class _AllToAllWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pending):
        pending.work.wait()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@dataclass
class _Route:
    """Where the copies of one micro-batch go: destination-sorted order and the split sizes."""

    order: Tensor
    send: list
    recv: list
    received_ids: Tensor


@dataclass
class ExpertGroup:
    """The ep ranks that exchange tokens; this rank holds experts [rank * local, (rank + 1) * local).
    micro_batches > 1 splits each layer's tokens so that the all-to-all of micro-batch i + 1
    travels while the experts compute micro-batch i (and its combine while i + 1 computes)."""

    group: dist.ProcessGroup
    size: int
    rank: int
    experts: int
    world: dist.ProcessGroup  # every rank: the loads of all tokens
    micro_batches: int = 1

    @property
    def local(self) -> int:
        return self.experts // self.size

    def total_load(self, load: Tensor) -> Tensor:
        dist.all_reduce(load, group=self.world)
        return load

    def _route(self, ids: Tensor) -> _Route:
        dest = torch.div(ids.flatten().long(), self.local, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)                 # copies grouped by destination rank
        send_counts = torch.bincount(dest, minlength=self.size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        local_ids = (ids.flatten().long() % self.local)[order].to(torch.int32)
        received_ids = torch.empty(sum(recv), dtype=torch.int32, device=ids.device)
        dist.all_to_all_single(received_ids, local_ids, recv, send, group=self.group)
        return _Route(order, send, recv, received_ids)

    def _experts(self, received: Tensor, route: _Route, moe: nn.Module, backend, dtype) -> Tensor:
        rows = received.shape[0]
        if not rows:  # nothing routed here: an empty result that still ties the experts into the graph
            return received + 0 * (moe.w_gate_up.sum() + moe.w_down.sum()).to(received.dtype)
        xs, row_map, offs = backend.moe_permute(received, route.received_ids[:, None], self.local)
        ones = torch.ones(rows, 1, dtype=dtype, device=received.device)
        return backend.moe_unpermute(moe.experts(xs, offs, backend), row_map, ones, rows)

    def dispatch_combine(self, z: Tensor, ids: Tensor, weights: Tensor, moe: nn.Module, backend) -> Tensor:
        """y[t] = sum_j weights[t, j] * expert_{ids[t, j]}(z[t]), the experts spread over the group."""
        T, k = ids.shape
        bounds = [T * i // self.micro_batches for i in range(self.micro_batches + 1)]
        parts = list(zip(bounds[:-1], bounds[1:]))
        routes = [self._route(ids[a:b]) for a, b in parts]
        dispatched = []
        for (a, b), r in zip(parts, routes):  # every dispatch in flight at once
            pending = _Pending()
            dispatched.append((_AllToAllStart.apply(z[a:b][r.order // k], r.recv, r.send, self.group, pending),
                               pending))
        combined = []
        for (received, pending), r in zip(dispatched, routes):
            out = self._experts(_AllToAllWait.apply(received, pending), r, moe, backend, weights.dtype)
            back = _Pending()
            combined.append((_AllToAllStart.apply(out, r.send, r.recv, self.group, back), back))
        ys = [backend.moe_unpermute(_AllToAllWait.apply(back, pending), r.order.to(torch.int32), weights[a:b], b - a)
              for (back, pending), r, (a, b) in zip(combined, routes, parts)]
        return torch.cat(ys) if len(ys) > 1 else ys[0]


def shard_experts(model: nn.Module, mesh: DeviceMesh, micro_batches: int = 1) -> None:
    """Keep this rank's slice of every LatentMoE's experts and route their tokens over mesh["ep"]
    (micro_batches: see ExpertGroup)."""
    ep_mesh = mesh["ep"]
    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for module in model.modules():
        if hasattr(module, "expert_group") and hasattr(module, "w_gate_up"):
            local = module.E // size
            keep = slice(rank * local, (rank + 1) * local)
            for name in ("w_gate_up", "w_down"):
                old = getattr(module, name)
                setattr(module, name, nn.Parameter(old.detach()[keep].clone(), requires_grad=old.requires_grad))
            module.expert_group = ExpertGroup(ep_mesh.get_group(), size, rank, module.E, dist.group.WORLD,
                                              micro_batches)


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


def optimizer_groups(model: nn.Module) -> list[dict]:
    """The trainable parameters as optimizer groups: FSDP-sharded ones (DTensor) apart from local
    ones (the experts, ignored by FSDP), since a foreach or fused optimizer step cannot mix the two
    kinds in one call. Empty groups are left out; works on an unsharded model too."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    sharded = [p for p in trainable if type(p).__name__ == "DTensor"]
    local = [p for p in trainable if type(p).__name__ != "DTensor"]
    return [{"params": group} for group in (sharded, local) if group]


def clip_grad_norm(model: nn.Module, max_norm: float, mesh: DeviceMesh | None = None) -> float:
    """The global L2 norm of the trainable parameters' gradients, as if the model were whole, and,
    with max_norm > 0, every gradient scaled by min(1, max_norm / norm). Under FSDP2 + EP (mesh
    given, after reduce_expert_gradients): each sharded gradient's squares are summed over all
    ranks (each holds one shard), each expert gradient's over the ep group (each ep rank holds
    other experts; the dp replicas hold the same reduced values)."""
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    if not grads:
        return 0.0
    device = next(model.parameters()).device

    def square_sum(tensors):  # one foreach pass, not a few kernels per parameter
        if not tensors:
            return torch.zeros((), dtype=torch.float64, device=device)
        return torch.stack(torch._foreach_norm(tensors)).double().square().sum()

    sharded = square_sum([g.to_local() for g in grads if type(g).__name__ == "DTensor"])
    local = square_sum([g for g in grads if type(g).__name__ != "DTensor"])
    if mesh is not None:
        dist.all_reduce(sharded)
        dist.all_reduce(local, group=mesh["ep"].get_group())
    norm = (sharded + local).sqrt().item()
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(scale)
    return norm


def reduce_expert_gradients(model: nn.Module, mesh: DeviceMesh) -> None:
    """Each expert's gradient, summed over its replicas (the dp dimension of the mesh) and divided
    by the world size: it saw the tokens of its whole ep group, and the loss is the mean over all
    ranks' tokens (FSDP averages the other gradients the same way)."""
    world = dist.get_world_size()
    for name, p in model.named_parameters():
        if p.grad is not None and is_expert_param(name):
            dist.all_reduce(p.grad, group=mesh["dp"].get_group())
            p.grad /= world
