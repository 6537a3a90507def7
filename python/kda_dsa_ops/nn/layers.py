"""Layers of the hybrid model, built on the ops (native kernels or reference, see backend.py).

Every attention and MoE layer takes packed tokens x [T, hidden] with cu_seqlens int32 [N + 1]
(varlen, B = 1) and returns [T, hidden].
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.bias import causal_lower_right

from .._dtypes import accumulation_dtype
from .backend import Backend
from .loss import indexer_kl_loss


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm; where the input's dtype is not the weight's (bf16 activations under
    autocast, fp32 weights) it computes in float32, as autocast does for layer_norm, and returns
    the input's dtype (torch's fused kernel takes one dtype)."""

    def forward(self, x: Tensor) -> Tensor:
        if self.weight is None or x.dtype == self.weight.dtype:
            return super().forward(x)
        return F.rms_norm(x.float(), self.normalized_shape, self.weight.float(), self.eps).to(x.dtype)


def freeze_all_but_adapters(module: nn.Module) -> None:
    """LoRA's rule, in one place: every parameter of module is frozen but the adapters (A, B) of
    its LoRALinear layers."""
    adapters = {id(p) for m in module.modules() if isinstance(m, LoRALinear) and m.rank > 0
                for p in (m.lora_a, m.lora_b)}
    for p in module.parameters():
        p.requires_grad_(id(p) in adapters)


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
            self.lora_a = nn.Parameter(torch.randn(rank, in_features) / math.sqrt(in_features))
            self.lora_b = nn.Parameter(torch.zeros(out_features, rank))
            self.scaling = (alpha if alpha is not None else rank) / rank
            freeze_all_but_adapters(self)

    def forward(self, x: Tensor) -> Tensor:
        if self.rank == 0 or self.merged:
            return self.base(x)
        rows = x.reshape(-1, x.shape[-1])
        # the adapter's product is added by the GEMM itself (addmm: y + scaling * (x A^T) B^T)
        y = torch.addmm(self.base(rows), F.linear(rows, self.lora_a.to(x.dtype)), self.lora_b.to(x.dtype).t(),
                        alpha=self.scaling)
        return y.view(*x.shape[:-1], y.shape[-1])

    def _delta(self) -> Tensor:
        return (self.lora_b @ self.lora_a) * self.scaling

    def effective_weight(self) -> Tensor:
        """W plus the adapter's delta (differentiable w.r.t. the adapter): for layers that use the
        weight itself rather than x W^T (MLA folds kv_up into its queries and outputs)."""
        if self.rank > 0 and not self.merged:
            return self.base.weight + self._delta().to(self.base.weight.dtype)
        return self.base.weight

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
    sequence bound, then SiLU: y[t] = silu(sum_{j < size, j <= pos(t)} w[:, j] x[t - j]) (the
    backend's short_conv: one pass over x, fp32 accumulation)."""

    def __init__(self, channels: int, size: int = 4):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(channels, size) / size)

    def forward(self, x: Tensor, pos: Tensor, backend: Backend, halo: Tensor | None = None) -> Tensor:
        """halo: the size - 1 rows before x (context parallelism's previous share; zeros if None)."""
        return backend.short_conv(x, self.weight, pos, halo)


class KDAAttention(nn.Module):
    """Kimi Delta Attention block: q/k/v projections with a short conv + SiLU, a low-rank
    per-channel decay g = -exp(A_log) * softplus(up(down(x)) + dt_bias) (or, with lower_bound,
    GLM-5.3's g = lower_bound * sigmoid(exp(A_log) * (up(down(x)) + dt_bias))), beta = sigmoid(b(x)),
    the KDA op (q/k L2-normalised), an RMS norm times a low-rank sigmoid output gate, and the
    output projection."""

    def __init__(self, hidden: int, heads: int, head_dim: int, value_heads: int | None = None, gate_rank: int = 16,
                 conv_size: int = 4, lora_rank: int = 0, norm_eps: float = 1e-6, lower_bound: float | None = None):
        super().__init__()
        self.H, self.HV, self.D = heads, value_heads or heads, head_dim
        self.lower_bound = lower_bound
        lin = lambda i, o: LoRALinear(i, o, lora_rank)  # noqa: E731
        self.q_proj, self.k_proj = lin(hidden, heads * head_dim), lin(hidden, heads * head_dim)
        self.v_proj = lin(hidden, self.HV * head_dim)
        self.q_conv, self.k_conv = ShortConv(heads * head_dim, conv_size), ShortConv(heads * head_dim, conv_size)
        self.v_conv = ShortConv(self.HV * head_dim, conv_size)
        self.g_down = nn.Linear(hidden, gate_rank, bias=False)
        self.g_up = nn.Linear(gate_rank, self.HV * head_dim, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(self.HV).uniform_(1.0, 16.0)))
        # softplus(dt_bias) log-uniform in [1e-3, 1e-1]: decays of exp(-A dt) that keep a state for
        # tens to thousands of steps at the start (dt_bias = 0 would forget within a step or two).
        dt = torch.exp(torch.empty(self.HV * head_dim).uniform_(math.log(1e-3), math.log(1e-1)))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.b_proj = nn.Linear(hidden, self.HV, bias=False)
        self.o_norm = RMSNorm(head_dim, eps=norm_eps)
        self.o_gate_down, self.o_gate_up = lin(hidden, gate_rank), lin(gate_rank, self.HV * head_dim)
        self.o_proj = lin(self.HV * head_dim, hidden)

    def forward(self, x: Tensor, cu_seqlens: Tensor, pos: Tensor, backend: Backend, cp=None) -> Tensor:
        """cp: a parallel.ContextParallel when x is one share of a batch split along T."""
        T = x.shape[0]

        def conv(layer, y):
            return layer(y, pos, backend, None if cp is None else cp.halo(y, layer.weight.shape[1] - 1))

        q = conv(self.q_conv, self.q_proj(x)).view(1, T, self.H, self.D)
        k = conv(self.k_conv, self.k_proj(x)).view(1, T, self.H, self.D)
        v = conv(self.v_conv, self.v_proj(x)).view(1, T, self.HV, self.D)
        # the raw gate and beta: the decay and sigmoid(beta) are chunk_kda's (fla 0.6's in-kernel options)
        g = self.g_up(self.g_down(x)).view(1, T, self.HV, self.D)
        beta = self.b_proj(x).view(1, T, self.HV)
        options = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias,
                       lower_bound=self.lower_bound, safe_gate=self.lower_bound is not None,
                       use_beta_sigmoid_in_kernel=True)
        if cp is None:
            o = backend.chunk_kda(q, k, v, g, beta, cu_seqlens=cu_seqlens, **options)[0][0]  # [T, HV, D]
        else:
            o = cp.chunk_kda(backend, q, k, v, g, beta, **options)[0]
        o = self.o_norm(o) * torch.sigmoid(self.o_gate_up(self.o_gate_down(x)).view(T, self.HV, self.D))
        return self.o_proj(o.reshape(T, self.HV * self.D))


@dataclass(frozen=True)
class Rope:
    """Rotary position embedding of the rope dims: "half" rotates pairs (i, i + d/2), "interleave"
    pairs (2i, 2i + 1) (DeepSeek's layout; the rotated dims come out as evens then odds, the same
    dot products), "none" leaves them as they are (NoPE). factor > 1: YaRN (inverse frequencies
    blended between interpolation and extrapolation by the beta_fast/beta_slow correction range
    of original_max positions, cos/sin scaled by mscale, the softmax scale by mscale_all_dim)."""
    STYLES = ("half", "interleave", "none")

    style: str = "half"
    theta: float = 10000.0
    factor: float = 1.0
    original_max: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    @staticmethod
    def _yarn_mscale(factor: float, m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    @property
    def cos_scale(self) -> float:
        if self.factor <= 1:
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return self._yarn_mscale(self.factor, self.mscale) / self._yarn_mscale(self.factor, self.mscale_all_dim)
        return self._yarn_mscale(self.factor, 1.0)

    @property
    def softmax_scale_factor(self) -> float:
        """What YaRN multiplies the attention's softmax scale by."""
        if self.factor <= 1 or not self.mscale_all_dim:
            return 1.0
        return self._yarn_mscale(self.factor, self.mscale_all_dim) ** 2

    def inv_freq(self, d: int, device=None) -> Tensor:
        """[d / 2] fp32 inverse frequencies."""
        exponents = torch.arange(0, d, 2, device=device, dtype=torch.float32) / d
        extrapolation = 1.0 / self.theta ** exponents
        if self.factor <= 1:
            return extrapolation

        def correction_dim(rotations: float) -> float:
            return d * math.log(self.original_max / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.beta_slow)), d - 1)
        ramp = ((torch.arange(d // 2, device=device, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        return extrapolation / self.factor * ramp + extrapolation * (1 - ramp)

    def __call__(self, x: Tensor, pos: Tensor, style: str | None = None) -> Tensor:
        """x [T, ..., d] rotated by each token's position pos [T] (style: this spec's unless given)."""
        style = style or self.style
        d = x.shape[-1]
        if style == "none" or d == 0:
            return x
        if style == "interleave":
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        angle = pos.float()[:, None] * self.inv_freq(d, x.device)[None, :]
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
        cos = (angle.cos() * self.cos_scale).view(shape).to(x.dtype)
        sin = (angle.sin() * self.cos_scale).view(shape).to(x.dtype)
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def sequence_bounds(cu_seqlens: Tensor, total: int) -> list[tuple[int, int]]:
    """(start, end) of each packed sequence (one host read; meta tensors: one sequence)."""
    if cu_seqlens.is_meta:
        return [(0, total)]
    cu = cu_seqlens.tolist()
    return [(a, b) for a, b in zip(cu[:-1], cu[1:]) if b > a]


class LightningIndexer(nn.Module):
    """Chooses each query's topk keys for sparse attention: I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s]).

    style "plain": q, k and w are projections of the block's input. style "deepseek" (DeepSeek-V3.2):
    q from the attention's q latent, k LayerNorm-ed (with bias), the first rope_dim dims of q and k
    rotated (half style), w scaled by heads^-1/2 * dim^-1/2. Its inputs are detached: the indexer
    learns only from its own loss (the KL to the attention's probabilities). kpool > 0 (GLM-5.3,
    deepseek style): it scores pools of kpool keys instead (kpool_indexer, on the indexer kernel;
    no KL loss: scores is None)."""

    STYLES = ("plain", "deepseek")

    def __init__(self, hidden: int, q_in: int, heads: int, dim: int, topk: int, style: str = "plain",
                 rope: Rope | None = None, rope_dim: int = 0, kpool: int = 0, kpool_tail: bool = True):
        super().__init__()
        if style not in self.STYLES:
            raise ValueError(f"indexer style must be one of {self.STYLES}, got {style!r}")
        self.heads, self.dim, self.topk, self.style = heads, dim, topk, style
        self.kpool, self.kpool_tail = kpool, kpool_tail
        self.rope, self.rope_dim = rope, rope_dim if style == "deepseek" else 0
        self.q = nn.Linear(q_in, heads * dim, bias=False)
        self.k = nn.Linear(hidden, dim, bias=False)
        self.k_norm = nn.LayerNorm(dim, eps=1e-6) if style == "deepseek" else None
        self.w = nn.Linear(hidden, heads, bias=False)
        if kpool:
            self.kpool_ape = nn.Parameter(torch.zeros(kpool, dim))
            self.kpool_gate = nn.Parameter(torch.randn(dim, hidden) / math.sqrt(hidden))

    def forward(self, x: Tensor, q_latent: Tensor, cu_seqlens: Tensor, pos: Tensor, backend: Backend, cp=None):
        """(indices [T, topk], scores [T, topk]) for x [T, hidden]; q_latent: the attention's q latent.
        cp (context parallelism): the keys are cp.key_rows, the indices rows of them."""
        T, r = x.shape[0], self.rope_dim
        x = x.detach()
        q_src = q_latent.detach() if self.style == "deepseek" else x
        q, k = self.q(q_src).view(T, self.heads, self.dim), self.k(x)
        w = self.w(x)
        if self.style == "deepseek":
            k = self.k_norm(k)
            q = torch.cat([self.rope(q[..., :r], pos, "half"), q[..., r:]], dim=-1)
            k = torch.cat([self.rope(k[..., :r], pos, "half"), k[..., r:]], dim=-1)
            w = w * (self.heads * self.dim) ** -0.5
        if self.kpool:
            gate = F.linear(x, self.kpool_gate.to(x.dtype))
            if cp is None:
                return backend.kpool_indexer(q, k, gate, self.kpool_ape, w, cu_seqlens, self.topk, self.kpool,
                                             self.kpool_tail), None
            return backend.kpool_indexer(q, cp.key_rows(k), cp.key_rows(gate), self.kpool_ape, w, cu_seqlens,
                                         self.topk, self.kpool, self.kpool_tail, cp.key_cu_seqlens(x.device)), None
        if cp is None:
            return backend.lightning_indexer(q, k, w, cu_seqlens, cu_seqlens, self.topk)
        return backend.lightning_indexer(q, cp.key_rows(k), w, cu_seqlens, cp.key_cu_seqlens(x.device), self.topk)


def attend(q: Tensor, k: Tensor, v: Tensor, **options) -> Tensor:
    """torch's scaled_dot_product_attention of one sequence, q [Tq, H, D], k [Tk, H, D], v [Tk, H, Dv]
    -> [Tq, H, Dv] (options: is_causal, attn_mask, scale). Called on [1, H, T, D]: torch's fused
    kernels take 4-D inputs only (3-D ones fall back to its math path, in fp32 for bf16)."""
    return F.scaled_dot_product_attention(q[None].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2),
                                          **options)[0].transpose(0, 1)


class MLAttention(nn.Module):
    """Multi-head latent attention over packed sequences, dense (causal) or sparse (DSA).

    Queries: q_proj, or q_down -> RMSNorm -> q_up (q_rank > 0); nope + rope dims per head. One
    latent row per token: kv_down gives c (kv_rank wide, RMS-normalised) and a rope key shared by
    the heads; kv_up expands c into each head's nope key and value. Dense layers run torch's
    scaled_dot_product_attention on the expanded heads, one sequence at a time. Sparse layers take
    the indexer's topk keys and run the sparse-attention op on the latent rows themselves: kv_up's
    key half is folded into the queries and its value half applied to the latent output (Dqk =
    kv_rank + rope, dv = kv_rank), where the optional sigmoid gate acts. A sparse layer without an
    indexer of its own (GLM-5.3's "shared" layers: sparse, indexer None) takes the previous
    layer's choice. forward returns (y, indexer_loss, indices or None); dense layers give a zero
    loss."""

    def __init__(self, hidden: int, heads: int, q_rank: int, kv_rank: int, nope_dim: int, rope_dim: int, v_dim: int,
                 rope: Rope, indexer: LightningIndexer | None = None, gate: bool = False, latent_eps: float = 1e-6,
                 lora_rank: int = 0, sparse: bool = False):
        super().__init__()
        self.H, self.kv_rank, self.nope, self.rope_dim, self.v_dim = heads, kv_rank, nope_dim, rope_dim, v_dim
        self.rope, self.indexer, self.sparse = rope, indexer, sparse or indexer is not None
        self.scale = (nope_dim + rope_dim) ** -0.5 * rope.softmax_scale_factor
        lin = lambda i, o: LoRALinear(i, o, lora_rank)  # noqa: E731
        qk = heads * (nope_dim + rope_dim)
        if q_rank > 0:
            self.q_down, self.q_norm, self.q_up = lin(hidden, q_rank), RMSNorm(q_rank, eps=latent_eps), lin(q_rank, qk)
        else:
            self.q_proj = lin(hidden, qk)
        self.kv_down, self.kv_norm = lin(hidden, kv_rank + rope_dim), RMSNorm(kv_rank, eps=latent_eps)
        self.kv_up = lin(kv_rank, heads * (nope_dim + v_dim))
        self.gate = lin(hidden, heads * kv_rank) if gate else None
        if gate and not self.sparse:
            raise ValueError("the output gate acts on the sparse attention's latent output: it needs an indexer")
        self.o_proj = lin(heads * v_dim, hidden)

    def queries(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """([T, H, nope + rope] queries before rope, the q latent the indexer may read)."""
        if hasattr(self, "q_proj"):
            return self.q_proj(x).view(x.shape[0], self.H, -1), x
        latent = self.q_norm(self.q_down(x))
        return self.q_up(latent).view(x.shape[0], self.H, -1), latent

    def forward(self, x: Tensor, cu_seqlens: Tensor, pos: Tensor, backend: Backend,
                shared_indices: Tensor | None = None, cp=None) -> tuple[Tensor, Tensor, Tensor | None]:
        """cp (context parallelism): the keys are the latent rows of cp.key_rows, the queries this
        share's (bottom-right causal); indices are rows of the key span."""
        T, H = x.shape[0], self.H
        q, q_latent = self.queries(x)
        q_nope, q_rot = q[..., : self.nope], self.rope(q[..., self.nope:], pos)
        kv = self.kv_down(x)
        c, k_rot = self.kv_norm(kv[:, : self.kv_rank]), self.rope(kv[:, self.kv_rank:], pos)
        w_up = self.kv_up.effective_weight().to(x.dtype).view(H, self.nope + self.v_dim, self.kv_rank)
        w_k, w_v = w_up[:, : self.nope], w_up[:, self.nope:]
        loss = x.new_zeros((), dtype=accumulation_dtype(x))
        rows = torch.cat([c, k_rot], dim=-1)  # one latent key row per token
        key_rows, key_cu = (rows, cu_seqlens) if cp is None else (cp.key_rows(rows), cp.key_cu_seqlens(x.device))
        if not self.sparse:
            c_k, rot_k = key_rows[:, : self.kv_rank], key_rows[:, self.kv_rank:]
            Tk = key_rows.shape[0]
            k = torch.cat([torch.einsum("tc,hnc->thn", c_k, w_k), rot_k[:, None].expand(Tk, H, self.rope_dim)], dim=-1)
            v = torch.einsum("tc,hvc->thv", c_k, w_v)
            q = torch.cat([q_nope, q_rot], dim=-1)
            o = x.new_empty(T, H, self.v_dim)
            for (a, b), (ka, kb) in zip(sequence_bounds(cu_seqlens, T), sequence_bounds(key_cu, Tk)):
                # causal; with more keys than queries (a share's part of a sequence) bottom-right aligned
                causal = {"is_causal": True} if kb - ka == b - a else {"attn_mask": causal_lower_right(b - a, kb - ka)}
                o[a:b] = attend(q[a:b], k[ka:kb], v[ka:kb], scale=self.scale, **causal)
            indices = None
        else:
            if self.indexer is not None:
                indices, scores = self.indexer(x, q_latent, cu_seqlens, pos, backend, cp)
            elif shared_indices is None:
                raise ValueError("a shared-indexer layer needs the indices of an earlier sparse layer")
            else:
                indices, scores = shared_indices, None
            q_abs = torch.cat([torch.einsum("thn,hnc->thc", q_nope, w_k), q_rot], dim=-1)
            gate = self.gate(x).view(T, H, self.kv_rank) if self.gate is not None else None
            # the probabilities feed the indexer's KL loss only: layers without one (a shared indexer,
            # GLM-5.3's pooled one) ask for none
            o_latent, _, p = backend.sparse_attention(q_abs, key_rows[:, None], indices[:, None], self.scale,
                                                      self.kv_rank, gate, return_p=scores is not None)
            o = torch.einsum("thc,hvc->thv", o_latent, w_v)
            if scores is not None:
                loss = indexer_kl_loss(p[:, 0].detach(), scores, indices)
        return self.o_proj(o.reshape(T, H * self.v_dim)), loss, indices


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int, lora_rank: int = 0, limit: float = 0.0):
        super().__init__()
        self.limit = limit
        self.gate_up = LoRALinear(hidden, 2 * ffn, lora_rank)
        self.down = LoRALinear(ffn, hidden, lora_rank)

    def forward(self, x: Tensor, backend: Backend) -> Tensor:
        """silu(gate) * up of gate_up(x) = [gate, up] (limit > 0: GLM-5.3's clamps), the backend's swiglu."""
        return self.down(backend.swiglu(self.gate_up(x), self.limit))


def _mm_acc(a: Tensor, b: Tensor) -> Tensor:
    """a @ b in the accumulation dtype: on CUDA from a's dtype (bf16 / fp16 tensor-core operands,
    fp32 accumulation and result), elsewhere on operands converted to it."""
    acc = accumulation_dtype(a)
    if a.is_cuda and a.dtype != acc:
        return torch.mm(a, b.to(a.dtype), out_dtype=acc)
    return torch.mm(a.to(acc), b.to(acc))


class _NormalisedProjection(torch.autograd.Function):
    """mHC's projection of the RMS-normalised flattened streams, (x fn^T) * rsqrt(mean(x^2) + eps)
    per token, in the accumulation dtype from x [T, n * D] in its own dtype. The RMS norm is one
    factor per token, so it scales the [T, (2 + n) n] projection instead of the streams, and the
    backward gives dx in x's dtype from one GEMM plus one pass over x (no fp32 copy of the streams):
    dx = (g r) fn + x c with c = -r^3 / (n D) sum(g * (x fn^T))."""

    @staticmethod
    def forward(ctx, x: Tensor, fn: Tensor, eps: float) -> Tensor:
        acc = accumulation_dtype(x)
        r = torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=acc).square() / x.shape[-1] + eps)
        p = _mm_acc(x, fn.t())
        ctx.save_for_backward(x, fn, p, r)
        return p * r

    @staticmethod
    def backward(ctx, g: Tensor):
        x, fn, p, r = ctx.saved_tensors
        dp = g * r
        dx = dfn = None
        if ctx.needs_input_grad[0]:
            c = (g * p).sum(-1, keepdim=True) * r.pow(3) / -x.shape[-1]
            dx = torch.mm(dp.to(x.dtype), fn.to(x.dtype)).addcmul_(x, c.to(x.dtype))
        if ctx.needs_input_grad[1]:
            dfn = _mm_acc(dp.t().to(x.dtype), x).to(fn.dtype)
        return dx, dfn, None


class HyperConnection(nn.Module):
    """Manifold-constrained hyper-connections (mHC, GLM-5.3): the residual is n streams [T, n, D].
    From the RMS-normalised flattened streams one linear map gives, per token, pre [n] (sigmoid +
    eps: the weights that collapse the streams into the block's input), post [n] (2 sigmoid: how
    the block's output enters each stream) and comb [n, n] (softmax rows + eps, then Sinkhorn
    normalisation towards doubly stochastic: how the streams mix). The next streams are
    post * block(collapsed) + comb^T streams (see mix). The collapse and the mix are the backend's
    hc_mix (one pass over the streams each, fp32 accumulation)."""

    def __init__(self, hidden: int, n: int, eps: float = 1e-6, sinkhorn_iters: int = 20, norm_eps: float = 1e-6):
        super().__init__()
        self.n, self.eps, self.iters, self.norm_eps = n, eps, sinkhorn_iters, norm_eps
        self.fn = nn.Parameter(torch.randn((2 + n) * n, n * hidden) / math.sqrt(n * hidden))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: Tensor, backend: Backend) -> tuple[Tensor, Tensor, Tensor]:
        """streams [T, n, D] -> (post [T, n], comb [T, n, n], collapsed block input [T, D])."""
        n, acc = self.n, accumulation_dtype(streams)
        mixed = _NormalisedProjection.apply(streams.reshape(streams.shape[0], -1), self.fn, self.norm_eps)
        pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.to(acc).split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.to(acc).unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax((comb_w * comb_s + comb_b).view(-1, n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(-2, keepdim=True) + self.eps)
        collapsed = backend.hc_mix(streams, pre[:, None])[:, 0]
        return post, comb, collapsed

    @staticmethod
    def mix(post: Tensor, comb: Tensor, out: Tensor, streams: Tensor, backend: Backend) -> Tensor:
        """The next streams: post[t, i] * out[t] + sum_j comb[t, j, i] * streams[t, j]."""
        return backend.hc_mix(streams, comb.transpose(-1, -2), out, post)


class LatentMoE(nn.Module):
    """Routed experts, optionally in a latent space: an fp32 router on the full width (sigmoid
    scores, a selection-only bias nudged toward balanced loads after each step, no auxiliary loss;
    optionally group-limited, n_group / topk_group; weights renormalised and times routed_scale),
    with latent > 0 a down-projection to the latent width, grouped SwiGLU experts (grouped_mm) with
    an optional capacity and drop policy, the weighted combine, and with latent > 0 an RMS norm and
    the up-projection; plus a shared SwiGLU expert on the full width (shared_ffn > 0)."""

    def __init__(self, hidden: int, latent: int, experts: int, topk: int, expert_ffn: int, shared_ffn: int,
                 capacity_factor: float | None = None, policy: str = "drop_probs", lora_rank: int = 0,
                 bias_rate: float = 1e-3, routed_scale: float = 1.0, n_group: int = 1, topk_group: int = 1,
                 renorm: bool = True, norm_eps: float = 1e-6, swiglu_limit: float = 0.0):
        super().__init__()
        if not 0 < topk <= experts:
            raise ValueError(f"topk must be in [1, experts = {experts}], got {topk}")
        self.E, self.topk, self.bias_rate = experts, topk, bias_rate
        self.capacity_factor, self.policy = capacity_factor, policy
        self.routed_scale, self.n_group, self.topk_group, self.renorm = routed_scale, n_group, topk_group, renorm
        self.swiglu_limit = swiglu_limit
        self.router = nn.Parameter(torch.randn(hidden, experts) / math.sqrt(hidden))
        self.register_buffer("router_bias", torch.zeros(experts))
        # routed copies per expert in the last forward (not saved: the next forward rewrites it)
        self.register_buffer("expert_load", torch.zeros(experts), persistent=False)
        self.expert_group = None  # set by parallel.shard_experts: experts split over ranks
        width = latent or hidden
        if latent:
            self.down = LoRALinear(hidden, latent, lora_rank)
            self.norm = RMSNorm(latent, eps=norm_eps)
            self.up = LoRALinear(latent, hidden, lora_rank)
        self.w_gate_up = nn.Parameter(torch.randn(experts, width, 2 * expert_ffn) / math.sqrt(width))
        self.w_down = nn.Parameter(torch.randn(experts, expert_ffn, width) / math.sqrt(expert_ffn))
        self.shared = SwiGLU(hidden, shared_ffn, lora_rank, swiglu_limit) if shared_ffn else None
        if lora_rank > 0:  # experts and router stay frozen under LoRA
            freeze_all_but_adapters(self)

    def forward(self, x: Tensor, backend: Backend) -> Tensor:
        T = x.shape[0]
        acc = accumulation_dtype(x)
        # the router stays in fp32 under autocast (meta tensors, for planning, have no autocast)
        no_autocast = (torch.autocast(x.device.type, enabled=False) if x.device.type in ("cuda", "cpu")
                       else contextlib.nullcontext())
        with no_autocast:
            logits = x.to(acc) @ self.router.to(acc)
        weights, ids = backend.moe_route(logits, self.topk, self.router_bias.to(acc), "sigmoid", self.renorm,
                                         self.routed_scale, self.n_group, self.topk_group)
        z = self.down(x) if hasattr(self, "down") else x
        if self.expert_group is None:
            zs, row_map, offs = backend.moe_permute(z, ids, self.E, weights.detach(),
                                                    capacity_factor=self.capacity_factor, policy=self.policy)
            y = backend.moe_unpermute(self.experts(zs, offs, backend), row_map, weights, T)
        else:
            y = self.expert_group.dispatch_combine(z, ids, weights, self, backend)
        if not ids.is_meta:  # meta tensors (memory planning) have no values to count
            with torch.no_grad():
                load = torch.bincount(ids.flatten().long(), minlength=self.E).to(self.expert_load)
                self.expert_load.copy_(load if self.expert_group is None else self.expert_group.total_load(load))
        y = self.up(self.norm(y.to(x.dtype))) if hasattr(self, "up") else y.to(x.dtype)
        return y + self.shared(x, backend) if self.shared is not None else y

    def experts(self, xs: Tensor, offs: Tensor, backend: Backend) -> Tensor:
        """The SwiGLU experts held here on rows sorted by expert (offs: cumulative rows per expert)."""
        h = backend.swiglu(backend.grouped_mm(xs, self.w_gate_up.to(xs.dtype), offs), self.swiglu_limit)
        return backend.grouped_mm(h, self.w_down.to(xs.dtype), offs)

    @torch.no_grad()
    def update_bias(self) -> None:
        """Auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower the others
    (loads: routed copies per expert in the last forward, over every rank)."""
        self.router_bias += self.bias_rate * torch.sign(self.expert_load.mean() - self.expert_load)
