"""Image front end: images become tokens of the same packed batch as text. Each image is cut into
patch x patch squares, embedded (a strided convolution) and projected (Linear-GELU-Linear) to
the model width; its patches take the places of image placeholder tokens in the sequence."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


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
