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
import functools
import statistics
import sys
from pathlib import Path

import pandas as pd
import torch

# the shared flags and model of the LM benchmarks (this folder is on sys.path when run as a
# script; not when imported by path, as the tests do)
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))
import lm_cases  # noqa: E402

import kernelstudy as ks  # noqa: E402
from kernelstudy.progress import run_script  # noqa: E402

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
    return 2.0 * lm_cases.matrix_weights(model) * tokens


def benchmark(args: argparse.Namespace) -> pd.DataFrame:
    """One row per attention, prompt length and way to read it."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rate = ks.analysis.matmul_rate(device, dtype, repeats=3)
    about = lm_cases.run_columns(args, "prefill.py", rate)
    cases = [(a, p) for a in args.attentions for p in args.prompt_lens]

    def rows_of(attention: str, length: int) -> list[dict]:
        rows = []
        model = lm_cases.build_model(args, attention, max(args.prompt_lens)).eval()
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
                lm_cases.case_columns(args, attention)
                | {
                    "way": way,
                    "prompt_len": length,
                    "time_ms": times[way] * 1e3,
                    "tokens_per_s": args.batch * length / times[way],
                    "gflops": flops / times[way] / 1e9,
                    "frac_matmul": flops / times[way] / 1e9 / rate,
                    "speedup": times["tokens"] / times[way],
                    "max_logit_diff": float((last["block"] - last["tokens"]).abs().max()),
                }
                | about
            )
        return rows

    return lm_cases.measure(cases, "prefill", rows_of)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-lens", type=int, nargs="+", help="P (default 64 256 1024 4096)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="P in {64, 512}, 3 repeats, unless --prompt-lens/--repeats",
    )
    lm_cases.add_model_arguments(p, "benchmarks/results/prefill.csv")
    args = lm_cases.parse_model_arguments(p, argv)
    if args.prompt_lens is None:
        args.prompt_lens = [64, 512] if args.quick else [64, 256, 1024, 4096]
    args.prompt_lens = list(dict.fromkeys(args.prompt_lens))  # one case per value given
    lm_cases.check_model_arguments(p, args, {"--prompt-lens": min(args.prompt_lens)})
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if lm_cases.no_gpu_for("prefill.py", args):
        return 1
    return lm_cases.finish(benchmark(args), args, "prompt_len", "tokens", "block")


if __name__ == "__main__":
    sys.exit(run_script(main))
