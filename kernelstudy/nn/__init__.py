"""Attention modules, encoder blocks and models built on the core."""

from .attention import KernelAttention, KVCache
from .encoder import EncoderLayer, TransformerEncoder
from .functional import kernel_attention, resolve_feature_map
from .models import (
    CausalLM,
    LMState,
    MatchingClassifier,
    PositionalEncoding,
    SequenceClassifier,
    feature_dim_of,
    feature_map_parameter_count,
    feature_maps_of,
    parameter_count,
    resolve_attention,
    sinusoidal_positions,
)

__all__ = [
    "CausalLM",
    "EncoderLayer",
    "KVCache",
    "KernelAttention",
    "LMState",
    "MatchingClassifier",
    "PositionalEncoding",
    "SequenceClassifier",
    "TransformerEncoder",
    "feature_dim_of",
    "feature_map_parameter_count",
    "feature_maps_of",
    "kernel_attention",
    "parameter_count",
    "resolve_attention",
    "resolve_feature_map",
    "sinusoidal_positions",
]
