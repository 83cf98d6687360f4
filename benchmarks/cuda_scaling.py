"""Whether the walk kernels are bound by latency or by an SM's throughput, from how their time
grows with the thread blocks each SM runs at once: no hardware counters needed (Nsight Compute
cannot read them on every machine).

One thread block walks each sequence (``WALK_BLOCKS`` 1: no sequence is cut, so no carry pass),
so B·H sets the grid: for each ``--loads`` value, B·H = load × the GPU's SM count (B = B·H,
H = 1; F = M = ``--dim``). For each dtype and variant (``walk_fused``: kernels 6 and 7, in bf16
6 and 11; ``walk_mma_fused``: kernels 8 and 9 where they apply, in bf16 8 and 10; the
``_apart`` variants keep 6 and 7, 8 and 9 in bf16 too, and a variant whose kernels another
already measured at that dtype and load is left out) steps
run under torch.profiler (``cuda_profile.kernel_times``), and each walk kernel's time per
call is kept beside what the extension's ``walk_kernels`` says of it: the kernel and how many
of its blocks an SM holds at once (``resident``). The product kernel runs twice a step (the
forward and the backward's dq), the dk, dv walk once; kernels 10 and 11 run once and hold the
backward's dq walk beside its dk, dv walk (at load L, 2L of its blocks an SM's worth: one of
each walk a sequence), so its cost mixes the two.

Columns: ``us_per_call``; ``us_per_chunk`` = us_per_call / ceil(N/64), the chunks each block
walks (at load <= 1: what one chunk costs an SM that runs nothing else); ``cost`` =
us_per_call / us_per_call at load 1 of the same dtype, variant and kernel.

Reading it: at load 2 with 2 resident, every SM runs two walks at once. A walk bound by latency
(warps waiting on each other at the barrier, on memory, on dependent products) then keeps
cost near 1: the second walk fills the first one's idle cycles. One bound by an SM's issue
slots, tensor cores or shared memory shares them, and cost nears 2. With 1 resident, load 2 is
two waves and costs 2 either way. ``bound`` says which (``latency`` below 1.35, ``throughput``
above 1.75, else ``mixed``; empty where fewer than 2 are resident).

    python benchmarks/cuda_scaling.py --out benchmarks/results/cuda_scaling.csv

The CSV records the device, date and command; a table is printed. Exit status 1 when a case
failed (the others are kept) or there is no GPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import re
import sys
from pathlib import Path

import pandas as pd
import torch

# the sibling script cuda_profile.py (its profiler loop): found when this one runs as a script,
# and from the end of the path when it is imported (nothing installed is shadowed)
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))
import cuda_profile  # noqa: E402

import kernelstudy as ks  # noqa: E402
from kernelstudy.arguments import expanded_path  # noqa: E402
from kernelstudy.core import cuda_backend  # noqa: E402
from kernelstudy.files import atomic_write_text, output_file_problem  # noqa: E402
from kernelstudy.progress import run_script  # noqa: E402

VARIANTS = ("walk_fused", "walk_fused_apart", "walk_mma_fused", "walk_mma_fused_apart")
# the walk kernels by their names within the profiler's (demangled or mangled) ones
KERNELS = {
    "chunk_walk_backward_kernel": 11,
    "chunk_walk_mma_backward_kernel": 10,
    "chunk_walk_mma_dkv_kernel": 9,
    "chunk_walk_mma_kernel": 8,
    "chunk_walk_dkv_kernel": 7,
    "chunk_walk_kernel": 6,
}
LATENCY_BELOW, THROUGHPUT_ABOVE = 1.35, 1.75
CHUNK = 64  # rows a walk takes per step (ks_cuda::kChunk)


def kernel_number(name: str) -> int | None:
    """The walk kernel (6-11) a profiler's kernel name is, None for any other kernel."""
    found = re.search(r"chunk_walk\w*_kernel", name)
    return KERNELS.get(found[0]) if found else None


def walk_rows(times: pd.DataFrame, kernels: dict) -> pd.DataFrame:
    """``cuda_profile.kernel_times``' rows of the walk kernels, with ``kernel`` their number and
    ``resident`` the blocks per SM ``kernels`` (``walk_kernels``' dict) gives it."""
    resident = {number: blocks for number, blocks in kernels.values() if number}
    rows = times.assign(name=times.kernel, kernel=times.kernel.map(kernel_number))
    rows = rows[rows.kernel.notna()].astype({"kernel": int})
    return rows.assign(resident=rows.kernel.map(resident))


def bound(cost: float, resident: float) -> str:
    """``latency``, ``mixed`` or ``throughput`` from the cost at load 2 (see the module's
    docstring); empty where fewer than 2 blocks are resident or cost is missing."""
    if not resident or resident < 2 or cost != cost:
        return ""
    return (
        "latency" if cost < LATENCY_BELOW else "throughput" if cost > THROUGHPUT_ABOVE else "mixed"
    )


def scaled(rows: pd.DataFrame, n: int) -> pd.DataFrame:
    """``rows`` (one per dtype, variant, kernel and load, with ``us_per_call``) with
    ``us_per_chunk`` and ``cost`` (against load 1 of the same dtype, variant and kernel)."""
    keys = ["dtype", "variant", "kernel"]
    base = rows[rows.load == 1].set_index(keys).us_per_call.rename("base")
    out = rows.join(base, on=keys)
    out["us_per_chunk"] = out.us_per_call / math.ceil(n / CHUNK)
    out["cost"] = out.us_per_call / out.base
    return out.drop(columns="base")


def summary(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per dtype, variant and kernel: resident blocks, µs per chunk at load 1, cost at
    every load (columns ``cost@<load>``) and the ``bound`` that load 2 says."""
    keys = ["dtype", "variant", "kernel"]
    costs = rows.pivot_table(index=keys, columns="load", values="cost")
    costs.columns = [f"cost@{load:g}" for load in costs.columns]
    first = rows[rows.load == 1].set_index(keys)[["resident", "us_per_chunk"]]
    table = first.join(costs, how="outer").reset_index()
    at2 = table["cost@2"] if "cost@2" in table else pd.Series(float("nan"), index=table.index)
    table["bound"] = [bound(c, r) for c, r in zip(at2, table.resident, strict=True)]
    return table


def walk_kernels(ext, dtype: torch.dtype, dim: int, variant: str) -> dict:
    """The extension's ``walk_kernels`` for ``dtype`` operands with F = M = ``dim`` under
    ``variant`` (one of ``cuda_backend.VARIANTS``):
    ``{"product": (kernel, resident), "dkv": (kernel, resident)}``."""
    kernel, _, together = cuda_backend.VARIANTS[variant]
    x = torch.empty(1, device="cuda", dtype=dtype)
    return ext.walk_kernels(x, dim, dim, kernel == "walk_mma", walks_together=together)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=8192, help="sequence length (8192)")
    p.add_argument("--dim", type=int, default=64, help="F = M (64)")
    p.add_argument(
        "--loads",
        type=float,
        nargs="+",
        default=[1, 2, 3, 4],
        help="B·H in units of the GPU's SMs (1 2 3 4; 1 is needed for cost)",
    )
    dtypes = cuda_profile.DTYPES
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=dtypes)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--steps", type=int, default=3, help="profiled fwd+bwd steps per case (3)")
    p.add_argument("--out", type=expanded_path, default=Path("benchmarks/results/cuda_scaling.csv"))
    args = p.parse_args(argv)
    if min(args.n, args.dim, args.steps) < 1:
        p.error("--n, --dim and --steps must be positive")
    if min(args.loads) <= 0:
        p.error("--loads must be positive")
    if 1 not in args.loads:
        p.error("--loads must include 1 (cost is measured against it)")
    if problem := output_file_problem(args.out):
        p.error(f"--out {args.out}: {problem}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ext = cuda_backend.extension() if torch.cuda.is_available() else None
    if ext is None or "cuda" not in ks.backends():
        print(
            "benchmarks/cuda_scaling.py needs a GPU and the cuda backend; none here",
            file=sys.stderr,
        )
        return 1
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    date = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    frames, failed, measured = [], [], set()
    cases = [(d, v, load) for d in args.dtypes for v in args.variants for load in args.loads]
    for name, variant, load in cases:
        dtype, bh = getattr(torch, name), max(1, round(load * sms))
        try:
            kernels = walk_kernels(ext, dtype, args.dim, variant)
            same = (name, load, kernels["product"][0], kernels["dkv"][0])
            if same in measured:  # e.g. walk_fused_apart in float32: walk_fused's kernels
                continue
            measured.add(same)
            times = cuda_profile.kernel_times(
                dtype, bh, 1, args.n, args.dim, variant, args.steps, 1
            )
        except Exception as err:  # one case failing keeps the others
            failed.append(f"{variant} ({name}, load {load:g})")
            case = f"{variant} in {name} at load {load:g}"
            if not cuda_profile.case_failed("cuda_scaling.py", case, err):
                break
            continue
        rows = walk_rows(times, kernels)
        frames.append(rows.assign(dtype=name, variant=variant, load=load, BH=bh, sms=sms))
        result = scaled(pd.concat(frames, ignore_index=True), args.n).assign(
            N=args.n,
            F=args.dim,
            device=torch.cuda.get_device_name(),
            date=date,
            torch=torch.__version__,
            command=cuda_backend.command_line(sys.argv),
        )
        atomic_write_text(args.out, result.to_csv(index=False))  # as it goes, never half a CSV
    if not frames:
        print(
            f"benchmarks/cuda_scaling.py: nothing measured; {args.out} left as it was",
            file=sys.stderr,
        )
        return 1
    with pd.option_context("display.width", 200):
        print(summary(result).round(3).to_string(index=False))
    print(f"wrote {args.out}", file=sys.stderr)
    if failed:
        print(f"benchmarks/cuda_scaling.py: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
