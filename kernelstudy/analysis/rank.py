"""Rank measures of an attention matrix.

Kernel attention ``D⁻¹ φ(Q) φ(K)ᵀ`` with F features has rank ≤ F; softmax
attention is generally full rank. Three measures, from strict to soft:

- numerical rank: number of singular values above ``tol`` (default, as in
  ``numpy.linalg.matrix_rank``: ``σ_max · max(N, S) · eps(dtype of A)``; for float16 and
  bfloat16, whose eps makes that ≥ σ_max from max(N, S) = 1024 or 128 on, ``eps · ‖A‖_F ·
  (√N + √S) / √(N·S)``, the spectral norm of independent roundings of relative size eps
  of entries of A's root-mean-square size);
- effective rank (Roy & Vetterli 2007): ``exp(H(p))`` with ``p_i = σ_i / Σ σ``;
- stable rank: ``‖A‖_F² / ‖A‖_2² = Σ σ² / σ_max²``.

:func:`normalized_spectrum` gives the singular values divided by the largest, the curve
behind all three (a kernel map's drops to round-off after F values).

Padding: the measures take one matrix as it is and no masks. Measure a padded sequence on
its real block, ``A[b, h][real_q][:, real_k]`` (``[:L, :L]`` for right padding) of
:func:`~kernelstudy.analysis.attention_matrix`. Padded keys are zero columns there: they
leave every nonzero singular value (so the effective and stable ranks) as it is, but add
zero singular values and raise the default ``tol`` (∝ ``max(N, S)``). Padded queries are
rows of their own (they attend to the real keys like any query): they change the spectrum,
and so every measure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..arguments import check_count, check_real


def attention_rank(A: torch.Tensor | np.ndarray, tol: float | None = None) -> dict[str, Any]:
    """Rank measures of an ``(N, S)`` attention matrix, N queries by S keys (computed in
    float64; cross-attention matrices need not be square). Every row and column counts: for
    a padded sequence pass its real block (see the module doc).

    Args:
        A: the matrix, tensor or array.
        tol: singular values ``> tol`` count toward the numerical rank; None uses
            ``σ_max · max(N, S) · eps`` of A's dtype (float32 eps for float32 input), and
            ``eps · ‖A‖_F · (√N + √S) / √(N·S)`` for float16 and bfloat16 (see the
            module doc).

    Returns:
        ``numerical_rank`` (int), ``tol`` (the tolerance used), ``effective_rank``,
        ``stable_rank`` (floats), ``n`` and ``s`` (the shape) and ``singular_values``
        (numpy, descending, ``min(N, S)`` of them). An all-zero matrix has all three ranks
        0 (no singular value above 0; the effective and stable ranks' ratios are 0/0 there).
    """
    if isinstance(A, np.ndarray):
        try:  # a reversed view has negative strides: contiguous first
            A = torch.from_numpy(np.ascontiguousarray(A))
        except TypeError:  # object, str, ... arrays: torch's message named no argument
            raise TypeError(f"A must be a numeric array, got dtype {A.dtype}") from None
    if not isinstance(A, torch.Tensor):
        raise TypeError(f"A must be a torch.Tensor or numpy array, got {type(A).__name__}")
    if A.device.type == "meta":
        raise ValueError("A must hold values (a tensor on the meta device has none)")
    if A.dim() != 2:
        raise ValueError(f"A must be a 2-D (N, S) matrix, got shape {tuple(A.shape)}")
    if not A.is_floating_point():
        raise ValueError(f"A must be a floating-point matrix, got dtype {A.dtype}")
    if A.numel() == 0:
        raise ValueError(f"A must be non-empty, got shape {tuple(A.shape)}")
    if not torch.isfinite(A).all():
        raise ValueError("A must be finite (it has NaN or Inf entries)")
    A_dtype = A.dtype
    eps = torch.finfo(A_dtype).eps
    A = A.detach().double().cpu()
    # A finite A near float64's top has σ_max = inf, ranks NaN (near its bottom, subnormal
    # σ): such an A is scaled by a power of two (exact) to entries below 1, σ and tol
    # scaled back. Others are not (the SVD's round-off would change in its last bits).
    power = math.frexp(float(A.abs().max()))[1]  # max|A| = m·2^power, 0.5 ≤ m < 1
    power = power if abs(power) > 500 else 0

    def scaled(x: torch.Tensor | float, power: int) -> torch.Tensor:  # x·2^power, inf past
        # in two exact halves: 2^±1024 is no float64 (torch 2.8's ldexp made it inf first)
        half = power // 2
        return torch.as_tensor(x, dtype=torch.float64) * 2.0**half * 2.0 ** (power - half)

    sv_scaled = torch.linalg.svdvals(scaled(A, -power))
    sv = scaled(sv_scaled, power)
    smax = sv_scaled[0].item()
    if tol is None:
        if A_dtype in (torch.float16, torch.bfloat16):
            n, s = A.shape
            tol_scaled = eps * float(sv_scaled.square().sum().sqrt())
            tol_scaled *= (n**0.5 + s**0.5) / (n * s) ** 0.5
        else:
            tol_scaled = smax * max(A.shape) * eps
        tol = float(scaled(tol_scaled, power))
    else:
        tol = check_real("tol", tol)
        tol_scaled = float(scaled(tol, -power))
    if smax > 0:  # both ranks are scale-free: relative to the largest (no over- or underflow)
        r = sv_scaled / smax
        p = r / r.sum()
        p = p[p > 0]
        effective = float(torch.exp(-(p * p.log()).sum()))
        stable = float(r.square().sum())
    else:
        effective = stable = 0.0
    return {
        "n": int(A.shape[0]),
        "s": int(A.shape[1]),
        "numerical_rank": int((sv_scaled > tol_scaled).sum().item()),
        "tol": float(tol),
        "effective_rank": effective,
        "stable_rank": stable,
        "singular_values": sv.numpy(),
    }


def normalized_spectrum(
    singular_values: torch.Tensor | np.ndarray | Sequence[float], digits: int | None = 6
) -> np.ndarray:
    """``σ_i / σ_1`` for singular values in descending order (as :func:`attention_rank` returns
    them), rounded to ``digits`` significant digits (rounding keeps the order; None keeps
    them exact). The first is 1; the rest lie in [0, 1], non-increasing.

    Raises:
        ValueError: if the values are not a non-empty 1-D descending non-negative sequence
            with a positive largest value.
    """
    try:
        sv = torch.as_tensor(singular_values).detach().double().cpu().numpy()
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(
            "singular_values must be a 1-D tensor, array or list of numbers, got "
            f"{type(singular_values).__name__}"
        ) from err
    if sv.ndim != 1 or sv.size == 0:
        raise ValueError(f"singular_values must be a non-empty 1-D sequence, got shape {sv.shape}")
    if not np.isfinite(sv).all() or (sv < 0).any() or (np.diff(sv) > 0).any():
        raise ValueError("singular_values must be finite, non-negative and in descending order")
    if not sv[0] > 0:
        raise ValueError("singular_values: the largest is 0 (a zero matrix has no spectrum)")
    ratio = sv / sv[0]
    if digits is not None:
        digits = check_count("digits", digits, 1)  # numpy's ints too
        ratio = np.array([float(f"{r:.{digits - 1}e}") for r in ratio])
    return ratio
