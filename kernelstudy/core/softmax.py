"""Exact softmax attention, the baseline every feature map is measured against."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..arguments import check_real
from .validation import (
    accumulation_dtype,
    autocast_off,
    check_key_padding_mask,
    check_qkv,
    zero_padded_keys,
)


def _allowed(
    n: int, s: int, causal: bool, key_padding_mask: torch.Tensor | None, device
) -> torch.Tensor | None:
    """``(B|1, 1, N, S)`` bool: which keys each query may attend to (None: all)."""
    allowed = None
    if causal:
        allowed = torch.ones(n, s, dtype=torch.bool, device=device).tril()[None, None]
    if key_padding_mask is not None:
        pad = key_padding_mask[:, None, None, :]
        allowed = pad if allowed is None else allowed & pad
    return allowed


def _check_scale(q: torch.Tensor, scale: object) -> float:
    """``scale`` as a float (``1/√D`` for None); ValueError unless positive and finite."""
    if scale is not None:
        return check_real("scale", scale, True)
    if q.shape[-1] == 0:
        raise ValueError("q has head dimension D = 0: 1/√D is undefined, pass scale")
    return 1.0 / math.sqrt(q.shape[-1])


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """``softmax(q kᵀ · scale) v`` with ``scale = 1/√D`` by default.

    ``q: (B,H,N,D)``, ``k: (B,H,S,D)``, ``v: (B,H,S,M)`` → ``(B,H,N,M)``. Uses
    ``torch.nn.functional.scaled_dot_product_attention``. A query with no key
    to attend to (every allowed key padded) gets a zero output, not NaN; padded keys
    and values contribute nothing, whatever they hold (inf and NaN included).
    ``scale``: a positive finite number.
    """
    causal = check_qkv(q, k, v, names=("q", "k", "v"), causal=causal)
    if key_padding_mask is not None:
        key_padding_mask = check_key_padding_mask(
            key_padding_mask, k.shape[0], k.shape[2], k.device
        )
    k, v = zero_padded_keys(k, v, key_padding_mask)  # a weight of 0 times NaN is still NaN
    scale = _check_scale(q, scale)
    n, s = q.shape[2], k.shape[2]
    if key_padding_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    allowed = _allowed(n, s, causal, key_padding_mask, q.device)
    empty = ~allowed.any(-1, keepdim=True)  # queries with nothing to attend to
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | empty, scale=scale)
    return out.masked_fill(empty, 0.0)


def softmax_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The same as :func:`softmax_attention`, written out with an explicit ``(B,H,N,S)`` matrix."""
    causal = check_qkv(q, k, v, names=("q", "k", "v"), causal=causal)
    scale = _check_scale(q, scale)
    if key_padding_mask is not None:  # on q's device, as softmax_attention takes it
        key_padding_mask = check_key_padding_mask(
            key_padding_mask, k.shape[0], k.shape[2], k.device
        )
    k, v = zero_padded_keys(k, v, key_padding_mask)
    acc = accumulation_dtype(q.dtype)  # float16 scores overflowed to inf, then NaN
    allowed = _allowed(q.shape[2], k.shape[2], causal, key_padding_mask, q.device)
    with autocast_off(q):
        scores = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale
        if allowed is None:
            return (torch.softmax(scores, dim=-1) @ v.to(acc)).to(q.dtype)
        scores = scores.masked_fill(~allowed, float("-inf"))
        # rows with no key are 0/0 = NaN: zero those only (a NaN query stays NaN, as in SDPA)
        empty = ~allowed.any(-1, keepdim=True)
        weights = torch.softmax(scores, dim=-1).masked_fill(empty, 0.0)
        return (weights @ v.to(acc)).to(q.dtype)
