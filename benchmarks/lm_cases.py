"""What the causal-LM benchmarks (``prefill.py``, ``compiled_step.py``) share: the model and run
flags and their checks, the model each case builds, the columns that describe a run, the
model's matrix weights (for FLOP counts), the cases' loop (Ctrl-C keeps what it measured), and
the CSV and table a run leaves."""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch

# the CPU benchmark's device name and argument checks (this folder is on sys.path when run as a
# script; not when imported by path, as the tests do)
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))
from core import (  # noqa: E402
    add_dtype_and_device,
    check_sizes_and_device,
    device_name,
    rows_until_interrupted,
)

import kernelstudy as ks  # noqa: E402
from kernelstudy.arguments import expanded_path  # noqa: E402
from kernelstudy.files import atomic_write_text, output_file_problem  # noqa: E402
from kernelstudy.progress import tqdm  # noqa: E402
from kernelstudy.revision import with_commit  # noqa: E402

ATTENTIONS = ("kernel", "softmax")


def add_model_arguments(p: argparse.ArgumentParser, default_out: str) -> None:
    """The flags of the model (attention, map, sizes, dtype, device) and of the run."""
    p.add_argument(
        "--attentions",
        nargs="+",
        default=list(ATTENTIONS),
        choices=ATTENTIONS,
        help="(default: both)",
    )
    p.add_argument("--feature-map", default="elu", help="the kernel runs' map (default elu)")
    p.add_argument("--batch", type=int, default=4, help="(default %(default)s)")
    p.add_argument("--d-model", type=int, default=128, help="(default %(default)s)")
    p.add_argument("--n-heads", type=int, default=4, help="(default %(default)s)")
    p.add_argument("--n-layers", type=int, default=2, help="(default %(default)s)")
    p.add_argument("--vocab", type=int, default=256, help="(default %(default)s)")
    add_dtype_and_device(p)
    p.add_argument("--repeats", type=int, help="timed calls per case and way (default 5)")
    p.add_argument(
        "--out",
        type=expanded_path,
        default=Path(default_out),
        help="CSV to write (default %(default)s, under the working directory)",
    )


def parse_model_arguments(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``p``'s arguments (``argv``, or the command line's), with ``args.argv`` kept for the
    ``command`` column and ``--repeats`` defaulting to 3 with ``--quick``, else 5."""
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.attentions = list(dict.fromkeys(args.attentions))  # one case per value given
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    return args


def check_model_arguments(
    p: argparse.ArgumentParser, args: argparse.Namespace, lengths: dict[str, int]
) -> None:
    """Exit through ``p.error`` (status 2) for a size below 1 (``lengths``: the script's own
    length flags and their smallest values), a device torch cannot parse, a ``--d-model`` that
    ``--n-heads`` does not divide, an unknown ``--feature-map``, or an ``--out`` that cannot
    be written (before the run rather than after it)."""
    sizes = lengths | {
        "--repeats": args.repeats,
        "--batch": args.batch,
        "--d-model": args.d_model,
        "--n-heads": args.n_heads,
        "--n-layers": args.n_layers,
        "--vocab": args.vocab,
    }
    check_sizes_and_device(p, sizes, args.device)
    if problem := output_file_problem(args.out):
        p.error(f"--out {args.out}: {problem}")
    if args.d_model % args.n_heads:
        p.error(f"--d-model {args.d_model} must be divisible by --n-heads {args.n_heads}")
    if args.feature_map not in ks.list_feature_maps():
        p.error(f"--feature-map: unknown {args.feature_map!r}; one of {ks.list_feature_maps()}")


def no_gpu_for(script: str, args: argparse.Namespace) -> bool:
    """True, saying so on stderr, where ``--device`` is a CUDA device and there is no GPU."""
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print(f"benchmarks/{script}: --device {args.device}: no CUDA GPU here", file=sys.stderr)
        return True
    return False


def build_model(
    args: argparse.Namespace, attention: str, max_len: int, classes: int = 0
) -> ks.nn.CausalLM | ks.nn.SequenceClassifier:
    """A causal LM (or, with ``classes``, a sequence classifier) of the flags' sizes with
    ``attention`` (``kernel``: ``--feature-map``), no dropout, seeded with 0, on ``--device`` in
    ``--dtype``."""
    torch.manual_seed(0)
    kind = {"attention": "softmax"} if attention == "softmax" else {"feature_map": args.feature_map}
    cls, sizes = (
        (ks.nn.SequenceClassifier, (args.vocab, classes))
        if classes
        else (ks.nn.CausalLM, (args.vocab,))
    )
    model = cls(
        *sizes,
        d_model=args.d_model,
        n_heads=args.n_heads,
        n_layers=args.n_layers,
        dropout=0.0,
        max_len=max_len,
        **kind,
    )
    return model.to(torch.device(args.device), getattr(torch, args.dtype))


def run_columns(args: argparse.Namespace, script: str, matmul_gflops: float) -> dict[str, object]:
    """The columns that describe the run on every row: device, dtype, torch and its CPU
    thread count (softmax's last bits depend on it), kernelstudy (``+git.<commit>`` in a
    checkout), date, the command and the same run's matmul rate."""
    return {
        "device": device_name(torch.device(args.device)),
        "dtype": args.dtype,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "kernelstudy": with_commit(ks.__version__),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(["python", f"benchmarks/{script}", *args.argv]),
        "matmul_gflops": matmul_gflops,
    }


def case_columns(args: argparse.Namespace, attention: str) -> dict[str, object]:
    """The model's columns on a case's rows."""
    return {
        "attention": attention,
        "feature_map": args.feature_map if attention == "kernel" else "",
        "batch": args.batch,
        "d_model": args.d_model,
        "n_layers": args.n_layers,
    }


def matrix_weights(model: torch.nn.Module) -> int:
    """The weights of the model's matrices (embeddings, which are lookups, left out)."""
    return sum(
        p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name
    )


def measure(
    cases: list[tuple[str, int]], desc: str, rows_of: Callable[[str, int], list[dict]]
) -> pd.DataFrame:
    """The rows of ``rows_of(attention, length)`` for each case, with a progress bar. Ctrl-C
    stops at the case it is in and keeps the ones measured before (``frame.attrs
    ["interrupted"]``: :func:`finish` writes them and exits 130)."""
    bar = tqdm(cases, desc=desc, unit="case")
    rows, interrupted = rows_until_interrupted(bar, lambda case: rows_of(*case))
    frame = pd.DataFrame(rows)
    frame.attrs["interrupted"] = interrupted
    return frame


def finish(frame: pd.DataFrame, args: argparse.Namespace, length: str, base: str, way: str) -> int:
    """The exit status after :func:`write_and_show`: 0, or 130 where Ctrl-C stopped the run
    (``frame.attrs["interrupted"]``): its cases measured so far are written, and ``--out`` is
    left as it was where there were none."""
    interrupted = bool(frame.attrs.get("interrupted"))
    if frame.empty:
        print(f"interrupted before any case; {args.out} left as it was", file=sys.stderr)
        return 130
    write_and_show(frame, args, length, base, way)
    if interrupted:
        print(f"interrupted: {args.out} holds the cases measured before", file=sys.stderr)
    return 130 if interrupted else 0


def write_and_show(
    frame: pd.DataFrame, args: argparse.Namespace, length: str, base: str, way: str
) -> None:
    """Write ``frame`` to ``--out`` (atomically) and print its times (ms) by attention and
    ``length`` column, with ``speedup``: the ``base`` way's time over ``way``'s."""
    atomic_write_text(args.out, frame.to_csv(index=False))
    table = frame.pivot_table(
        index=["attention", length], columns="way", values="time_ms", aggfunc="first"
    )
    table["speedup"] = table[base] / table[way]
    print(table.round(2).to_string())
    print(f"matmul {frame.matmul_gflops.iloc[0]:.1f} GFLOP/s ({args.dtype}); wrote {args.out}")
