"""The dtype ops accumulate in: float64 for float64 inputs, float32 otherwise."""

import torch


def accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32
