"""What the core's autograd Functions share for ``torch.func``: the jvp of a product linear
in each input, the fold of a ``vmap``-ed dimension into the batch for kernels that take
plain tensors (the compiled CPU and CUDA products), and the vjp and jvp of a function the
Function recomputes (the autocast-free sums, the CUDA attention's higher derivatives); the
forward's signature computed once (:func:`signature_once`); and what ``torch.compile`` traces:
each Function's ``apply`` (:func:`traceable_apply`) and constants (:func:`constant_when_traced`);
whether the host may read a tensor's value (:func:`host_reads_allowed`), and whether a compiled
kernel may read its memory (:func:`kernel_readable`, :func:`legacy_batched`)."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch._C._functorch import (
    TransformType,
    is_functorch_wrapped_tensor,
    is_legacy_batchedtensor,
)
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

FunctionT = TypeVar("FunctionT", bound=type[torch.autograd.Function])
CallableT = TypeVar("CallableT", bound=Callable[..., Any])


def signature_once(cls: FunctionT) -> FunctionT:
    """Class decorator for a Function with ``setup_context``: its ``forward``'s signature is
    computed here, once, and kept as ``forward.__signature__``.

    ``Function.apply`` binds its arguments to ``inspect.signature(forward)`` on every call,
    which rebuilds the signature from the code object: of a CUDA product's fwd+bwd step (a
    stand-in extension on CPU, 2026-11-30) 61 µs of host time before, 49.5 after. The kept
    ``__signature__`` is what ``inspect.signature`` returns, so the binding (defaults too) is
    unchanged.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        raise TypeError(f"signature_once takes a torch.autograd.Function subclass, got {cls!r}")
    forward = cls.__dict__.get("forward")
    if not isinstance(forward, staticmethod):
        raise TypeError(f"{cls.__name__} must define forward as a staticmethod of its own")
    forward.__func__.__signature__ = inspect.signature(forward.__func__)
    return cls


def traceable_apply(cls: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``cls.apply``, and while ``torch.compile`` traces, the ``apply`` of a subclass of ``cls``
    without its custom ``jvp``.

    Dynamo refuses to trace a Function that defines a jvp once an input requires grad (a graph
    break, an error under ``fullgraph=True``); compiled code runs no forward-mode AD, so the twin
    loses nothing there. Its forward, backward and vmap rule are ``cls``'s own. (A function, not
    an attribute of ``cls``: dynamo follows a closure's class, not a class's added attribute.)
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        raise TypeError(f"traceable_apply takes a torch.autograd.Function subclass, got {cls!r}")
    body = {
        "jvp": staticmethod(torch.autograd.Function.jvp),
        "__module__": cls.__module__,
        "__qualname__": f"{cls.__qualname__}_traced",
        "__doc__": f"{cls.__name__} without its jvp, for torch.compile (traceable_apply).",
    }
    traced = type(f"{cls.__name__}_traced", (cls,), body)

    def run(*args: Any) -> Any:
        if torch.compiler.is_compiling():
            return traced.apply(*args)
        return cls.apply(*args)

    run.__doc__ = f"{cls.__name__}.apply, traceable by torch.compile (traceable_apply)."
    return run


def constant_when_traced(fn: CallableT) -> CallableT:
    """Mark ``fn`` as ``torch.compiler.assume_constant_result`` does: while dynamo traces, it
    calls ``fn`` once, outside the graph, and keeps the result as a constant (whether a backend
    is built, a GPU's compute capability). The marker is set here because torch's decorator
    imports dynamo, which made ``import kernelstudy`` take 0.7 s longer (1.0 s before);
    ``tests/test_core.py`` checks that torch's decorator sets this marker."""
    fn._dynamo_marked_constant = True
    return fn


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
    """``(V·B,...) → (V,B,...)``: a result's mapped dimension split off the batch again (B
    from the sizes: ``-1`` cannot be inferred where another dimension is 0)."""
    return t.unflatten(0, (size, t.shape[0] // size if size else 0))


def vjp_of_needed(
    fn: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    need: Sequence[bool],
    grad: torch.Tensor,
) -> list[torch.Tensor | None]:
    """The gradients of ``fn(*inputs)`` against ``grad`` for the inputs with ``need[i]``
    (None for the others). By ``torch.func.vjp`` rather than ``autograd.grad``: it nests
    inside torch.func transforms, and under ``create_graph=True`` its result stays
    differentiable (gradients of gradients)."""
    wanted = [i for i, n in enumerate(need) if n]

    def of_wanted(*tensors: torch.Tensor) -> torch.Tensor:
        args = list(inputs)
        for i, t in zip(wanted, tensors, strict=True):
            args[i] = t
        return fn(*args)

    _, pull = torch.func.vjp(of_wanted, *(inputs[i] for i in wanted))
    grads = iter(pull(grad))
    return [next(grads) if n else None for n in need]


def jvp_filled(
    fn: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    tangents: Sequence[torch.Tensor | None],
) -> torch.Tensor:
    """The jvp of ``fn(*inputs)`` along ``tangents``, a None tangent taken as zeros.

    By two vjps (the vjp is linear in its cotangent u, and the vjp of ``u ↦ Jᵀu`` is ``J``):
    ``torch.func.jvp`` cannot run inside ``torch.autograd.forward_ad.dual_level`` ("nested
    forward mode AD"), which is where a Function's jvp runs for forward-mode AD with dual
    tensors; reverse mode nests there and inside every torch.func transform."""
    filled = tuple(
        torch.zeros_like(x) if d is None else d for x, d in zip(inputs, tangents, strict=True)
    )
    out, pull = torch.func.vjp(fn, *inputs)
    _, pull_of_pull = torch.func.vjp(pull, torch.zeros_like(out))
    return pull_of_pull(filled)[0]


def host_reads_allowed(*tensors: torch.Tensor) -> bool:
    """Whether code may read a tensor's value on the host here (``float(t)``, a sync): not
    while ``torch.compile`` traces (a graph break), nor inside ``torch.func.vmap`` (a batched
    tensor has no single value: it raises), nor of ``tensors`` on the meta device (they hold
    no values: shape inference). Code that decides on values takes a path that needs no
    such decision where this is False."""
    if torch.compiler.is_compiling() or any(t.is_meta for t in tensors):
        return False
    return all(i.key() != TransformType.Vmap for i in retrieve_all_functorch_interpreters())


def checked_in_graph(
    condition: Callable[[], torch.Tensor], message: str, what: str, *tensors: torch.Tensor
) -> bool:
    """A value check for where the host may not read values (:func:`host_reads_allowed`):
    while ``torch.compile`` traces, ``condition()`` (a bool tensor, True when all is well)
    is asserted in the graph (``torch._assert_async``: ``message`` on failure, no sync on the
    GPU); on the meta device there is nothing to check; inside ``torch.func.vmap``, which
    has no batching rule for the assertion and no single value to read, a warning says that
    ``what`` (the check) is skipped. Returns False where the host may read: the caller checks.
    """
    if host_reads_allowed(*tensors):
        return False
    if torch.compiler.is_compiling():
        torch._assert_async(condition(), message)
    elif not any(t.is_meta for t in tensors):
        warnings.warn(
            f"{what} is skipped inside torch.func.vmap (a batched tensor's values cannot be "
            "read there): an overflow gives inf or NaN",
            RuntimeWarning,
            stacklevel=3,
        )
    return True


def kernel_readable(*tensors: torch.Tensor | None) -> bool:
    """Whether a compiled kernel (which takes raw memory) can read all of ``tensors``: none is
    a ``torch.func`` level's wrapper (vmap, grad, jvp) nor a legacy vmap batch
    (:func:`legacy_batched`). Grad mode does not tell: the function a ``torch.func.vjp``
    returns, called under ``no_grad`` (as ``jacrev`` does there), hands a backward wrapped
    gradients with grad mode off. None (an absent mask) is readable. True while
    ``torch.compile`` traces (the graph holds the kernels as custom ops)."""
    if torch.compiler.is_compiling():
        return True
    return not any(
        t is not None and (is_functorch_wrapped_tensor(t) or is_legacy_batchedtensor(t))
        for t in tensors
    )


def legacy_batched(*tensors: torch.Tensor) -> bool:
    """Whether any of ``tensors`` is a batch of torch's older vmap, which
    ``autograd.grad(is_grads_batched=True)`` and ``autograd.functional.jacobian(vectorize=True)``
    use: it knows no Function's vmap rule, so a Function whose forward hands it to a compiled
    kernel fails there; such gradients are computed in torch ops instead. False while
    ``torch.compile`` traces."""
    if torch.compiler.is_compiling():
        return False
    return any(is_legacy_batchedtensor(t) for t in tensors)


def needs_input_grad(ctx: Any) -> tuple[bool, ...]:
    """A Function's ``ctx.needs_input_grad``, but all True while ``torch.compile`` traces:
    there, inside ``torch.func.grad``/``vjp``/``jacrev``, an input computed in the function
    (not one of its arguments) made torch report False for the Function's other inputs, and
    their gradients were silently zero (torch 2.13: ``compile(grad(f))`` of causal attention,
    whose v gains a column of ones, gave dq = dk = 0). The compiled graph drops the
    gradients nobody uses."""
    if torch.compiler.is_compiling():
        return (True,) * len(ctx.needs_input_grad)
    return ctx.needs_input_grad


def forward_levels() -> int:
    """How many ``torch.func`` forward-mode levels (jvp, jacfwd) are active here."""
    return sum(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters())


def refuse_nested_forward(what: str) -> None:
    """RuntimeError where forward mode runs inside forward mode (jvp of jvp, jacfwd of
    jacfwd): inside a Function's jvp rule torch drops the outer level's tangent of the saved
    inputs, so ``what``'s mixed second derivatives came out silently wrong (off by 1.9 of
    2 for the torch backend's attention). Called by the products' jvp rules."""
    if forward_levels() > 1:
        raise RuntimeError(
            f"{what}: forward mode inside forward mode (jvp of jvp, jacfwd of jacfwd) is not "
            "supported: a Function's jvp rule loses the outer tangent of its saved inputs; "
            "use backend='reference', or jacfwd of jacrev (forward over reverse)"
        )
