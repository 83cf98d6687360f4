"""What the core's autograd Functions share for ``torch.func``: the jvp of a product linear
in each input, and the fold of a ``vmap``-ed dimension into the batch for kernels that take
plain tensors (the compiled CPU and CUDA products)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def trilinear_jvp(
    product: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    primals: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    tangents: tuple[torch.Tensor | None, ...],
) -> torch.Tensor:
    """The jvp of a ``product(q, k, v)`` linear in each input: the sum, over the inputs with
    a tangent, of the product with that input replaced by its tangent."""
    out = None
    for i, tangent in enumerate(tangents):
        if tangent is not None:
            term = product(*(tangent if j == i else x for j, x in enumerate(primals)))
            out = term if out is None else out + term
    return out


def fold_mapped(size: int, t: torch.Tensor | None, dim: int | None) -> torch.Tensor | None:
    """A ``vmap`` rule's input with the mapped dimension (size V) folded into the batch:
    ``(V,B,...) → (V·B,...)``; an unmapped input (``dim`` None) is repeated V times; None
    stays None."""
    if t is None:
        return None
    t = t.expand(size, *t.shape) if dim is None else t.movedim(dim, 0)
    return t.reshape(size * t.shape[1], *t.shape[2:])


def unfold_mapped(size: int, t: torch.Tensor) -> torch.Tensor:
    """``(V·B,...) → (V,B,...)``: a result's mapped dimension split off the batch again."""
    return t.reshape(size, -1, *t.shape[1:])
