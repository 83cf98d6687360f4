"""Random Fourier (sin/cos) features of the softmax kernel (Rahimi & Recht 2007; the
Performer paper's trigonometric baseline)."""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import Hyperparameter, RandomFeatureMap
from .favor import PROJECTION_HPARAMS, SoftmaxRandomFeatures
from .registry import register_feature_map


@register_feature_map("trig_rf")
class TrigRandomFeatureMap(SoftmaxRandomFeatures):
    """Trigonometric random features of exp(q·k/√D): unbiased but NOT positive.

    φ(x) = exp(‖x̂‖²/2)/√R · [sin(Wx̂), cos(Wx̂)] with x̂ = x/D^{1/4}, so
    E[φ(x)·φ(y)] = exp(x·y/√D). Kernel estimates can be negative and the attention
    normalizer can vanish or change sign, which makes outputs blow up: this is the
    unstable baseline FAVOR+ improves on. ``stabilize`` divides exp(‖x̂‖²/2) (always
    ≥ 1) by its excess over the dtype's range: per row for queries, by the sequence's
    largest for keys (a per-row and a per-sequence factor); both cancel in normalized
    attention.
    ``(B,H,N,D) → (B,H,N,2R)``; W is shared by all heads.
    """

    paper = "Rahimi & Recht 2007; baseline in Choromanski et al. 2021 (Performers)"
    positive = False
    feature_dim_formula = "2R"
    hyperparameters: ClassVar[dict[str, Hyperparameter]] = {
        **PROJECTION_HPARAMS,
        **RandomFeatureMap.hyperparameters,
    }

    @property
    def feature_dim(self) -> int:
        return 2 * self.hparams["num_features"]

    def log_parts(self, x: torch.Tensor, is_query: bool) -> tuple[torch.Tensor, torch.Tensor]:
        self.maybe_redraw(is_query)
        proj, half_sq_norm = self.project(x)
        trig = torch.cat([proj.sin(), proj.cos()], dim=-1) * self.hparams["num_features"] ** -0.5
        return half_sq_norm, trig
