"""Reading a prompt: a causal LM's prompt token by token (``step``) against one block (``steps``).

For each attention (kernel attention with ``--feature-map``, in RNN mode; softmax attention
with a KV cache) and prompt length P, the median time to read a ``(B, P)`` prompt into the
generation state, both ways in the same run, and their ratio (``speedup``: token by token /
block). Both leave the same state: ``max_logit_diff`` is the largest difference of the last
position's logits. The dense matmul rate of the run's dtype is measured in the same run as a
yardstick (``matmul_gflops``), beside each way's achieved rate of the model's matrix products
(``gflops``: 2 FLOPs per weight per token, attention's own products not counted).

    python benchmarks/prefill.py --quick
    python benchmarks/prefill.py --device cuda --dtype bfloat16 \
        --out benchmarks/results/prefill_cuda.csv
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import shlex
import statistics
import sys
from pathlib import Path

import pandas as pd
import torch

# the CPU benchmark's device name and argument checks (this folder is on sys.path when run as a
# script; not when imported by path, as the tests do)
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))
from core import check_sizes_and_device, device_name  # noqa: E402

import kernelstudy as ks  # noqa: E402
from kernelstudy.files import atomic_write_text  # noqa: E402
from kernelstudy.progress import tqdm  # noqa: E402

WAYS = ("tokens", "block")


def read_prompt(model: ks.nn.CausalLM, prompt: torch.Tensor, way: str) -> torch.Tensor:
    """The logits of the prompt's last position after reading ``prompt: (B,P)`` token by
    token (``way="tokens"``) or in one block (``"block"``); the state is built and dropped."""
    with torch.no_grad():
        if way == "block":
            return model.steps(prompt)[0][:, -1]
        state = None
        for t in range(prompt.shape[1]):
            logits, state = model.step(prompt[:, t], state)
        return logits


def weight_flops(model: ks.nn.CausalLM, tokens: int) -> float:
    """2 FLOPs per weight of the model's matrices per token (embeddings are lookups)."""
    weights = sum(
        p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name
    )
    return 2.0 * weights * tokens


def benchmark(args: argparse.Namespace) -> pd.DataFrame:
    """One row per attention, prompt length and way to read it."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rate = ks.analysis.matmul_rate(device, dtype, repeats=3)
    about = {
        "device": device_name(device),
        "dtype": args.dtype,
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(["python", "benchmarks/prefill.py", *args.argv]),
        "matmul_gflops": rate,
    }
    rows = []
    cases = [(a, p) for a in args.attentions for p in args.prompt_lens]
    for attention, length in tqdm(cases, desc="prefill", unit="case"):
        torch.manual_seed(0)
        kind = (
            {"attention": "softmax"}
            if attention == "softmax"
            else {"feature_map": args.feature_map}
        )
        model = ks.nn.CausalLM(
            args.vocab,
            d_model=args.d_model,
            n_heads=args.n_heads,
            n_layers=args.n_layers,
            dropout=0.0,
            max_len=max(args.prompt_lens),
            **kind,
        )
        model = model.to(device, dtype).eval()
        gen = torch.Generator().manual_seed(length)
        prompt = torch.randint(args.vocab, (args.batch, length), generator=gen).to(device)
        last = {way: read_prompt(model, prompt, way).float() for way in WAYS}
        times = {}
        for way in WAYS:
            call = functools.partial(read_prompt, model, prompt, way)
            seconds = ks.analysis.time_call(call, device, args.repeats)
            times[way] = statistics.median(seconds)
        flops = weight_flops(model, args.batch * length)
        for way in WAYS:
            rows.append(
                {
                    "attention": attention,
                    "feature_map": args.feature_map if attention == "kernel" else "",
                    "way": way,
                    "prompt_len": length,
                    "batch": args.batch,
                    "d_model": args.d_model,
                    "n_layers": args.n_layers,
                    "time_ms": times[way] * 1e3,
                    "tokens_per_s": args.batch * length / times[way],
                    "gflops": flops / times[way] / 1e9,
                    "frac_matmul": flops / times[way] / 1e9 / rate,
                    "speedup": times["tokens"] / times[way],
                    "max_logit_diff": float((last["block"] - last["tokens"]).abs().max()),
                }
                | about
            )
    return pd.DataFrame(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-lens", type=int, nargs="+", help="P (default 64 256 1024 4096)")
    p.add_argument(
        "--attentions", nargs="+", default=["kernel", "softmax"], choices=["kernel", "softmax"]
    )
    p.add_argument("--feature-map", default="elu", help="the kernel runs' map (default elu)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, help="timed reads per case (default 5)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="P in {64, 512}, 3 repeats, unless --prompt-lens/--repeats",
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/prefill_cpu.csv"))
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.prompt_lens is None:
        args.prompt_lens = [64, 512] if args.quick else [64, 256, 1024, 4096]
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    sizes = {
        "--prompt-lens": min(args.prompt_lens),
        "--repeats": args.repeats,
        "--batch": args.batch,
        "--d-model": args.d_model,
        "--n-heads": args.n_heads,
        "--n-layers": args.n_layers,
        "--vocab": args.vocab,
    }
    check_sizes_and_device(p, sizes, args.device)
    if args.d_model % args.n_heads:
        p.error(f"--d-model {args.d_model} must be divisible by --n-heads {args.n_heads}")
    if args.feature_map not in ks.list_feature_maps():
        p.error(f"--feature-map: unknown {args.feature_map!r}; one of {ks.list_feature_maps()}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print(f"benchmarks/prefill.py: --device {args.device}: no CUDA GPU here", file=sys.stderr)
        return 1
    frame = benchmark(args)
    atomic_write_text(args.out, frame.to_csv(index=False))
    table = frame.pivot_table(
        index=["attention", "prompt_len"], columns="way", values="time_ms", aggfunc="first"
    )
    table["speedup"] = table["tokens"] / table["block"]
    print(table.round(2).to_string())
    print(f"matmul {frame.matmul_gflops.iloc[0]:.1f} GFLOP/s ({args.dtype}); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
