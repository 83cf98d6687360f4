"""Attention modules, encoder blocks and models built on the core."""

from .attention import KernelAttention, KVCache
from .encoder import EncoderLayer, TransformerEncoder
from .functional import kernel_attention, resolve_feature_map

__all__ = [
    "EncoderLayer",
    "KVCache",
    "KernelAttention",
    "TransformerEncoder",
    "kernel_attention",
    "resolve_feature_map",
]
