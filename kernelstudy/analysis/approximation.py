"""How well a feature map's attention approximates softmax attention.

Metrics (all against exact softmax attention, on the entries each measured query may
see, pooled over the whole batch and every head):

- ``kernel_mse``: mean of ``(φq_i·φk_j − exp(q_i·k_j/√D))²`` over those entries, the error
  on the unnormalized softmax kernel; only for maps that estimate a kernel (they have a
  ``kernel`` method), and not while their ``stabilize`` is on (FAVOR's, the polynomial
  map's: it may rescale φ, and must be off for this metric to mean anything).
- ``attention_mse``: mean squared difference of the row-normalized matrices over those
  entries.
- ``attention_kl``: mean over rows (measured queries with at least one key) of
  ``KL(softmax row ‖ kernel row)`` in nats (NaN when a kernel row has negative entries,
  e.g. the identity map).
- ``output_rel_error``: ``‖A_kernel V − A_softmax V‖_F / ‖A_softmax V‖_F`` over the rows of
  the measured queries when v is given (one ratio of norms, not a mean of ratios).

The measured queries are all N rows by default, and the real ones only with a
``query_padding_mask``: a padded batch element then weighs by its real entries, rows or
squared norms, exactly as if each element's unpadded slice were measured on its own and
the sums pooled.

Every table also carries the ``uniform`` baseline (``1/#keys`` per key): a map
whose attention error is above it is worse than no attention at all.
"""

from __future__ import annotations

import math

import pandas as pd
import torch

from ..arguments import check_count, check_flag, check_real
from ..core.validation import check_device, check_tensor, zero_padded_keys
from ..feature_maps import FeatureMap
from ..nn.functional import resolve_feature_map
from ..nn.modes import module_mode
from .matrices import (
    MAX_N,
    MapSpec,
    allowed_keys,
    attention_matrix,
    check_max_n,
    check_qk,
    check_query_padding_mask,
    kernel_scores,
    normalize_rows,
    softmax_kernel,
)
from .speed import check_float_dtype

METRICS = ("kernel_mse", "attention_mse", "attention_kl", "output_rel_error")


def gaussian_qk(
    n: int,
    head_dim: int,
    std: float = 1.0,
    batch: int = 1,
    heads: int = 1,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys with iid ``N(0, std²)`` entries, each ``(batch, heads, n, head_dim)``."""
    n, head_dim, batch, heads = (
        check_count(name, value, 1)
        for name, value in (("n", n), ("head_dim", head_dim), ("batch", batch), ("heads", heads))
    )
    check_real("std", std, strict=True)
    check_float_dtype(dtype)
    device = check_device("device", device)
    gen = torch.Generator().manual_seed(check_count("seed", seed, 0, 2**64 - 1))
    shape = (2, batch, heads, n, head_dim)
    qk = torch.randn(shape, generator=gen, dtype=torch.float64) * std
    qk = qk.to(dtype=dtype, device=device)
    return qk[0], qk[1]


def map_label(feature_map: FeatureMap) -> str:
    """The registry name of a map, or its class name for unregistered maps (a subclass of a
    registered map too: its rows are not the registered map's)."""
    if not isinstance(feature_map, FeatureMap):
        raise TypeError(f"feature_map must be a FeatureMap, got {type(feature_map).__name__}")
    cls = type(feature_map)
    return cls.__dict__.get("name") or cls.__name__


def _masked_mean(x: torch.Tensor, allowed: torch.Tensor) -> float:
    allowed = allowed.expand_as(x)
    return (x.masked_select(allowed)).double().mean().item()


def row_kl(p: torch.Tensor, q: torch.Tensor, tiny: float = 1e-30) -> torch.Tensor:
    """``KL(p_i ‖ q_i)`` per row of non-negative ``(..., N, S)`` matrices, in nats: ``(..., N)``.

    Rows are renormalized to sum to one first (kernel rows sum to 1 − O(eps));
    terms with ``p = 0`` contribute 0, and a row where ``q`` is 0 but ``p`` is not is
    +inf (``q`` misses mass ``p`` has: e.g. relu features with disjoint supports).
    Rows where ``q`` has negative entries are NaN; all-zero rows (queries without keys)
    are 0. ``tiny`` only guards the renormalization of all-zero rows. ``p`` (softmax
    rows) must be non-negative. Where ``p`` and ``q`` agree to within a third, log(p/q) is
    taken as log1p((p − q)/q) (the difference of logs cancelled to ~1e-16 there, and
    rows of nearly equal p and q came out below 0); a sum that still rounds below 0 is 0.
    """
    for name, x in (("p", p), ("q", q)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point torch.Tensor, got {type(x).__name__}")
    tiny = check_real("tiny", tiny, strict=True)  # a NaN one read +inf rows as 0
    if (p < 0).any():
        raise ValueError("p must be non-negative (attention weights)")
    if p.shape != q.shape:
        raise ValueError(
            f"p and q must have the same shape, got {tuple(p.shape)}, {tuple(q.shape)}"
        )
    p, q = p.double(), q.double()
    negative = (q < 0).any(-1)
    p = p / p.sum(-1, keepdim=True).clamp_min(tiny)
    q = q.clamp_min(0.0)
    q = q / q.sum(-1, keepdim=True).clamp_min(tiny)
    # logs of positive entries only: clamping q at tiny logged a weight of 1e-40 as 1e-30,
    # capping each such term at p·69 nats (peaked rows read far too low)
    one = torch.ones((), dtype=p.dtype, device=p.device)
    safe_p, safe_q = torch.where(p > 0, p, one), torch.where(q > 0, q, one)
    near = (safe_p - safe_q) / safe_q  # log1p of it is exact where |near| is small
    log_ratio = torch.where(near.abs() < 1 / 3, torch.log1p(near), safe_p.log() - safe_q.log())
    log_ratio = torch.where(q > 0, log_ratio, math.inf)
    terms = torch.where(p > 0, p * log_ratio, 0.0)
    return terms.sum(-1).clamp_min(0.0).masked_fill(negative, math.nan)


def _attention_metrics(
    a_soft: torch.Tensor,
    a_hat: torch.Tensor,
    measured: torch.Tensor,
    queries: torch.Tensor,
    v: torch.Tensor | None,
    out_soft: torch.Tensor | None,
) -> dict[str, float]:
    """``measured: (B|1,1,N,S)`` the entries measured (keys each measured query sees),
    ``queries: (B|1,1,N)`` the measured queries, ``out_soft`` zero on the other rows."""
    rows_with_keys = measured.any(-1).expand(a_soft.shape[:-1])
    metrics = {
        "attention_mse": _masked_mean((a_hat - a_soft) ** 2, measured),
        "attention_kl": row_kl(a_soft, a_hat)[rows_with_keys].mean().item(),
    }
    if v is not None:
        diff = torch.where(queries[..., None], a_hat @ v - out_soft, 0.0)
        metrics["output_rel_error"] = (
            torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(out_soft)
        ).item()
    return metrics


def approximation_error(
    feature_map: MapSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None = None,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    baseline: bool = True,
    max_n: int = MAX_N,
    eps: float = 0.0,
    query_padding_mask: torch.Tensor | None = None,
) -> pd.DataFrame:
    """Errors of a feature map's attention against exact softmax attention.

    Args:
        feature_map: a FeatureMap, a registered name or a config dict. Measured in eval
            mode (a redrawing map in training mode neither counts the call nor redraws: two
            equal calls measured other features), each module's mode given back.
        q, k: ``(B,H,N,D)``, ``(B,H,S,D)``; computed in float64 for exact metrics.
        v: optional values ``(B,H,S,M)`` for the output error.
        causal, key_padding_mask: which keys each query sees (as in the core;
            ``key_padding_mask: (B,S)`` bool, True = real key).
        baseline: add the ``uniform`` rows.
        max_n: cap on N and S (the matrices are explicit).
        eps: normalizer guard of the kernel attention; 0 (default) measures the map
            itself, 1e-6 reproduces the core's guard.
        query_padding_mask: ``(B,N)`` bool, True = real query: every metric is averaged
            over the real queries' rows only (see the module doc for each metric's
            weights), and padded queries may hold anything (NaN included). None
            (default) measures all N rows: ``key_padding_mask`` alone does not drop any,
            so for a padded self-attention batch pass the same mask as both (the rows
            of padded queries attend to the real keys and would count otherwise). A
            batch element without real queries counts for nothing.

    Raises:
        ValueError: bad shapes or values, or nothing left to measure: no real query
            (``query_padding_mask``), no real query with a key to attend to, or
            (with v) softmax outputs that are all zero on the measured rows.
        TypeError: a mask that is not a bool tensor, a flag that is not a bool.

    Returns:
        Long table, one row per (method, metric): columns ``method`` (map name or
        ``"uniform"``), ``kind`` (``"map"``/``"baseline"``), ``feature_dim`` (F; NA
        for the baseline), ``metric``, ``value``. Metrics: see the module docstring.
    """
    check_qk(q, k)
    eps = check_real("eps", eps)
    if q.shape[0] == 0 or q.shape[1] == 0:  # every metric a mean of nothing: NaN
        raise ValueError(
            f"q has no batch elements or heads (shape {tuple(q.shape)}): nothing to measure"
        )
    fm = resolve_feature_map(feature_map, q.shape[-1], q.shape[1])
    if v is not None:
        check_tensor(v, "v", 4)
        if v.shape[:3] != k.shape[:3] or v.device != k.device:
            raise ValueError(
                f"v must have shape (B,H,S,M) matching k {tuple(k.shape)} on {k.device}, got "
                f"{tuple(v.shape)} on {v.device}"
            )
    n, s = q.shape[2], k.shape[2]
    if n == 0 or s == 0:
        raise ValueError(
            f"{'q' if n == 0 else 'k'} has no positions (shape {tuple((q if n == 0 else k).shape)})"
            ": nothing to measure"
        )
    check_max_n("approximation_error", n, s, max_n)
    allowed = allowed_keys(n, s, causal, key_padding_mask, q.shape[0], q.device)
    if not allowed.any():
        raise ValueError("key_padding_mask leaves no query a key to attend to: nothing to measure")
    queries = torch.ones(1, 1, n, dtype=torch.bool, device=q.device)  # the queries measured
    if query_padding_mask is not None:
        real = check_query_padding_mask(query_padding_mask, q.shape[0], n, q.device)
        if not real.any():
            raise ValueError("query_padding_mask marks no query as real: nothing to measure")
        queries = real[:, None, :]
        if not (allowed & queries[..., None]).any():
            raise ValueError(
                "no real query (query_padding_mask) has a key to attend to (key_padding_mask"
                f"{', causal' if causal else ''}): nothing to measure"
            )
    measured = allowed & queries[..., None]
    # Padded keys and values may hold anything (NaN included): zeroed, as in the core
    # (k stands in for the values when there are none); so are padded queries.
    k64, v64 = zero_padded_keys(k.double(), (k if v is None else v).double(), key_padding_mask)
    v64 = None if v is None else v64
    q64 = torch.where(queries[..., None], q.double(), 0.0)
    for name, t, what in (("q", q64, "queries"), ("k", k64, "keys"), ("v", v64, "keys")):
        if t is not None and not torch.isfinite(t).all():
            raise ValueError(f"{name} holds NaN or inf (outside padded {what})")
    a_soft = attention_matrix(q64, k64, "softmax", causal, key_padding_mask, max_n)
    out_soft = None if v64 is None else torch.where(queries[..., None], a_soft @ v64, 0.0)
    if out_soft is not None and not out_soft.any():
        where = "" if query_padding_mask is None else " on the real queries"
        raise ValueError(
            f"softmax attention of v is all zero{where}: output_rel_error is undefined"
        )
    rows = []
    with torch.no_grad(), module_mode(fm, False):
        # in float64 (exact metrics), rows scaled as causal kernel_attention scales them
        scores = kernel_scores(q64, k64, fm, key_padding_mask, causal)
        a_hat = normalize_rows(scores, allowed, eps)
        metrics: dict[str, float] = {}
        stabilized = fm.keys_need_sequence or fm.hparams.get("stabilize") is True
        if callable(getattr(fm, "kernel", None)) and not stabilized:
            exact = softmax_kernel(q64, k64)
            metrics["kernel_mse"] = _masked_mean((scores - exact) ** 2, measured)
        metrics.update(_attention_metrics(a_soft, a_hat, measured, queries, v64, out_soft))
    label = map_label(fm)
    for metric, value in metrics.items():
        rows.append(("map", label, fm.feature_dim, metric, value))
    if check_flag("baseline", baseline):
        a_uni = attention_matrix(q64, k64, "uniform", causal, key_padding_mask, max_n)
        uniform = _attention_metrics(a_soft, a_uni, measured, queries, v64, out_soft)
        for metric, value in uniform.items():
            rows.append(("baseline", "uniform", pd.NA, metric, value))
    frame = pd.DataFrame(rows, columns=["kind", "method", "feature_dim", "metric", "value"])
    return frame[["method", "kind", "feature_dim", "metric", "value"]]
