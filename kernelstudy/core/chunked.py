"""Chunked causal product in plain PyTorch (the ``torch`` backend).

The sequence is cut into chunks of ``C`` steps. Within a chunk the product is a
masked ``C×C`` matrix product; across chunks, each chunk adds ``φq_c · S_c``
where ``S_c = Σ_{chunks before c} φk_cᵀ v_c`` is an exclusive prefix sum of
per-chunk states. The custom backward saves only ``q, k, v`` and recomputes
what it needs with the same algorithm (one causal and two anti-causal
products, themselves differentiable, so double backward works), so training memory is
linear in N: activations ``O(N·(F+M))`` plus
``O(N·C)`` intra-chunk scores and ``O(N/C·F·M)`` chunk states.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

from .transforms import (
    needs_input_grad,
    refuse_nested_forward,
    signature_once,
    traceable_apply,
    trilinear_jvp,
)
from .validation import accumulation_dtype, autocast_off, check_qkv

DEFAULT_CHUNK_SIZE = 64


def check_chunk_size(chunk_size: object) -> int:
    """``chunk_size`` as an int ≥ 1 (numpy's ints too), else ValueError naming it."""
    integral = isinstance(chunk_size, numbers.Integral) and not isinstance(chunk_size, bool)
    if not integral or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return int(chunk_size)


def _chunked_product(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int, reverse: bool
) -> torch.Tensor:
    """Causal (or, with ``reverse``, anti-causal ``j ≥ i``) product in the dtype of the inputs."""
    b, h, n, f = q.shape
    m = v.shape[-1]
    chunk = min(chunk, max(n, 1))
    pad = (-n) % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    c = (n + pad) // chunk
    qc = q.reshape(b, h, c, chunk, f)
    kc = k.reshape(b, h, c, chunk, f)
    vc = v.reshape(b, h, c, chunk, m)

    scores = qc @ kc.transpose(-1, -2)
    scores = torch.triu(scores) if reverse else torch.tril(scores)
    out = scores @ vc
    del scores

    states = kc.transpose(-1, -2) @ vc  # (b, h, c, f, m)
    if reverse:
        states = states.flip(2).cumsum(2).flip(2)
        prefix = F.pad(states[:, :, 1:], (0, 0, 0, 0, 0, 1))  # the chunks after each
    else:
        states = states.cumsum(2)
        prefix = F.pad(states[:, :, :-1], (0, 0, 0, 0, 1, 0))  # the chunks before each
    # (a pad, not a cat with zeros: with one chunk torch's older vmap, which
    # autograd.grad(is_grads_batched=True) uses, has no rule for the empty slice's alias)
    del states
    out = out + qc @ prefix
    out = out.reshape(b, h, c * chunk, m)
    # the padded tail sliced off in a copy: a view returned by an autograd Function breaks
    # forward-mode AD (an internal assert on the tangent's layout)
    return out[:, :, :n].clone() if pad else out


@signature_once
class _ChunkedProduct(torch.autograd.Function):
    """The causal (or anti-causal) product with a backward of three such products, each
    again a ``_ChunkedProduct``: gradients of gradients (``create_graph=True``) work too.
    The product is linear in each of q, k, v, so its jvp is three products as well; the vmap
    rule is generated, so ``torch.func`` transforms (vmap, jacrev, jvp) work through it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, chunk, reverse):  # type: ignore[override]
        acc = accumulation_dtype(q.dtype)
        return _chunked_product(q.to(acc), k.to(acc), v.to(acc), chunk, reverse)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[override]
        q, k, v, chunk, reverse = inputs
        ctx.save_for_backward(q, k, v)
        ctx.save_for_forward(q, k, v)
        ctx.chunk, ctx.reverse = chunk, reverse

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        with autocast_off(grad):
            return _ChunkedProduct._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):  # type: ignore[no-untyped-def]
        q, k, v = ctx.saved_tensors
        acc, chunk, rev = grad.dtype, ctx.chunk, ctx.reverse
        qa, ka, va = q.to(acc), k.to(acc), v.to(acc)
        need = needs_input_grad(ctx)
        dq = dk = dv = None
        # causal: dq_i = Σ_{j≤i} (g_i·v_j) k_j, dk_j = Σ_{i≥j} (v_j·g_i) q_i,
        # dv_j = Σ_{i≥j} (k_j·q_i) g_i; anti-causal: the same with the orders swapped
        if need[0]:
            dq = _ChunkedProduct.apply(grad, va, ka, chunk, rev).to(q.dtype)
        if need[1]:
            dk = _ChunkedProduct.apply(va, grad, qa, chunk, not rev).to(k.dtype)
        if need[2]:
            dv = _ChunkedProduct.apply(ka, qa, grad, chunk, not rev).to(v.dtype)
        return dq, dk, dv, None, None

    @staticmethod
    def jvp(ctx, dq, dk, dv, _chunk, _reverse):  # type: ignore[override]
        def product(q, k, v):
            return _ChunkedProduct.apply(q, k, v, ctx.chunk, ctx.reverse)

        refuse_nested_forward("the torch backend")
        with autocast_off(ctx.saved_tensors[0]):
            return trilinear_jvp(product, ctx.saved_tensors, (dq, dk, dv))


_apply_chunked_product = traceable_apply(_ChunkedProduct)


def causal_dot_product_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """``Σ_{j≤i} (q_i·k_j) v_j`` for ``q, k: (B,H,N,F)``, ``v: (B,H,N,M)``.

    Returns ``(B,H,N,M)`` in the accumulation dtype (float32, or float64 for
    float64 inputs); gradients come back in the input dtypes.
    """
    check_qkv(q, k, v, names=("q", "k", "v"), causal=True)
    chunk = check_chunk_size(chunk_size)
    with autocast_off(q):
        return _apply_chunked_product(q, k, v, chunk, False)


def chunked_product(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    reverse: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """The causal (``reverse``: anti-causal ``j ≥ i``) product of
    :func:`causal_dot_product_chunked`, inputs unchecked: the compiled backends' backward for
    gradients batched by torch's older vmap (:func:`~.transforms.legacy_batched`), which
    their kernels cannot read. Differentiable, in the accumulation dtype."""
    with autocast_off(q):
        return _ChunkedProduct.apply(q, k, v, chunk_size, reverse)
