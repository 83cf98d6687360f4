"""Orthogonality helpers: Gaussian projections with (block-)orthogonal rows, orthogonal
initialization, and the orthogonality penalty ‖WᵀW − I‖²_F."""

from __future__ import annotations

import math

import torch

from ..core.validation import autocast_off
from .base import fill_on_cpu_

ROW_NORMS = ("chi", "sqrt_d")
CPU = torch.device("cpu")  # where the draws are made: the same on every device


def gaussian_projection(
    num_rows: int,
    dim: int,
    generator: torch.Generator,
    orthogonal: bool = False,
    row_norms: str = "chi",
) -> torch.Tensor:
    """A random ``(num_rows, dim)`` float64 matrix whose rows w_r stand in for draws from
    N(0, I): each row's marginal is N(0, I) except with ``row_norms="sqrt_d"``.

    iid: rows are independent N(0, I_dim). Orthogonal: rows come in blocks of
    ``dim`` mutually orthogonal directions (QR of a Gaussian matrix, sign-corrected so
    each block is Haar distributed; the last block is truncated); each row is then
    rescaled to the norm of an independent N(0, I_dim) vector (``row_norms="chi"``,
    so every row is marginally N(0, I)) or to exactly √dim (``"sqrt_d"``: the rows are
    then uniform on the sphere of radius √dim, and E[exp(w·x)] ≠ exp(‖x‖²/2), so
    FAVOR+ estimates are biased). iid rows ignore ``row_norms``.
    """
    if row_norms not in ROW_NORMS:
        raise ValueError(f"row_norms must be one of {list(ROW_NORMS)}, got {row_norms!r}")
    if not orthogonal:
        return torch.randn(num_rows, dim, generator=generator, dtype=torch.float64, device=CPU)
    blocks = []
    for _ in range(math.ceil(num_rows / dim)):
        gaussian = torch.randn(dim, dim, generator=generator, dtype=torch.float64, device=CPU)
        q, r = torch.linalg.qr(gaussian)
        blocks.append((q * torch.sign(torch.diagonal(r))).T)  # rows orthonormal
    rows = torch.cat(blocks)[:num_rows]
    if row_norms == "chi":
        gaussian = torch.randn(num_rows, dim, generator=generator, dtype=torch.float64, device=CPU)
        norms = gaussian.norm(dim=1)
    else:
        norms = torch.full((num_rows,), math.sqrt(dim), dtype=torch.float64, device=CPU)
    return rows * norms[:, None]


def orthogonal_init_(weight: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """Fill ``weight: (..., n, n)`` in place with an orthogonal matrix per leading index,
    drawn on the CPU from ``generator`` (a CPU one; :func:`~.base.fill_on_cpu_`)."""

    def draw(cpu: torch.Tensor) -> None:
        for matrix in cpu.view(-1, *cpu.shape[-2:]):
            torch.nn.init.orthogonal_(matrix, generator=generator)

    fill_on_cpu_(weight, draw)


def orthogonality_penalty(weight: torch.Tensor) -> torch.Tensor:
    """‖WᵀW − I‖²_F of ``weight: (..., n, m)``, summed over leading indices: a scalar in at
    least float32, with autocast off (the trainer's bf16 autocast rounded the Gram matrix:
    a floor of 3e-6 at an orthogonal W, the gradient 25% off near one)."""
    dtype = torch.promote_types(weight.dtype, torch.float32)
    with autocast_off(weight):
        w = weight.to(dtype)
        gram = w.transpose(-1, -2) @ w
        eye = torch.eye(gram.shape[-1], dtype=dtype, device=gram.device)
        return (gram - eye).square().sum()
