"""Attention distillation: train a learnable feature map to mimic softmax attention."""

from __future__ import annotations

import pandas as pd
import torch

from ..arguments import check_count, check_real
from ..core.validation import accumulation_dtype
from ..feature_maps import FeatureMap
from .matrices import MAX_N, attention_matrix, check_qk


def distillation_loss(
    feature_map: FeatureMap,
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool = False,
    target: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Mean over rows of the cross-entropy ``−Σ_j P_ij log Â_ij`` (nats).

    ``P`` is softmax attention of ``q: (B,H,N,D)``, ``k: (B,H,S,D)`` (or ``target``,
    precomputed, ``(B,H,N,S)``) and ``Â`` the map's kernel attention. Differentiable
    in the map's parameters. Minimizing it minimizes ``KL(P ‖ Â)``; its floor is the
    mean entropy of the softmax rows. ``feature_map`` must be a FeatureMap: a name or
    config would build a new map, with new random weights, on every call.
    """
    if not isinstance(feature_map, FeatureMap):
        raise TypeError(f"feature_map must be a FeatureMap, got {type(feature_map).__name__}")
    check_qk(q, k)
    if target is not None:
        want = (*q.shape[:3], k.shape[2])
        if not isinstance(target, torch.Tensor) or tuple(target.shape) != want:
            got = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
            raise ValueError(
                f"target must be softmax attention of shape (B,H,N,S) = {want}, got {got}"
            )
    if target is None:
        with torch.no_grad():
            target = attention_matrix(q, k, "softmax", causal, max_n=MAX_N)
    a_hat = attention_matrix(q, k, feature_map, causal, max_n=MAX_N, eps=eps)
    # in float32 at least: 1e-30 is 0 in float16, and log(0) made the loss inf
    acc = accumulation_dtype(a_hat.dtype)
    ce = -(target.to(acc) * a_hat.to(acc).clamp_min(1e-30).log()).sum(-1)
    return ce.mean()


def fit_to_softmax(
    feature_map: FeatureMap,
    q: torch.Tensor,
    k: torch.Tensor,
    steps: int = 200,
    lr: float = 1e-2,
    causal: bool = False,
    q_val: torch.Tensor | None = None,
    k_val: torch.Tensor | None = None,
    reg_weight: float = 1.0,
    eval_every: int = 10,
) -> pd.DataFrame:
    """Train ``feature_map`` in place (Adam) so its attention matches softmax on ``q``, ``k``.

    Loss = :func:`distillation_loss` + ``reg_weight · feature_map.regularization()``,
    full batch over ``q: (B,H,N,D)``, ``k: (B,H,S,D)``. If ``q_val``/``k_val`` are given,
    the held-out distillation loss is recorded every ``eval_every`` steps (and at
    step 0 and the last step).

    Returns:
        History in long format: columns ``step``, ``metric`` (``train_loss``,
        ``regularization``, ``val_loss``), ``value``.
    """
    if not isinstance(feature_map, FeatureMap):
        raise TypeError(f"feature_map must be a FeatureMap, got {type(feature_map).__name__}")
    params = [p for p in feature_map.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            f"feature_map {feature_map.name or type(feature_map).__name__!r} has no trainable "
            "parameters to fit"
        )
    check_count("steps", steps, 0)
    check_count("eval_every", eval_every, 1)
    check_real("lr", lr, strict=True)
    check_real("reg_weight", reg_weight)
    if (q_val is None) != (k_val is None):
        raise ValueError("q_val and k_val must be given together")
    check_qk(q, k)
    if q_val is not None:
        check_qk(q_val, k_val, ("q_val", "k_val"))
    pairs = [("q", q), ("k", k)] + (
        [("q_val", q_val), ("k_val", k_val)] if q_val is not None else []
    )
    for name, t in pairs:
        if not torch.isfinite(t).all():  # would write NaN into the caller's map
            raise ValueError(f"{name} holds NaN or inf")
    with torch.no_grad():
        target = attention_matrix(q, k, "softmax", causal)
        val_target = None
        if q_val is not None:
            val_target = attention_matrix(q_val, k_val, "softmax", causal)

    history: list[tuple[int, str, float]] = []

    def record_val(step: int) -> None:
        if val_target is None:
            return
        with torch.no_grad():
            loss = distillation_loss(feature_map, q_val, k_val, causal, val_target)
        history.append((step, "val_loss", loss.item()))

    was_training = feature_map.training
    feature_map.train()
    optimizer = torch.optim.Adam(params, lr=lr)
    try:  # the caller's mode back, on an error (or Ctrl-C) too
        record_val(0)
        for step in range(1, steps + 1):
            optimizer.zero_grad(set_to_none=True)
            loss = distillation_loss(feature_map, q, k, causal, target)
            reg = feature_map.regularization()
            (loss + reg_weight * reg).backward()
            optimizer.step()
            history.append((step, "train_loss", loss.item()))
            history.append((step, "regularization", float(reg.detach())))
            if step % eval_every == 0 or step == steps:
                record_val(step)
    finally:
        feature_map.train(was_training)
    return pd.DataFrame(history, columns=["step", "metric", "value"])
