"""Multi-head attention modules: kernel (linear) attention and the softmax baseline."""

from __future__ import annotations

import numbers
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..arguments import check_flag, is_real
from ..core.backends import check_backend_name
from ..core.recurrent import RecurrentState
from ..core.softmax import softmax_attention
from ..core.validation import accumulation_dtype, check_dense, check_eps
from ..feature_maps import FeatureMap
from .functional import (
    check_products_fit,
    float16_in_float32,
    kernel_attention,
    resolve_feature_map,
)

ATTENTION_KINDS = ("kernel", "softmax")


class _Room:
    """The buffers a :class:`KVCache` grows in, ``(B,H,capacity,D|M)``, and how far they are
    written (``end``): shared by the caches that view them."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, end: int) -> None:
        self.keys, self.values, self.end = keys, values, end


@dataclass(frozen=True, eq=False)
class KVCache:
    """Softmax attention's autoregressive state: every past key and value, ``k: (B,H,T,D)``,
    ``v: (B,H,T,M)``.

    :meth:`append` writes a step into buffers with room for later ones (capacity doubling:
    amortized O(1) copying per step; growing by concatenation copied the whole cache every
    step, which dominated generation time at a few thousand tokens). ``k`` and ``v`` are
    views of those buffers; an earlier cache stays valid, and appending to it again (a
    branch) copies into buffers of its own.
    """

    k: torch.Tensor
    v: torch.Tensor
    _room: _Room | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        """Checks a cache built directly (``append`` builds valid ones)."""
        _check_keys_and_values(self.k, self.v, "k", "v")

    def append(self, k: torch.Tensor, v: torch.Tensor) -> KVCache:
        """This cache with ``k: (B,H,S,D)``, ``v: (B,H,S,M)`` after it (same B, H, D, M and
        device as the cache; another dtype converts the cache to it). Where autograd
        records the step (an in-place write would invalidate what earlier steps saved for
        the backward), by concatenation instead."""
        _check_keys_and_values(k, v, "k", "v")
        b, h, t, d = self.k.shape
        for name, x, last in (("k", k, d), ("v", v, self.v.shape[-1])):
            if (*x.shape[:2], x.shape[-1]) != (b, h, last):  # else broadcast into the cache
                raise ValueError(
                    f"{name} must have shape ({b}, {h}, S, {last}) as the cache's, "
                    f"got {tuple(x.shape)}"
                )
        if k.device != self.k.device:  # an in-place write would copy it across silently
            raise ValueError(f"k is on {k.device} but the cache is on {self.k.device}")
        s = k.shape[2]
        tensors = (self.k, self.v, k, v)
        if torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
            # converted as the in-place path converts (cat would promote instead)
            return KVCache(
                torch.cat([self.k.to(k.dtype), k], 2), torch.cat([self.v.to(v.dtype), v], 2)
            )
        room = self._room
        with _APPEND_LOCK:  # check and claim at once: two threads continuing one cache (a
            # branch each) both saw the room free and wrote into the same slots
            fits = (
                room is not None
                and room.end == t  # no later step was written after this one (else: a branch)
                and room.keys.shape[2] >= t + s
                and (room.keys.dtype, room.values.dtype) == (k.dtype, v.dtype)
                # buffers made under inference_mode take no in-place write outside it
                and (torch.is_inference_mode_enabled() or not room.keys.is_inference())
            )
            if fits:
                room.end = t + s
        if not fits:
            capacity = max(_MIN_CAPACITY, 2 * (t + s))
            b, h = self.k.shape[:2]
            keys = k.new_empty(b, h, capacity, k.shape[-1])
            values = v.new_empty(b, h, capacity, v.shape[-1])
            keys[:, :, :t] = self.k
            values[:, :, :t] = self.v
            room = _Room(keys, values, t + s)
        room.keys[:, :, t : t + s] = k
        room.values[:, :, t : t + s] = v
        return KVCache(room.keys[:, :, : t + s], room.values[:, :, : t + s], room)


_MIN_CAPACITY = 64  # steps a new KVCache buffer holds at least
_APPEND_LOCK = threading.Lock()  # module-level: caches still pickle and deepcopy


def _softmax_after(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """Causal softmax attention of queries ``q: (B,H,N,D)`` at positions ``past ..
    past+N-1`` over the keys ``k: (B,H,past+N,D)``, ``v: (B,H,past+N,M)`` before and at them."""
    if past == 0:
        return softmax_attention(q, k, v, causal=True)
    n, s = q.shape[2], k.shape[2]
    allowed = torch.ones(n, s, dtype=torch.bool, device=q.device).tril(diagonal=past)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def _check_keys_and_values(k: object, v: object, nk: str, nv: str) -> None:
    """TypeError/ValueError naming ``nk``/``nv`` unless they are ``(B,H,S,D)`` and
    ``(B,H,S,M)`` float tensors on one device."""
    for name, x in ((nk, k), (nv, v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4 or not x.is_floating_point():
            raise ValueError(
                f"{name} must be a float tensor (batch, heads, seq, dim), got "
                f"{x.dtype} of shape {tuple(x.shape)}"
            )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"{nk} and {nv} must agree in (batch, heads, seq), got {tuple(k.shape)} and "
            f"{tuple(v.shape)}"
        )
    if k.device != v.device:
        raise ValueError(f"{nk} is on {k.device} but {nv} on {v.device}")


def check_size(name: str, value: object) -> int:
    """``value`` as an int if it is a positive one (numpy's too, as the feature maps take;
    not a bool), else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def check_dropout(dropout: object) -> float:
    """``dropout`` as a float in [0, 1), else TypeError/ValueError naming it."""
    if not is_real(dropout):
        raise TypeError(f"dropout must be a float in [0, 1), got {dropout!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    return float(dropout)


class KernelAttention(nn.Module):
    """Multi-head self-attention around the linear-attention core.

    Args:
        d_model: model width; must be divisible by ``n_heads``.
        n_heads: number of heads; each has ``d_model // n_heads`` dims.
        feature_map: a registered map name, a config dict or a FeatureMap
            (``attention="kernel"`` only; None: ``"elu"``).
        attention: ``"kernel"`` (linear attention with ``feature_map``) or
            ``"softmax"`` (exact scaled dot-product attention, the baseline).
        causal: position i attends to ``j ≤ i`` only.
        dropout: dropout on the attention output (before the output projection).
        feature_map_kwargs: hyperparameters for a map given by name.
        eps: normalizer guard of linear attention.
        backend: core backend (None: ``KERNELSTUDY_BACKEND`` or auto).
        bias: biases in the q/k/v and output projections.

    Input ``x: (B,N,d_model)``, optional ``key_padding_mask: (B,N)`` bool (True =
    real token); output ``(B,N,d_model)``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        feature_map: str | Mapping[str, Any] | FeatureMap | None = None,
        attention: str = "kernel",
        causal: bool = False,
        dropout: float = 0.0,
        feature_map_kwargs: Mapping[str, Any] | None = None,
        eps: float = 1e-6,
        backend: str | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__()
        d_model, n_heads = check_size("d_model", d_model), check_size("n_heads", n_heads)
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
        if attention != "kernel" and feature_map_kwargs:
            raise ValueError(f"feature_map_kwargs given with attention={attention!r}: no map")
        if attention != "kernel" and feature_map is not None:  # was dropped without a word
            raise ValueError(f"feature_map={feature_map!r} given with attention={attention!r}")
        bias = check_flag("bias", bias)  # "False" built biases
        dropout = check_dropout(dropout)
        eps = check_eps(eps)
        check_backend_name(backend)
        self.d_model, self.n_heads = d_model, n_heads
        self.head_dim = d_model // n_heads
        self.attention, self.eps, self.backend = attention, eps, backend
        self.causal = check_flag("causal", causal)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.out = nn.Linear(d_model, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.feature_map: FeatureMap | None = None
        if attention == "kernel":
            self.feature_map = resolve_feature_map(
                "elu" if feature_map is None else feature_map,
                self.head_dim,
                n_heads,
                feature_map_kwargs,
            )

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.n_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        return q, k, v

    def _merge(self, y: torch.Tensor) -> torch.Tensor:
        b, h, n, d = y.shape
        return self.out(self.dropout(y.transpose(1, 2).reshape(b, n, h * d)))

    def check_input(self, x: object, name: str = "x", shape: str = "batch, seq") -> None:
        """TypeError/ValueError naming ``name`` unless ``x`` is a tensor of shape
        ``(shape, d_model)`` in the layer's dtype (or under autocast) and on its device."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        check_dense(x, name)
        if x.dim() != shape.count(",") + 2 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"{name} must have shape ({shape}, {self.d_model}), got {tuple(x.shape)}"
            )
        weight = self.qkv.weight
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a float tensor (token features), got {x.dtype}")
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"{name} has dtype {x.dtype} but the layer's weights are {weight.dtype}: convert "
                f"one (e.g. {name}.to({weight.dtype}) or layer.to({x.dtype})), or use autocast"
            )
        if x.device != weight.device:
            raise ValueError(
                f"{name} is on {x.device} but the layer's weights are on {weight.device}"
            )

    def forward(
        self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Self-attention over ``x: (B,N,d_model)`` (float) → ``(B,N,d_model)``;
        ``key_padding_mask: (B,N)`` bool, True = real token."""
        self.check_input(x)
        q, k, v = self._heads(x)
        if self.feature_map is None:
            y = softmax_attention(q, k, v, causal=self.causal, key_padding_mask=key_padding_mask)
        else:
            y = kernel_attention(
                q,
                k,
                v,
                self.feature_map,
                causal=self.causal,
                key_padding_mask=key_padding_mask,
                eps=self.eps,
                backend=self.backend,
            )
        return self._merge(y)

    def step(
        self, x_t: torch.Tensor, state: RecurrentState | KVCache | None = None
    ) -> tuple[torch.Tensor, RecurrentState | KVCache]:
        """One autoregressive step of a causal layer: ``x_t: (B,d_model)`` → ``(B,d_model)``.

        Kernel attention keeps a :class:`RecurrentState` (constant memory);
        softmax attention keeps a :class:`KVCache` that grows by one per step. A map that
        redraws its features in training (``redraw_every``) must step in eval mode: a
        redraw mid-sequence would leave the state summed over the old features.
        """
        self._check_stepping("step", x_t, "x_t", "batch", state)
        q, k, v = self._heads(x_t.unsqueeze(1))  # (B,H,1,D)
        if self.feature_map is None:
            if state is None:
                state = KVCache(k, v)
            else:
                state = state.append(k, v)
            y = softmax_attention(q, state.k, state.v)
        else:
            dtype = q.dtype
            phi_q, phi_k, v, log_scale = self._stepping_features(q, k, v)
            if state is None:
                state = self._empty_state(phi_q, x_t.device)
            scale = None if log_scale is None else log_scale[:, :, 0]
            y_t, state = state.step(phi_q[:, :, 0], phi_k[:, :, 0], v[:, :, 0], scale)
            # as kernel_attention: where stabilize=False, no overflowing φ(q)·Σφ(k)
            check_products_fit(self.feature_map, phi_q, state.Z[:, :, None])
            y = y_t.unsqueeze(2).to(dtype)
        return self._merge(y)[:, 0], state

    def steps(
        self, x: torch.Tensor, state: RecurrentState | KVCache | None = None
    ) -> tuple[torch.Tensor, RecurrentState | KVCache]:
        """:meth:`step` through a block of tokens at once: ``x: (B,N,d_model)`` →
        ``(B,N,d_model)`` and the state after them (a prompt read in parallel before
        stepping, or a long sequence in segments).

        Kernel attention runs the block on the core's causal product from the state
        (:meth:`~kernelstudy.core.RecurrentState.steps`); softmax attention appends the
        block to the :class:`KVCache` and attends causally over it. The outputs equal
        ``N`` calls of :meth:`step` (and :meth:`forward` from an empty state).
        """
        self._check_stepping("steps", x, "x", "batch, seq", state)
        q, k, v = self._heads(x)  # (B,H,N,D)
        if self.feature_map is None:
            past = 0 if state is None else state.k.shape[2]
            state = KVCache(k, v) if state is None else state.append(k, v)
            return self._merge(_softmax_after(q, state.k, state.v, past)), state
        dtype = q.dtype
        phi_q, phi_k, v, log_scale = self._stepping_features(q, k, v)
        if state is None:
            state = self._empty_state(phi_q, x.device)
        y, state = state.steps(phi_q, phi_k, v, log_scale, backend=self.backend)
        check_products_fit(self.feature_map, phi_q, state.Z[:, :, None])
        return self._merge(y.to(dtype)), state

    def _stepping_features(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(φ(q), φ̂(k), v, log_scale)`` of ``(B,H,N,D)`` heads for a kernel layer's state:
        keys one at a time (:meth:`~kernelstudy.feature_maps.FeatureMap.key_features`), with
        their log scales where the map shifts keys per sequence (None elsewhere): a scaled
        state keeps its running maximum, so stepping gives the batch output. float16 is
        mapped and summed in float32 (v too), as :func:`kernel_attention` does."""
        q, k, v, context = float16_in_float32(q, k, v)
        with context:
            phi_q = self.feature_map(q, is_query=True)
            phi_k, log_scale = self.feature_map.key_features(k)
        return phi_q, phi_k, v, log_scale if self.feature_map.keys_need_sequence else None

    def _empty_state(self, phi_q: torch.Tensor, device: torch.device) -> RecurrentState:
        """A kernel layer's first state for features like ``phi_q: (B,H,·,F)``."""
        b, h, f = phi_q.shape[0], phi_q.shape[1], phi_q.shape[-1]
        return RecurrentState.zeros(
            b,
            h,
            f,
            self.head_dim,
            dtype=accumulation_dtype(phi_q.dtype),
            device=device,
            eps=self.eps,
            scaled=self.feature_map.keys_need_sequence,
        )

    def _check_stepping(self, method: str, x: object, name: str, shape: str, state: object) -> None:
        """What :meth:`step` and :meth:`steps` (``method``) ask of the layer, their input
        ``x`` (called ``name``, of shape ``(shape, d_model)``) and ``state``."""
        if not self.causal:
            raise ValueError(f"{method}() needs a causal attention layer (causal=True)")
        fm = self.feature_map  # its own mode decides whether it redraws, not the layer's
        if fm is not None and fm.training and getattr(fm, "hparams", {}).get("redraw_every"):
            raise ValueError(
                f"{method}() of a layer whose feature map redraws in training (redraw_every > "
                "0) needs eval mode (layer.eval()): a redraw would mix two draws in the state"
            )
        self.check_input(x, name, shape)
        kind = KVCache if self.feature_map is None else RecurrentState
        if state is not None and not isinstance(state, kind):
            raise TypeError(
                f"state must be None or the {kind.__name__} of an earlier step of a "
                f"{'softmax' if self.feature_map is None else 'kernel'} attention layer, "
                f"got {type(state).__name__}"
            )
        if state is not None:
            self._check_state(state, x.shape[0])

    def _check_state(self, state: RecurrentState | KVCache, batch: int) -> None:
        """ValueError naming ``state`` when it is not this layer's for a batch of ``batch``
        on the layer's device."""
        if isinstance(state, KVCache):
            held, want = tuple(state.k.shape[:2]) + (state.k.shape[-1],), "(batch, heads, dim)"
            expected = (batch, self.n_heads, self.head_dim)
            device = state.k.device
        else:
            held, want = tuple(state.S.shape), "(batch, heads, features, dim)"
            expected = (batch, self.n_heads, self.feature_map.feature_dim, self.head_dim)
            device = state.S.device
        if device != self.qkv.weight.device:
            raise ValueError(
                f"state is on {device} but the layer is on {self.qkv.weight.device}: move the "
                "state's tensors with the layer, or start a new state"
            )
        if held != expected:
            raise ValueError(
                f"state holds {want} = {held}, but this layer steps {want} = {expected} "
                f"(x_t has batch {batch}): pass the state this layer returned for this batch"
            )

    def regularization(self) -> torch.Tensor:
        """The feature map's regularizer, a scalar (0 for softmax and maps without one)."""
        if self.feature_map is None:
            return torch.zeros((), device=self.out.weight.device)
        return self.feature_map.regularization().to(self.out.weight.device)
