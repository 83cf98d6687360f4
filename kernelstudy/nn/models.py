"""Models on :class:`TransformerEncoder`: LRA classifiers, the two-tower matcher and a causal LM.

Every model takes any attention: ``attention="softmax"``, ``attention="kernel"``
with ``feature_map=`` (a registered name or config dict) and ``feature_map_kwargs=``,
or a map name / config directly as ``attention="favor"``. Inputs are token ids
``(B,N)`` long and an optional padding ``mask`` ``(B,N)`` bool, True = real token.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..arguments import check_count, check_flag, check_real
from ..core.validation import check_key_padding_mask
from ..feature_maps import FeatureMap
from ..feature_maps.base import resolve_seed
from .attention import check_dropout, check_size
from .encoder import LayerState, TransformerEncoder
from .modes import module_mode

POSITIONS = ("sinusoidal", "learned", "none")
POOLINGS = ("mean", "cls")


def feature_maps_of(module: nn.Module) -> list[FeatureMap]:
    """Every FeatureMap inside ``module`` (one per kernel-attention layer; empty for softmax)."""
    return [m for m in module.modules() if isinstance(m, FeatureMap)]


def feature_map_parameter_count(module: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters held by the feature maps inside ``module`` (shared ones once)."""
    trainable_only = check_flag("trainable_only", trainable_only)
    params = {id(p): p for fm in feature_maps_of(module) for p in fm.parameters()}
    return sum(p.numel() for p in params.values() if p.requires_grad or not trainable_only)


def parameter_count(module: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters of ``module`` (tied weights counted once)."""
    trainable_only = check_flag("trainable_only", trainable_only)
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def feature_dim_of(module: nn.Module) -> int | None:
    """F of the feature maps inside ``module`` (None for softmax attention)."""
    dims = {fm.feature_dim for fm in feature_maps_of(module)}
    if len(dims) > 1:
        raise ValueError(f"the feature maps of this module differ in feature_dim: {sorted(dims)}")
    return dims.pop() if dims else None


def resolve_attention(
    attention: str | Mapping[str, Any], feature_map: str | Mapping[str, Any] | None
) -> tuple[str, str | Mapping[str, Any] | None]:
    """``(kind, feature_map)`` for the encoder from the models' ``attention``/``feature_map`` args.

    ``attention`` is ``"softmax"`` (no map: None), ``"kernel"`` (map from ``feature_map``,
    default ``"elu"``), or a map name / config dict (then ``feature_map`` must be None).
    """
    if isinstance(attention, Mapping) or attention not in ("softmax", "kernel"):
        if not isinstance(attention, str | Mapping):
            raise TypeError(
                "attention must be 'softmax', 'kernel', a feature-map name or a config dict, "
                f"got {type(attention).__name__}"
            )
        if feature_map is not None:
            raise ValueError(
                f"attention={attention!r} already names the feature map; "
                f"do not also pass feature_map={feature_map!r}"
            )
        return "kernel", attention
    if attention == "softmax":
        if feature_map is not None:
            raise ValueError(f"feature_map={feature_map!r} given with attention='softmax'")
        return "softmax", None
    return "kernel", "elu" if feature_map is None else feature_map


def check_positions(positions: object) -> None:
    """Raise unless ``positions`` is a 1-D integer tensor ``(N,)`` (a batch-shaped ``(1, N)``
    gave one row that encodes no position)."""
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
    if positions.dim() != 1:
        raise ValueError(f"positions must be 1-D (N,), got shape {tuple(positions.shape)}")
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise TypeError(f"positions must be an integer tensor, got {positions.dtype}")


def sinusoidal_positions(positions: torch.Tensor, d_model: int) -> torch.Tensor:
    """Vaswani et al. encodings: ``positions (N,)`` long → ``(N, d_model)`` float32 in [-1, 1]."""
    check_positions(positions)
    d_model = check_size("d_model", d_model)
    pos = positions.to(torch.float32)[:, None]
    half = torch.arange(0, d_model, 2, device=positions.device, dtype=torch.float32)
    freq = torch.exp(half * (-math.log(10_000.0) / d_model))
    pe = torch.zeros(positions.shape[0], d_model, device=positions.device, dtype=torch.float32)
    pe[:, 0::2] = torch.sin(pos * freq)
    pe[:, 1::2] = torch.cos(pos * freq)[:, : d_model // 2]
    return pe


class PositionalEncoding(nn.Module):
    """Position vectors ``(N,) → (N, d_model)``: ``"sinusoidal"`` (any length, no parameters),
    ``"learned"`` (one vector per position below ``max_len``) or ``"none"`` (zeros; None
    too, as ``--model-arg positions=none`` reads it)."""

    def __init__(self, d_model: int, max_len: int, kind: str | None = "sinusoidal") -> None:
        super().__init__()
        kind = "none" if kind is None else kind
        if kind not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {kind!r}")
        d_model, max_len = check_size("d_model", d_model), check_size("max_len", max_len)
        self.d_model, self.max_len, self.kind = d_model, max_len, kind
        self.table = nn.Embedding(max_len, d_model) if kind == "learned" else None
        if self.table is not None:
            nn.init.normal_(self.table.weight, std=0.02)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """Encodings of integer ``positions: (N,)`` → ``(N, d_model)`` float."""
        check_positions(positions)
        if self.kind == "sinusoidal":
            return sinusoidal_positions(positions, self.d_model)
        if self.kind == "none":
            return torch.zeros(positions.shape[0], self.d_model, device=positions.device)
        if torch.compiler.is_compiling():  # a check in the graph, without a sync on the GPU
            inside = ((positions >= 0) & (positions < self.max_len)).all()
            message = f"positions must lie in [0, max_len={self.max_len}) of the learned encoding"
            torch._assert_async(inside, message)
        elif positions.numel() and not positions.is_meta:
            low, high = torch.stack(list(positions.aminmax())).tolist()  # one sync
            if low < 0:
                raise ValueError(f"positions must be >= 0, got {low}")
            if high >= self.max_len:
                raise ValueError(
                    f"position {high} is beyond max_len={self.max_len} "
                    "of the learned positional encoding"
                )
        return self.table(positions)

    def extra_repr(self) -> str:
        return f"{self.kind}, d_model={self.d_model}, max_len={self.max_len}"


#: The dtypes token ids may have.
ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_token_ids(
    input_ids: torch.Tensor,
    vocab_size: int,
    name: str = "input_ids",
    device: torch.device | None = None,
) -> None:
    """ValueError naming ``name`` unless ``input_ids`` is a (batch, seq) tensor of ids in
    ``[0, vocab_size)`` of one of ``ID_DTYPES`` (on ``device``, the model's, when given)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else input_ids
        raise ValueError(f"{name} must be a (batch, seq) tensor of token ids, got {shape!r}")
    if input_ids.dtype not in ID_DTYPES:  # torch has no min/max for uint16 and wider
        raise ValueError(
            f"{name} must hold token ids as int64, int32, int16, int8 or uint8, "
            f"got dtype {input_ids.dtype}"
        )
    if device is not None and input_ids.device != device:  # torch's error names neither
        raise ValueError(
            f"{name} is on {input_ids.device}, the model on {device}: move the ids "
            f"({name}.to({str(device)!r})) or the model"
        )
    if torch.compiler.is_compiling():  # a check in the graph, without a sync on the GPU
        inside = ((input_ids >= 0) & (input_ids < vocab_size)).all()
        torch._assert_async(inside, f"{name} must lie in [0, {vocab_size})")
    elif input_ids.numel() and not input_ids.is_meta:  # meta ids hold no values
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{name} must lie in [0, {vocab_size}), got values in [{lo}, {hi}]")


def _check_mask(mask: torch.Tensor | None, input_ids: torch.Tensor, name: str) -> None:
    """A ``(B, N)`` bool mask of ``(B, N)`` ids, True for real tokens: checked as the core
    checks a key padding mask (TypeError for a tensor of another dtype, as there)."""
    if mask is not None:
        check_key_padding_mask(mask, *input_ids.shape, input_ids.device, name=name)


def _padded(
    ids: torch.Tensor, mask: torch.Tensor | None, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B,N)`` ids and mask (None: all real) right-padded to length ``n``."""
    if mask is None:
        mask = torch.ones_like(ids, dtype=torch.bool)
    extra = n - ids.shape[1]
    return torch.nn.functional.pad(ids, (0, extra)), torch.nn.functional.pad(mask, (0, extra))


def _mlp_head(in_dim: int, hidden: int, out_dim: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(in_dim, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, out_dim)
    )


def _plain_numbers(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """A model's constructor ``arguments`` (its ``locals()``) as its config: numpy numbers
    as Python ones (the checks take them), so the config stays JSON-serializable."""
    return {
        name: _plain(value)
        for name, value in arguments.items()
        if name not in ("self", "__class__")
    }


def _plain(value: Any) -> Any:
    """``value`` with numpy numbers as Python ones, also inside dicts, lists and tuples (a
    ``feature_map_kwargs`` or an attention config)."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(item) for item in value)
    if isinstance(value, np.bool_):  # not a numbers.Integral; the checks take it
        return bool(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, float)):
        return float(value)
    return value


#: The model arguments that may hold a map's ``seed``.
_MAP_ARGUMENTS = ("attention", "feature_map", "feature_map_kwargs")


def _seed_drawn(config: Any) -> Any:
    """A map config or kwargs dict whose ``seed`` is a ``torch.Generator`` with an int seed
    drawn from it in its place (as the map itself would draw it): the model's ``config()``
    stays JSON and rebuilds the same maps, and layer i draws with :func:`layer_seed`.
    Anything else is returned as is."""
    if isinstance(config, Mapping) and isinstance(config.get("seed"), torch.Generator):
        return {**config, "seed": resolve_seed(config["seed"])}
    return config


class _SequenceModel(nn.Module):
    """Token embedding (scaled by √d_model) + positions + dropout + a TransformerEncoder."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_heads: int,
        n_layers: int,
        d_ff: int | None,
        dropout: float,
        attention: str | Mapping[str, Any],
        feature_map: str | Mapping[str, Any] | None,
        feature_map_kwargs: Mapping[str, Any] | None,
        positions: str | None,
        max_len: int,
        causal: bool,
        eps: float,
        backend: str | None,
        extra_positions: int = 0,
    ) -> None:
        super().__init__()
        vocab_size = check_size("vocab_size", vocab_size)
        d_model = check_size("d_model", d_model)
        # before max_len + extra_positions: a str failed in the sum, True was read as 1 and
        # 0 with pooling="cls" as 1
        max_len = check_size("max_len", max_len)
        dropout = check_dropout(dropout)
        kind, fmap = resolve_attention(attention, feature_map)
        self.vocab_size, self.d_model = vocab_size, d_model
        self.embed = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.embed.weight, std=d_model**-0.5)
        self.positions = PositionalEncoding(d_model, max_len + extra_positions, positions)
        self.drop = nn.Dropout(dropout)
        self.encoder = TransformerEncoder(
            n_layers,
            d_model,
            n_heads,
            d_ff=d_ff,
            dropout=dropout,
            attention=kind,
            feature_map=fmap,
            feature_map_kwargs=feature_map_kwargs,
            causal=causal,
            eps=eps,
            backend=backend,
        )
        self.attention_kind = kind

    def _check_ids(self, input_ids: torch.Tensor, name: str = "input_ids") -> None:
        """:func:`check_token_ids` against this model's vocabulary and device."""
        check_token_ids(input_ids, self.vocab_size, name, self.embed.weight.device)

    def _embed(self, input_ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        """``(B,N)`` ids → ``(B,N,d_model)`` token + position vectors (positions from ``start``)."""
        pos = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids.long()) * math.sqrt(self.d_model)  # Embedding: int64/int32
        return x + self.positions(pos).to(x.dtype)  # a .half() model stays half

    def parameter_count(self, trainable_only: bool = False) -> int:
        """Number of parameters of the whole model (tied weights once)."""
        return parameter_count(self, trainable_only)

    def feature_map_parameter_count(self, trainable_only: bool = False) -> int:
        """Number of parameters in the feature maps (0 for softmax and parameter-free maps)."""
        return feature_map_parameter_count(self, trainable_only)

    @property
    def feature_dim(self) -> int | None:
        """F per head of the kernel attention (None for softmax attention)."""
        return feature_dim_of(self)

    def regularization(self) -> torch.Tensor:
        """Sum of the feature maps' regularizers (a scalar; 0 when none has one)."""
        return self.encoder.regularization().to(self.embed.weight.device)

    def config(self) -> dict[str, Any]:
        """The constructor arguments (JSON-serializable when the maps are given by name/config)."""
        return copy.deepcopy(self._config)  # never shared with the caller


class SequenceClassifier(_SequenceModel):
    """An LRA classifier: embedding + positions + encoder + mean/CLS pooling + MLP head.

    Args:
        vocab_size, num_classes: token and label counts.
        d_model, n_heads, n_layers, d_ff, dropout: encoder size (``d_ff`` default 4·d_model).
        attention, feature_map, feature_map_kwargs: see :func:`resolve_attention`.
        pooling: ``"mean"`` over real tokens, or ``"cls"`` (a learned vector prepended at
            position 0, read out after the encoder).
        positions: ``"sinusoidal"``, ``"learned"`` or ``"none"``; ``max_len`` bounds learned ones.
        head_dim: hidden width of the MLP head (default ``d_model``).
        eps, backend: linear attention's normalizer guard and core backend, as in
            :class:`TransformerEncoder`.

    ``forward(input_ids (B,N), mask (B,N) | None) → logits (B, num_classes)``.
    """

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        d_model: int = 128,
        n_heads: int = 4,
        n_layers: int = 2,
        d_ff: int | None = None,
        dropout: float = 0.1,
        attention: str | Mapping[str, Any] = "kernel",
        feature_map: str | Mapping[str, Any] | None = None,
        feature_map_kwargs: Mapping[str, Any] | None = None,
        pooling: str = "mean",
        positions: str | None = "sinusoidal",
        max_len: int = 4096,
        head_dim: int | None = None,
        eps: float = 1e-6,
        backend: str | None = None,
    ) -> None:
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        num_classes = check_count("num_classes", num_classes, 2)
        attention, feature_map = _seed_drawn(attention), _seed_drawn(feature_map)
        feature_map_kwargs = _seed_drawn(feature_map_kwargs)
        config = _plain_numbers(locals())
        super().__init__(
            vocab_size=vocab_size,
            d_model=d_model,
            n_heads=n_heads,
            n_layers=n_layers,
            d_ff=d_ff,
            dropout=dropout,
            attention=attention,
            feature_map=feature_map,
            feature_map_kwargs=feature_map_kwargs,
            positions=positions,
            max_len=max_len,
            causal=False,
            eps=eps,
            backend=backend,
            extra_positions=1 if pooling == "cls" else 0,
        )
        self._config = copy.deepcopy(config)
        self.num_classes, self.pooling = num_classes, pooling
        self.cls = nn.Parameter(torch.randn(d_model) * 0.02) if pooling == "cls" else None
        head_dim = d_model if head_dim is None else check_count("head_dim", head_dim, 1)
        self.head = _mlp_head(d_model, head_dim, num_classes, dropout)

    def _check_fits_with_cls(self, input_ids: torch.Tensor, name: str) -> None:
        """ValueError naming ``name`` where ``(B,N)`` ids and the CLS token pass the learned
        positions (the table has max_len + 1 rows for the CLS token: the encoding's own
        error would name that)."""
        n = input_ids.shape[1]
        if self.positions.kind == "learned" and n >= self.positions.max_len:
            raise ValueError(
                f"{name} has {n} tokens, beyond max_len={self.positions.max_len - 1} "
                "of the learned positional encoding"
            )

    def encode(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor | None = None,
        names: tuple[str, str] = ("input_ids", "mask"),
    ) -> torch.Tensor:
        """The pooled sequence vector ``(B, d_model)``; padded positions never enter it. Under
        mean pooling a row without a real token (an empty AAN document, say) pools to 0.

        ``names`` are the argument names that error messages use.
        """
        self._check_ids(input_ids, names[0])
        _check_mask(mask, input_ids, names[1])
        if input_ids.shape[1] == 0 and self.cls is None:  # a mean over nothing is NaN
            raise ValueError(f"{names[0]} must hold at least one token for mean pooling")
        if self.cls is None:
            x = self._embed(input_ids)
        else:
            self._check_fits_with_cls(input_ids, names[0])
            b = input_ids.shape[0]
            first = self.positions(torch.zeros(1, dtype=torch.long, device=self.cls.device))
            cls = self.cls + first.to(self.cls.dtype)  # a bf16/half model stays so
            x = torch.cat([cls.expand(b, 1, -1), self._embed(input_ids, start=1)], dim=1)
            if mask is not None:
                mask = torch.cat([mask.new_ones(b, 1), mask], dim=1)
        h = self.encoder(self.drop(x), key_padding_mask=mask)
        if self.cls is not None:
            return h[:, 0]
        if mask is None:
            return h.mean(1)
        # summed in float32 at least: a float16 sum of 4K tokens overflows to inf; padded
        # positions filled with 0, not multiplied by it (0 · NaN is NaN); a row without a real
        # token pools to 0
        acc = torch.promote_types(h.dtype, torch.float32)
        total = h.to(acc).masked_fill(~mask.unsqueeze(-1), 0).sum(1)
        return (total / mask.sum(1, keepdim=True).clamp_min(1).to(acc)).to(h.dtype)

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Class logits ``(B, num_classes)`` of token ids ``input_ids: (B,N)`` (long);
        ``mask: (B,N)`` bool, True = real token."""
        return self.head(self.encode(input_ids, mask))


class MatchingClassifier(SequenceClassifier):
    """The LRA two-tower model (Retrieval): one shared encoder pools each document to u and v,
    an MLP classifies ``[u, v, u·v, u−v]`` (``4·d_model`` wide), as the PyTorch LRA
    re-implementations do (LRA's released Jax training classifies ``[u, v]`` with two hidden
    layers, ``head_dim`` then ``head_dim/2`` wide: at LRA's sizes a head 0.1% smaller).

    Same arguments as :class:`SequenceClassifier` (default ``num_classes=2``).
    ``forward(input_ids_1, mask_1, input_ids_2, mask_2) → logits (B, num_classes)``, ids
    ``(B,N1)`` and ``(B,N2)``.
    """

    def __init__(self, vocab_size: int, num_classes: int = 2, **kwargs: Any) -> None:
        kwargs = {
            key: _seed_drawn(value) if key in _MAP_ARGUMENTS else value
            for key, value in kwargs.items()
        }
        super().__init__(vocab_size, num_classes, **kwargs)
        self._config = copy.deepcopy(
            _plain_numbers({"vocab_size": vocab_size, "num_classes": num_classes, **kwargs})
        )
        dropout = self.head[2].p
        hidden = self.head[0].out_features
        self.head = _mlp_head(4 * self.d_model, hidden, num_classes, dropout)

    def forward(  # type: ignore[override]
        self,
        input_ids_1: torch.Tensor,
        mask_1: torch.Tensor | None = None,
        input_ids_2: torch.Tensor | None = None,
        mask_2: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Class logits ``(B, num_classes)`` of two documents ``input_ids_1: (B,N1)`` and
        ``input_ids_2: (B,N2)`` (long) with their ``(B,N)`` bool masks."""
        if input_ids_2 is None:
            raise ValueError("input_ids_2 is required: the matching model compares two documents")
        self._check_ids(input_ids_1, "input_ids_1")
        self._check_ids(input_ids_2, "input_ids_2")
        if input_ids_1.shape[0] != input_ids_2.shape[0]:
            raise ValueError(
                f"input_ids_1 and input_ids_2 must have the same batch size, got "
                f"{input_ids_1.shape[0]} and {input_ids_2.shape[0]}"
            )
        _check_mask(mask_1, input_ids_1, "mask_1")
        _check_mask(mask_2, input_ids_2, "mask_2")
        for name, ids in (("input_ids_1", input_ids_1), ("input_ids_2", input_ids_2)):
            if ids.shape[1] == 0 and self.cls is None:  # its mean would be a silent 0
                raise ValueError(f"{name} must hold at least one token for mean pooling")
            if self.cls is not None:
                self._check_fits_with_cls(ids, name)
        # One encoder pass over both documents (padded to one length): one draw of a
        # redrawing random map per forward, as one shared encoder should see.
        if input_ids_1.shape == input_ids_2.shape and (mask_1 is None) == (mask_2 is None):
            ids = torch.cat([input_ids_1, input_ids_2])
            mask = None if mask_1 is None else torch.cat([mask_1, mask_2])
        else:
            n = max(input_ids_1.shape[1], input_ids_2.shape[1])
            pairs = [_padded(i, m, n) for i, m in ((input_ids_1, mask_1), (input_ids_2, mask_2))]
            ids, mask = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
        pooled = self.encode(ids, mask)
        # slices, not chunk(2): with a symbolic batch B, chunk's (2B + B - 1) // B == 2 is a
        # guard torch.export cannot prove, so the batch could not be exported dynamic
        u, v = pooled[: input_ids_1.shape[0]], pooled[input_ids_1.shape[0] :]
        return self.head(torch.cat([u, v, u * v, u - v], dim=-1))


@dataclass(frozen=True)
class LMState:
    """Generation state of :class:`CausalLM`: the next position and each layer's state."""

    position: int
    layers: list[LayerState]


class CausalLM(_SequenceModel):
    """A causal language model: embedding + positions + causal encoder + output head.

    Args: ``vocab_size``, the encoder's sizes, ``attention``/``feature_map``/
    ``feature_map_kwargs`` and ``positions``/``max_len`` as in :class:`SequenceClassifier`
    (no classes, pooling or MLP head), plus ``tie_weights`` (the output head reuses the
    embedding matrix, no bias).

    ``forward(input_ids (B,N), mask (B,N) | None) → logits (B,N,vocab_size)``, the
    prediction of token ``t+1`` at position ``t``. :meth:`step` runs one token with
    constant memory for kernel attention (recurrent state) and a KV cache for softmax.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 128,
        n_heads: int = 4,
        n_layers: int = 2,
        d_ff: int | None = None,
        dropout: float = 0.1,
        attention: str | Mapping[str, Any] = "kernel",
        feature_map: str | Mapping[str, Any] | None = None,
        feature_map_kwargs: Mapping[str, Any] | None = None,
        positions: str | None = "sinusoidal",
        max_len: int = 4096,
        tie_weights: bool = False,
        eps: float = 1e-6,
        backend: str | None = None,
    ) -> None:
        tie_weights = check_flag("tie_weights", tie_weights)
        attention, feature_map = _seed_drawn(attention), _seed_drawn(feature_map)
        feature_map_kwargs = _seed_drawn(feature_map_kwargs)
        config = _plain_numbers(locals())
        super().__init__(
            vocab_size=vocab_size,
            d_model=d_model,
            n_heads=n_heads,
            n_layers=n_layers,
            d_ff=d_ff,
            dropout=dropout,
            attention=attention,
            feature_map=feature_map,
            feature_map_kwargs=feature_map_kwargs,
            positions=positions,
            max_len=max_len,
            causal=True,
            eps=eps,
            backend=backend,
        )
        self._config = copy.deepcopy(config)
        self.head = nn.Linear(d_model, vocab_size, bias=not tie_weights)
        if tie_weights:
            self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits ``(B,N,vocab_size)`` of ``input_ids: (B,N)`` (long);
        ``mask: (B,N)`` bool, True = real token."""
        self._check_ids(input_ids)
        _check_mask(mask, input_ids, "mask")
        h = self.encoder(self.drop(self._embed(input_ids)), key_padding_mask=mask)
        return self.head(h)

    def step(
        self, token: torch.Tensor, state: LMState | None = None
    ) -> tuple[torch.Tensor, LMState]:
        """Feed one token per sequence, ``token: (B,)`` long → next-token logits ``(B, vocab)``."""
        if not isinstance(token, torch.Tensor) or token.dim() != 1:
            shape = tuple(token.shape) if isinstance(token, torch.Tensor) else token
            raise ValueError(f"token must be a (batch,) tensor of ids, got {shape!r}")
        self._check_ids(token[:, None], "token")
        self._check_state(state)
        return self._step(token, state)

    def steps(
        self, tokens: torch.Tensor, state: LMState | None = None
    ) -> tuple[torch.Tensor, LMState]:
        """:meth:`step` through a block of tokens at once (a prompt read in parallel, or a
        long text in segments): ``tokens: (B,N)`` long → next-token logits ``(B,N,vocab)``
        and the state after the block. From None the logits are :meth:`forward`'s."""
        self._check_ids(tokens, "tokens")
        self._check_state(state)
        return self._steps(tokens, state)

    def _steps(self, tokens: torch.Tensor, state: LMState | None) -> tuple[torch.Tensor, LMState]:
        """:meth:`steps` on checked ids."""
        start = 0 if state is None else state.position
        x = self.drop(self._embed(tokens, start=start))
        h, layers = self.encoder.steps(x, None if state is None else state.layers)
        return self.head(h), LMState(start + tokens.shape[1], layers)

    @staticmethod
    def _check_state(state: object) -> None:
        if state is not None and not isinstance(state, LMState):
            raise TypeError(
                f"state must be None or the LMState of an earlier step, got {type(state).__name__}"
            )

    def _step(self, token: torch.Tensor, state: LMState | None) -> tuple[torch.Tensor, LMState]:
        """:meth:`step` on checked ids (no host sync to check them)."""
        start = 0 if state is None else state.position
        x = self.drop(self._embed(token[:, None], start=start)[:, 0])
        h, layers = self.encoder.step(x, None if state is None else state.layers)
        return self.head(h), LMState(start + 1, layers)

    @torch.no_grad()
    def generate(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        mask: torch.Tensor | None = None,
        pad_id: int = 0,
        eos_id: int | None = None,
    ) -> torch.Tensor:
        """Continue ``prompt (B,P)`` by ``max_new_tokens`` tokens: the part of the prompt that
        every row holds is read in one parallel pass (:meth:`steps`), the rest with :meth:`step`.

        ``temperature`` 0 is greedy (argmax); > 0 samples from ``softmax(logits / T)``.
        Runs in eval mode (each submodule's previous mode is restored). Returns
        ``(B, P + max_new_tokens)`` int64 token ids. ``eos_id``: a row ends at the first new
        token equal to it (kept), and is filled with ``pad_id`` after it; generation stops
        once every row has ended.

        Prompts of different lengths: ``mask (B,P)`` bool, True = real token, each row's
        real tokens first (right padding, as :meth:`forward` takes it; at least one per
        row). Row ``b`` of the result holds its ``L_b = mask[b].sum()`` prompt tokens, its
        ``max_new_tokens`` new ones, then ``pad_id`` up to ``P + max_new_tokens``. All rows
        step together, one position per step: a row whose prompt has ended feeds back its
        own new tokens while longer prompts are still read, so every row sees exactly the
        positions it would see alone (greedy decoding gives its lone result, up to float
        rounding of the batch). Without ``mask`` every prompt token is real.

        The model reads ``max L_b + max_new_tokens - 1`` positions (the last token is not
        fed back; none for ``max_new_tokens = 0``, which returns the prompt); learned
        positions need that many below ``max_len`` (checked before any step).
        """
        self._check_ids(prompt, "prompt")
        if prompt.shape[1] < 1:
            raise ValueError("prompt must hold at least one token per sequence")
        max_new_tokens = check_count("max_new_tokens", max_new_tokens, 0)
        temperature = check_real("temperature", temperature)
        pad_id = check_count("pad_id", pad_id, 0, self.vocab_size - 1)
        if eos_id is not None:
            eos_id = check_count("eos_id", eos_id, 0, self.vocab_size - 1)
        lengths = _prompt_lengths(mask, prompt)
        longest = int(lengths.max()) if prompt.shape[0] else prompt.shape[1]
        # the last token is not fed back; with no new token nothing is read at all
        read = longest + max_new_tokens - 1 if max_new_tokens else 0
        if self.positions.kind == "learned" and read > self.positions.max_len:
            raise ValueError(
                f"prompt length {longest} + max_new_tokens {max_new_tokens} needs "
                f"{read} positions, beyond max_len={self.positions.max_len} of the learned "
                "positional encoding"
            )
        with module_mode(self, False):
            return self._generate(
                prompt, lengths, max_new_tokens, temperature, generator, pad_id, eos_id
            )

    def _generate(
        self,
        prompt: torch.Tensor,
        lengths: torch.Tensor,
        max_new_tokens: int,
        temperature: float,
        generator: torch.Generator | None,
        pad_id: int,
        eos_id: int | None,
    ) -> torch.Tensor:
        """:meth:`generate` on checked arguments, in eval mode, without autograd."""
        b, p = prompt.shape
        positions = torch.arange(p, device=prompt.device)
        real = positions < lengths[:, None]
        out = torch.full((b, p + max_new_tokens), pad_id, device=prompt.device)  # int64
        out[:, :p] = torch.where(real, prompt.long(), pad_id)
        if max_new_tokens == 0 or b == 0:
            return out
        shortest, longest = int(lengths.min()), int(lengths.max())
        # the prompt that every row holds, read in one parallel pass: logits of its last
        # position and the states after it
        logits, state = self._steps(prompt[:, :shortest], None)
        logits, token = logits[:, -1], None
        ended = torch.zeros(b, dtype=torch.bool, device=prompt.device)  # an eos was written
        for t in range(shortest - 1, longest + max_new_tokens - 1):  # predicts t + 1
            if t >= shortest:  # feeds position t (ids checked or drawn in range)
                logits, state = self._step(token, state)
            if temperature == 0.0:
                new = logits.argmax(-1)
            else:
                # shifted, in float64 (every positive Python float is one there: in float32 a
                # temperature below 1.4e-45 was 0, and 0/0 NaN): 0 and -inf, not inf
                z = logits.double()
                probs = torch.softmax((z - z.amax(-1, keepdim=True)) / temperature, dim=-1)
                new = torch.multinomial(probs, 1, generator=generator)[:, 0]
            written = (t + 1 >= lengths) & (t + 1 < lengths + max_new_tokens) & ~ended
            out[:, t + 1] = torch.where(written, new, out[:, t + 1])
            token = torch.where(t + 1 < lengths, prompt[:, min(t + 1, p - 1)].long(), new)
            if eos_id is not None:
                ended |= written & (new == eos_id)
                if bool(ended.all()):  # a host sync per step, only with eos_id
                    break
        return out


def _prompt_lengths(mask: torch.Tensor | None, prompt: torch.Tensor) -> torch.Tensor:
    """The real length of each prompt row, ``(B,)`` long, from a right-padded ``mask``."""
    if mask is None:
        return torch.full((prompt.shape[0],), prompt.shape[1], device=prompt.device)
    _check_mask(mask, prompt, "mask")
    if mask.device != prompt.device:
        raise ValueError(f"mask must be on the prompt's device {prompt.device}, got {mask.device}")
    lengths = mask.sum(1)
    prefix = torch.arange(prompt.shape[1], device=mask.device) < lengths[:, None]
    if not torch.equal(mask, prefix):
        raise ValueError(
            "mask must hold each prompt's real tokens first (right padding: True then False)"
        )
    if prompt.shape[0] and int(lengths.min()) < 1:
        raise ValueError("mask must mark at least one real token in every prompt row")
    return lengths
