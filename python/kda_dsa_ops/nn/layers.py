"""Layers of the hybrid model, built on the ops (native kernels or reference, see backend.py).

Every attention and MoE layer takes packed tokens x [T, hidden] with cu_seqlens int32 [N + 1]
(varlen, B = 1) and returns [T, hidden].
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import reference as R
from .._dtypes import accumulation_dtype
from .backend import Backend


class LoRALinear(nn.Module):
    """y = x W^T (+ b) + (alpha / rank) x A^T B^T with W, b frozen and A [rank, in], B [out, rank]
    trainable (B starts at zero, so a fresh adapter changes nothing). rank 0: a plain trainable
    linear layer. merge() folds the adapter into W (for inference), unmerge() takes it out."""

    def __init__(self, in_features: int, out_features: int, rank: int = 0, alpha: float | None = None,
                 bias: bool = False):
        super().__init__()
        self.base = nn.Linear(in_features, out_features, bias=bias)
        self.rank = rank
        self.merged = False
        if rank > 0:
            self.base.requires_grad_(False)
            self.lora_a = nn.Parameter(torch.randn(rank, in_features) / math.sqrt(in_features))
            self.lora_b = nn.Parameter(torch.zeros(out_features, rank))
            self.scaling = (alpha if alpha is not None else rank) / rank

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        if self.rank > 0 and not self.merged:
            y = y + F.linear(F.linear(x, self.lora_a.to(x.dtype)), self.lora_b.to(x.dtype)) * self.scaling
        return y

    def _delta(self) -> Tensor:
        return (self.lora_b @ self.lora_a) * self.scaling

    @torch.no_grad()
    def merge(self) -> None:
        if self.rank > 0 and not self.merged:
            self.base.weight += self._delta().to(self.base.weight.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.rank > 0 and self.merged:
            self.base.weight -= self._delta().to(self.base.weight.dtype)
            self.merged = False


def positions_in_sequence(cu_seqlens: Tensor, total: int) -> Tensor:
    """For packed tokens: each token's position within its own sequence, [total] int64."""
    starts = cu_seqlens[:-1].long()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq_start = torch.repeat_interleave(starts, lengths, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - seq_start


class ShortConv(nn.Module):
    """Depthwise causal convolution over the packed sequence that never reaches across a
    sequence bound, then SiLU: y[t] = silu(sum_{j < size, j <= pos(t)} w[:, j] x[t - j])."""

    def __init__(self, channels: int, size: int = 4):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(channels, size) / size)

    def forward(self, x: Tensor, pos: Tensor) -> Tensor:
        y = x * self.weight[:, 0].to(x.dtype)
        for j in range(1, self.weight.shape[1]):
            shifted = F.pad(x, (0, 0, j, 0))[: x.shape[0]]
            y = y + shifted * (pos >= j)[:, None].to(x.dtype) * self.weight[:, j].to(x.dtype)
        return F.silu(y)


class KDAAttention(nn.Module):
    """Kimi Delta Attention block: q/k/v projections with a short conv + SiLU, the per-channel
    decay g = -exp(A_log) * softplus(low-rank(x) + dt_bias), beta = sigmoid(b(x)), the KDA op
    (q/k L2-normalised), an RMS norm with a sigmoid output gate, and the output projection."""

    def __init__(self, hidden: int, heads: int, head_dim: int, value_heads: int | None = None, gate_rank: int = 16,
                 conv_size: int = 4, lora_rank: int = 0):
        super().__init__()
        self.H, self.HV, self.D = heads, value_heads or heads, head_dim
        lin = lambda i, o: LoRALinear(i, o, lora_rank)  # noqa: E731
        self.q_proj, self.k_proj = lin(hidden, heads * head_dim), lin(hidden, heads * head_dim)
        self.v_proj = lin(hidden, self.HV * head_dim)
        self.q_conv, self.k_conv = ShortConv(heads * head_dim, conv_size), ShortConv(heads * head_dim, conv_size)
        self.v_conv = ShortConv(self.HV * head_dim, conv_size)
        self.g_down, self.g_up = nn.Linear(hidden, gate_rank, bias=False), nn.Linear(gate_rank, self.HV * head_dim,
                                                                                        bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(self.HV).uniform_(1.0, 16.0)))
        # softplus(dt_bias) log-uniform in [1e-3, 1e-1]: decays of exp(-A dt) that keep a state for
        # tens to thousands of steps at the start (dt_bias = 0 would forget within a step or two).
        dt = torch.exp(torch.empty(self.HV * head_dim).uniform_(math.log(1e-3), math.log(1e-1)))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.b_proj = nn.Linear(hidden, self.HV, bias=False)
        self.o_norm = nn.RMSNorm(head_dim)
        self.o_gate = lin(hidden, self.HV * head_dim)
        self.o_proj = lin(self.HV * head_dim, hidden)

    def forward(self, x: Tensor, cu_seqlens: Tensor, pos: Tensor, backend: Backend) -> Tensor:
        T = x.shape[0]
        q = self.q_conv(self.q_proj(x), pos).view(1, T, self.H, self.D)
        k = self.k_conv(self.k_proj(x), pos).view(1, T, self.H, self.D)
        v = self.v_conv(self.v_proj(x), pos).view(1, T, self.HV, self.D)
        acc = accumulation_dtype(x)  # gates in fp32 (fp64 for fp64 models)
        a = self.g_up(self.g_down(x)).to(acc) + self.dt_bias.to(acc)
        g = (-self.A_log.to(acc).exp().repeat_interleave(self.D) * F.softplus(a)).view(1, T, self.HV, self.D)
        beta = torch.sigmoid(self.b_proj(x).to(acc)).view(1, T, self.HV)
        o = backend.kda(q, k, v, g, beta, cu_seqlens)[0]  # [T, HV, D]
        o = self.o_norm(o) * torch.sigmoid(self.o_gate(x).view(T, self.HV, self.D))
        return self.o_proj(o.reshape(T, self.HV * self.D))


def rotary(x: Tensor, pos: Tensor, base: float = 10000.0) -> Tensor:
    """Rotary position embedding over the last dimension (pairs of halves), x [T, ..., d]."""
    d = x.shape[-1]
    freqs = base ** (-torch.arange(0, d // 2, device=x.device, dtype=torch.float32) / (d // 2))
    angle = pos.float()[:, None] * freqs[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = angle.cos().view(shape).to(x.dtype), angle.sin().view(shape).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class GatedSparseAttention(nn.Module):
    """DSA block: MLA-style low-rank queries over one shared latent kv row per token (latent
    width kv_rank for values and keys, plus rope dims for keys), the lightning indexer on the
    detached input choosing topk keys per query (trained by its KL loss against the attention's
    probabilities), sparse attention over those keys with a sigmoid output gate, and the output
    projection. forward returns (y, indexer_loss)."""

    def __init__(self, hidden: int, heads: int, q_rank: int, kv_rank: int, rope_dim: int, index_heads: int,
                 index_dim: int, topk: int, lora_rank: int = 0):
        super().__init__()
        if not 0 < topk <= R.dsa.MAX_TOPK:
            raise ValueError(f"topk must be in [1, {R.dsa.MAX_TOPK}], got {topk}")
        self.H, self.kv_rank, self.rope_dim, self.topk = heads, kv_rank, rope_dim, topk
        self.Dqk = kv_rank + rope_dim
        lin = lambda i, o: LoRALinear(i, o, lora_rank)  # noqa: E731
        self.q_down, self.q_norm, self.q_up = lin(hidden, q_rank), nn.RMSNorm(q_rank), lin(q_rank, heads * self.Dqk)
        self.kv_down, self.kv_norm = lin(hidden, self.Dqk), nn.RMSNorm(kv_rank)
        self.gate = lin(hidden, heads * kv_rank)
        self.o_proj = lin(heads * kv_rank, hidden)
        self.index_q = nn.Linear(hidden, index_heads * index_dim, bias=False)
        self.index_k = nn.Linear(hidden, index_dim, bias=False)
        self.index_w = nn.Linear(hidden, index_heads, bias=False)
        self.index_heads, self.index_dim = index_heads, index_dim

    def forward(self, x: Tensor, cu_seqlens: Tensor, pos: Tensor, backend: Backend) -> tuple[Tensor, Tensor]:
        T = x.shape[0]
        q = self.q_up(self.q_norm(self.q_down(x))).view(T, self.H, self.Dqk)
        q = torch.cat([q[..., : self.kv_rank], rotary(q[..., self.kv_rank:], pos)], dim=-1)
        kv = self.kv_down(x)
        kv = torch.cat([self.kv_norm(kv[:, : self.kv_rank]), rotary(kv[:, self.kv_rank:], pos)], dim=-1)[:, None]
        xd = x.detach()  # the indexer learns from its own loss only
        iq = self.index_q(xd).view(T, self.index_heads, self.index_dim)
        indices, scores = backend.indexer(iq, self.index_k(xd), self.index_w(xd), cu_seqlens, cu_seqlens, self.topk)
        gate = self.gate(x).view(T, self.H, self.kv_rank)
        o, p = backend.sparse_attn(q, kv, indices[:, None], self.Dqk ** -0.5, self.kv_rank, gate)
        indexer_loss = R.indexer_kl_loss(p[:, 0].detach(), scores, indices)
        return self.o_proj(o.reshape(T, self.H * self.kv_rank)), indexer_loss


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int, lora_rank: int = 0):
        super().__init__()
        self.gate_up = LoRALinear(hidden, 2 * ffn, lora_rank)
        self.down = LoRALinear(ffn, hidden, lora_rank)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class LatentMoE(nn.Module):
    """Routed experts in a latent space: an fp32 router on the full width (sigmoid scores, a
    selection-only bias nudged toward balanced loads after each step, no auxiliary loss),
    down-projection to the latent width, grouped SwiGLU experts (grouped_mm) with a capacity and
    drop policy, the weighted combine, an RMS norm and the up-projection; plus a shared SwiGLU
    expert on the full width."""

    def __init__(self, hidden: int, latent: int, experts: int, topk: int, expert_ffn: int, shared_ffn: int,
                 capacity_factor: float | None = 1.25, policy: str = "drop_probs", lora_rank: int = 0,
                 bias_rate: float = 1e-3):
        super().__init__()
        if not 0 < topk <= experts:
            raise ValueError(f"topk must be in [1, experts = {experts}], got {topk}")
        self.E, self.topk, self.bias_rate = experts, topk, bias_rate
        self.capacity_factor, self.policy = capacity_factor, policy
        self.router = nn.Parameter(torch.randn(hidden, experts) / math.sqrt(hidden))
        self.register_buffer("router_bias", torch.zeros(experts))
        # routed copies per expert in the last forward (not saved: the next forward rewrites it)
        self.register_buffer("expert_load", torch.zeros(experts), persistent=False)
        self.expert_group = None  # set by parallel.shard_experts: experts split over ranks
        self.down = LoRALinear(hidden, latent, lora_rank)
        self.w_gate_up = nn.Parameter(torch.randn(experts, latent, 2 * expert_ffn) / math.sqrt(latent))
        self.w_down = nn.Parameter(torch.randn(experts, expert_ffn, latent) / math.sqrt(expert_ffn))
        self.norm = nn.RMSNorm(latent)
        self.up = LoRALinear(latent, hidden, lora_rank)
        self.shared = SwiGLU(hidden, shared_ffn, lora_rank)
        if lora_rank > 0:  # experts and router stay frozen under LoRA
            self.router.requires_grad_(False)
            self.w_gate_up.requires_grad_(False)
            self.w_down.requires_grad_(False)

    def forward(self, x: Tensor, backend: Backend) -> Tensor:
        T = x.shape[0]
        acc = accumulation_dtype(x)
        # the router stays in fp32 under autocast (meta tensors, for planning, have no autocast)
        no_autocast = (torch.autocast(x.device.type, enabled=False) if x.device.type in ("cuda", "cpu")
                       else contextlib.nullcontext())
        with no_autocast:
            logits = x.to(acc) @ self.router.to(acc)
        weights, ids = backend.route(logits, self.topk, self.router_bias.to(acc))
        z = self.down(x)
        if self.expert_group is None:
            capacity = (None if self.capacity_factor is None
                        else R.expert_capacity(T, self.topk, self.E, self.capacity_factor))
            zs, row_map, offs = backend.permute(z, ids, self.E, weights.detach(), capacity, self.policy)
            y = backend.unpermute(self.experts(zs, offs, backend), row_map, weights, T)
        else:
            y = self.expert_group.dispatch_combine(z, ids, weights, self, backend)
        if not ids.is_meta:  # meta tensors (memory planning) have no values to count
            with torch.no_grad():
                load = torch.bincount(ids.flatten().long(), minlength=self.E).to(self.expert_load)
                self.expert_load.copy_(load if self.expert_group is None else self.expert_group.total_load(load))
        return self.up(self.norm(y.to(x.dtype))) + self.shared(x)

    def experts(self, xs: Tensor, offs: Tensor, backend: Backend) -> Tensor:
        """The SwiGLU experts held here on rows sorted by expert (offs: cumulative rows per expert)."""
        gate, up = backend.grouped_mm(xs, self.w_gate_up.to(xs.dtype), offs).chunk(2, dim=-1)
        return backend.grouped_mm((F.silu(gate) * up).contiguous(), self.w_down.to(xs.dtype), offs)

    @torch.no_grad()
    def update_bias(self) -> None:
        """Auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower the others
    (loads: routed copies per expert in the last forward, over every rank)."""
        self.router_bias += self.bias_rate * torch.sign(self.expert_load.mean() - self.expert_load)
