"""The hybrid KDA / gated-DSA LatentMoE model and its configurations."""

from .hybrid import PRESETS, HybridConfig, HybridModel, get_config

__all__ = ["PRESETS", "HybridConfig", "HybridModel", "get_config"]
