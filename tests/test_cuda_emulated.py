"""The CUDA kernels of ``csrc/cuda``, run on the CPU by ``tests/cuda_emulator``, against the
float64 reference: no GPU needed, so CI checks the kernels' logic on every change.

The emulator compiles ``linear_attention.cu`` as C++ with g++ (shim CUDA headers; each thread a
fiber, barriers and warp operations as on a GPU, WMMA tiles computed in float). It checks
indexing, masking, chunk grouping, segment carries, shared-memory layout (reads of unwritten
shared memory give NaN; writes past it abort) and barrier placement (the threads of a block run
in a seeded random order between barriers, so a missing barrier changes results with the seed).
It does not check timing, occupancy or the GPU's exact rounding; ``tests/test_cuda_backend.py``
does that on a GPU. Tolerances: float32 max relative error ≤ 1e-4 (3xTF32), bfloat16/float16
relative RMS error ≤ 1e-2, as on the GPU.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kernelstudy.core import causal_dot_product_reference, linear_attention_reference
from kernelstudy.core.extensions import csrc_dir

from .conftest import rel_err

EMULATOR = Path(__file__).resolve().parent / "cuda_emulator"
GXX = shutil.which("g++")
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
H100_SMEM, A100_SMEM = 232448, 166912  # opt-in shared memory per block (bytes)

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ is not on PATH")


@pytest.fixture(scope="module")
def emu(tmp_path_factory) -> ctypes.CDLL:
    """The kernels and tests/cuda_emulator/harness.cpp built into one shared library."""
    cuda = csrc_dir() / "cuda"
    lib = tmp_path_factory.mktemp("cuda_emulator") / "ks_emulated.so"
    # -fno-strict-aliasing: the kernels read 16-byte vectors through other types, as CUDA allows
    command = [
        GXX, "-std=c++17", "-O2", "-fno-strict-aliasing", "-shared", "-fPIC", "-w",
        "-I", str(EMULATOR), "-I", str(csrc_dir()), "-I", str(cuda),
        "-x", "c++", str(cuda / "linear_attention.cu"), "-x", "c++", str(EMULATOR / "harness.cpp"),
        "-o", str(lib),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"g++ failed:\n{result.stderr[-6000:]}"
    module = ctypes.CDLL(str(lib))
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    module.ks_emu_configure.argtypes = [ctypes.c_uint64, i64]
    module.ks_emu_causal_product.argtypes = [i32, p, p, p, p, i32, p, i32, f32, *[i64] * 4]
    module.ks_emu_causal_product.argtypes += [i32, i64]
    module.ks_emu_causal_backward.argtypes = [i32, *[p] * 7, i32, *[i64] * 5]
    module.ks_emu_full_attention.argtypes = [i32, p, p, p, p, i64, p, p, f32, *[i64] * 5]
    module.ks_emu_scaled_cumsum.argtypes = [i32, p, p, p, p, i64, i64, i64, i32]
    module.ks_emu_configure(0, H100_SMEM)
    return module


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(None if t is None else t.data_ptr())


def _inputs(bh, n, f, m, dtype, seed=0, extra=0):
    """q, k (positive features) and v (plus `extra` tensors like v), (BH, N, ·), in dtype."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.rand(bh, n, f, generator=gen), torch.rand(bh, n, f, generator=gen)
    rest = [torch.randn(bh, n, m, generator=gen) for _ in range(1 + extra)]
    return [t.to(dtype).contiguous() for t in (q, k, *rest)]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    assert torch.isfinite(got).all()
    if dtype == torch.float32:
        return rel_err(got, want, floor=1.0) <= 1e-4
    scale = want.double().pow(2).mean().sqrt().item()
    return (got.double() - want.double()).pow(2).mean().sqrt().item() <= 1e-2 * max(scale, 1e-12)


def _product(emu, q, k, v, reverse=False, walk_blocks=0, normalize=False):
    bh, n, f = q.shape
    m = v.shape[-1]
    out, den = torch.empty(bh, n, m), torch.empty(bh, n)
    err = emu.ks_emu_causal_product(
        DTYPES[q.dtype], _ptr(q), _ptr(k), _ptr(v), _ptr(out), 1, _ptr(den), int(normalize),
        1e-6, bh, n, f, m, int(reverse), walk_blocks,
    )  # fmt: skip
    assert err == 0
    return out, den


def _reference_product(q, k, v, reverse=False):
    """Σ_{j≤i} (q_i·k_j) v_j (j ≥ i with reverse) and its normalizer, in float64."""
    flip = (lambda x: x.flip(1)) if reverse else (lambda x: x)
    q, k, v = (flip(t.double())[None] for t in (q, k, v))
    ones = torch.ones(*v.shape[:-1], 1, dtype=torch.float64)
    return flip(causal_dot_product_reference(q, k, v)[0]), flip(
        causal_dot_product_reference(q, k, ones)[0, ..., 0]
    )


# (BH, N, F, M): one row; N not a multiple of the chunk with odd F and M; F = 96 > M (two F
# slices); F ≠ M with two M slices; F = M = 130 (three slices: outside the walk).
SHAPES = [(2, 1, 4, 3), (6, 37, 8, 5), (3, 130, 96, 40), (2, 200, 33, 70), (1, 70, 130, 130)]
IDS = ["x".join(map(str, s)) for s in SHAPES]
# walk_blocks: 0 = the chunk kernels; 1 = one walk per sequence; 5 = ragged segments; 10**6 =
# one chunk per segment.
KERNELS = [0, 1, 5, 10**6]
KERNEL_IDS = ["chunks", "walk_whole", "walk_5", "walk_per_chunk"]


@pytest.mark.parametrize("walk_blocks", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_causal_product_and_normalizer(emu, shape, dtype, walk_blocks):
    q, k, v = _inputs(*shape, dtype)
    for reverse in (False, True):
        want, want_den = _reference_product(q, k, v, reverse)
        out, den = _product(emu, q, k, v, reverse, walk_blocks)
        assert _close(out, want, dtype) and _close(den, want_den, dtype)
        normalized, _ = _product(emu, q, k, v, reverse, walk_blocks, normalize=True)
        assert _close(normalized, want / (want_den[..., None] + 1e-6), dtype)


@pytest.mark.parametrize("walk_blocks", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_fused_backward(emu, shape, dtype, walk_blocks):
    """dq, dk, dv of the fused backward: the chunk kernels' (kernels 4, 5) or the walk's
    (kernel 6 for dq, kernel 7 for dk and dv, two walks where F or M exceeds 128)."""
    bh, n, f, m = shape
    q, k, v, g = _inputs(*shape, dtype, extra=1)
    grads = [torch.empty(bh, n, d) for d in (f, f, m)]
    err = emu.ks_emu_causal_backward(
        DTYPES[dtype], *map(_ptr, (q, k, v, g, *grads)), 1, bh, n, f, m, walk_blocks
    )
    assert err == 0
    q64, k64, v64 = (t.double()[None].requires_grad_() for t in (q, k, v))
    out = causal_dot_product_reference(q64, k64, v64)
    want = torch.autograd.grad(out, (q64, k64, v64), g.double()[None])
    for got, w in zip(grads, want, strict=True):
        assert _close(got, w[0], dtype)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("shape", [(6, 37, 8, 5), (4, 1100, 33, 70)], ids=["small", "two_blocks"])
def test_full_attention_with_key_padding(emu, shape, dtype):
    """Non-causal: the state over blocks of 1024 keys with padding, then the read-out."""
    bh, s, f, m = shape
    heads, n = 2, 45
    q = _inputs(bh, n, f, m, dtype, seed=1)[0]
    k, v = _inputs(bh, s, f, m, dtype, seed=2)[1:]
    keep = torch.ones(bh // heads, s, dtype=torch.bool)
    keep[-1, s // 3 :] = False
    out, den = torch.empty(bh, n, m), torch.empty(bh, n)
    err = emu.ks_emu_full_attention(
        DTYPES[dtype], *map(_ptr, (q, k, v, keep)), heads, _ptr(out), _ptr(den), 1e-6,
        bh, n, s, f, m,
    )  # fmt: skip
    assert err == 0
    split = lambda t: t.double().reshape(bh // heads, heads, *t.shape[1:])  # noqa: E731
    want = linear_attention_reference(split(q), split(k), split(v), key_padding_mask=keep)
    assert _close(out, want.reshape(bh, n, m), dtype)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_scaled_cumsum(emu, reverse):
    bh, n, f = 3, 150, 20
    x = torch.randn(bh, n, f)
    pre, post = torch.rand(bh, n), torch.rand(bh, n)
    out = torch.empty(bh, n, f)
    err = emu.ks_emu_scaled_cumsum(0, _ptr(x), _ptr(pre), _ptr(post), _ptr(out), bh, n, f,
                                   int(reverse))  # fmt: skip
    assert err == 0
    flip = (lambda t: t.flip(1)) if reverse else (lambda t: t)
    want = post[..., None] * flip(torch.cumsum(flip(pre[..., None] * x).double(), dim=1))
    assert rel_err(out, want) <= 1e-5


@pytest.mark.parametrize("walk_blocks", [0, 5], ids=["chunks", "walk"])
def test_results_do_not_depend_on_the_thread_schedule(emu, walk_blocks):
    """Threads run in a different order between barriers under each seed; a race (a barrier
    missing) would change the results."""
    q, k, v, g = _inputs(2, 200, 96, 70, torch.bfloat16, extra=1)
    runs = []
    for seed in (1, 2, 3):
        emu.ks_emu_configure(seed, H100_SMEM)
        grads = [torch.empty(2, 200, d) for d in (96, 96, 70)]
        emu.ks_emu_causal_backward(2, *map(_ptr, (q, k, v, g, *grads)), 1, 2, 200, 96, 70,
                                   walk_blocks)  # fmt: skip
        runs.append([_product(emu, q, k, v, walk_blocks=walk_blocks)[0], *grads])
    emu.ks_emu_configure(0, H100_SMEM)
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert torch.equal(a, b)


def test_walk_falls_back_where_shared_memory_is_short(emu):
    """fp32 with F = M = 128 needs 227 KB for the walk and 261 KB for kernel 7: on an A100's
    163 KB both fall back to the chunk kernels, and every path gives the product."""
    q, k, v, g = _inputs(1, 140, 128, 128, torch.float32, extra=1)
    want, _ = _reference_product(q, k, v)
    results = {}
    for smem in (H100_SMEM, A100_SMEM):
        emu.ks_emu_configure(0, smem)
        out, _ = _product(emu, q, k, v, walk_blocks=256)
        assert _close(out, want, torch.float32)
        grads = [torch.empty(1, 140, 128) for _ in range(3)]
        assert emu.ks_emu_causal_backward(0, *map(_ptr, (q, k, v, g, *grads)), 1, 1, 140, 128,
                                          128, 256) == 0  # fmt: skip
        results[smem] = [out, *grads]
    emu.ks_emu_configure(0, H100_SMEM)
    chunks, _ = _product(emu, q, k, v, walk_blocks=0)
    assert torch.equal(results[A100_SMEM][0], chunks)  # the chunk kernels, bit for bit
    for a, b in zip(results[H100_SMEM], results[A100_SMEM], strict=True):
        assert _close(a, b, torch.float32)
