"""Hedgehog: a trainable softmax mimic [exp(Wx+b), exp(−Wx−b)] (Zhang et al. 2024)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from .base import HeadwiseFeatureMap, Hyperparameter, compute_dtype
from .registry import register_feature_map
from .softmax_kernel import ExpFeatures


@register_feature_map("hedgehog")
class HedgehogFeatureMap(ExpFeatures, HeadwiseFeatureMap):
    """φ(x) = [exp(xW + b), exp(−xW − b)] with trainable ``W: (D, D)``, ``b: (D,)``.

    Starts at W = I, b = 0; per head by default (``shared=False``), as in the paper.
    ``stabilize`` shifts exponents as ``favor`` does (per query row; per key
    sequence only beyond the dtype's range): normalized attention is unchanged,
    kernel values φ(q)·φ(k) only up to that factor. Positive, F = 2D. With the query's
    shift a row's normalizer can fall below ``eps`` (1e-6) when its keys lie far below
    its largest exponent (inputs at ~20σ), even in float64: the row then shrinks towards
    0; pass a smaller ``eps`` there. Without ``stabilize``, exponents beyond the dtype's
    range raise ValueError (features from e^88.7 in float32; attention from products
    above e^70.7). ``(B,H,N,D) → (B,H,N,2D)``.
    """

    paper = "Zhang et al. 2024, The Hedgehog & the Porcupine"
    feature_dim_formula = "2D"
    hyperparameters: ClassVar[dict[str, Hyperparameter]] = {
        "shared": Hyperparameter(
            bool, False, search=False, doc="one W, b for all heads (False: one per head)"
        ),
        "stabilize": Hyperparameter(
            bool, True, search=False, doc="subtract a max inside exp (cancels in attention)"
        ),
    }

    def __init__(self, head_dim: int, num_heads: int = 1, **hparams: Any) -> None:
        super().__init__(head_dim, num_heads, **hparams)
        eye = torch.eye(head_dim).expand(self.weight_heads, head_dim, head_dim)
        self.weight = nn.Parameter(eye.clone())
        self.bias = nn.Parameter(torch.zeros(self.weight_heads, 1, head_dim))

    @property
    def feature_dim(self) -> int:
        return 2 * self.head_dim

    def log_parts(self, x: torch.Tensor, is_query: bool) -> tuple[torch.Tensor, float]:
        """The exponents ±(xW + b) in at least float32 (a bfloat16 z ≈ 10 is off by up to
        0.03, i.e. 3% in exp)."""
        bias = self.bias[0, 0] if self.weight_heads == 1 else self.bias  # shared: (D,)
        dtype = compute_dtype(x, self.weight)
        z = self.headwise(x.to(dtype), self.weight.to(dtype)) + bias.to(dtype)
        return torch.cat([z, -z], dim=-1), 1.0
