"""The CUDA kernels of ``csrc/cuda``, run on the CPU by ``tests/cuda_emulator``, against the
float64 reference: no GPU needed, so CI checks the kernels' logic on every change.

The emulator compiles the extension's ``.cu`` files as C++ with g++ (shim CUDA headers; each
thread a fiber, barriers and warp operations as on a GPU, WMMA tiles computed in float). It checks
indexing (every tensor sits between guards: reads outside an input give NaN, writes outside
an output fail), masking, chunk grouping, segment carries, shared-memory layout (reads of unwritten
shared memory give NaN; writes past it abort) and barrier placement (between block barriers the
warps run one at a time, each as far as it can, in a seeded random order, so a missing barrier
changes results with the seed; each lane stores only its share of a WMMA tile, so a missing
``__syncwarp`` shows up too), and alignment (cp.async and 16-byte vectors on 16-byte addresses,
WMMA tiles on 32-byte addresses with leading dimensions in 16-byte steps: a violation aborts,
as it faults on a GPU).
It does not check timing, occupancy or the GPU's exact rounding; ``tests/test_cuda_backend.py``
does that on a GPU. Tolerances: float32 max relative error ≤ 1e-4 (3xTF32), bfloat16/float16
relative RMS error ≤ 1e-2, as on the GPU.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kernelstudy.core import (
    causal_dot_product_reference,
    cuda_backend,
    linear_attention_reference,
)
from kernelstudy.core.extensions import csrc_dir

from .conftest import (
    CUDA_COMPILED_OPS,
    autocast_bf16,
    close_in_dtype,
    compiled_matches_eager,
    compiled_whole,
    cuda_custom_op_cases,
    outputs_and_grads,
    rel_err,
    rel_rms,
    torch_func_results,
)

EMULATOR = Path(__file__).resolve().parent / "cuda_emulator"
# _compile's objects, a folder per user (another user's folder may not be writable)
OBJECT_CACHE = Path(tempfile.gettempdir()) / f"kernelstudy_emulator_objects_{os.getuid()}"
GXX = shutil.which("g++")
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
H100_SMEM, A100_SMEM = 232448, 166912  # opt-in shared memory per block (bytes)

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ is not on PATH")


# -fno-strict-aliasing: the kernels read 16-byte vectors through other types, as CUDA allows;
# -fsanitize=alignment: a misaligned vector access aborts, as it faults on a GPU;
# -ffp-contract=off: g++ fuses a * b + c into an FMA by default (also under -std=c++17) where
# the target has one (aarch64, a compiler defaulting to x86-64-v3), so the emulator's bits
# would depend on the host (19 of 54 outputs of a check moved by an ulp under
# -march=x86-64-v3); nvcc's own contraction (--fmad) is not reproduced by any host build;
# -O3: this file's tests took 241 s of CPU against 296 s at -O2, for a build of 58 s against
# 40 s (2026-12-02), with the same bits
GXX_FLAGS = [
    "-std=c++17", "-O3", "-ffp-contract=off", "-fno-strict-aliasing", "-fPIC", "-w",
    "-fsanitize=alignment",
    "-fno-sanitize-recover=alignment", "-I", str(EMULATOR), "-I", str(csrc_dir()), "-I",
    str(csrc_dir() / "cuda"),
]  # fmt: skip
# every .cu of the extension, as C++, and the harness
EMULATED_SOURCES = [
    *(csrc_dir() / "cuda" / name for name in cuda_backend.SOURCES if name.endswith(".cu")),
    EMULATOR / "harness.cpp",
]


@functools.cache
def _build_digest(defines: tuple[str, ...]) -> str:
    """What the emulator's objects depend on, hashed: g++ (its path and version), its flags and
    ``defines``, and every file under csrc/ and tests/cuda_emulator/ (names and contents)."""
    version = subprocess.run([GXX, "-dumpfullversion"], capture_output=True, text=True).stdout
    digest = hashlib.sha256("\0".join([GXX, version, *GXX_FLAGS, *defines]).encode())
    for root in (csrc_dir(), EMULATOR):
        for path in sorted(
            p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts
        ):
            digest.update(f"\0{path.relative_to(root.parent)}\0".encode() + path.read_bytes())
    return digest.hexdigest()[:20]


def _compile(sources: list[Path], defines: tuple[str, ...] = ()) -> list[Path]:
    """Each source compiled to an object, its own g++, as many at once as the machine has
    cores (the three input types' units are the long ones): the objects' paths, in order.

    They are kept in a folder of the temporary directory named by :func:`_build_digest`, so
    pytest-xdist's workers, the child process of test_the_gpu_tests_run_on_the_emulator and
    later runs compile each once (one build took 58 s of CPU time on this machine; a run of the
    suite made three); a changed source, header, flag or compiler names a new folder. Each
    object is compiled under a lock on its name (another process waits for it rather than
    compiling it again) into a file of its own, then renamed: no process loads a half-written
    object."""
    roots = [root.resolve() for root in (csrc_dir(), EMULATOR)]
    outside = [s for s in sources if not any(s.resolve().is_relative_to(r) for r in roots)]
    assert not outside, f"{outside}: the objects' digest covers csrc/, tests/cuda_emulator/ only"
    folder = OBJECT_CACHE / _build_digest(defines)
    folder.mkdir(parents=True, exist_ok=True)

    def one(source: Path) -> str | None:
        out = folder / source.stem
        with open(folder / f"{source.stem}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if out.exists():
                return None
            part = folder / f"{source.stem}.{os.getpid()}.{threading.get_ident()}.part"
            command = [GXX, *GXX_FLAGS, *defines, "-c", "-x", "c++", str(source), "-o", str(part)]
            result = subprocess.run(command, capture_output=True, text=True, timeout=600)
            if result.returncode != 0:
                part.unlink(missing_ok=True)
                return f"g++ failed on {source.name}:\n{result.stderr[-6000:]}"
            os.replace(part, out)
            return None

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        failures = [f for f in pool.map(one, sources) if f is not None]
    assert not failures, failures[0]
    return [folder / source.stem for source in sources]


def _load(objects: list[Path], lib: Path) -> ctypes.CDLL:
    """The objects linked into the shared library ``lib``, loaded, its functions typed."""
    command = [GXX, "-shared", "-fsanitize=alignment", *map(str, objects), "-o", str(lib)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"linking failed:\n{result.stderr[-6000:]}"
    module = ctypes.CDLL(str(lib))
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    module.ks_emu_configure.argtypes = [ctypes.c_uint64, i64]
    module.ks_emu_last_launch_smem.restype = i64
    module.ks_emu_causal_product.argtypes = [i32, p, p, p, p, i32, p, i32, f32, *[i64] * 4]
    module.ks_emu_causal_product.argtypes += [i32, i64, i32]
    module.ks_emu_causal_backward.argtypes = [i32, *[p] * 7, i32, i32, *[i64] * 5, i32, i32]
    module.ks_emu_full_state.argtypes = [i32, p, p, i32, p, i64, p, *[i64] * 4]
    module.ks_emu_full_apply.argtypes = [i32, p, i32, p, p, p, i64, p, i32, p, i32, f32]
    module.ks_emu_full_apply.argtypes += [i64] * 4
    module.ks_emu_scaled_cumsum.argtypes = [i32, p, p, p, p, p, i32, i64, i64, i64, i32]
    module.ks_emu_normalized_grad.argtypes = [i32, p, p, p, f32, p, i32, p, i64, i64]
    module.ks_emu_walk_kernels.argtypes = [i32, i64, i64, i32, i32, p, p]
    module.ks_emu_last_kernel.restype = ctypes.c_uint64
    module.ks_emu_set_carry_blocks.argtypes = [i64]
    module.ks_emu_set_chunk_blocks.argtypes = [i64]
    module.ks_emu_causal_workspace_floats.argtypes = [i32, *[i64] * 5, i32]
    module.ks_emu_causal_workspace_floats.restype = i64
    module.ks_emu_configure(0, H100_SMEM)
    return module


def build_emulator(folder: Path, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The kernels and tests/cuda_emulator/harness.cpp compiled with ``defines`` (an object per
    source, :func:`_compile`) and linked into one shared library in ``folder``, loaded."""
    return _load(_compile(EMULATED_SOURCES, defines), folder / "ks_emulated.so")


@pytest.fixture(scope="module")
def emu(tmp_path_factory) -> ctypes.CDLL:
    """The emulator's objects linked into one shared library, loaded."""
    return build_emulator(tmp_path_factory.mktemp("cuda_emulator"))


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(None if t is None else t.data_ptr())


GUARD = 64  # elements around every tensor the kernels see (a multiple of 16 bytes)
OUT_GUARD = -7168.0  # around outputs (exact in every dtype); inputs are guarded by NaN
OUTSIDE_WORKSPACE = 1000  # harness.cpp's error for a write to a guard of the workspace


class EmulatedExtension:
    """The extension's Python API (``csrc/cuda/binding.cpp``: same functions, arguments and
    results) on CPU tensors, run by the emulator: what ``cuda_backend`` calls on a GPU.

    Every tensor the kernels see sits between two guards of GUARD elements: NaN around inputs,
    so a read outside an input reaches the results as NaN, and OUT_GUARD around outputs, checked
    after each call, so a write outside an output fails. With ``misalign``, every tensor starts
    that many elements past an aligned address (torch aligns allocations to 64 bytes).
    """

    def __init__(self, lib: ctypes.CDLL, misalign: int = 0):
        self.lib = lib
        self.misalign = misalign
        self._outputs: list[tuple[torch.Tensor, int, int]] = []

    def _place(self, t: torch.Tensor, fill: float) -> tuple[torch.Tensor, torch.Tensor, int]:
        start = GUARD + self.misalign
        buf = torch.full((t.numel() + start + GUARD,), fill, dtype=t.dtype)
        return buf[start : start + t.numel()].view(t.shape), buf, start

    def _input(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        inner, _, _ = self._place(t, float("nan") if t.is_floating_point() else 0)
        return inner.copy_(t)

    def _output(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        inner, buf, start = self._place(torch.empty(*shape, dtype=dtype), OUT_GUARD)
        self._outputs.append((buf, start, inner.numel()))
        return inner

    def _run(self, fn, *args) -> None:
        err = fn(*args)
        outputs, self._outputs = self._outputs, []
        assert err != OUTSIDE_WORKSPACE, "a kernel wrote outside its workspace"
        assert err == 0
        for buf, start, size in outputs:
            guards = torch.cat([buf[:start], buf[start + size :]]).float()
            assert (guards == OUT_GUARD).all(), "a kernel wrote outside its output"

    def causal_product(self, q, k, v, reverse=False, out_fp32=True, with_den=False,
                       normalize=False, eps=1e-6, walk_blocks=0, mma_walk=False):  # fmt: skip
        b, h, n, f = q.shape
        m = v.shape[-1]
        if b * h * n * m == 0 or f == 0:  # the binding's readout: zeros, no launch
            return _zeros_read_out(b, h, n, m, torch.float32 if out_fp32 else q.dtype, with_den)
        q, k, v = (self._input(t) for t in (q, k, v))
        out = self._output(b, h, n, m, dtype=torch.float32 if out_fp32 else q.dtype)
        den = self._output(b, h, n) if with_den else None
        self._run(
            self.lib.ks_emu_causal_product,
            DTYPES[q.dtype], _ptr(q), _ptr(k), _ptr(v), _ptr(out), int(out_fp32), _ptr(den),
            int(normalize), eps, b * h, n, f, m, int(reverse), walk_blocks, int(mma_walk),
        )  # fmt: skip
        return [out, den]

    def causal_backward(
        self, q, k, v, g, out_fp32=False, dv_fp32=None, walk_blocks=0, mma_walk=False,
        walks_together=True,
    ):  # fmt: skip
        b, h, n, f = q.shape
        m = v.shape[-1]
        dv_fp32 = out_fp32 if dv_fp32 is None else dv_fp32
        if dv_fp32 and not out_fp32:
            raise ValueError("dv_fp32=True needs out_fp32=True")  # as the binding
        dtypes = [torch.float32 if wide else q.dtype for wide in (out_fp32, out_fp32, dv_fp32)]
        if b * h * n * f * m == 0:  # as the binding: zeros, no launch
            return [
                torch.zeros(b, h, n, d, dtype=t) for d, t in zip((f, f, m), dtypes, strict=True)
            ]
        q, k, v, g = (self._input(t) for t in (q, k, v, g))
        grads = [self._output(b, h, n, d, dtype=t) for d, t in zip((f, f, m), dtypes, strict=True)]
        self._run(
            self.lib.ks_emu_causal_backward,
            DTYPES[q.dtype], *map(_ptr, (q, k, v, g, *grads)), int(out_fp32), int(dv_fp32),
            b * h, n, f, m, walk_blocks, int(mma_walk), int(walks_together),
        )  # fmt: skip
        return grads

    def full_state(self, k, v, key_padding_mask=None):
        b, h, n, f = k.shape
        m = v.shape[-1]
        v_fp32 = v.dtype == torch.float32 and k.dtype != torch.float32
        assert v.dtype in (k.dtype, torch.float32), "v in k's dtype or float32 (the binding)"
        if b * h * f == 0 or m == 0 or n == 0:  # as the binding: zeros, no launch
            return torch.zeros(b, h, f * m + f)
        k, v = self._input(k), self._input(v)
        state = self._output(b, h, f * m + f)
        keep = self._input(key_padding_mask)
        self._run(
            self.lib.ks_emu_full_state,
            DTYPES[k.dtype], _ptr(k), _ptr(v), int(v_fp32), _ptr(keep), h, _ptr(state),
            b * h, n, f, m,
        )  # fmt: skip
        return state

    def full_apply(self, q, state, m, out_fp32=True, with_den=False, normalize=False, eps=1e-6,
                   bias=None, key_padding_mask=None, out_dtype=None):  # fmt: skip
        b, h, n, f = q.shape
        assert state.shape == (b, h, f * m + f), "state must be (B,H,F*M+F) (the binding)"
        q_fp32 = out_dtype is not None and out_dtype != q.dtype
        if q_fp32 and (q.dtype != torch.float32 or out_fp32 or out_dtype not in DTYPES):
            raise TypeError("out_dtype must be q's dtype, or float16 or bfloat16 for a float32 q")
        out_type = torch.float32 if out_fp32 else out_dtype if q_fp32 else q.dtype
        if b * h * n * m == 0 or f == 0:  # the binding's read-out: the bias alone, no launch
            out, den = _zeros_read_out(b, h, n, m, out_type, with_den)
            if bias is not None:
                out.copy_(bias[:, :, None, :].expand(b, h, n, m))
                if key_padding_mask is not None:
                    out.mul_(key_padding_mask.view(b, 1, n, 1))
            return [out, den]
        q, state, bias, keep = (self._input(t) for t in (q, state, bias, key_padding_mask))
        out = self._output(b, h, n, m, dtype=out_type)
        den = self._output(b, h, n) if with_den else None
        self._run(
            self.lib.ks_emu_full_apply,
            DTYPES[out_type if q_fp32 else q.dtype], _ptr(q), int(q_fp32), _ptr(state),
            _ptr(bias), _ptr(keep), h, _ptr(out), int(out_fp32), _ptr(den), int(normalize), eps,
            b * h, n, f, m,
        )  # fmt: skip
        return [out, den]

    def scaled_cumsum(self, x, pre=None, post=None, reverse=False, base=None, out_fp32=True):
        b, h, n, f = x.shape
        if b * h * n * f == 0:  # as the binding: nothing to sum
            return torch.empty(b, h, n, f, dtype=torch.float32 if out_fp32 else x.dtype)
        x, pre, post, base = (self._input(t) for t in (x, pre, post, base))
        out = self._output(b, h, n, f, dtype=torch.float32 if out_fp32 else x.dtype)
        self._run(
            self.lib.ks_emu_scaled_cumsum,
            DTYPES[x.dtype], _ptr(x), _ptr(pre), _ptr(post), _ptr(base), _ptr(out),
            int(out_fp32), b * h, n, f, int(reverse),
        )  # fmt: skip
        return out

    def walk_kernels(self, q, f, m, mma_walk=False, walks_together=True):
        kernels, asked = (ctypes.c_int * 4)(), (ctypes.c_uint64 * 2)()
        err = self.lib.ks_emu_walk_kernels(
            DTYPES[q.dtype], f, m, int(mma_walk), int(walks_together), kernels, asked
        )
        assert err == 0
        return {"product": (kernels[0], kernels[1]), "dkv": (kernels[2], kernels[3])}

    def normalized_grad(self, g, out, den, eps, dden_column=False, dnum_fp32=False):
        g, out, den = (self._input(t) for t in (g, out, den))
        b, h, n, m = g.shape
        bf16 = g.dtype == torch.bfloat16 and not dnum_fp32
        operand = torch.bfloat16 if bf16 else torch.float32
        dnum = self._output(b, h, n, m + dden_column, dtype=operand)
        dden = None if dden_column else self._output(b, h, n)
        self._run(
            self.lib.ks_emu_normalized_grad,
            DTYPES[g.dtype], _ptr(g), _ptr(out), _ptr(den), eps, _ptr(dnum), int(dnum_fp32),
            _ptr(dden), b * h * n, m,
        )  # fmt: skip
        return [dnum, dden]


def _zeros_read_out(b, h, n, m, dtype, with_den) -> list:
    """The binding's read-out where nothing is computed (N·M = 0 or F = 0): out (B,H,N,M) and,
    with ``with_den``, den (B,H,N) as zeros."""
    return [torch.zeros(b, h, n, m, dtype=dtype), torch.zeros(b, h, n) if with_den else None]


@pytest.fixture(scope="module")
def ext(emu) -> EmulatedExtension:
    return EmulatedExtension(emu)


def _inputs(bh, n, f, m, dtype, seed=0, extra=0):
    """q, k (positive features) and v (plus `extra` tensors like v), (1, BH, N, ·), in dtype."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.rand(1, bh, n, f, generator=gen), torch.rand(1, bh, n, f, generator=gen)
    rest = [torch.randn(1, bh, n, m, generator=gen) for _ in range(1 + extra)]
    return [t.to(dtype) for t in (q, k, *rest)]


def _reference_product(q, k, v, reverse=False):
    """Σ_{j≤i} (q_i·k_j) v_j (j ≥ i with reverse) and its normalizer, in float64."""
    flip = (lambda x: x.flip(2)) if reverse else (lambda x: x)
    q, k, v = (flip(t.double()) for t in (q, k, v))
    ones = torch.ones(*v.shape[:-1], 1, dtype=torch.float64)
    return (
        flip(causal_dot_product_reference(q, k, v)),
        flip(causal_dot_product_reference(q, k, ones)[..., 0]),
    )


def _reference_grads(q, k, v, g):
    """dq, dk, dv of Σ_{j≤i} (q_i·k_j) v_j for the output gradient g, in float64."""
    x64 = [t.double().requires_grad_() for t in (q, k, v)]
    return torch.autograd.grad(causal_dot_product_reference(*x64), x64, g.double())


def _prefix_state_reference(q, k, v, g):
    """The product, its normalizer and the gradients of :func:`_reference_product` and
    :func:`_reference_grads` (forward direction), in float64 from prefix sums of the states
    S_i = Σ_{j≤i} k_j v_jᵀ and R_j = Σ_{i≥j} q_i g_iᵀ: O(N·F·M) where the reference's masked
    product is O(N²) (at N = 16384 its 2 GiB mask took half the drift tests' time). Returns
    (out, den, (dq, dk, dv))."""
    q, k, v, g = (t.double() for t in (q, k, v, g))
    state = torch.cumsum(k.unsqueeze(-1) * v.unsqueeze(-2), dim=2)  # (..., N, F, M)
    out = torch.einsum("...nf,...nfm->...nm", q, state)
    den = (q * torch.cumsum(k, dim=2)).sum(-1)
    back = torch.cumsum((q.unsqueeze(-1) * g.unsqueeze(-2)).flip(2), dim=2).flip(2)
    dq = torch.einsum("...nm,...nfm->...nf", g, state)
    dk = torch.einsum("...nm,...nfm->...nf", v, back)
    dv = torch.einsum("...nf,...nfm->...nm", k, back)
    return out, den, (dq, dk, dv)


def test_the_prefix_state_reference_is_the_reference():
    """:func:`_prefix_state_reference` against the masked reference on a ragged shape."""
    q, k, v, g = _inputs(3, 77, 5, 6, torch.float32, extra=1)
    out, den, grads = _prefix_state_reference(q, k, v, g)
    want, want_den = _reference_product(q, k, v)
    assert rel_err(out, want) <= 1e-13 and rel_err(den, want_den) <= 1e-13
    for a, w in zip(grads, _reference_grads(q, k, v, g), strict=True):
        assert rel_err(a, w) <= 1e-13


# (BH, N, F, M): one row; N not a multiple of the chunk with odd F and M; F = 96 > M (two F
# slices); F ≠ M with two M slices; F = M = 130 (three slices: outside the walk).
SHAPES = [(2, 1, 4, 3), (6, 37, 8, 5), (3, 130, 96, 40), (2, 200, 33, 70), (1, 70, 130, 130)]
IDS = ["x".join(map(str, s)) for s in SHAPES]
# walk_blocks: 0 = the chunk kernels; 1 = one walk per sequence; 5 = ragged segments; 10**6 =
# one chunk per segment.
KERNELS = [0, 1, 5, 10**6]
KERNEL_IDS = ["chunks", "walk_whole", "walk_5", "walk_per_chunk"]


# ---------------------------------------------------------------- the kernels
@pytest.mark.parametrize("walk_blocks", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_causal_product_and_normalizer(ext, shape, dtype, walk_blocks):
    q, k, v = _inputs(*shape, dtype)
    for reverse in (False, True):
        _check_product(ext, q, k, v, reverse, walk_blocks=walk_blocks)


def _check_product(x: EmulatedExtension, q, k, v, reverse: bool, **kernel) -> None:
    """The product and its normalizer (fp32), and the normalized output in the inputs' dtype,
    against float64; ``kernel``: walk_blocks, mma_walk."""
    dtype = q.dtype
    want, want_den = _reference_product(q, k, v, reverse)
    out, den = x.causal_product(q, k, v, reverse, with_den=True, **kernel)
    assert close_in_dtype(out, want, dtype) and close_in_dtype(den, want_den, dtype)
    normalized, _ = x.causal_product(q, k, v, reverse, out_fp32=False, normalize=True, **kernel)
    assert normalized.dtype == dtype
    assert close_in_dtype(normalized, want / (want_den[..., None] + 1e-6), dtype)


@pytest.mark.parametrize("walk_blocks", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_fused_backward(ext, shape, dtype, walk_blocks):
    """dq, dk, dv of the fused backward: the chunk kernels' (kernels 4, 5) or the walk's
    (kernel 6 for dq, kernel 7 for dk and dv, two walks where F or M exceeds 128)."""
    _check_fused_backward(ext, *_inputs(*shape, dtype, extra=1), walk_blocks=walk_blocks)


def _check_fused_backward(x: EmulatedExtension, q, k, v, g, **kernel) -> list[torch.Tensor]:
    """dq, dk, dv of the fused backward against float64, returned; ``kernel``: walk_blocks,
    mma_walk and walks_together."""
    got = x.causal_backward(q, k, v, g, out_fp32=True, **kernel)
    for a, w in zip(got, _reference_grads(q, k, v, g), strict=True):
        assert close_in_dtype(a, w, q.dtype)
    return got


@pytest.mark.parametrize(
    "walk_blocks, mma_walk", [(0, False), (5, False), (5, True)], ids=["chunks", "walk", "walk_mma"]
)
def test_float16_inputs_keep_their_bits_in_products(ext, walk_blocks, mma_walk):
    """float16 inputs are exact in tf32, so a product of two inputs loses nothing: at N = 1,
    dq = (g·v) k, and a g·v that cancels showed bfloat16 operands' rounding of g and v in full
    (relative RMS error 0.017 over these seeds, past the 1e-2 tolerance). Every gradient, by
    both backwards, now stays within 2e-3 of float64 (measured: 4e-4)."""
    worst = 0.0
    for seed in range(40):
        q, k, v, g = _inputs(2, 1, 4, 3, torch.float16, seed=seed, extra=1)
        want = _reference_grads(q, k, v, g)
        for got in (
            [ext.causal_product(*x, reverse=r, walk_blocks=walk_blocks, mma_walk=mma_walk)[0]
             for x, r in (((g, v, k), False), ((v, g, q), True), ((k, q, g), True))],
            ext.causal_backward(
                q, k, v, g, out_fp32=True, walk_blocks=walk_blocks, mma_walk=mma_walk
            ),
        ):  # fmt: skip
            worst = max(worst, *(rel_rms(a, w) for a, w in zip(got, want, strict=True)))
    assert worst <= 2e-3


@pytest.mark.parametrize(
    "walk_blocks, mma_walk, backward",
    [(0, False, False), (1, False, False), (1, True, False), (1, True, True)],
    ids=["chunks", "walk", "walk_mma", "walk_mma_backward"],
)
def test_long_float32_sums_do_not_drift(ext, walk_blocks, mma_walk, backward):
    """One sequence of 256 chunks in float32: the state (and z, and R in the backward) is summed
    over every chunk. The emulator sums product steps as the tensor cores do, cut toward zero
    (ks_emulator.h, tensor_core_sum); kept in the accumulators over the walk, that drift put the
    output 1.24e-4 off here (above fp32's 1e-4; on the H200, 2.4e-4 between 512 chunks and two
    segments of 256). With each chunk's products summed apart and added in fp32 (warp_gemm_sum,
    chunk_sum) the error stays near 2e-6 at any length: 2e-5 leaves a margin."""
    q, k, v, g = _inputs(1, 64 * 256, 16, 16, torch.float32, extra=1)
    want, want_den, want_grads = _prefix_state_reference(q, k, v, g)
    if backward:
        got = ext.causal_backward(q, k, v, g, True, walk_blocks=walk_blocks, mma_walk=mma_walk)
        for a, w in zip(got, want_grads, strict=True):
            assert rel_err(a, w, 1.0) <= 2e-5
        return
    out, den = ext.causal_product(q, k, v, with_den=True, walk_blocks=walk_blocks,
                                  mma_walk=mma_walk)  # fmt: skip
    assert rel_err(out, want, 1.0) <= 2e-5 and rel_err(den, want_den, 1.0) <= 2e-5


@pytest.mark.parametrize("walk_blocks", [0, 3], ids=["chunks", "walk_3"])
@pytest.mark.parametrize(
    "shape, dtype",
    [((1, 130, 256, 256), torch.bfloat16), ((1, 2577, 16, 8), torch.float32)],
    ids=["F=M=256", "one_long_sequence"],
)
def test_largest_head_dims_and_one_long_split_sequence(ext, shape, dtype, walk_blocks):
    """The issue's largest F = M = 256 (walks fall back to the chunk kernels, kernel 7 to
    separate walks), and B·H = 1 at N = 2577 cut into 3 ragged segments with carries."""
    q, k, v, g = _inputs(*shape, dtype, extra=1)
    for reverse in (False, True):
        want, want_den = _reference_product(q, k, v, reverse)
        out, den = ext.causal_product(q, k, v, reverse, with_den=True, walk_blocks=walk_blocks)
        assert close_in_dtype(out, want, dtype) and close_in_dtype(den, want_den, dtype)
    got = ext.causal_backward(q, k, v, g, out_fp32=True, walk_blocks=walk_blocks)
    for a, w in zip(got, _reference_grads(q, k, v, g), strict=True):
        assert close_in_dtype(a, w, dtype)


# B·H = 1, N = 2577 (41 chunks) in WALK_BLOCKS 3 segments of 14, 14 and 13 chunks; the carry
# pass (walk_layout) sums them in groups of cpg chunks, as many as keep its thread blocks near
# the target KS_CARRY_BLOCKS: 2 -> one group a segment (carries in place over the totals), 5 ->
# groups of 7, 20 -> groups of 2 (the last segment 6 of 2 and one of 1), 512 (the GPU's) -> of 1.
# The workspace: the carries (3 x 144 floats), after the totals (groups x 144, rounded up to 64)
# where a segment holds several groups.
CARRY_GROUPS = {2: 432, 5: 896 + 432, 20: 3072 + 432, 512: 5952 + 432}


# (B·H, N, WALK_BLOCKS) -> workspace floats at F = M = 8 (72 floats a state) with the GPU's
# target: B·H = 8, N = 32768 (512 chunks) in 16 segments of 32 chunks, 120 blocks in groups of 8
# (64 groups a sequence: 4608 floats each); B·H = 16, N = 32768 in 2 segments of 256 chunks (the
# GPU test of grouped carries), 16 blocks in groups of 8; B·H = 1, N = 65536 in 128 segments of 8
# chunks, which 127 blocks would sum in groups of 2, but that is 512 groups a sequence for kernel
# 2 to add one after another: capped at 128, one group a segment (per = 1: the carries alone).
CARRY_CAP = {
    (8, 32768, 128): 8 * 64 * 72 + 8 * 16 * 72,
    (16, 32768, 32): 16 * 64 * 72 + 16 * 2 * 72,
    (1, 65536, 128): 128 * 72,
}


def test_walk_carry_groups_follow_the_target(emu):
    dtype = DTYPES[torch.bfloat16]
    try:
        for target, floats in CARRY_GROUPS.items():
            emu.ks_emu_set_carry_blocks(target)
            assert emu.ks_emu_causal_workspace_floats(dtype, 1, 2577, 16, 8, 3, 0) == floats
    finally:
        emu.ks_emu_set_carry_blocks(512)
    for (bh, n, blocks), floats in CARRY_CAP.items():
        assert emu.ks_emu_causal_workspace_floats(dtype, bh, n, 8, 8, blocks, 0) == floats


@pytest.mark.parametrize("target", [2, 5, 20])
def test_walk_carries_sum_segments_in_groups(emu, ext, target):
    """Each walk's carries from groups of chunks: the forward and reverse walks (kernels 6
    and 8), and the fused backward's reverse dk, dv walk alone (kernels 7 and 9) and beside
    the dq walk (kernels 11 and 10), against float64. (512: the segment tests elsewhere.)"""
    q, k, v, g = _inputs(1, 2577, 16, 8, torch.bfloat16, extra=1)
    emu.ks_emu_set_carry_blocks(target)
    try:
        for mma_walk in (False, True):
            for reverse in (False, True):
                _check_product(ext, q, k, v, reverse, walk_blocks=3, mma_walk=mma_walk)
            for together in (False, True):
                _check_fused_backward(
                    ext, q, k, v, g, walk_blocks=3, mma_walk=mma_walk, walks_together=together
                )
    finally:
        emu.ks_emu_set_carry_blocks(512)


# The chunk kernels' state pass gives each thread block cpb consecutive chunks of a sequence
# (causal_layout), as many as keep about KS_CHUNK_BLOCKS (1024 as built for a GPU) blocks over
# all sequences and 64-wide F and M tiles. The workspace starts with a state (F·M + F floats) per
# group, so its size says how the chunks were grouped: (dtype, B·H, N, F, M) -> workspace floats
# at the GPU's target, each the groups' states, then z (B·H·chunks·F) and the chunks' states
# (B·H·chunks·F·M in the operand type: bf16 for bf16, fp32 for fp16 and fp32), each region
# rounded up to 64 floats:
# B·H = 4, N = 1950 (31 chunks), F = M = 192 (9 tiles): 36 blocks a chunk, 16 groups of 2 chunks
# (the last one of 1); B·H = 20, N = 700 (11 chunks), F = 130, M = 70 (3 x 2 tiles): 120 blocks a
# chunk, 6 groups of 2 (states of 9230 floats); B·H = 1, N = 262144 (4096 chunks), F = M = 8:
# 1024 groups of 4.
CHUNK_GROUPS = {
    (torch.bfloat16, 4, 1950, 192, 192): 4 * 16 * 37056 + 4 * 31 * 192 + 4 * 31 * 192 * 96,
    (torch.float16, 20, 700, 130, 70): 1107648 + 28608 + 2002048,
    (torch.float32, 1, 262144, 8, 8): 1024 * 72 + 4096 * 8 + 4096 * 64,
}


def test_chunk_kernels_group_chunks_toward_the_target(emu):
    for (dtype, bh, n, f, m), floats in CHUNK_GROUPS.items():
        assert emu.ks_emu_causal_workspace_floats(DTYPES[dtype], bh, n, f, m, 0, 0) == floats


def _round64(x: int) -> int:
    return -(-x // 64) * 64


# (B·H, N, F, M), a lowered KS_CHUNK_BLOCKS -> blocks a sequence (of 5 chunks): B·H·tiles = 4
# blocks a chunk at F = 33, M = 70 (one block of 5 chunks at 4, groups of 3 + 2 at 8, of
# 2 + 2 + 1 at 12); 6 at F = 130 (3 F tiles: groups of 3 + 2 at 12)
LOWERED_TARGETS = [
    ((2, 300, 33, 70), 4, 1),
    ((2, 300, 33, 70), 8, 2),
    ((2, 300, 33, 70), 12, 3),
    ((1, 300, 130, 70), 12, 2),
]


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize(
    "shape, target, blocks",
    LOWERED_TARGETS,
    ids=[f"{'x'.join(map(str, s))}-target_{t}" for s, t, _ in LOWERED_TARGETS],
)
def test_chunk_kernels_sum_groups_of_chunks(emu, ext, dtype, shape, target, blocks):
    """With the state pass's target lowered, small shapes give each thread block several
    chunks (block-local prefixes, then carries between the blocks; one block a sequence: no
    carries): the product both ways, its normalizer, the normalized output and the fused
    backward against float64, as at the GPU's target (the workspace says the grouping)."""
    bh, n, f, m = shape
    q, k, v, g = _inputs(*shape, dtype, extra=1)
    ungrouped = emu.ks_emu_causal_workspace_floats(DTYPES[dtype], bh, n, f, m, 0, 0)
    emu.ks_emu_set_chunk_blocks(target)
    try:
        grouped = emu.ks_emu_causal_workspace_floats(DTYPES[dtype], bh, n, f, m, 0, 0)
        states = bh * (f * m + f)
        assert ungrouped - grouped == _round64(states * 5) - _round64(states * blocks)
        for reverse in (False, True):
            _check_product(ext, q, k, v, reverse, walk_blocks=0)
        _check_fused_backward(ext, q, k, v, g, walk_blocks=0)
    finally:
        emu.ks_emu_set_chunk_blocks(1024)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("keys", [37, 1100], ids=["one_block", "two_blocks"])
def test_full_attention_with_key_padding(ext, keys, dtype):
    """Non-causal: the state over blocks of 1024 keys with padding, then the read-out."""
    b, h, n, f, m = 2, 3, 45, 33, 70
    q = _inputs(b * h, n, f, m, dtype, seed=1)[0].reshape(b, h, n, f)
    k, v = (t.reshape(b, h, keys, -1) for t in _inputs(b * h, keys, f, m, dtype, seed=2)[1:])
    keep = torch.ones(b, keys, dtype=torch.bool)
    keep[-1, keys // 3 :] = False
    out, den = ext.full_apply(q, ext.full_state(k, v, keep), m, with_den=True, normalize=True)
    want = linear_attention_reference(q.double(), k.double(), v.double(), key_padding_mask=keep)
    assert close_in_dtype(out, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 150, 33, 70), (1, 1, 1, 1, 3)], ids=["ragged", "one_row"])
def test_full_backward_kernels_read_the_inputs_dtype(ext, shape, dtype):
    """The non-causal backward's kernels beside fp32 row terms: the reduction of a 16-bit q with
    fp32 ``[dnum | dden]`` is the bits of the all-float32 reduction (q is exact in fp32 tiles),
    and the read-out of fp32 operands into ``out_dtype`` the float32 read-out rounded once."""
    b, h, n, f, m = shape
    gen = torch.Generator().manual_seed(5)
    q = torch.rand(b, h, n, f, generator=gen).to(dtype)
    dnum = torch.randn(b, h, n, m + 1, generator=gen)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[-1, n // 3 :] = False
    for keep in (None, mask):
        state = ext.full_state(q, dnum, keep)
        assert torch.equal(state, ext.full_state(q.float(), dnum, keep))
        kept = torch.ones(b, n, dtype=torch.float64) if keep is None else keep.double()
        want = torch.einsum("bhnf,bhnm,bn->bhfm", q.double(), dnum.double(), kept)
        assert rel_err(state[..., : f * (m + 1)].reshape(b, h, f, m + 1), want) <= 1e-5
    # dnum (B,H,N,M+1) read against an (M+1) x F matrix, with a zero normalizer part
    mat = torch.randn(b, h, (m + 1) * f, generator=gen)
    mat = torch.cat([mat, torch.zeros(b, h, m + 1)], dim=-1)
    got = ext.full_apply(dnum, mat, f, out_fp32=False, out_dtype=dtype)[0]
    assert got.dtype == dtype
    assert torch.equal(got, ext.full_apply(dnum, mat, f, out_fp32=True)[0].to(dtype))


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 150, 70, 33), (1, 2, 64, 8, 130)], ids=["ragged", "wide"])
def test_read_out_with_bias_and_padding(ext, shape, dtype):
    """The read-out ``x·S + bias`` (dk's dz) with padded rows zero (out and den), against float64,
    in each dtype; padded rows are exact zeros, whatever x holds there (NaN included)."""
    b, h, n, f, m = shape
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(b, h, n, f, generator=gen).to(dtype)
    mat = torch.randn(b, h, f, m, generator=gen)
    z = torch.rand(b, h, f, generator=gen)
    bias = torch.randn(b, h, m, generator=gen)
    state = torch.cat([mat.reshape(b, h, f * m), z], dim=-1)
    keep = torch.ones(b, n, dtype=torch.bool)
    keep[0, :5] = False
    keep[-1, n // 2 :] = False
    x[0, :, :5] = float("nan")  # padded rows: never seen
    kept = keep[:, None, :, None]
    x64 = torch.where(kept, x.double(), 0.0)
    want = (x64 @ mat.double() + bias.double()[:, :, None]) * kept
    for out_fp32 in (True, False):
        out, den = ext.full_apply(
            x, state, m, out_fp32=out_fp32, with_den=True, bias=bias, key_padding_mask=keep
        )
        assert out.dtype == (torch.float32 if out_fp32 else dtype)
        assert close_in_dtype(out, want, dtype)
        assert (out.masked_select(~kept) == 0).all() and (
            den.masked_select(~keep[:, None]) == 0
        ).all()
        assert rel_err(den, (x64 @ z.double()[..., None])[..., 0]) <= 1e-2
    # without padding or bias: as before
    plain = ext.full_apply(x.nan_to_num(), state, m, out_fp32=True)[0]
    assert close_in_dtype(plain, x.nan_to_num().double() @ mat.double(), dtype)


def test_read_out_of_nothing_is_the_bias():
    """F = 0: the binding's read-out launches nothing; with a bias, out is the bias on the kept
    rows (zeros on padded ones), as the kernel would give."""
    x = EmulatedExtension(None)
    bias = torch.randn(2, 1, 3)
    keep = torch.tensor([[True, False], [True, True]])
    out = x.full_apply(torch.zeros(2, 1, 2, 0), torch.zeros(2, 1, 0), 3, bias=bias,
                       key_padding_mask=keep)[0]  # fmt: skip
    assert torch.equal(out, bias[:, :, None].expand(2, 1, 2, 3) * keep[:, None, :, None])


def test_read_out_refuses_a_narrower_out_dtype_of_16_bit_operands(ext):
    """out_dtype narrows only a float32 q (dq from fp32 row terms), and not beside out_fp32."""
    q16 = torch.rand(1, 1, 4, 2, dtype=torch.bfloat16)
    state = torch.zeros(1, 1, 2 * 3 + 2)
    with pytest.raises(TypeError, match="out_dtype must be q's dtype"):
        ext.full_apply(q16, state, 3, out_dtype=torch.float16)
    with pytest.raises(TypeError, match="out_dtype must be q's dtype"):
        ext.full_apply(q16.float(), state, 3, out_fp32=True, out_dtype=torch.float16)
    assert ext.full_apply(q16, state, 3, out_fp32=False, out_dtype=torch.bfloat16)[0].dtype == (
        torch.bfloat16
    )


# (B, H, N, F): ragged chunks with idle columns; two column slices of 64, the second ragged; whole
# chunks; one row
CUMSUM_SHAPES = [(1, 3, 150, 20), (2, 1, 130, 70), (1, 2, 128, 64), (1, 1, 1, 1)]


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("shape", CUMSUM_SHAPES, ids=["x".join(map(str, s)) for s in CUMSUM_SHAPES])
def test_scaled_cumsum(ext, shape, reverse):
    """``post · cumsum(pre · x)`` along N (reversed: from the last row) against float64, with
    either weight or none."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(*shape, generator=gen)
    pre, post = torch.rand(*shape[:3], generator=gen), torch.rand(*shape[:3], generator=gen)
    flip = (lambda t: t.flip(2)) if reverse else (lambda t: t)
    for a, b in ((pre, post), (None, post), (pre, None), (None, None)):
        out = ext.scaled_cumsum(x, a, b, reverse)
        w_pre = torch.ones(shape[:3]) if a is None else a
        w_post = torch.ones(shape[:3]) if b is None else b
        want = w_post[..., None] * flip(torch.cumsum(flip(w_pre[..., None] * x).double(), dim=2))
        assert rel_err(out, want) <= 1e-5


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_scaled_cumsum_adds_a_base_and_rounds_once(ext, dtype):
    """With ``base`` (the products' float32 dq or dk) the sum is added in float32; written in
    x's dtype it is the float32 result rounded once (the same bits as casting it afterwards)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, 150, 20, generator=gen).to(dtype)
    pre, base = torch.rand(1, 3, 150, generator=gen), torch.randn(1, 3, 150, 20, generator=gen)
    wide = ext.scaled_cumsum(x, pre, None, reverse=True, base=base)
    want = base.double() + (pre[..., None] * x.double()).flip(2).cumsum(2).flip(2)
    assert wide.dtype == torch.float32 and rel_err(wide, want) <= 1e-5
    narrow = ext.scaled_cumsum(x, pre, None, reverse=True, base=base, out_fp32=False)
    assert narrow.dtype == dtype and torch.equal(narrow, wide.to(dtype))


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("m", [1, 5, 33, 70, 200])
def test_normalized_grad_rows(ext, dtype, m):
    """dnum = g/d in the products' operand dtype (bf16 for bf16, else float32), the same bits
    as torch's division; dden = -(g·out)/d in float32, also on rows whose d is eps alone (no
    real key: den 0). 111 rows (a warp takes two at once), M = 200: a second pass of columns."""
    gen = torch.Generator().manual_seed(m)
    g, out = (torch.randn(1, 3, 37, m, generator=gen).to(dtype) for _ in "go")
    den = 10 * torch.rand(1, 3, 37, generator=gen)
    den[0, 0, :3] = 0
    eps = 1e-6
    dnum, dden = ext.normalized_grad(g, out, den, eps)
    d = den + eps
    operand = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    assert dnum.dtype == operand and torch.equal(dnum, (g.float() / d[..., None]).to(operand))
    want = -(g.double() * out.double()).sum(-1) / d.double()
    assert dden.dtype == torch.float32 and rel_err(dden, want) <= 1e-6
    empty, none = ext.normalized_grad(g[..., :0], out[..., :0], den, eps)  # M = 0
    assert empty.shape == (1, 3, 37, 0) and (none == 0).all()
    # the non-causal backward's form: float32, dden as a last column
    both, absent = ext.normalized_grad(g, out, den, eps, dden_column=True, dnum_fp32=True)
    assert absent is None and both.dtype == torch.float32 and both.shape == (1, 3, 37, m + 1)
    assert torch.equal(both[..., :m], g.float() / d[..., None])
    assert rel_err(both[..., m], want) <= 1e-6
    column, _ = ext.normalized_grad(g, out, den, eps, dden_column=True)  # in dnum's dtype
    assert torch.equal(column[..., :m], dnum) and torch.equal(column[..., m], dden.to(operand))


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("walk_blocks", [0, 5], ids=["chunks", "walk"])
def test_results_do_not_depend_on_the_thread_schedule(emu, ext, walk_blocks, dtype):
    """Threads run in a different order between barriers, and blocks in a different order,
    under each seed; a race (a barrier missing, blocks sharing an output) would change the
    results. Every dtype: fp32 and fp16 take other buffers (scores read from Af)."""
    q, k, v, g = _inputs(2, 200, 96, 70, dtype, extra=1)
    runs = []
    for seed in (1, 2, 3):
        emu.ks_emu_configure(seed, H100_SMEM)
        runs.append(
            [
                *ext.causal_product(q, k, v, with_den=True, walk_blocks=walk_blocks),
                ext.causal_product(q, k, v, reverse=True, walk_blocks=walk_blocks)[0],
                *ext.causal_backward(q, k, v, g, walk_blocks=walk_blocks),
            ]
        )
    emu.ks_emu_configure(0, H100_SMEM)
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert torch.equal(a, b)


def test_walk_backward_layouts_agree(emu, ext):
    """Kernel 7 takes two buffers or one, and two staging tiles or one, as the shared memory
    allows. Stepping the limit down below each layout's size reaches all four; dk and dv agree
    bit for bit and with the reference. F = 96 gives three slices a chunk (dk twice, dv once),
    so the staging tiles wrap around."""
    q, k, v, g = _inputs(2, 200, 96, 40, torch.bfloat16, extra=1)
    want = _reference_grads(q, k, v, g)
    sizes, runs, limit = [], [], H100_SMEM
    try:
        for _ in range(4):
            emu.ks_emu_configure(0, limit)
            runs.append(ext.causal_backward(q, k, v, g, out_fp32=True, walk_blocks=5))
            sizes.append(emu.ks_emu_last_launch_smem())  # kernel 7 runs last
            limit = sizes[-1] - 1
    finally:
        emu.ks_emu_configure(0, H100_SMEM)
    assert sizes == sorted(set(sizes), reverse=True) and len(sizes) == 4
    for run in runs:
        for a, w in zip(run, want, strict=True):
            assert close_in_dtype(a, w, torch.bfloat16)
        assert torch.equal(run[1], runs[0][1]) and torch.equal(run[2], runs[0][2])


def test_walk_falls_back_where_shared_memory_is_short(emu, ext):
    """fp32 with F = M = 128 needs 227 KB for the walk and 261 KB for kernel 7: on an A100's
    163 KB the walk falls back to the chunk kernels, and every path gives the product."""
    q, k, v, g = _inputs(1, 140, 128, 128, torch.float32, extra=1)
    want, _ = _reference_product(q, k, v)
    results = {}
    for smem in (H100_SMEM, A100_SMEM):
        emu.ks_emu_configure(0, smem)
        out = ext.causal_product(q, k, v, walk_blocks=256)[0]
        assert close_in_dtype(out, want, torch.float32)
        results[smem] = [out, *ext.causal_backward(q, k, v, g, out_fp32=True, walk_blocks=256)]
    emu.ks_emu_configure(0, H100_SMEM)
    assert torch.equal(results[A100_SMEM][0], ext.causal_product(q, k, v)[0])  # bit for bit
    for a, b in zip(results[H100_SMEM], results[A100_SMEM], strict=True):
        assert close_in_dtype(a, b, torch.float32)


@pytest.mark.parametrize("walk_blocks", [0, 5], ids=["chunks", "walk"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_misaligned_tensors_give_the_same_bits(emu, ext, dtype, walk_blocks):
    """Tensors that start one element past an aligned address (views into a larger buffer)
    cannot move as 16-byte vectors or with cp.async: the kernels take the element-wise path
    for them (the emulator aborts on a misaligned vector, cp.async or WMMA tile, as a GPU
    faults), and every result is bit-identical to the aligned run. F and M are whole vectors,
    so only the addresses decide."""
    m = 40
    tensors = _inputs(2, 130, 64, m, dtype, extra=1)
    bias = torch.randn(1, 2, m)
    keep = torch.ones(1, 130, dtype=torch.bool)
    keep[0, 100:] = False

    def run(x, q, k, v, g):
        rows = g.float()  # the non-causal backward's fp32 row terms beside q
        state = x.full_state(q, rows, keep)
        return [
            *x.causal_product(q, k, v, with_den=True, walk_blocks=walk_blocks),
            *x.causal_product(
                q, k, v, reverse=True, out_fp32=False, normalize=True, walk_blocks=walk_blocks
            )[:1],
            *x.causal_backward(q, k, v, g, walk_blocks=walk_blocks),
            *x.full_apply(q, x.full_state(k, v), m, with_den=True),
            x.scaled_cumsum(k, pre=q[0, :, :, 0].float()),
            state,
            x.full_apply(
                q, x.full_state(k, v), m, out_fp32=False, bias=bias, key_padding_mask=keep
            )[0],
            x.full_apply(rows, mat, 64, out_fp32=False, out_dtype=dtype)[0],
        ]

    # S (64 x 40) read as a 40 x 64 matrix, with a zero normalizer part
    mat = torch.cat([torch.randn(1, 2, 64 * m), torch.zeros(1, 2, m)], dim=-1)

    misaligned = EmulatedExtension(emu, misalign=1)  # inputs and outputs
    for a, b in zip(run(ext, *tensors), run(misaligned, *tensors), strict=True):
        assert a.data_ptr() % 16 == 0 and b.data_ptr() % 16 != 0
        assert torch.equal(a, b)


# ---------------------------------------------------------------- kernel 8: the register walk
# kernels 8 and 9's shared memory (bytes): how a test sees that they ran (bf16 tiles for bf16
# inputs, fp32 tiles for the tf32 products of float32 and float16 inputs); kernel 8 with one
# feature slice (F <= 64) or two (64 < F <= 128, bf16 only), kernel 9
MMA_SMEM = {torch.bfloat16: (74240, 130048, 92160), torch.float32: (139776, None, 174080)}
MMA_SMEM[torch.float16] = MMA_SMEM[torch.float32]
SM86_SMEM = 101376  # an RTX 30x0's opt-in shared memory per block: kernels 6 and 7 do not fit


def _mma_walk_smem(dtype: torch.dtype, f: int) -> int | None:
    """Kernel 8's shared memory for F features, None where it does not apply."""
    return MMA_SMEM[dtype][0] if f <= 64 else MMA_SMEM[dtype][1] if f <= 128 else None


# F <= 64: one row; N not a multiple of the chunk with odd F and M; F = M = 64 with a partial
# last chunk; F ≠ M with two M slices (the second ragged; kernel 7 for dk and dv).
MMA_SHAPES = [(2, 1, 4, 3), (6, 37, 8, 5), (3, 130, 64, 64), (2, 200, 33, 70)]
# 64 < F <= 128, two feature slices (bf16): F = 128 with M = 64; F = 100 (the second slice
# ragged) with two M slices.
MMA_SHAPES_WIDE = [(2, 130, 128, 64), (2, 200, 100, 70)]
# walk_blocks: whole sequences, segments of 5 chunks, one chunk per segment
MMA_WALKS = {"whole": 1, "segments_5": 5, "per_chunk": 10**6}
# bf16 (mma.sync m16n8k16) on every shape and walk, and with two feature slices once whole and
# once in segments (the segments' carries are the same code); the tf32 kinds (m16n8k8; 3xTF32
# or one product), whose emulation costs 2-6 times more, on the shapes that reach every
# fragment and state slab, once whole and once in segments
MMA_CASES = [(torch.bfloat16, s, w) for s in MMA_SHAPES for w in MMA_WALKS]
MMA_CASES += [(torch.bfloat16, s, w) for s, w in zip(MMA_SHAPES_WIDE, MMA_WALKS, strict=False)]
MMA_CASES += [(d, s, w) for d in (torch.float32, torch.float16)
              for s, w in ((MMA_SHAPES[2], "whole"), (MMA_SHAPES[3], "segments_5"))]  # fmt: skip


@pytest.mark.parametrize(
    "dtype, shape, walk",
    MMA_CASES,
    ids=[f"{d}-{'x'.join(map(str, s))}-{w}" for d, s, w in MMA_CASES],
)
def test_mma_walk_product_normalizer_and_gradients(emu, ext, dtype, shape, walk):
    """Kernels 8 and 9 (mma.sync on operands in registers, emulated lane by lane as the PTX ISA
    lays out the fragments) against float64: the causal and anti-causal product, its
    normalizer, the normalized output in the input dtype and fp32, and the gradients by three
    products and by the fused backward (kernel 8 for dq, kernel 9 for dk and dv where F and M
    are <= 64, kernel 7 otherwise), with whole sequences, ragged segments (carries) and one
    chunk per segment; and within the dtype's tolerance of kernel 6."""
    walk_smem, dkv_smem_want = _mma_walk_smem(dtype, shape[2]), MMA_SMEM[dtype][2]
    walk_blocks = MMA_WALKS[walk]
    q, k, v, g = _inputs(*shape, dtype, extra=1)
    for reverse in (False, True):
        want, want_den = _reference_product(q, k, v, reverse)
        out, den = ext.causal_product(
            q, k, v, reverse, with_den=True, walk_blocks=walk_blocks, mma_walk=True
        )
        assert emu.ks_emu_last_launch_smem() == walk_smem
        assert close_in_dtype(out, want, dtype) and close_in_dtype(den, want_den, dtype)
        wmma, wmma_den = ext.causal_product(
            q, k, v, reverse, with_den=True, walk_blocks=walk_blocks
        )
        assert close_in_dtype(out, wmma.double(), dtype)
        assert close_in_dtype(den, wmma_den.double(), dtype)
        for out_fp32 in (False, True):
            normalized, _ = ext.causal_product(
                q, k, v, reverse, out_fp32=out_fp32, normalize=True, walk_blocks=walk_blocks,
                mma_walk=True,
            )  # fmt: skip
            assert normalized.dtype == (torch.float32 if out_fp32 else dtype)
            assert close_in_dtype(normalized, want / (want_den[..., None] + 1e-6), dtype)
    want = _reference_grads(q, k, v, g)
    three = [
        ext.causal_product(*x, reverse=r, walk_blocks=walk_blocks, mma_walk=True)[0]
        for x, r in (((g, v, k), False), ((v, g, q), True), ((k, q, g), True))
    ]
    fused = ext.causal_backward(q, k, v, g, out_fp32=True, walk_blocks=walk_blocks, mma_walk=True)
    dkv_smem = emu.ks_emu_last_launch_smem()
    assert (dkv_smem == dkv_smem_want) == (max(shape[2:]) <= 64)
    for got in (three, fused):
        for a, w in zip(got, want, strict=True):
            assert close_in_dtype(a, w, dtype)


def test_mma_walk_leaves_other_cases_to_the_other_kernels(emu, ext):
    """mma_walk leaves every case kernel 8 does not cover or fit to kernel 6 or the chunk
    kernels, bit for bit: F = 65 in fp32 tiles, F = 129 in bf16, and on an sm_86 (99 KB) F = 64
    in fp32 tiles (137 KB) and F = 128 in bf16 (127 KB)."""
    cases = [((2, 70, 65, 8), d, H100_SMEM) for d in (torch.float32, torch.float16)]
    cases += [((2, 70, 129, 8), torch.bfloat16, H100_SMEM)]
    cases += [((2, 70, 64, 8), d, SM86_SMEM) for d in (torch.float32, torch.float16)]
    cases += [((2, 70, 128, 8), torch.bfloat16, SM86_SMEM)]
    try:
        for shape, dtype, smem in cases:
            emu.ks_emu_configure(0, smem)
            q, k, v = _inputs(*shape, dtype)
            a = ext.causal_product(q, k, v, with_den=True, walk_blocks=1, mma_walk=True)
            assert emu.ks_emu_last_launch_smem() not in MMA_SMEM[dtype]
            b = ext.causal_product(q, k, v, with_den=True, walk_blocks=1)
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    finally:
        emu.ks_emu_configure(0, H100_SMEM)


@pytest.mark.parametrize(
    "shape, smem", [((2, 100, 64, 48), SM86_SMEM), ((2, 100, 128, 48), A100_SMEM)],
    ids=["F=64-sm_86", "F=128-A100"],
)  # fmt: skip
def test_mma_walk_runs_where_only_it_fits(emu, ext, shape, smem):
    """bf16 kernel 8 takes less shared memory than kernel 6: on an sm_86 (99 KB) it runs (73 KB)
    where kernel 6 (108 KB) does not fit, and kernel 9 (90 KB) in place of kernel 7's
    single-buffered layout (98 KB); with two feature slices it fits an A100's 163 KB (127 KB,
    kernel 6 170 KB). Products and gradients against float64."""
    dtype = torch.bfloat16
    q, k, v, g = _inputs(*shape, dtype, extra=1)
    want, want_den = _reference_product(q, k, v)
    try:
        emu.ks_emu_configure(0, smem)
        out, den = ext.causal_product(q, k, v, with_den=True, walk_blocks=1, mma_walk=True)
        assert emu.ks_emu_last_launch_smem() == _mma_walk_smem(dtype, shape[2])
        grads = ext.causal_backward(q, k, v, g, out_fp32=True, walk_blocks=1, mma_walk=True)
        if shape[2] <= 64:
            assert emu.ks_emu_last_launch_smem() == MMA_SMEM[dtype][2]
    finally:
        emu.ks_emu_configure(0, H100_SMEM)
    assert close_in_dtype(out, want, dtype) and close_in_dtype(den, want_den, dtype)
    for a, w in zip(grads, _reference_grads(q, k, v, g), strict=True):
        assert close_in_dtype(a, w, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_mma_walk_backward_falls_back_where_shared_memory_is_short(emu, ext, dtype):
    """Below kernel 9's shared memory (90 KB for bf16 tiles, 170 KB for fp32 tiles: an A100 has
    163 KB) the fused backward takes kernel 7 (in a layout that fits), and the gradients still
    match float64."""
    dkv_smem = MMA_SMEM[dtype][2]
    q, k, v, g = _inputs(2, 100, 16, 16, dtype, extra=1)
    want = _reference_grads(q, k, v, g)
    try:
        emu.ks_emu_configure(0, dkv_smem - 1)
        got = ext.causal_backward(q, k, v, g, out_fp32=True, walk_blocks=1, mma_walk=True)
        assert emu.ks_emu_last_launch_smem() < dkv_smem
    finally:
        emu.ks_emu_configure(0, H100_SMEM)
    for a, w in zip(got, want, strict=True):
        assert close_in_dtype(a, w, dtype)


@pytest.mark.parametrize(
    "dtype, f", [(d, 40) for d in MMA_SMEM] + [(torch.bfloat16, 100)],
    ids=[*map(str, MMA_SMEM), "torch.bfloat16-two_slices"],
)  # fmt: skip
def test_mma_walk_is_schedule_independent_and_alignment_blind(emu, ext, dtype, f):
    """Kernels 8 and 9 under three thread schedules, and on tensors one element past an aligned
    address (outputs written element-wise, tiles loaded without cp.async): bit-identical. bf16
    also with two feature slices (F = 100; kernel 7 for dk and dv)."""
    q, k, v, g = _inputs(2, 150, f, 56, dtype, extra=1)

    def run(x):
        return [
            *x.causal_product(q, k, v, with_den=True, walk_blocks=5, mma_walk=True),
            *x.causal_product(
                q, k, v, reverse=True, out_fp32=False, normalize=True, walk_blocks=5,
                mma_walk=True,
            )[:1],
            *x.causal_backward(q, k, v, g, walk_blocks=5, mma_walk=True),
        ]  # fmt: skip

    runs = []
    for seed in (1, 2, 3):
        emu.ks_emu_configure(seed, H100_SMEM)
        runs.append(run(ext))
    emu.ks_emu_configure(0, H100_SMEM)
    runs.append(run(EmulatedExtension(emu, misalign=1)))
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert torch.equal(a, b)


# ---------------------------------------------------------------- the emulator's own checks
@pytest.fixture(scope="module")
def self_checks(tmp_path_factory) -> Path:
    """tests/cuda_emulator/self_checks.cpp built: small kernels that check the emulator."""
    exe = tmp_path_factory.mktemp("self_checks") / "self_checks"
    source = EMULATOR / "self_checks.cpp"
    command = [GXX, *GXX_FLAGS, str(source), "-o", str(exe)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]
    return exe


def _self_check(exe: Path, case: str, seed: int) -> subprocess.CompletedProcess:
    return subprocess.run([str(exe), case, str(seed)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("block_of_2048", "a block above 1024 threads"),
        ("grid_y_65536", "a grid above"),
        ("smem_64k", "above 48 KB not allowed by cudaFuncSetAttribute"),
        ("write_before_smem", "write outside the block's dynamic shared memory"),
    ],
)
def test_the_emulator_refuses_what_a_gpu_refuses(self_checks, case, message):
    """A launch a GPU refuses (too many threads a block, grid.y above 65,535, dynamic shared
    memory above 48 KB without cudaFuncSetAttribute) and a write before the block's dynamic
    shared memory abort; each ran through before."""
    run = _self_check(self_checks, case, 0)
    assert run.returncode != 0, run.stdout
    assert run.stderr.startswith("ks_emu: ") and message in run.stderr, run.stderr


def test_the_emulator_runs_what_a_gpu_runs(self_checks):
    """64 KB of dynamic shared memory once cudaFuncSetAttribute allows it; a grid of three
    blocks along z, each with its own blockIdx.z (was 1 in every block, and one block ran); a
    __syncwarp() that lanes which have returned do not reach (CUDA waits for the non-exited
    lanes only; it aborted as a deadlock under some schedules)."""
    assert _self_check(self_checks, "smem_64k_allowed", 0).returncode == 0
    run = _self_check(self_checks, "block_z", 0)
    assert run.returncode == 0 and run.stdout.split() == ["100", "101", "102"], run
    for seed in range(20):
        run = _self_check(self_checks, "exited_lanes", seed)
        assert run.returncode == 0, (seed, run.stderr)
        assert run.stdout.split() == [str(lane) for lane in range(16)], (seed, run.stdout)


def test_ldmatrix_reads_rows_stored_without_a_syncwarp_stale(self_checks):
    """Lanes store a tile whose rows hold elements of eight lanes each, then ldmatrix it: without
    a __syncwarp() in between, a lane that runs ahead posts rows other lanes have not stored yet
    and receives poison (the emulated ldmatrix read the rows only once every lane had posted, so
    the missing barrier never showed); with one, every element arrives."""
    stale = 0
    for seed in range(10):
        run = _self_check(self_checks, "ldmatrix", seed)
        assert run.returncode == 0, run.stderr
        stale += sum(map(int, run.stdout.split()))
        synced = _self_check(self_checks, "ldmatrix_synced", seed)
        assert synced.returncode == 0 and set(synced.stdout.split()) == {"0"}, synced
    assert stale > 0


def test_the_emulator_fuses_no_multiply_add_whatever_the_host(tmp_path):
    """The emulator's flags keep a * b + c two roundings on a host with FMA (g++ fused them under
    -march=x86-64-v3, as a compiler defaulting to it or aarch64 would: the emulator's bits
    depended on the host). Compile-only: the assembly, not the host, is checked."""
    source = tmp_path / "fma.cpp"
    source.write_text("float f(float a, float b, float c) { return a * b + c; }\n")
    flags = [f for f in GXX_FLAGS if not f.startswith("-fsanitize")]
    command = [GXX, *flags, "-march=x86-64-v3", "-S", str(source), "-o", "-"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        pytest.skip(f"g++ cannot target x86-64-v3 here: {result.stderr[-300:]}")
    assert "vmulss" in result.stdout and "fmadd" not in result.stdout, result.stdout


def test_objects_are_compiled_once_per_source_flags_and_compiler():
    """_compile keeps an object and compiles it again only where what it depends on changed:
    here the defines (a changed source or header changes the digest the same way)."""
    harness = EMULATOR / "harness.cpp"
    first = _compile([harness])[0]
    made = first.stat().st_mtime_ns
    assert _compile([harness]) == [first] and first.stat().st_mtime_ns == made
    other = _compile([harness], ("-DKS_DIGEST_TEST",))[0]
    assert other.parent != first.parent and other.name == first.name and other.exists()
    assert not list(first.parent.glob("*.part"))
    with pytest.raises(AssertionError, match="digest covers"):
        _compile([Path(__file__)])


# ---------------------------------------------------------------- bf16x3 (-DKS_FP32_BF16X3)
@pytest.fixture(scope="module")
def emu_bf16x3(tmp_path_factory) -> ctypes.CDLL:
    """The emulator with float32.cu built with -DKS_FP32_BF16X3 (fp32 inputs' register walks
    on bf16 parts), the other units' objects as they are."""
    unit = csrc_dir() / "cuda" / "float32.cu"
    others = [s for s in EMULATED_SOURCES if s != unit]
    objects = dict(zip(others, _compile(others), strict=True))
    objects[unit] = _compile([unit], ("-DKS_FP32_BF16X3",))[0]
    folder = tmp_path_factory.mktemp("cuda_emulator_bf16x3")
    return _load([objects[s] for s in EMULATED_SOURCES], folder / "ks_emulated.so")


def _mma_walk_results(x: EmulatedExtension, q, k, v, g, walk_blocks: int) -> dict:
    """Kernels 8, 9 and 12 on fp32 inputs: the product and its normalizer both ways, the
    normalized output, and the gradients by three products and by the fused backward."""
    results = {}
    for reverse in (False, True):
        results[f"out_{reverse}"], results[f"den_{reverse}"] = x.causal_product(
            q, k, v, reverse, with_den=True, walk_blocks=walk_blocks, mma_walk=True
        )
        results[f"normalized_{reverse}"] = x.causal_product(
            q, k, v, reverse, out_fp32=False, normalize=True, walk_blocks=walk_blocks,
            mma_walk=True,
        )[0]  # fmt: skip
    for name, args, reverse in (("dq", (g, v, k), False), ("dk", (v, g, q), True),
                                ("dv", (k, q, g), True)):  # fmt: skip
        results[f"{name}_three"] = x.causal_product(
            *args, reverse=reverse, walk_blocks=walk_blocks, mma_walk=True
        )[0]
    dq, dk, dv = x.causal_backward(q, k, v, g, out_fp32=True, walk_blocks=walk_blocks,
                                   mma_walk=True)  # fmt: skip
    results.update(dq_fused=dq, dk_fused=dk, dv_fused=dv)
    return results


def _mma_walk_references(q, k, v, g) -> dict:
    want = {}
    for reverse in (False, True):
        out, den = _reference_product(q, k, v, reverse)
        want.update({f"out_{reverse}": out, f"den_{reverse}": den})
        want[f"normalized_{reverse}"] = out / (den[..., None] + 1e-6)
    for name, grad in zip(("dq", "dk", "dv"), _reference_grads(q, k, v, g), strict=True):
        want[f"{name}_three"] = want[f"{name}_fused"] = grad
    return want


# fp32 shapes of kernels 8, 9 and 12 (F, M <= 64): one row; odd F and M, N not a multiple of the
# chunk; F = M = 64 with a partial chunk; F ≠ M with two M slices (kernel 7 for dk and dv there)
BF16X3_CASES = [(MMA_SHAPES[0], "whole"), (MMA_SHAPES[1], "per_chunk"),
                (MMA_SHAPES[2], "whole"), (MMA_SHAPES[3], "segments_5")]  # fmt: skip


@pytest.mark.parametrize(
    "shape, walk", BF16X3_CASES, ids=[f"{'x'.join(map(str, s))}-{w}" for s, w in BF16X3_CASES]
)
def test_bf16x3_walks_keep_float32_accuracy(emu_bf16x3, ext, shape, walk):
    """Built with -DKS_FP32_BF16X3, fp32 inputs' register walks (kernel 8; kernel 9 for dk and
    dv; kernel 12 for the segments' carries) multiply bf16 parts: every result within fp32's
    1e-4 (max relative error, scale at least 1) of float64, as 3xTF32's, and not 3xTF32's
    bits (the build's products are bf16x3's). Measured: at most 1.3e-5 over these cases, against
    2.6e-6 for 3xTF32 (one-term bf16 products miss 1e-4 by more than tenfold)."""
    q, k, v, g = _inputs(*shape, torch.float32, extra=1)
    walk_blocks = MMA_WALKS[walk]
    got = _mma_walk_results(EmulatedExtension(emu_bf16x3), q, k, v, g, walk_blocks)
    tf32 = _mma_walk_results(ext, q, k, v, g, walk_blocks)
    want = _mma_walk_references(q, k, v, g)
    errors = {name: rel_err(got[name], want[name], 1.0) for name in want}
    assert all(torch.isfinite(t).all() for t in got.values())
    assert max(errors.values()) <= 1e-4, errors
    products = [n for n in want if not n.startswith("normalized") and not n.startswith("den")]
    if shape[1] > 1:  # one row: the products of one key may be exact both ways
        assert any(not torch.equal(got[n], tf32[n]) for n in products)


def test_bf16x3_long_sums_do_not_drift(emu_bf16x3):
    """One sequence of 256 chunks, as test_long_float32_sums_do_not_drift: each chunk's bf16x3
    products summed apart and added in fp32 keep the state's error near its products' (2e-5)."""
    x = EmulatedExtension(emu_bf16x3)
    q, k, v, g = _inputs(1, 64 * 256, 16, 16, torch.float32, extra=1)
    want, want_den, want_grads = _prefix_state_reference(q, k, v, g)
    out, den = x.causal_product(q, k, v, with_den=True, walk_blocks=1, mma_walk=True)
    assert rel_err(out, want, 1.0) <= 2e-5 and rel_err(den, want_den, 1.0) <= 2e-5
    got = x.causal_backward(q, k, v, g, True, walk_blocks=1, mma_walk=True)
    for a, w in zip(got, want_grads, strict=True):
        assert rel_err(a, w, 1.0) <= 2e-5


def test_bf16x3_walks_are_schedule_independent_and_alignment_blind(emu_bf16x3):
    """As test_mma_walk_is_schedule_independent_and_alignment_blind, on the bf16x3 build."""
    q, k, v, g = _inputs(2, 150, 40, 56, torch.float32, extra=1)
    runs = []
    for seed in (1, 2):
        emu_bf16x3.ks_emu_configure(seed, H100_SMEM)
        runs.append(_mma_walk_results(EmulatedExtension(emu_bf16x3), q, k, v, g, 5))
    emu_bf16x3.ks_emu_configure(0, H100_SMEM)
    runs.append(_mma_walk_results(EmulatedExtension(emu_bf16x3, misalign=1), q, k, v, g, 5))
    for other in runs[1:]:
        assert all(torch.equal(runs[0][n], other[n]) for n in runs[0])


@pytest.mark.parametrize("walk_blocks", [1, 7])
@pytest.mark.parametrize("out_fp32", [False, True])
@pytest.mark.parametrize("mma", [True, False], ids=["kernel10", "kernel11"])
def test_backward_walks_together_give_the_bits_of_two_launches(
    emu, ext, mma, walk_blocks, out_fp32
):
    """Kernel 10 runs kernel 8's dq walk and kernel 9's dk, dv walk in one grid, kernel 11
    kernel 6's and kernel 7's (with one buffer): the gradients are bit for bit those of the two
    launches, with one segment a sequence and with several (walk_blocks 7 over B·H = 3: both
    walks' carries share the workspace); F != M."""
    q, k, v, g = _inputs(3, 200, 48, 40, torch.bfloat16, extra=1)
    kernels, asked = (ctypes.c_int * 4)(), (ctypes.c_uint64 * 2)()
    results, last = {}, {}
    for together in (True, False):
        err = emu.ks_emu_walk_kernels(DTYPES[torch.bfloat16], 48, 40, mma, together, kernels, asked)
        assert err == 0
        assert kernels[2] == ((10 if mma else 11) if together else (9 if mma else 7))
        results[together] = ext.causal_backward(
            q, k, v, g, out_fp32=out_fp32, walk_blocks=walk_blocks, mma_walk=mma,
            walks_together=together,
        )  # fmt: skip
        last[together] = emu.ks_emu_last_kernel()
        if not out_fp32:  # walk_kernels names the instantiation with outputs in the inputs' dtype
            assert last[together] == asked[1]
    assert last[True] != last[False]
    for a, b in zip(results[True], results[False], strict=True):
        assert torch.equal(a, b)


# (B·H, N, F, M, walk_blocks, mma_walk, walks_together): which kernels write dk and dv
DV_CASES = {
    "chunks": (2, 130, 40, 24, 0, False, True),  # kernels 4 and 5
    "kernel7": (2, 130, 40, 24, 5, False, False),
    "kernel9": (2, 130, 40, 24, 5, True, False),
    "kernel10": (2, 130, 40, 24, 5, True, True),  # bf16; float16: kernel 9
    "kernel11": (2, 130, 40, 24, 5, False, True),  # bf16; float16: kernel 7
    "products": (1, 150, 130, 20, 5, False, True),  # F > 128: dk and dv as two products
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(DV_CASES))
def test_fused_backward_writes_dv_in_the_inputs_dtype_beside_float32_dq_dk(ext, case, dtype):
    """``dv_fp32=False`` beside ``out_fp32=True`` (what the normalized backward asks for: it adds
    terms to dq and dk in float32, none to dv): dq and dk are the bits of the all-float32 call,
    dv those of its float32 dv rounded once to the inputs' dtype, on every kernel that writes
    them. ``dv_fp32`` None follows ``out_fp32``; float32 dv beside narrow dq, dk is refused."""
    bh, n, f, m, walk_blocks, mma, together = DV_CASES[case]
    q, k, v, g = _inputs(bh, n, f, m, dtype, extra=1)
    kernel = dict(walk_blocks=walk_blocks, mma_walk=mma, walks_together=together)
    wide = ext.causal_backward(q, k, v, g, out_fp32=True, dv_fp32=None, **kernel)
    assert [t.dtype for t in wide] == [torch.float32] * 3
    dq, dk, dv = ext.causal_backward(q, k, v, g, out_fp32=True, dv_fp32=False, **kernel)
    assert dq.dtype == dk.dtype == torch.float32 and dv.dtype == dtype
    assert torch.equal(dq, wide[0]) and torch.equal(dk, wide[1])
    assert torch.equal(dv, wide[2].to(dtype))
    with pytest.raises(ValueError, match="dv_fp32"):
        ext.causal_backward(q, k, v, g, out_fp32=False, dv_fp32=True, **kernel)


# ---------------------------------------------------------------- walk_kernels
# (dtype, F, M, mma_walk, walks_together, shared memory per block, product kernel, dk/dv kernel)
WALK_KERNEL_CASES = [
    (torch.bfloat16, 64, 64, True, True, H100_SMEM, 8, 10),  # dq, dk and dv walks in one grid
    (torch.bfloat16, 64, 64, True, False, H100_SMEM, 8, 9),  # the two walks apart
    (torch.bfloat16, 64, 64, False, True, H100_SMEM, 6, 11),  # kernels 6 and 7 in one grid
    (torch.bfloat16, 64, 64, False, False, H100_SMEM, 6, 7),
    (torch.bfloat16, 64, 64, False, True, A100_SMEM, 6, 7),  # two blocks of 11 do not fit an SM
    (torch.float32, 64, 64, True, True, H100_SMEM, 8, 9),
    (torch.float16, 40, 56, True, True, H100_SMEM, 8, 9),
    (torch.bfloat16, 128, 64, True, True, H100_SMEM, 8, 7),  # two slices; kernel 9 takes F <= 64
    (torch.float32, 65, 8, True, True, H100_SMEM, 6, 7),  # kernel 8 in fp32 tiles takes F <= 64
    (torch.bfloat16, 200, 8, True, True, H100_SMEM, 0, 0),  # no walk above F = 128
    (torch.bfloat16, 64, 48, False, True, SM86_SMEM, 0, 7),  # kernel 6 (108 KB) does not fit
    (torch.bfloat16, 64, 48, True, True, SM86_SMEM, 8, 9),  # two blocks of 10 do not fit an SM
    (
        torch.float32,
        64,
        64,
        True,
        True,
        A100_SMEM,
        8,
        7,
    ),  # kernel 9 in fp32 tiles (170 KB) does not
]


@pytest.mark.parametrize(
    "dtype, f, m, mma, together, smem, product, dkv",
    WALK_KERNEL_CASES,
    ids=[
        f"{c[0]}-F{c[1]}-M{c[2]}-{'mma' if c[3] else 'wmma'}{'' if c[4] else '-apart'}-{c[5]}"
        for c in WALK_KERNEL_CASES
    ],
)
def test_walk_kernels_name_the_kernels_that_run(
    emu, ext, dtype, f, m, mma, together, smem, product, dkv
):
    """walk_kernels (what the scaling benchmark reports) names the kernels that the product and
    the fused backward launch: the kernel it asks the occupancy of is the one launched, and its
    blocks per SM are the emulator's count for the launched kernel's shared memory."""
    kernels, asked = (ctypes.c_int * 4)(), (ctypes.c_uint64 * 2)()
    try:
        emu.ks_emu_configure(0, smem)
        assert emu.ks_emu_walk_kernels(DTYPES[dtype], f, m, mma, together, kernels, asked) == 0
        assert (kernels[0], kernels[2]) == (product, dkv)
        asked_product = asked[0] if product else None
        asked_dkv = asked[1 if product else 0] if dkv else None
        q, k, v, g = _inputs(2, 70, f, m, dtype, extra=1)
        ext.causal_product(q, k, v, out_fp32=False, walk_blocks=1, mma_walk=mma)  # as autograd
        launched = emu.ks_emu_last_kernel()
        assert (launched == asked_product) == bool(product)
        if product:
            resident = min(8, (smem + 1024) // (emu.ks_emu_last_launch_smem() + 1024))
            assert kernels[1] == resident >= 1
        # dk, dv last
        ext.causal_backward(q, k, v, g, walk_blocks=1, mma_walk=mma, walks_together=together)
        assert (emu.ks_emu_last_kernel() == asked_dkv) == bool(dkv)
        if dkv:
            resident = min(8, (smem + 1024) // (emu.ks_emu_last_launch_smem() + 1024))
            assert kernels[3] == resident >= 1
        assert emu.ks_emu_walk_kernels(DTYPES[dtype], 0, m, mma, together, kernels, asked) != 0
    finally:
        emu.ks_emu_configure(0, H100_SMEM)


# Cases drawn at random over every option at once (a campaign of 2324 such cases, 40 minutes,
# found no failure on 2026-11-29; these keep a fixed draw of it in CI): dtype, B·H, N around the
# chunk edges, F and M on both sides of the 64-wide slices, WALK_BLOCKS, mma_walk, misaligned
# tensors, the shared memory of an H100, an A100 or an sm_86, the schedule, the direction, and
# the backward's two walks in one grid or not.
RANDOM_CASES = 12


def _random_case(rng: random.Random) -> dict:
    return {
        "dtype": rng.choice(list(DTYPES)),
        "bh": rng.choice([1, 2, 3]),
        "n": rng.choice([1, 15, 63, 64, 65, 127, 129, 200, 257]),
        "f": rng.choice([1, 7, 33, 63, 64, 65, 96, 128, 129]),
        "m": rng.choice([1, 8, 31, 40, 64, 65, 100, 129]),
        "walk_blocks": rng.choice([0, 1, 2, 5, 10**6]),
        "mma_walk": rng.random() < 0.7,
        "misalign": rng.choice([0, 1, 2]),
        "smem": rng.choice([H100_SMEM, A100_SMEM, 101376]),
        "schedule": rng.randrange(1 << 30),
        "reverse": rng.random() < 0.5,
        "seed": rng.randrange(1000),
        "walks_together": rng.random() < 0.7,  # drawn after the fields above: they keep their
        # draws; so is the carry pass's target (KS_CARRY_BLOCKS; 512 on a GPU, lower: segments
        # summed in several groups even at these sizes)
        "carry_blocks": rng.choice([512, 2, 3, 5]),
        "chunk_blocks": rng.choice([1024, 1, 2, 5]),  # the chunk kernels' (KS_CHUNK_BLOCKS)
    }


@pytest.mark.parametrize("case", range(RANDOM_CASES))
def test_random_cases_over_every_option_match_the_reference(emu, case):
    c = _random_case(random.Random(f"cuda-emulated-{case}"))  # in the traceback's locals
    kernel = {"walk_blocks": c["walk_blocks"], "mma_walk": c["mma_walk"]}
    x = EmulatedExtension(emu, misalign=c["misalign"])
    q, k, v, g = _inputs(c["bh"], c["n"], c["f"], c["m"], c["dtype"], seed=c["seed"], extra=1)
    try:
        emu.ks_emu_configure(c["schedule"], c["smem"])
        emu.ks_emu_set_carry_blocks(c["carry_blocks"])
        emu.ks_emu_set_chunk_blocks(c["chunk_blocks"])
        _check_product(x, q, k, v, c["reverse"], **kernel)
        together = c["walks_together"]
        wide = _check_fused_backward(x, q, k, v, g, walks_together=together, **kernel)
        if c["dtype"] != torch.float32:  # dv in the inputs' dtype: the normalized backward's
            dq, dk, dv = x.causal_backward(
                q, k, v, g, out_fp32=True, dv_fp32=False, walks_together=together, **kernel
            )
            assert torch.equal(dq, wide[0]) and torch.equal(dk, wide[1])
            assert torch.equal(dv, wide[2].to(c["dtype"]))
        # the normalized backward's row terms and cumulative sum on the same tensors
        den = q.float().sum(-1)
        dnum, dden = x.normalized_grad(g, v, den, 1e-3)
        assert torch.equal(dnum, (g.float() / (den + 1e-3)[..., None]).to(dnum.dtype))
        want = -(g.double() * v.double()).sum(-1) / (den.double() + 1e-3)
        assert rel_err(dden, want) <= 1e-5
        flip = (lambda t: t.flip(2)) if c["reverse"] else (lambda t: t)
        sums = x.scaled_cumsum(k, dden, None, c["reverse"], base=wide[0])
        want = wide[0].double() + flip(flip(dden[..., None].double() * k.double()).cumsum(2))
        assert rel_err(sums, want) <= 1e-5
        # the non-causal backward's kernels: q beside fp32 row terms (the bits of the float32
        # reduction), fp32 operands read into the inputs' dtype, a bias and padded rows
        gen = torch.Generator().manual_seed(c["seed"])
        keep = torch.rand(1, c["n"], generator=gen) < 0.8
        rows = g.float()
        state = x.full_state(q, rows, keep)
        assert torch.equal(state, x.full_state(q.float(), rows, keep))
        # S (F x M) read as an M x F matrix, with a zero normalizer part
        s = state[..., : c["f"] * c["m"]].reshape(1, c["bh"], c["m"], c["f"])
        mat = torch.cat([s.reshape(1, c["bh"], -1), torch.zeros(1, c["bh"], c["m"])], dim=-1)
        wide = x.full_apply(rows, mat, c["f"])[0]
        got = x.full_apply(rows, mat, c["f"], out_fp32=False, out_dtype=c["dtype"])[0]
        assert torch.equal(got, wide.to(c["dtype"]))
        bias = torch.randn(1, c["bh"], c["f"], generator=gen)
        got = x.full_apply(v, mat, c["f"], out_fp32=True, bias=bias, key_padding_mask=keep)[0]
        want = (v.double() @ s.double() + bias.double()[:, :, None]) * keep[:, None, :, None]
        assert close_in_dtype(got, want, c["dtype"])
    finally:
        emu.ks_emu_configure(0, H100_SMEM)
        emu.ks_emu_set_carry_blocks(512)
        emu.ks_emu_set_chunk_blocks(1024)


# ---------------------------------------------------------------- the backend on the kernels
@pytest.fixture
def backend(ext, monkeypatch):
    """kernelstudy.core.cuda_backend with the emulated extension taking CPU tensors."""
    monkeypatch.setattr(cuda_backend, "extension", lambda: ext)
    monkeypatch.setattr(cuda_backend, "supports", lambda x: x.dtype in DTYPES)
    return cuda_backend


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("n, f, m", [(0, 4, 3), (5, 0, 3), (5, 4, 0)], ids=["N0", "F0", "M0"])
def test_backend_on_empty_sizes(backend, dtype, causal, n, f, m):
    """No rows, no features or no values: the normalized attention and its gradients are zeros
    of the inputs' shapes (the binding launches nothing), as the float64 reference has them."""
    q, k = (torch.rand(1, 2, n, f).to(dtype).requires_grad_() for _ in "qk")
    v = torch.randn(1, 2, n, m).to(dtype).requires_grad_()
    out = backend.linear_attention(q, k, v, causal=causal)
    assert out.shape == (1, 2, n, m) and out.dtype == dtype and not out.abs().sum()
    out.backward(torch.randn_like(out))
    for t in (q, k, v):
        assert t.grad.shape == t.shape and t.grad.dtype == dtype and not t.grad.abs().sum()


# (shape, dtype, kernel): every dtype on each kernel; walk_mma's tf32 kinds (slow to emulate)
# on the small shape only
BACKEND_SHAPES = {"small": (2, 3, 37, 8, 5), "ragged": (1, 2, 150, 33, 70)}
BACKEND_CASES = [
    (s, d, k)
    for s in BACKEND_SHAPES
    for d in DTYPES
    for k in cuda_backend.CAUSAL_KERNELS
    if s == "small" or k != "walk_mma" or d == torch.bfloat16
]
# CAUSAL_KERNEL as a dict: each dtype its own kernel
BY_DTYPE = {torch.float32: "walk", torch.float16: "chunks", torch.bfloat16: "walk_mma"}
BACKEND_CASES += [("small", d, "by_dtype") for d in DTYPES]


@pytest.mark.parametrize("fused", [False, True], ids=["three_products", "fused_backward"])
@pytest.mark.parametrize(
    "shape, dtype, kernel", BACKEND_CASES, ids=[f"{s}-{d}-{k}" for s, d, k in BACKEND_CASES]
)
def test_backend_matches_reference(backend, monkeypatch, shape, dtype, kernel, fused):
    """The autograd functions of the cuda backend (products, normalizer, masks, the float16
    normalized backward in float32) on each kernel and backward: outputs and every gradient."""
    monkeypatch.setattr(backend, "CAUSAL_KERNEL", BY_DTYPE if kernel == "by_dtype" else kernel)
    monkeypatch.setattr(backend, "WALK_BLOCKS", 3)
    monkeypatch.setattr(backend, "FUSED_BACKWARD", fused)
    b, h, n, f, m = BACKEND_SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.rand(b, h, n, f, generator=gen).to(dtype) for _ in "qk")
    v, g = (torch.randn(b, h, n, m, generator=gen).to(dtype) for _ in "vg")
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[-1, n // 2 :] = False
    mask[0, :3] = False  # left padding: rows that see no real key in causal attention
    cases = [
        (backend.causal_product, causal_dot_product_reference),
        *(
            (
                lambda *x, c=causal: backend.linear_attention(*x, causal=c, key_padding_mask=mask),
                lambda *x, c=causal: linear_attention_reference(
                    *x, causal=c, key_padding_mask=mask
                ),
            )
            for causal in (True, False)
        ),
    ]
    for fn, ref in cases:
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        x64 = [t.double().requires_grad_() for t in (q, k, v)]
        got, want = fn(*x), ref(*x64)
        assert got.dtype == dtype and close_in_dtype(got, want, dtype)
        for a, w in zip(
            torch.autograd.grad(got, x, g), torch.autograd.grad(want, x64, g.double()), strict=True
        ):
            assert a.dtype == dtype and close_in_dtype(a, w, dtype)


def _func_cases(backend, mask):
    """(name, the cuda backend's function, the float64 reference) of q, k, v."""
    return [
        ("product", backend.causal_product, causal_dot_product_reference),
        *(
            (
                name,
                lambda *x, c=causal: backend.linear_attention(*x, causal=c, key_padding_mask=mask),
                lambda *x, c=causal: linear_attention_reference(
                    *x, causal=c, key_padding_mask=mask
                ),
            )
            for name, causal in (("causal", True), ("full", False))
        ),
    ]


@pytest.mark.parametrize("kernel", ["chunks", "walk"])
def test_backend_under_torch_func_and_double_backward(backend, ext, monkeypatch, kernel):
    """The cuda backend's Functions under torch.func (jvp, vmap with an unmapped input,
    vmap of grad, jacrev, jacfwd of jacrev), dual tensors, jacrev under no_grad, batched
    gradients and gradients of gradients (create_graph=True), float32 on the kernels against
    the float64 reference: max relative error ≤ 1e-4. They had no setup_context (every
    transform raised) and refused a double backward; the fused backwards handed torch.func's
    wrapped gradients (grad mode off: jacrev under no_grad) and the older vmap's batched ones to
    the kernels; the composed jvp ran torch.func.jvp, which fails among dual tensors. The
    outputs are copied out of their guard buffers, as the binding allocates them: a view
    returned by a Function fails forward-mode AD's layout assertion."""
    monkeypatch.setattr(backend, "extension", lambda: _OutputsCopied(ext))
    monkeypatch.setattr(backend, "CAUSAL_KERNEL", kernel)
    monkeypatch.setattr(backend, "WALK_BLOCKS", 3)
    b, h, n, f, m = 2, 1, 37, 6, 5
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.rand(b, h, n, f, generator=gen) for _ in "qk")
    v, w = (torch.randn(b, h, n, m, generator=gen) for _ in "vw")
    tangents = [torch.randn(x.shape, generator=gen) for x in (q, k, v)]
    u = torch.randn(q.shape, generator=gen)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, :3] = mask[1, 20:] = False
    x32, x64 = (q, k, v), tuple(t.double() for t in (q, k, v))
    small = [t[:1, :, 1:5] for t in x32], [t[:1, :, 1:5] for t in x64]  # jacobians
    cases = zip(_func_cases(backend, mask), _func_cases(backend, mask[:1, 1:5]), strict=True)
    for (name, fn, ref), (_, small_fn, small_ref) in cases:
        got = torch_func_results(fn, x32, small_fn, small[0], w, u, tangents)
        want = torch_func_results(ref, x64, small_ref, small[1], w, u, tangents)
        for i, (a, e) in enumerate(zip(got, want, strict=True)):
            assert a.dtype == torch.float32, (name, i)
            assert rel_err(a, e, floor=1.0) <= 1e-4, (name, i, rel_err(a, e, 1.0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_backend_double_backward_in_half_precision(backend, dtype):
    """Gradients of gradients of half inputs run the composed attention in float32 and come
    back in the input dtype: relative RMS error ≤ 1e-2 against float64."""
    b, h, n, f, m = 1, 2, 45, 8, 5
    gen = torch.Generator().manual_seed(4)
    q, k = (torch.rand(b, h, n, f, generator=gen).to(dtype) for _ in "qk")
    v, w = (torch.randn(b, h, n, m, generator=gen).to(dtype) for _ in "vw")
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, :2] = False
    for name, fn, ref in _func_cases(backend, mask):
        results = []
        for xs in ([t.clone().requires_grad_() for t in (q, k, v)],
                   [t.double().requires_grad_() for t in (q, k, v)]):  # fmt: skip
            f_ = fn if xs[0].dtype == dtype else ref
            (dk,) = torch.autograd.grad(
                (f_(*xs) * w.to(xs[0].dtype)).sum(), xs[1], create_graph=True
            )
            results.append(torch.autograd.grad(dk.square().sum(), xs, materialize_grads=True))
        for got, want in zip(*results, strict=True):
            assert got.dtype == dtype and close_in_dtype(got, want, dtype), name


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_the_core_dispatches_to_the_backend_and_checks_for_it(backend, monkeypatch, causal):
    """``ks.linear_attention(backend="cuda")`` checks shapes, ``causal`` and ``eps`` and calls the
    backend's fused ``attention``, which checks the mask: the same bits as
    ``cuda_backend.linear_attention`` (which checks everything itself), and bad arguments are
    refused by name on both paths. ``ks.causal_dot_product`` likewise reaches the product."""
    import kernelstudy as ks
    from kernelstudy.core.backends import registered_backends

    registered = registered_backends()["cuda"]
    monkeypatch.setattr(registered, "available", lambda: True)
    monkeypatch.setattr(registered, "supports", lambda x: x.dtype in DTYPES)
    assert "cuda" in ks.backends()
    gen = torch.Generator().manual_seed(5)
    b, h, n, f, m = 2, 2, 70, 9, 6
    q, k = (torch.rand(b, h, n, f, generator=gen).to(torch.bfloat16) for _ in "qk")
    v = torch.randn(b, h, n, m, generator=gen).to(torch.bfloat16)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, n // 3 :] = False
    calls = []
    real = backend._attention
    monkeypatch.setattr(registered, "attention", lambda *a: calls.append(1) or real(*a))
    got = ks.linear_attention(q, k, v, causal=causal, key_padding_mask=mask, backend="cuda")
    assert calls == [1]
    want = backend.linear_attention(q, k, v, causal=causal, key_padding_mask=mask)
    assert torch.equal(got, want)
    ref = linear_attention_reference(q.double(), k.double(), v.double(), causal, mask)
    assert close_in_dtype(got, ref, torch.bfloat16)
    if causal:
        got = ks.causal_dot_product(q, k, v, backend="cuda")
        assert torch.equal(got, backend.causal_product(q, k, v))
    for fn in (
        lambda **kw: ks.linear_attention(q, k, v, causal=causal, backend="cuda", **kw),
        lambda **kw: backend.linear_attention(q, k, v, causal=causal, **kw),
    ):
        with pytest.raises(ValueError, match="key_padding_mask"):
            fn(key_padding_mask=mask[:, :-1])
        with pytest.raises(TypeError, match="key_padding_mask"):
            fn(key_padding_mask=mask.float())
        with pytest.raises(ValueError, match="eps"):
            fn(eps=0.0)
    with pytest.raises((ValueError, TypeError), match="causal"):
        ks.linear_attention(q, k, v, causal="yes", backend="cuda")
    with pytest.raises((ValueError, TypeError), match="causal"):
        backend.linear_attention(q, k, v, causal="yes")


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_torch_compile_traces_the_kernels_whole(backend, dtype):
    """``torch.compile(fullgraph=True)`` traces the cuda backend's Functions with the kernels as
    custom ops: the product, and causal and non-causal attention with key padding, give eager
    mode's outputs and gradients bit for bit, with each one's kernels (and no others) in the
    traced forward and backward graphs."""
    gen = torch.Generator().manual_seed(6)
    b, h, n, f, m = 2, 3, 37, 8, 5
    q, k = (torch.rand(b, h, n, f, generator=gen).to(dtype) for _ in "qk")
    v, g = (torch.randn(b, h, n, m, generator=gen).to(dtype) for _ in "vg")
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, 20:] = False
    for name, fn, _ in _func_cases(backend, mask):
        assert compiled_matches_eager(fn, (q, k, v), g) == CUDA_COMPILED_OPS[name], name


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_a_layer_under_autocast_compiles_whole_on_the_kernels(backend, monkeypatch, causal):
    """A kernel-attention layer on the cuda backend under bfloat16 autocast (on the CPU here, as
    the emulator runs), compiled whole: the kernels' custom ops in its graphs, and output and
    every parameter's gradient equal to eager mode's bit for bit."""
    import kernelstudy as ks
    from kernelstudy.core.backends import registered_backends

    registered = registered_backends()["cuda"]
    monkeypatch.setattr(registered, "available", lambda: True)
    monkeypatch.setattr(registered, "supports", lambda x: x.dtype in DTYPES)
    torch.manual_seed(8)
    layer = ks.nn.KernelAttention(32, 2, causal=causal, backend="cuda")
    x = torch.randn(2, 37, 32)
    nodes = []
    runs = (compiled_whole(layer, nodes), layer)
    results = outputs_and_grads(layer, runs, autocast_bf16("cpu", x), lambda out: out.float().sum())
    assert results[0][0].dtype == torch.bfloat16
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)
    names = {str(n.target).removeprefix("kernelstudy.").removesuffix(".default") for n in nodes}
    assert names == CUDA_COMPILED_OPS["causal" if causal else "full"]


class _OutputsCopied:
    """The emulated extension with its outputs copied out of their guard buffers, to storage
    offset 0 as torch allocates them (opcheck compares a fake output's offset with the real)."""

    def __init__(self, ext: EmulatedExtension):
        self._ext = ext

    def __getattr__(self, name: str):
        fn = getattr(self._ext, name)

        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                return out.clone()
            if isinstance(out, (tuple, list)):
                return type(out)(t.clone() if isinstance(t, torch.Tensor) else t for t in out)
            return out  # no tensors (walk_kernels' dict of kernel numbers)

        return call


def test_the_kernels_custom_ops_agree_with_their_fake_shapes(backend, ext, monkeypatch):
    """``torch.library.opcheck`` on the CUDA extension's functions as custom ops (schema, fake
    tensors against the kernels' real outputs, AOT dispatch, dynamic shapes) over their options,
    for each input dtype."""
    monkeypatch.setattr(backend, "extension", lambda: _OutputsCopied(ext))
    gen = torch.Generator().manual_seed(7)
    b, h, n, f, m = 2, 3, 21, 6, 4
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, 12:] = False
    for dtype in DTYPES:
        q, k = (torch.rand(b, h, n, f, generator=gen).to(dtype) for _ in "qk")
        v, g = (torch.randn(b, h, n, m, generator=gen).to(dtype) for _ in "vg")
        for op, args in cuda_custom_op_cases(q, k, v, g, mask):
            torch.library.opcheck(op, args)


def test_the_gpu_tests_run_on_the_emulator(tmp_path):
    """``tests/cuda_emulator/gpu_tests_on_emulator.py`` runs GPU tests without a GPU (in a child
    process: it makes ``torch.cuda.is_available()`` say True): the non-causal backward's kernels
    the half-precision cases of one shape of ``tests/test_cuda_backend.py`` and the recurrent
    state's blocks pass on the emulator, a test that needs CUDA itself is skipped with its reason,
    and the child leaves no folder where it links (this test's own folder: in the shared temp
    dir another run's child may be linking meanwhile)."""
    root = Path(__file__).resolve().parents[1]
    cases = (
        "full_backward_kernels and chunks or half_matches_reference and chunks and 2x3x37 "
        "or recurrent_blocks and chunks or registered_and_chosen and chunks"
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.cuda_emulator.gpu_tests_on_emulator",
         "-q", "-rs", "-p", "no:cacheprovider", "tests/test_cuda_backend.py", "-k", cases],
        capture_output=True, text=True, timeout=900, cwd=root,
        env={**os.environ, "KS_EMULATOR_LINK_DIR": str(tmp_path)},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "11 passed, 1 skipped" in run.stdout, run.stdout[-2000:]
    assert "needs CUDA itself: tells CPU from CUDA tensors" in run.stdout, run.stdout[-2000:]
    assert not list(tmp_path.glob("cuda_emulator*"))
