"""The exponents ``exp`` may take in each dtype, and the shift that keeps a maximum inside.

Feature maps of the form φ = exp(L − c)·T (FAVOR+, Hedgehog, trig features) and the
scaled :class:`~kernelstudy.core.RecurrentState` subtract a shift ``c`` from their key
exponents only where the dtype needs it. Inside the safe range the shift is 0, so keys
are exactly the unshifted features: no dependence on other keys (causality, key
padding), and the normalizer guard ``eps`` acts on the map's own scale of φ(q)·Σφ(k).
"""

from __future__ import annotations

import torch

#: ``(lo, hi)`` per feature dtype: a maximum exponent above it moves to ``hi``, one below to 0.
#: float32/bfloat16: a query feature times a key feature, both at most their maxima,
#: lies below e^40, so sums over 2^31 keys and 2^12 features (e^30) stay below float32's
#: largest value (e^88); with both maxima at or above e^-20, the largest product is
#: at least e^-40 and terms down to e^-47 below it stay above the smallest normal
#: float (e^-87). float64 takes float32's range, though its own (e^±708) would allow
#: e^±300: a shift changes how much ``eps`` weighs, so float64 results, the reference
#: that float32 ones are checked against, must shift where float32 does. float16
#: features are summed in float32, so each only has to fit float16 itself: e^±9 lies
#: within its normal range [6.1e-5, 65504].
SAFE_EXPONENTS: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (-9.0, 9.0),
    torch.bfloat16: (-20.0, 20.0),
    torch.float32: (-20.0, 20.0),
    torch.float64: (-20.0, 20.0),
}


def exp_shift(
    log_max: torch.Tensor, dtype: torch.dtype, lift_negative: bool = False
) -> torch.Tensor:
    """The shift to subtract from exponents whose maximum is ``log_max`` (any shape).

    0 where ``log_max`` lies in ``SAFE_EXPONENTS[dtype]`` (or is not finite: no
    features, or non-finite input). A maximum above the range moves to its top: the
    shift is only the excess, so it grows from 0 there without a jump (the shift changes
    how much ``eps`` weighs, and a jump in it made attention jump), and features stay as
    large as is safe (``eps`` weighs least). A maximum below the range moves to 0, where
    ``eps`` is negligible beside it (at the range's bottom it would swamp such terms).
    ``lift_negative`` moves every negative maximum to 0 (for query rows, whose factor
    cancels: a larger normalizer only shrinks the share of ``eps``); that lift grows to 0
    without a jump too. Non-decreasing in ``log_max``.
    """
    if not isinstance(log_max, torch.Tensor):
        raise TypeError(f"log_max must be a torch.Tensor, got {type(log_max).__name__}")
    if dtype not in SAFE_EXPONENTS:
        raise TypeError(f"dtype must be one of {list(SAFE_EXPONENTS)}, got {dtype}")
    lo, hi = SAFE_EXPONENTS[dtype]
    below = torch.isfinite(log_max) & (log_max < (0.0 if lift_negative else lo))
    excess = (log_max - hi).clamp_min(0.0).nan_to_num(0.0, 0.0)  # 0 for +inf and NaN
    return torch.where(below, log_max, excess)


def shift_setting(logs: torch.Tensor) -> torch.Tensor:
    """Key log scales as they set a shift: NaN and +inf (a non-finite input, or a key whose
    exponent overflowed) as −inf. Such a key makes its own row and later ones NaN through
    its features; in the shift it would stand for 0 (:func:`exp_shift` of a non-finite
    maximum) and overflow earlier keys above the range."""
    return logs.masked_fill(logs.isnan() | logs.isposinf(), -torch.inf)
