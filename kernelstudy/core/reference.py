"""Reference causal product: materializes the N×N kernel matrix.

Slow and O(N²) in memory; the ground truth every fast backend is tested against.
"""

from __future__ import annotations

import torch

from .autocast import without_autocast
from .validation import accumulation_dtype, check_qkv


def causal_dot_product_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``out_i = Σ_{j≤i} (q_i·k_j) v_j`` for ``q, k: (B,H,N,F)``, ``v: (B,H,N,M)`` → ``(B,H,N,M)``.

    Computed in float32 (float64 for float64 inputs) and returned in the input dtype.
    Differentiable (autocast off in the backward too, see :mod:`.autocast`).
    """
    check_qkv(q, k, v, names=("q", "k", "v"), causal=True)
    acc = accumulation_dtype(q.dtype)

    def product(q, k, v):
        return torch.tril(q.to(acc) @ k.to(acc).transpose(-1, -2)) @ v.to(acc)

    return without_autocast(product, q, k, v).to(q.dtype)
