"""Pieces shared by the maps that estimate or mimic the softmax kernel exp(q·k/√D)."""

from __future__ import annotations

import math

import torch

from ..core.exp_range import exp_shift
from ..core.transforms import checked_in_graph
from ..core.validation import autocast_off
from .base import FeatureMap


def softmax_kernel(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The exact softmax kernel ``exp(x·y/√D)``: ``(..., N, D), (..., S, D) → (..., N, S)``."""
    return torch.exp(x @ y.transpose(-1, -2) / x.shape[-1] ** 0.5)


def stabilizer(logits: torch.Tensor, is_query: bool, dtype: torch.dtype) -> torch.Tensor:
    """The shift to subtract from ``logits: (..., N, F)`` before ``exp`` into ``dtype``.

    Detached (a constant of the attention), from :func:`kernelstudy.core.exp_shift`:
    - queries, per row ``(..., N, 1)``: a row whose largest exponent is negative moves
      it to 0, one above ``dtype``'s safe range to the range's top (by the excess only,
      so attention does not jump there). A per-query factor cancels in normalized
      attention; lifting small rows keeps ``eps`` negligible beside them.
    - keys, per sequence ``(..., 1, 1)``: the largest exponent of the whole sequence
      moves to 0 when it lies below the safe range, to its top when above, and not at
      all inside it. Ordinary keys keep their exact features, so a key does not
      depend on later keys (causality) or on padding.
      Beyond the range (very large or very small exponents) the shift is set by the
      largest key of the sequence, later ones included. Causal
      :func:`~kernelstudy.nn.kernel_attention` therefore normalizes each row at the
      shift of its own prefix (:func:`~kernelstudy.nn.functional.causal_key_features`),
      as a scaled :class:`~kernelstudy.core.RecurrentState` (a running maximum) does;
      features of φ(k) alone, summed by the core directly, are at the whole sequence's
      shift. Where a row's keys lie so far below a later key's that one shift for the
      sequence would make them underflow (in float32 from about e^50 below), the causal
      attention reads the sequence in segments of that state instead
      (:func:`~kernelstudy.nn.functional.causal_in_segments`: one sync to tell; while
      ``torch.compile`` traces or inside ``vmap``, ``jacfwd``'s too, such rows keep part of
      ``eps``).
    """
    dims = (-1,) if is_query or logits.dim() < 2 else (-2, -1)
    logits = logits.detach()
    if logits.numel() == 0:  # no keys or queries: nothing to shift
        n = logits.dim()
        return logits.new_zeros([1 if i - n in dims else s for i, s in enumerate(logits.shape)])
    return exp_shift(logits.amax(dim=dims, keepdim=True), dtype, lift_negative=is_query)


class ExpFeatures(FeatureMap):
    """Maps of the form φ(x) = exp(L(x) − c)·T(x), with a ``stabilize`` hyperparameter.

    Subclasses implement ``log_parts(x, is_query) → (L, T)``: the log-domain part
    ``L: (..., N, F)`` (or ``(..., N, 1)``) and the bounded rest ``T`` (a tensor that
    broadcasts against it, or a float), computed in at least float32. With ``stabilize``
    the shift ``c`` is :func:`stabilizer` (per query row; per key sequence only where the
    dtype's range needs it), else 0. ``log_parts`` runs with autocast off: under a
    bfloat16 autocast its projections would otherwise round the exponents to bfloat16
    (features off by several percent).
    """

    def log_parts(self, x: torch.Tensor, is_query: bool) -> tuple[torch.Tensor, object]:
        raise NotImplementedError

    @property
    def keys_need_sequence(self) -> bool:
        return self.hparams["stabilize"]

    def full_precision_parts(self, x: torch.Tensor, is_query: bool) -> tuple[torch.Tensor, object]:
        """``log_parts`` with autocast off on ``x``'s device."""
        with autocast_off(x):
            return self.log_parts(x, is_query)

    def features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        """Without ``stabilize``, features that overflow ``x``'s dtype (finite exponents
        beyond its range, e.g. e^89 in float32 or e^11.1 in float16) raise ValueError
        rather than becoming inf and NaN attention (the check syncs)."""
        log, rest = self.full_precision_parts(x, is_query)
        if self.hparams["stabilize"]:
            log = log - stabilizer(log, is_query, x.dtype)
        phi = (log.exp() * rest).to(x.dtype)
        if not self.hparams["stabilize"]:
            self._check_no_overflow(phi, log, x.dtype)
        return phi

    def _check_no_overflow(self, phi: torch.Tensor, log: torch.Tensor, dtype: torch.dtype) -> None:
        """ValueError where a finite exponent gave an infinite feature (non-finite inputs
        keep their inf/NaN, as with ``stabilize``)."""
        phi = phi.detach()
        name = type(self).__name__
        if checked_in_graph(  # compile: in the graph, without a sync on the GPU; vmap: a warning
            lambda: ~(torch.isinf(phi) & torch.isfinite(log)).any(),
            f"{name} with stabilize=False: features overflow {dtype}; pass stabilize=True "
            "(normalized attention is unchanged), smaller inputs or a wider dtype",
            f"{name}'s overflow check (stabilize=False)",
            phi,
        ):
            return
        if not phi.numel() or bool(torch.isfinite(torch.stack([phi.amax(), phi.amin()])).all()):
            return  # the common case: two reductions, no copy of φ
        overflow = torch.isinf(phi) & torch.isfinite(log)
        if bool(overflow.any()):
            largest = float(log.detach().masked_fill(~torch.isfinite(log), -torch.inf).amax())
            raise ValueError(
                f"{type(self).__name__} with stabilize=False: exponents up to {largest:.4g} "
                f"overflow {dtype} (largest e^{math.log(torch.finfo(dtype).max):.1f}); pass "
                "stabilize=True (normalized attention is unchanged), smaller inputs or a "
                "wider dtype"
            )

    def key_features(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.hparams["stabilize"]:
            return super().key_features(k)
        self._check_input(k)
        log, rest = self.full_precision_parts(k, False)
        shift = log.detach().amax(dim=-1, keepdim=True)  # each key by its own max exponent
        return ((log - shift).exp() * rest).to(k.dtype), shift[..., 0]
