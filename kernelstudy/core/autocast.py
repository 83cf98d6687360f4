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

from .transforms import (
    forward_levels,
    jvp_filled,
    needs_input_grad,
    signature_once,
    vjp_of_needed,
)
from .validation import autocast_off


@signature_once
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
        with autocast_off(grad):
            grads = vjp_of_needed(ctx.fn, ctx.saved_tensors, needs_input_grad(ctx)[1:], grad)
        return (None, *grads)

    @staticmethod
    def jvp(ctx, _fn_tangent, *tangents):  # type: ignore[override]
        inputs = ctx.saved_tensors
        with autocast_off(inputs[0]):  # forward mode (jvp, jacfwd, forward-over-reverse)
            return jvp_filled(ctx.fn, inputs, tangents)


def without_autocast(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """``fn(*tensors)`` (one output tensor) with autocast off in its forward and backward
    (recomputed there): the non-causal sums, the reference's explicit matrix and the
    recurrent read-out (the chunked products' own backward turns autocast off). While
    ``torch.compile`` traces, ``fn`` is traced as it is: the compiled backward is traced with the
    forward, in its dtypes, not run in the autocast region of a later ``backward()``."""
    if (
        torch.compiler.is_compiling()
        or not torch.is_grad_enabled()
        or not any(t.requires_grad for t in tensors)
        or forward_levels() > 1  # the Function's jvp would lose the outer level's tangent
    ):
        with autocast_off(tensors[0]):
            return fn(*tensors)
    return _WithoutAutocast.apply(fn, *tensors)
