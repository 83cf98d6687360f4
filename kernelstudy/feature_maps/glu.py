"""Gated-linear-unit kernels GLU, OGLU and AOGLU (Yorsh & Kovalenko).

A unit maps ``(..., N, n) → (..., N, n)``: GLU(X) = XW_f ⊙ σ(XW_g); the last unit of a
stack is Softplus(XW_f) ⊙ σ(XW_g), so φ > 0. ``depth`` stacks 1–3 units.
"""

from __future__ import annotations

import numbers
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..core.validation import autocast_off
from .base import SEED, SHARED, HeadwiseFeatureMap, Hyperparameter, compute_dtype, fill_on_cpu_
from .orthogonal import orthogonal_init_, orthogonality_penalty
from .registry import register_feature_map
from .softplus_ffn import REG_WEIGHT, YORSH_KOVALENKO

DEPTH = Hyperparameter(int, 1, low=1, high=3, doc="number of stacked GLU units")


class GLUUnit(nn.Module):
    """One unit's weights ``W_f: (H', n, n)`` and gate ``W_g: (H', n, n)``, or, with a
    ``rank``, the gate as a product ``W_g = A B`` of ``A: (H', n, r)``, ``B: (H', r, n)``."""

    def __init__(
        self, heads: int, n: int, orthogonal: bool, rank: int | None, generator: torch.Generator
    ) -> None:
        super().__init__()
        bound = n**-0.5
        self.w_f = nn.Parameter(torch.empty(heads, n, n))  # on the default device
        if orthogonal:
            orthogonal_init_(self.w_f, generator)
        else:
            fill_on_cpu_(self.w_f, lambda w: w.uniform_(-bound, bound, generator=generator))
        if rank is None:
            self.w_g = nn.Parameter(torch.empty(heads, n, n))
            fill_on_cpu_(self.w_g, lambda w: w.uniform_(-bound, bound, generator=generator))
        else:  # entries of A B get the variance 1/(3n) of the full gate's uniform init
            std = (3 * rank * n) ** -0.25
            self.w_g_down = nn.Parameter(torch.empty(heads, n, rank))
            self.w_g_up = nn.Parameter(torch.empty(heads, rank, n))
            for w in (self.w_g_down, self.w_g_up):
                fill_on_cpu_(w, lambda w: w.normal_(generator=generator).mul_(std))

    def gate_weight(self) -> torch.Tensor:
        """``W_g: (H', n, n)``."""
        if hasattr(self, "w_g"):
            return self.w_g
        return self.w_g_down @ self.w_g_up


@register_feature_map("glu")
class GLUFeatureMap(HeadwiseFeatureMap):
    """Stacked GLU kernel: ``depth`` units of XW_f ⊙ σ(XW_g), the last with Softplus(XW_f).

    W_f, W_g: ``(n, n)`` with n = D, no biases: 2n² parameters per unit (per head if
    ``shared=False``). Positive, F = D. ``(B,H,N,D) → (B,H,N,D)``.
    """

    paper = YORSH_KOVALENKO
    feature_dim_formula = "D"
    orthogonal_f: ClassVar[bool] = False
    hyperparameters: ClassVar[dict[str, Hyperparameter]] = {
        "depth": DEPTH,
        "shared": SHARED,
        "seed": SEED,
    }

    def __init__(self, head_dim: int, num_heads: int = 1, **hparams: Any) -> None:
        super().__init__(head_dim, num_heads, **hparams)
        generator = torch.Generator().manual_seed(self.hparams["seed"])
        self.units = nn.ModuleList(
            GLUUnit(self.weight_heads, head_dim, self.orthogonal_f, self.rank, generator)
            for _ in range(self.hparams["depth"])
        )

    @property
    def rank(self) -> int | None:
        """The gate's rank r (None: a full n×n gate)."""
        return None

    @property
    def feature_dim(self) -> int:
        return self.head_dim

    def features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        """Computed in at least float32 with autocast off, returned in ``x``'s dtype: σ(z) and
        softplus(z) of a negative z are about e^z, and a bfloat16 z is off by up to |z|/256
        (z ≈ −30: features 6% off from that rounding alone)."""
        dtype = compute_dtype(x, self.units[0].w_f)
        with autocast_off(x):
            h = x.to(dtype)
            for i, unit in enumerate(self.units):
                value = self.headwise(h, unit.w_f.to(dtype))
                gate = torch.sigmoid(self.headwise(h, unit.gate_weight().to(dtype)))
                if i == len(self.units) - 1:
                    value = F.softplus(value)
                h = value * gate
        return h.to(x.dtype)


@register_feature_map("oglu")
class OGLUFeatureMap(GLUFeatureMap):
    """GLU kernel with orthogonal W_f: orthogonal init and ``regularization()`` =
    ``reg_weight``·Σ_units ‖W_fᵀW_f − I‖²_F. 2n² parameters per unit, F = D.
    ``(B,H,N,D) → (B,H,N,D)``."""

    orthogonal_f = True
    hyperparameters: ClassVar[dict[str, Hyperparameter]] = {
        "depth": DEPTH,
        "reg_weight": REG_WEIGHT,
        "shared": SHARED,
        "seed": SEED,
    }

    def regularization(self) -> torch.Tensor:
        """``reg_weight``·Σ_units ‖W_fᵀW_f − I‖²_F, a scalar (≈ 0 at init)."""
        penalty = sum(orthogonality_penalty(unit.w_f) for unit in self.units)
        return self.hparams["reg_weight"] * penalty


@register_feature_map("aoglu")
class AOGLUFeatureMap(OGLUFeatureMap):
    """OGLU whose gate is a rank-r product W_g = A B (A: n×r, B: r×n), r = ``rank``
    (default n//4, at least 1): exactly n² + 2nr parameters per unit (per head if
    ``shared=False``). F = D. ``(B,H,N,D) → (B,H,N,D)``. The paper takes r < n/2 (its
    runs n/4: 25% fewer parameters than OGLU's 2n²); ranks from n/2 to n are accepted
    but cost as much as OGLU's full gate or more."""

    hyperparameters: ClassVar[dict[str, Hyperparameter]] = {
        "depth": DEPTH,
        "rank": Hyperparameter(
            int,
            None,
            low=1,
            nullable=True,
            search=False,
            doc="rank r of the gate, at most head_dim (None: n//4)",
        ),
        "reg_weight": REG_WEIGHT,
        "shared": SHARED,
        "seed": SEED,
    }

    def __init__(self, head_dim: int, num_heads: int = 1, **hparams: Any) -> None:
        rank = hparams.get("rank")
        valid = [  # numpy's ints too (the base takes them): rebuilt from config() it refused
            isinstance(x, numbers.Integral) and not isinstance(x, bool | np.bool_)
            for x in (rank, head_dim)
        ]
        if all(valid) and head_dim >= 1 and rank > head_dim:  # else the base names the bad one
            raise ValueError(f"rank must be <= head_dim={head_dim}, got {rank}")
        super().__init__(head_dim, num_heads, **hparams)

    @property
    def rank(self) -> int | None:
        rank = self.hparams["rank"]
        return max(1, self.head_dim // 4) if rank is None else rank
