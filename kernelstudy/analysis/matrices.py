"""Explicit N×S attention matrices for analysis sizes: softmax, kernel, uniform.

Everything here materializes the full matrix, so sizes are capped by ``max_n``;
the fast paths live in the core. Inputs follow the core's conventions:
``q: (B,H,N,D)``, ``k: (B,H,S,D)``, ``key_padding_mask: (B,S)`` bool (True = real key).
Padded keys get weight 0. The rows of padded queries are kept (they attend to the real keys
like any query) unless a ``query_padding_mask: (B,N)`` (True = real query,
:func:`check_query_padding_mask`) is given: :func:`attention_matrix` then zeroes them, and
the analyses that average over rows leave them out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..arguments import check_count, check_flag, check_real
from ..core.exp_range import exp_shift
from ..core.validation import accumulation_dtype, autocast_off, check_key_padding_mask, check_tensor
from ..feature_maps import FeatureMap, RandomFeatureMap
from ..feature_maps.softmax_kernel import softmax_kernel as exact_softmax_kernel
from ..nn.functional import query_and_key_features, real_key_features, resolve_feature_map

MAX_N = 4096
SOFTMAX = "softmax"
UNIFORM = "uniform"

MapSpec = str | Mapping[str, Any] | FeatureMap | None


def check_qk(q: torch.Tensor, k: torch.Tensor, names: tuple[str, str] = ("q", "k")) -> None:
    """Check ``q: (B,H,N,D)`` and ``k: (B,H,S,D)`` agree in batch, heads, dim, dtype and device."""
    nq, nk = names
    check_tensor(q, nq, 4)
    check_tensor(k, nk, 4)
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"{nq} (B,H,N,D) and {nk} (B,H,S,D) must agree in B, H and D, got shapes "
            f"{tuple(q.shape)} and {tuple(k.shape)}"
        )
    if q.shape[-1] == 0:  # 1/√D: an all-NaN matrix
        raise ValueError(f"{nq} and {nk} must have head dimension D >= 1, got D = 0")
    if q.dtype != k.dtype or q.device != k.device:
        raise ValueError(
            f"{nq} and {nk} must share dtype and device, got {q.dtype}/{q.device} and "
            f"{k.dtype}/{k.device}"
        )


def allowed_keys(
    n: int,
    s: int,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    batch: int,
    device: torch.device,
) -> torch.Tensor:
    """``(B|1, 1, N, S)`` bool: which keys each query may attend to."""
    allowed = torch.ones(1, 1, n, s, dtype=torch.bool, device=device)
    if check_flag("causal", causal):
        if n != s:
            raise ValueError(f"causal attention needs N == S, got N={n}, S={s}")
        allowed = allowed.tril()
    if key_padding_mask is not None:
        mask = check_key_padding_mask(key_padding_mask, batch, s, device)
        allowed = allowed & mask[:, None, None, :]
    return allowed


def check_query_padding_mask(
    mask: object, batch: int, n: int, device: torch.device
) -> torch.Tensor:
    """Check a ``(B, N)`` bool mask of the queries, True for real ones; returned on
    ``device`` (as ``key_padding_mask`` is moved there)."""
    return check_key_padding_mask(mask, batch, n, device, name="query_padding_mask")


def softmax_kernel(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The unnormalized softmax kernel ``exp(q·k/√D)``: ``(B,H,N,S)`` (the feature maps'
    :func:`~kernelstudy.feature_maps.softmax_kernel.softmax_kernel`, inputs checked)."""
    check_qk(q, k)
    return exact_softmax_kernel(q, k)


def _as_feature_map(feature_map: MapSpec, q: torch.Tensor) -> FeatureMap:
    return resolve_feature_map(feature_map, q.shape[-1], q.shape[1])


def check_max_n(what: str, n: int, s: int, max_n: int, settable: bool = True) -> None:
    """ValueError naming ``what`` when N or S exceeds ``max_n``: checked before anything of
    N×S is made (the masks too), so that the message, not the allocator's, is what a call
    too large gets. ``settable``: whether ``what`` takes a ``max_n`` (said in the hint)."""
    if max(n, s) > check_count("max_n", max_n, 1):
        hint = (
            "pass a larger max_n if you have the memory"
            if settable
            else f"it caps them at {max_n}: use shorter sequences"
        )
        raise ValueError(
            f"{what} materializes N×S per head; N={n}, S={s} exceeds max_n={max_n} ({hint})"
        )


def attention_matrix(
    q: torch.Tensor,
    k: torch.Tensor,
    feature_map: MapSpec = None,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    max_n: int = MAX_N,
    eps: float = 1e-6,
    query_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The explicit row-normalized attention matrix ``(B,H,N,S)``.

    Args:
        q, k: queries ``(B,H,N,D)`` and keys ``(B,H,S,D)``.
        feature_map: None or ``"softmax"`` for ``softmax(q kᵀ/√D)``; ``"uniform"``
            for ``1/#allowed`` on every allowed key; otherwise a FeatureMap, a
            registered name or a config dict, giving ``φq_i·φk_j / (Σ_j φq_i·φk_j + eps)``
            exactly as the core normalizes it.
        causal: query i sees keys ``j ≤ i`` only (needs N == S).
        key_padding_mask: ``(B,S)`` bool, True for real keys.
        max_n: largest N or S allowed (the matrix is N×S per head).
        eps: the kernel normalizer's guard (kernel maps only; the core's default is
            1e-6; 0 normalizes exactly, leaving rows without mass at zero).
        query_padding_mask: ``(B,N)`` bool, True for real queries: the rows of padded
            queries come out all zero, like rows with no key. None (default): every row is
            computed, padded queries' included (they attend to the real keys).

    Rows with no key to attend to are all zero. Padded keys and padded queries may hold
    anything (NaN and inf included): they are zeroed before any product, so they reach
    no other entry and no gradient. Half-precision inputs are scored and normalized in
    float32 (as the core sums them) and the matrix returned in their dtype.

    Raises:
        ValueError: N or S exceeds ``max_n``, the map name is not registered, causal with
            N != S, or a mask of the wrong shape (named).
        TypeError: a mask that is not a bool tensor (named).
    """
    check_qk(q, k)
    n, s = q.shape[2], k.shape[2]
    eps = check_real("eps", eps)  # the guard of an analysis: 0 is exact
    check_max_n("attention_matrix", n, s, max_n)
    allowed = allowed_keys(n, s, causal, key_padding_mask, q.shape[0], q.device)
    if query_padding_mask is not None:
        real = check_query_padding_mask(query_padding_mask, q.shape[0], n, q.device)
        allowed = allowed & real[:, None, :, None]
        q = q.masked_fill(~real[:, None, :, None], 0.0)  # NaN there reaches nothing
    if feature_map is None or feature_map == SOFTMAX:
        if key_padding_mask is not None:  # garbage there made NaN gradients of q
            k = k.masked_fill(~key_padding_mask.to(k.device)[:, None, :, None], 0.0)
        acc = accumulation_dtype(q.dtype)  # float16 scores overflow at |q·k| > 65504
        with autocast_off(q):
            scores = (q.to(acc) @ k.to(acc).transpose(-1, -2)) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.softmax(scores, dim=-1)  # rows without keys: NaN, zeroed here
        return torch.where(allowed.any(-1, keepdim=True), weights, 0.0).to(q.dtype)
    if feature_map == UNIFORM:
        weights = allowed.to(q.dtype).expand(q.shape[0], q.shape[1], n, s)
        return weights / weights.sum(-1, keepdim=True).clamp_min(1.0)
    scores = kernel_scores(q, k, feature_map, key_padding_mask, causal)  # float32 if half
    return normalize_rows(scores, allowed, eps).to(q.dtype)


def kernel_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    feature_map: MapSpec,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """The unnormalized kernel matrix ``φ(q) φ(k)ᵀ``: ``(B,H,N,S)``, no masking applied
    (but causal rows of a map with a per-sequence key stabilizer, below),
    in float32 for half-precision inputs (a float16 score can pass 65504) and in the
    inputs' dtype otherwise.

    Padded keys are treated as in ``kernel_attention`` (zeroed first; a per-sequence key
    stabilizer sees the real keys only; float16 inputs are mapped in float32); ``causal``
    puts each row of such a map at its own prefix's shift, as ``kernel_attention`` does, so
    the matrix normalizes as the core output, and its entries after the diagonal are 0
    (a later key may lie beyond the row's range). A map whose parameters or buffers have a
    narrower dtype than ``q`` runs on copies cast up to it (``torch.func.functional_call``):
    float64 analysis of a float32 map is exact, and gradients still reach the map's
    parameters. Wider ones are kept, as the core keeps them: bfloat16 inputs meet a float32
    map's own weights (cast down to bfloat16, FAVOR+'s projections moved the kernel 5×
    further from float64's).
    """
    fm = _as_feature_map(feature_map, q)
    if check_flag("causal", causal) and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal attention needs N == S, got N={q.shape[2]}, S={k.shape[2]}")
    mask = None
    if key_padding_mask is not None:
        mask = check_key_padding_mask(key_padding_mask, k.shape[0], k.shape[2], k.device)
    if q.dtype == torch.float16:  # mapped in float32, as kernel_attention maps them
        q, k = q.float(), k.float()
    scores = _KernelScores(fm)

    def narrower(t: torch.Tensor) -> bool:  # exactly representable in q's dtype
        return (
            t.is_floating_point()
            and t.dtype != q.dtype
            and torch.promote_types(t.dtype, q.dtype) == q.dtype
        )

    tensors = [*fm.named_parameters(), *fm.named_buffers()]
    if not any(narrower(t) for _, t in tensors):
        return scores(q, k, mask, causal)
    random = isinstance(fm, RandomFeatureMap)
    if random:  # count the query call, and redraw if due, on the map itself: a redraw inside
        fm.maybe_redraw(True)  # functional_call would land on the copies and be lost
        tensors = [*fm.named_parameters(), *fm.named_buffers()]
    cast = {f"fm.{n}": t.to(q.dtype) if narrower(t) else t for n, t in tensors}
    training = fm.training
    # the copies must not count or redraw again: the map's own flag off (only its own: a
    # submodule's mode, set apart by the caller, came back as the map's)
    fm.training = training and not random
    try:
        return torch.func.functional_call(scores, cast, (q, k, mask, causal))
    finally:
        fm.training = training


class _KernelScores(nn.Module):
    """``φ(q) φ(k)ᵀ`` as a module around the map, so that :func:`kernel_scores` can run it
    on cast parameters with ``functional_call``."""

    def __init__(self, fm: FeatureMap) -> None:
        super().__init__()
        self.fm = fm

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool = False
    ) -> torch.Tensor:
        if causal and self.fm.keys_need_sequence and k.shape[-2] > 0:
            return _causal_scores(self.fm, q, k, mask)
        phi_q, phi_k = query_and_key_features(self.fm, q, k, mask, causal)
        acc = accumulation_dtype(phi_q.dtype)  # each dot product summed in float32
        with autocast_off(phi_q):
            return phi_q.to(acc) @ phi_k.to(acc).transpose(-1, -2)


def _causal_scores(
    fm: FeatureMap, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Causal ``φ(q) φ(k)ᵀ`` ``(B,H,N,N)`` of a map that shifts keys per sequence, row t at
    its own prefix's shift c_t as causal ``kernel_attention`` normalizes it:
    ``φq_t·φ̂k_j·exp(log_scale_j − c_t)`` for j ≤ t (at most e^20 per key: c_t follows the
    largest log scale up to t), 0 after t (later keys may lie beyond the row's range). Exact
    also where a later key lies so far above earlier ones that a single shift would let
    them underflow."""
    phi_q = fm(q, is_query=True)
    phi_hat, log_scale, logs, real = real_key_features(fm, k, mask)
    acc = accumulation_dtype(phi_q.dtype)
    with autocast_off(phi_q):
        prefix = exp_shift(logs.cummax(-1).values, acc).to(acc)  # c_t: (B,H,N)
        n = k.shape[-2]
        later = torch.ones(n, n, dtype=torch.bool, device=k.device).triu(1)  # j > t
        live = log_scale.to(acc).masked_fill(~real | log_scale.detach().isnan(), -torch.inf)
        exponent = (live[..., None, :] - prefix[..., None]).masked_fill(later, -torch.inf)
        scores = (phi_q.to(acc) @ phi_hat.to(acc).transpose(-1, -2)) * exponent.exp()
        return scores.masked_fill(later, 0.0)  # a NaN later key reaches no earlier row


def normalize_rows(scores: torch.Tensor, allowed: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``scores / (Σ_allowed scores + eps)`` on allowed entries, 0 elsewhere (eps 0: exact;
    rows without mass stay zero). Summed in float32 for half-precision scores (a float16
    row sum overflows at a few thousand keys), returned in their dtype."""
    scores_acc = scores.to(accumulation_dtype(scores.dtype)).masked_fill(~allowed, 0.0)
    total = scores_acc.sum(-1, keepdim=True) + eps
    if eps == 0:
        total = torch.where(total == 0, torch.ones_like(total), total)
    return (scores_acc / total).to(scores.dtype)
