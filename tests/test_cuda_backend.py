"""The CUDA backend against the float64 reference and the torch backend (skipped without a GPU).

Tolerances: float32 outputs and gradients max relative error ≤ 1e-4; float16/bfloat16
relative RMS error ≤ 1e-2 (against the reference in float64 on the same rounded inputs).
Also: awkward shapes (N=1, N not a multiple of the chunk, F≠M, F=M=256, B·H=1 at long N),
key padding, recurrent-state consistency, dispatch, torch.func and gradients of gradients,
bit-identical reruns (also for inputs off 16-byte addresses), offsets past 2**31 elements, peak
memory (no O(N·F·M) tensor), and the fused backward (``ext.causal_backward``) against the
reference and the three-product backward.
Every test runs under each causal kernel (``cuda_backend.CAUSAL_KERNEL``: "chunks", "walk" and
"walk_mma", whose kernel 8 takes F ≤ 64, bfloat16 F ≤ 128); the walks and their fused backward are
also checked with sequences cut into 1, several and one-chunk segments.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import kernelstudy as ks
from kernelstudy.core import (
    RecurrentState,
    causal_dot_product_reference,
    cuda_backend,
    linear_attention_reference,
    resolve_backend,
)

from .conftest import (
    BENCHMARKS,
    CUDA_COMPILED_OPS,
    autocast_bf16,
    benchmark_script,
    close_in_dtype,
    compiled_matches_eager,
    compiled_whole,
    cuda_custom_op_cases,
    outputs_and_grads,
    rel_err,
    rel_rms,
    shifted,
    torch_func_results,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"
REPO = BENCHMARKS.parent  # where test_the_extensions_errors_reach_python's child runs

# (B, H, N, F, M): N=1, N not a multiple of 64, odd F and M, F≠M, F=M=256, B·H=1 at long N.
SHAPES = [
    (1, 1, 1, 4, 3),
    (2, 3, 37, 8, 5),
    (3, 2, 130, 96, 40),
    (1, 4, 64, 16, 16),
    (2, 2, 200, 33, 70),
    (1, 2, 129, 256, 256),
    (1, 1, 4099, 64, 64),
]
SHAPE_IDS = ["x".join(map(str, s)) for s in SHAPES]
# Shapes where the state pass groups several chunks per thread block (B·H·tiles·chunks > 1024):
# one block per sequence (64x1x1030x256x256) and ragged groups of 2 chunks (16x8x700x64x64).
GROUPED_SHAPES = [(64, 1, 1030, 256, 256), (16, 8, 700, 64, 64)]
GROUPED_IDS = ["x".join(map(str, s)) for s in GROUPED_SHAPES]
HALF = [torch.float16, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    if torch.cuda.get_device_capability() < cuda_backend.MIN_CAPABILITY:
        pytest.skip("the cuda backend needs compute capability >= 8.0")
    assert cuda_backend.is_available(), "the CUDA extension did not build (see the warning)"


@pytest.fixture(autouse=True, params=cuda_backend.CAUSAL_KERNELS)
def causal_kernel(request, monkeypatch) -> str:
    """Every test runs under each causal kernel: the chunk kernels and the walk."""
    monkeypatch.setattr(cuda_backend, "CAUSAL_KERNEL", request.param)
    return request.param


def _features(b, h, n, f, m, dtype=torch.float32, seed=0, shift=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.rand(b, h, n, f, generator=gen)
    k = torch.rand(b, h, n, f, generator=gen)
    v = torch.randn(b, h, n, m, generator=gen)
    return [shifted(t.to(DEVICE, dtype), shift).requires_grad_() for t in (q, k, v)]


def _upstream(shape, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _grads(out, inputs, g):
    return torch.autograd.grad(out, inputs, g.to(out.dtype))


def _as64(tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


def test_registered_and_chosen_for_cuda_tensors():
    assert "cuda" in ks.backends()
    x = torch.zeros(1, 1, 2, 2, device=DEVICE)
    assert resolve_backend(None, x).name == "cuda"
    assert resolve_backend(None, x.cpu()).name != "cuda"
    assert not cuda_backend.supports(x.double())
    with pytest.raises(ValueError):
        ks.causal_dot_product(x.cpu(), x.cpu(), x.cpu(), backend="cuda")


def test_feature_sizes_from_2_to_the_24_are_refused():
    """Offsets inside a 64-row tile are 32-bit in the kernels (64 · D < 2^31): a last dimension
    of 2^24 or more is a ValueError naming the tensor, not a wrong result. The Python side says
    so before the extension (on the H200 of 2026-11-30 the extension's own check, a C++ throw,
    segfaulted the test run: test_the_extensions_errors_reach_python)."""
    big = torch.zeros(1, 1, 1, 2**24, device=DEVICE, dtype=torch.bfloat16)
    small = torch.zeros(1, 1, 1, 2, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"q's last dimension must be below 2\^24"):
        ks.causal_dot_product(big, big, small, backend="cuda")
    with pytest.raises(ValueError, match=r"v's last dimension must be below 2\^24"):
        ks.linear_attention(small, small, big, causal=False, backend="cuda")


def test_the_extensions_errors_reach_python(causal_kernel):
    """The extension's own checks (TORCH_CHECK_VALUE in csrc/cuda/binding.cpp, behind the
    Python side's) raise a Python ValueError. Run in a child process, so that a crash fails this
    test alone: on the H200 machine of 2026-11-30 every such throw segfaulted, because its
    message streamed a number into a std::ostringstream (csrc/check_messages.h; the messages
    now stream strings alone, tests/test_binding_messages.py)."""
    if causal_kernel != "chunks":
        pytest.skip("one run is enough")
    code = (
        "import torch\n"
        "from kernelstudy.core import cuda_backend\n"
        "x = torch.zeros(1, 1, 4, 4, device='cuda')\n"
        "ext = cuda_backend.extension()\n"
        "s = torch.zeros(1, 1, 4 * 4 + 4, device='cuda')\n"
        "for call in (lambda: ext.causal_product(x, x, x, walk_blocks=-1),\n"
        "             lambda: ext.causal_backward(x, x, x, x, out_fp32=False, dv_fp32=True),\n"
        "             lambda: ext.full_apply(x.half(), s, 4, out_dtype=torch.bfloat16)):\n"
        "    try:\n"
        "        call()\n"
        "    except (ValueError, TypeError) as err:\n"
        "        print(type(err).__name__ + ':', err)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=REPO
    )
    assert run.returncode == 0, f"the child ended with {run.returncode}: {run.stderr[-3000:]}"
    assert "ValueError: walk_blocks must be >= 0, got -1" in run.stdout, run.stdout[-2000:]
    assert "ValueError: dv_fp32=True needs out_fp32=True" in run.stdout, run.stdout[-2000:]
    assert "TypeError: out_dtype must be q's dtype" in run.stdout, run.stdout[-2000:]


# ---------------------------------------------------------------- unnormalized causal product
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_causal_product_fp32_matches_reference(shape):
    b, h, n, f, m = shape
    q, k, v = _features(b, h, n, f, m)
    got = ks.causal_dot_product(q, k, v, backend="cuda")
    q64, k64, v64 = _as64((q, k, v))
    want = causal_dot_product_reference(q64, k64, v64)
    assert got.shape == (b, h, n, m) and got.dtype == torch.float32
    assert rel_err(got, want) <= 1e-4
    g = _upstream(got.shape)
    for g_got, g_want in zip(
        _grads(got, (q, k, v), g), _grads(want, (q64, k64, v64), g), strict=True
    ):
        assert g_got.dtype == torch.float32
        assert rel_err(g_got, g_want) <= 1e-4


def _where_wrong(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> str:
    """Which elements of (..., rows, columns) results are off, by row mod 16 and column mod 8:
    the pattern a wrong mma.sync fragment layout leaves (kernels 8 and 9 keep 16-row bands of
    8-column tiles in registers)."""
    err = (got.double() - want.double()).abs()
    tol = (1e-4 if dtype == torch.float32 else 3e-2) * max(want.abs().max().item(), 1.0)
    bad = (~(err <= tol)).nonzero()  # NaN counts as off
    if len(bad) == 0:
        return "no element beyond the tolerance"
    rows, cols = bad[:, -2] % 16, bad[:, -1] % 8
    return (
        f"{len(bad)} of {err.numel()} elements off; rows mod 16: {sorted(set(rows.tolist()))}; "
        f"columns mod 8: {sorted(set(cols.tolist()))}; first at {tuple(bad[0].tolist())}"
    )


@pytest.mark.parametrize(
    "dtype, f",
    [(torch.float32, 64), *((d, 64) for d in HALF), (torch.bfloat16, 128)],
    ids=["float32", "float16", "bfloat16", "bfloat16-F=128"],
)
def test_one_chunk_points_at_wrong_elements(monkeypatch, dtype, f):
    """One whole chunk (N = M = 64, F = 64, and F = 128: kernel 8's two feature slices in
    bf16), forward and fused backward, against float64; a failure names the wrong elements'
    rows mod 16 and columns mod 8, which locate a fragment layout of kernels 8 and 9 (walk_mma)
    that only a GPU can check."""
    monkeypatch.setattr(cuda_backend, "FUSED_BACKWARD", True)
    q, k, v = _features(1, 2, 64, f, 64, dtype=dtype)
    got = ks.causal_dot_product(q, k, v, backend="cuda")
    x64 = _as64((q, k, v))
    want = causal_dot_product_reference(*x64)
    g = _upstream(got.shape).to(dtype)
    results = zip(
        ("out", "dq", "dk", "dv"),
        (got, *_grads(got, (q, k, v), g)),
        (want, *_grads(want, x64, g)),
        strict=True,
    )
    for name, a, w in results:
        assert close_in_dtype(a, w, dtype), f"{name}: {_where_wrong(a, w, dtype)}"


@pytest.mark.parametrize("shape", SHAPES[1:4] + SHAPES[5:], ids=SHAPE_IDS[1:4] + SHAPE_IDS[5:])
def test_causal_product_fp32_matches_torch_backend(shape):
    q, k, v = _features(*shape)
    got = ks.causal_dot_product(q, k, v, backend="cuda")
    want = ks.causal_dot_product(q, k, v, backend="torch")
    assert rel_err(got, want) <= 1e-4
    g = _upstream(got.shape)
    for g_got, g_want in zip(_grads(got, (q, k, v), g), _grads(want, (q, k, v), g), strict=True):
        assert rel_err(g_got, g_want) <= 1e-4


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_causal_product_half_matches_reference(shape, dtype):
    q, k, v = _features(*shape, dtype=dtype)
    got = ks.causal_dot_product(q, k, v, backend="cuda")
    q64, k64, v64 = _as64((q, k, v))
    want = causal_dot_product_reference(q64, k64, v64)
    assert got.dtype == dtype
    assert rel_rms(got, want) <= 1e-2
    g = _upstream(got.shape).to(dtype)
    for g_got, g_want in zip(
        _grads(got, (q, k, v), g), _grads(want, (q64, k64, v64), g), strict=True
    ):
        assert g_got.dtype == dtype
        assert rel_rms(g_got, g_want) <= 1e-2


def test_float16_one_row_gradients_keep_the_inputs_bits():
    """At N = 1, dq = (g·v) k: a g·v that cancels magnifies any rounding of g and v. float16
    inputs are exact in the kernels' tf32 operands, so over 40 seeds every gradient stays
    within 2e-3 (bfloat16 operands reached 0.017 on these seeds in the emulator)."""
    worst = 0.0
    for seed in range(40):
        q, k, v = _features(1, 1, 1, 4, 3, dtype=torch.float16, seed=seed)
        got = ks.causal_dot_product(q, k, v, backend="cuda")
        q64, k64, v64 = _as64((q, k, v))
        want = causal_dot_product_reference(q64, k64, v64)
        g = _upstream(got.shape, seed=seed + 100).to(torch.float16)
        for g_got, g_want in zip(
            _grads(got, (q, k, v), g), _grads(want, (q64, k64, v64), g), strict=True
        ):
            worst = max(worst, rel_rms(g_got, g_want))
    assert worst <= 2e-3


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
@pytest.mark.parametrize("shape", GROUPED_SHAPES, ids=GROUPED_IDS)
def test_grouped_chunks_match_reference(shape, dtype):
    q, k, v = _features(*shape, dtype=dtype)
    q64, k64, v64 = _as64((q, k, v))
    g = _upstream((*shape[:3], shape[4])).to(dtype)
    for fn, ref in (
        (lambda *x: ks.causal_dot_product(*x, backend="cuda"), causal_dot_product_reference),
        (
            lambda *x: cuda_backend.linear_attention(*x, causal=True),
            lambda *x: linear_attention_reference(*x, causal=True),
        ),
    ):
        got, want = fn(q, k, v), ref(q64, k64, v64)
        pairs = [(got, want)]
        pairs += zip(_grads(got, (q, k, v), g), _grads(want, (q64, k64, v64), g), strict=True)
        for a, b in pairs:
            assert close_in_dtype(a, b, dtype)


# ---------------------------------------------------------------- normalized attention
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_linear_attention_fp32_matches_reference(shape, causal, padded):
    b, h, n, f, m = shape
    q, k, v = _features(b, h, n, f, m)
    mask = None
    if padded:
        lengths = torch.tensor([max(1, n - 3 * i) for i in range(b)], device=DEVICE)
        mask = torch.arange(n, device=DEVICE)[None, :] < lengths[:, None]
        with torch.no_grad():  # whatever padded keys hold, they must not count
            k.masked_fill_(~mask[:, None, :, None], 1e3)
            v.masked_fill_(~mask[:, None, :, None], float("nan"))
    got = cuda_backend.linear_attention(q, k, v, causal=causal, key_padding_mask=mask)
    q64, k64, v64 = _as64((q, k, v))
    want = linear_attention_reference(q64, k64, v64, causal=causal, key_padding_mask=mask)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert rel_err(got, want) <= 1e-4
    g = _upstream(got.shape)
    grads_got = _grads(got, (q, k, v), g)
    grads_want = _grads(want, (q64, k64, v64), g)
    for g_got, g_want in zip(grads_got, grads_want, strict=True):
        g_want = torch.nan_to_num(g_want, nan=0.0)  # reference: NaN values of padded keys
        assert torch.isfinite(g_got).all()
        assert rel_err(g_got, g_want, floor=1.0) <= 1e-4


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES[1:], ids=SHAPE_IDS[1:])
def test_linear_attention_half_matches_reference(shape, causal, dtype):
    q, k, v = _features(*shape, dtype=dtype)
    got = cuda_backend.linear_attention(q, k, v, causal=causal)
    q64, k64, v64 = _as64((q, k, v))
    want = linear_attention_reference(q64, k64, v64, causal=causal)
    assert got.dtype == dtype
    assert rel_rms(got, want) <= 1e-2
    g = _upstream(got.shape).to(dtype)
    for g_got, g_want in zip(
        _grads(got, (q, k, v), g), _grads(want, (q64, k64, v64), g), strict=True
    ):
        assert rel_rms(g_got, g_want) <= 1e-2


@pytest.mark.parametrize("dtype", [*HALF, torch.float32], ids=str)
def test_left_padded_causal_rows_have_finite_gradients(dtype):
    """A causal row whose keys are all padded has den = 0, so d = eps and g/d passes
    float16's 65504: the backward used to compute inf·0 = NaN in dq."""
    b, h, n, f, m = 2, 2, 70, 16, 8
    q, k, v = _features(b, h, n, f, m, dtype=dtype)
    mask = torch.ones(b, n, dtype=torch.bool, device=DEVICE)
    mask[:, :5] = False  # left padding: rows 0..4 attend to no real key
    got = cuda_backend.linear_attention(q, k, v, causal=True, key_padding_mask=mask)
    q64, k64, v64 = _as64((q, k, v))
    want = linear_attention_reference(q64, k64, v64, causal=True, key_padding_mask=mask)
    g = _upstream(got.shape).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for g_got, g_want in zip(
        _grads(got, (q, k, v), g), _grads(want, (q64, k64, v64), g), strict=True
    ):
        assert torch.isfinite(g_got).all()
        assert rel_rms(g_got, g_want) <= tol


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_normalized_attention_builds_no_n_f_m_tensor(causal):
    """The normalizer comes with the numerator: a forward and backward at B·H = 2, N = 32768,
    F = M = 128 (fp32) allocate at most a quarter of one (B, H, N, F, M) tensor (4.3 GB) on
    top of the inputs; chunk states take N·F·M/64 each, the per-row tensors N·M or N·F."""
    b, h, n, f, m = 1, 2, 32768, 128, 128
    q, k, v = _features(b, h, n, f, m)
    g = _upstream((b, h, n, m))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = cuda_backend.linear_attention(q, k, v, causal=causal)
    _grads(out, (q, k, v), g)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= b * h * n * f * m * 4 / 4


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_public_linear_attention_on_cuda(causal):
    q, k, v = _features(2, 3, 100, 32, 48)
    got = ks.linear_attention(q, k, v, causal=causal)  # auto: the cuda backend
    want = ks.linear_attention(q, k, v, causal=causal, backend="torch")
    assert rel_err(got, want) <= 1e-4


@pytest.mark.parametrize("case", ["product", "causal", "full"])
def test_torch_func_and_double_backward(case):
    """jvp, vmap, vmap of grad, jacrev, the Hessian (jacfwd of jacrev) and gradients of
    gradients (create_graph=True) through the cuda backend's Functions, float32, against the
    float64 reference on the GPU: max relative error ≤ 1e-4 (scale at least 1)."""
    b, h, n, f, m = 2, 1, 70, 6, 5
    q, k, v = (t.detach() for t in _features(b, h, n, f, m))
    w, u = _upstream((b, h, n, m)), _upstream((b, h, n, f), seed=2)
    tangents = [_upstream(t.shape, seed=3 + i) for i, t in enumerate((q, k, v))]
    mask = torch.ones(b, n, dtype=torch.bool, device=DEVICE)
    mask[0, :3] = mask[1, 40:] = False

    def pair(mask):
        if case == "product":
            return cuda_backend.causal_product, causal_dot_product_reference
        c = case == "causal"
        return (
            lambda *x: cuda_backend.linear_attention(*x, causal=c, key_padding_mask=mask),
            lambda *x: linear_attention_reference(*x, causal=c, key_padding_mask=mask),
        )

    (fn, ref), (small_fn, small_ref) = pair(mask), pair(mask[:1, 1:5])
    x32, x64 = (q, k, v), _as64((q, k, v))
    small32, small64 = ([t[:1, :, 1:5].detach() for t in x] for x in (x32, x64))
    got = torch_func_results(fn, x32, small_fn, small32, w, u, tangents)
    want = torch_func_results(ref, [t.detach() for t in x64], small_ref, small64, w, u, tangents)
    for i, (a, e) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == torch.float32 and rel_err(a, e, floor=1.0) <= 1e-4, i


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_torch_compile_traces_the_kernels_whole(dtype):
    """``torch.compile(fullgraph=True)`` traces the cuda backend with its kernels as custom ops:
    the product, and causal and non-causal attention with key padding, give eager mode's outputs
    and gradients bit for bit, with each one's kernels (and no others) in the traced forward and
    backward graphs."""
    b, h, n, f, m = 2, 3, 100, 32, 48
    q, k, v = (t.detach().to(dtype) for t in _features(b, h, n, f, m))
    g = _upstream((b, h, n, m)).to(dtype)
    mask = torch.ones(b, n, dtype=torch.bool, device=DEVICE)
    mask[1, 60:] = False
    cases = {
        "product": cuda_backend.causal_product,
        "causal": lambda *x: cuda_backend.linear_attention(*x, causal=True, key_padding_mask=mask),
        "full": lambda *x: ks.linear_attention(*x, key_padding_mask=mask),  # auto: the cuda one
    }
    for name, fn in cases.items():
        assert compiled_matches_eager(fn, (q, k, v), g) == CUDA_COMPILED_OPS[name], name


def test_compiled_with_cuda_graphs_the_kernels_replay(causal_kernel):
    """``torch.compile(mode="reduce-overhead")`` captures the kernels' launches in CUDA graphs
    (workspaces from the graph's pool, launches on the capturing stream): replayed on new
    inputs, the product and causal attention and their gradients match eager mode's (float32,
    max relative error <= 1e-4; the same kernels, so in practice the same bits)."""
    if causal_kernel != "walk_mma":
        pytest.skip("one run is enough")
    b, h, n, f, m = 2, 3, 200, 32, 48

    def forward(q, k, v):
        causal = cuda_backend.linear_attention(q, k, v, causal=True)
        return cuda_backend.causal_product(q, k, v) + causal

    torch._dynamo.reset()
    compiled = torch.compile(forward, fullgraph=True, mode="reduce-overhead")
    for seed in range(4):  # warm-up, capture, then replays on other inputs
        q, k, v = _features(b, h, n, f, m, seed=seed)
        g = _upstream((b, h, n, m), seed=seed)
        results = []
        for fn in (compiled, forward):
            out = fn(q, k, v)
            results.append([out.clone(), *torch.autograd.grad(out, (q, k, v), g)])
        for got, want in zip(*results, strict=True):
            assert rel_err(got, want, floor=1.0) <= 1e-4, seed


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_a_layer_under_autocast_compiles_whole(causal):
    """A kernel-attention layer on CUDA under bfloat16 autocast (as the trainer runs it),
    compiled whole: output and every parameter's gradient within bfloat16's 1e-2 relative RMS
    of eager mode's (the core's kernels are the same; cuBLAS may pick other algorithms for the
    projections' products in the traced graph's layouts)."""
    torch.manual_seed(8)
    layer = ks.nn.KernelAttention(64, 2, causal=causal).to(DEVICE)
    x = torch.randn(2, 300, 64, device=DEVICE)
    runs = (compiled_whole(layer), layer)
    results = outputs_and_grads(
        layer, runs, autocast_bf16("cuda", x), lambda out: out.float().sum()
    )
    assert results[0][0].dtype == torch.bfloat16
    for got, want in zip(*results, strict=True):
        assert close_in_dtype(got.float(), want.float(), torch.bfloat16)


def test_the_kernels_custom_ops_agree_with_their_fake_shapes(causal_kernel):
    """``torch.library.opcheck`` on the CUDA extension's functions as custom ops (schema, fake
    tensors against the kernels' outputs, AOT dispatch, dynamic shapes), for each dtype."""
    if causal_kernel != "walk_mma":
        pytest.skip("one run is enough")
    b, h, n, f, m = 2, 3, 70, 16, 24
    mask = torch.ones(b, n, dtype=torch.bool, device=DEVICE)
    mask[0, 50:] = False
    for dtype in (torch.float32, *HALF):
        q, k, v = (t.detach().to(dtype) for t in _features(b, h, n, f, m))
        g = _upstream((b, h, n, m)).to(dtype)
        for op, args in cuda_custom_op_cases(q, k, v, g, mask):
            torch.library.opcheck(op, args)


def test_a_model_compiled_whole_with_inductor_trains_as_in_eager_mode(causal_kernel):
    """``torch.compile(model, fullgraph=True)`` with inductor (Triton) around the kernels' custom
    ops: a causal LM's loss and every parameter's gradient within 1e-4 relative of eager mode
    (float32; inductor fuses the ops around the core in its own order)."""
    if causal_kernel != "walk_mma":
        pytest.skip("one run is enough")
    torch.manual_seed(0)
    model = ks.nn.CausalLM(50, d_model=64, n_heads=2, n_layers=2, dropout=0.0).to(DEVICE)
    ids = torch.randint(0, 50, (2, 300), device=DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)

    def loss_of(run):
        logits = run(ids)[:, :-1]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    results = outputs_and_grads(model, (compiled, model), loss_of, scalar=lambda loss: loss)
    for got, want in zip(*results, strict=True):
        assert rel_err(got, want, floor=1e-3) <= 1e-4


def test_cross_attention_lengths():
    q = _features(2, 3, 70, 6, 4)[0]
    _, k, v = _features(2, 3, 130, 6, 4, seed=1)
    got = cuda_backend.linear_attention(q, k, v)
    want = linear_attention_reference(*_as64((q, k, v)))
    assert rel_err(got, want) <= 1e-4


def test_recurrent_state_matches_causal_attention():
    b, h, n, f, m = 2, 2, 150, 16, 8
    q, k, v = (t.detach() for t in _features(b, h, n, f, m))
    batch = cuda_backend.linear_attention(q, k, v, causal=True)
    state = RecurrentState.zeros(b, h, f, m, device=DEVICE)
    steps = []
    for t in range(n):
        out_t, state = state.step(q[:, :, t], k[:, :, t], v[:, :, t])
        steps.append(out_t)
    assert rel_err(torch.stack(steps, dim=2), batch) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_recurrent_blocks_match_causal_attention(dtype):
    """``RecurrentState.steps`` on the CUDA product: segments of 70, 1 and 129 tokens (F≠M,
    odd sizes) give the causal attention of the whole, and its gradients through the carried
    states; in float16 with sums past 65504 in a block (the CUDA product rounds to the
    inputs' dtype, so such blocks run it in float32) the outputs stay finite and close."""
    b, h, n, f, m = 2, 2, 200, 33, 70
    q, k, v = _features(b, h, n, f, m, dtype)
    state, outs, start = RecurrentState.zeros(b, h, f, m, device=DEVICE), [], 0
    for size in (70, 1, 129):
        part = slice(start, start + size)
        out, state = state.steps(q[:, :, part], k[:, :, part], v[:, :, part])
        assert out.dtype == dtype
        outs.append(out)
        start += size
    got = torch.cat(outs, 2)
    inputs = _as64((q, k, v))
    want = linear_attention_reference(*inputs, causal=True)
    assert close_in_dtype(got, want, dtype)
    g = _upstream(got.shape)
    for a, w in zip(_grads(got, (q, k, v), g), _grads(want, inputs, g.double()), strict=True):
        assert close_in_dtype(a, w, dtype)
    if dtype == torch.float16:  # q·k = 160 a key: a block of 500 sums to 8e4
        q, k = torch.ones(1, 1, 600, 16, device=DEVICE), torch.full((1, 1, 600, 16), 10.0)
        q, k, v = q.half(), k.half().to(DEVICE), torch.randn(1, 1, 600, 4).half().to(DEVICE)
        start = RecurrentState.zeros(1, 1, 16, 4, device=DEVICE)
        _, state = start.steps(q[:, :, :100], k[:, :, :100], v[:, :, :100])
        out, _ = state.steps(q[:, :, 100:], k[:, :, 100:], v[:, :, 100:])
        want = linear_attention_reference(*_as64((q, k, v)), causal=True)[:, :, 100:]
        assert close_in_dtype(out, want, dtype)


def test_scaled_cumsum_matches_torch():
    x = torch.rand(2, 3, 300, 70, device=DEVICE)
    w = torch.rand(2, 3, 300, device=DEVICE)
    ext = cuda_backend.extension()
    got = ext.scaled_cumsum(x, None, w, reverse=False)
    want = w.unsqueeze(-1) * x.double().cumsum(2)
    assert rel_err(got, want) <= 1e-5
    got = ext.scaled_cumsum(x, w, None, reverse=True)
    want = (w.unsqueeze(-1) * x.double()).flip(2).cumsum(2).flip(2)
    assert rel_err(got, want) <= 1e-5
    base = torch.randn(2, 3, 300, 70, device=DEVICE)  # the products' dq or dk, added in fp32
    got = ext.scaled_cumsum(x, w, None, reverse=True, base=base)
    assert rel_err(got, base.double() + want) <= 1e-5
    for dtype in HALF:  # written in x's dtype: the float32 result rounded once
        narrow = ext.scaled_cumsum(x.to(dtype), w, None, True, base=base, out_fp32=False)
        wide = ext.scaled_cumsum(x.to(dtype), w, None, True, base=base)
        assert narrow.dtype == dtype and torch.equal(narrow, wide.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_normalized_grad_matches_torch(dtype):
    """The normalized backward's row terms: dnum = g/d (bf16 for bf16, else float32) with
    torch's bits, dden = -(g·out)/d in float32, d = den + eps (den 0 on rows with no real key)."""
    g, out = (torch.randn(2, 3, 300, 70, device=DEVICE).to(dtype) for _ in "go")
    den = 10 * torch.rand(2, 3, 300, device=DEVICE)
    den[0, 0, :3] = 0
    dnum, dden = cuda_backend.extension().normalized_grad(g, out, den, 1e-6)
    d = den + 1e-6
    operand = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    assert dnum.dtype == operand and torch.equal(dnum, (g.float() / d[..., None]).to(operand))
    want = -(g.double() * out.double()).sum(-1) / d.double()
    assert dden.dtype == torch.float32 and rel_err(dden, want) <= 1e-6
    # the non-causal backward's form: float32, dden as a last column
    both, absent = cuda_backend.extension().normalized_grad(
        g, out, den, 1e-6, dden_column=True, dnum_fp32=True
    )
    assert absent is None and both.dtype == torch.float32 and both.shape == (2, 3, 300, 71)
    assert torch.equal(both[..., :70], g.float() / d[..., None])
    assert rel_err(both[..., 70], want) <= 1e-6


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_full_backward_kernels_read_the_inputs_dtype(causal_kernel, dtype):
    """The non-causal backward's kernels: the reduction of a 16-bit q beside fp32 row terms has
    the bits of the all-float32 one; the read-out of fp32 operands into ``out_dtype`` is the
    float32 read-out rounded once; the read-out's bias and padded rows (exact zeros, out and
    den, whatever x holds there) against float64."""
    if causal_kernel != "chunks":
        pytest.skip("non-causal: one run is enough")
    ext = cuda_backend.extension()
    b, h, n, f, m = 2, 3, 1100, 33, 70
    q = torch.rand(b, h, n, f, device=DEVICE).to(dtype)
    dnum = torch.randn(b, h, n, m + 1, device=DEVICE)
    keep = torch.ones(b, n, dtype=torch.bool, device=DEVICE)
    keep[-1, n // 3 :] = False
    state = ext.full_state(q, dnum, keep)
    assert torch.equal(state, ext.full_state(q.float(), dnum, keep))
    want = torch.einsum("bhnf,bhnm,bn->bhfm", q.double(), dnum.double(), keep.double())
    assert rel_err(state[..., : f * (m + 1)].reshape(b, h, f, m + 1), want) <= 1e-5
    mat = torch.randn(b, h, (m + 1) * f, device=DEVICE)
    mat = torch.cat([mat, torch.zeros(b, h, m + 1, device=DEVICE)], dim=-1)
    got = ext.full_apply(dnum, mat, f, out_fp32=False, out_dtype=dtype)[0]
    assert got.dtype == dtype
    assert torch.equal(got, ext.full_apply(dnum, mat, f, out_fp32=True)[0].to(dtype))
    x = torch.randn(b, h, n, m, device=DEVICE).to(dtype)
    x[-1, :, -5:] = float("nan")  # padded rows: never seen
    s, z = torch.randn(b, h, m, f, device=DEVICE), torch.rand(b, h, m, device=DEVICE)
    bias = torch.randn(b, h, f, device=DEVICE)
    state = torch.cat([s.reshape(b, h, m * f), z], dim=-1)
    kept = keep[:, None, :, None]
    x64 = torch.where(kept, x.double(), 0.0)
    want = (x64 @ s.double() + bias.double()[:, :, None]) * kept
    for out_fp32 in (True, False):
        out, den = ext.full_apply(
            x, state, f, out_fp32=out_fp32, with_den=True, bias=bias, key_padding_mask=keep
        )
        assert close_in_dtype(out, want, dtype)
        assert (out.masked_select(~kept) == 0).all()
        assert (den.masked_select(~keep[:, None]) == 0).all()


# ---------------------------------------------------------------- fused backward
@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
@pytest.mark.parametrize("shape", SHAPES + GROUPED_SHAPES, ids=SHAPE_IDS + GROUPED_IDS)
def test_fused_backward_matches_reference(shape, dtype):
    b, h, n, f, m = shape
    q, k, v = (t.detach() for t in _features(*shape, dtype=dtype))
    g = _upstream((b, h, n, m)).to(dtype)
    q64, k64, v64 = _as64((q, k, v))
    want = _grads(causal_dot_product_reference(q64, k64, v64), (q64, k64, v64), g)
    ext = cuda_backend.extension()
    for out_fp32 in (False, True):
        got = cuda_backend._fused_backward(ext, q, k, v, g, out_fp32=out_fp32)
        for a, w in zip(got, want, strict=True):
            assert a.shape == w.shape and a.dtype == (torch.float32 if out_fp32 else dtype)
            assert torch.isfinite(a).all() and close_in_dtype(a, w, dtype)


@pytest.mark.parametrize("walk_blocks", [1, 7], ids=["one_segment", "7"])
def test_backward_walks_together_give_the_bits_of_two_launches(
    monkeypatch, causal_kernel, walk_blocks
):
    """Kernels 10 (walk_mma) and 11 (walk) run the fused backward's dq walk and its dk, dv walk
    in one grid (bfloat16, F, M <= 64, where an SM holds two blocks): the same bits as the two
    launches (WALKS_TOGETHER False), with one segment a sequence and with several (both walks'
    carries in one workspace)."""
    if causal_kernel == "chunks":
        pytest.skip("kernels 10 and 11 are the walks' backward")
    monkeypatch.setattr(cuda_backend, "WALK_BLOCKS", walk_blocks)
    q, k, v = (t.detach() for t in _features(1, 3, 200, 48, 40, dtype=torch.bfloat16))
    g = _upstream((1, 3, 200, 40)).to(torch.bfloat16)
    ext = cuda_backend.extension()
    results = {}
    for together in (True, False):
        monkeypatch.setattr(cuda_backend, "WALKS_TOGETHER", together)
        results[together] = cuda_backend._fused_backward(ext, q, k, v, g, out_fp32=True)
    kernel = ext.walk_kernels(q, 48, 40, causal_kernel == "walk_mma")["dkv"][0]
    assert kernel in (10, 11) or torch.cuda.get_device_capability() < (9, 0)
    for a, b in zip(results[True], results[False], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_walk_carries_in_groups_match_whole_sequences(monkeypatch, causal_kernel, dtype):
    """B·H = 16 at N = 32768 (512 chunks) with WALK_BLOCKS 32: two segments of 256 chunks a
    sequence, whose carries the pass sums in groups of 8 chunks (walk_layout: 32 groups a
    segment, 512 thread blocks; the emulator's CARRY_CAP checks the layout); the products both
    ways and the fused backward (both walks in one grid and apart) agree with one segment a
    sequence (WALK_BLOCKS 1: no carries)."""
    if causal_kernel == "chunks":
        pytest.skip("segments are the walks'")
    q, k, v = (t.detach() for t in _features(2, 8, 32768, 64, 64, dtype=dtype))
    g = _upstream((2, 8, 32768, 64)).to(dtype)
    ext = cuda_backend.extension()

    def run(blocks: int) -> list[torch.Tensor]:
        monkeypatch.setattr(cuda_backend, "WALK_BLOCKS", blocks)
        got = [cuda_backend._product(ext, q, k, v, r, out_fp32=True) for r in (False, True)]
        for together in (True, False):
            monkeypatch.setattr(cuda_backend, "WALKS_TOGETHER", together)
            got += cuda_backend._fused_backward(ext, q, k, v, g, out_fp32=True)
        return got

    whole = run(1)
    for a, w in zip(run(32), whole, strict=True):
        assert close_in_dtype(a, w, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_fused_backward_in_autograd_matches_three_products(monkeypatch, dtype):
    q, k, v = _features(2, 3, 200, 33, 70, dtype=dtype)
    mask = torch.ones(2, 200, dtype=torch.bool, device=DEVICE)
    mask[1, 150:] = False
    g = _upstream((2, 3, 200, 70)).to(dtype)
    grads = {}
    for fused in (False, True):
        monkeypatch.setattr(cuda_backend, "FUSED_BACKWARD", fused)
        product = ks.causal_dot_product(q, k, v, backend="cuda")
        attention = cuda_backend.linear_attention(q, k, v, causal=True, key_padding_mask=mask)
        grads[fused] = [*_grads(product, (q, k, v), g), *_grads(attention, (q, k, v), g)]
    for a, b in zip(grads[True], grads[False], strict=True):
        assert close_in_dtype(a, b, dtype)


# ---------------------------------------------------------------- determinism
def _run_all(dtype, shift=0):
    q, k, v = _features(2, 2, 3000, 64, 64, dtype=dtype, shift=shift)
    mask = torch.ones(2, 3000, dtype=torch.bool, device=DEVICE)
    mask[1, 2500:] = False
    results = []
    for fn in (
        lambda: ks.causal_dot_product(q, k, v, backend="cuda"),
        lambda: cuda_backend.linear_attention(q, k, v, causal=True, key_padding_mask=mask),
        lambda: cuda_backend.linear_attention(q, k, v, causal=False, key_padding_mask=mask),
    ):
        out = fn()
        g = shifted(_upstream(out.shape).to(out.dtype), shift)
        results += [out.detach(), *_grads(out, (q, k, v), g)]
    return results


@pytest.mark.parametrize("fused", [False, True], ids=["three_products", "fused_backward"])
@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_bit_identical_reruns(monkeypatch, dtype, fused):
    monkeypatch.setattr(cuda_backend, "FUSED_BACKWARD", fused)
    first, second = _run_all(dtype), _run_all(dtype)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fused", [False, True], ids=["three_products", "fused_backward"])
@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_misaligned_inputs_give_the_same_bits(monkeypatch, dtype, fused):
    """Inputs and upstream gradients that start one element past an aligned address (views
    into a larger buffer) cannot move as 16-byte vectors or with cp.async: the kernels load
    them element by element, with the same results bit for bit."""
    monkeypatch.setattr(cuda_backend, "FUSED_BACKWARD", fused)
    aligned, moved = _run_all(dtype), _run_all(dtype, shift=1)
    for a, b in zip(aligned, moved, strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- the walk kernel
# F = M = 64 (two buffers in kernel 7), F ≠ M with two M slices, F = 96 > M, one row, and F = 130:
# the walk covers dq and dk (F' = M = 20) while dv runs the chunk kernels.
WALK_SHAPES = [SHAPES[6], SHAPES[4], SHAPES[2], (2, 1, 1, 4, 3), (1, 2, 300, 130, 20)]
WALK_IDS = ["x".join(map(str, s)) for s in WALK_SHAPES]


@pytest.mark.parametrize("walk_blocks", [1, 5, 10**6], ids=["one_segment", "5", "per_chunk"])
@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
@pytest.mark.parametrize("shape", WALK_SHAPES, ids=WALK_IDS)
def test_walk_segments_match_reference(monkeypatch, causal_kernel, shape, dtype, walk_blocks):
    """Segments of every length (the whole sequence, ragged groups, one chunk each) give the
    product, the normalized attention and their gradients (three products and the fused
    backward), forward and anti-causal, with the normalizer; under each walk kernel."""
    if causal_kernel == "chunks":
        pytest.skip("segments are the walks'")
    monkeypatch.setattr(cuda_backend, "WALK_BLOCKS", walk_blocks)
    kernel = cuda_backend._kernel_args(dtype)
    b, h, n, f, m = shape
    q, k, v = _features(*shape, dtype=dtype)
    q64, k64, v64 = _as64((q, k, v))
    mask = torch.ones(b, n, dtype=torch.bool, device=DEVICE)
    mask[-1, n // 2 + 1 :] = False
    g = _upstream((b, h, n, m)).to(dtype)
    # Normalized over one key (N = 1) the φq-gradient is eps·k/(φq·k + eps)², about 1e-7 here,
    # below float16's normal range: in half precision it is met on the scale of its terms (the
    # O(1) products whose difference it is; bfloat16's rounding of the saved output leaves
    # 2e-4), not relative to itself. Same inputs in float32 keep the 1e-4 check.
    for fn, ref, floor in (
        (
            lambda *x: ks.causal_dot_product(*x, backend="cuda"),
            causal_dot_product_reference,
            1e-12,
        ),
        (
            lambda *x: cuda_backend.linear_attention(*x, causal=True, key_padding_mask=mask),
            lambda *x: linear_attention_reference(*x, causal=True, key_padding_mask=mask),
            1.0 if n == 1 else 1e-12,
        ),
    ):
        got, want = fn(q, k, v), ref(q64, k64, v64)
        assert got.dtype == dtype
        pairs = [(got, want)]
        pairs += zip(_grads(got, (q, k, v), g), _grads(want, (q64, k64, v64), g), strict=True)
        for a, w in pairs:
            assert torch.isfinite(a).all() and close_in_dtype(a, w, dtype, half_floor=floor)
    ext = cuda_backend.extension()
    q, k, v, g = (t.detach() for t in (q, k, v, g))
    for a, w in zip(
        ext.causal_backward(q, k, v, g, out_fp32=True, **kernel),
        _grads(causal_dot_product_reference(q64, k64, v64), (q64, k64, v64), g),
        strict=True,
    ):  # the walk's fused backward: dq by one walk, dk and dv by one reverse walk
        assert a.dtype == torch.float32 and torch.isfinite(a).all() and close_in_dtype(a, w, dtype)
    wide = ext.causal_backward(q, k, v, g, out_fp32=True, **kernel)
    for together in (True, False):  # dv in the inputs' dtype (the normalized backward's call)
        dq, dk, dv = ext.causal_backward(
            q, k, v, g, out_fp32=True, dv_fp32=False, walks_together=together, **kernel
        )
        assert torch.equal(dq, wide[0]) and torch.equal(dk, wide[1])
        assert dv.dtype == dtype and torch.equal(dv, wide[2].to(dtype))
    for reverse in (False, True):
        out, den = ext.causal_product(
            q, k, v, reverse=reverse, out_fp32=True, with_den=True, **kernel
        )
        flip = (lambda x: x.flip(2)) if reverse else (lambda x: x)
        want = flip(causal_dot_product_reference(flip(q64), flip(k64), flip(v64)))
        ones = torch.ones(*q64.shape[:3], 1, dtype=torch.float64, device=DEVICE)
        want_den = flip(causal_dot_product_reference(flip(q64), flip(k64), ones))[..., 0]
        assert out.dtype == torch.float32 and close_in_dtype(out, want, dtype)
        assert close_in_dtype(den, want_den, dtype)


def _by_kernel(monkeypatch, fn) -> dict[str, torch.Tensor]:
    """fn() under each causal kernel."""
    got = {}
    for kernel in cuda_backend.CAUSAL_KERNELS:
        monkeypatch.setattr(cuda_backend, "CAUSAL_KERNEL", kernel)
        got[kernel] = fn()
    return got


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_walk_falls_back_to_chunks_above_f_128(monkeypatch, dtype):
    """F > 128 is outside the walks: they run the chunk kernels, bit for bit."""
    q, k, v = (t.detach() for t in _features(1, 2, 129, 130, 20, dtype=dtype))
    got = _by_kernel(monkeypatch, lambda: ks.causal_dot_product(q, k, v, backend="cuda"))
    assert torch.equal(got["walk"], got["chunks"]) and torch.equal(got["walk_mma"], got["chunks"])


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_walk_matches_chunk_kernels(monkeypatch, dtype):
    """The kernels agree to the precision of their operands on a long, many-head case (kernel
    8 for walk_mma at F = 64); at F = 80 walk_mma runs kernel 8 on two feature slices in
    bfloat16, and kernel 6 in the other dtypes, bit for bit the walk's."""
    q, k, v = (t.detach() for t in _features(2, 8, 2500, 64, 64, dtype=dtype))
    got = _by_kernel(monkeypatch, lambda: cuda_backend.linear_attention(q, k, v, causal=True))
    assert close_in_dtype(got["walk"], got["chunks"], dtype)
    assert close_in_dtype(got["walk_mma"], got["chunks"], dtype)
    q, k, v = (t.detach() for t in _features(1, 2, 300, 80, 24, dtype=dtype))
    got = _by_kernel(monkeypatch, lambda: cuda_backend.linear_attention(q, k, v, causal=True))
    if dtype == torch.bfloat16:
        assert close_in_dtype(got["walk_mma"], got["chunks"], dtype)
    else:
        assert torch.equal(got["walk_mma"], got["walk"])


# ---------------------------------------------------------------- 64-bit indexing
# B·H = 2, F = 64: q and k hold 2.28e9 elements; head 1's rows from 2**31 / 64 - BIG_N on lie
# past element 2**31, where a 32-bit offset wraps. The upstream gradient is zero except on head
# 1's last BIG_TAIL rows, so every result has a closed form in float64.
BIG_N, BIG_TAIL, BIG_F, BIG_M = 2**24 + 2**20, 256, 64, 8


def _state_sums(k: torch.Tensor, v: torch.Tensor, stop: int, block: int = 2**22):
    """Σ_{j<stop} k_jᵀ v_j (F, M) and Σ_{j<stop} k_j (F) of rows k: (N, F), v: (N, M), in
    float64, a block of rows at a time (a float64 copy of all of k would take 9 GB)."""
    s = torch.zeros(k.shape[-1], v.shape[-1], dtype=torch.float64, device=k.device)
    z = torch.zeros(k.shape[-1], dtype=torch.float64, device=k.device)
    for a in range(0, stop, block):
        kb, vb = k[a : min(stop, a + block)].double(), v[a : min(stop, a + block)].double()
        s += kb.T @ vb
        z += kb.sum(0)
    return s, z


def _tail_case(n: int, tail: int, device: str, backend: str):
    """q, k, v of (1, 2, n, BIG_F/BIG_M) in bf16; the causal product with its gradients for an
    upstream gradient on head 1's last `tail` rows; and the non-causal attention of those rows'
    queries over all keys. Returns (got, want) pairs, want in float64 from closed forms."""
    gen = torch.Generator(device=device).manual_seed(0)
    dt = torch.bfloat16
    q, k = (torch.rand(1, 2, n, BIG_F, generator=gen, device=device, dtype=dt) for _ in "qk")
    v = torch.randn(1, 2, n, BIG_M, generator=gen, device=device, dtype=dt)
    t = n - tail
    g = torch.zeros_like(v)
    g[0, 1, t:] = torch.randn(tail, BIG_M, generator=gen, device=device, dtype=dt)
    for x in (q, k, v):
        x.requires_grad_()
    out = ks.causal_dot_product(q, k, v, backend=backend)
    dq, dk, dv = _grads(out, (q, k, v), g)
    q1, k1, v1, g1 = (x.detach()[0, 1] for x in (q, k, v, g))
    prefix, _ = _state_sums(k1, v1, t)  # P = Σ_{j<t} k_jᵀ v_j
    rows = [x[t:].double().requires_grad_() for x in (q1, k1, v1)]
    want = causal_dot_product_reference(*(x[None, None] for x in rows))[0, 0] + rows[0] @ prefix
    want_dq, want_dk, want_dv = torch.autograd.grad(want, rows, g1[t:].double())
    r = q1[t:].double().T @ g1[t:].double()  # R = Σ_tail q_iᵀ g_i: dk_j = v_j Rᵀ, dv_j = k_j R
    before = torch.cat([torch.arange(4096), torch.arange(t - 8192, t)]).to(device)
    pairs = [
        (out[0, 1, t:], want),
        (dq[0, 1, t:], want_dq),
        (dk[0, 1, t:], want_dk),
        (dv[0, 1, t:], want_dv),
        (dk[0, 1, before], v1[before].double() @ r.T),
        (dv[0, 1, before], k1[before].double() @ r),
    ]
    zeros = [dq[0, 1, :t], dq[0, 0], dk[0, 0], dv[0, 0]]  # no upstream gradient reaches them
    s, z = _state_sums(k1, v1, n)
    qt = q.detach()[:, :, t:]
    full = cuda_backend.linear_attention if backend == "cuda" else ks.linear_attention
    got_full = full(qt, k.detach(), v.detach(), causal=False)[0, 1]
    pairs.append((got_full, (qt[0, 1].double() @ s) / (qt[0, 1].double() @ z + 1e-6)[:, None]))
    return pairs, zeros


@pytest.mark.parametrize("fused", [False, True], ids=["three_products", "fused_backward"])
def test_offsets_past_2_to_the_31(monkeypatch, fused):
    """64-bit indexing on tensors of more than 2**31 elements, bf16 (fp32 would take twice
    the 20 GB): the causal product's output and gradients on rows past element 2**31 and on
    head 1's first rows, exact zeros where no gradient reaches, and the non-causal attention
    of the last rows' queries over all keys."""
    if torch.cuda.mem_get_info()[0] < 40e9:
        pytest.skip("needs 40 GB of free GPU memory")
    assert 2 * BIG_N * BIG_F > 2**31 and (2 * BIG_N - BIG_TAIL - 8192) * BIG_F > 2**31
    monkeypatch.setattr(cuda_backend, "FUSED_BACKWARD", fused)
    pairs, zeros = _tail_case(BIG_N, BIG_TAIL, DEVICE, "cuda")
    for got, want in pairs:
        assert close_in_dtype(got, want, torch.bfloat16)
    for z in zeros:
        assert not z.any()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_backward_inside_autocast_changes_nothing(causal):
    """The backwards' float32 matmuls ran in half precision when backward() was called
    inside an autocast region (inf at a loss scale of 2**16)."""
    torch.manual_seed(0)
    q, k = (torch.rand(2, 2, 2048, 32, device="cuda") + 0.5 for _ in range(2))
    v = torch.randn(2, 2, 2048, 32, device="cuda") + 1
    grads = []
    for enabled in (False, True):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=enabled):
            out = ks.linear_attention(*inputs, causal=causal, backend="cuda")
            grads.append(torch.autograd.grad(out.sum() * 2**16, inputs))
    for plain, cast in zip(*grads, strict=True):
        assert torch.isfinite(cast).all() and torch.equal(plain, cast)


# ---------------------------------------------------------------- launch configuration, streams
def test_more_sequences_than_grid_y_holds():
    """B·H = 70000 sequences, past gridDim.y's (and z's) limit of 65535: the kernels enumerate
    (sequence, chunk or segment) pairs in grid.x, so every entry point runs and matches the
    reference (a launch with B·H in grid.y would fail with an invalid configuration)."""
    b, h, n, f, m = 2, 35000, 5, 4, 3
    q, k, v = _features(b, h, n, f, m)
    q64, k64, v64 = _as64((q, k, v))
    g = _upstream((b, h, n, m))
    for fn, ref in (
        (cuda_backend.causal_product, causal_dot_product_reference),
        (
            lambda *x: cuda_backend.linear_attention(*x, causal=True),
            lambda *x: linear_attention_reference(*x, causal=True),
        ),
        (cuda_backend.linear_attention, linear_attention_reference),
    ):
        got, want = fn(q, k, v), ref(q64, k64, v64)
        pairs = [(got, want)]
        pairs += zip(_grads(got, (q, k, v), g), _grads(want, (q64, k64, v64), g), strict=True)
        for a, w in pairs:
            assert rel_err(a, w, floor=1.0) <= 1e-4
    ext = cuda_backend.extension()
    want = _grads(causal_dot_product_reference(q64, k64, v64), (q64, k64, v64), g)
    got = cuda_backend._fused_backward(ext, q.detach(), k.detach(), v.detach(), g, True)
    for a, w in zip(got, want, strict=True):
        assert rel_err(a, w, floor=1.0) <= 1e-4


def test_kernels_run_on_the_current_stream():
    """Every entry point enqueues on torch's current stream. On a side stream that is kept busy
    (a spin of about 50 ms) before it writes the inputs, the results match those of the default
    stream bit for bit; a kernel enqueued on the legacy default stream (or any other) would run
    before the inputs are written and read zeros."""
    ext = cuda_backend.extension()
    kernel = cuda_backend._kernel_args(torch.bfloat16)
    q, k, v = (t.detach() for t in _features(2, 3, 300, 32, 24, dtype=torch.bfloat16))
    g = _upstream((2, 3, 300, 24)).to(torch.bfloat16)

    def run(q, k, v, g):
        return [
            *ext.causal_product(q, k, v, with_den=True, normalize=True, **kernel),
            *ext.causal_backward(q, k, v, g, out_fp32=True, **kernel),
            *ext.full_apply(q, ext.full_state(k, v), v.shape[-1], with_den=True),
            ext.scaled_cumsum(k, None, None, reverse=True),
            ext.scaled_cumsum(k, base=q.float(), out_fp32=False),
            ext.normalized_grad(g, v, q.float().sum(-1), 1e-6)[1],
            ext.normalized_grad(g, v, q.float().sum(-1), 1e-6, dden_column=True)[0],
        ]

    want = run(q, k, v, g)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        inputs = [torch.zeros_like(t) for t in (q, k, v, g)]
        torch.cuda._sleep(100_000_000)
        for dst, src in zip(inputs, (q, k, v, g), strict=True):
            dst.copy_(src)
        got = run(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    for a, w in zip(got, want, strict=True):
        assert torch.equal(a, w)


# kernels 8 and 9 (F = M = 64), 6 or 8 with two feature slices and 7 (100), no walk (200)
WALK_KERNEL_CASES = [(d, 64) for d in (torch.float32, *HALF)]
WALK_KERNEL_CASES += [(torch.float32, 100), (torch.bfloat16, 100), (torch.bfloat16, 200)]


@pytest.mark.parametrize(
    "dtype, d", WALK_KERNEL_CASES, ids=[f"{t}-D={d}" for t, d in WALK_KERNEL_CASES]
)
def test_walk_kernels_name_the_kernels_that_run(monkeypatch, causal_kernel, dtype, d):
    """ext.walk_kernels (the kernels and blocks per SM that benchmarks/cuda_scaling.py reports)
    names the walk kernels that a forward+backward step with the fused backward launches, as
    torch.profiler sees them (F = M = D: the backward's dq walk is then the product's kernel);
    each kernel it names fits at least one block on an SM, and none where no walk runs. With
    walk_mma above F, M = 64 the backend runs the backward as WIDE_BACKWARD says (three products
    on the forward's kernel, or the chunk kernels), so the step's one walk kernel is the
    product's."""
    from torch.profiler import ProfilerActivity, profile

    kernel_number = benchmark_script("cuda_scaling").kernel_number  # the profiler's names read
    monkeypatch.setattr(cuda_backend, "FUSED_BACKWARD", True)
    monkeypatch.setattr(cuda_backend, "WALK_BLOCKS", 1)
    q, k, v = _features(2, 2, 200, d, d, dtype)
    g = _upstream((2, 2, 200, d)).to(dtype)
    said = cuda_backend.extension().walk_kernels(q, d, d, causal_kernel == "walk_mma")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        cuda_backend.causal_product(q, k, v).backward(g)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    if not events:
        pytest.skip("torch.profiler recorded no CUDA kernel here (no CUPTI?)")
    ran = {kernel_number(event.key) for event in events} - {None}
    if causal_kernel == "chunks":
        want = set()
    elif cuda_backend._wide_walk_mma(q, v):  # the backward on the product's kernel or the chunks'
        want = {said["product"][0]} - {0}
    else:
        want = {said["product"][0], said["dkv"][0]} - {0}
    assert ran == want
    for kernel, blocks in said.values():
        assert (blocks >= 1) if kernel else blocks == 0
    # an A100's and an H100's shared memory fit kernels 6 to 9 at F = M = 64 in bf16; an H100's
    # also two blocks of kernel 10 or 11 an SM (the backward's dq walk beside its dk, dv walk)
    capability = torch.cuda.get_device_capability()
    if capability in ((8, 0), (9, 0)) and d == 64 and dtype == torch.bfloat16:
        together = capability == (9, 0)
        want = {
            "walk": (6, 11 if together else 7),
            "walk_mma": (8, 10 if together else 9),
        }.get(causal_kernel)
        assert want is None or (said["product"][0], said["dkv"][0]) == want
