"""Sums whose backward, too, runs with autocast off.

The core runs its float32 sums with autocast off (:func:`~.validation.autocast_off`). Plain
autograd ops record no autocast state: a ``backward()`` called inside an autocast region runs
their backward matmuls in float16/bfloat16, which rounds the sums' gradients and overflows
them at a loss scale of 2**16. :func:`without_autocast` recomputes the sums in its backward
with autocast off and differentiates them there (gradients of gradients included).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .validation import autocast_off


class _WithoutAutocast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, *tensors):  # type: ignore[override]
        ctx.fn = fn
        ctx.save_for_backward(*tensors)
        with autocast_off(tensors[0]):
            return fn(*tensors)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        need = ctx.needs_input_grad[1:]
        create_graph = torch.is_grad_enabled()  # a backward with create_graph=True
        inputs = list(ctx.saved_tensors)  # reached by the graph only for create_graph
        if not create_graph:
            inputs = [t.detach().requires_grad_(n) for t, n in zip(inputs, need, strict=True)]
        with torch.enable_grad(), autocast_off(grad):
            out = ctx.fn(*inputs)
            wanted = [t for t, n in zip(inputs, need, strict=True) if n]
            grads = iter(torch.autograd.grad(out, wanted, grad, create_graph=create_graph))
        return (None, *(next(grads) if n else None for n in need))


def without_autocast(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """``fn(*tensors)`` (one output tensor) with autocast off in its forward and backward
    (recomputed there): the non-causal sums, the reference's explicit matrix and the
    recurrent read-out (the chunked products' own backward turns autocast off)."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        with autocast_off(tensors[0]):
            return fn(*tensors)
    return _WithoutAutocast.apply(fn, *tensors)
