"""Analyses of feature maps against softmax attention.

The table-producing analyses (``approximation_error``, ``fit_to_softmax``,
``benchmark_attention``, ``benchmark_generation``) return a pandas DataFrame in long
format (one row per configuration, seed and metric); ``attention_rank`` returns a dict
of measures and ``attention_matrix`` a tensor. Every function of :mod:`.plots` takes
such a frame and returns a matplotlib Figure drawn with seaborn.

- approximation error: :func:`approximation_error`, :func:`gaussian_qk`,
  :func:`capture_qk`, :func:`fit_to_softmax`;
- attention matrices and their rank: :func:`attention_matrix`, :func:`attention_rank`,
  :func:`normalized_spectrum`;
- speed and memory: :func:`benchmark_attention`, :func:`benchmark_generation`.
"""

from .approximation import METRICS, approximation_error, gaussian_qk, map_label, row_kl
from .capture import capture_qk
from .fitting import distillation_loss, fit_to_softmax
from .generation import benchmark_generation, generate, speedups, state_bytes
from .matching import map_kind, matched_feature_map, random_feature_map
from .matrices import MAX_N, attention_matrix, softmax_kernel
from .rank import attention_rank, normalized_spectrum
from .speed import (
    benchmark_attention,
    matmul_rate,
    peak_memory_bytes,
    speed_labels,
    time_call,
)

__all__ = [
    "MAX_N",
    "METRICS",
    "approximation_error",
    "attention_matrix",
    "attention_rank",
    "benchmark_attention",
    "benchmark_generation",
    "capture_qk",
    "distillation_loss",
    "fit_to_softmax",
    "gaussian_qk",
    "generate",
    "map_kind",
    "map_label",
    "matched_feature_map",
    "matmul_rate",
    "normalized_spectrum",
    "peak_memory_bytes",
    "plots",
    "random_feature_map",
    "row_kl",
    "softmax_kernel",
    "speed_labels",
    "speedups",
    "state_bytes",
    "time_call",
]


def __getattr__(name: str):
    if name == "plots":  # imported on first use: seaborn/matplotlib are slow to import
        import importlib

        return importlib.import_module(f"{__name__}.plots")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
