"""Autoregressive generation: greedy decoding with and without a per-step state, and its cost.

A causal language model here is any module with

- ``model(input_ids: (B,N) long) -> logits (B,N,V)`` (the batch causal forward), and
- ``model.step(token_ids: (B,) long, state) -> (logits (B,V), state)`` (one step; ``state``
  None to start) — a :class:`~kernelstudy.core.RecurrentState` per layer for kernel
  attention (RNN mode, constant memory) or a growing KV cache for softmax attention.

Three ways to generate (the question of "Transformers are RNNs" and its replications):
``"step"`` with a kernel model (RNN mode), ``"full"`` (re-run the whole prefix every
step: softmax without a KV cache, the paper's baseline) and ``"step"`` with a softmax
model (KV cache, the fair baseline).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping

import pandas as pd
import torch
from torch import nn

from ..arguments import check_count, check_real
from ..core.validation import check_device
from ..nn.models import check_token_ids
from ..nn.modes import module_mode
from .speed import time_call

MODES = ("step", "full")


def state_bytes(state: object) -> int:
    """Total bytes of the tensors in a (nested) generation state."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, Mapping):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(state_bytes(v) for v in state)
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        return sum(state_bytes(getattr(state, f.name)) for f in dataclasses.fields(state))
    return 0


def _check_lm(model: nn.Module, prompt: torch.Tensor, steps: int, mode: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "step" and not callable(getattr(model, "step", None)):
        raise ValueError("mode='step' needs a model with a step(token_ids, state) method")
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.dtype != torch.long:
        raise ValueError("prompt must be a (batch, length) long tensor of token ids")
    if prompt.shape[1] < 1:
        raise ValueError("prompt must hold at least one token")
    vocab = getattr(model, "vocab_size", None)
    if isinstance(vocab, int):  # else the step's check names "token"
        check_token_ids(prompt, vocab, "prompt")
    check_count("steps", steps, 0)


@torch.no_grad()
def generate(
    model: nn.Module, prompt: torch.Tensor, steps: int, mode: str = "step"
) -> tuple[torch.Tensor, object]:
    """Greedy decoding of ``steps`` tokens after ``prompt: (B,P)``.

    ``mode="step"`` feeds one token at a time through ``model.step``, after reading the
    prompt in one block where the model has ``steps(tokens (B,P), state) -> (logits
    (B,P,V), state)`` (:class:`~kernelstudy.nn.CausalLM` has; else the prompt is stepped
    too); ``mode="full"`` re-runs ``model(prefix)`` on the whole prefix for every
    new token. Both run the model ``P + steps - 1`` token positions deep and no
    further: the last new token is never fed back. Returns the ``(B, P+steps)``
    tokens and the state after every token but the last (after the whole prompt
    when ``steps`` is 0; None for ``"full"``): feed the last token to ``model.step``
    with it to go on.

    Runs in eval mode (each submodule's mode is restored): in training, dropout would make the
    decoding random, and a map that redraws its features (``redraw_every``) would redraw at
    every ``"full"`` forward and refuse ``"step"``. Every prompt has P real tokens (no
    padding mask; :meth:`kernelstudy.nn.CausalLM.generate` takes prompts of different
    lengths).
    """
    _check_lm(model, prompt, steps, mode)
    with module_mode(model, False):
        return _generate(model, prompt, steps, mode)


def _generate(
    model: nn.Module, prompt: torch.Tensor, steps: int, mode: str
) -> tuple[torch.Tensor, object]:
    """:func:`generate` on a checked model in eval mode."""
    tokens = prompt
    if mode == "full":
        for _ in range(steps):
            logits = model(tokens)[:, -1]
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], 1)
        return tokens, None
    state = None
    out = [prompt]
    if callable(getattr(model, "steps", None)):  # the prompt in one block
        logits, state = model.steps(prompt, None)
        logits = logits[:, -1]
    else:
        for t in range(prompt.shape[1]):
            logits, state = model.step(prompt[:, t], state)
    for i in range(steps):
        nxt = logits.argmax(-1)
        out.append(nxt[:, None])
        if i + 1 < steps:  # the last token's logits would not be used
            logits, state = model.step(nxt, state)
    return torch.cat(out, 1), state


def benchmark_generation(
    runs: Mapping[str, tuple[nn.Module, str]],
    lengths: list[int],
    batch: int = 1,
    prompt_len: int = 1,
    device: str | torch.device = "cpu",
    repeats: int = 3,
    warmup: int = 1,
    time_limit_s: float | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
) -> pd.DataFrame:
    """Throughput and memory of generating ``lengths`` tokens, per labelled way to generate.

    Args:
        runs: ``{label: (model, mode)}``, e.g. ``{"linear, RNN state": (lin, "step"),
            "softmax, no cache": (soft, "full"), "softmax, KV cache": (soft, "step")}``.
        lengths: numbers of generated tokens (ascending: see ``time_limit_s``).
        batch, prompt_len: B sequences, each with a random prompt of this length.
        device: models are moved there.
        repeats, warmup: timed (median taken) and untimed generations per measurement (warm-up
            generates ``min(lengths)`` tokens).
        time_limit_s: once a run takes longer than this, skip its longer lengths.
        vocab_size: prompt tokens are drawn from ``[0, vocab_size)`` (default: the
            model's output size, read from one forward).
        seed: of the random prompts.

    Returns:
        Long table: ``label``, ``mode``, ``length``, ``batch``, ``metric``
        (``time_s`` median of one :func:`generate` call, which reads the prompt too: one
        block (or P steps) for ``"step"``, a forward over it for ``"full"``;
        ``tokens_per_s`` = B·length/time, new tokens only; ``state_mb`` = size of
        the RNN state or KV cache at the end, over ``prompt_len + length - 1`` tokens,
        in MiB (2**20 bytes), NaN for ``"full"``; the tokens held, while a KV cache's
        buffers have room for up to twice as many (capacity doubling, at least 64 tokens);
        ``peak_memory_mb`` on CUDA, MiB),
        ``value``, ``note``.
    """
    device = check_device("device", device)
    if not runs:
        raise ValueError("runs must name at least one (model, mode)")
    if not isinstance(runs, Mapping):
        raise TypeError(f"runs must be a dict {{label: (model, mode)}}, got {type(runs).__name__}")
    for label, entry in runs.items():
        if not (isinstance(entry, tuple | list) and len(entry) == 2):
            raise TypeError(f"runs[{label!r}] must be a (model, mode) pair, got {entry!r}")
        if not isinstance(entry[0], nn.Module):
            raise TypeError(f"runs[{label!r}]: model must be a torch.nn.Module, got {entry[0]!r}")
        mode = entry[1]  # before any model is moved or run
        if mode not in MODES:
            raise ValueError(f"runs[{label!r}]: mode must be one of {MODES}, got {mode!r}")
        if mode == "step" and not callable(getattr(entry[0], "step", None)):
            raise ValueError(
                f"runs[{label!r}]: mode='step' needs a model with a step(token_ids, state) method"
            )
    if isinstance(lengths, str | int) or not lengths:
        raise TypeError(f"lengths must be a non-empty list of ints, got {lengths!r}")
    for n in lengths:
        check_count("lengths entries", n, 1)
    for name, value in (("batch", batch), ("prompt_len", prompt_len), ("repeats", repeats)):
        check_count(name, value, 1)
    check_count("warmup", warmup, 0)
    if vocab_size is not None:
        check_count("vocab_size", vocab_size, 1)
        for label, (model, _) in runs.items():  # the prompts' check would name "prompt"
            own = getattr(model, "vocab_size", None)
            if isinstance(own, int) and vocab_size > own:
                raise ValueError(
                    f"vocab_size must be <= the vocabulary of runs[{label!r}] ({own}), "
                    f"got {vocab_size}"
                )
    if time_limit_s is not None:
        check_real("time_limit_s", time_limit_s, strict=True)
    gen = torch.Generator().manual_seed(check_count("seed", seed, 0, 2**64 - 1))
    rows = []
    for label, (model, mode) in runs.items():
        with module_mode(model, False):  # the caller's modes back (it stays on ``device``)
            rows += _generation_rows(
                label, model.to(device), mode, lengths, batch, prompt_len, device,
                repeats, warmup, time_limit_s, vocab_size, gen,
            )  # fmt: skip
    return pd.DataFrame(
        rows, columns=["label", "mode", "length", "batch", "metric", "value", "note"]
    )


def _generation_rows(
    label: str,
    model: nn.Module,
    mode: str,
    lengths: list[int],
    batch: int,
    prompt_len: int,
    device: torch.device,
    repeats: int,
    warmup: int,
    time_limit_s: float | None,
    vocab_size: int | None,
    gen: torch.Generator,
) -> list[dict]:
    """The rows of :func:`benchmark_generation` for one labelled (model, mode)."""
    rows = []
    if vocab_size is None:
        probe = torch.zeros(1, 1, dtype=torch.long, device=device)
        with torch.no_grad():
            vocab = model(probe).shape[-1]
    else:
        vocab = vocab_size
    prompt = torch.randint(vocab, (batch, prompt_len), generator=gen).to(device)
    _check_lm(model, prompt, 0, mode)
    for _ in range(warmup):
        generate(model, prompt, min(lengths), mode)
    skip = ""
    for length in lengths:
        base = {"label": label, "mode": mode, "length": length, "batch": batch}
        if skip:
            rows.append({**base, "metric": "time_s", "value": math.nan, "note": skip})
            continue
        state_box: list = []

        def run(m=model, p=prompt, n=length, md=mode, box=state_box) -> None:
            box.clear()  # the last repeat's state is not held through this one's peak
            box.append(generate(m, p, n, md)[1])

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        seconds = statistics.median(time_call(run, device, repeats, warmup=0))
        rows.append({**base, "metric": "time_s", "value": seconds, "note": ""})
        rows.append(
            {**base, "metric": "tokens_per_s", "value": batch * length / seconds, "note": ""}
        )
        if mode == "step":
            mb, note = state_bytes(state_box[0]) / 2**20, ""
        else:
            mb, note = math.nan, "no state kept: the prefix is recomputed"
        rows.append({**base, "metric": "state_mb", "value": mb, "note": note})
        if device.type == "cuda":
            peak = (torch.cuda.max_memory_allocated(device) - before) / 2**20
            rows.append({**base, "metric": "peak_memory_mb", "value": peak, "note": ""})
        if time_limit_s is not None and seconds > time_limit_s:
            skip = f"skipped: a shorter length took longer than time_limit_s={time_limit_s}"
    return rows


def speedups(
    frame: pd.DataFrame, numerator: str, denominator: str, by: str = "label"
) -> pd.DataFrame:
    """Per length: ``tokens_per_s`` of run ``numerator`` divided by that of ``denominator``
    (repeats averaged); ``by`` is the column naming the runs (``"run"`` in the generation
    study's results). Columns ``batch`` and ``device`` that vary in ``frame`` are kept as
    keys beside ``length``: a speed-up is taken within one batch size and one device, never
    of timings averaged across them."""
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(
            f"frame must be a pandas DataFrame (benchmark_generation's), got {type(frame).__name__}"
        )
    missing = [c for c in ("metric", "value", "length") if c not in frame]
    if missing:
        raise ValueError(
            f"frame has no column(s) {missing} of benchmark_generation's table "
            f"(has {list(frame.columns)})"
        )
    if by not in frame:
        raise ValueError(f"frame has no column {by!r} naming the runs (has {list(frame.columns)})")
    rows = frame[frame["metric"] == "tokens_per_s"]
    keys = ["length", *(c for c in ("batch", "device") if c in rows and rows[c].nunique() > 1)]
    tps = rows.pivot_table(index=keys, columns=by, values="value", aggfunc="mean")
    for label in (numerator, denominator):
        if label not in tps:
            raise ValueError(f"no tokens_per_s rows for run {label!r} (runs: {list(tps.columns)})")
    return (tps[numerator] / tps[denominator]).rename("speedup").reset_index()
