"""The ``cpu`` backend: the causal product as a compiled C++/OpenMP kernel (``csrc/cpu/``).

The extension is built on first use (see :mod:`kernelstudy.core.extensions`); until then, or
if it cannot be built, the backend reports itself unavailable and ``"auto"`` picks ``torch``.

The backward pass saves only ``q, k, v`` and recomputes with the same kernel (one causal and
two anti-causal products), so training memory is linear in N. float32 and float64 run
natively; float16/bfloat16 inputs are computed in float32 (the output is float32, as for every
backend; their gradients come back in the input dtype). Results do not depend on the number of
threads: the kernel's reductions run in a fixed order.
"""

from __future__ import annotations

import threading
import warnings
from types import ModuleType

import torch

from ..arguments import check_count
from .backends import Backend, register_backend
from .chunked import chunked_product
from .extensions import build_name, csrc_dir, load_extension, native_cflags
from .traced_kernels import CPU as TRACED_KERNELS
from .traced_kernels import CpuKernels as TracedKernels
from .transforms import (
    constant_when_traced,
    fold_mapped,
    kernel_readable,
    legacy_batched,
    needs_input_grad,
    refuse_nested_forward,
    signature_once,
    traceable_apply,
    trilinear_jvp,
    unfold_mapped,
)
from .validation import FLOAT_DTYPES, accumulation_dtype, check_qkv

EXTENSION_NAME = "kernelstudy_cpu"  # built as extension_name(): with a hash (-march=native)

_extension: ModuleType | None = None
_tried = False
_lock = threading.Lock()  # a second thread waits for the first build, not sees None
#: The most threads the kernel takes (a C int).
MAX_THREADS = 2**31 - 1


def extension() -> ModuleType | None:
    """The compiled module (built on the first call), or None if it cannot be built."""
    global _extension, _tried
    with _lock:
        if _tried:
            return _extension
        try:
            sources = [csrc_dir() / "cpu" / "binding.cpp"]
        except FileNotFoundError as err:
            _tried = True
            warnings.warn(f"{err}; falling back to the 'torch' backend", RuntimeWarning, 2)
            return None
        _extension = load_extension(
            extension_name(),
            sources,
            extra_cflags=[*native_cflags(), "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
        _tried = True  # only now: a build stopped by Ctrl-C is tried again on the next call
        return _extension


def extension_name() -> str:
    """The build's name: :data:`EXTENSION_NAME` and a hash of this CPU, torch, Python and
    the sources' folder (:func:`~kernelstudy.core.extensions.build_name`)."""
    return build_name(EXTENSION_NAME, native=True)


@constant_when_traced  # torch.compile asks once, outside the graph
def available() -> bool:
    """Whether the compiled kernel runs here (builds it on first call)."""
    return extension() is not None


def _kernels() -> ModuleType | TracedKernels:
    """The extension (built), or while ``torch.compile`` traces its functions as custom ops."""
    if torch.compiler.is_compiling():
        return TRACED_KERNELS
    return extension()


def supports(x: torch.Tensor) -> bool:
    """CPU tensors of any float dtype (half types are computed in float32)."""
    return x.device.type == "cpu" and x.dtype in FLOAT_DTYPES


@signature_once
class _CpuProduct(torch.autograd.Function):
    """The compiled causal (or anti-causal) product. A first-order backward of the causal
    product is one fused pass (dk and dv share it); under ``create_graph=True`` the
    gradients are three such products again, so double backward works too. ``torch.func``
    works through it: the product is linear in each of q, k, v (a jvp of three products),
    and vmap folds the mapped dimension into the batch."""

    @staticmethod
    def forward(q, k, v, threads, reverse):  # type: ignore[override]
        return _kernels().causal_product(q, k, v, reverse=reverse, threads=threads)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[override]
        q, k, v, threads, reverse = inputs
        ctx.save_for_backward(q, k, v)
        ctx.save_for_forward(q, k, v)
        ctx.threads, ctx.reverse = threads, reverse

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, k, v = ctx.saved_tensors
        need, threads, rev = needs_input_grad(ctx), ctx.threads, ctx.reverse
        if legacy_batched(grad):  # autograd.grad(is_grads_batched=True): torch ops
            product = chunked_product
        else:
            # the fused pass, unless the gradients must be differentiable or are torch.func's
            if not (torch.is_grad_enabled() or rev) and kernel_readable(grad, q, k, v):
                # dq = causal(grad, v, k), dk = anticausal(v, grad, q), dv = anticausal(k, q, grad)
                dq, dk, dv = _kernels().causal_product_backward(
                    q, k, v, grad, need[0], need[1], need[2], threads=threads
                )
                return dq, dk, dv, None, None

            def product(q, k, v, reverse):
                return _CpuProduct.apply(q, k, v, threads, reverse)

        dq = product(grad, v, k, rev) if need[0] else None
        dk = product(v, grad, q, not rev) if need[1] else None
        dv = product(k, q, grad, not rev) if need[2] else None
        return dq, dk, dv, None, None

    @staticmethod
    def jvp(ctx, dq, dk, dv, _threads, _reverse):  # type: ignore[override]
        refuse_nested_forward("the cpu backend")

        def product(q, k, v):
            return _CpuProduct.apply(q, k, v, ctx.threads, ctx.reverse)

        return trilinear_jvp(product, ctx.saved_tensors, (dq, dk, dv))

    @staticmethod
    def vmap(info, in_dims, q, k, v, threads, reverse):  # type: ignore[override]
        """``torch.func.vmap``: the mapped dimension (size V) joins the batch,
        ``(V,B,H,N,F) → (V·B,H,N,F)``, and is split off the output again."""
        size = info.batch_size
        q, k, v = (fold_mapped(size, t, d) for t, d in zip((q, k, v), in_dims[:3], strict=True))
        return unfold_mapped(size, _CpuProduct.apply(q, k, v, threads, reverse)), 0


_apply_cpu_product = traceable_apply(_CpuProduct)


def causal_dot_product_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_threads: int | None = None
) -> torch.Tensor:
    """``Σ_{j≤i} (q_i·k_j) v_j`` for CPU tensors ``q, k: (B,H,N,F)``, ``v: (B,H,N,M)``.

    Returns ``(B,H,N,M)`` in the accumulation dtype (float32, or float64 for float64
    inputs). ``num_threads`` defaults to ``torch.get_num_threads()`` (under ``torch.compile``,
    read when the compiled code runs); the result is the same for any thread count. Raises
    RuntimeError if the kernel could not be built.
    """
    check_qkv(q, k, v, names=("q", "k", "v"), causal=True)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cpu":
            raise ValueError(f"backend 'cpu' takes CPU tensors; {name} is on {t.device}")
    if num_threads is None:  # 0 in a compiled graph: torch's thread count when it runs
        num_threads = 0 if torch.compiler.is_compiling() else torch.get_num_threads()
    else:
        num_threads = check_count("num_threads", num_threads, 1, MAX_THREADS)
    if not available():
        raise RuntimeError("kernelstudy: the 'cpu' backend could not be built (see the warning)")
    acc = accumulation_dtype(q.dtype)
    return _apply_cpu_product(q.to(acc), k.to(acc), v.to(acc), num_threads, False)


register_backend(
    Backend(
        "cpu",
        causal_dot_product_cpu,
        available=available,
        supports=supports,
        priority=20,
        description="compiled C++/OpenMP kernel (csrc/cpu); float16/bfloat16 computed in float32",
    )
)
