"""The core on features: every backend equals the reference on awkward shapes.

Tolerances: fp32 max relative error ≤ 1e-5 (outputs and the gradients of
φq, φk and v); float64 checked with ``torch.autograd.gradcheck``.
"""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwAD

import kernelstudy as ks
from kernelstudy.core import causal_dot_product_reference, linear_attention_reference

from .conftest import compiled_whole, rel_err

# Backends that take CPU tensors (a GPU backend has its own tests).
_CPU = torch.zeros(1, 1, 1, 1)
FAST_BACKENDS = [
    b for b in ks.backends() if b != "reference" and ks.core.registered_backends()[b].supports(_CPU)
]

# (B, H, N, F, M, chunk): N not a multiple of the chunk, N=1, F≠M, batch 1 and 3.
SHAPES = [
    (1, 1, 1, 4, 3, 64),
    (2, 3, 37, 8, 5, 16),
    (3, 2, 130, 96, 40, 64),
    (1, 4, 64, 16, 16, 64),
    (1, 1, 257, 7, 11, 32),
]


def _features(b, h, n, f, m, dtype=torch.float32, requires_grad=True):
    q = torch.rand(b, h, n, f, dtype=dtype)
    k = torch.rand(b, h, n, f, dtype=dtype)
    v = torch.randn(b, h, n, m, dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, g)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_causal_product_matches_reference(backend, shape):
    b, h, n, f, m, chunk = shape
    q, k, v = _features(b, h, n, f, m)
    want = causal_dot_product_reference(q, k, v)
    kw = {"chunk_size": chunk} if backend == "torch" else {}
    got = ks.causal_dot_product(q, k, v, backend=backend, **kw)
    assert got.shape == (b, h, n, m) and got.dtype == torch.float32
    assert rel_err(got, want) <= 1e-5
    for g_got, g_want in zip(_grads(got, (q, k, v)), _grads(want, (q, k, v)), strict=True):
        assert rel_err(g_got, g_want) <= 1e-5


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_linear_attention_matches_reference(backend, causal, shape):
    b, h, n, f, m, _ = shape
    q, k, v = _features(b, h, n, f, m)
    want = linear_attention_reference(q, k, v, causal=causal)
    got = ks.linear_attention(q, k, v, causal=causal, backend=backend)
    assert rel_err(got, want) <= 1e-5
    # Normalized outputs and upstream gradients are O(1): gradients are compared at scale ≥ 1.
    for g_got, g_want in zip(_grads(got, (q, k, v)), _grads(want, (q, k, v)), strict=True):
        assert rel_err(g_got, g_want, floor=1.0) <= 1e-5


def test_reference_backend_is_explicit():
    q, k, v = _features(2, 2, 9, 4, 3, requires_grad=False)
    scores = torch.tril(q @ k.transpose(-1, -2))
    want = (scores @ v) / (scores.sum(-1, keepdim=True) + 1e-6)
    assert rel_err(ks.linear_attention(q, k, v, causal=True, backend="reference"), want) <= 1e-6
    assert rel_err(ks.causal_dot_product(q, k, v, backend="reference"), scores @ v) <= 1e-6


def test_which_backends_run_their_own_noncausal_attention():
    """An unknown name was a bare KeyError ('CPU'), where every other entry point names
    the argument and the backends."""
    assert ks.core.runs_own_noncausal_attention("torch")
    assert not ks.core.runs_own_noncausal_attention("cpu")  # non-causal: the torch path
    for name in ("CPU", "auto"):
        with pytest.raises(ValueError, match=r"name must be a registered backend \(reference"):
            ks.core.runs_own_noncausal_attention(name)
    with pytest.raises(TypeError, match="name must be a str"):
        ks.core.runs_own_noncausal_attention(3)


def test_noncausal_cross_attention_lengths():
    q = torch.rand(2, 3, 5, 6)
    k, v = torch.rand(2, 3, 9, 6), torch.randn(2, 3, 9, 4)
    got = ks.linear_attention(q, k, v)
    assert got.shape == (2, 3, 5, 4)
    assert rel_err(got, linear_attention_reference(q, k, v)) <= 1e-5


@pytest.mark.parametrize("backend", ["reference", *FAST_BACKENDS])
@pytest.mark.parametrize("causal", [False, True])
def test_key_padding_ignores_garbage(backend, causal):
    b, h, n, f, m = 3, 2, 21, 8, 5
    q, k, v = _features(b, h, n, f, m, requires_grad=False)
    lengths = torch.tensor([21, 13, 1])
    mask = torch.arange(n)[None, :] < lengths[:, None]
    out = ks.linear_attention(q, k, v, causal=causal, key_padding_mask=mask, backend=backend)
    k2, v2 = k.clone(), v.clone()
    pad = ~mask[:, None, :, None]
    k2 = torch.where(pad, torch.full_like(k2, 1e30), k2)
    v2 = torch.where(pad, torch.full_like(v2, -1e30), v2)
    out2 = ks.linear_attention(q, k2, v2, causal=causal, key_padding_mask=mask, backend=backend)
    assert torch.isfinite(out2).all()
    assert torch.equal(out, out2)
    # Each sequence alone, truncated to its real length, gives the same answer.
    for i, length in enumerate(lengths.tolist()):
        sl = slice(0, length)
        alone = ks.linear_attention(
            q[i : i + 1, :, sl] if causal else q[i : i + 1],
            k[i : i + 1, :, sl],
            v[i : i + 1, :, sl],
            causal=causal,
            backend="reference",
        )
        got = out[i : i + 1, :, sl] if causal else out[i : i + 1]
        assert rel_err(got, alone) <= 1e-5


@pytest.mark.parametrize("backend", ["reference", *FAST_BACKENDS])
@pytest.mark.parametrize("causal", [False, True])
def test_nan_in_padded_keys_reaches_no_gradient(backend, causal):
    q, k, v = _features(2, 1, 9, 4, 3, requires_grad=False)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 5:] = False
    grads = []
    for filler in (0.0, float("nan")):
        held = [t.clone() for t in (k, v)]
        for t in held:
            t[1, :, 5:] = filler
        inputs = [t.requires_grad_() for t in (q.clone(), *held)]
        out = ks.linear_attention(*inputs, causal=causal, key_padding_mask=mask, backend=backend)
        grads.append(_grads(out, inputs))
    for clean, dirty in zip(*grads, strict=True):
        assert torch.isfinite(dirty).all()
        torch.testing.assert_close(dirty, clean, rtol=0, atol=0)


def test_padding_gradients_are_zero():
    q, k, v = _features(2, 1, 10, 4, 3)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 6:] = False
    out = ks.linear_attention(q, k, v, key_padding_mask=mask)
    _, dk, dv = _grads(out, (q, k, v))
    assert torch.all(dk[1, :, 6:] == 0) and torch.all(dv[1, :, 6:] == 0)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_float64_gradcheck(backend, causal):
    q, k, v = _features(2, 2, 7, 3, 4, dtype=torch.float64)

    def fn(q, k, v):
        return ks.linear_attention(q, k, v, causal=causal, backend=backend)

    assert torch.autograd.gradcheck(fn, (q, k, v))
    assert torch.autograd.gradgradcheck(fn, (q, k, v))  # gradients of gradients too


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_second_derivatives_match_the_reference(backend):
    q, k, v = _features(2, 1, 9, 3, 4, dtype=torch.float64)
    grads = {}
    for name in ("reference", backend):
        out = ks.causal_dot_product(q, k, v, backend=name)
        (dq,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
        grads[name] = torch.autograd.grad(dq.pow(2).sum(), (q, k, v))
    for got, want in zip(grads[backend], grads["reference"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def _plain_attention(q, k, v, causal):
    """Normalized kernel attention written with plain ops (no custom autograd Function)."""
    a = q @ k.transpose(-1, -2)
    if causal:
        a = torch.tril(a)
    return (a @ v) / (a.sum(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("backend", ["reference", *FAST_BACKENDS])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_func_transforms_match_plain_autograd(backend, causal):
    """``torch.func`` (jacrev, jacfwd, jvp, vmap, vmap of grad, jacfwd of jacrev) and
    forward-mode AD work through the core's autograd Functions (they had no
    ``setup_context``, so every transform raised; the reference had no jvp; the chunked
    product returned a view, which broke dual tensors when N is not a multiple of the
    chunk) and give what plain ops give; float64, max abs error ≤ 1e-10. N=9 with chunk 4
    crosses chunks."""
    q, k, v = _features(2, 1, 9, 3, 4, dtype=torch.float64, requires_grad=False)
    extra = {"chunk_size": 4} if backend == "torch" else {}

    def fn(q, k, v):
        return ks.linear_attention(q, k, v, causal=causal, backend=backend, eps=1e-6, **extra)

    def plain(q, k, v):
        return _plain_attention(q, k, v, causal)

    close = dict(rtol=0, atol=1e-10)
    for transform in (torch.func.jacrev, torch.func.jacfwd):
        got = transform(fn, argnums=(0, 1, 2))(q, k, v)
        want = torch.autograd.functional.jacobian(plain, (q, k, v))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, **close)
    tangents = tuple(torch.randn_like(t) for t in (q, k, v))
    got = torch.func.jvp(fn, (q, k, v), tangents)
    want = torch.autograd.functional.jvp(plain, (q, k, v), tangents)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **close)
    stacked = [torch.stack([t, 2 * t, t + 1]) for t in (q, k, v)]
    got = torch.func.vmap(fn)(*stacked)
    want = torch.stack([plain(*(t[i] for t in stacked)) for i in range(3)])
    torch.testing.assert_close(got, want, **close)
    got = torch.func.vmap(fn, in_dims=(0, None, 0))(stacked[0], k, stacked[2])
    want = torch.stack([plain(stacked[0][i], k, stacked[2][i]) for i in range(3)])
    torch.testing.assert_close(got, want, **close)
    weights = torch.randn_like(plain(q, k, v))
    got = torch.func.vmap(torch.func.grad(lambda *t: (fn(*t) * weights).sum(), argnums=(0, 1, 2)))(
        *stacked
    )
    for i in range(3):
        want = torch.func.grad(lambda *t: (plain(*t) * weights).sum(), argnums=(0, 1, 2))(
            *(t[i] for t in stacked)
        )
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g[i], w, **close)
    # forward over reverse (a Hessian), and forward-mode AD on dual tensors (gradcheck)
    got = torch.func.jacfwd(torch.func.jacrev(lambda q: (fn(q, k, v) * weights).sum()))(q)
    want = torch.autograd.functional.hessian(lambda q: (plain(q, k, v) * weights).sum(), q)
    torch.testing.assert_close(got, want, **close)
    q_dual = q.clone().requires_grad_()  # N=9 with chunk 4: a padded tail
    assert torch.autograd.gradcheck(lambda q: fn(q, k, v), q_dual, check_forward_ad=True)


@pytest.mark.parametrize("backend", ["reference", *FAST_BACKENDS])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [5, 9], ids=["one_chunk", "two_chunks"])
def test_jacobians_without_grad_mode_batched_and_dual_match_plain_ops(backend, causal, n):
    """Routes that reach a backward with grad mode off or with batched gradients: jacrev under
    ``no_grad`` and ``inference_mode`` and a vjp's function called under ``no_grad`` (the cpu
    kernel's fused backward was handed torch.func's wrapped gradients: "Cannot access data
    pointer"), the jacobian by batched gradients (``vectorize=True``, torch's older vmap: the cpu
    kernel could not read its batch, and the torch backend's anti-causal prefix of one chunk had
    no batching rule), gradcheck with batched gradients; forward-mode AD on dual tensors of
    inputs that require grad (the reference's autocast-free sums ran ``torch.func.jvp``, which
    refuses to nest in a dual level), gradgradcheck forward over reverse. Float64, max abs error
    ≤ 1e-10 against plain ops; the torch backend in chunks of 8."""
    q, k, v = _features(1, 2, n, 3, 4, dtype=torch.float64, requires_grad=False)
    extra = {"chunk_size": 8} if backend == "torch" else {}

    def fn(q, k, v):
        return ks.linear_attention(q, k, v, causal=causal, backend=backend, eps=1e-6, **extra)

    def plain(q, k, v):
        return _plain_attention(q, k, v, causal)

    close = dict(rtol=0, atol=1e-10)
    want = torch.autograd.functional.jacobian(plain, (q, k, v))
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            got = torch.func.jacrev(fn, argnums=(0, 1, 2))(q, k, v)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, **close)
    got = torch.autograd.functional.jacobian(fn, (q, k, v), vectorize=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **close)
    out, pull = torch.func.vjp(fn, q, k, v)
    weights = torch.randn_like(out)
    with torch.no_grad():
        got = pull(weights)
    plain_pull = torch.func.vjp(plain, q, k, v)[1]
    for g, w in zip(got, plain_pull(weights), strict=True):
        torch.testing.assert_close(g, w, **close)
    tangents = [torch.randn_like(t) for t in (q, k, v)]
    for needs_grad in (False, True):
        with fwAD.dual_level():
            duals = [
                fwAD.make_dual(t.clone().requires_grad_(needs_grad), d)
                for t, d in zip((q, k, v), tangents, strict=True)
            ]
            got = fwAD.unpack_dual(fn(*duals)).tangent
        want_tangent = torch.func.jvp(plain, (q, k, v), tuple(tangents))[1]
        torch.testing.assert_close(got, want_tangent, **close)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(fn, inputs, check_batched_grad=True)
    assert torch.autograd.gradgradcheck(fn, inputs, check_fwd_over_rev=True)


@pytest.mark.parametrize("backend", ["reference", *FAST_BACKENDS])
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_torch_func_gradients_of_computed_inputs_match_eager(backend, causal):
    """``torch.compile`` of ``torch.func.grad``/``vjp`` where one of a Function's inputs is
    computed in the function (v here, and in causal attention v gains a column of ones) and
    the others are its arguments: torch reported False in ``needs_input_grad`` for those,
    and the torch backend's causal dq and dk were silently 0 (``transforms.needs_input_grad``).
    Dynamo alone (backend "eager"); float64, equal to eager mode to 1e-12."""
    q, k, v = _features(1, 2, 5, 3, 4, dtype=torch.float64, requires_grad=False)
    w = torch.randn(1, 2, 5, 4, dtype=torch.float64)

    def loss(q, k, v):
        out = ks.linear_attention(q, k, v * 2.0, causal=causal, backend=backend)
        return (out * w).sum()

    def pulled(q, k, v):
        return torch.func.vjp(lambda *x: loss(*x), q, k, v)[1](torch.tensor(1.0, dtype=q.dtype))

    for fn in (torch.func.grad(loss, argnums=(0, 1, 2)), pulled):
        torch._dynamo.reset()
        got = torch.compile(fn, backend="eager", fullgraph=True)(q, k, v)
        for g, e in zip(got, fn(q, k, v), strict=True):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["reference", *FAST_BACKENDS])
@pytest.mark.parametrize("causal", [False, True])
def test_mixed_forward_derivatives_are_right_or_refused(backend, causal):
    """Forward mode inside forward mode (jvp of jvp): torch drops the outer level's tangent
    of a Function's saved inputs in its jvp rule, so the torch and cpu backends' mixed
    derivatives were silently wrong (1.9 off for 2); they raise now, naming the remedy, and
    the reference (plain ops there) is right, also with inputs that require grad. A backward
    through a dual tensor's tangent (non-causal: the tangent was built from the sums saved
    without a graph, so its gradients to k and v were wrong) matches plain ops.
    Float64, ≤ 1e-12."""
    q, k, v = _features(1, 1, 4, 2, 3, dtype=torch.float64, requires_grad=False)
    d, dk = torch.randn_like(q), torch.randn_like(k)

    def fn(q, k, v):
        return ks.linear_attention(q, k, v, causal=causal, backend=backend, eps=1e-6)

    def plain(q, k, v):
        return _plain_attention(q, k, v, causal)

    def mixed(f, k):
        inner = lambda x: torch.func.jvp(f, (x, k, v), (torch.zeros_like(x), dk, 0 * v))[1]  # noqa: E731
        return torch.func.jvp(inner, (q,), (d,))[1]

    want = mixed(plain, k)
    if backend == "reference":
        for key in (k, k.clone().requires_grad_()):
            torch.testing.assert_close(mixed(fn, key), want, rtol=1e-12, atol=1e-12)
    else:
        with pytest.raises(RuntimeError, match="forward mode inside forward mode"):
            mixed(fn, k)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(fn(fwAD.make_dual(ins[0], d), ins[1], ins[2])).tangent
    got = torch.autograd.grad(tangent.sum(), ins)
    plain_ins = [t.clone().requires_grad_() for t in (q, k, v)]
    plain_tangent = torch.func.jvp(lambda x: plain(x, *plain_ins[1:]), (plain_ins[0],), (d,))[1]
    for g, w in zip(got, torch.autograd.grad(plain_tangent.sum(), plain_ins), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["reference", *FAST_BACKENDS])
def test_vmap_over_an_inner_dimension_equals_a_loop(backend):
    """``vmap`` over axis 2 of (B, H, V, N, F) inputs, results stacked at axis 2, equals a
    loop over that axis (a vmap rule that moved axis 0 to the mapped axis instead of the
    mapped axis to 0 would give wrong sums, or a shape error)."""
    torch.manual_seed(0)
    q, k, v = (torch.rand(2, 1, 3, 5, 4, dtype=torch.float64) for _ in range(3))

    def fn(q, k, v):
        return ks.linear_attention(q, k, v, causal=True, backend=backend)

    got = torch.func.vmap(fn, in_dims=2, out_dims=2)(q, k, v)
    want = torch.stack([fn(q[:, :, i], k[:, :, i], v[:, :, i]) for i in range(3)], 2)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)

    def product(q, k, v):
        return ks.causal_dot_product(q, k, v, backend=backend)

    got = torch.func.vmap(product, in_dims=(2, None, 2), out_dims=2)(q, k[:, :, 0], v)
    want = torch.stack([product(q[:, :, i], k[:, :, 0], v[:, :, i]) for i in range(3)], 2)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", ["reference", *FAST_BACKENDS])
@pytest.mark.parametrize("shape", [(2, 2, 0, 4, 5), (2, 2, 7, 4, 0), (2, 0, 7, 4, 5)])
def test_vmap_over_empty_sizes_equals_a_loop(backend, shape):
    """The compiled backends' vmap rule split the batch off with reshape(V, -1, ...), which
    cannot infer -1 where N, M or H is 0: a torch error naming nothing (eager calls and the
    torch backend worked)."""
    b, h, n, f, m = shape
    q, k = (torch.rand(3, b, h, n, f) for _ in range(2))
    v = torch.rand(3, b, h, n, m)
    for fn in (
        lambda q, k, v: ks.causal_dot_product(q, k, v, backend=backend),
        lambda q, k, v: ks.linear_attention(q, k, v, causal=True, backend=backend),
    ):
        got = torch.func.vmap(fn)(q, k, v)
        want = torch.stack([fn(q[i], k[i], v[i]) for i in range(3)])
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_torch_compile_traces_the_core_whole(backend):
    """``torch.compile(fullgraph=True)`` traces the core without a graph break: the compiled
    backends' kernels are custom ops in the forward and backward graphs (the ``cpu`` backend's
    product and its fused backward, with thread count 0: torch's, read when the graph runs), and
    outputs and gradients equal eager mode's bit for bit (float64, causal and non-causal with key
    padding, the product alone), also after a recompile for another length (dynamic shapes)."""
    nodes = []

    def model(q, k, v, mask):
        out = ks.linear_attention(q.exp(), k.exp(), v, key_padding_mask=mask, backend=backend)
        causal = ks.linear_attention(q.exp(), k.exp(), v, causal=True, backend=backend)
        product = ks.causal_dot_product(q.exp(), k.exp(), v, backend=backend)
        return (out + causal).tanh() + product

    compiled = compiled_whole(model, nodes)
    for n in (37, 50):
        q, k, v = _features(2, 3, n, 8, 5, dtype=torch.float64)
        mask = torch.ones(2, n, dtype=torch.bool)
        mask[1, 30:] = False
        got, want = compiled(q, k, v, mask), model(q, k, v, mask)
        assert torch.equal(got, want)
        for g, w in zip(_grads(got, (q, k, v)), _grads(want, (q, k, v)), strict=True):
            assert torch.equal(g, w)
    names = {str(n.target) for n in nodes}
    if backend == "cpu":
        assert names == {
            "kernelstudy.cpu_causal_product.default",
            "kernelstudy.cpu_causal_product_backward.default",
        }
        assert all(n.args[-1] == 0 for n in nodes), [n.args[-1] for n in nodes]
    else:
        assert not names


@pytest.mark.skipif("cpu" not in ks.backends(), reason="the cpu backend is not built here")
def test_the_cpu_kernels_custom_ops_agree_with_their_fake_shapes():
    """``torch.library.opcheck`` on the ``cpu`` backend's custom ops (schema, fake tensors against
    the kernels' real outputs, AOT dispatch), with every gradient asked for and with some left
    out (the extension's None comes back as an empty tensor), forward and reverse products."""
    q, k, v = _features(2, 3, 21, 6, 4, requires_grad=False)
    g = torch.randn_like(v)
    ops = torch.ops.kernelstudy
    for reverse, threads in ((False, 0), (True, 2)):
        torch.library.opcheck(ops.cpu_causal_product.default, (q, k, v, reverse, threads))
    for need in ((True, True, True), (False, True, False), (True, False, True)):
        args = (q, k, v, g, *need, 1)
        torch.library.opcheck(ops.cpu_causal_product_backward.default, args)


def test_every_core_function_binds_its_arguments_to_a_signature_kept_once():
    """``Function.apply`` binds its arguments to ``inspect.signature(forward)`` on each call;
    every autograd Function of the core keeps that signature (``signature_once``), so the
    binding reads it rather than rebuilding it, and the binding (defaults too) is unchanged."""
    import importlib
    import inspect
    import pkgutil

    import kernelstudy.core as core
    from kernelstudy.core.transforms import signature_once

    found = []
    for info in pkgutil.iter_modules(core.__path__):
        module = importlib.import_module(f"kernelstudy.core.{info.name}")
        for obj in vars(module).values():
            if (
                isinstance(obj, type)
                and issubclass(obj, torch.autograd.Function)
                and obj.__module__ == module.__name__
                and "forward" in obj.__dict__
            ):
                found.append(obj)
                kept = obj.forward.__dict__.get("__signature__")
                assert kept is not None, obj.__name__
                assert inspect.signature(obj.forward) is kept, obj.__name__
                assert kept == inspect.Signature.from_callable(obj.forward, follow_wrapped=False)
    assert len(found) >= 7, found

    @signature_once
    class Scaled(torch.autograd.Function):
        @staticmethod
        def forward(x, scale=2.0):  # type: ignore[override]
            return x * scale

        @staticmethod
        def setup_context(ctx, inputs, output):  # type: ignore[override]
            ctx.scale = inputs[1]

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            return grad * ctx.scale, None

    x = torch.ones(3, requires_grad=True)
    Scaled.apply(x).sum().backward()  # the default reached setup_context through the binding
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    torch.testing.assert_close(Scaled.apply(x, 3.0), torch.full((3,), 3.0))  # torch < 2.9:
    # no keyword arguments to apply (the core passes none)
    with pytest.raises(TypeError, match="Function subclass"):
        signature_once(object)
    with pytest.raises(TypeError, match="staticmethod of its own"):
        signature_once(type("Inherits", (Scaled,), {}))


def test_chunked_gradcheck_small_chunk():
    q, k, v = _features(1, 2, 11, 3, 2, dtype=torch.float64)

    def fn(q, k, v):
        return ks.causal_dot_product(q, k, v, backend="torch", chunk_size=4)

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_half_precision_accumulates_in_float32(dtype, causal):
    q, k, v = _features(2, 2, 300, 16, 8, requires_grad=False)
    want = linear_attention_reference(q, k, v, causal=causal)
    qh, kh, vh = (t.to(dtype).requires_grad_() for t in (q, k, v))
    got = ks.linear_attention(qh, kh, vh, causal=causal)
    assert got.dtype == dtype
    assert torch.isfinite(got).all()
    rms = ((got.float() - want) ** 2).mean().sqrt() / (want**2).mean().sqrt()
    assert rms < 1e-2
    grads = torch.autograd.grad(got.float().sum(), (qh, kh, vh))
    assert all(g.dtype == dtype and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_backend_sums_half_inputs_in_float32(dtype, monkeypatch):
    """The reference backend's product summed in float16: its normalizer column overflowed
    to inf and KERNELSTUDY_BACKEND=reference gave zeros where the others were right."""
    q, k, v = _features(1, 1, 300, 64, 4, requires_grad=False)
    q, k = q * 10, k * 10  # sums of q.k far above float16's range
    want = linear_attention_reference(q, k, v, causal=True)
    for name in ks.backends():
        monkeypatch.setenv("KERNELSTUDY_BACKEND", name)
        got = ks.linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True)
        rms = ((got.float() - want) ** 2).mean().sqrt() / (want**2).mean().sqrt()
        assert torch.isfinite(got).all() and rms < 1e-2, name


def test_the_cpu_extension_builds_once_for_threads_racing_to_it(monkeypatch):
    """A second thread on first use used to see the build in progress as 'not available'."""
    import threading
    import time

    from kernelstudy.core import cpu_backend

    if cpu_backend.extension() is None:
        pytest.skip("the cpu extension does not build here")
    built = cpu_backend._extension

    def slow_build(*args, **kwargs):  # a first build takes a while: the others come meanwhile
        time.sleep(0.3)
        return built

    monkeypatch.setattr(cpu_backend, "load_extension", slow_build)
    monkeypatch.setattr(cpu_backend, "_tried", False)
    monkeypatch.setattr(cpu_backend, "_extension", None)
    seen, start = [], threading.Barrier(4)

    def use():
        start.wait()
        seen.append(cpu_backend.extension())

    threads = [threading.Thread(target=use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [built] * 4


@pytest.mark.parametrize("amp", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["reference", *FAST_BACKENDS])
def test_autocast_changes_nothing(backend, amp):
    """The core's sums ignore autocast: under float16 autocast every product of the
    float32 accumulation was rounded to float16, and a normalizer over 1024 keys
    (up to ~8e4, beyond float16's 65504) overflowed to inf (NaN output). Outputs and
    gradients are bit-identical, also for a backward called inside the autocast region at a
    loss scale of 2**16 (the non-causal sums and the reference ran theirs in half precision:
    inf gradients)."""
    torch.manual_seed(0)
    n = 1024  # the reference's backward is O(N²): 4096 keys of half the size took 15 s
    q, k = (2 * torch.rand(1, 2, n, 16) + 1 for _ in range(2))
    v = torch.randn(1, 2, n, 8) + 1
    for causal in (False, True):
        results = []
        for enabled, backward_inside in ((False, False), (True, False), (True, True)):
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            with torch.autocast("cpu", dtype=amp, enabled=enabled):
                out = ks.linear_attention(*inputs, causal=causal, backend=backend)
                prod = ks.causal_dot_product(*inputs, backend=backend)
                loss = (out.sum() + prod.sum() / n) * 2**16
                if backward_inside:
                    grads = torch.autograd.grad(loss, inputs)
            if not backward_inside:
                grads = torch.autograd.grad(loss, inputs)
            results.append((out, prod, *grads))
        for plain, *cast in zip(*results, strict=True):
            for x in cast:
                assert plain.dtype == x.dtype and torch.equal(plain, x), causal
    plain = ks.core.softmax_attention_reference(q * 9, k * 9, v)
    with torch.autocast("cpu", dtype=amp):
        assert torch.equal(ks.core.softmax_attention_reference(q * 9, k * 9, v), plain)
        state = ks.RecurrentState.zeros(1, 2, 16, 8)
        for t in range(3):
            out, state = state.step(q[:, :, t], k[:, :, t], v[:, :, t])
    ref = ks.linear_attention(q[:, :, :3], k[:, :, :3], v[:, :, :3], causal=True)
    torch.testing.assert_close(out, ref[:, :, 2], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("amp", [torch.float16, torch.bfloat16])
def test_recurrent_steps_backward_inside_autocast_changes_nothing(amp):
    """The recurrent read-out turned autocast off for its forward only: a backward called
    inside the autocast region ran its matmul in half precision."""
    torch.manual_seed(0)
    q, k = (torch.rand(1, 2, 64, 16) + 0.5 for _ in range(2))
    v = torch.randn(1, 2, 64, 16) + 1
    grads = []
    for enabled in (False, True):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        with torch.autocast("cpu", dtype=amp, enabled=enabled):
            state, total = ks.RecurrentState.zeros(1, 2, 16, 16), 0
            for t in range(64):
                out, state = state.step(*(x[:, :, t] for x in inputs))
                total = total + out.sum()
            grads.append(torch.autograd.grad(total * 2**16, inputs))
    for plain, cast in zip(*grads, strict=True):
        assert torch.equal(plain, cast)


def test_without_autocast_keeps_a_backward_inside_autocast_exact_for_one_grad_input():
    """Only one input requires grad (a frozen other): the backward, called inside a CPU
    bfloat16 autocast region, is still recomputed with autocast off (skipping the
    Function unless every input required grad, and the matmul's backward ran in bfloat16:
    a relative error of about 1e-2)."""
    from kernelstudy.core.autocast import without_autocast

    torch.manual_seed(0)
    a = torch.randn(64, 64, requires_grad=True)
    b, g = torch.randn(64, 64), torch.randn(64, 64)  # b: no grad
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = without_autocast(lambda x, y: x @ y, a, b)
        (out * g).sum().backward()
    assert out.dtype == torch.float32
    want = g.double() @ b.double().T
    assert rel_err(a.grad.double(), want) < 1e-5


def test_causal_output_in_input_dtype():
    q, k, v = _features(1, 1, 5, 2, 2, dtype=torch.float64, requires_grad=False)
    assert ks.causal_dot_product(q, k, v).dtype == torch.float64
    assert ks.linear_attention(q, k, v, causal=True).dtype == torch.float64


def test_large_features_stay_finite():
    # Feature sums far above half range still normalize correctly in float32.
    q, k, v = _features(1, 1, 4096, 4, 2, requires_grad=False)
    q, k = q.half() * 60, k.half() * 60
    out = ks.linear_attention(q, k, v.half(), causal=True)
    assert torch.isfinite(out).all()


def test_environment_variable_chooses_backend(monkeypatch):
    q, k, v = _features(1, 1, 5, 2, 2, requires_grad=False)
    monkeypatch.setenv("KERNELSTUDY_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="KERNELSTUDY_BACKEND"):
        ks.linear_attention(q, k, v, causal=True)
    monkeypatch.setenv("KERNELSTUDY_BACKEND", "torch")
    assert ks.core.resolve_backend(None, q).name == "torch"
    monkeypatch.setenv("KERNELSTUDY_BACKEND", "auto")
    assert ks.core.resolve_backend(None, q).name in ks.backends()


def test_auto_picks_highest_priority_available():
    from kernelstudy.core.backends import registered_backends

    q = torch.rand(1, 1, 4, 2)
    chosen = ks.core.resolve_backend("auto", q)
    best = max(
        (b for b in registered_backends().values() if b.available() and b.supports(q)),
        key=lambda b: b.priority,
    )
    assert chosen.name == best.name


@pytest.mark.parametrize("module", ["cpu_backend", "cuda_backend"])
def test_a_build_stopped_by_ctrl_c_is_tried_again(monkeypatch, module):
    """A KeyboardInterrupt in the first build left the backend off for the whole process,
    with no warning ever given."""
    import importlib

    from kernelstudy.core import extensions

    backend = importlib.import_module(f"kernelstudy.core.{module}")
    built = object()
    calls = []

    def build(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return built

    if module == "cuda_backend":
        monkeypatch.setattr(backend.torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(extensions, "load_extension", build)
        state = "_module"
    else:
        monkeypatch.setattr(backend, "load_extension", build)
        state = "_extension"
    monkeypatch.setattr(backend, "_tried", False)
    monkeypatch.setattr(backend, state, None)
    with pytest.raises(KeyboardInterrupt):
        backend.extension()
    assert backend.extension() is built and backend.extension() is built
    assert len(calls) == 2


def test_an_eps_that_is_zero_in_float32_is_refused():
    """eps = 1e-46 passed the check, became 0 in the float32 sums, and a fully padded
    sequence came out NaN in every backend."""
    q = k = v = torch.rand(1, 1, 4, 3)
    for eps in (1e-46, 1e-39):
        with pytest.raises(ValueError, match="eps must be >= 1.18e-38"):
            ks.linear_attention(q, k, v, eps=eps)
        with pytest.raises(ValueError, match="eps must be >= "):
            ks.RecurrentState.zeros(1, 1, 3, 3, eps=eps)
    mask = torch.zeros(1, 4, dtype=torch.bool)
    out = ks.linear_attention(q, k, v, key_padding_mask=mask, eps=torch.finfo(torch.float32).tiny)
    assert torch.equal(out, torch.zeros_like(out))
    q64 = q.double()  # float64 sums take a float64 eps
    out = ks.linear_attention(q64, q64, q64, key_padding_mask=mask, eps=1e-300)
    assert torch.equal(out, torch.zeros_like(out))
    ks.RecurrentState.zeros(1, 1, 3, 3, dtype=torch.float64, eps=1e-300)


def test_an_eps_just_below_float32s_smallest_normal_is_refused():
    """The bound is float32's smallest normal itself: tiny / 2 (a subnormal, 0 where
    denormals are flushed) is refused, tiny is taken."""
    q = torch.rand(1, 1, 2, 4)
    tiny = torch.finfo(torch.float32).tiny
    with pytest.raises(ValueError, match="eps must be >= 1.18e-38"):
        ks.linear_attention(q, q, q, eps=tiny / 2)
    with pytest.raises(ValueError, match="eps must be >= "):
        ks.RecurrentState.zeros(1, 1, 4, 4, eps=tiny / 2)
    ks.linear_attention(q, q, q, eps=tiny)
    ks.RecurrentState.zeros(1, 1, 4, 4, eps=tiny)


def test_counts_may_be_numpy_ints_and_thread_counts_fit_a_c_int():
    import numpy as np

    from kernelstudy.core import cpu_backend

    state = ks.RecurrentState.zeros(np.int64(1), np.int32(2), np.int64(3), np.int16(4))
    assert state.S.shape == (1, 2, 3, 4)
    q = torch.rand(1, 1, 4, 3)
    for threads in (2**31, 2**64):  # cut to 1 thread, or a bare pybind TypeError
        with pytest.raises(ValueError, match="num_threads must be an int <= 2147483647"):
            cpu_backend.causal_dot_product_cpu(q, q, q, num_threads=threads)


def test_unavailable_backend_falls_back_with_one_warning():
    from kernelstudy.core import Backend, register_backend, registered_backends, unregister_backend

    register_backend(Backend("ghost", lambda q, k, v: None, available=lambda: False))
    try:
        q = torch.rand(1, 1, 3, 2)
        with pytest.warns(RuntimeWarning, match="ghost"):
            assert ks.core.resolve_backend("ghost", q).name == "torch"
        assert "ghost" not in ks.backends()
    finally:
        unregister_backend("ghost")
    assert "ghost" not in registered_backends()


def test_a_backend_whose_device_is_missing_falls_back_but_a_wrong_input_raises(monkeypatch):
    """DESIGN: "if a build or a device is missing, the core falls back and says so once".
    backend="cuda" (or KERNELSTUDY_BACKEND=cuda, a GPU machine's setting) on a machine without
    a GPU raised "does not take float32 tensors on cpu". A backend that runs here but not on
    these tensors still raises: a wrong input, not a missing device."""
    import sys

    from kernelstudy.core import Backend, register_backend, unregister_backend

    q = torch.rand(1, 2, 5, 3)
    expected = ks.linear_attention(q, q, q, causal=True, backend="torch")
    monkeypatch.setattr(sys.modules["kernelstudy.core.backends"], "_WARNED", set())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as here, also on a GPU
    with pytest.warns(RuntimeWarning, match="backend 'cuda' is not available here") as caught:
        out = ks.linear_attention(q, q, q, causal=True, backend="cuda")
        monkeypatch.setenv("KERNELSTUDY_BACKEND", "cuda")
        assert torch.equal(
            ks.causal_dot_product(q, q, q), ks.causal_dot_product(q, q, q, backend="torch")
        )
    assert torch.equal(out, expected)
    assert len([w for w in caught if "is not available" in str(w.message)]) == 1  # once
    only_gpu = Backend("gpu_only", lambda q, k, v: None, supports=lambda x: x.is_cuda)
    register_backend(only_gpu)  # available here, but not for CPU tensors
    try:
        with pytest.raises(ValueError, match="backend='gpu_only' does not take torch.float32"):
            ks.core.resolve_backend("gpu_only", q)
    finally:
        unregister_backend("gpu_only")


def test_a_gpu_below_compute_capability_8_is_no_device_for_the_cuda_backend(monkeypatch):
    """is_available() was True on any visible GPU whose extension built, so backend="cuda"
    on CUDA tensors of a compute-capability-7.5 GPU raised (supports() refuses them) where
    it should fall back; it is False there now, before any build is tried."""
    from kernelstudy.core import cuda_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda_backend, "_capable", lambda index: False)
    monkeypatch.setattr(cuda_backend, "extension", lambda: pytest.fail("a build was tried"))
    assert cuda_backend.is_available() is False


def test_a_non_causal_call_builds_no_backend_it_does_not_run():
    """Non-causal attention resolved the backend fully: "auto" built the CPU extension
    (compiling it on a first call), which non-causal attention never runs."""
    from kernelstudy.core import Backend, register_backend, unregister_backend

    built = []

    def available() -> bool:
        built.append(1)
        return True

    product = ks.core.registered_backends()["torch"].product
    register_backend(Backend("eager", product, available=available, priority=99))
    try:
        q = torch.rand(1, 1, 5, 2)
        for backend in (None, "eager"):
            ks.linear_attention(q, q, q, causal=False, backend=backend)
        assert built == []
        ks.linear_attention(q, q, q, causal=True)  # the causal product runs on it
        assert built
    finally:
        unregister_backend("eager")


# --- bad input ---------------------------------------------------------------------------


def _ok():
    return torch.rand(2, 3, 5, 4), torch.rand(2, 3, 5, 4), torch.rand(2, 3, 5, 6)


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (lambda q, k, v: (q[:1], k, v), ValueError, "batch"),
        (lambda q, k, v: (q[:, :2], k, v), ValueError, "head"),
        (lambda q, k, v: (q, k[:, :, :4], v), ValueError, "phi_k|v"),
        (lambda q, k, v: (q, k[..., :3], v), ValueError, "phi_q and phi_k"),
        (lambda q, k, v: (q[0], k, v), ValueError, "phi_q"),
        (lambda q, k, v: (q, k, v.long()), TypeError, "v"),
        (lambda q, k, v: (q.double(), k, v), TypeError, "dtype"),
        (lambda q, k, v: (q.numpy(), k, v), TypeError, "phi_q"),
        (lambda q, k, v: (q, k.to_sparse(), v), TypeError, "phi_k must be a dense"),
    ],
)
def test_bad_input_names_the_argument(mutate, error, match):
    q, k, v = mutate(*_ok())
    with pytest.raises(error, match=match):
        ks.linear_attention(q, k, v)


def test_causal_needs_equal_lengths():
    q = torch.rand(1, 1, 5, 2)
    with pytest.raises(ValueError, match="causal"):
        ks.linear_attention(q, torch.rand(1, 1, 6, 2), torch.rand(1, 1, 6, 2), causal=True)


@pytest.mark.parametrize("fn", [ks.linear_attention, ks.softmax_attention])
def test_causal_must_be_a_bool(fn):
    """A string is truthy: causal="no" used to run causal attention."""
    q = torch.rand(1, 1, 3, 2)
    with pytest.raises(TypeError, match="causal must be a bool"):
        fn(q, q, q, causal="no")
    for flag in (1, np.False_):  # ints 0/1 and numpy's bool are flags too
        assert torch.equal(fn(q, q, q, causal=flag), fn(q, q, q, causal=bool(flag)))


@pytest.mark.parametrize(
    "mask, error",
    [
        (torch.ones(2, 4, dtype=torch.bool), ValueError),
        (torch.ones(3, 5, dtype=torch.bool), ValueError),
        (torch.ones(2, 5), TypeError),
        ([[True] * 5] * 2, TypeError),
        (torch.ones(2, 5, dtype=torch.bool, device="meta"), ValueError),  # NotImplementedError
    ],
)
def test_bad_mask(mask, error):
    with pytest.raises(error, match="key_padding_mask"):
        ks.linear_attention(*_ok(), key_padding_mask=mask)


@pytest.mark.parametrize(
    "eps, error",
    [(0.0, ValueError), (-1e-3, ValueError), (float("inf"), ValueError), ("1", TypeError)],
)
def test_bad_eps(eps, error):
    with pytest.raises(error, match="eps"):
        ks.linear_attention(*_ok(), eps=eps)


def test_bad_backend_and_chunk():
    with pytest.raises(ValueError, match="backend"):
        ks.linear_attention(*_ok(), backend="fastest")
    with pytest.raises(TypeError, match="backend"):
        ks.linear_attention(*_ok(), backend=3)
    q, k, _ = _ok()
    with pytest.raises(ValueError, match="chunk_size"):
        ks.causal_dot_product(q, k, torch.rand(2, 3, 5, 6), backend="torch", chunk_size=0)
    for causal in (False, True):  # checked in every mode, not only where chunks are used
        with pytest.raises(ValueError, match="chunk_size must be a positive int"):
            ks.linear_attention(*_ok(), causal=causal, chunk_size=0)
        with pytest.raises(ValueError, match="chunk_size applies to backend='torch' only"):
            ks.linear_attention(*_ok(), causal=causal, backend="reference", chunk_size=8)
        with pytest.raises(TypeError, match="backend must be a str"):  # not about chunk_size
            ks.linear_attention(*_ok(), causal=causal, backend=3, chunk_size=8)
    # chunk_size selects the torch backend: "auto" as None; numpy ints and floats are numbers
    q, k, v = _ok()
    want = ks.causal_dot_product(q, k, v, backend="torch", chunk_size=2)
    same = ks.causal_dot_product(q, k, v, backend="auto", chunk_size=np.int64(2))
    assert torch.equal(same, want)
    ks.linear_attention(q, k, v, eps=np.float32(1e-6))


def test_exported_causal_products_check_their_inputs():
    """Heads and batch swapped were silently read as each other (chunked) or broadcast
    (reference)."""
    q, v = torch.rand(2, 1, 4, 3), torch.rand(2, 1, 4, 5)
    k = torch.rand(1, 2, 4, 3)
    for fn in (ks.core.causal_dot_product_chunked, ks.core.causal_dot_product_reference):
        with pytest.raises(ValueError, match="must agree in batch size"):
            fn(q, k, v)
        with pytest.raises(TypeError, match="floating-point"):
            fn(q.long(), q.long(), v.long())


def test_softmax_padding_holds_anything_and_scale_is_checked():
    q, k, v = (torch.randn(2, 2, 6, 4) for _ in range(3))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[:, -2:] = False
    want = ks.softmax_attention(q, k, v, key_padding_mask=mask)
    k[:, :, -2:], v[:, :, -1] = float("nan"), float("inf")
    got = ks.softmax_attention(q, k, v, key_padding_mask=mask)
    torch.testing.assert_close(got, want)
    got = ks.core.softmax_attention_reference(q, k, v, key_padding_mask=mask)
    torch.testing.assert_close(got, want)
    for bad, error in ((0.0, ValueError), (float("nan"), ValueError), ("a", TypeError)):
        with pytest.raises(error, match="scale"):
            ks.softmax_attention(q, k, v, scale=bad)


def test_constants_are_marked_as_torchs_decorator_marks_them():
    """``constant_when_traced`` sets the marker that ``torch.compiler.assume_constant_result``
    sets (without importing dynamo): if torch changes it, this fails, not a silent graph break."""
    from kernelstudy.core.transforms import constant_when_traced

    def ours() -> int:
        return 1

    def torchs() -> int:
        return 1

    constant_when_traced(ours)
    torch.compiler.assume_constant_result(torchs)
    assert vars(ours) == vars(torchs) == {"_dynamo_marked_constant": True}


@pytest.mark.parametrize("autocast", [False, True])
def test_the_autocast_lookup_is_a_constant_when_traced(monkeypatch, autocast):
    """``autocast_off`` asks whether autocast exists on the device once while dynamo traces,
    outside the graph (torch 2.11's dynamo could not trace ``torch.amp.is_autocast_available``:
    every compiled CUDA layer failed under ``fullgraph=True`` on the H200, 2026-11-30); compiled
    calls ask no more, and the region is off inside either way."""
    from kernelstudy.core import validation

    asked = []
    available = torch.amp.is_autocast_available
    monkeypatch.setattr(
        torch.amp, "is_autocast_available", lambda d: asked.append(d) or available(d)
    )

    def fn(x):
        with validation.autocast_off(x):
            return (x @ x).to(torch.float32) + float(torch.is_autocast_enabled("cpu"))

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    x = torch.ones(2, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for _ in range(3):
            assert compiled(x).tolist() == [[2.0, 2.0], [2.0, 2.0]]
    assert asked == ["cpu"]


def test_kernelstudy_imports_without_dynamo():
    """``import kernelstudy`` leaves ``torch._dynamo`` unimported (0.7 s of every import when the
    backends marked their constants with torch's decorator)."""
    code = "import sys, kernelstudy; print('torch._dynamo' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "False", run.stderr


def test_traceable_apply_calls_the_function_and_refuses_other_classes():
    """Eager calls go to the Function itself (its jvp serves forward mode); ``traceable_apply``
    takes only Function subclasses, by name."""
    from kernelstudy.core.transforms import traceable_apply

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(x):  # type: ignore[override]
            return 2 * x

        @staticmethod
        def setup_context(ctx, inputs, output):  # type: ignore[override]
            pass

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            return 2 * grad

        @staticmethod
        def jvp(ctx, tangent):  # type: ignore[override]
            return 3 * tangent  # not the true derivative: shows which jvp ran

    apply = traceable_apply(Double)
    x = torch.ones(2)
    _, tangent = torch.func.jvp(apply, (x,), (torch.ones(2),))
    assert tangent.tolist() == [3.0, 3.0]
    compiled = torch.compile(apply, fullgraph=True, backend="aot_eager")
    y = torch.ones(2, requires_grad=True)
    compiled(y).sum().backward()
    assert y.grad.tolist() == [2.0, 2.0]
    with pytest.raises(TypeError, match="traceable_apply takes a torch.autograd.Function"):
        traceable_apply(int)


_NO_DEFAULT = object()  # a binding argument without a default


def _binding_signatures(source: str) -> dict[str, list[tuple[str, object]]]:
    """Each ``m.def("name", ...)`` of a pybind11 binding: its ``py::arg`` names and defaults
    (``_NO_DEFAULT`` where none), parsed from the C++ source."""
    values = {"false": False, "true": True, "py::none()": None}
    found = {}
    for block in re.findall(r'm\.def\("(\w+)",(.*?)\);', source, flags=re.S):
        name, body = block
        args = []
        for arg, default in re.findall(
            r'py::arg\("(\w+)"\)(?:\s*=\s*(py::none\(\)|[^,)]+))?', body
        ):
            default = default.strip()
            if not default:
                args.append((arg, _NO_DEFAULT))
            elif default in values:
                args.append((arg, values[default]))
            else:
                args.append(
                    (arg, float(default) if "." in default or "e" in default else int(default))
                )
        found[name] = args
    return found


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_the_traced_kernels_take_the_bindings_arguments(kind):
    """``core/traced_kernels.py``'s namespaces, which stand for the extensions while dynamo
    traces, have each binding function's arguments in its order with its defaults (read from
    ``csrc/*/binding.cpp``): a binding that changes without them fails here, not in a compiled
    model on a GPU."""
    import inspect

    from kernelstudy.core import traced_kernels
    from kernelstudy.core.extensions import csrc_dir

    source = (csrc_dir() / kind / "binding.cpp").read_text()
    namespace = traced_kernels.CPU if kind == "cpu" else traced_kernels.CUDA
    bindings = _binding_signatures(source)
    assert bindings, "no m.def found"
    untraced = {"walk_kernels"}  # reports kernels, launches nothing: never called in a model
    assert set(bindings) - untraced == {name for name in dir(namespace) if not name.startswith("_")}
    for name, args in bindings.items():
        if name in untraced:
            continue
        params = inspect.signature(getattr(namespace, name)).parameters.values()
        ours = [(p.name, _NO_DEFAULT if p.default is p.empty else p.default) for p in params]
        assert ours == args, name
