"""The compiled extensions' functions as ``torch.library`` custom ops, which ``torch.compile``
traces.

Dynamo cannot trace into a pybind11 function: a call of one is a graph break, an error under
``fullgraph=True``. A custom op stays in the graph as one node, and its fake implementation gives
its outputs' shapes and dtypes without running a kernel. The backends call their extension
directly in eager mode (a custom op's dispatch costs host time on every call) and the namespaces
here, :data:`CPU` and :data:`CUDA`, while torch.compile traces. Each has its extension's functions
with their signatures, defaults and results (None where the extension returns None), so the
backends' code is the same either way. Outputs are new contiguous tensors, as the extensions'.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch
from torch import Tensor

_EMPTY_SHAPE = (0,)  # an output the extension leaves undefined (None): a custom op returns this


def _defined(t: Tensor | None, like: Tensor) -> Tensor:
    """``t``, or an empty float32 tensor on ``like``'s device where ``t`` is None."""
    return like.new_empty(_EMPTY_SHAPE, dtype=torch.float32) if t is None else t


def _empty(like: Tensor, shape: Sequence[int], dtype: torch.dtype | None = None) -> Tensor:
    return like.new_empty(tuple(shape), dtype=like.dtype if dtype is None else dtype)


# ---------------------------------------------------------------- cpu (csrc/cpu/binding.cpp)
def _cpu() -> ModuleType:
    from . import cpu_backend

    module = cpu_backend.extension()
    if module is None:
        raise RuntimeError("kernelstudy: the 'cpu' backend could not be built (see the warning)")
    return module


def _threads(threads: int) -> int:
    """``threads``, where 0 (the compiled graph's default) is torch's thread count when run."""
    return torch.get_num_threads() if threads == 0 else threads


@torch.library.custom_op("kernelstudy::cpu_causal_product", mutates_args=())
def _cpu_causal_product(q: Tensor, k: Tensor, v: Tensor, reverse: bool, threads: int) -> Tensor:
    return _cpu().causal_product(q, k, v, reverse=reverse, threads=_threads(threads))


@_cpu_causal_product.register_fake
def _(q, k, v, reverse, threads):
    return _empty(v, v.shape)


@torch.library.custom_op("kernelstudy::cpu_causal_product_backward", mutates_args=())
def _cpu_causal_product_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    grad: Tensor,
    need_dq: bool,
    need_dk: bool,
    need_dv: bool,
    threads: int,
) -> list[Tensor]:
    grads = _cpu().causal_product_backward(
        q, k, v, grad, need_dq, need_dk, need_dv, threads=_threads(threads)
    )
    return [_defined(t, q) for t in grads]


@_cpu_causal_product_backward.register_fake
def _(q, k, v, grad, need_dq, need_dk, need_dv, threads):
    return [
        _empty(x, x.shape) if need else _defined(None, q)
        for x, need in ((q, need_dq), (k, need_dk), (v, need_dv))
    ]


class CpuKernels:
    """``csrc/cpu/binding.cpp``'s functions on custom ops; ``threads=0`` reads torch's thread
    count when the graph runs."""

    @staticmethod
    def causal_product(
        q: Tensor, k: Tensor, v: Tensor, reverse: bool = False, threads: int = 1
    ) -> Tensor:
        return _cpu_causal_product(q, k, v, reverse, threads)

    @staticmethod
    def causal_product_backward(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        grad: Tensor,
        need_dq: bool = True,
        need_dk: bool = True,
        need_dv: bool = True,
        threads: int = 1,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        dq, dk, dv = _cpu_causal_product_backward(q, k, v, grad, need_dq, need_dk, need_dv, threads)
        return (dq if need_dq else None, dk if need_dk else None, dv if need_dv else None)


CPU = CpuKernels()


# ---------------------------------------------------------------- cuda (csrc/cuda/binding.cpp)
def _cuda() -> ModuleType:
    from . import cuda_backend

    return cuda_backend.extension_or_raise()


@torch.library.custom_op("kernelstudy::cuda_causal_product", mutates_args=())
def _cuda_causal_product(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    reverse: bool,
    out_fp32: bool,
    with_den: bool,
    normalize: bool,
    eps: float,
    walk_blocks: int,
    mma_walk: bool,
) -> list[Tensor]:
    out, den = _cuda().causal_product(
        q,
        k,
        v,
        reverse=reverse,
        out_fp32=out_fp32,
        with_den=with_den,
        normalize=normalize,
        eps=eps,
        walk_blocks=walk_blocks,
        mma_walk=mma_walk,
    )
    return [out, _defined(den, q)]


@_cuda_causal_product.register_fake
def _(q, k, v, reverse, out_fp32, with_den, normalize, eps, walk_blocks, mma_walk):
    b, h, n, _ = q.shape
    out = _empty(q, (b, h, n, v.shape[-1]), torch.float32 if out_fp32 else q.dtype)
    den = _empty(q, (b, h, n), torch.float32) if with_den else _defined(None, q)
    return [out, den]


@torch.library.custom_op("kernelstudy::cuda_causal_backward", mutates_args=())
def _cuda_causal_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    out_fp32: bool,
    dv_fp32: bool | None,
    walk_blocks: int,
    mma_walk: bool,
    walks_together: bool,
) -> list[Tensor]:
    return list(
        _cuda().causal_backward(
            q,
            k,
            v,
            g,
            out_fp32=out_fp32,
            dv_fp32=dv_fp32,
            walk_blocks=walk_blocks,
            mma_walk=mma_walk,
            walks_together=walks_together,
        )
    )


@_cuda_causal_backward.register_fake
def _(q, k, v, g, out_fp32, dv_fp32, walk_blocks, mma_walk, walks_together):
    dv32 = out_fp32 if dv_fp32 is None else dv_fp32
    dtype = torch.float32 if out_fp32 else q.dtype
    return [
        _empty(q, q.shape, dtype),
        _empty(q, q.shape, dtype),
        _empty(q, v.shape, torch.float32 if dv32 else q.dtype),
    ]


@torch.library.custom_op("kernelstudy::cuda_full_state", mutates_args=())
def _cuda_full_state(k: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    return _cuda().full_state(k, v, key_padding_mask)


@_cuda_full_state.register_fake
def _(k, v, key_padding_mask):
    b, h, _, f = k.shape
    return _empty(k, (b, h, f * v.shape[-1] + f), torch.float32)


@torch.library.custom_op("kernelstudy::cuda_full_apply", mutates_args=())
def _cuda_full_apply(
    q: Tensor,
    state: Tensor,
    m: int,
    out_fp32: bool,
    with_den: bool,
    normalize: bool,
    eps: float,
    bias: Tensor | None,
    key_padding_mask: Tensor | None,
    out_dtype: torch.dtype | None,
) -> list[Tensor]:
    out, den = _cuda().full_apply(
        q,
        state,
        m,
        out_fp32=out_fp32,
        with_den=with_den,
        normalize=normalize,
        eps=eps,
        bias=bias,
        key_padding_mask=key_padding_mask,
        out_dtype=out_dtype,
    )
    return [out, _defined(den, q)]


@_cuda_full_apply.register_fake
def _(q, state, m, out_fp32, with_den, normalize, eps, bias, key_padding_mask, out_dtype):
    b, h, n, _ = q.shape
    dtype = torch.float32 if out_fp32 else (q.dtype if out_dtype is None else out_dtype)
    den = _empty(q, (b, h, n), torch.float32) if with_den else _defined(None, q)
    return [_empty(q, (b, h, n, m), dtype), den]


@torch.library.custom_op("kernelstudy::cuda_scaled_cumsum", mutates_args=())
def _cuda_scaled_cumsum(
    x: Tensor,
    pre: Tensor | None,
    post: Tensor | None,
    reverse: bool,
    base: Tensor | None,
    out_fp32: bool,
) -> Tensor:
    return _cuda().scaled_cumsum(x, pre, post, reverse=reverse, base=base, out_fp32=out_fp32)


@_cuda_scaled_cumsum.register_fake
def _(x, pre, post, reverse, base, out_fp32):
    return _empty(x, x.shape, torch.float32 if out_fp32 else x.dtype)


@torch.library.custom_op("kernelstudy::cuda_normalized_grad", mutates_args=())
def _cuda_normalized_grad(
    g: Tensor, out: Tensor, den: Tensor, eps: float, dden_column: bool, dnum_fp32: bool
) -> list[Tensor]:
    dnum, dden = _cuda().normalized_grad(
        g, out, den, eps, dden_column=dden_column, dnum_fp32=dnum_fp32
    )
    return [dnum, _defined(dden, g)]


@_cuda_normalized_grad.register_fake
def _(g, out, den, eps, dden_column, dnum_fp32):
    b, h, n, m = g.shape
    bf16 = g.dtype == torch.bfloat16 and not dnum_fp32
    # int(): torch 2.11's opcheck could not add a bool to a symbolic size (the H200, 2026-11-30)
    dnum = _empty(g, (b, h, n, m + int(dden_column)), g.dtype if bf16 else torch.float32)
    dden = _defined(None, g) if dden_column else _empty(g, (b, h, n), torch.float32)
    return [dnum, dden]


class CudaKernels:
    """``csrc/cuda/binding.cpp``'s functions (all but ``walk_kernels``, which reports and
    launches nothing) on custom ops."""

    @staticmethod
    def causal_product(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        reverse: bool = False,
        out_fp32: bool = True,
        with_den: bool = False,
        normalize: bool = False,
        eps: float = 1e-6,
        walk_blocks: int = 0,
        mma_walk: bool = False,
    ) -> list[Tensor | None]:
        out, den = _cuda_causal_product(
            q, k, v, reverse, out_fp32, with_den, normalize, eps, walk_blocks, mma_walk
        )
        return [out, den if with_den else None]

    @staticmethod
    def causal_backward(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        out_fp32: bool = False,
        dv_fp32: bool | None = None,
        walk_blocks: int = 0,
        mma_walk: bool = False,
        walks_together: bool = True,
    ) -> list[Tensor]:
        return _cuda_causal_backward(
            q, k, v, g, out_fp32, dv_fp32, walk_blocks, mma_walk, walks_together
        )

    @staticmethod
    def full_state(k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        return _cuda_full_state(k, v, key_padding_mask)

    @staticmethod
    def full_apply(
        q: Tensor,
        state: Tensor,
        m: int,
        out_fp32: bool = True,
        with_den: bool = False,
        normalize: bool = False,
        eps: float = 1e-6,
        bias: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> list[Tensor | None]:
        out, den = _cuda_full_apply(
            q, state, m, out_fp32, with_den, normalize, eps, bias, key_padding_mask, out_dtype
        )
        return [out, den if with_den else None]

    @staticmethod
    def scaled_cumsum(
        x: Tensor,
        pre: Tensor | None = None,
        post: Tensor | None = None,
        reverse: bool = False,
        base: Tensor | None = None,
        out_fp32: bool = True,
    ) -> Tensor:
        return _cuda_scaled_cumsum(x, pre, post, reverse, base, out_fp32)

    @staticmethod
    def normalized_grad(
        g: Tensor,
        out: Tensor,
        den: Tensor,
        eps: float,
        dden_column: bool = False,
        dnum_fp32: bool = False,
    ) -> list[Tensor | None]:
        dnum, dden = _cuda_normalized_grad(g, out, den, eps, dden_column, dnum_fp32)
        return [dnum, None if dden_column else dden]


CUDA = CudaKernels()
