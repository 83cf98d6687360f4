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

    Starts at W = I, b = 0; per head by default (``shared=False``), as in the paper. One
    W, b serve queries and keys by default (``tie_qk=True``); the paper learns a map for
    each (``tie_qk=False``: ``key_weight``, ``key_bias`` for keys, twice the parameters).
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
        "tie_qk": Hyperparameter(
            bool, True, search=False, doc="one W, b for queries and keys (False: one each)"
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
        if not self.hparams["tie_qk"]:  # the keys' own map, from the same start
            self.key_weight = nn.Parameter(eye.clone())
            self.key_bias = nn.Parameter(torch.zeros(self.weight_heads, 1, head_dim))

    @property
    def feature_dim(self) -> int:
        return 2 * self.head_dim

    def log_parts(self, x: torch.Tensor, is_query: bool) -> tuple[torch.Tensor, float]:
        """The exponents ±(xW + b) in at least float32 (a bfloat16 z ≈ 10 is off by up to
        0.03, i.e. 3% in exp). Keys take ``key_weight``, ``key_bias`` when not ``tie_qk``."""
        own = is_query or self.hparams["tie_qk"]
        weight, bias = (self.weight, self.bias) if own else (self.key_weight, self.key_bias)
        bias = bias[0, 0] if self.weight_heads == 1 else bias  # shared: (D,)
        dtype = compute_dtype(x, weight)
        z = self.headwise(x.to(dtype), weight.to(dtype)) + bias.to(dtype)
        return torch.cat([z, -z], dim=-1), 1.0
