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
    generate_vmap_rule = True  # torch.func.vmap and jacrev work through it

    @staticmethod
    def forward(fn, *tensors):  # type: ignore[override]
        with autocast_off(tensors[0]):
            return fn(*tensors)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[override]
        ctx.fn = inputs[0]
        ctx.save_for_backward(*inputs[1:])
        ctx.save_for_forward(*inputs[1:])

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        need = ctx.needs_input_grad[1:]
        inputs = ctx.saved_tensors
        wanted = [i for i, n in enumerate(need) if n]

        def of_wanted(*tensors: torch.Tensor) -> torch.Tensor:
            args = list(inputs)
            for i, t in zip(wanted, tensors, strict=True):
                args[i] = t
            return ctx.fn(*args)

        # torch.func.vjp rather than autograd.grad: it nests inside torch.func transforms,
        # and under create_graph=True its result stays differentiable (gradients of gradients)
        with autocast_off(grad):
            _, pull = torch.func.vjp(of_wanted, *(inputs[i] for i in wanted))
            grads = iter(pull(grad))
        return (None, *(next(grads) if n else None for n in need))

    @staticmethod
    def jvp(ctx, _fn_tangent, *tangents):  # type: ignore[override]
        inputs = ctx.saved_tensors
        filled = tuple(
            torch.zeros_like(t) if d is None else d for t, d in zip(inputs, tangents, strict=True)
        )
        with autocast_off(inputs[0]):  # forward mode (jvp, jacfwd, forward-over-reverse)
            return torch.func.jvp(ctx.fn, inputs, filled)[1]


def without_autocast(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """``fn(*tensors)`` (one output tensor) with autocast off in its forward and backward
    (recomputed there): the non-causal sums, the reference's explicit matrix and the
    recurrent read-out (the chunked products' own backward turns autocast off)."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        with autocast_off(tensors[0]):
            return fn(*tensors)
    return _WithoutAutocast.apply(fn, *tensors)
