"""Benchmark the CUDA linear-attention core on a GPU: time and memory vs N against baselines.

Causal attention, forward and forward+backward, median of CUDA-event timings after a
warm-up, for every N, (B, H), F = M = D and dtype, and the peak GPU memory of one call above
what is allocated before it (the inputs), as ``benchmarks/core.py`` measures it: column
``peak_mib``, ``torch.cuda.max_memory_allocated`` around one more call after the timed ones,
so the timings carry no reset of the statistics. Methods (a column is skipped when its
package or kernel is missing, and a cell is left empty when it runs out of memory):

- ``cuda``   this project's CUDA backend, ``ks.causal_dot_product(..., backend="cuda")``, with
             the chunk kernels and the three-product backward (``cuda_backend`` variant
             ``chunks``; the backend's defaults are the walk's, see ``cuda_walk_fused``);
- ``cuda_fused``  the same with the fused backward (``cuda_backend.FUSED_BACKWARD``): one
             pass for dq, dk and dv instead of three causal products (same forward);
- ``cuda_walk``  the same with the walk kernel (``cuda_backend.CAUSAL_KERNEL = "walk"``: each
             thread block walks a segment of chunks with the state on chip), forward and the
             three backward products; ``--walk-blocks`` sweeps ``cuda_backend.WALK_BLOCKS``
             (columns ``cuda_walk_<blocks>`` when more than one value is given);
- ``cuda_walk_fused``  the walk with its fused backward (dq by one walk, dk and dv together by
             one reverse walk, in bf16 with F, M <= 64 both in one grid where an SM holds two
             blocks: ``cuda_backend.WALKS_TOGETHER``; same forward as ``cuda_walk``): the
             backend's default in bf16 and fp16 (in fp32 its default is ``cuda_walk``);
- ``cuda_walk_mma``, ``cuda_walk_mma_fused``  the same two with ``CAUSAL_KERNEL = "walk_mma"``:
             F <= 64 (bf16: F <= 128) walks by kernel 8 (mma.sync, operands in registers;
             bf16, or tf32 as ``cuda_walk``: 3xTF32 for fp32), every other case as
             ``cuda_walk``;
- ``cuda_walk_fused_apart``, ``cuda_walk_mma_fused_apart``  the two fused walks with their
             backward's walks as two launches (``WALKS_TOGETHER = False``): the A/B of
             kernels 11 and 10 (the same kernels as their twins where those do not apply:
             fp16, fp32, F or M above 64);
- ``torch``  this project's chunked PyTorch backend on the same GPU;
- ``fla``    flash-linear-attention's ``chunk_linear_attn`` (``normalize=False``, scale 1:
             the same unnormalized causal product), inputs made in its (B, N, H, D) layout;
- ``sdpa``   softmax attention through ``torch.nn.functional.scaled_dot_product_attention``
             restricted to the flash backend (fp16/bf16 only; the memory-efficient backend
             for fp32, reported as ``sdpa_efficient``), head dimension D = F.

FLOPs counted as in ``benchmarks/core.py``: 4·B·H·N·F·M for a causal linear-attention
forward, 3× that with the backward; softmax 2·B·H·N²·D causal forward, 3× with backward
(flash's recomputed scores not counted; CSVs written before 2026-11-24 used 2.5×, so their
sdpa TFLOP/s are 5/6 of this convention's; their times are unaffected).
Achieved rates are also given against the GPU's measured dense matmul rate (8192³) of the
same dtype, measured in the same run.

    python benchmarks/cuda_core.py --quick                      # a minute: smoke run
    python benchmarks/cuda_core.py --out benchmarks/results/cuda_h100.csv

The CSV records the device, date, versions and command; a seaborn plot of time and peak
memory vs N is written beside it (same name, ``.png``; not with ``--no-plot``). The CSV is
rewritten (atomically) after every case, so a run killed at a time limit keeps what it measured.
A case that breaks the CUDA context (an illegal address: every later CUDA call fails) stops the
run; what ran before it is written and the exit status is 1. ``--resume`` keeps the rows already
in ``--out`` and measures only the cases they lack (a later call of a GPU session goes on where
the last one stopped). ``--from-csv`` needs no GPU: it joins CSVs of earlier runs (a later row
of the same case wins), writes them to ``--out`` with the plot and prints the tables and the
issue's target ratios:

    python benchmarks/cuda_core.py --from-csv targets.csv sweep.csv \
        --out benchmarks/results/cuda_h200.csv
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import inspect
import itertools
import math
import statistics
import sys
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from pathlib import Path

import pandas as pd
import torch

import kernelstudy as ks
from kernelstudy.arguments import expanded_path
from kernelstudy.core import cuda_backend
from kernelstudy.files import atomic_write, atomic_write_text, output_file_problem
from kernelstudy.progress import run_script

DEFAULT_N = [512, 1024, 2048, 4096, 8192, 16384, 32768]
METHODS = ["cuda", "cuda_fused", "cuda_walk", "cuda_walk_fused", "cuda_walk_fused_apart"]
METHODS += ["cuda_walk_mma", "cuda_walk_mma_fused", "cuda_walk_mma_fused_apart"]
METHODS += ["torch", "fla", "sdpa"]
# this project's CUDA methods and their cuda_backend.VARIANTS
CUDA_METHODS = {
    "cuda": "chunks",
    "cuda_fused": "chunks_fused",
    "cuda_walk": "walk",
    "cuda_walk_fused": "walk_fused",
    "cuda_walk_fused_apart": "walk_fused_apart",
    "cuda_walk_mma": "walk_mma",
    "cuda_walk_mma_fused": "walk_mma_fused",
    "cuda_walk_mma_fused_apart": "walk_mma_fused_apart",
}
WALK_METHODS = tuple(m for m, variant in CUDA_METHODS.items() if variant.startswith("walk"))
# where the cases' tensors live: "cuda" (the tests run the pipeline on "cpu" with a fake timer)
DEVICE = "cuda"


class ContextLost(RuntimeError):
    """A case left the CUDA context broken (an illegal address is sticky: every later CUDA call
    fails), so no later case can be measured in this process. ``row`` is that case's row."""

    def __init__(self, row: dict):
        super().__init__(row["error"])
        self.row = row


def cuda_time_ms(fn: Callable[[], object], repeats: int, warmup: int) -> float:
    """Median time of ``fn()`` in milliseconds, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def stream_time_ms(fn: Callable[[], object], steps: int, repeats: int = 3) -> tuple[float, float]:
    """``steps`` calls of ``fn()`` back to back between one pair of CUDA events, ``repeats``
    times: the median per call of the GPU's time (events) and of the host's time to issue the
    calls (``time.perf_counter``, before synchronizing), in ms. With calls queued the GPU waits
    for the host only where issuing a call takes longer than running it; :func:`cuda_time_ms`
    (one call between synchronizations) also counts the host's time before its first kernel."""
    gpu, host = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        host.append((time.perf_counter() - began) * 1e3 / steps)
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) / steps)
    return statistics.median(gpu), statistics.median(host)


def peak_memory_mib(call: Callable[[], object], inputs) -> float:
    """Peak GPU memory in MiB that one call of ``call`` allocates above what is allocated
    before it (the inputs; the upstream gradient of ``with_backward``), measured by
    ``ks.analysis.peak_memory_bytes``. For a call of its own, after the timed ones. Gradients
    the timed calls left in ``.grad`` are dropped first: the call drops them itself
    (``with_backward``), and inside the measurement that lowered the peak by their size."""
    for t in inputs:
        t.grad = None
    return ks.analysis.peak_memory_bytes(call, "cuda") / 2**20


def matmul_tflops(dtype: torch.dtype, size: int = 8192, repeats: int = 10) -> float:
    """Dense matmul rate of this GPU in TFLOP/s for ``dtype`` (fp32 without TF32, whatever the
    process's setting: an import that turned TF32 on would make the fp32 yardstick ~7x high)."""
    a = torch.randn(size, size, device=DEVICE, dtype=dtype)
    b = torch.randn(size, size, device=DEVICE, dtype=dtype)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        ms = cuda_time_ms(lambda: a @ b, repeats, warmup=3)
    finally:
        torch.set_float32_matmul_precision(precision)
    return 2 * size**3 / (ms * 1e-3) / 1e12


def load_fla() -> Callable | None:
    """flash-linear-attention's chunked linear attention, or None if it is not importable (the
    reason, e.g. a dependency missing beside wheels installed with --no-deps, goes to stderr)."""
    reasons = []
    for module, name in (
        ("fla.ops.linear_attn", "chunk_linear_attn"),
        ("fla.ops.linear_attn.chunk", "chunk_linear_attn"),
    ):
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as err:
            reasons.append(f"{module}.{name}: {type(err).__name__}: {err}")
    print("\n".join(reasons), file=sys.stderr)
    return None


def takes_head_first(fn: Callable) -> bool:
    """Whether ``fn`` has a ``head_first`` argument (older fla releases, where it defaults to
    True: (B, H, N, D) inputs; without it, fla reads (B, N, H, D))."""
    try:
        return "head_first" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def package_version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return ""


def _sdpa_backend(dtype: torch.dtype):
    from torch.nn.attention import SDPBackend

    if dtype in (torch.float16, torch.bfloat16):
        return "sdpa", SDPBackend.FLASH_ATTENTION
    return "sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION


def make_case(
    method: str,
    b: int,
    h: int,
    n: int,
    d: int,
    dtype: torch.dtype,
    fla_fn,
    walk_blocks: int | None = None,
):
    """(label, fn, inputs) for one method: fn() runs the causal forward and returns the output
    (``walk_blocks``: the backend's ``WALK_BLOCKS`` for a walk method; None keeps it)."""
    gen = torch.Generator(device=DEVICE).manual_seed(n)

    def rand(*shape, positive=False):
        x = torch.rand(*shape, device=DEVICE, generator=gen, dtype=torch.float32)
        return (x if positive else 2 * x - 1).to(dtype)

    if method in (*CUDA_METHODS, "torch"):
        q, k, v = rand(b, h, n, d, positive=True), rand(b, h, n, d, positive=True), rand(b, h, n, d)
        backend = "torch" if method == "torch" else "cuda"

        def run():
            if method in CUDA_METHODS:  # read by the backward that follows (cases run in turn)
                cuda_backend.use_variant(CUDA_METHODS[method], walk_blocks)
            return ks.causal_dot_product(q, k, v, backend=backend)

        return method, run, (q, k, v)
    if method == "fla":  # (B, N, H, D): fla's layout; releases before 0.3 take head_first
        q, k, v = rand(b, n, h, d, positive=True), rand(b, n, h, d, positive=True), rand(b, n, h, d)
        layout = {"head_first": False} if takes_head_first(fla_fn) else {}
        return (
            "fla",
            lambda: fla_fn(q, k, v, scale=1.0, normalize=False, **layout)[0],
            (q, k, v),
        )
    if method == "sdpa":
        from torch.nn.attention import sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        label, backend = _sdpa_backend(dtype)
        q, k, v = rand(b, h, n, d), rand(b, h, n, d), rand(b, h, n, d)

        def run():
            with sdpa_kernel([backend]):
                return scaled_dot_product_attention(q, k, v, is_causal=True)

        return label, run, (q, k, v)
    raise ValueError(f"unknown method {method!r}")


def with_backward(fn: Callable[[], torch.Tensor], inputs) -> Callable[[], None]:
    grad: list[torch.Tensor] = []

    def run() -> None:
        for t in inputs:
            t.grad = None
        out = fn()
        if not grad:
            grad.append(torch.randn_like(out))
        out.backward(grad[0])

    return run


def flops(method: str, mode: str, b: int, h: int, n: int, d: int) -> float:
    if method.startswith("sdpa"):
        fwd = 2 * b * h * n * n * d
        return fwd * (3 if mode == "fwd+bwd" else 1)
    fwd = 4 * b * h * n * d * d
    return fwd * (3 if mode == "fwd+bwd" else 1)


# the columns that name a case: a row of a CSV per case and key
CASE = ["method", "mode", "dtype", "B", "H", "N", "F"]


def row_label(method: str, dtype_name: str, blocks: int | None, several_blocks: bool) -> str:
    """The ``method`` a case's row will carry: sdpa's by the backend it runs for the dtype, a
    walk method's with its WALK_BLOCKS when several are swept."""
    if method == "sdpa":
        return _sdpa_backend(getattr(torch, dtype_name))[0]
    if method in WALK_METHODS and several_blocks:
        return f"{method}_{blocks}"
    return method


def walk_parts(method: str, walk_blocks: object = None) -> tuple[str, int]:
    """A row's method without its WALK_BLOCKS suffix, and the blocks of a walk method (from
    the ``walk_blocks`` column, else the suffix; 0 where neither says, and for other
    methods): ``cuda_walk_128`` and ``cuda_walk`` at 128 are one case."""
    blocks = 0 if walk_blocks is None or pd.isna(walk_blocks) else int(walk_blocks)
    base, _, suffix = method.rpartition("_")
    if base in WALK_METHODS and suffix.isdigit():
        return base, blocks or int(suffix)
    return method, blocks if method in WALK_METHODS else 0


def case_key(method: str, walk_blocks: object, mode: str, dtype: str, *sizes: int) -> tuple:
    """The key of a case (``sizes``: B, H, N, F), whatever its row's label says."""
    return (*walk_parts(str(method), walk_blocks), str(mode), str(dtype), *map(int, sizes))


def _row_walk_parts(frame: pd.DataFrame) -> list[tuple[str, int]]:
    """:func:`walk_parts` of each row of a CSV's frame (with or without ``walk_blocks``)."""
    blocks = frame["walk_blocks"] if "walk_blocks" in frame.columns else [None] * len(frame)
    return [walk_parts(str(m), w) for m, w in zip(frame["method"], blocks, strict=True)]


def row_keys(frame: pd.DataFrame) -> list[tuple]:
    """The :func:`case_key` of each row of a CSV's frame, in order."""
    sizes = frame[CASE[1:]].itertuples(index=False)
    return [
        (*parts, str(mode), str(dt_), int(b), int(h), int(n), int(f))
        for parts, (mode, dt_, b, h, n, f) in zip(_row_walk_parts(frame), sizes, strict=True)
    ]


def case_keys(frame: pd.DataFrame) -> set[tuple]:
    """The cases of a CSV's frame as :func:`case_key` keys (what ``--resume`` skips)."""
    return set() if frame.empty else set(row_keys(frame))


def benchmark(
    args: argparse.Namespace,
    progress: Callable[[pd.DataFrame], None] | None = None,
    done: AbstractSet[tuple] = frozenset(),
) -> tuple[pd.DataFrame, str]:
    """Every case, as a frame (empty when every method asked for was skipped), and why the run
    stopped early ("" when it did not). ``progress(frame)`` gets the rows so far after each
    case, so a run killed at a time limit leaves what it measured. Cases whose key
    (:func:`case_keys`) is in ``done`` are not measured."""
    fla_fn = load_fla() if "fla" in args.methods else None
    if "fla" in args.methods and fla_fn is None:
        print("flash-linear-attention is not importable: skipping the fla column", file=sys.stderr)
    ours = [m for m in args.methods if m in CUDA_METHODS]
    if ours and "cuda" not in ks.backends():
        print(
            f"the kernelstudy cuda backend did not build: skipping {', '.join(ours)}",
            file=sys.stderr,
        )
    rates = {}
    for name in args.dtypes:
        dtype = getattr(torch, name)
        rates[name] = matmul_tflops(dtype)
        print(f"{name} matmul: {rates[name]:.1f} TFLOP/s", file=sys.stderr)
    about: dict[str, str] = {}  # filled with the first row
    rows: list[dict] = []
    several = len(args.walk_blocks or ()) > 1  # walk rows labelled with their WALK_BLOCKS
    # the backend's WALK_BLOCKS for each dtype, read before any case sets it (use_variant)
    default_blocks = {
        name: [cuda_backend.walk_blocks(getattr(torch, name))] for name in args.dtypes
    }

    def record(row: dict, walk: bool, blocks: int) -> None:
        if not about:
            about.update(provenance())
        if walk and several:
            row["method"] = f"{row['method']}_{blocks}"
        rows.append(row)
        if progress is not None:
            progress(table(rows, rates, about))

    try:
        for name, (b, h), d, n, method, mode in itertools.product(
            args.dtypes, args.shapes, args.dims, args.n, args.methods, args.modes
        ):
            if method == "fla" and fla_fn is None:
                continue
            if method.startswith("cuda") and "cuda" not in ks.backends():
                continue
            if method.endswith("_fused") and mode == "fwd":
                continue  # the forward is that of the unfused method
            walk = method in WALK_METHODS
            dtype = getattr(torch, name)
            # a walk at each --walk-blocks (default: the backend's for the dtype); others at none
            for blocks in (args.walk_blocks or default_blocks[name]) if walk else [None]:
                label = row_label(method, name, blocks, several)
                if case_key(label, blocks, mode, name, b, h, n, d) in done:
                    continue
                try:
                    row = measure(method, mode, b, h, n, d, name, dtype, fla_fn, args, blocks)
                except ContextLost as lost:
                    record(lost.row, walk, blocks)
                    raise
                record(row, walk, blocks)
    except ContextLost as lost:
        row = lost.row
        stopped = (
            f"the CUDA context broke in {row['method']} {row['mode']} {row['dtype']} "
            f"B={row['B']} H={row['H']} N={row['N']} D={row['F']} ({row['error']}); no later "
            "case could run in this process, so the run stopped there. Run the other methods "
            "without it (--methods) to measure them."
        )
        return table(rows, rates, about), stopped
    return table(rows, rates, about), ""


def provenance() -> dict[str, str]:
    """The columns that say where and with what a run was measured (the same on every row)."""
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": package_version("triton"),
        "fla": package_version("fla-core") or package_version("flash-linear-attention"),
        "kernelstudy": ks.__version__,
        "command": cuda_backend.command_line(sys.argv),
    }


def table(rows: list[dict], rates: dict[str, float], about: dict[str, str]) -> pd.DataFrame:
    """The CSV's frame: one row per case, with the matmul yardstick and ``about`` the run."""
    if not rows:  # every method asked for was skipped: the caller reports it
        return pd.DataFrame()
    frame = pd.DataFrame(rows)
    frame["matmul_tflops"] = frame["dtype"].map(rates)
    frame["frac_matmul"] = frame["tflops"] / frame["matmul_tflops"]
    return frame.assign(**about)


def context_alive() -> bool:
    """Whether CUDA still runs work in this process (after an illegal address it never does)."""
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device=DEVICE).add_(1).item() == 2
    except Exception:
        return False


def measure(method, mode, b, h, n, d, dtype_name, dtype, fla_fn, args, walk_blocks=None) -> dict:
    """One case's row; an error other than running out of memory leaves NaN and its message,
    and raises :class:`ContextLost` with the row when CUDA no longer works after it. The peak
    memory is measured in one more call after the timed ones; if that call fails, the time
    stays and the error says ``peak memory: ...``."""
    label, ms, mib, error, lost = method, float("nan"), float("nan"), "", False
    try:
        label, fn, inputs = make_case(method, b, h, n, d, dtype, fla_fn, walk_blocks)
        if mode == "fwd+bwd":
            for t in inputs:
                t.requires_grad_(True)
            call = with_backward(fn, inputs)
        else:

            def call():
                with torch.no_grad():
                    fn()

        ms = cuda_time_ms(call, args.repeats, args.warmup)
        mib = peak_memory_mib(call, inputs)  # untimed: the timings see no reset or extra sync
    except torch.cuda.OutOfMemoryError:
        error = "out of memory"
    except Exception as err:  # a baseline that does not take this shape or dtype
        error = f"{type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}"
        lost = not context_alive()
    finally:
        try:  # raises itself once the context is broken
            torch.cuda.empty_cache()
        except Exception:
            lost = True
    if error and ms == ms:  # timed, then the memory's call failed
        error = f"peak memory: {error}"
    tflops = flops(label, mode, b, h, n, d) / (ms * 1e-3) / 1e12 if ms == ms else float("nan")
    print(
        f"{dtype_name:<9} B={b:<3} H={h:<3} D={d:<4} N={n:<6} {label:<15} {mode:<8}"
        f"{ms:10.3f} ms {tflops:8.2f} TFLOP/s {mib:9.1f} MiB {error}",
        file=sys.stderr,
    )
    row = {
        "method": label,
        "mode": mode,
        "causal": True,
        "dtype": dtype_name,
        "B": b,
        "H": h,
        "BH": b * h,
        "N": n,
        "F": d,
        "M": d,
        "walk_blocks": walk_blocks if method in WALK_METHODS else None,
        "time_ms": ms,
        "tflops": tflops,
        "peak_mib": mib,
        "error": error,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    if lost:
        raise ContextLost(row)
    return row


def targets(frame: pd.DataFrame) -> str:
    """The issue's target ratios where the frame has the cells (bf16, B=8, H=16, F=M=64): for
    each of our methods, then for the fastest of ours at each target, with its achieved rate
    against the matmul rate of the same run where the frame has them (what a closing note
    quotes)."""

    def cell(method, dtype, n, column="time_ms", b=8, h=16, d=64, mode="fwd+bwd"):
        if column not in frame.columns:
            return float("nan")
        sel = frame[
            (frame.method == method)
            & (frame.dtype == dtype)
            & (frame.N == n)
            & (frame.B == b)
            & (frame.H == h)
            & (frame.F == d)
            & (frame["mode"] == mode)
        ]
        if not len(sel) or pd.isna(sel[column].iloc[0]):  # NA of an Int64 column, too
            return float("nan")
        return float(sel[column].iloc[0])

    def t(method, dtype, n):
        return cell(method, dtype, n)

    lines = []
    fla, sdpa = t("fla", "bfloat16", 8192), t("sdpa", "bfloat16", 8192)
    torch32 = t("torch", "float32", 16384)
    ours = [m for m in frame.method.unique() if m.startswith(tuple(CUDA_METHODS))]
    for m in sorted(ours):
        lines += [
            f"N=8192 bf16 {m}/fla: {t(m, 'bfloat16', 8192) / fla:.3f} (target <= 1.0)",
            f"N=8192 bf16 {m}/sdpa: {t(m, 'bfloat16', 8192) / sdpa:.3f} (target < 1.0)",
            f"N=16384 fp32 torch/{m}: {torch32 / t(m, 'float32', 16384):.2f} (target >= 10)",
        ]
        lines.append(
            f"crossover of {m} with sdpa flash (bf16): N = "
            f"{crossover(frame, m, t) or 'none'} (target <= 2048)"
        )

    def fastest(dtype: str, n: int) -> tuple[str, float] | None:
        timed = [(ms, m) for m in ours if (ms := t(m, dtype, n)) == ms]  # NaN: not measured
        if not timed:
            return None
        ms, m = min(timed)
        return m, ms

    def rate(m: str, dtype: str, n: int) -> str:
        got, yardstick = cell(m, dtype, n, "tflops"), cell(m, dtype, n, "matmul_tflops")
        if got != got or yardstick != yardstick:
            return ""
        return f"; {got:.1f} TFLOP/s, {got / yardstick:.1%} of the run's {yardstick:.0f} (matmul)"

    if best := fastest("bfloat16", 8192):
        m, ms = best
        lines.append(
            f"fastest of ours, N=8192 bf16: {m} {ms:.3f} ms: /fla {ms / fla:.3f} (target <= 1.0),"
            f" /sdpa {ms / sdpa:.3f} (target < 1.0){rate(m, 'bfloat16', 8192)}"
        )
        lines.append(
            f"  as defaults for bf16: {settings_of(m, cell(m, 'bfloat16', 8192, 'walk_blocks'))}"
        )
    if best := fastest("float32", 16384):
        m, ms = best
        lines.append(
            f"fastest of ours, N=16384 fp32: {m} {ms:.3f} ms: torch/ours {torch32 / ms:.2f} "
            f"(target >= 10){rate(m, 'float32', 16384)}"
        )
        blocks = cell(m, "float32", 16384, "walk_blocks")
        lines.append(f"  as defaults for fp32: {settings_of(m, blocks, 'float32')}")
    crossings = sorted((n, m) for m in ours if (n := crossover(frame, m, t)) is not None)
    if crossings:
        n, m = crossings[0]
        lines.append(
            f"earliest crossover of ours with sdpa flash (bf16): N = {n} ({m}) (target <= 2048)"
        )
    return "\n".join(lines)


def settings_of(label: str, walk_blocks: object = None, dtype: str = "bfloat16") -> str:
    """The ``cuda_backend`` settings that make a row's method (``label``, with its WALK_BLOCKS
    as a suffix or in ``walk_blocks``) what a product in ``dtype`` runs, in words
    (WALKS_TOGETHER only for bfloat16, the one dtype it applies to)."""
    method, blocks = walk_parts(label, walk_blocks)
    kernel, fused, together = cuda_backend.VARIANTS[CUDA_METHODS[method]]
    words = [f"CAUSAL_KERNEL {kernel!r}", f"FUSED_BACKWARD {'on' if fused else 'off'}"]
    if fused and kernel != "chunks" and dtype == "bfloat16":
        words.append(f"WALKS_TOGETHER {together}")
    if kernel != "chunks":
        words.append(f"WALK_BLOCKS {blocks}" if blocks else "WALK_BLOCKS as run")
    return ", ".join(words)


def crossover(frame: pd.DataFrame, method: str, t: Callable[..., float]) -> int | None:
    """The smallest N from which ``method`` is no slower than sdpa flash (bf16 fwd+bwd) at that
    N and at every larger N where both were measured; None if it is slower at the largest.
    ``t(method, dtype, n)`` gives a median time (NaN where not measured)."""
    found = None
    for n in sorted(frame.N.unique(), reverse=True):
        ours, sdpa = t(method, "bfloat16", n), t("sdpa", "bfloat16", n)
        if math.isnan(ours) or math.isnan(sdpa):
            continue
        if ours > sdpa:
            break
        found = int(n)
    return found


# what the plot and the printed tables show of a case, where the frame has it
QUANTITIES = {"time_ms": "time (ms, median)", "peak_mib": "peak memory (MiB)"}


def plot_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The plot's points: one row per case and quantity of :data:`QUANTITIES` the frame has
    (CSVs before peak memory have only the time), with its ``value`` and the plot row it goes
    in (``panel``: dtype and quantity); a quantity not measured in a case is left out."""
    quantities = [q for q in QUANTITIES if q in frame.columns]
    data = frame.assign(shape=lambda f: "B·H=" + f.BH.astype(str) + ", D=" + f.F.astype(str))
    data = data.melt(
        id_vars=["dtype", "shape", "method", "mode", "N"],
        value_vars=quantities,
        var_name="quantity",
        value_name="value",
    ).dropna(subset=["value"])
    return data.assign(panel=data["dtype"] + ": " + data["quantity"].map(QUANTITIES))


#: The methods the issue compares, drawn in strong colours of their own; the variant sweeps
#: (``cuda_walk_*``) share the rest of the colour circle, lighter, one colour each.
HEADLINE_METHODS = ("cuda", "torch", "fla", "sdpa", "sdpa_efficient", "cuda_fused")


def method_colours(methods) -> dict[str, str | tuple[float, float, float]]:
    """A distinct colour for every method, headline methods first (the legend's order):
    ``tab20`` cycled once 35 methods were drawn, and 15 pairs shared a colour, the ``sdpa``
    baseline among them."""
    import seaborn as sns

    methods = sorted(set(methods), key=str)
    # blue, orange, green, black, purple, teal: apart from each other and from light hues
    strong = ["#1f5fa8", "#e8710a", "#1e8a3a", "#000000", "#7b3fa0", "#00838f"]
    colours = {m: c for m, c in zip(HEADLINE_METHODS, strong, strict=True) if m in methods}
    others = [m for m in methods if m not in HEADLINE_METHODS]
    colours.update(zip(others, sns.husl_palette(len(others), s=0.75, l=0.7), strict=True))
    return colours


def plot(frame: pd.DataFrame, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import seaborn as sns

    data = plot_rows(frame)
    if data.empty:
        return False
    present = set(data.panel)
    panels = [  # each dtype's time, then its memory
        panel
        for dtype in data["dtype"].unique()
        for panel in (f"{dtype}: {label}" for label in QUANTITIES.values())
        if panel in present
    ]
    colours = method_colours(data["method"].unique())
    grid = sns.relplot(
        data=data,
        x="N",
        y="value",
        hue="method",
        style="mode",
        row="panel",
        row_order=panels,
        col="shape",
        kind="line",
        markers=True,
        palette=colours,
        hue_order=list(colours),
        height=3,
        facet_kws={"sharey": False},
    )
    grid.set(xscale="log", yscale="log")
    grid.set_titles("{row_name}\n{col_name}")
    grid.set_axis_labels("N (tokens)", "")
    grid.figure.suptitle(f"causal attention on {frame.device.iloc[0]}", y=1.02)
    atomic_write(path, lambda f: grid.savefig(f, format="png", dpi=120, bbox_inches="tight"))
    return True


def _shape(text: str) -> tuple[int, int]:
    try:
        b, h = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BxH such as 8x16, got {text!r}") from None
    if b < 1 or h < 1:
        raise argparse.ArgumentTypeError(f"B and H must be positive, got {text!r}")
    return b, h


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, nargs="+", help=f"sequence lengths (default {DEFAULT_N})")
    p.add_argument(
        "--shapes",
        type=_shape,
        nargs="+",
        help="batch x heads, e.g. 1x8 (B·H=8), 4x16 (B·H=64), 8x16 (the issue's targets); "
        "default 1x8 4x16 8x16",
    )
    p.add_argument("--dims", type=int, nargs="+", help="F = M = D (default 64 128)")
    p.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "bfloat16"],
        choices=["float32", "bfloat16", "float16"],
    )
    p.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument(
        "--walk-blocks",
        type=int,
        nargs="+",
        help="cuda_backend.WALK_BLOCKS values for the walk methods (several: one column each; "
        "default: the backend's for each dtype)",
    )
    p.add_argument("--repeats", type=int, help="timed calls per case (default 10)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--quick",
        action="store_true",
        help="N in {1024, 8192}, B×H = 8x16, D = 64, 5 repeats (where not given)",
    )
    p.add_argument("--out", type=expanded_path, default=Path("benchmarks/results/cuda.csv"))
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the rows already in --out and measure only the cases they lack",
    )
    p.add_argument("--no-plot", action="store_true", help="write the CSV only (no PNG beside it)")
    p.add_argument(
        "--from-csv",
        type=Path,
        nargs="+",
        metavar="CSV",
        help="no GPU: join these CSVs of earlier runs (a later row of a case wins), write them "
        "to --out with the plot, print the tables and the target ratios",
    )
    args = p.parse_args(argv)
    for path in args.from_csv or []:
        if not path.is_file():
            p.error(f"--from-csv: no file {str(path)!r}")
    defaults = (
        {"n": [1024, 8192], "shapes": [(8, 16)], "dims": [64], "repeats": 5}
        if args.quick
        else {
            "n": DEFAULT_N,
            "shapes": [(1, 8), (4, 16), (8, 16)],
            "dims": [64, 128],
            "repeats": 10,
        }
    )
    for name, value in defaults.items():  # what the user gave stands, also with --quick
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("n", "shapes", "dims", "dtypes", "methods", "modes", "walk_blocks"):
        if getattr(args, name) is not None:  # a value given twice is measured once
            setattr(args, name, list(dict.fromkeys(getattr(args, name))))
    if any(n < 1 for n in args.n) or args.repeats < 1 or args.warmup < 0:
        p.error("--n and --repeats must be positive, --warmup non-negative")
    if any(d < 1 for d in args.dims):
        p.error("--dims must be positive")
    if any(blocks < 1 for blocks in args.walk_blocks or ()):
        p.error("--walk-blocks must be positive")
    if problem := output_file_problem(args.out):
        p.error(f"--out {args.out}: {problem}")
    return args


def read_results(path: Path) -> pd.DataFrame:
    """A CSV this script wrote; ValueError naming the file if it is not one."""
    try:
        frame = pd.read_csv(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable CSV ({err})") from None
    missing = [c for c in (*CASE, "time_ms") if c not in frame.columns]
    if missing:
        raise ValueError(f"{path}: not a results CSV of this script (no column {missing[0]!r})")
    return frame


def join(*frames: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``frames`` in order, one per case (:func:`case_key`): a later row of the
    same case wins. Rows of one device only (ValueError naming them: two GPUs' rows
    collapsed into one and the plot was titled by the first).

    A run that swept one WALK_BLOCKS value labels its walk rows ``cuda_walk`` (its
    ``walk_blocks`` column holds the value), one that swept several ``cuda_walk_128``, ...
    Joined, a walk method's rows in a dtype carry their blocks where they hold several values
    (rows of different blocks are different cases) or some came so labelled, else its plain
    name (each dtype may run at its own: a per-dtype ``WALK_BLOCKS``)."""
    frames = tuple(f for f in frames if not f.empty)
    if not frames:
        return pd.DataFrame()
    whole = pd.concat(frames, ignore_index=True)
    if "device" in whole.columns and whole["device"].nunique() > 1:
        devices = ", ".join(map(str, whole["device"].dropna().unique()))
        raise ValueError(f"the CSVs hold rows of several devices ({devices}): join one's")
    parts = _row_walk_parts(whole)
    labelled = {
        (base, dtype)
        for (base, _), m, dtype in zip(parts, whole["method"], whole["dtype"], strict=True)
        if base != m
    }
    whole["method"] = [base for base, _ in parts]
    whole["walk_blocks"] = pd.array(
        [w if base in WALK_METHODS and w else None for base, w in parts], dtype="Int64"
    )
    for method, dtype in itertools.product(WALK_METHODS, whole["dtype"].unique()):
        rows = (whole["method"] == method) & (whole["dtype"] == dtype)
        if (method, dtype) in labelled or whole.loc[rows, "walk_blocks"].nunique() > 1:
            whole.loc[rows, "method"] = method + "_" + whole.loc[rows, "walk_blocks"].astype(str)
    latest = ~pd.Series(row_keys(whole)).duplicated(keep="last").to_numpy()
    return whole[latest].reset_index(drop=True)


def report(frame: pd.DataFrame, out: Path, draw: bool) -> None:
    """Writes ``frame`` to ``out`` (and its plot beside it when ``draw``), prints the tables of
    time and peak memory and the issue's target ratios."""
    atomic_write_text(out, frame.to_csv(index=False))
    png = out.with_suffix(".png")
    plotted = draw and plot(frame, png)
    with pd.option_context("display.width", 250, "display.max_columns", 30):
        for quantity, label in QUANTITIES.items():
            if quantity not in frame.columns:
                continue
            table = frame.pivot_table(
                index=["dtype", "BH", "F", "mode", "method"], columns="N", values=quantity
            ).round(3)
            print(f"{label}:\n{table.to_string()}")
    print(targets(frame))
    print(f"wrote {out} and {png}" if plotted else f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_csv:
        try:
            frame = join(*(read_results(path) for path in args.from_csv))
        except ValueError as err:
            print(f"benchmarks/cuda_core.py: {err}", file=sys.stderr)
            return 1
        if frame.empty:
            print("benchmarks/cuda_core.py: the CSVs hold no rows", file=sys.stderr)
            return 1
        report(frame, args.out, draw=not args.no_plot)
        return 0
    if not torch.cuda.is_available():
        print(
            "benchmarks/cuda_core.py needs a CUDA GPU, and none is visible here "
            "(torch.cuda.is_available() is False); nothing was measured.",
            file=sys.stderr,
        )
        return 1
    previous = pd.DataFrame()
    if args.resume and args.out.is_file():
        try:
            previous = read_results(args.out)
        except ValueError as err:
            print(f"benchmarks/cuda_core.py: --resume: {err}", file=sys.stderr)
            return 1
        here = torch.cuda.get_device_name()
        other = sorted(set(previous.get("device", pd.Series(dtype=str)).dropna()) - {here})
        if other:  # its cases are not this GPU's, and one CSV holds one device's rows
            print(
                f"benchmarks/cuda_core.py: --resume: {args.out} holds rows measured on "
                f"{', '.join(other)}, not on this {here}: give another --out",
                file=sys.stderr,
            )
            return 1

    def save(frame: pd.DataFrame) -> None:  # as it goes, once a case has a time
        whole = join(previous, frame)
        if not whole.empty and whole["time_ms"].notna().any():
            atomic_write_text(args.out, whole.to_csv(index=False))

    with cuda_backend.settings_kept():  # each CUDA method selects its variant
        frame, stopped = benchmark(args, progress=save, done=case_keys(previous))
    whole = join(previous, frame)
    if whole.empty or whole["time_ms"].isna().all():  # every case skipped, or every one failed
        print(
            f"benchmarks/cuda_core.py: nothing was measured (see above); {args.out} left as it was",
            file=sys.stderr,
        )
        if stopped:
            print(f"benchmarks/cuda_core.py: {stopped}", file=sys.stderr)
        return 1
    if frame.empty:
        print(f"every case asked for is already in {args.out} (--resume)", file=sys.stderr)
    report(whole, args.out, draw=not args.no_plot)
    if stopped:
        print(f"benchmarks/cuda_core.py: {stopped}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
