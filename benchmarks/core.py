"""Benchmark the linear-attention core against softmax attention: time and peak memory vs N.

For every N, backend and mode (forward, forward+backward) it reports the median
time over repeats (after a warm-up), the peak memory above the inputs, and the
achieved FLOP rate as a fraction of the matmul rate in the run's dtype measured
in the same run. FLOPs counted: 4·B·H·N·F·M for a forward of the causal product or of
linear attention, 12·B·H·N·F·M for forward+backward; softmax counts
4·B·H·N·S·D (halved when causal) and 3× that for forward+backward (the six N×N
products; flash attention's recomputed scores are not counted, as no kernel's
recomputation is; CSVs written before 2026-11-24, ``core_cpu_issue2.csv`` among them,
used 2.5×, so their softmax fwd+bwd GFLOP/s are 5/6 of this convention's; their times are
unaffected; ``core_cpu.csv`` was written again on 2026-12-01 with 3×). Non-causal linear
attention runs on ``reference``, ``torch`` and the backends with a fused attention; the
others would run the torch path.

    python benchmarks/core.py --quick                 # a minute on a laptop
    python benchmarks/core.py --out benchmarks/results/core_cpu.csv

Peak memory: the peak bytes the call's tensors take above those allocated before it
(``ks.analysis.peak_memory_bytes``: on CUDA ``torch.cuda.max_memory_allocated``, on CPU the
profiler's allocation events); the compiled CPU kernel's own scratch (a few chunk-sized
blocks per thread, well under 1 MiB at F = M = 64) is not counted. CSVs written before
2026-12-01 (``core_cpu_issue2.csv``, ``core_cpu_issue4.csv``) took on CPU the rise of the
process's resident set, which counted the allocator's slack: glibc serves large tensors from
its heap once it has raised its mmap threshold, and the heap stays resident, fragmented, so
the torch backend's causal fwd+bwd at N = 1024 read 44 MiB for 16 MiB allocated, depending on
which cases ran before.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import TypeVar

import pandas as pd
import torch

import kernelstudy as ks
from kernelstudy.arguments import expanded_path
from kernelstudy.cli import out_of_memory
from kernelstudy.core import registered_backends, runs_own_noncausal_attention
from kernelstudy.files import atomic_write_text, output_file_problem
from kernelstudy.progress import run_script
from kernelstudy.revision import with_commit

T = TypeVar("T")

# Above this, the reference backend's N×N matrix costs too much memory to benchmark.
REFERENCE_MAX_N = 4096


def peak_memory_mib(fn: Callable[[], object], device: torch.device) -> float:
    """Peak memory (MiB) that one call of ``fn()`` adds above what is allocated before it."""
    return ks.analysis.peak_memory_bytes(fn, device) / 2**20


def _run(fn: Callable[[], torch.Tensor], inputs: list[torch.Tensor], backward: bool):
    """One call of ``fn`` and, with ``backward``, the gradients of ``inputs``. They are returned
    by ``torch.autograd.grad`` and dropped with the call: gradients left in ``.grad`` by one call
    would be freed inside the next one's memory measurement and lower its peak by their size."""

    def call() -> None:
        out = fn()
        if backward:
            torch.autograd.grad(out, inputs, torch.ones_like(out))

    return call


def rows_until_interrupted(
    items: Iterable[T], rows_of: Callable[[T], Iterable[dict]]
) -> tuple[list[dict], bool]:
    """The rows ``rows_of(item)`` gives (a generator: as each case is measured) for each item,
    and whether Ctrl-C stopped the loop: the rows given before it are kept (the caller writes
    them and exits 130)."""
    rows: list[dict] = []
    try:
        for item in items:
            for row in rows_of(item):
                rows.append(row)
    except KeyboardInterrupt:
        return rows, True
    return rows, False


def benchmark(args: argparse.Namespace, linear_backends: list[str]) -> pd.DataFrame:
    """Time every case; ``linear_backends`` from :func:`usable_backends`."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    b, h, f, m, d = args.batch, args.heads, args.features, args.values, args.head_dim
    rate = ks.analysis.matmul_rate(device, dtype, size=2048) * 1e9  # FLOP/s
    print(
        f"{args.dtype} matmul rate: {rate / 1e9:.1f} GFLOP/s on {device_name(device)}",
        file=sys.stderr,
    )

    def rows_of(n: int) -> Iterator[dict]:
        gen = torch.Generator(device="cpu").manual_seed(n)
        try:
            phi_q = torch.rand(b, h, n, f, generator=gen).to(device, dtype)
            phi_k = torch.rand(b, h, n, f, generator=gen).to(device, dtype)
            v = torch.randn(b, h, n, m, generator=gen).to(device, dtype)
            q = torch.randn(b, h, n, d, generator=gen).to(device, dtype)
            k = torch.randn(b, h, n, d, generator=gen).to(device, dtype)
            vs = torch.randn(b, h, n, d, generator=gen).to(device, dtype)
        except (RuntimeError, MemoryError) as err:  # a CPU's allocation failure is neither
            if not out_of_memory(err):  # torch.OutOfMemoryError nor a MemoryError
                raise
            print(f"N={n:>6} the inputs do not fit in memory: skipped", file=sys.stderr)
            return
        cases = []
        for backend in linear_backends:
            if backend == "reference" and n > REFERENCE_MAX_N:
                continue
            cases.append(
                (
                    "causal_product",
                    backend,
                    True,
                    partial(ks.causal_dot_product, phi_q, phi_k, v, backend=backend),
                    (phi_q, phi_k, v),
                    4 * b * h * n * f * m,
                )
            )
            for causal in (True, False):
                if not causal and not runs_own_noncausal_attention(backend):
                    continue  # non-causal attention there is the torch path under a new label
                cases.append(
                    (
                        "linear_attention",
                        backend,
                        causal,
                        partial(
                            ks.linear_attention, phi_q, phi_k, v, causal=causal, backend=backend
                        ),
                        (phi_q, phi_k, v),
                        4 * b * h * n * f * m,
                    )
                )
        if not args.no_softmax:
            for causal in (True, False):
                cases.append(
                    (
                        "softmax_attention",
                        "sdpa",
                        causal,
                        partial(ks.softmax_attention, q, k, vs, causal=causal),
                        (q, k, vs),
                        4 * b * h * n * n * d // (2 if causal else 1),
                    )
                )
        for op, backend, causal, fn, inputs, flops in cases:
            for mode in args.modes:
                backward = mode == "fwd+bwd"
                for t in inputs:
                    t.requires_grad_(backward)
                call = _run(fn, list(inputs), backward)
                call_flops = 3 * flops if backward else flops
                error = ""
                try:
                    seconds = statistics.median(ks.analysis.time_call(call, device, args.repeats))
                    memory = peak_memory_mib(call, device)
                except (RuntimeError, MemoryError) as err:  # this size only: the others run
                    if not out_of_memory(err):
                        raise
                    seconds, memory, error = float("nan"), float("nan"), "out of memory"
                if error and device.type == "cuda":  # after the except: its traceback held
                    torch.cuda.empty_cache()  # the failed call's tensors
                print(
                    f"N={n:>6} {op:<18} {backend:<9} causal={causal!s:<5} {mode:<7} "
                    f"{seconds * 1e3:9.2f} ms {memory:8.1f} MiB {error}",
                    file=sys.stderr,
                )
                yield {
                    "op": op,
                    "backend": backend,
                    "causal": causal,
                    "mode": mode,
                    "B": b,
                    "H": h,
                    "N": n,
                    "F": f if op != "softmax_attention" else None,
                    "M": m if op != "softmax_attention" else d,
                    "D": d if op == "softmax_attention" else None,
                    "dtype": args.dtype,
                    "time_ms": seconds * 1e3,
                    "peak_mib": memory,
                    "gflops": call_flops / seconds / 1e9,
                    "frac_matmul": call_flops / seconds / rate,
                    "error": error,
                }

    # Ctrl-C keeps the cases measured so far (main writes them)
    rows, interrupted = rows_until_interrupted(args.n, rows_of)
    frame = pd.DataFrame(rows)
    for size in ("F", "D"):  # blank for the other kind of op: integers, not floats (64.0)
        if size in frame.columns:
            frame[size] = frame[size].astype("Int64")
    frame.attrs["interrupted"] = interrupted
    frame["matmul_gflops"] = rate / 1e9
    frame["device"] = device_name(device)
    frame["threads"] = torch.get_num_threads()
    frame["torch"] = torch.__version__
    frame["kernelstudy"] = with_commit(ks.__version__)  # +git.<commit> in a checkout
    frame["date"] = dt.date.today().isoformat()
    frame["command"] = shlex.join(["python", "benchmarks/core.py", *args.argv])
    return frame


def usable_backends(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The linear backends asked for (all when ``--backends`` is empty) that take tensors
    of ``--dtype`` on ``--device`` here, and those that do not (not built, or another
    device: e.g. ``cuda`` for CPU tensors)."""
    example = torch.empty(0, device=args.device, dtype=getattr(torch, args.dtype))
    asked = args.backends or list(registered_backends())
    available = set(ks.backends())
    ok = [x for x in asked if x in available and registered_backends()[x].supports(example)]
    return ok, [x for x in asked if x not in ok]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cpus)"


def summary(frame: pd.DataFrame) -> pd.DataFrame:
    """Wide table: time (ms) and peak memory (MiB) per op/backend/mode vs N."""
    frame = frame.assign(
        what=frame["op"]
        + ":"
        + frame["backend"]
        + frame["causal"].map({True: " causal", False: ""})
    )
    return frame.pivot_table(
        index=["what", "mode"], columns="N", values=["time_ms", "peak_mib"], aggfunc="first"
    ).round(1)


def add_dtype_and_device(p: argparse.ArgumentParser) -> None:
    """The ``--dtype`` and ``--device`` flags the benchmarks share (checked by
    :func:`check_sizes_and_device`)."""
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float64", "bfloat16"],
        help="(default %(default)s)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default %(default)s)")


def check_sizes_and_device(p: argparse.ArgumentParser, sizes: dict[str, int], device: str) -> None:
    """Exit through ``p.error`` (status 2) naming every flag of ``sizes`` below 1, or a
    ``--device`` that torch cannot parse or that is neither a CPU nor a CUDA device (the
    benchmarks time and synchronize those two; ``meta`` would time no work)."""
    bad = [name for name, value in sizes.items() if value < 1]
    if bad:
        p.error(f"{', '.join(bad)} must be positive")
    try:
        kind = torch.device(device).type
    except RuntimeError:  # torch's message lists its 20 device types
        kind = None
    if kind not in ("cpu", "cuda"):
        p.error(f"--device {device!r}: expected cpu, cuda or cuda:N")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--n", type=int, nargs="+", help="sequence lengths (default 1024 2048 4096 8192 16384)"
    )
    p.add_argument("--batch", type=int, default=1, help="B (default %(default)s)")
    p.add_argument("--heads", type=int, default=8, help="H (default %(default)s)")
    p.add_argument(
        "--features", type=int, default=64, help="F, feature dimension (default %(default)s)"
    )
    p.add_argument(
        "--values", type=int, default=64, help="M, value dimension (default %(default)s)"
    )
    p.add_argument(
        "--head-dim", type=int, default=64, help="D of the softmax baseline (default %(default)s)"
    )
    add_dtype_and_device(p)
    p.add_argument("--backends", nargs="*", default=[], help="linear backends (default: all)")
    p.add_argument(
        "--modes",
        nargs="+",
        default=["fwd", "fwd+bwd"],
        choices=["fwd", "fwd+bwd"],
        help="(default: both)",
    )
    p.add_argument("--repeats", type=int, help="timed calls per case (default 5)")
    p.add_argument("--no-softmax", action="store_true", help="skip the softmax baseline")
    p.add_argument(
        "--quick", action="store_true", help="N in {1024, 4096}, 3 repeats, unless --n/--repeats"
    )
    p.add_argument(
        "--out",
        type=expanded_path,
        default=Path("benchmarks/results/core.csv"),
        help="CSV to write (default %(default)s, under the working directory)",
    )
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command the CSV records
    if args.n is None:
        args.n = [1024, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384]
    for name in ("n", "backends", "modes"):  # a value given twice is measured once
        setattr(args, name, list(dict.fromkeys(getattr(args, name))))
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    sizes = {
        "--n": min(args.n),
        "--repeats": args.repeats,
        "--batch": args.batch,
        "--heads": args.heads,
        "--features": args.features,
        "--values": args.values,
        "--head-dim": args.head_dim,
    }
    check_sizes_and_device(p, sizes, args.device)
    if problem := output_file_problem(args.out):
        p.error(f"--out {args.out}: {problem}")
    known = registered_backends()
    unknown = [name for name in args.backends if name not in known]
    if unknown:
        p.error(f"--backends: unknown {unknown}; registered: {', '.join(known)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"benchmarks/core.py: --device {args.device}: no CUDA GPU here", file=sys.stderr)
        return 1
    usable, unusable = usable_backends(args)
    if unusable and args.backends:  # asked for by name: refuse rather than leave them out
        print(
            f"benchmarks/core.py: backend(s) {', '.join(unusable)} cannot run "
            f"{args.dtype} on {args.device} here; {args.out} left as it was",
            file=sys.stderr,
        )
        return 1
    if unusable:
        print(f"skipped (not built, or not for {device}): {', '.join(unusable)}", file=sys.stderr)
    frame = benchmark(args, usable)
    interrupted = frame.attrs.get("interrupted", False)  # by Ctrl-C: exit 130
    if frame.empty or frame.time_ms.isna().all():  # nothing ran: keep whatever --out holds
        print(f"benchmarks/core.py: no case ran; {args.out} left as it was", file=sys.stderr)
        return 130 if interrupted else 1
    atomic_write_text(args.out, frame.to_csv(index=False))
    with pd.option_context("display.width", 200, "display.max_columns", 50):
        print(summary(frame).to_string())
    print(
        f"wrote {args.out}" + (" (interrupted: the cases measured before)" if interrupted else "")
    )
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(run_script(main))
