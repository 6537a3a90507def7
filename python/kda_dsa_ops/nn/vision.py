"""Image front ends: images become tokens of the same packed batch as text, taking the places
of image placeholder tokens. PatchEmbed (the presets'): each image cut into patch x patch
squares, embedded (a strided convolution) and projected (Linear-GELU-Linear) to the model width.
VisionTower (GLM-5.3-Flash's): a vision transformer over the patches an image processor made."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..reference import swiglu
from .layers import RMSNorm, attend, sequence_bounds


class PatchEmbed(nn.Module):
    def __init__(self, image_size: int, patch: int, channels: int, hidden: int):
        super().__init__()
        if image_size % patch:
            raise ValueError(f"image_size ({image_size}) must be a multiple of patch ({patch})")
        self.image_size, self.patch, self.channels = image_size, patch, channels
        self.patches = (image_size // patch) ** 2
        self.embed = nn.Conv2d(channels, hidden, kernel_size=patch, stride=patch)
        self.proj = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, hidden))

    def forward(self, images: Tensor) -> Tensor:
        """images [n, channels, image_size, image_size] -> [n * patches, hidden], row-major patches."""
        expected = (self.channels, self.image_size, self.image_size)
        if images.dim() != 4 or tuple(images.shape[1:]) != expected:
            raise ValueError(f"images must be [n, {expected[0]}, {expected[1]}, {expected[2]}], got "
                             f"{tuple(images.shape)}")
        x = self.embed(images.to(self.embed.weight.dtype)).flatten(2).transpose(1, 2)  # [n, patches, hidden]
        return self.proj(F.layer_norm(x, x.shape[-1:])).reshape(-1, x.shape[-1])


@dataclass(frozen=True)
class VisionConfig:
    """GLM-5.3-Flash's vision tower (its vision_config)."""
    depth: int
    hidden: int
    heads: int
    ffn: int
    out_hidden: int  # the width after the spatial merge (then projected to the language model's)
    merger_ffn: int
    patch: int = 14
    temporal_patch: int = 2
    merge: int = 2
    channels: int = 3
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    swiglu_limit: float = 10.0
    bias: bool = True


class VisionBlock(nn.Module):
    """Pre-norm attention (RMS-normalised q and k, 2-D axial rope, no mask within an image frame)
    and a SwiGLU with biases and clamps."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.heads, self.head_dim, self.limit = c.heads, c.hidden // c.heads, c.swiglu_limit
        self.norm1, self.norm2 = RMSNorm(c.hidden, eps=c.norm_eps), RMSNorm(c.hidden, eps=c.norm_eps)
        self.qkv = nn.Linear(c.hidden, 3 * c.hidden, bias=c.bias)
        self.q_norm = RMSNorm(self.head_dim, eps=c.norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=c.norm_eps)
        self.proj = nn.Linear(c.hidden, c.hidden, bias=c.bias)
        self.gate_up = nn.Linear(c.hidden, 2 * c.ffn, bias=c.bias)
        self.down = nn.Linear(c.ffn, c.hidden, bias=c.bias)

    @staticmethod
    def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def forward(self, x: Tensor, frames: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        N = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(N, 3, self.heads, self.head_dim).unbind(1)
        q, k = self.rotate(self.q_norm(q), cos, sin), self.rotate(self.k_norm(k), cos, sin)
        o = torch.empty_like(q)
        for a, b in sequence_bounds(frames, N):
            o[a:b] = attend(q[a:b], k[a:b], v[a:b])
        x = x + self.proj(o.reshape(N, -1))
        return x + self.down(swiglu(self.gate_up(self.norm2(x)), self.limit))


class VisionTower(nn.Module):
    """GLM-5.3-Flash's vision transformer. pixel_values [N, channels * temporal_patch * patch^2]
    (an image processor's patches, each m x m window of patches consecutive), grid_thw [n, 3] (each
    image's frames and patch rows / columns) -> [N / m^2, hidden] image tokens: patches embedded
    linearly, transformer blocks attending within each frame with a 2-D rope of the patch's row and
    column, an RMS norm, each m x m window merged by a linear map to out_hidden, then a projection,
    LayerNorm, GELU and a clamped SwiGLU to the language model's width."""

    def __init__(self, c: VisionConfig, hidden: int):
        super().__init__()
        self.cfg = c
        self.patch_embed = nn.Linear(c.channels * c.temporal_patch * c.patch ** 2, c.hidden)
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.depth))
        self.post_norm = RMSNorm(c.hidden, eps=c.norm_eps)
        self.downsample = nn.Linear(c.merge ** 2 * c.hidden, c.out_hidden)
        self.merger_proj = nn.Linear(c.out_hidden, c.out_hidden, bias=False)
        self.merger_norm = nn.LayerNorm(c.out_hidden)
        self.merger_gate_up = nn.Linear(c.out_hidden, 2 * c.merger_ffn, bias=False)
        self.merger_down = nn.Linear(c.merger_ffn, hidden, bias=False)

    def positions(self, grid_thw: Tensor) -> Tensor:
        """[N, 2] (row, column) of every patch, each m x m window's patches consecutive."""
        m, out = self.cfg.merge, []
        for t, h, w in grid_thw.tolist():
            rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m).transpose(1, 2).flatten()
            cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m).transpose(1, 2).flatten()
            out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
        return torch.cat(out).to(grid_thw.device)

    def forward(self, pixel_values: Tensor, grid_thw: Tensor) -> Tensor:
        c = self.cfg
        expected = int(grid_thw.prod(-1).sum())
        if pixel_values.dim() != 2 or pixel_values.shape[0] != expected:
            raise ValueError(f"pixel_values must be [{expected}, {self.patch_embed.in_features}] (the patches of "
                             f"grid_thw {grid_thw.tolist()}), got {tuple(pixel_values.shape)}")
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        head_dim = c.hidden // c.heads
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float32,
                                                        device=x.device) / (head_dim // 2))
        angles = self.positions(grid_thw).float()[..., None] * inv_freq       # [N, 2, head_dim / 4]
        angles = angles.flatten(1).repeat(1, 2)[:, None, :]                   # [N, 1, head_dim]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        frames = F.pad(torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).cumsum(0), (1, 0))
        for block in self.blocks:
            x = block(x, frames.to(torch.int32), cos, sin)
        x = self.post_norm(x).reshape(-1, c.merge ** 2 * c.hidden)
        x = F.gelu(self.merger_norm(self.merger_proj(self.downsample(x))))
        return self.merger_down(swiglu(self.merger_gate_up(x), c.swiglu_limit))
