"""Pieces shared by the maps that estimate or mimic the softmax kernel exp(q·k/√D)."""

from __future__ import annotations

import torch

from .base import FeatureMap


def softmax_kernel(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The exact softmax kernel ``exp(x·y/√D)``: ``(..., N, D), (..., S, D) → (..., N, S)``."""
    return torch.exp(x @ y.transpose(-1, -2) / x.shape[-1] ** 0.5)


def compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """At least float32 (half inputs are computed in float32), float64 if either is."""
    return torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)


def stabilizer(logits: torch.Tensor, is_query: bool) -> torch.Tensor:
    """The constant to subtract from ``logits: (..., N, F)`` before ``exp``.

    Queries: the max over features of each row ``(..., N, 1)``; a per-query factor
    cancels in normalized attention. Keys: the max over the whole sequence and
    all features ``(..., 1, 1)``; one factor shared by every key of a sequence
    cancels too (also causally). Detached: it is a constant of the attention.
    """
    dims = (-1,) if is_query or logits.dim() < 2 else (-2, -1)
    return logits.detach().amax(dim=dims, keepdim=True)


class ExpFeatures(FeatureMap):
    """Maps of the form φ(x) = exp(L(x) − c)·T(x), with a ``stabilize`` hyperparameter.

    Subclasses implement ``log_parts(x, is_query) → (L, T)``: the log-domain part
    ``L: (..., N, F)`` (or ``(..., N, 1)``) and the bounded rest ``T`` (a tensor that
    broadcasts against it, or a float). With ``stabilize`` the shift ``c`` is
    :func:`stabilizer` (per query row, per key sequence), else 0.
    """

    def log_parts(self, x: torch.Tensor, is_query: bool) -> tuple[torch.Tensor, object]:
        raise NotImplementedError

    @property
    def keys_need_sequence(self) -> bool:
        return self.hparams["stabilize"]

    def features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        log, rest = self.log_parts(x, is_query)
        if self.hparams["stabilize"]:
            log = log - stabilizer(log, is_query)
        return (log.exp() * rest).to(x.dtype)

    def key_features(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.hparams["stabilize"]:
            return super().key_features(k)
        self._check_input(k)
        log, rest = self.log_parts(k, False)
        shift = stabilizer(log, is_query=True)  # each key by its own max, like a query row
        return ((log - shift).exp() * rest).to(k.dtype), shift[..., 0]
