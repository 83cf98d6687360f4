"""Attention distillation: train a learnable feature map to mimic softmax attention."""

from __future__ import annotations

import pandas as pd
import torch

from ..arguments import check_count, check_flag, check_real
from ..core.validation import accumulation_dtype, check_key_padding_mask
from ..feature_maps import FeatureMap
from ..nn.modes import module_mode
from .matrices import MAX_N, allowed_keys, attention_matrix, check_max_n, check_qk


def _loss_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    query_padding_mask: torch.Tensor | None,
    names: tuple[str, str] = ("key_padding_mask", "query_padding_mask"),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(allowed: (B|1,1,N,S), rows: (B|1,1,N), real: (B|1,1,N))``: the keys each real
    query may see, the rows the loss averages (real queries with at least one such key)
    and the real queries. Checks the masks (named by ``names``); ValueError when no row is
    left."""
    kname, qname = names
    batch, n, s = q.shape[0], q.shape[2], k.shape[2]
    if key_padding_mask is not None:
        key_padding_mask = check_key_padding_mask(key_padding_mask, batch, s, k.device, kname)
    allowed = allowed_keys(n, s, causal, key_padding_mask, batch, q.device)
    real = torch.ones(1, 1, n, dtype=torch.bool, device=q.device)
    if query_padding_mask is not None:
        real = check_key_padding_mask(query_padding_mask, batch, n, q.device, qname)[:, None]
        allowed = allowed & real[..., None]
    rows = allowed.any(-1)
    if not rows.any():
        raise ValueError(
            f"no real query ({qname}) has a key to attend to ({kname}"
            f"{', causal' if causal else ''}): no row to average the loss over"
        )
    return allowed, rows, real


def _check_target_rows(target: torch.Tensor, rows: torch.Tensor | None) -> None:
    """ValueError unless ``target``'s rows that the loss averages (``rows: (B|1,1,N)``, or
    every row) are distributions: finite, non-negative, summing to 1 (to 1e-3; 2e-2 in
    half precision). A negative, NaN or unscaled target gave a negative, NaN or scaled
    loss without a word."""
    with torch.no_grad():
        t = target.detach()
        if rows is not None:
            t = t.masked_fill(~rows[..., None], 0.0)
            counted = rows.expand(t.shape[:3])
        else:
            counted = torch.ones(t.shape[:3], dtype=torch.bool, device=t.device)
        if not torch.isfinite(t).all() or (t < 0).any():
            raise ValueError(
                "target must be softmax attention: finite and non-negative in the rows the "
                "loss averages"
            )
        tol = 2e-2 if t.element_size() < 4 else 1e-3
        off = ((t.double().sum(-1) - 1.0).abs() > tol) & counted
        if off.any():
            raise ValueError(
                f"target must be softmax attention: its rows must sum to 1 (to {tol:g}), "
                f"got {int(off.sum())} row(s) that do not (e.g. a sum of "
                f"{t.double().sum(-1)[off][0].item():.6g})"
            )


def distillation_loss(
    feature_map: FeatureMap,
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool = False,
    target: torch.Tensor | None = None,
    eps: float = 1e-6,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over rows of the cross-entropy ``−Σ_j P_ij log Â_ij`` (nats).

    ``P`` is softmax attention of ``q: (B,H,N,D)``, ``k: (B,H,S,D)`` (or ``target``,
    precomputed, ``(B,H,N,S)``) and ``Â`` the map's kernel attention. Differentiable
    in the map's parameters. Minimizing it minimizes ``KL(P ‖ Â)``; its floor is the
    mean entropy of the softmax rows. ``feature_map`` must be a FeatureMap: a name or
    config would build a new map, with new random weights, on every call.

    Padded batches: ``key_padding_mask: (B,S)`` and ``query_padding_mask: (B,N)``, bool,
    True = real. Padded keys are left out of both ``P`` and ``Â`` (as in the core), and the
    mean is over the rows of real queries only that have a key to attend to (a row with
    none, e.g. a sequence without real keys, has no distribution to match and is left
    out). The mean is pooled: one mean over every such row of every sequence and head
    (not a mean of per-sequence means), so a padded batch gives, up to rounding, what the
    unpadded sequences give concatenated. Padded positions may hold anything (NaN and inf
    included): they reach neither the loss nor the map's gradients. Without masks every
    one of the ``B·H·N`` rows counts (``key_padding_mask`` alone drops no row: for a padded
    self-attention batch pass the same mask as both).

    ``target`` must be 0 outside the keys each real query may see (padded keys, and
    later keys when causal), as ``attention_matrix(q, k, "softmax", causal,
    key_padding_mask)`` gives it; its rows of padded queries are ignored. With a mask or
    ``causal`` it is checked: a target that weighs a key its query may not see (one
    computed without the key mask, say) raises ValueError.

    Raises:
        TypeError: ``feature_map`` not a FeatureMap, a mask not a bool tensor.
        ValueError: bad shapes (masks named), a target as above or one whose averaged
            rows are not distributions (negative, non-finite, not summing to 1), or no row
            to average: no real query with a key to attend to.
    """
    return _distillation_loss(
        feature_map, q, k, causal, target, eps, key_padding_mask, query_padding_mask, True
    )


def _distillation_loss(
    feature_map: FeatureMap,
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool = False,
    target: torch.Tensor | None = None,
    eps: float = 1e-6,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    check_target: bool = True,
) -> torch.Tensor:
    """:func:`distillation_loss`; ``check_target=False`` skips the checks of the target's
    values (:func:`fit_to_softmax` passes the softmax attention it computed itself, at every
    step: the checks' passes over (B,H,N,S) cost 20-50% of a step)."""
    if not isinstance(feature_map, FeatureMap):
        raise TypeError(f"feature_map must be a FeatureMap, got {type(feature_map).__name__}")
    check_qk(q, k)
    if q.shape[:3].numel() == 0 or k.shape[2] == 0:  # the mean of no rows: NaN (or 0)
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} leave no row to average the loss over "
            "(an empty batch, no heads, no queries or no keys)"
        )
    check_max_n("distillation_loss", q.shape[2], k.shape[2], MAX_N, settable=False)
    if target is not None:
        want = (*q.shape[:3], k.shape[2])
        if not isinstance(target, torch.Tensor) or tuple(target.shape) != want:
            got = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
            raise ValueError(
                f"target must be softmax attention of shape (B,H,N,S) = {want}, got {got}"
            )
        if not target.is_floating_point():  # a complex one lost its imaginary part silently
            raise TypeError(
                f"target must be a floating-point tensor (softmax attention), got {target.dtype}"
            )
    masked = key_padding_mask is not None or query_padding_mask is not None
    if masked or (causal and target is not None and check_target):
        allowed, rows, real = _loss_rows(q, k, causal, key_padding_mask, query_padding_mask)
        if target is not None and check_target:
            outside = (target != 0) & ~allowed & real[..., None]  # NaN there counts too
            if outside.any():
                raise ValueError(
                    "target weighs keys its queries may not see (padded keys"
                    f"{', or later keys (causal)' if causal else ''}): it must be 0 there, "
                    "as attention_matrix(q, k, 'softmax', causal, key_padding_mask) gives it"
                )
    if target is not None and check_target:
        _check_target_rows(target, None if not masked else rows)
    if target is None:
        with torch.no_grad():
            target = attention_matrix(
                q, k, "softmax", causal, key_padding_mask, MAX_N,
                query_padding_mask=query_padding_mask,
            )  # fmt: skip
    a_hat = attention_matrix(
        q, k, feature_map, causal, key_padding_mask, MAX_N, eps,
        query_padding_mask=query_padding_mask,
    )  # fmt: skip
    # in float32 at least: 1e-30 is 0 in float16, and log(0) made the loss inf
    acc = accumulation_dtype(a_hat.dtype)
    log_a = a_hat.to(acc).clamp_min(1e-30).log()
    if not masked:
        ce = -(target.to(acc) * log_a).sum(-1)
        return ce.mean()
    # a padded query's row of a given target may hold anything: selected, not multiplied
    p = torch.where(rows[..., None], target.to(acc), 0.0)
    ce = -(p * log_a).sum(-1)  # (B,H,N), 0 on rows left out
    return ce.sum() / rows.expand(ce.shape).sum()


@torch.inference_mode(False)
@torch.enable_grad()  # whatever the caller's mode (it trains)
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
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    key_padding_mask_val: torch.Tensor | None = None,
    query_padding_mask_val: torch.Tensor | None = None,
) -> pd.DataFrame:
    """Train ``feature_map`` in place (Adam) so its attention matches softmax on ``q``, ``k``.

    Loss = :func:`distillation_loss` + ``reg_weight · feature_map.regularization()``,
    full batch over ``q: (B,H,N,D)``, ``k: (B,H,S,D)``. If ``q_val``/``k_val`` are given,
    the held-out distillation loss is recorded every ``eval_every`` steps (and at
    step 0 and the last step).

    Padded batches: ``key_padding_mask: (B,S)`` and ``query_padding_mask: (B,N)`` (bool,
    True = real) of ``q``, ``k``, and ``key_padding_mask_val``, ``query_padding_mask_val`` of
    ``q_val``, ``k_val`` (named as the data they go with), are passed to
    :func:`distillation_loss`: each loss is the pooled mean over the real queries' rows,
    and padded positions may hold anything. All are checked before the first step.

    Returns:
        History in long format: columns ``step``, ``metric`` (``train_loss``,
        ``regularization``, ``val_loss``), ``value``. Step s is the map after s updates
        (0: as given): the training loss of each update is its map's, before the update, so
        ``train_loss`` runs from step 0 to ``steps − 1`` and ``val_loss`` at step
        ``steps`` is the returned map's (the training loss was logged a step late, beside
        the validation loss of the next map).
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
    causal = check_flag("causal", causal)
    if (q_val is None) != (k_val is None):
        raise ValueError("q_val and k_val must be given together")
    if q_val is None:
        for name, mask in (
            ("key_padding_mask_val", key_padding_mask_val),
            ("query_padding_mask_val", query_padding_mask_val),
        ):
            if mask is not None:
                raise ValueError(f"{name} needs q_val and k_val (it masks them)")
    check_qk(q, k)

    def plain(t: torch.Tensor | None) -> torch.Tensor | None:
        """Data, not part of the caller's graph (each step's backward ran into it: a second
        step failed, and the caller's .grad were written); made under inference_mode, a
        copy (no backward through those)."""
        if not isinstance(t, torch.Tensor):
            return t
        return t.detach().clone() if t.is_inference() else t.detach()

    q, k, q_val, k_val = plain(q), plain(k), plain(q_val), plain(k_val)
    data = [("", q, k, key_padding_mask, query_padding_mask)]
    if q_val is not None:
        check_qk(q_val, k_val, ("q_val", "k_val"))
        data.append(("_val", q_val, k_val, key_padding_mask_val, query_padding_mask_val))
    for suffix, qx, kx, kmask, qmask in data:
        qname, kname = f"q{suffix}", f"k{suffix}"
        check_max_n("fit_to_softmax", qx.shape[2], kx.shape[2], MAX_N, settable=False)
        if causal and qx.shape[2] != kx.shape[2]:  # said by attention_matrix, unnamed
            raise ValueError(
                f"causal attention needs {qname} and {kname} of one length, got N="
                f"{qx.shape[2]}, S={kx.shape[2]}"
            )
        masks = {}  # checked, named as the caller passed them
        for what, t, mask, name in (
            ("queries", qx, qmask, f"query_padding_mask{suffix}"),
            ("keys", kx, kmask, f"key_padding_mask{suffix}"),
        ):
            if mask is not None:
                masks[what] = check_key_padding_mask(mask, t.shape[0], t.shape[2], t.device, name)
        for what, t, name in (("queries", qx, qname), ("keys", kx, kname)):
            if what in masks:
                t = t.masked_fill(~masks[what][:, None, :, None], 0.0)
            if not torch.isfinite(t).all():  # would write NaN into the caller's map
                outside = f" (outside padded {what})" if what in masks else ""
                raise ValueError(f"{name} holds NaN or inf{outside}")
        if masks:  # the same masks, checked against both tensors: rows left to fit?
            names = (f"key_padding_mask{suffix}", f"query_padding_mask{suffix}")
            _loss_rows(qx, kx, causal, kmask, qmask, names)
    with torch.no_grad():
        target = attention_matrix(
            q, k, "softmax", causal, key_padding_mask, query_padding_mask=query_padding_mask
        )
        val_target = None
        if q_val is not None:
            val_target = attention_matrix(
                q_val, k_val, "softmax", causal, key_padding_mask_val,
                query_padding_mask=query_padding_mask_val,
            )  # fmt: skip

    history: list[tuple[int, str, float]] = []

    def record_val(step: int) -> None:
        if val_target is None:
            return
        with torch.no_grad():
            loss = _distillation_loss(
                feature_map, q_val, k_val, causal, val_target,
                key_padding_mask=key_padding_mask_val, query_padding_mask=query_padding_mask_val,
                check_target=False,
            )  # fmt: skip
        history.append((step, "val_loss", loss.item()))

    optimizer = torch.optim.Adam(params, lr=lr)
    with module_mode(feature_map, True):  # the caller's modes back, on an error too
        record_val(0)
        for step in range(1, steps + 1):
            optimizer.zero_grad(set_to_none=True)
            loss = _distillation_loss(
                feature_map, q, k, causal, target,
                key_padding_mask=key_padding_mask, query_padding_mask=query_padding_mask,
                check_target=False,
            )  # fmt: skip
            reg = feature_map.regularization()
            (loss + reg_weight * reg).backward()
            optimizer.step()
            history.append((step - 1, "train_loss", loss.item()))
            history.append((step - 1, "regularization", float(reg.detach())))
            if step % eval_every == 0 or step == steps:
                record_val(step)
    return pd.DataFrame(history, columns=["step", "metric", "value"])
