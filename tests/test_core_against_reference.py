"""Every fast core backend against the float64 reference where test_core does not reach:
key padding (left padding, a fully padded sequence) with gradients, causal and not, cross
lengths with padding, small chunks (gradcheck and gradgradcheck), half-precision gradient
values, and the CPU kernel's reverse product over several 512-row segments. Tolerances:
1e-5 of the largest entry (float32), 1e-10 (float64), 1e-2 relative RMS (half)."""

import pytest
import torch

import kernelstudy as ks
from kernelstudy.core import causal_dot_product_reference, linear_attention_reference

from .conftest import rel_err, rel_rms

_CPU = torch.zeros(1, 1, 1, 1)
FAST = [
    b for b in ks.backends() if b != "reference" and ks.core.registered_backends()[b].supports(_CPU)
]
# (B, H, N, S, F, M, chunk)
SHAPES = [
    (1, 1, 1, 1, 4, 3, 16),  # N=1, B*H=1
    (3, 2, 37, 37, 7, 5, 16),  # N % chunk != 0, F != M
    (3, 1, 70, 70, 5, 9, 32),
]


def _mask(b, s):
    mask = torch.ones(b, s, dtype=torch.bool)
    if b >= 2:
        mask[1, : s // 3] = False  # left padding: early causal rows see no real key
    if b >= 3:
        mask[2] = False  # a fully padded sequence
    return mask


def _run(fn, inputs, seed=1):
    out = fn(*inputs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (out, *torch.autograd.grad(out, inputs, g.to(out.dtype)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_masked_attention_outputs_and_grads_match_reference(shape, causal, backend, dtype):
    b, h, n, s, f, m, chunk = shape
    q = torch.rand(b, h, n, f, dtype=dtype).requires_grad_()
    k = torch.rand(b, h, s, f, dtype=dtype).requires_grad_()
    v = torch.randn(b, h, s, m, dtype=dtype).requires_grad_()
    mask = _mask(b, s)
    kw = {"chunk_size": chunk} if backend == "torch" else {}
    got = _run(
        lambda *x: ks.linear_attention(
            *x, causal=causal, key_padding_mask=mask, backend=backend, **kw
        ),
        (q, k, v),
    )
    want = _run(
        lambda *x: linear_attention_reference(
            *(t.double() for t in x), causal=causal, key_padding_mask=mask
        ),
        (q, k, v),
    )
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, w, floor=1.0) <= tol, name
    # a fully padded sequence: zero output and zero gradients
    if b >= 3:
        assert torch.all(got[0][2] == 0) and torch.all(got[2][2] == 0) and torch.all(got[3][2] == 0)


@pytest.mark.parametrize("backend", FAST)
def test_cross_attention_lengths_with_padding_and_grads(backend):
    q = torch.rand(2, 3, 5, 6, dtype=torch.float64).requires_grad_()
    k = torch.rand(2, 3, 11, 6, dtype=torch.float64).requires_grad_()
    v = torch.randn(2, 3, 11, 4, dtype=torch.float64).requires_grad_()
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, 7:] = False
    got = _run(
        lambda *x: ks.linear_attention(*x, key_padding_mask=mask, backend=backend), (q, k, v)
    )
    want = _run(lambda *x: linear_attention_reference(*x, key_padding_mask=mask), (q, k, v))
    for a, w in zip(got, want, strict=True):
        assert rel_err(a, w, floor=1.0) <= 1e-10


def test_chunked_linear_attention_gradcheck_with_small_chunks_and_padding():
    q, k = (torch.rand(2, 1, 13, 3, dtype=torch.float64, requires_grad=True) for _ in "qk")
    v = torch.randn(2, 1, 13, 2, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[1, :4] = False
    for causal in (False, True):

        def fn(q, k, v, causal=causal):
            return ks.linear_attention(
                q, k, v, causal=causal, key_padding_mask=mask, backend="torch", chunk_size=4
            )

        assert torch.autograd.gradcheck(fn, (q, k, v))
        assert torch.autograd.gradgradcheck(fn, (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("causal", [False, True])
def test_half_precision_gradient_values(dtype, backend, causal):
    """test_core only checks the dtype and finiteness of half gradients, not their values."""
    q, k = (torch.rand(2, 2, 70, 8).to(dtype).requires_grad_() for _ in "qk")
    v = torch.randn(2, 2, 70, 6).to(dtype).requires_grad_()
    kw = {"chunk_size": 16} if backend == "torch" else {}
    got = _run(lambda *x: ks.linear_attention(*x, causal=causal, backend=backend, **kw), (q, k, v))
    want = _run(
        lambda *x: linear_attention_reference(*(t.double() for t in x), causal=causal), (q, k, v)
    )
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == dtype, name
        assert rel_rms(a, w) <= 1e-2, name
    # the unnormalized product too (torch backend's output is float32 for half inputs)
    got = _run(lambda *x: ks.causal_dot_product(*x, backend=backend, **kw), (q, k, v))
    want = _run(lambda *x: causal_dot_product_reference(*(t.double() for t in x)), (q, k, v))
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert rel_rms(a, w) <= 1e-2, name


@pytest.mark.skipif("cpu" not in ks.backends(), reason="cpu extension not built")
@pytest.mark.parametrize("n", [65, 600, 1100])
def test_cpu_reverse_product_over_several_segments(n):
    """The compiled anti-causal product (reverse=True) is only reached by double backward
    and single-gradient paths; existing tests run it at N <= 90 (one segment)."""
    from kernelstudy.core import cpu_backend

    q, k = (torch.rand(1, 2, n, 5, dtype=torch.float64) for _ in "qk")
    v = torch.randn(1, 2, n, 3, dtype=torch.float64)
    for threads in (1, 2):
        got = cpu_backend.extension().causal_product(q, k, v, reverse=True, threads=threads)
        want = causal_dot_product_reference(q.flip(2), k.flip(2), v.flip(2)).flip(2)
        assert rel_err(got, want) <= 1e-12


@pytest.mark.skipif("cpu" not in ks.backends(), reason="cpu extension not built")
def test_cpu_double_backward_over_several_segments():
    q, k = (torch.rand(1, 1, 600, 4, dtype=torch.float64, requires_grad=True) for _ in "qk")
    v = torch.randn(1, 1, 600, 3, dtype=torch.float64, requires_grad=True)
    grads = {}
    for name in ("reference", "cpu"):
        out = ks.causal_dot_product(q, k, v, backend=name)
        (dq,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
        grads[name] = torch.autograd.grad(dq.pow(2).sum(), (q, k, v))
    for a, w in zip(grads["cpu"], grads["reference"], strict=True):
        assert rel_err(a, w) <= 1e-10
