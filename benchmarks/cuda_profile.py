"""Per-kernel GPU time of the CUDA backend's causal product, forward and backward.

Runs ``ks.causal_dot_product(..., backend="cuda")`` (``--op attention``: the normalized
``ks.linear_attention(..., causal=True)``, whose backward adds its row terms' and cumulative sums'
kernels, and in float16 dv's cast; ``--op full``: the non-causal one with padded keys, as the LRA
encoders call it, on the reduction and read-out kernels whatever the variant) forward + backward
under ``torch.profiler`` for each F = M, dtype and kernel variant of ``cuda_backend.VARIANTS``
(``chunks``: the chunk kernels with three causal products in the backward; ``chunks_fused``: the
chunk kernels with their fused backward; ``walk``: the walk kernel, forward and three backward
products; ``walk_fused``: the walk with its fused backward; ``walk_mma``, ``walk_mma_fused``: the
same on kernels 8 and 9, mma.sync with operands in registers, for F <= 64, kernel 8 in bf16 for F <=
128; in bf16 the fused backwards' two walks run as one grid, kernels 11 and 10, and
``walk_fused_apart``, ``walk_mma_fused_apart`` keep them as two launches, the A/B of kernels 11 and
10) and reports every CUDA kernel's total and per-call time, its share of the step and its call
count per step: where the time goes before a kernel is changed. Each variant's rows also carry a
step's wall time (``step_wall_us``, CUDA events around one step, as ``cuda_core.py`` times cases),
its time with steps queued back to back (``step_stream_us``) and the host's time to issue one
(``step_host_us``); a second table gives the kernels' sum per step against them (``gpu_busy``: of
the wall time). On the H200 (2026-11-30) the defaults' step was 775 µs of kernels in 1.0-1.2 ms:
where the stream time is near the kernels' sum, the rest is the host's latency before the GPU gets
work (Python and launches: that host is slow, SDPA's fwd+bwd at N = 512, 15 GFLOP, took 0.38 ms
there); where the host's time passes the kernels', the host is what limits.

    python benchmarks/cuda_profile.py --out benchmarks/results/cuda_profile.csv

The CSV records the device, date and command, and the walk variants' ``WALK_BLOCKS``
(``--walk-blocks``; the backend's default without it); a table is printed. ``--append`` keeps
the rows already in ``--out`` (another run's: a second WALK_BLOCKS, say) beside the new ones.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile

# the sibling script cuda_core.py (its CUDA-event timer): found when this one runs as a script,
# and from the end of the path when it is imported (nothing installed is shadowed)
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))
import cuda_core  # noqa: E402

import kernelstudy as ks  # noqa: E402
from kernelstudy.arguments import expanded_path  # noqa: E402
from kernelstudy.core import cuda_backend  # noqa: E402
from kernelstudy.files import atomic_write_text, output_file_problem  # noqa: E402
from kernelstudy.progress import run_script  # noqa: E402

VARIANTS = tuple(cuda_backend.VARIANTS)
DTYPES = ("float32", "bfloat16", "float16")


def step_inputs(
    dtype: torch.dtype, b: int, h: int, n: int, d: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A profiled step's q, k (positive, as feature maps give them) and v, requiring
    gradients, and the output's gradient g: (B, H, N, D) each, on the GPU, seeded."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (
        torch.rand(b, h, n, d, device="cuda", generator=gen).to(dtype).requires_grad_()
        for _ in range(2)
    )
    v = torch.randn(b, h, n, d, device="cuda", generator=gen).to(dtype).requires_grad_()
    g = torch.randn(b, h, n, d, device="cuda", generator=gen).to(dtype)
    return q, k, v, g


def padded_keys(q: torch.Tensor) -> torch.Tensor:
    """A key padding mask (B, N) for q (B,H,N,F): the last eighth of every other sequence's keys
    padded (the ragged lengths of an LRA batch)."""
    b, _, n, _ = q.shape
    keep = torch.ones(b, n, dtype=torch.bool, device=q.device)
    keep[::2, n - n // 8 :] = False
    return keep


# What a profiled step runs: the unnormalized causal product (the targets), the
# normalized causal attention that models call (its backward adds normalized_grad and the
# cumulative sums with the products' dq and dk added; float16 also dv's cast), or the
# non-causal one with padded keys (the encoders')
OPS = {
    "product": lambda q, k, v: ks.causal_dot_product(q, k, v, backend="cuda"),
    "attention": lambda q, k, v: ks.linear_attention(q, k, v, causal=True, backend="cuda"),
    "full": lambda q, k, v: ks.linear_attention(
        q, k, v, causal=False, key_padding_mask=padded_keys(q), backend="cuda"
    ),
}


def kernel_times(
    dtype: torch.dtype,
    b: int,
    h: int,
    n: int,
    d: int,
    variant: str,
    steps: int,
    walk_blocks: int | None = None,
    op: str = "product",
) -> pd.DataFrame:
    """One row per CUDA kernel: total µs over ``steps`` forward+backward steps and calls
    (``walk_blocks``: the backend's ``WALK_BLOCKS`` for the steps; None keeps it), and, after
    the profiled steps, the median wall time of a step (``step_wall_us``, CUDA events: what the
    kernels' sum per step leaves of it is the GPU waiting for the host), and with ``steps``
    steps queued back to back the GPU's time a step and the host's time to issue one
    (``step_stream_us``, ``step_host_us``: :func:`cuda_core.stream_time_ms`)."""
    q, k, v, g = step_inputs(dtype, b, h, n, d)

    def step() -> None:
        for t in (q, k, v):
            t.grad = None
        OPS[op](q, k, v).backward(g)

    with cuda_backend.settings_kept():  # the backend's defaults again afterwards
        cuda_backend.use_variant(variant, walk_blocks)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        # a step's wall time (CUDA events, as cuda_core.py times cases): beside the kernels'
        # sum, the host's share; and with steps queued, the GPU's and the host's time a step
        wall_us = cuda_core.cuda_time_ms(step, steps, 0) * 1e3
        stream_ms, host_ms = cuda_core.stream_time_ms(step, steps)
    rows = [
        {"kernel": e.key, "total_us": e.self_device_time_total, "calls": e.count}
        for e in prof.key_averages()
        if e.self_device_time_total > 0  # kernels (operators own no device time)
    ]
    if not rows:  # e.g. a profiler that recorded no device activity
        raise RuntimeError(
            f"the profiler recorded no CUDA kernel time for {variant} in {dtype}: nothing to report"
        )
    frame = pd.DataFrame(rows)
    frame["us_per_call"] = frame.total_us / frame.calls
    frame["calls_per_step"] = frame.calls / steps
    frame["us_per_step"] = frame.total_us / steps
    frame["share"] = frame.total_us / frame.total_us.sum()
    frame["step_wall_us"] = wall_us
    frame["step_stream_us"] = stream_ms * 1e3
    frame["step_host_us"] = host_ms * 1e3
    return frame.sort_values("total_us", ascending=False)


STEP_COLUMNS = {"wall_us": "step_wall_us", "stream_us": "step_stream_us", "host_us": "step_host_us"}


def step_table(result: pd.DataFrame) -> pd.DataFrame:
    """One row per variant: the kernels' sum per step (``gpu_us``) beside the step's wall,
    stream and host times (those of :data:`STEP_COLUMNS` that ``result`` has), and
    ``gpu_busy = gpu_us / wall_us``."""
    keys = [key for key in ("op", "F", "dtype", "variant", "walk_blocks") if key in result]
    times = {name: (column, "first") for name, column in STEP_COLUMNS.items() if column in result}
    steps = result.groupby(keys, dropna=False).agg(gpu_us=("us_per_step", "sum"), **times)
    steps["gpu_busy"] = steps.gpu_us / steps.wall_us
    return steps.reset_index()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=8192, help="sequence length")
    p.add_argument("--batch", type=int, default=8, help="B")
    p.add_argument("--heads", type=int, default=16, help="H")
    p.add_argument("--dim", type=int, nargs="+", default=[64], help="F = M (each in turn)")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=DTYPES)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--steps", type=int, default=5, help="profiled fwd+bwd steps")
    p.add_argument(
        "--walk-blocks", type=int, default=None,
        help="cuda_backend.WALK_BLOCKS for the walk variants (default: the backend's)",
    )  # fmt: skip
    p.add_argument(
        "--op", nargs="+", choices=OPS, default=["product"],
        help="the step's call, each in turn: ks.causal_dot_product (product, the default), "
        "ks.linear_attention causal (attention) or non-causal with padded keys (full)",
    )  # fmt: skip
    p.add_argument("--append", action="store_true", help="keep the rows already in --out")
    p.add_argument("--out", type=expanded_path, default=Path("benchmarks/results/cuda_profile.csv"))
    args = p.parse_args(argv)
    if min(args.n, args.batch, args.heads, *args.dim, args.steps) < 1:
        p.error("--n, --batch, --heads, --dim and --steps must be positive")
    if args.walk_blocks is not None and args.walk_blocks < 1:
        p.error("--walk-blocks must be positive")
    if problem := output_file_problem(args.out):
        p.error(f"--out {args.out}: {problem}")
    return args


def context_alive() -> bool:
    """Whether CUDA still runs work in this process (after an illegal address it never does)."""
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device="cuda").add_(1).item() == 2
    except Exception:
        return False


def case_failed(script: str, case: str, err: BaseException) -> bool:
    """Says on stderr that ``case`` failed with ``err``; False where the CUDA context is broken
    (an illegal address: nothing later can run in this process), else True."""
    message = str(err).splitlines()[0] if str(err) else ""
    print(f"benchmarks/{script}: {case} failed: {type(err).__name__}: {message}", file=sys.stderr)
    if context_alive():
        return True
    print(
        f"benchmarks/{script}: the CUDA context is broken; the cases after it were not run "
        "(leave the failing one out)",
        file=sys.stderr,
    )
    return False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() or "cuda" not in ks.backends():
        print(
            "benchmarks/cuda_profile.py needs a GPU and the cuda backend; none here",
            file=sys.stderr,
        )
        return 1
    b, h = args.batch, args.heads
    frames, failed = [], []
    earlier = [pd.read_csv(args.out)] if args.append and args.out.is_file() else []
    date = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    cases = [
        (op, d, name, v)
        for op in args.op
        for d in args.dim
        for name in args.dtypes
        for v in args.variants
    ]
    for op, dim, name, variant in cases:
        blocks = args.walk_blocks or cuda_backend.walk_blocks(getattr(torch, name))
        try:
            frame = kernel_times(
                getattr(torch, name), b, h, args.n, dim, variant, args.steps, blocks, op
            )
        except Exception as err:  # one variant failing keeps the others' tables
            failed.append(f"{variant} ({name}, F=M={dim}, {op})")
            if not case_failed("cuda_profile.py", f"{op}: {variant} in {name} at F=M={dim}", err):
                break
            continue
        walk = variant.startswith("walk")
        frames.append(
            frame.assign(
                op=op, dtype=name, variant=variant, F=dim, walk_blocks=blocks if walk else None
            )
        )
        result = pd.concat(frames, ignore_index=True).assign(
            B=b,
            H=h,
            N=args.n,
            device=torch.cuda.get_device_name(),
            date=date,
            torch=torch.__version__,
            command=cuda_backend.command_line(sys.argv),
        )
        # as it goes (a run killed at a time limit keeps what it profiled); atomically: never
        # half a CSV over results
        written = pd.concat([*earlier, result], ignore_index=True)
        atomic_write_text(args.out, written.to_csv(index=False))
    if not frames:
        print(
            f"benchmarks/cuda_profile.py: nothing profiled; {args.out} left as it was",
            file=sys.stderr,
        )
        return 1
    cols = [
        "op",
        "F",
        "dtype",
        "variant",
        "walk_blocks",
        "kernel",
        "calls_per_step",
        "us_per_call",
        "us_per_step",
        "share",
    ]
    with pd.option_context("display.max_colwidth", 60, "display.width", 200):
        print(result[cols].round(3).to_string(index=False))
        if "step_wall_us" in result.columns:  # the GPU's busy share of a step's wall time
            print(step_table(result).round(3).to_string(index=False))
    print(f"wrote {args.out}", file=sys.stderr)
    if failed:
        print(f"benchmarks/cuda_profile.py: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
