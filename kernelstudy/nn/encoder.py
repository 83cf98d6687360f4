"""A pre-LayerNorm Transformer encoder built on :class:`KernelAttention`."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from ..arguments import check_flag
from ..core.recurrent import RecurrentState
from ..feature_maps import FeatureMap
from .attention import KernelAttention, KVCache, check_size

LayerState = RecurrentState | KVCache | None


class EncoderLayer(nn.Module):
    """``x + attn(LN(x))`` then ``x + FFN(LN(x))``; ``x: (B,N,d_model)``."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        attention: str = "kernel",
        feature_map: str | Mapping[str, Any] | FeatureMap | None = None,
        feature_map_kwargs: Mapping[str, Any] | None = None,
        causal: bool = False,
        eps: float = 1e-6,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        d_model = check_size("d_model", d_model)  # before d_ff and LayerNorm(d_model) use it
        d_ff = check_size("d_ff", d_ff)
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = KernelAttention(
            d_model,
            n_heads,
            feature_map=feature_map,
            attention=attention,
            causal=causal,
            dropout=dropout,
            feature_map_kwargs=feature_map_kwargs,
            eps=eps,
            backend=backend,
        )
        self.norm2 = nn.LayerNorm(d_model)
        self.ffn = nn.Sequential(
            nn.Linear(d_model, d_ff), nn.GELU(), nn.Dropout(dropout), nn.Linear(d_ff, d_model)
        )
        self.drop = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pre-norm block: attention then feed-forward, each residual.
        ``x: (B,N,d_model)`` → ``(B,N,d_model)``; ``key_padding_mask: (B,N)`` bool."""
        self.attn.check_input(x)  # named errors, not LayerNorm's RuntimeError
        x = x + self.drop(self.attn(self.norm1(x), key_padding_mask))
        return x + self.drop(self.ffn(self.norm2(x)))

    def step(self, x_t: torch.Tensor, state: LayerState) -> tuple[torch.Tensor, LayerState]:
        """One autoregressive step, ``x_t: (B,d_model)`` → ``(B,d_model)``."""
        self.attn.check_input(x_t, "x_t", "batch")
        a, state = self.attn.step(self.norm1(x_t), state)
        x_t = x_t + self.drop(a)
        return x_t + self.drop(self.ffn(self.norm2(x_t))), state

    def steps(self, x: torch.Tensor, state: LayerState) -> tuple[torch.Tensor, LayerState]:
        """:meth:`step` through a block of tokens at once, ``x: (B,N,d_model)`` →
        ``(B,N,d_model)`` (:meth:`KernelAttention.steps`)."""
        self.attn.check_input(x)
        a, state = self.attn.steps(self.norm1(x), state)
        x = x + self.drop(a)
        return x + self.drop(self.ffn(self.norm2(x))), state


def layer_map_kwargs(
    feature_map: str | Mapping[str, Any] | None,
    feature_map_kwargs: Mapping[str, Any] | None,
    layer: int,
    attention: str = "kernel",
) -> Mapping[str, Any] | None:
    """``feature_map_kwargs`` for layer ``layer``: an explicit int ``seed`` (numpy's too; in
    the kwargs or the config dict) is layer 0's; layer i > 0 draws with
    :func:`layer_seed`, so layers draw independent features (one seed gave every layer
    the same projection) and the model stays reproducible. Softmax attention has no map:
    its kwargs pass unchanged (the layer checks them)."""
    if attention != "kernel":
        return feature_map_kwargs
    if feature_map_kwargs is not None and not isinstance(feature_map_kwargs, Mapping):
        return feature_map_kwargs  # the layer refuses it, naming it
    config = feature_map if isinstance(feature_map, Mapping) else {}
    seed = (feature_map_kwargs or {}).get("seed", config.get("seed"))
    if layer == 0 or isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        return feature_map_kwargs  # None and Generators draw anew for each layer anyway
    return {**(feature_map_kwargs or {}), "seed": layer_seed(int(seed), layer)}


def layer_seed(seed: int, layer: int) -> int:
    """The map seed of layer ``layer`` of a model whose map seed is ``seed``: ``seed`` for
    layer 0, else a hash of (seed, layer) in [0, 2**32). Not ``seed + layer``: then runs
    with seeds 0 and 1 shared all but one layer's draws, and were not independent. A
    seed outside [0, 2**32) is returned as is (the map refuses it by name)."""
    if layer == 0 or not 0 <= seed < 2**32:
        return seed
    return int(np.random.SeedSequence([seed, layer]).generate_state(1)[0])


class TransformerEncoder(nn.Module):
    """A stack of pre-LN layers with a final LayerNorm.

    Args:
        n_layers, d_model, n_heads: depth, width, heads (``d_model % n_heads == 0``).
        d_ff: hidden width of the feed-forward block (default ``4·d_model``).
        dropout: dropout rate in attention output, FFN and residual branches.
        attention: ``"kernel"`` or ``"softmax"``.
        feature_map, feature_map_kwargs: the map of every layer (kernel attention only; None:
            ``"elu"``; each layer gets its own copy; an explicit int ``seed`` is layer 0's,
            layer i draws with :func:`layer_seed`).
        causal: causal self-attention; enables :meth:`step`.
        eps, backend: linear attention's normalizer guard and core backend (None:
            ``KERNELSTUDY_BACKEND`` or auto), as in :class:`KernelAttention`.

    ``forward(x: (B,N,d_model), key_padding_mask: (B,N) | None) → (B,N,d_model)``.
    """

    def __init__(
        self,
        n_layers: int,
        d_model: int,
        n_heads: int,
        d_ff: int | None = None,
        dropout: float = 0.1,
        attention: str = "kernel",
        feature_map: str | Mapping[str, Any] | None = None,
        feature_map_kwargs: Mapping[str, Any] | None = None,
        causal: bool = False,
        eps: float = 1e-6,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        n_layers = check_size("n_layers", n_layers)
        d_model = check_size("d_model", d_model)  # before the default d_ff = 4·d_model
        if isinstance(feature_map, FeatureMap):
            raise TypeError(
                "feature_map must be a name or config dict (each layer builds its own map)"
            )
        self.causal = causal = check_flag("causal", causal)
        self.layers = nn.ModuleList(
            EncoderLayer(
                d_model,
                n_heads,
                d_ff if d_ff is not None else 4 * d_model,
                dropout,
                attention,
                feature_map,
                layer_map_kwargs(feature_map, feature_map_kwargs, i, attention),
                causal,
                eps,
                backend,
            )
            for i in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)

    def forward(
        self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Every layer then the final norm: ``x: (B,N,d_model)`` → ``(B,N,d_model)``;
        ``key_padding_mask: (B,N)`` bool, True = real token."""
        for layer in self.layers:
            x = layer(x, key_padding_mask)
        return self.norm(x)

    def step(
        self, x_t: torch.Tensor, states: list[LayerState] | None = None
    ) -> tuple[torch.Tensor, list[LayerState]]:
        """One autoregressive step through every layer: ``x_t: (B,d_model)`` → ``(B,d_model)``.

        ``states`` is the list returned by the previous step (None to start).
        """
        new_states: list[LayerState] = []
        for layer, state in zip(self.layers, self._layer_states(states), strict=True):
            x_t, state = layer.step(x_t, state)
            new_states.append(state)
        return self.norm(x_t), new_states

    def steps(
        self, x: torch.Tensor, states: list[LayerState] | None = None
    ) -> tuple[torch.Tensor, list[LayerState]]:
        """:meth:`step` through a block of tokens at once: ``x: (B,N,d_model)`` →
        ``(B,N,d_model)`` and the layers' states after it (``states``: an earlier step's or
        block's, None to start). From None it equals :meth:`forward` of a causal encoder."""
        new_states: list[LayerState] = []
        for layer, state in zip(self.layers, self._layer_states(states), strict=True):
            x, state = layer.steps(x, state)
            new_states.append(state)
        return self.norm(x), new_states

    def _layer_states(self, states: object) -> list[LayerState]:
        """``states`` of :meth:`step` and :meth:`steps` as a list with one entry a layer."""
        if states is None:
            return [None] * len(self.layers)
        if not isinstance(states, list | tuple):
            raise TypeError(
                f"states must be the list of layer states of an earlier step (or None), "
                f"got {type(states).__name__}"
            )
        if len(states) != len(self.layers):
            raise ValueError(f"states must have {len(self.layers)} entries, got {len(states)}")
        return list(states)

    def regularization(self) -> torch.Tensor:
        """Sum of every layer's feature-map regularizer (a scalar)."""
        return sum((layer.attn.regularization() for layer in self.layers), torch.zeros(()))
