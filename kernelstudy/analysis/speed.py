"""Time and peak memory of attention vs sequence length, with the machine's matmul rate.

Times are medians over ``repeats`` calls after ``warmup`` calls that are not
timed; on CUDA they are measured with CUDA events. Peak memory is the memory
allocated above what existed before the call: ``torch.cuda.max_memory_allocated``
on CUDA, the PyTorch profiler's allocation trace on CPU (one extra call).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F

from ..arguments import check_count, check_flag, check_real
from ..core.attention import linear_attention
from ..core.backends import backends as available_backends
from ..core.backends import registered_backends, runs_own_noncausal_attention
from ..core.validation import accumulation_dtype, check_device
from ..nn.functional import resolve_feature_map
from .matrices import MapSpec

METHODS = ("softmax_sdpa", "softmax_explicit", "linear")
PASSES = ("fwd", "fwd+bwd")
COLUMNS = [
    "method",
    "backend",
    "causal",
    "pass",
    "n",
    "batch",
    "heads",
    "head_dim",
    "feature_dim",
    "device",
    "dtype",
    "metric",
    "value",
    "note",
]


def _check_fn(fn: object) -> None:
    if not callable(fn):
        raise TypeError(f"fn must be a callable taking no arguments, got {type(fn).__name__}")


def check_float_dtype(dtype: object) -> None:
    """TypeError unless ``dtype`` is a floating-point torch.dtype."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")


def _check_names(name: str, values: object, allowed: Sequence[str] | None = None) -> None:
    """A non-empty list of names (a bare string was read as its letters), among ``allowed``."""
    if isinstance(values, str) or not isinstance(values, Sequence) or not values:
        raise TypeError(f"{name} must be a non-empty list of names, got {values!r}")
    if allowed is not None:
        bad = [v for v in values if v not in allowed]
        if bad:
            raise ValueError(f"{name} must be among {tuple(allowed)}, got {bad}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(
    fn: Callable[[], object], device: str | torch.device = "cpu", repeats: int = 5, warmup: int = 1
) -> list[float]:
    """Seconds per call of ``fn`` for each of ``repeats`` timed calls (warm-up calls untimed)."""
    _check_fn(fn)
    check_count("repeats", repeats, 1)
    check_count("warmup", warmup, 0)
    device = check_device("device", device)
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream = torch.cuda.current_stream(device)  # device's, not the current device's
            start.record(stream)
            fn()
            end.record(stream)
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence C-level stderr, file descriptor 2 (the profiler's start/stop lines). Not
    ``sys.stderr.fileno()``: under ipykernel that is a copy of the terminal's descriptor
    while fd 2 feeds the notebook's output."""
    fd = 2
    try:
        sys.stderr.flush()
        saved = os.dup(fd)
    except (AttributeError, ValueError, OSError):  # no stderr at all: nothing to silence
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def peak_memory_bytes(fn: Callable[[], object], device: str | torch.device = "cpu") -> int:
    """Peak bytes allocated by one call of ``fn`` above what was allocated before it.

    On CPU, from the profiler's allocation events, by address: a free counts only for a
    block allocated in the call. Blocks from before it that the call frees (old
    gradients, garbage the collector finds) used to count as negative, so the peak came
    out low, even below 0. The cyclic garbage collector is paused for the call.
    """
    _check_fn(fn)
    device = check_device("device", device)
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        _sync(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    paused = gc.isenabled()
    gc.disable()
    try:
        with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
            fn()
    finally:
        if paused:
            gc.enable()
    return _peak_of_allocations(_allocations(p.profiler.kineto_results.experimental_event_tree()))


def _allocations(nodes: Iterable[Any]) -> list[tuple[int, int, int]]:
    """``(time_ns, bytes, address)`` of every allocation event (bytes < 0: a free) in a
    profiler event tree."""
    found, stack = [], list(nodes)
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        extra = node.extra_fields
        if type(extra).__name__ == "_ExtraFields_Allocation":
            found.append((int(node.start_time_ns), int(extra.alloc_size), int(extra.ptr)))
    return sorted(found)


def _peak_of_allocations(events: Iterable[tuple[int, int, int]]) -> int:
    """The highest sum of live bytes over time-ordered ``(time, bytes, address)`` events,
    counting a free (bytes < 0) only where its address was allocated among the events."""
    live: dict[int, int] = {}
    running = peak = 0
    for _, nbytes, address in events:
        if nbytes >= 0:
            running += nbytes
            live[address] = live.get(address, 0) + nbytes
            peak = max(peak, running)
        elif address in live:
            running -= live.pop(address)
    return peak


def matmul_rate(
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    size: int | None = None,
    repeats: int = 5,
) -> float:
    """Measured dense matmul throughput in GFLOP/s (``size×size`` square products of
    random matrices from a fixed seed of their own: the global RNG is left as it was)."""
    check_float_dtype(dtype)
    if size is not None:  # before the device: a bad size is named on any machine
        size = check_count("size", size, 1)
    check_count("repeats", repeats, 1)
    device = check_device("device", device)
    if size is None:
        size = 4096 if device.type == "cuda" else 1024
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=gen).to(device, dtype) for _ in range(2))
    seconds = statistics.median(time_call(lambda: a @ b, device, repeats, warmup=2))
    return 2 * size**3 / seconds / 1e9


def _explicit_softmax(q, k, v, causal: bool) -> torch.Tensor:
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        n = q.shape[2]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _quadratic(method: str, backend: str) -> bool:
    return method == "softmax_explicit" or (method == "linear" and backend == "reference")


def speed_labels(frame: pd.DataFrame) -> pd.Series:
    """The rows of :func:`benchmark_attention`'s table named as ``"method [backend]"``
    (``"linear [torch]"``), or the method alone where the row has no backend (softmax, or
    a frame without the column; read back from CSV, an empty backend is NaN)."""
    if "backend" not in frame.columns:
        return frame["method"].astype(str)
    backend = frame["backend"].fillna("").astype(str)
    return frame["method"].astype(str) + backend.map(lambda b: f" [{b}]" if b else "")


def benchmark_attention(
    seq_lens: Sequence[int],
    head_dim: int = 64,
    value_dim: int | None = None,
    batch: int = 1,
    heads: int = 1,
    feature_map: MapSpec = "elu",
    methods: Sequence[str] = METHODS,
    causal: Sequence[bool] = (False, True),
    passes: Sequence[str] = PASSES,
    backends: Sequence[str] | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    repeats: int = 5,
    warmup: int = 1,
    memory: bool = True,
    max_quadratic_gb: float = 4.0,
    time_limit_s: float | None = None,
    matmul: bool = True,
    seed: int = 0,
) -> pd.DataFrame:
    """Time and memory of one attention layer's core vs sequence length N.

    Args:
        seq_lens: the N values (ascending is best: see ``time_limit_s``).
        head_dim, value_dim: D of q/k and M of v (M defaults to D).
        batch, heads: B and H.
        feature_map: the map of ``linear`` (name, config or FeatureMap); its
            cost is included, as in an attention layer.
        methods: ``softmax_sdpa`` (``scaled_dot_product_attention``),
            ``softmax_explicit`` (materialized N×N matrix) and ``linear``
            (kernel attention; one entry per backend).
        causal: which of non-causal/causal to run.
        passes: ``fwd`` (under ``no_grad``) and/or ``fwd+bwd`` (gradients of q, k, v).
        backends: core backends for ``linear`` (default: those of :func:`kernelstudy.backends`
            that take ``dtype`` tensors on ``device``).
            Non-causal linear attention takes no causal product: it runs with ``torch``,
            ``reference`` (the explicit matrix) and backends with a fused ``attention``
            (e.g. ``cuda``) among those listed; the others would time the torch path again.
        device, dtype: where and in what precision.
        repeats, warmup: timed and untimed calls per measurement.
        memory: also measure peak memory (one extra call).
        max_quadratic_gb: skip explicit-matrix methods whose N×N buffers would exceed this
            (GB; the reference's matrix counted in its accumulation dtype).
        time_limit_s: once a method's median time exceeds this, skip its larger N.
        matmul: add a ``matmul`` row with the measured GFLOP/s of this run.
        seed: of the random q, k and v.

    Returns:
        Long table (columns ``COLUMNS``): metrics ``time_ms`` (median), ``time_ms_min``,
        ``peak_memory_mb`` (MiB, 2**20 bytes); skipped measurements get one row with NaN and
        a ``note``.
    """
    device = check_device("device", device)
    _check_names("methods", methods, METHODS)
    _check_names("passes", passes, PASSES)
    if backends is not None:
        _check_names("backends", backends)
    memory, matmul = check_flag("memory", memory), check_flag("matmul", matmul)
    for name, values, kind in (("seq_lens", seq_lens, int), ("causal", causal, bool)):
        if not isinstance(values, Sequence) or isinstance(values, str) or not values:
            raise TypeError(f"{name} must be a non-empty list of {kind.__name__}, got {values!r}")
    for n in seq_lens:
        check_count("seq_lens entries", n, 1)
    if any(not isinstance(c, bool) for c in causal):
        raise TypeError(f"causal must be a list of bools, got {causal!r}")
    for name, value in (("head_dim", head_dim), ("batch", batch), ("heads", heads)):
        check_count(name, value, 1)
    value_dim = head_dim if value_dim is None else check_count("value_dim", value_dim, 1)
    check_count("repeats", repeats, 1)
    check_count("warmup", warmup, 0)
    if time_limit_s is not None:
        check_real("time_limit_s", time_limit_s, strict=True)
    max_quadratic_gb = check_real("max_quadratic_gb", max_quadratic_gb, strict=True)
    seed = check_count("seed", seed, 0, 2**64 - 1)  # what a torch.Generator takes
    check_float_dtype(dtype)
    known = available_backends()
    example = torch.empty(0, device=device, dtype=dtype)
    takes = [b for b in known if registered_backends()[b].supports(example)]
    if backends is None:
        backends = takes
    missing = [b for b in backends if b not in known]
    if missing:
        raise ValueError(f"backends {missing} are not available here (available: {known})")
    refused = [b for b in backends if b not in takes]
    if refused:
        raise ValueError(
            f"backends {refused} do not take {dtype} tensors on {device} (these do: {takes})"
        )
    fm = resolve_feature_map(feature_map, head_dim, heads)
    if fm is feature_map:  # the caller's module: timed as a copy, left where it is
        fm = copy.deepcopy(fm)
    fm = fm.to(device)
    dtype_name = str(dtype).removeprefix("torch.")
    common = {
        "batch": batch,
        "heads": heads,
        "head_dim": head_dim,
        "device": device.type,
        "dtype": dtype_name,
    }
    rows: list[dict] = []
    if matmul:
        rate = matmul_rate(device, dtype)
        rows.append(
            {
                **common,
                "method": "matmul",
                "backend": "",
                "causal": False,
                "pass": "fwd",
                "n": 0,
                "feature_dim": 0,
                "metric": "gflops",
                "value": rate,
                "note": "",
            }
        )

    variants = []
    for method, is_causal, pass_ in itertools.product(methods, causal, passes):
        if method != "linear":
            variants.append((method, "", is_causal, pass_))
            continue
        names = [b for b in backends if is_causal or runs_own_noncausal_attention(b)]
        for backend in names or ["torch"]:
            variants.append((method, backend, is_causal, pass_))

    gen = torch.Generator(device="cpu").manual_seed(seed)
    # bytes per N×N entry: the explicit softmax keeps the inputs' dtype; the reference's
    # kernel matrix is in the accumulation dtype (float32 for half inputs)
    elem = {
        "softmax_explicit": torch.finfo(dtype).bits // 8,
        "linear": torch.finfo(accumulation_dtype(dtype)).bits // 8,
    }
    for method, backend, is_causal, pass_ in variants:
        too_slow = False
        for n in seq_lens:
            row = {
                **common,
                "method": method,
                "backend": backend,
                "causal": is_causal,
                "pass": pass_,
                "n": n,
                "feature_dim": fm.feature_dim if method == "linear" else 0,
            }
            note = ""
            quad_gb = (
                batch * heads * n * n * elem.get(method, 0) * (4 if pass_ == "fwd+bwd" else 2) / 1e9
            )
            if too_slow:
                note = f"skipped: a shorter N took longer than time_limit_s={time_limit_s}"
            elif _quadratic(method, backend) and quad_gb > max_quadratic_gb:
                note = f"skipped: N×N buffers ~{quad_gb:.1f} GB > max_quadratic_gb"
            if note:
                rows.append({**row, "metric": "time_ms", "value": math.nan, "note": note})
                continue
            q, k = (
                torch.randn(batch, heads, n, head_dim, generator=gen).to(device, dtype)
                for _ in range(2)
            )
            v = torch.randn(batch, heads, n, value_dim, generator=gen).to(device, dtype)
            fn = _make_call(method, backend, is_causal, pass_, q, k, v, fm)
            times = time_call(fn, device, repeats, warmup)
            median = statistics.median(times)
            rows.append({**row, "metric": "time_ms", "value": median * 1e3, "note": ""})
            rows.append({**row, "metric": "time_ms_min", "value": min(times) * 1e3, "note": ""})
            if memory:
                mb = peak_memory_bytes(fn, device) / 2**20
                rows.append({**row, "metric": "peak_memory_mb", "value": mb, "note": ""})
            del q, k, v, fn
            if time_limit_s is not None and median > time_limit_s:
                too_slow = True
    return pd.DataFrame(rows, columns=COLUMNS)


def _make_call(method, backend, causal, pass_, q, k, v, fm) -> Callable[[], None]:
    def attend(q, k, v):
        if method == "softmax_sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        if method == "softmax_explicit":
            return _explicit_softmax(q, k, v, causal)
        phi_q, phi_k = fm(q, is_query=True), fm(k, is_query=False)
        return linear_attention(phi_q, phi_k, v, causal=causal, backend=backend)

    if pass_ == "fwd":

        def forward() -> None:
            with torch.no_grad():
                attend(q, k, v)

        return forward
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

    def forward_backward() -> None:
        # gradients returned, not stored in .grad: a call frees nothing from the last one,
        # so the CUDA peak (net of frees) and the CPU one (by address) measure the same
        torch.autograd.grad(attend(*leaves).sum(), leaves)

    return forward_backward
