"""The ``cuda`` backend: the chunked tensor-core kernels of ``csrc/cuda``.

The extension is compiled with nvcc on first use (see :mod:`kernelstudy.core.extensions`) and
only where a CUDA device is visible; elsewhere :func:`is_available` returns False at once,
without trying to build. It takes CUDA tensors in float32, float16 and bfloat16 on GPUs of
compute capability 8.0 or newer (tensor cores through WMMA), accumulates in float32 and is
deterministic (no atomics; every sum in a fixed order).

Kernels (``csrc/cuda/linear_attention.cu`` documents tiles and precision and says which ``.cuh``
holds each kernel):

- causal product ``Σ_{j≤i} (q_i·k_j) v_j``: per-chunk states, a prefix over chunks, then
  per-chunk outputs, so one sequence (B·H = 1) at any N still fills the GPU; the backward
  pass recomputes with the same kernels, ``dq = causal(g, v, k)``,
  ``dk = anticausal(v, g, q)``, ``dv = anticausal(k, q, g)``, and keeps no per-step state
  (:data:`FUSED_BACKWARD` selects a fused backward instead, by default for every dtype: one
  pass over the chunks for all three, or with the walks one walk for dq and one for dk and dv,
  in bfloat16 with F, M ≤ 64 both in one grid as :data:`WALKS_TOGETHER` says); with
  :data:`CAUSAL_KERNEL` ``= "walk"`` (for F ≤ 128) each thread block instead walks a segment
  of chunks with the state in shared memory (one launch, no per-chunk state in global
  memory); ``"walk_mma"`` (the default) walks F ≤ 64 (bfloat16: F ≤ 128) on ``mma.sync``
  with each warp's operands in registers, and falls back to ``"walk"`` elsewhere (its
  backward where F or M > 64 as :data:`WIDE_BACKWARD` says: float16's on the chunk kernels);
- normalized attention (:func:`linear_attention`): the normalizer ``φq_i·Σ_{j≤i} φk_j`` comes
  out of the same kernel, so neither direction builds an ``O(N·F·M)`` tensor; non-causal
  attention reduces ``S = Σ_j φk_j v_jᵀ`` and ``z = Σ_j φk_j`` over unmasked keys, then reads
  ``φq_i·S / (φq_i·z + eps)``. Both backwards take ``g/d`` and ``-(g·out)/d`` from one pass
  (``normalized_grad``); the causal one adds its normalizer terms in the cumulative-sum kernel,
  the non-causal one runs on the same reduction and read-out as its forward.

Operands on the tensor cores: bfloat16 inputs run as bf16; float16 inputs as tf32, in which
every fp16 value is exact and the fp32 intermediates (scores, chunk states), which can outgrow
fp16's range, keep fp32's range; float32 inputs use 3xTF32 and keep float32 accuracy. The
normalized causal backward runs float16 in float32 (``g/d`` can outgrow fp16's range).

``torch.func`` transforms and gradients of gradients work through every Function: vmap folds
the mapped dimension into the batch; the causal product's jvp and higher derivatives are
products again; the normalized attention's are those of the same attention built from the
causal product (or matrix products) in float32, while its first-order backward stays fused.
Under ``torch.compile`` the kernels are custom ops (:mod:`.traced_kernels`), so a model compiles
whole (``fullgraph=True``), its backward fused as in eager mode.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shlex
import threading
import warnings
from collections.abc import Iterator
from types import ModuleType

import torch

from ..arguments import check_count, check_flag
from .backends import Backend, register_backend
from .chunked import chunked_product
from .traced_kernels import CUDA as TRACED_KERNELS
from .traced_kernels import CudaKernels as TracedKernels
from .transforms import (
    constant_when_traced,
    fold_mapped,
    jvp_filled,
    kernel_readable,
    legacy_batched,
    needs_input_grad,
    refuse_nested_forward,
    signature_once,
    traceable_apply,
    trilinear_jvp,
    unfold_mapped,
    vjp_of_needed,
)
from .validation import autocast_off, check_eps, check_key_padding_mask, check_qkv

#: What the Functions call the kernels on: the extension, or while torch.compile traces, its
#: functions as custom ops (:mod:`.traced_kernels`), with the same signatures
Kernels = ModuleType | TracedKernels

EXTENSION_NAME = "kernelstudy_cuda"
# The torch bindings, the entry points, and each input type's kernels in a translation unit of its
# own, which ninja compiles at once (nvcc on two cores: 18 s against 29 s for one unit of all).
SOURCES = ("binding.cpp", "linear_attention.cu", "float32.cu", "float16.cu", "bfloat16.cu")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_CAPABILITY = (8, 0)  # bf16 and tf32 tensor cores (Ampere and newer)
# nvcc flags added to the build's, as shell words: "-lineinfo" (Nsight Compute's source view),
# "-DKS_WMMA_GENERIC_LOADS" (kernels 1-7 load WMMA fragments by wmma::load_matrix_sync, as when
# they first passed on a GPU, in place of their own .shared loads), "-DKS_FP32_BF16X3" (fp32
# inputs' register walks on two bf16 parts of each operand, not 3xTF32's two tf32 parts). torch
# rebuilds the extension when they change.
CUDA_FLAGS_ENV = "KERNELSTUDY_CUDA_FLAGS"

# The fused backward (``ext.causal_backward``) replaces three separate causal products: with the
# chunk kernels, two state passes and one pass over the chunks for dq, dk and dv; with the walk,
# dq by one walk and dk, dv together by one reverse walk. True or False for every dtype, or the
# operand dtypes whose backward is fused. On an H200 (benchmarks/results/cuda_h200.md,
# 2026-11-30; B·H = 128, F = M = 64, N = 8192, walk_mma, GPU time of a fwd+bwd step) it saves
# 29 % in bfloat16 (775 against 1085 µs), 18 % in float32 (2854 against 3500) and 20 % in
# float16 (3490 against 4381), so it is on for every dtype. (With the WMMA walk of 2026-11-28 it
# cost 15-25 % in float32; kernel 9 turned that round. At F = M = 128, where kernel 9 does not
# apply, bfloat16's unfused backward was faster: 3020 against 3448 µs.)
FUSED_BACKWARD: bool | tuple[torch.dtype, ...] = True

# The causal kernels. "chunks": kernels 1-3 (csrc/cuda/chunk_kernels.cuh: every chunk's state
# written to global memory, then every chunk's output in parallel). "walk": kernel 6 (each thread
# block walks a segment of chunks with the state in shared memory; F <= 128, the chunk kernels
# elsewhere), for the forward and the backward products (see FUSED_BACKWARD). Both pass
# tests/test_cuda_backend.py on an H200; the walk is the faster at the shape (bfloat16
# fwd+bwd N = 8192: 2.49 ms against 2.63 ms; float32 N = 4096: 3.28 against 3.87 ms).
# "walk_mma": kernels 8 and 9 in place of kernels 6 and 7 for F <= 64 (kernel 8 for bfloat16: F <=
# 128) and, for kernel 9, M <= 64: mma.sync on operands in registers (bf16, or tf32 as kernel 6 uses
# it: 3xTF32 for float32, one tf32 product for float16), one barrier a chunk (in bfloat16 the fused
# backward's dq and dk, dv walks run as one grid, kernel 10, so that an SM walks two sequences at
# once at B·H near its SM count); kernels 6 and 7 elsewhere and where kernel 8's or 9's shared
# memory does not fit the device (137 and 170 KB with float32 tiles). On the H200 (2026-11-30) it
# passed the GPU tests and is the fastest in every dtype at F = M = 64 (fwd+bwd GPU time at
# N = 8192, fused: bfloat16 775 µs against the walk's 1513 and the chunks' 1898; float32 2854
# against 3657 and 3792; float16 3490 against 4060 and 3835), so it is the default.
# One of CAUSAL_KERNELS for every dtype, or a dict giving one for each operand dtype of DTYPES (as
# FUSED_BACKWARD may name dtypes: a kernel may win in bfloat16 and lose in float32).
CAUSAL_KERNELS = ("chunks", "walk", "walk_mma")
CAUSAL_KERNEL: str | dict[torch.dtype, str] = "walk_mma"
# The fused backward of a "walk_mma" product where its register kernels (9 and 10: F, M <= 64) do
# not apply, for each operand dtype of DTYPES: "products" (three products, each on the forward's
# kernels) or "chunks" (the chunk kernels' fused backward, kernels 4 and 5; the forward stays on
# the walk). From the H200's per-kernel GPU times (2026-11-30, B·H = 128, N = 8192,
# F = M = 128, cuda_h200_2026-11-30_profile.csv): float16's three products on the walk took
# 3 x 3734 = 11203 µs against the chunks' fused backward's 8886 (the walk reads float16 into
# float32 tiles through registers, and kernel 7 does not fit float32 tiles of F = M = 128), so a
# fwd+bwd step about 3734 + 8886 = 12620 against 14938; float32's products 3 x 2966 = 8897
# against 10037; bfloat16's, on kernel 8, 3 x 755 = 2265 against 4122.
WIDE_BACKWARD: dict[torch.dtype, str] = {
    torch.float32: "products",
    torch.float16: "chunks",
    torch.bfloat16: "products",
}
WIDE_BACKWARDS = ("products", "chunks")
# Thread blocks the walk aims for: a sequence is cut into segments (one extra pass over k and v
# gives their carries) until B·H·ceil(M/64)·segments reaches this; 1 never cuts it. 128 was the
# fastest of 128, 256, 512, 1024, 4096 and 16384 at B·H = 128 on the H200 (2026-11-30,
# walk_mma fused, fwd+bwd: bfloat16 N = 8192 0.997 ms against 1.265 at 512 and 3.34 at 16384;
# float32 N = 16384 6.07 ms against 7.05 at 1024), as for the walk on 2026-11-28.
# One count for every dtype, or a dict giving one for each operand dtype of DTYPES (as
# CAUSAL_KERNEL: the register walk in bfloat16 may want more segments than float32's walk).
WALK_BLOCKS: int | dict[torch.dtype, int] = 128

# Whether the walks' fused backward runs its dq walk and its dk, dv walk as one grid (kernel 10
# for "walk_mma", 11 for "walk", whose dk, dv walk then has one buffer) where an SM holds two of
# its blocks (bfloat16, F and M <= 64; an H100's shared memory, not an A100's), so that an SM
# walks two sequences at once even where B·H is near its SM count; else one launch after the
# other. The same bits either way; only the time differs: on the H200 (2026-11-30, bfloat16,
# N = 8192, B·H = 128, GPU time of a fwd+bwd step) kernel 10 775 µs against 888 apart.
WALKS_TOGETHER = True

# The kernel variants by name: (CAUSAL_KERNEL, FUSED_BACKWARD, WALKS_TOGETHER).
VARIANTS = {
    "chunks": ("chunks", False, True),
    "chunks_fused": ("chunks", True, True),
    "walk": ("walk", False, True),
    "walk_fused": ("walk", True, True),
    "walk_fused_apart": ("walk", True, False),
    "walk_mma": ("walk_mma", False, True),
    "walk_mma_fused": ("walk_mma", True, True),
    "walk_mma_fused_apart": ("walk_mma", True, False),
}


def use_variant(name: str, walk_blocks: int | None = None) -> None:
    """Selects one of :data:`VARIANTS` for the causal products that follow (forward and
    backward): sets :data:`CAUSAL_KERNEL`, :data:`FUSED_BACKWARD`, :data:`WALKS_TOGETHER` and,
    if given, :data:`WALK_BLOCKS` (for every dtype). The backward reads them when it runs."""
    global CAUSAL_KERNEL, FUSED_BACKWARD, WALKS_TOGETHER, WALK_BLOCKS
    if name not in VARIANTS:
        raise ValueError(f"variant must be one of {tuple(VARIANTS)}, got {name!r}")
    if walk_blocks is not None:
        WALK_BLOCKS = check_count("walk_blocks", walk_blocks, 1)
    CAUSAL_KERNEL, FUSED_BACKWARD, WALKS_TOGETHER = VARIANTS[name]


@contextlib.contextmanager
def settings_kept() -> Iterator[None]:
    """Restores :data:`CAUSAL_KERNEL`, :data:`FUSED_BACKWARD`, :data:`WALKS_TOGETHER`,
    :data:`WALK_BLOCKS` and :data:`WIDE_BACKWARD` (a copy: its entries too) on exit, so that a
    benchmark trying each variant (:func:`use_variant`) leaves the defaults as they were."""
    global CAUSAL_KERNEL, FUSED_BACKWARD, WALKS_TOGETHER, WALK_BLOCKS, WIDE_BACKWARD
    saved = CAUSAL_KERNEL, FUSED_BACKWARD, WALKS_TOGETHER, WALK_BLOCKS
    wide = dict(WIDE_BACKWARD) if isinstance(WIDE_BACKWARD, dict) else WIDE_BACKWARD
    try:
        yield
    finally:
        CAUSAL_KERNEL, FUSED_BACKWARD, WALKS_TOGETHER, WALK_BLOCKS = saved
        WIDE_BACKWARD = wide


_module: ModuleType | None = None
_tried = False
_lock = threading.Lock()  # a second thread waits for the first build, not sees None


def extra_cuda_flags() -> list[str]:
    """The nvcc flags of ``$KERNELSTUDY_CUDA_FLAGS`` (:data:`CUDA_FLAGS_ENV`), split as a shell
    would (``[]`` where it is unset or blank); ValueError for unbalanced quotes."""
    text = os.environ.get(CUDA_FLAGS_ENV, "")
    try:
        return shlex.split(text)
    except ValueError as err:
        raise ValueError(
            f"${CUDA_FLAGS_ENV} must be nvcc flags as shell words, got {text!r}: {err}"
        ) from None


def command_line(argv: list[str]) -> str:
    """``python`` and ``argv`` as one shell line, led by ``KERNELSTUDY_CUDA_FLAGS=...`` where
    that is set: the command a benchmark's results record, so that they say which build ran."""
    line = shlex.join(["python", *argv])  # quoted: an argument with a space stays one
    flags = os.environ.get(CUDA_FLAGS_ENV, "").strip()
    return f"{CUDA_FLAGS_ENV}={shlex.quote(flags)} {line}" if flags else line


def extension() -> ModuleType | None:
    """The compiled extension, built on first call; None without a CUDA device or if the build
    fails (:func:`kernelstudy.core.extensions.load_extension` then warns once)."""
    global _module, _tried
    if not torch.cuda.is_available():
        return None
    with _lock:
        if not _tried:
            from .extensions import csrc_dir, load_extension

            try:
                folder = csrc_dir() / "cuda"
            except FileNotFoundError as err:  # said once, as a failed build is
                _tried = True
                warnings.warn(f"{err}; falling back to the 'torch' backend", RuntimeWarning, 2)
                return None
            _module = load_extension(
                extension_name(),
                [folder / name for name in SOURCES],
                cuda=True,
                extra_cflags=["-O3"],
                extra_cuda_cflags=["-O3", *extra_cuda_flags()],
            )
            _tried = True  # only now: a build stopped by Ctrl-C is tried again on the next call
        return _module


def extension_name() -> str:
    """The build's name: :data:`EXTENSION_NAME` and a hash of torch (its version, commit and
    CUDA version), Python and the sources' folder
    (:func:`~kernelstudy.core.extensions.build_name`)."""
    from .extensions import build_name

    return build_name(EXTENSION_NAME, native=False)


@constant_when_traced  # torch.compile asks once, outside the graph
def is_available() -> bool:
    """True where the current CUDA device has compute capability ≥ :data:`MIN_CAPABILITY` and
    the extension builds (False at once without such a device: no build is tried)."""
    if not torch.cuda.is_available() or not _capable(torch.cuda.current_device()):
        return False
    return extension() is not None


def supports(x: torch.Tensor) -> bool:
    """CUDA tensors of float32/float16/bfloat16 on a GPU of compute capability ≥ 8.0."""
    if not (x.is_cuda and x.dtype in DTYPES):
        return False
    return _capable(x.device.index)


@constant_when_traced  # torch.compile asks once, outside the graph
def _capable(index: int | None) -> bool:
    """Whether device ``index`` has compute capability >= :data:`MIN_CAPABILITY`, looked up once a
    process: a call is checked four times a product (the backend's choice, then q, k and v), and
    torch's lookup is Python. A bool, not the capability: dynamo in torch 2.11 could not compare
    a constant tuple (``InternalTorchDynamoError`` in every compiled CUDA test, the H200,
    2026-11-30)."""
    return _capability_once(index) >= MIN_CAPABILITY


@functools.cache
def _capability_once(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _fused(dtype: torch.dtype) -> bool:
    """Whether the backward of a product on ``dtype`` operands is fused, by
    :data:`FUSED_BACKWARD`, checked: a string such as ``"False"`` is not read as True."""
    if isinstance(FUSED_BACKWARD, tuple):
        if not all(d in DTYPES for d in FUSED_BACKWARD):
            raise TypeError(
                "cuda_backend.FUSED_BACKWARD must be a bool or a tuple of dtypes from "
                f"{DTYPES}, got {FUSED_BACKWARD!r}"
            )
        return dtype in FUSED_BACKWARD
    return check_flag("cuda_backend.FUSED_BACKWARD", FUSED_BACKWARD)


def _use_fused(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the backward of a causal product of ``q`` (B,H,N,F) and ``v`` (B,H,N,M) runs
    fused: :data:`FUSED_BACKWARD` for q's dtype; with ``walk_mma`` where its register dk, dv walk
    (kernel 9, F and M <= 64) does not apply, as :data:`WIDE_BACKWARD` says (the WMMA fused
    backward, kernel 7, is not used there: the three products on kernel 8 were as fast or faster,
    the H200, 2026-11-30, N = 8192, F = M = 128: bfloat16 3020 against 3448 µs a step, float32
    and float16 within 0.3 %)."""
    if not _fused(q.dtype):
        return False
    return not _wide_walk_mma(q, v) or _wide_backward(q.dtype) == "chunks"


def _wide_walk_mma(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``walk_mma`` is chosen for q's dtype and its fused register backward (F, M <= 64)
    does not cover q (B,H,N,F) and v (B,H,N,M)."""
    return _causal_kernel(q.dtype) == "walk_mma" and max(q.shape[-1], v.shape[-1]) > 64


def _wide_backward(dtype: torch.dtype) -> str:
    """:data:`WIDE_BACKWARD` for operands of ``dtype``, checked."""
    chosen = WIDE_BACKWARD.get(dtype) if isinstance(WIDE_BACKWARD, dict) else None
    if chosen not in WIDE_BACKWARDS or set(WIDE_BACKWARD) != set(DTYPES):
        raise ValueError(
            f"cuda_backend.WIDE_BACKWARD must be a dict giving one of {WIDE_BACKWARDS} for each "
            f"of {[str(d) for d in DTYPES]}, got {WIDE_BACKWARD!r}"
        )
    return chosen


def _causal_kernel(dtype: torch.dtype) -> str:
    """:data:`CAUSAL_KERNEL` for operands of ``dtype`` (its entry where it is a dict), checked."""
    if isinstance(CAUSAL_KERNEL, str) and CAUSAL_KERNEL in CAUSAL_KERNELS:  # one for all dtypes
        return CAUSAL_KERNEL
    chosen = (
        CAUSAL_KERNEL if isinstance(CAUSAL_KERNEL, dict) else dict.fromkeys(DTYPES, CAUSAL_KERNEL)
    )
    if set(chosen) != set(DTYPES) or not all(
        isinstance(k, str) and k in CAUSAL_KERNELS for k in chosen.values()
    ):
        raise ValueError(
            f"cuda_backend.CAUSAL_KERNEL must be one of {CAUSAL_KERNELS}, or a dict giving one for "
            f"each of {[str(d) for d in DTYPES]}, got {CAUSAL_KERNEL!r}"
        )
    return chosen[dtype]


def walk_blocks(dtype: torch.dtype) -> int:
    """:data:`WALK_BLOCKS` for operands of ``dtype`` (its entry where it is a dict), checked."""
    if not isinstance(WALK_BLOCKS, dict):
        return check_count("cuda_backend.WALK_BLOCKS", WALK_BLOCKS, 1)
    if set(WALK_BLOCKS) != set(DTYPES):
        raise ValueError(
            "cuda_backend.WALK_BLOCKS must be an int >= 1, or a dict giving one for each of "
            f"{[str(d) for d in DTYPES]}, got {WALK_BLOCKS!r}"
        )
    return check_count(f"cuda_backend.WALK_BLOCKS[{dtype}]", WALK_BLOCKS[dtype], 1)


def _kernel_args(dtype: torch.dtype) -> dict[str, int | bool]:
    """The extension's ``walk_blocks`` (0: the chunk kernels) and ``mma_walk`` arguments for
    :data:`CAUSAL_KERNEL` on operands of ``dtype``."""
    kernel = _causal_kernel(dtype)
    if kernel == "chunks":
        return {"walk_blocks": 0, "mma_walk": False}
    return {"walk_blocks": walk_blocks(dtype), "mma_walk": kernel == "walk_mma"}


def _fused_backward(
    ext: Kernels, q, k, v, g, out_fp32: bool, dv_fp32: bool | None = None
) -> list[torch.Tensor]:
    """``[dq, dk, dv]`` of the causal product by :data:`CAUSAL_KERNEL`'s fused backward (its
    two walks in one grid as :data:`WALKS_TOGETHER` says; the chunk kernels' where
    :data:`WIDE_BACKWARD` says so for ``walk_mma``): dq and dk in float32 with
    ``out_fp32``, else in the operands' dtype; dv likewise with ``dv_fp32`` (None: as dq)."""
    together = check_flag("cuda_backend.WALKS_TOGETHER", WALKS_TOGETHER)
    if _wide_walk_mma(q, v) and _wide_backward(q.dtype) == "chunks":
        kernel = {"walk_blocks": 0, "mma_walk": False}
    else:
        kernel = _kernel_args(q.dtype)
    return ext.causal_backward(
        q,
        k,
        v,
        g,
        out_fp32=out_fp32,
        dv_fp32=dv_fp32,
        walks_together=together,
        **kernel,
    )


def _product(ext: Kernels, q, k, v, reverse: bool, out_fp32: bool) -> torch.Tensor:
    """The unnormalized causal (``reverse``: anti-causal) product by :data:`CAUSAL_KERNEL`."""
    args = _kernel_args(q.dtype)
    return ext.causal_product(q, k, v, reverse=reverse, out_fp32=out_fp32, **args)[0]


def _require() -> Kernels:
    """The extension, or while ``torch.compile`` traces its functions as custom ops."""
    if torch.compiler.is_compiling():
        return TRACED_KERNELS
    return extension_or_raise()


def extension_or_raise() -> ModuleType:
    """The extension; RuntimeError where it is not available."""
    module = extension()
    if module is None:
        raise RuntimeError("kernelstudy: the CUDA extension is not available on this machine")
    return module


# The kernels index within a 64-row tile in 32 bits (csrc/cuda load_tile): 64 · D < 2^31.
MAX_LAST_DIM = 2**24
# The state kernels take one 64 × 64 tile of the (F, M) state per grid row (gridDim.y, at most
# 65535; csrc/cuda/launch.cuh launch_tiles): ceil(F/64) · ceil((M+1)/64) of them, M+1 for the
# normalizer's column beside v (and the backward's [dnum | dden]).
MAX_STATE_TILES = 65535


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """CUDA tensors the kernels take, last dimensions below :data:`MAX_LAST_DIM` and a state
    of at most :data:`MAX_STATE_TILES` tiles: ValueError naming the tensor or F and M here,
    before the extension (whose launches failed as "invalid configuration argument")."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not supports(t):
            raise ValueError(
                "the cuda backend takes float32, float16 or bfloat16 CUDA tensors on a GPU of "
                f"compute capability >= 8.0, got {name} of {t.dtype} on {t.device}"
            )
        if t.dim() > 0 and t.shape[-1] >= MAX_LAST_DIM:
            raise ValueError(
                f"{name}'s last dimension must be below 2^24 for the cuda backend, got "
                f"{t.shape[-1]}"
            )
    f, m = q.shape[-1], v.shape[-1]
    tiles = -(-f // 64) * -(-(m + 1) // 64)
    if tiles > MAX_STATE_TILES:
        raise ValueError(
            f"F = {f} and M = {m} make a state of {tiles} tiles of 64 × 64 (M + 1 columns), "
            f"more than the cuda backend's {MAX_STATE_TILES}; use backend='torch'"
        )


# ---------------------------------------------------------------- unnormalized causal product
def _chunked_in_dtype(q, k, v, reverse: bool) -> torch.Tensor:
    """:func:`~.chunked.chunked_product` in the inputs' dtype, as :class:`_CausalProduct`
    gives it: the backward's product for gradients batched by torch's older vmap."""
    return chunked_product(q, k, v, reverse).to(q.dtype)


@signature_once
class _CausalProduct(torch.autograd.Function):
    """The causal (``reverse``: anti-causal) product on the kernels.

    The first-order backward is three products (or :data:`FUSED_BACKWARD`'s one pass); under
    ``create_graph=True`` or ``torch.func`` the three products are ``_CausalProduct`` again, so
    gradients of gradients work. The product is linear in each of q, k, v (a jvp of three
    products); vmap folds the mapped dimension into the batch.
    """

    @staticmethod
    def forward(q, k, v, reverse):  # type: ignore[override]
        # Written in the input dtype from the fp32 accumulators: no fp32 copy to cast afterwards.
        return _product(_require(), q, k, v, reverse=reverse, out_fp32=False)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[override]
        q, k, v, reverse = inputs
        ctx.save_for_backward(q, k, v)
        ctx.save_for_forward(q, k, v)
        ctx.reverse = reverse

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, k, v = ctx.saved_tensors
        need, rev = needs_input_grad(ctx), ctx.reverse
        with autocast_off(grad):  # backward() called inside an autocast region
            g = grad.to(q.dtype)
            if legacy_batched(g):  # autograd.grad(is_grads_batched=True): torch ops
                product = _chunked_in_dtype
            elif torch.is_grad_enabled() or not kernel_readable(g, q, k, v):
                # gradients of gradients, or torch.func's wrapped gradients: differentiable
                product = _CausalProduct.apply
            else:
                product = None  # the kernels, below
            if product is not None:
                dq = product(g, v, k, rev) if need[0] else None
                dk = product(v, g, q, not rev) if need[1] else None
                dv = product(k, q, g, not rev) if need[2] else None
                return dq, dk, dv, None
            ext = _require()
            if _use_fused(q, v) and not rev and all(need[:3]):
                return (*_fused_backward(ext, q, k, v, g, out_fp32=False), None)
            dq = dk = dv = None
            if need[0]:  # dq_i = Σ_{j≤i} (g_i·v_j) k_j
                dq = _product(ext, g, v, k, reverse=rev, out_fp32=False)
            if need[1]:  # dk_j = Σ_{i≥j} (v_j·g_i) q_i
                dk = _product(ext, v, g, q, reverse=not rev, out_fp32=False)
            if need[2]:  # dv_j = Σ_{i≥j} (k_j·q_i) g_i
                dv = _product(ext, k, q, g, reverse=not rev, out_fp32=False)
        return dq, dk, dv, None

    @staticmethod
    def jvp(ctx, dq, dk, dv, _reverse):  # type: ignore[override]
        refuse_nested_forward("the cuda backend")

        def product(q, k, v):
            return _CausalProduct.apply(q, k, v, ctx.reverse)

        return trilinear_jvp(product, ctx.saved_tensors, (dq, dk, dv))

    @staticmethod
    def vmap(info, in_dims, q, k, v, reverse):  # type: ignore[override]
        size = info.batch_size
        q, k, v = (fold_mapped(size, t, d) for t, d in zip((q, k, v), in_dims, strict=False))
        return unfold_mapped(size, _CausalProduct.apply(q, k, v, reverse)), 0


def causal_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``Σ_{j≤i} (q_i·k_j) v_j`` for CUDA ``q, k: (B,H,N,F)``, ``v: (B,H,N,M)``.

    Returns ``(B,H,N,M)`` in the input dtype, rounded once from the float32 accumulators (the
    backend contract allows this for a backend with a fused ``attention``); gradients come back
    in the input dtypes.
    """
    _check_inputs(q, k, v)
    return _apply_causal_product(q, k, v, False)


# ---------------------------------------------------------------- normalized attention
def _keep(mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask is None else mask[:, None, :, None]


def _masked(x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    return (
        x if keep is None else torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))
    )


def _composed_attention(q, k, v, mask, eps, causal: bool, torch_ops: bool = False) -> torch.Tensor:
    """The normalized attention from differentiable pieces in float32: the causal product
    (:class:`_CausalProduct`, with a column of ones beside v for the normalizer; with
    ``torch_ops``, :func:`~.chunked.chunked_product`) or matrix products. The fused Functions
    differentiate it for forward mode, for gradients of gradients and for torch.func's or
    batched gradients; their plain first-order backward does not use it."""
    keep = _keep(mask)
    q, k, v = q.float(), _masked(k.float(), keep), _masked(v.float(), keep)
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # (B,H,S,M+1): [num | den]
    if causal:
        both = chunked_product(q, k, v1) if torch_ops else _CausalProduct.apply(q, k, v1, False)
    else:
        both = q @ (k.transpose(-1, -2) @ v1)
    return both[..., :-1] / (both[..., -1:] + eps)


class _FusedAttention(torch.autograd.Function):
    """What the normalized Functions share: the forward returns ``(out, den, *rest)`` with
    everything after ``out`` non-differentiable (the first-order backward reads it). Gradients
    of gradients and forward mode differentiate :func:`_composed_attention`; vmap folds the
    mapped dimension into the batch."""

    causal = False

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[override]
        q, k, v, mask, eps = inputs
        ctx.mark_non_differentiable(*output[1:])
        ctx.save_for_backward(q, k, v, mask, *output)
        ctx.save_for_forward(q, k, v, mask)
        ctx.eps, ctx.outputs = eps, len(output)

    @classmethod
    def _composed(cls, ctx, torch_ops: bool = False):
        """:func:`_composed_attention` of q, k, v with this call's mask and eps, in q's dtype."""
        mask, dtype = ctx.saved_tensors[3], ctx.saved_tensors[0].dtype

        def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return _composed_attention(q, k, v, mask, ctx.eps, cls.causal, torch_ops).to(dtype)

        return fn

    @classmethod
    def _composed_vjp(cls, ctx, grad):
        """Gradients through :func:`_composed_attention`, differentiable themselves (in torch
        ops for gradients batched by torch's older vmap, which the kernels cannot read)."""
        composed = cls._composed(ctx, torch_ops=legacy_batched(grad))
        grads = vjp_of_needed(composed, ctx.saved_tensors[:3], needs_input_grad(ctx)[:3], grad)
        return (*grads, None, None)

    @classmethod
    def jvp(cls, ctx, dq, dk, dv, _mask, _eps):  # type: ignore[override]
        refuse_nested_forward("the cuda backend")
        inputs = ctx.saved_tensors[:3]
        with autocast_off(inputs[0]):
            tangent = jvp_filled(cls._composed(ctx), inputs, (dq, dk, dv))
        return (tangent, *(None,) * (ctx.outputs - 1))

    @classmethod
    def vmap(cls, info, in_dims, q, k, v, mask, eps):  # type: ignore[override]
        size = info.batch_size
        folded = (fold_mapped(size, t, d) for t, d in zip((q, k, v, mask), in_dims, strict=False))
        outputs = cls.apply(*folded, eps)
        return tuple(unfold_mapped(size, t) for t in outputs), (0,) * len(outputs)


@signature_once
class _CausalAttention(_FusedAttention):
    """Causal ``out_i = num_i / (den_i + eps)``.

    ``num_i = Σ_{j≤i} (q_i·k_j) v_j`` and ``den_i = Σ_{j≤i} q_i·k_j`` come from one kernel.

    Backward, with ``d = den + eps``, ``dnum = g / d``, ``dden = -(g·out) / d``:
    ``dq = causal(dnum, v, k) + dden·cumsum(k)``, ``dk = anticausal(v, dnum, q) +
    revcumsum(dden·q)``, ``dv = anticausal(k, q, dnum)``. ``dnum`` and ``dden`` come from one
    pass over g and out (``ext.normalized_grad``); the cumulative sums run in the deterministic
    kernel (``torch.cumsum`` is not deterministic on CUDA), which adds the products' float32 dq
    and dk and writes the sums in the inputs' dtype; dv comes out of the kernels in the
    operands' dtype. No (B,H,N,M) pass runs in torch (float16 inputs: dv's cast, since their
    products run in float32).
    """

    causal = True

    @staticmethod
    def forward(q, k, v, mask, eps):  # type: ignore[override]
        keep = _keep(mask)
        k, v = _masked(k, keep), _masked(v, keep)
        out, den = _require().causal_product(
            q,
            k,
            v,
            reverse=False,
            out_fp32=False,
            with_den=True,
            normalize=True,
            eps=eps,
            **_kernel_args(q.dtype),
        )
        return out, den

    @staticmethod
    def backward(ctx, grad, _den_grad):  # type: ignore[override]
        with autocast_off(grad):  # backward() called inside an autocast region
            saved = ctx.saved_tensors  # unpacked once (a cost on every backward)
            if torch.is_grad_enabled() or not kernel_readable(grad, *saved):
                return _CausalAttention._composed_vjp(ctx, grad)
            q, k, v, mask, out, den = saved
            keep = _keep(mask)
            k, v = _masked(k, keep), _masked(v, keep)
            ext = _require()
            dtype = q.dtype
            # dnum = g/d in the products' operand dtype and dden = -(g·out)/d: one kernel, one
            # pass over g and out
            dnum, dden = ext.normalized_grad(grad.to(dtype), out, den, ctx.eps)
            q_in, k_in = q, k  # the cumulative sums read them in the inputs' dtype
            if dtype == torch.float16:  # dnum = g/d passes 65504 where d ~ eps (a row with no
                # real key): inf, then inf·0 = NaN. The products run in float32 (3xTF32) instead.
                q, k, v = q.float(), k.float(), v.float()
            if _use_fused(q, v):  # dq, dk in float32 for the sums below; dv rounded once
                dq, dk, dv = _fused_backward(ext, q, k, v, dnum, out_fp32=True, dv_fp32=False)
            else:
                dq = _product(ext, dnum, v, k, reverse=False, out_fp32=True)
                dk = _product(ext, v, dnum, q, reverse=True, out_fp32=True)
                # dv is the product alone: rounded once to the operands' dtype in the kernel
                dv = _product(ext, k, q, dnum, reverse=True, out_fp32=False)
            # the products' float32 dq and dk plus the cumulative sums, rounded once to the
            # inputs' dtype in the sums' last pass
            dq = ext.scaled_cumsum(k_in, None, dden, reverse=False, base=dq, out_fp32=False)
            dk = ext.scaled_cumsum(q_in, dden, None, reverse=True, base=dk, out_fp32=False)
        return dq, _masked(dk, keep), _masked(dv.to(dtype), keep), None, None


@signature_once
class _FullAttention(_FusedAttention):
    """Non-causal ``out_i = φq_i·S / (φq_i·z + eps)``.

    ``S = Σ_j keep_j k_j v_jᵀ`` and ``z = Σ_j keep_j k_j`` are reduced in a fixed order.

    The backward runs on the forward's kernels, with ``dnum = g / d``, ``dden = -(g·out) / d``
    side by side (one pass, ``ext.normalized_grad``): ``dq = [dnum | dden]·[Sᵀ ; zᵀ]`` (the
    read-out), ``[dS | dz] = Σ_i q_i [dnum_i | dden_i]ᵀ`` (the reduction), ``dk_j = keep_j
    (v_j·dSᵀ + dz)`` and ``dv_j = keep_j k_j·dS`` (read-outs, dz as their bias and the padded
    rows zeroed in the kernel). The kernels read the inputs in their dtype and write the
    gradients in it: no (B,H,N,·) pass runs in torch.
    """

    @staticmethod
    def forward(q, k, v, mask, eps):  # type: ignore[override]
        ext = _require()
        state = ext.full_state(k, v, mask)
        out, den = ext.full_apply(
            q, state, v.shape[-1], out_fp32=False, with_den=True, normalize=True, eps=eps
        )
        return out, den, state

    @staticmethod
    def backward(ctx, grad, _den_grad, _state_grad):  # type: ignore[override]
        with autocast_off(grad):  # backward() called inside an autocast region
            saved = ctx.saved_tensors  # unpacked once (a cost on every backward)
            if torch.is_grad_enabled() or not kernel_readable(grad, *saved):
                return _FullAttention._composed_vjp(ctx, grad)
            q, k, v, mask, out, den, state = saved
            b, h, _, f = q.shape
            m = v.shape[-1]
            ext = _require()
            dtype = q.dtype
            # [g/d | -(g·out)/d] (B,H,N,M+1) in float32: dq's two terms nearly cancel, so dq
            # and [dS | dz] run on float32 operands (3xTF32, q converted as the reduction loads
            # it; in bf16 operands dq's relative RMS error doubled to 7.6e-3 in the emulator)
            dnum1 = ext.normalized_grad(
                grad.to(dtype), out, den, ctx.eps, dden_column=True, dnum_fp32=True
            )[0]
            s = state[..., : f * m].reshape(b, h, f, m)
            z = state[..., f * m :].unsqueeze(-2)  # (B,H,1,F)
            dq = _read_out(ext, dnum1, torch.cat([s.transpose(-1, -2), z], dim=-2), dtype)
            dsz = ext.full_state(q, dnum1)[..., : f * (m + 1)].reshape(b, h, f, m + 1)
            ds = dsz[..., :m]
            dk = _read_out(ext, v, ds.transpose(-1, -2), dtype, bias=dsz[..., m], mask=mask)
            dv = _read_out(ext, k, ds, dtype, mask=mask)
        return dq, dk, dv, None, None


_apply_causal_product = traceable_apply(_CausalProduct)
_apply_causal_attention = traceable_apply(_CausalAttention)
_apply_full_attention = traceable_apply(_FullAttention)


def _read_out(
    ext: Kernels,
    x: torch.Tensor,
    mat: torch.Tensor,
    dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x·mat (+ bias)`` in ``dtype`` for ``x: (B,H,N,F')`` (in ``dtype``, or float32) and a
    float32 ``mat: (B,H,F',M')``, by the non-causal read-out kernel (``mat`` as its state, with a
    zero normalizer part); ``bias: (B,H,M')`` float32, rows of padded keys (``mask`` False)
    zero."""
    b, h, rows, cols = mat.shape
    state = torch.cat([mat.reshape(b, h, rows * cols), mat.new_zeros(b, h, rows)], dim=-1)
    return ext.full_apply(
        x, state, cols, out_fp32=False, bias=bias, key_padding_mask=mask, out_dtype=dtype
    )[0]


def linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Normalized linear attention on CUDA features, as :func:`kernelstudy.linear_attention`.

    ``phi_q: (B,H,N,F)``, ``phi_k: (B,H,S,F)``, ``v: (B,H,S,M)`` → ``(B,H,N,M)`` in the input
    dtype; the normalizer is computed with the numerator (no ``O(N·F·M)`` tensor, no
    ``torch.cumsum``), padded keys contribute nothing.
    """
    causal = check_qkv(phi_q, phi_k, v, causal=causal)
    eps = check_eps(eps, phi_q.dtype)
    return _attention(phi_q, phi_k, v, causal, key_padding_mask, eps)


def _attention(phi_q, phi_k, v, causal: bool, key_padding_mask, eps: float) -> torch.Tensor:
    """:func:`linear_attention` on shapes, ``causal`` and ``eps`` that the caller has checked
    (``ks.linear_attention`` does, then calls this as the backend's ``attention``): the tensors'
    device and dtype and the mask are checked here."""
    _check_inputs(phi_q, phi_k, v)
    mask = None
    if key_padding_mask is not None:
        mask = check_key_padding_mask(
            key_padding_mask, phi_k.shape[0], phi_k.shape[2], phi_k.device
        ).contiguous()
    fn = _apply_causal_attention if causal else _apply_full_attention
    return fn(phi_q, phi_k, v, mask, eps)[0]


register_backend(
    Backend(
        "cuda",
        causal_product,
        available=is_available,
        supports=supports,
        priority=30,
        attention=_attention,
        description="chunked CUDA kernels on tensor cores (fp32/fp16/bf16, fp32 accumulation)",
    )
)
