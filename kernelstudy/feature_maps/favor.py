"""FAVOR+: positive random features of the softmax kernel (Choromanski et al. 2021)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from ..core.validation import autocast_off
from .base import Hyperparameter, RandomFeatureMap, compute_dtype
from .orthogonal import ROW_NORMS, gaussian_projection
from .registry import register_feature_map
from .softmax_kernel import ExpFeatures, softmax_kernel

#: Hyperparameters shared by the random-feature maps of the softmax kernel.
PROJECTION_HPARAMS: dict[str, Hyperparameter] = {
    "num_features": Hyperparameter(
        int, 256, low=1, high=8192, log=True, doc="R, the number of random projections"
    ),
    "orthogonal": Hyperparameter(
        bool, True, search=False, doc="block-orthogonal rows of W (False: iid Gaussian)"
    ),
    "row_norms": Hyperparameter(
        str,
        "chi",
        choices=ROW_NORMS,
        search=False,
        doc="orthogonal rows rescaled to χ(D)-distributed norms (unbiased) or to exactly "
        "√D (biased: the kernel estimate's mean is not exp(q·k/√D)); iid rows ignore it",
    ),
    "stabilize": Hyperparameter(
        bool,
        True,
        search=False,
        doc="subtract a max (per query row / per key sequence) inside exp; it cancels in "
        "normalized attention but scales the kernel values φ(q)·φ(k)",
    ),
}


class SoftmaxRandomFeatures(ExpFeatures, RandomFeatureMap):
    """Base of random-feature maps of exp(q·k/√D) with a projection ``W: (R, D)`` buffer.

    Inputs are scaled as x̂ = x / D^{1/4}, so that exp(q̂·k̂) = exp(q·k/√D).
    """

    state_hyperparameters: ClassVar[tuple[str, ...]] = ("orthogonal", "row_norms")

    @classmethod
    def state_hparams(cls, hparams: Mapping[str, Any]) -> dict[str, Any]:
        """``orthogonal`` and ``row_norms``, the latter only for orthogonal rows (iid rows
        ignore it)."""
        found = super().state_hparams(hparams)
        if found.get("orthogonal") is False:
            found.pop("row_norms", None)
        return found

    def __init__(self, head_dim: int, num_heads: int = 1, **hparams: Any) -> None:
        super().__init__(head_dim, num_heads, **hparams)
        r = self.hparams["num_features"]
        self.register_buffer("weight", torch.empty(r, head_dim))
        self.redraw(self.hparams["seed"])

    def draw(self, generator: torch.Generator) -> None:
        w = gaussian_projection(
            self.hparams["num_features"],
            self.head_dim,
            generator,
            orthogonal=self.hparams["orthogonal"],
            row_norms=self.hparams["row_norms"],
        )
        # A new tensor, not an in-place copy: a forward that saved the old draw for its
        # backward (redraw_every, two calls before one backward) keeps it.
        self.weight = w.to(dtype=self.weight.dtype, device=self.weight.device)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Wx̂: (..., N, R), ‖x̂‖²/2: (..., N, 1))`` in at least float32, also under
        autocast."""
        dtype = compute_dtype(x, self.weight)
        with autocast_off(x):
            x_hat = x.to(dtype) * self.head_dim**-0.25
            half_sq_norm = x_hat.square().sum(-1, keepdim=True) / 2
            return x_hat @ self.weight.to(dtype).T, half_sq_norm

    def kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The kernel the features estimate, exp(x·y/√D): ``(..., N, S)``.

        With ``stabilize=True`` φ(x)·φ(y) equals it only up to a factor per query
        row and per key sequence (which normalized attention cancels).
        """
        return softmax_kernel(x, y)


@register_feature_map("favor")
class FavorFeatureMap(SoftmaxRandomFeatures):
    """FAVOR+ positive random features of the softmax kernel exp(q·k/√D).

    φ(x) = exp(Wx̂ − ‖x̂‖²/2)/√R with x̂ = x/D^{1/4} and W: (R, D) Gaussian rows (iid or
    block-orthogonal with χ row norms), so E[φ(x)·φ(y)] = exp(x·y/√D) (not with
    ``row_norms="sqrt_d"``, which is biased). ``hyperbolic=True`` uses
    [exp(Wx̂), exp(−Wx̂)]·exp(−‖x̂‖²/2)/√(2R) (F = 2R; same mean, lower variance at equal R).
    ``stabilize`` (:func:`~kernelstudy.feature_maps.softmax_kernel.stabilizer`) moves
    a query row's largest exponent to 0 when it is negative, and the key sequence's to 0
    when it lies below the dtype's safe range (:data:`kernelstudy.core.SAFE_EXPONENTS`,
    e^±20 in float32); either one above the range moves to its top: ordinary keys keep
    their exact features, independent of later keys and of padding. Normalized attention
    is unchanged; φ(q)·φ(k) is the kernel times a per-row (and, for extreme keys,
    per-sequence) factor. Turn it off for kernel-level analysis; unstabilized
    φ ≤ exp(max_r ‖w_r‖²/2)/√R anyway, as w·x̂ − ‖x̂‖²/2 ≤ ‖w‖²/2. The normalizer
    φ(q)·Σφ(k) estimates Σ exp(q·k/√D) with heavy tails: at large ‖x̂‖ it can fall
    towards ``eps`` (1e-6) for a few early causal rows; pass a smaller ``eps`` there.
    ``(B,H,N,D) → (B,H,N,F)``; W is shared by all heads.
    """

    paper = "Choromanski et al. 2021, Rethinking Attention with Performers"
    feature_dim_formula = "R (2R if hyperbolic)"
    hyperparameters: ClassVar[dict[str, Hyperparameter]] = {
        **PROJECTION_HPARAMS,
        "hyperbolic": Hyperparameter(
            bool, False, search=False, doc="features [exp(Wx̂), exp(−Wx̂)] (F = 2R)"
        ),
        **RandomFeatureMap.hyperparameters,
    }

    @property
    def feature_dim(self) -> int:
        return self.hparams["num_features"] * (2 if self.hparams["hyperbolic"] else 1)

    def log_parts(self, x: torch.Tensor, is_query: bool) -> tuple[torch.Tensor, float]:
        self.maybe_redraw(is_query)
        proj, half_sq_norm = self.project(x)
        if self.hparams["hyperbolic"]:
            proj = torch.cat([proj, -proj], dim=-1)
        # + (-norm), not - norm: the same values, and the backward negates the (..., N, 1)
        # gradient, not the (..., N, F) one (a fifth of the map's backward at F = 256)
        return proj + (-half_sq_norm), self.feature_dim**-0.5
