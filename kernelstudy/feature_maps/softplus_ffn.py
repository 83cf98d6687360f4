"""A trainable one-layer feed-forward kernel φ(X) = Softplus(XW) (Yorsh & Kovalenko)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..core.validation import autocast_off
from .base import SEED, SHARED, HeadwiseFeatureMap, Hyperparameter, compute_dtype, fill_on_cpu_
from .orthogonal import orthogonal_init_, orthogonality_penalty
from .registry import register_feature_map

#: Hyperparameters of the trainable maps of Yorsh & Kovalenko.
REG_WEIGHT = Hyperparameter(
    float, 0.01, low=0.0, high=1.0, doc="weight of the orthogonality penalty ‖WᵀW − I‖²_F"
)
YORSH_KOVALENKO = "Yorsh & Kovalenko, Linear Self-Attention Approximation via Trainable FF Kernel"


@register_feature_map("softplus_ffn")
class SoftplusFFNFeatureMap(HeadwiseFeatureMap):
    """φ(X) = Softplus(XW) with ``W: (n, n)``, n = D, applied head-wise (positive, F = D).

    With ``orthogonal`` (the default) W starts orthogonal and ``regularization()`` =
    ``reg_weight``·‖WᵀW − I‖²_F keeps it near orthogonal (summed over heads when
    ``shared=False``): the paper's "orthogonal" FFN. ``orthogonal=False, reg_weight=0``
    is its plain "linear kernel": W uniform in ±1/√n (as ``nn.Linear``), no penalty.
    ``(B,H,N,D) → (B,H,N,D)``.
    """

    paper = YORSH_KOVALENKO
    feature_dim_formula = "D"
    hyperparameters: ClassVar[dict[str, Hyperparameter]] = {
        "reg_weight": REG_WEIGHT,
        "orthogonal": Hyperparameter(
            bool, True, search=False, doc="orthogonal init (False: uniform in ±1/√n)"
        ),
        "shared": SHARED,
        "seed": SEED,
    }
    state_hyperparameters: ClassVar[tuple[str, ...]] = ("orthogonal",)  # W's initialization

    def __init__(self, head_dim: int, num_heads: int = 1, **hparams: Any) -> None:
        super().__init__(head_dim, num_heads, **hparams)
        self.weight = nn.Parameter(torch.empty(self.weight_heads, head_dim, head_dim))
        generator = torch.Generator().manual_seed(self.hparams["seed"])
        if self.hparams["orthogonal"]:
            orthogonal_init_(self.weight, generator)
        else:
            bound = head_dim**-0.5
            fill_on_cpu_(self.weight, lambda w: w.uniform_(-bound, bound, generator=generator))

    @property
    def feature_dim(self) -> int:
        return self.head_dim

    def features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        """Computed in at least float32 with autocast off, returned in ``x``'s dtype
        (softplus(z) ≈ e^z for negative z: a bfloat16 z is off by up to |z|/256)."""
        dtype = compute_dtype(x, self.weight)
        with autocast_off(x):
            return F.softplus(self.headwise(x.to(dtype), self.weight.to(dtype))).to(x.dtype)

    def regularization(self) -> torch.Tensor:
        """``reg_weight``·‖WᵀW − I‖²_F, a scalar (≈ 0 at the orthogonal init)."""
        return self.hparams["reg_weight"] * orthogonality_penalty(self.weight)
