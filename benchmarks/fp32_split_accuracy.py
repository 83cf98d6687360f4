"""How accurate float32 products are when tensor cores compute them from split operands.

Tensor cores multiply tf32 (10 explicit mantissa bits) or bf16 (7) operands exactly and add in
float32. A float32 operand ``x`` split into ``hi = round(x)`` and ``lo = round(x - hi)`` gives
``x·y ≈ hi_x·hi_y + hi_x·lo_y + lo_x·hi_y`` (the ``x3`` methods: three products); ``x1`` keeps
``hi_x·hi_y`` alone. This emulates each on the CPU (the roundings bit for bit, the float32 sums
as a float32 matmul) inside the chunked causal product the CUDA kernels compute (intra-chunk
scores and their product with v, chunk states summed in float32, the queries' product with the
prefix state), for the product and for the backward's ``dq = causal(g, v, k)``, and gives the
max relative error against float64 (scale at least 1), as the GPU tests measure float32 (their
tolerance: 1e-4). ``tf32x3`` is the cuda backend's float32 mode (3xTF32); ``bf16x3`` does the
same work in bf16 products, which run at twice tf32's rate on A100, H100 and H200 (the register
walks' build variant ``-DKS_FP32_BF16X3``, ``csrc/cuda/register_walk_kernels.cuh``).

    python benchmarks/fp32_split_accuracy.py --out benchmarks/results/fp32_split_accuracy.csv
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from kernelstudy.arguments import expanded_path
from kernelstudy.files import atomic_write_text, output_file_problem
from kernelstudy.progress import run_script

METHODS = ("fp32", "tf32x3", "bf16x3", "tf32x1", "bf16x1")
#: (B, H, N, F, M): the GPU tests' shapes (N not a multiple of 64, F≠M, F=M=256), and long N
SHAPES = [
    (2, 3, 37, 8, 5),
    (3, 2, 130, 96, 40),
    (2, 2, 200, 33, 70),
    (1, 2, 129, 256, 256),
    (1, 1, 4099, 64, 64),
    (1, 1, 16384, 64, 64),
]
CHUNK = 64


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 ``x`` rounded to ``bits`` explicit mantissa bits, to nearest with ties away from
    zero (``cvt.rna.tf32.f32``), kept in float32."""
    if x.dtype != torch.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    drop = 23 - bits
    i = x.contiguous().view(torch.int32)
    return ((i + (1 << (drop - 1))) & ~((1 << drop) - 1)).view(torch.float32)


def split(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)`` of float32 ``x`` in ``kind`` (``tf32`` or ``bf16``), both as float32."""
    if kind == "tf32":
        hi = round_mantissa(x, 10)
        return hi, round_mantissa(x - hi, 10)
    hi = x.to(torch.bfloat16).float()
    return hi, (x - hi).to(torch.bfloat16).float()


def matmul(a: torch.Tensor, b: torch.Tensor, method: str) -> torch.Tensor:
    """``a @ b`` by ``method`` (one of :data:`METHODS`; ``fp32``: plain, in the inputs' dtype)."""
    if method == "fp32":
        return a @ b
    kind, terms = method.split("x")
    a_hi, a_lo = split(a, kind)
    b_hi, b_lo = split(b, kind)
    out = a_hi @ b_hi
    return out + (a_hi @ b_lo + a_lo @ b_hi) if terms == "3" else out


def causal_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, method: str) -> torch.Tensor:
    """``Σ_{j≤i} (q_i·k_j) v_j`` of ``(B,H,N,F)``, ``(B,H,N,F)``, ``(B,H,N,M)`` in chunks of
    :data:`CHUNK`, every product by ``method``; chunk states summed in the inputs' dtype."""
    b, h, n, f = q.shape
    m = v.shape[-1]
    pad = (-n) % CHUNK
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    c = (n + pad) // CHUNK
    qc, kc = q.view(b, h, c, CHUNK, f), k.view(b, h, c, CHUNK, f)
    vc = v.view(b, h, c, CHUNK, m)
    out = matmul(torch.tril(matmul(qc, kc.transpose(-1, -2), method)), vc, method)
    states = matmul(kc.transpose(-1, -2), vc, method).cumsum(2)
    prefix = torch.cat([torch.zeros_like(states[:, :, :1]), states[:, :, :-1]], 2)
    out = out + matmul(qc, prefix, method)
    return out.reshape(b, h, c * CHUNK, m)[:, :, :n]


def max_relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want| / max(max|want|, 1)`` (the GPU tests' float32 measure)."""
    scale = max(float(want.abs().max()), 1.0)
    return float((got.double() - want).abs().max()) / scale


def measure(shapes: list[tuple[int, ...]], seed: int) -> pd.DataFrame:
    """One row per shape, quantity (``product``, ``dq``) and method."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for shape in shapes:
        b, h, n, f, m = shape
        q, k = (torch.rand(b, h, n, f, generator=gen) for _ in "qk")
        v, g = (torch.randn(b, h, n, m, generator=gen) for _ in "vg")
        cases = {"product": (q, k, v), "dq": (g, v, k)}  # dq = causal(g, v, k)
        for quantity, args in cases.items():
            want = causal_product(*(t.double() for t in args), "fp32")
            for method in METHODS:
                error = max_relative_error(causal_product(*args, method), want)
                row = dict(zip("BHNFM", shape, strict=True))
                rows.append(row | {"quantity": quantity, "method": method, "max_rel_err": error})
    return pd.DataFrame(rows)


def parse_shape(text: str) -> tuple[int, ...]:
    """``BxHxNxFxM`` → a tuple of five positive ints (argparse type)."""
    try:
        shape = tuple(int(x) for x in text.split("x"))
    except ValueError:
        shape = ()
    if len(shape) != 5 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected BxHxNxFxM of positive ints, got {text!r}")
    return shape


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--shapes",
        type=parse_shape,
        nargs="+",
        help="BxHxNxFxM (default: the GPU tests' and long N)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", type=expanded_path, default=Path("benchmarks/results/fp32_split_accuracy.csv")
    )
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.shapes = args.shapes or SHAPES
    if problem := output_file_problem(args.out):
        p.error(f"--out {args.out}: {problem}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    frame = measure(args.shapes, args.seed)
    frame["torch"] = torch.__version__
    frame["date"] = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    frame["command"] = shlex.join(["python", "benchmarks/fp32_split_accuracy.py", *args.argv])
    atomic_write_text(args.out, frame.to_csv(index=False))
    table = frame.pivot_table(
        index="method", columns="quantity", values="max_rel_err", aggfunc="max"
    )
    print(table.loc[list(METHODS)].map(lambda x: f"{x:.1e}").to_string())
    print(f"largest over {len(args.shapes)} shapes; the GPU tests' float32 tolerance is 1e-4; "
          f"wrote {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
