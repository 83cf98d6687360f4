"""Normalized linear attention on features, and the unnormalized causal product.

``V'_i = φq_i · Σ_j φk_j v_jᵀ / (φq_i · Σ_j φk_j + eps)`` where the sums run
over every unmasked key (non-causal) or over ``j ≤ i`` (causal). Shapes follow
``scaled_dot_product_attention``: ``phi_q: (B,H,N,F)``, ``phi_k: (B,H,S,F)``,
``v: (B,H,S,M)``, result ``(B,H,N,M)``. Causal attention needs ``S == N``.

Causality holds for finite inputs. An unmasked inf or NaN in a later token's ``φk`` or
``v`` may reach earlier rows in these batch forms: they multiply blocks of keys before the
causal mask (0·inf is NaN), each backend in its own blocks, so which rows turn NaN differs
between backends. Stepping (:class:`~kernelstudy.core.RecurrentState`) reaches no earlier
row; padded tokens (``key_padding_mask``) are zeroed first and reach none.
"""

from __future__ import annotations

import torch

from .autocast import without_autocast
from .backends import check_backend_name, resolve_backend
from .chunked import causal_dot_product_chunked, check_chunk_size
from .transforms import (
    needs_input_grad,
    refuse_nested_forward,
    signature_once,
    traceable_apply,
)
from .validation import (
    accumulation_dtype,
    autocast_off,
    check_eps,
    check_qkv,
    zero_padded_keys,
)


def causal_dot_product(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    backend: str | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Unnormalized causal product ``out_i = Σ_{j≤i} (φq_i·φk_j) v_j``.

    ``phi_q, phi_k: (B,H,N,F)``, ``v: (B,H,N,M)`` → ``(B,H,N,M)`` in the input
    dtype (accumulated in float32 for half inputs). ``chunk_size`` selects the
    ``torch`` backend (:func:`check_chunked`).
    """
    check_qkv(phi_q, phi_k, v, causal=True)
    check_chunked(backend, chunk_size)
    with autocast_off(phi_q):
        return _causal_product(phi_q, phi_k, v, backend, chunk_size).to(phi_q.dtype)


def check_chunked(backend: object, chunk_size: object) -> None:
    """Check ``backend`` by name and ``chunk_size`` (an int ≥ 1 or None). A chunk size
    selects the ``torch`` backend, so ``backend`` must then be None, ``"auto"`` or
    ``"torch"`` (``KERNELSTUDY_BACKEND`` is not read)."""
    check_backend_name(backend)
    if chunk_size is None:
        return
    check_chunk_size(chunk_size)
    if backend not in (None, "auto", "torch"):
        raise ValueError(f"chunk_size applies to backend='torch' only, got backend={backend!r}")


def _causal_product(phi_q, phi_k, v, backend, chunk_size) -> torch.Tensor:
    if chunk_size is not None:
        return causal_dot_product_chunked(phi_q, phi_k, v, chunk_size)
    return resolve_backend(backend, phi_q).product(phi_q, phi_k, v)


def linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = 1e-6,
    backend: str | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Normalized kernel attention on features.

    Args:
        phi_q: query features ``(B,H,N,F)``.
        phi_k: key features ``(B,H,S,F)``.
        v: values ``(B,H,S,M)``.
        causal: sum over ``j ≤ i`` only (needs ``S == N``).
        key_padding_mask: ``(B,S)`` bool, True for real tokens; padded keys
            contribute nothing whatever they hold.
        eps: added to the normalizer (> 0).
        backend: ``"auto"``, ``"torch"``, ``"reference"``, or a compiled one
            (see :func:`kernelstudy.backends`); None reads ``KERNELSTUDY_BACKEND``.
        chunk_size: chunk length of the ``torch`` backend, which it selects.

    Returns:
        ``(B,H,N,M)`` in the input dtype; sums accumulate in float32 (also under autocast,
        which the core turns off: the inputs' dtype decides).
    """
    causal = check_qkv(phi_q, phi_k, v, causal=causal)
    eps = check_eps(eps, phi_q.dtype)
    check_chunked(backend, chunk_size)  # in every mode, also where no chunk is used
    with autocast_off(phi_q):
        return _attend(phi_q, phi_k, v, causal, key_padding_mask, eps, backend, chunk_size)


def _attend(phi_q, phi_k, v, causal, key_padding_mask, eps, backend, chunk_size) -> torch.Tensor:
    """:func:`linear_attention` on checked arguments."""
    if backend == "reference":
        return linear_attention_reference(phi_q, phi_k, v, causal, key_padding_mask, eps)
    if chunk_size is None:
        # non-causal: only a fused attention runs (the causal product resolves fully)
        chosen = resolve_backend(backend, phi_q, for_attention=not causal)
        if chosen.attention is not None:
            return chosen.attention(phi_q, phi_k, v, causal, key_padding_mask, eps)
    phi_k, v = zero_padded_keys(phi_k, v, key_padding_mask)
    acc = accumulation_dtype(phi_q.dtype)
    if causal:
        # One causal product with a column of ones appended to v yields the
        # numerator and the normalizer Σ_{j≤i} φq_i·φk_j together.
        ones = v.new_ones(*v.shape[:-1], 1)
        both = _causal_product(phi_q, phi_k, torch.cat([v, ones], dim=-1), backend, chunk_size)
        num, den = both[..., :-1].to(acc), both[..., -1:].to(acc)
    else:
        if backend is not None:
            resolve_backend(backend, phi_q, for_attention=True)  # the name, checked
        num, den = _noncausal_sums(phi_q, phi_k, v)
    return (num / (den + eps)).to(phi_q.dtype)


def _noncausal_sums(phi_q, phi_k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """``(φq·Σ φk vᵀ, φq·Σ φk)`` in the accumulation dtype, autocast off in both passes."""
    both, _ = _apply_noncausal_sums(phi_q, phi_k, v)
    return both[..., :-1], both[..., -1:]


@signature_once
class _NoncausalSums(torch.autograd.Function):
    """``φq · Σ_j φk_j [v_j, 1]ᵀ``: ``(B,H,N,M+1)`` in the accumulation dtype, with the
    backward (and forward-mode jvp) written out and run with autocast off too (plain
    autograd ops ran theirs in half precision when ``backward()`` was called inside an
    autocast region). The sums ``kv = Σ_j φk_j [v_j, 1]ᵀ`` ``(B,H,F,M+1)`` are a second,
    non-differentiable output, so the backward reuses them; the vmap rule is generated, so
    ``torch.func`` transforms work through it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v):  # type: ignore[override]
        acc = accumulation_dtype(q.dtype)
        with autocast_off(q):
            kv = k.to(acc).transpose(-1, -2) @ _with_ones(v, acc)
            return q.to(acc) @ kv, kv

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[override]
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(*inputs, output[1])
        ctx.save_for_forward(*inputs, output[1])

    @staticmethod
    def backward(ctx, grad, _grad_kv):  # type: ignore[override]
        q, k, v, kv = ctx.saved_tensors
        acc, m = grad.dtype, v.shape[-1]
        need = needs_input_grad(ctx)
        dq = dk = dv = None
        with autocast_off(grad):
            if need[0]:
                if torch.is_grad_enabled():  # create_graph: kv again, with a graph to k and v
                    kv = k.to(acc).transpose(-1, -2) @ _with_ones(v, acc)
                dq = (grad @ kv.transpose(-1, -2)).to(q.dtype)
            if need[1] or need[2]:
                dkv = q.to(acc).transpose(-1, -2) @ grad  # (B,H,F,M+1)
                if need[1]:
                    dk = (_with_ones(v, acc) @ dkv.transpose(-1, -2)).to(k.dtype)
                if need[2]:
                    dv = (k.to(acc) @ dkv[..., :m]).to(v.dtype)
        return dq, dk, dv

    @staticmethod
    def jvp(ctx, dq, dk, dv):  # type: ignore[override]
        refuse_nested_forward("non-causal attention on the torch and cpu backends")
        q, k, v, kv = ctx.saved_tensors
        acc = kv.dtype
        with autocast_off(q):
            if torch.is_grad_enabled():  # a backward through the tangent: kv with a graph
                kv = k.to(acc).transpose(-1, -2) @ _with_ones(v, acc)
            dkv = torch.zeros_like(kv)  # the tangent of kv
            if dk is not None:
                dkv = dkv + dk.to(acc).transpose(-1, -2) @ _with_ones(v, acc)
            if dv is not None:
                dv1 = torch.cat([dv.to(acc), torch.zeros_like(dv[..., :1], dtype=acc)], -1)
                dkv = dkv + k.to(acc).transpose(-1, -2) @ dv1
            out = q.to(acc) @ dkv
            if dq is not None:
                out = out + dq.to(acc) @ kv
        return out, None  # kv is not differentiable


_apply_noncausal_sums = traceable_apply(_NoncausalSums)


def _with_ones(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[v, 1]``: ``(..., M) → (..., M+1)`` in ``dtype``."""
    return torch.cat([v.to(dtype), torch.ones(*v.shape[:-1], 1, dtype=dtype, device=v.device)], -1)


def linear_attention_reference(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Ground truth of :func:`linear_attention` through the explicit ``(B,H,N,S)`` kernel matrix."""
    causal = check_qkv(phi_q, phi_k, v, causal=causal)
    eps = check_eps(eps, phi_q.dtype)
    acc = accumulation_dtype(phi_q.dtype)
    phi_k, v = zero_padded_keys(phi_k, v, key_padding_mask)  # before any product: no 0·NaN

    def attention(q, k, v):
        scores = q.to(acc) @ k.to(acc).transpose(-1, -2)
        if causal:
            scores = torch.tril(scores)
        return (scores @ v.to(acc)) / (scores.sum(-1, keepdim=True) + eps)

    return without_autocast(attention, phi_q, phi_k, v).to(phi_q.dtype)
