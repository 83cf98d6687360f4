"""Attention with a feature map, on raw queries, keys and values."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any

import torch

from ..core.attention import linear_attention
from ..core.backends import check_backend_name, env_backend_name
from ..core.exp_range import exp_shift, shift_setting
from ..core.recurrent import RecurrentState
from ..core.transforms import checked_in_graph, host_reads_allowed
from ..core.validation import (
    accumulation_dtype,
    autocast_off,
    check_eps,
    check_key_padding_mask,
    check_qkv,
)
from ..feature_maps import FeatureMap, create_feature_map

#: e^SPARE of room kept for sums over features, keys and values (:func:`capped_factors`,
#: :func:`check_products_fit`).
SPARE = 18.0


def resolve_feature_map(
    feature_map: str | Mapping[str, Any] | FeatureMap,
    head_dim: int,
    num_heads: int = 1,
    kwargs: Mapping[str, Any] | None = None,
) -> FeatureMap:
    """A FeatureMap from a map, a registered name or a config dict (updated by ``kwargs``,
    hyperparameters other than ``head_dim`` and ``num_heads``), for ``head_dim``.

    A config's ``num_heads`` is replaced by ``num_heads`` (the layer decides how many
    heads there are; a map with per-head weights gets one set per head of the layer).
    A FeatureMap instance must have been built for 1 or ``num_heads`` heads."""
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(
            f"feature_map_kwargs must be a mapping of hyperparameters, got {type(kwargs).__name__}"
        )
    kwargs = dict(kwargs or {})
    if isinstance(feature_map, FeatureMap):
        if kwargs:
            raise ValueError("feature_map kwargs given alongside a FeatureMap instance")
        if feature_map.head_dim != head_dim:
            raise ValueError(
                f"feature_map has head_dim={feature_map.head_dim}, but the queries have "
                f"head dimension {head_dim}"
            )
        if feature_map.num_heads not in (1, num_heads):
            raise ValueError(
                f"feature_map was built for num_heads={feature_map.num_heads}, but the "
                f"attention has {num_heads} heads"
            )
        return feature_map
    clash = sorted({"head_dim", "num_heads"} & set(kwargs))
    if clash:
        raise ValueError(
            f"feature_map kwargs may not set {', '.join(clash)}: the attention sets them "
            f"(head_dim={head_dim}, num_heads={num_heads})"
        )
    if isinstance(feature_map, Mapping):
        config = {**feature_map, **kwargs}
        config.setdefault("head_dim", head_dim)
        config["num_heads"] = num_heads
        if config["head_dim"] != head_dim:
            raise ValueError(
                f"feature_map config has head_dim={config['head_dim']}, expected {head_dim}"
            )
        return create_feature_map(config)
    if isinstance(feature_map, str):
        return create_feature_map(feature_map, head_dim=head_dim, num_heads=num_heads, **kwargs)
    raise TypeError(
        "feature_map must be a FeatureMap, a registered name or a config dict, "
        f"got {type(feature_map).__name__}"
    )


def kernel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: str | Mapping[str, Any] | FeatureMap,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = 1e-6,
    backend: str | None = None,
) -> torch.Tensor:
    """Linear attention ``φ(q)·Σ φ(k) vᵀ / φ(q)·Σ φ(k)`` with the given feature map.

    ``q: (B,H,N,D)``, ``k: (B,H,S,D)``, ``v: (B,H,S,M)`` → ``(B,H,N,M)``.
    Padded keys are zeroed before the map sees them, and a map that stabilizes keys
    per sequence (``keys_need_sequence``) takes its shift over the real keys only
    (:func:`padded_key_features`): the output equals that of the real keys alone,
    whatever the padding holds. Causal, such a map normalizes each row at the shift of
    its own prefix (:func:`causal_key_features`), as a
    :class:`~kernelstudy.core.RecurrentState` stepping the keys does: a later key does not
    change how much ``eps`` weighs in an earlier row. A map with ``stabilize=False``
    raises ValueError where φ(q)·φ(k) would overflow (:func:`check_products_fit`).

    float16 inputs are mapped and attended in float32 (with autocast off) and the output
    cast back: the gradient with respect to a feature grows as 1/normalizer and
    overflows float16 (to inf, then NaN through the map) where float32's stays small.
    bfloat16 keeps its dtype (float32's range). The built-in maps with weights compute
    their features in at least float32 with autocast off; under autocast, a user's map
    with linear layers may return features in the autocast dtype: they are cast to ``v``'s
    dtype. Call ``backward()`` outside the autocast region, as PyTorch advises: the core's
    sums recompute their backward with autocast off, the maps' backward does not (inside a
    float16 region with a loss scale of 2**16, FAVOR+'s and the GLU maps' key gradients
    overflow; inside bfloat16 they are about 1e-2 off).
    """
    check_qkv(q, k, v, names=("q", "k", "v"), causal=causal)
    dtype = q.dtype
    q, k, v, context = float16_in_float32(q, k, v)
    # the core's own checks, before the map's forward (a typo cost a forward of the map)
    check_eps(eps, v.dtype)  # the features are cast to v's dtype
    if backend is None:
        env_backend_name()  # KERNELSTUDY_BACKEND, checked
    else:
        check_backend_name(backend)
    fm = resolve_feature_map(feature_map, q.shape[-1], q.shape[1])
    if not isinstance(feature_map, FeatureMap):  # built here: on the inputs' device
        fm = fm.to(q.device)
    mask = None
    if key_padding_mask is not None:
        mask = check_key_padding_mask(key_padding_mask, k.shape[0], k.shape[2], k.device)
    with context:
        if causal and fm.keys_need_sequence and k.shape[-2] > 0:
            phi_q, phi_k, factors, capped = causal_features(fm, q, k, mask)
            # one sync, none in compile or vmap; M = 0 has nothing to read (its state can't be)
            if v.shape[-1] > 0 and host_reads_allowed(capped) and bool(capped):
                return causal_in_segments(fm, phi_q, k, v, mask, eps, backend).to(dtype)
            phi_q = _rows_times_exp(phi_q, factors)
        else:
            phi_q, phi_k = query_and_key_features(fm, q, k, mask, causal)
    phi_q, phi_k = phi_q.to(v.dtype), phi_k.to(v.dtype)
    out = linear_attention(
        phi_q, phi_k, v, causal=causal, key_padding_mask=key_padding_mask, eps=eps, backend=backend
    )
    return out.to(dtype)


def float16_in_float32(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, contextlib.AbstractContextManager]:
    """float16 ``q, k, v`` in float32, with a context that turns autocast off for mapping
    them (other dtypes as they are, with a context that does nothing): a map's float16
    features and their gradients overflow, and float16's exponent range is narrower."""
    if q.dtype != torch.float16:
        return q, k, v, contextlib.nullcontext()
    q, k, v = q.float(), k.float(), v.float()
    return q, k, v, autocast_off(q)


def query_and_key_features(
    fm: FeatureMap,
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(φ(q), φ(k))`` as :func:`kernel_attention` hands them to the core: padded keys
    (``mask: (B,S)``, True = real, or None) as :func:`padded_key_features` maps them, and,
    causal with a per-sequence key stabilizer, each query row scaled to its prefix's shift
    (:func:`causal_features`; capped rows keep part of ``eps``, where
    :func:`kernel_attention` reads the sequence in segments instead)."""
    if causal and fm.keys_need_sequence and k.shape[-2] > 0:
        phi_q, phi_k, factors, _ = causal_features(fm, q, k, mask)
        return _rows_times_exp(phi_q, factors), phi_k
    phi_q = fm(q, is_query=True)
    phi_k = fm(k, is_query=False) if mask is None else padded_key_features(fm, k, mask)
    check_products_fit(fm, phi_q, phi_k)
    return phi_q, phi_k


def check_products_fit(fm: FeatureMap, phi_q: torch.Tensor, phi_k: torch.Tensor) -> None:
    """ValueError where the largest |φ(q)|·|φ(k)| of ``(B,H,N,F)``, ``(B,H,S,F)`` comes
    within e^SPARE of the largest value of the dtype they are summed in (float32 for half
    precision; non-finite features aside): sums of such products over features, keys and
    values would overflow to inf and NaN attention. Only for maps whose user turned their
    exponent shift off (``stabilize=False``; the shift keeps every product below e^40):
    other maps return at once. A stepping layer passes its state's key sum ``Z`` as
    ``phi_k``. Syncs."""
    if fm.hparams.get("stabilize") is not False or not phi_q.numel() or not phi_k.numel():
        return
    acc = accumulation_dtype(phi_q.dtype)  # half-precision features are summed in float32
    limit = math.log(torch.finfo(acc).max) - SPARE
    if checked_in_graph(  # compile: in the graph, without a sync on the GPU; vmap: a warning
        lambda: _log_largest_product(phi_q, phi_k) <= limit,
        f"feature map {fm.name!r} with stabilize=False: φ(q)·φ(k) beyond e^{limit:.1f}, "
        f"where sums over features and keys overflow {acc}; pass stabilize=True",
        f"feature map {fm.name!r}'s check of φ(q)·φ(k) against {acc}'s range (stabilize=False)",
        phi_q,
        phi_k,
    ):
        return
    log_top = float(_log_largest_product(phi_q, phi_k))
    if log_top > limit:
        raise ValueError(
            f"feature map {fm.name!r} with stabilize=False: φ(q)·φ(k) reaches e^{log_top:.1f}, "
            f"beyond e^{limit:.1f}, where sums over features and keys overflow "
            f"{acc}; pass stabilize=True (normalized attention is unchanged), "
            "smaller inputs or float64"
        )


def _log_largest_product(phi_q: torch.Tensor, phi_k: torch.Tensor) -> torch.Tensor:
    """log of the largest |φ(q)|·|φ(k)| within a (batch, head): (B,H,N,F), (B,H,S,F) → a
    float64 scalar; non-finite features are left out (:func:`_largest_finite_abs`)."""
    with torch.no_grad():
        tops = _largest_finite_abs(((phi_q, (-2, -1)), (phi_k, (-2, -1))))  # (B,H) each
        return (tops[0].double().log() + tops[1].double().log()).amax()


def _largest_finite_abs(
    pairs: tuple[tuple[torch.Tensor, tuple[int, ...]], ...],
) -> list[torch.Tensor]:
    """max |x| over ``dims`` for each ``(x, dims)``, non-finite entries left out. Reduced
    without a copy of ``x`` where every result is finite (one sync to tell); else, and
    where the host may not read values (compile, vmap), through :func:`_finite_abs`,
    whose copies of a FAVOR+ map's φ(q) and φ(k) cost 9-12% of a causal training step."""
    # aminmax: slower than the two reductions
    tops = [torch.maximum(-x.detach().amin(dims), x.detach().amax(dims)) for x, dims in pairs]
    if host_reads_allowed(*(x for x, _ in pairs)):
        if bool(torch.stack([t.isfinite().all() for t in tops]).all()):
            return tops
    return [_finite_abs(x).amax(dims) for x, dims in pairs]


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    """``|x|`` with non-finite entries as 0 (they set no bound)."""
    return x.detach().abs().nan_to_num(0.0, 0.0, 0.0)


def padded_key_features(fm: FeatureMap, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """φ(k) of keys ``(B,H,S,D)`` with padding ``mask: (B,S)`` (True = real key): padded
    keys are zeroed first (NaN or inf there reach nothing). A map with a per-sequence key
    stabilizer gets it over the real keys only, from :meth:`FeatureMap.key_features`
    (each key's φ̂ and log scale): φ = φ̂·exp(log_scale − c) with c the
    :func:`~kernelstudy.core.exp_shift` of the largest real log scale, so padding can
    neither lift nor lower the shift. Padded rows of the result are 0 for such maps
    (the core masks them out anyway)."""
    real = mask[:, None, :]  # (B,1,S)
    k = k.masked_fill(~real[..., None], 0.0)
    if not fm.keys_need_sequence or k.shape[-2] == 0:
        return fm(k, is_query=False)
    phi_hat, log_scale = fm.key_features(k)  # (B,H,S,F), (B,H,S)
    top = log_scale.detach().masked_fill(~real, -torch.inf).amax(-1, keepdim=True)
    shift = exp_shift(top, k.dtype)  # 0 for a sequence without real keys (top = -inf)
    return _keys_at_shift(phi_hat, log_scale, shift, real, k.dtype)


def _keys_at_shift(
    phi_hat: torch.Tensor,
    log_scale: torch.Tensor,
    shift: torch.Tensor,
    real: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """φ = φ̂·exp(log_scale − shift) in ``dtype``, 0 where ``real: (B,1,S)`` is False."""
    scale = torch.exp((log_scale - shift).masked_fill(~real, -torch.inf))
    promoted = torch.promote_types(phi_hat.dtype, scale.dtype)
    return (phi_hat.to(promoted) * scale[..., None].to(promoted)).to(dtype)


def real_key_features(
    fm: FeatureMap, k: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(φ̂: (B,H,S,F), log_scale: (B,H,S), logs, real: (B,1,S))`` of keys ``(B,H,S,D)``
    with padded keys (``mask: (B,S)``, True = real; None: all real) zeroed first: the map's
    :meth:`~kernelstudy.feature_maps.FeatureMap.key_features`, and ``logs``, the detached
    log scales that set shifts: −inf for padded keys, NaN ones and +inf ones (a non-finite
    input, or an exponent that overflowed, neither sets the shift nor reaches rows before
    it)."""
    if mask is None:
        mask = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)
    real = mask[:, None, :]  # (B,1,S)
    k = k.masked_fill(~real[..., None], 0.0)
    phi_hat, log_scale = fm.key_features(k)  # (B,H,S,F), (B,H,S)
    logs = shift_setting(log_scale.detach()).masked_fill(~real, -torch.inf)
    return phi_hat, log_scale, logs, real


def causal_key_features(
    fm: FeatureMap, k: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys for causal attention with a map that shifts keys per sequence: ``(φ(k):
    (B,H,S,F), log_factor: (B,H,S))``.

    φ(k) is taken at the shift c of the sequence's real keys, as
    :func:`padded_key_features` does (``mask: (B,S)``, True = real; None: all real).
    Row t's query features are to be multiplied by ``exp(log_factor_t) = exp(c − c_t)``
    (:func:`causal_features`), c_t the shift of the real keys up to t: numerator and
    normalizer of row t then equal those at c_t, so ``eps`` weighs in it as in the
    :class:`~kernelstudy.core.RecurrentState` that steps the keys, whatever later keys
    hold."""
    phi_hat, log_scale, logs, real = real_key_features(fm, k, mask)
    prefix = exp_shift(logs.cummax(-1).values, k.dtype)  # c_t: non-decreasing in t
    shift = exp_shift(logs.amax(-1, keepdim=True), k.dtype)  # c (0 without real keys)
    phi_k = _keys_at_shift(phi_hat, log_scale, shift, real, k.dtype)
    # rows before the first real key have no keys (c_t = 0): their factor is moot
    return phi_k, (shift - prefix).clamp_min(0.0)


def causal_features(
    fm: FeatureMap, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal attention's features for a map that shifts keys per sequence: ``(φ(q):
    (B,H,N,F), φ(k): (B,H,S,F), log factors: (B,H,N), capped)``. φ(k) is at the sequence's
    shift (:func:`causal_key_features`); row t of φ(q) is to be multiplied by ``exp`` of its
    log factor (to its prefix's shift), capped (:func:`capped_factors`) so that no product
    of the row with a feature of φ(k) (later keys included: a chunk multiplies them before
    masking) comes within e^SPARE of the dtype's largest value. ``capped`` (a bool scalar
    tensor): whether some row's factor was, so that it keeps part of ``eps`` (its prefix
    lies about e^50 below the sequence's largest key in float32)."""
    phi_q = fm(q, is_query=True)
    phi_k, log_factor = causal_key_features(fm, k, mask)
    factors, capped = capped_factors(phi_q, log_factor, phi_k)
    return phi_q, phi_k, factors, capped


def capped_factors(
    phi_q: torch.Tensor, log_factor: torch.Tensor, phi_k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log factors: (B,H,N), capped: a bool scalar tensor)``: each row's ``log_factor``
    capped at the largest that keeps its products with ``phi_k: (B,H,S,F)`` e^SPARE below
    the largest value of ``phi_q``'s dtype, in the promoted dtype of ``phi_q`` and
    ``log_factor``, and whether any row was capped. No gradient."""
    dtype = torch.promote_types(phi_q.dtype, log_factor.dtype)
    top = math.log(torch.finfo(phi_q.dtype).max) - SPARE
    with torch.no_grad():
        q_top, k_top = _largest_finite_abs(((phi_q, (-1,)), (phi_k, (-2, -1))))
        q_max = q_top.to(dtype).clamp_min(1e-30).log()  # (B,H,N)
        k_max = k_top.to(dtype).clamp_min(1e-30).log()  # (B,H)
        cap = (top - q_max - k_max[..., None]).clamp(0.0, top)
        log_factor = log_factor.to(dtype)
        return torch.minimum(log_factor, cap), (log_factor > cap).any()


def _rows_times_exp(phi_q: torch.Tensor, log_factors: torch.Tensor) -> torch.Tensor:
    """``phi_q: (B,H,N,F)`` with row t times ``exp(log_factors[..., t])``, in its dtype."""
    dtype = log_factors.dtype
    return (phi_q.to(dtype) * log_factors.exp()[..., None]).to(phi_q.dtype)


def causal_in_segments(
    fm: FeatureMap,
    phi_q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    eps: float,
    backend: str | None,
) -> torch.Tensor:
    """Causal attention ``(B,H,N,M)`` of query features ``phi_q: (B,H,N,F)`` (unscaled),
    keys ``k: (B,H,N,D)`` of a map that shifts keys per sequence, ``v: (B,H,N,M)`` and
    padding ``mask: (B,N)`` (or None), by a scaled :class:`~kernelstudy.core.RecurrentState`
    reading the sequence in blocks (:meth:`~kernelstudy.core.RecurrentState.steps`): each
    row at its own prefix's shift, as :func:`kernel_attention` normalizes causal rows, where
    a later key lies so far above earlier ones that one shift for the whole sequence would
    make the earlier keys underflow (and :func:`capped_factors` cap their rows)."""
    phi_hat, log_scale, _, real = real_key_features(fm, k, mask)
    # the live log scales (gradients reach the keys through them), none from padding; the
    # state leaves NaN and +inf ones out of its shifts (they reach rows from theirs on)
    logs = log_scale.masked_fill(~real, -torch.inf)
    b, h, _, f = phi_q.shape
    sums = torch.float64 if v.dtype == torch.float64 else torch.float32
    state = RecurrentState.zeros(b, h, f, v.shape[-1], sums, v.device, eps, scaled=True)
    phi_q, phi_hat = phi_q.to(v.dtype), phi_hat.to(v.dtype)
    return state.steps(phi_q, phi_hat, v, logs, key_padding_mask=mask, backend=backend)[0]
