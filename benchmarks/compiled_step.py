"""A model's training step, in eager mode against ``torch.compile(model, fullgraph=True)``.

For each attention (kernel attention with ``--feature-map``; softmax attention) and sequence length
N, the median time of a training step (forward, cross-entropy, backward; no optimizer) of a
causal LM (``--model lm``) or a sequence classifier (``--model classifier``) on ``(B,N)``
tokens in eager mode and compiled whole by inductor (one graph: the core's kernels are custom ops
in it; ``--mode``: torch.compile's), in the same run, and their ratio (``speedup``: eager /
compiled). The compiled rows give the compile time (``compile_s``: the first compiled step, less a
step; a cold compile, inductor's caches off for it: with its on-disk cache from an earlier run
the same case read 6 s for a cold 36 s; CSVs written before 2026-12-01 may hold such warm
times) and ``max_grad_diff``: the largest difference between the two ways' gradients, relative to
the largest eager gradient of the same parameter. The dense matmul rate of the run's dtype is
measured in the same run as a yardstick (``matmul_gflops``), beside each way's achieved rate of the
model's matrix products (``gflops``: 6 FLOPs per weight per token for the forward and backward,
attention's own products not counted).

    python benchmarks/compiled_step.py --quick
    python benchmarks/compiled_step.py --device cuda --dtype bfloat16 --mode reduce-overhead \\
        --out benchmarks/results/compiled_step_cuda.csv
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

# the shared flags and model of the LM benchmarks (this folder is on sys.path when run as a
# script; not when imported by path, as the tests do)
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))
import lm_cases  # noqa: E402

import kernelstudy as ks  # noqa: E402
from kernelstudy.progress import run_script  # noqa: E402

WAYS = ("eager", "compiled")
#: torch.compile's modes (``reduce-overhead``: CUDA graphs, on a GPU)
MODES = {
    "default": None,
    "reduce-overhead": "reduce-overhead",
    "max-autotune-no-cudagraphs": "max-autotune-no-cudagraphs",
}


#: classes of the classifier (``--model classifier``)
CLASSES = 10


def train_step(run, model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """One step of cross-entropy on ``ids: (B,N)`` through ``run`` (the model or its compiled
    form): next-token for a causal LM; for a classifier, labels ``ids[:, 0] % CLASSES``. The
    gradients of ``model``'s parameters (zeroed first)."""
    model.zero_grad(set_to_none=True)
    logits = run(ids)
    if isinstance(model, ks.nn.CausalLM):
        logits, labels = logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()
    else:
        labels = ids[:, 0] % CLASSES
    F.cross_entropy(logits.float(), labels).backward()
    return [p.grad for p in model.parameters()]


def weight_flops(model: torch.nn.Module, tokens: int) -> float:
    """6 FLOPs per weight of the model's matrices per token: 2 forward, 4 backward (embeddings
    are lookups)."""
    return 6.0 * lm_cases.matrix_weights(model) * tokens


def max_relative_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest ``max|g - w| / max|w|`` over pairs of gradients (a zero ``w``: ``max|g|``)."""
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        scale = float(w.abs().max()) or 1.0
        worst = max(worst, float((g.float() - w.float()).abs().max()) / scale)
    return worst


def benchmark(args: argparse.Namespace) -> pd.DataFrame:
    """One row per attention, sequence length and way to run the step."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rate = ks.analysis.matmul_rate(device, dtype, repeats=3)
    about = lm_cases.run_columns(args, "compiled_step.py", rate)
    cases = [(a, n) for a in args.attentions for n in args.seq_lens]

    def rows_of(attention: str, length: int) -> list[dict]:
        rows = []
        classes = CLASSES if args.model == "classifier" else 0
        model = lm_cases.build_model(args, attention, max(args.seq_lens), classes)
        gen = torch.Generator().manual_seed(length)
        ids = torch.randint(args.vocab, (args.batch, length), generator=gen).to(device)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, mode=MODES[args.mode])
        runs = {"eager": model, "compiled": compiled}
        grads, first = {}, {}
        for way, run in runs.items():
            start = time.perf_counter()
            with cold_compile():
                grads[way] = [g.clone() for g in train_step(run, model, ids)]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            first[way] = time.perf_counter() - start
        times = {}
        for way, run in runs.items():
            call = functools.partial(train_step, run, model, ids)
            times[way] = statistics.median(ks.analysis.time_call(call, device, args.repeats))
        flops = weight_flops(model, args.batch * length)
        diff = max_relative_diff(grads["compiled"], grads["eager"])
        for way in WAYS:
            is_compiled = way == "compiled"
            rows.append(
                lm_cases.case_columns(args, attention)
                | {
                    "way": way,
                    "model": args.model,
                    "seq_len": length,
                    "mode": args.mode if is_compiled else "",
                    "time_ms": times[way] * 1e3,
                    "tokens_per_s": args.batch * length / times[way],
                    "gflops": flops / times[way] / 1e9,
                    "frac_matmul": flops / times[way] / 1e9 / rate,
                    "speedup": times["eager"] / times[way],
                    "compile_s": first[way] - times[way] if is_compiled else 0.0,
                    "max_grad_diff": diff if is_compiled else 0.0,
                }
                | about
            )
        return rows

    return lm_cases.measure(cases, "compiled step", rows_of)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", help="N (default 256 1024 4096)")
    p.add_argument("--quick", action="store_true", help="N in {128, 512}, 3 repeats, unless given")
    p.add_argument("--mode", default="default", choices=list(MODES), help="torch.compile's mode")
    p.add_argument(
        "--model",
        default="lm",
        choices=["lm", "classifier"],
        help="a causal LM (default) or a sequence classifier (mean pooling, 10 classes)",
    )
    lm_cases.add_model_arguments(p, "benchmarks/results/compiled_step.csv")
    args = lm_cases.parse_model_arguments(p, argv)
    if args.seq_lens is None:
        args.seq_lens = [128, 512] if args.quick else [256, 1024, 4096]
    args.seq_lens = list(dict.fromkeys(args.seq_lens))  # one case per value given
    lm_cases.check_model_arguments(p, args, {})
    if min(args.seq_lens) < 2:
        p.error("--seq-lens must be at least 2 (a step predicts each next token)")
    return args


@contextlib.contextmanager
def cold_compile() -> Iterator[None]:
    """Inductor's caches off (its on-disk cache, kept between runs, and the in-memory ones):
    the first compiled step compiles from scratch, whatever ran before."""
    with warnings.catch_warnings(), torch._inductor.config.patch(force_disable_caches=True):
        warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")  # said so
        yield


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if lm_cases.no_gpu_for("compiled_step.py", args):
        return 1
    return lm_cases.finish(benchmark(args), args, "seq_len", "eager", "compiled")


if __name__ == "__main__":
    sys.exit(run_script(main))
