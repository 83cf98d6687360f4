"""The GPU benchmark scripts' CPU-side parts: arguments, the target ratios, the plot, and a
clean refusal without a GPU (the measurements themselves need one)."""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

import kernelstudy as ks

from .conftest import BENCHMARKS, benchmark_script


@pytest.fixture(scope="module")
def cuda_core():
    return benchmark_script("cuda_core")


def _frame() -> pd.DataFrame:
    rows = []
    times = {  # (method, dtype, N) -> ms, fwd+bwd, B=8, H=16, F=M=64
        ("cuda", "bfloat16", 2048): 1.0,
        ("sdpa", "bfloat16", 2048): 1.5,
        ("cuda", "bfloat16", 1024): 1.0,
        ("sdpa", "bfloat16", 1024): 0.5,
        ("cuda", "bfloat16", 8192): 3.0,
        ("cuda_fused", "bfloat16", 8192): 2.0,
        ("cuda_walk", "bfloat16", 8192): 1.25,
        ("cuda_walk", "bfloat16", 2048): 1.6,
        ("cuda_walk", "bfloat16", 1024): 0.4,
        ("cuda_walk", "float32", 16384): 1.6,
        ("fla", "bfloat16", 8192): 2.5,
        ("sdpa", "bfloat16", 8192): 12.0,
        ("cuda", "float32", 16384): 4.0,
        ("torch", "float32", 16384): 20.0,
    }
    for (method, dtype, n), ms in times.items():
        rows.append(
            dict(method=method, mode="fwd+bwd", dtype=dtype, B=8, H=16, BH=128, N=n, F=64, M=64)
            | {"time_ms": ms, "device": "test GPU"}
        )
    return pd.DataFrame(rows)


def test_targets_report_the_issue_ratios(cuda_core):
    text = cuda_core.targets(_frame())
    assert "N=8192 bf16 cuda/fla: 1.200" in text
    assert "N=8192 bf16 cuda_fused/fla: 0.800" in text
    assert "N=8192 bf16 cuda/sdpa: 0.250" in text
    assert "N=16384 fp32 torch/cuda: 5.00" in text
    assert "crossover of cuda with sdpa flash (bf16): N = 2048" in text
    assert "N=8192 bf16 cuda_walk/fla: 0.500" in text
    assert "N=16384 fp32 torch/cuda_walk: 12.50" in text
    # faster at 1024, slower at 2048, faster from 8192: the crossover is where it stays ahead
    assert "crossover of cuda_walk with sdpa flash (bf16): N = 8192" in text
    # the fastest of ours at each target (no rate without the tflops columns)
    # ... and the backend's settings that run it (no walk_blocks column here: "as run")
    assert text.splitlines()[-5:] == [
        "fastest of ours, N=8192 bf16: cuda_walk 1.250 ms: /fla 0.500 (target <= 1.0),"
        " /sdpa 0.104 (target < 1.0)",
        "  as defaults for bf16: CAUSAL_KERNEL 'walk', FUSED_BACKWARD off, WALK_BLOCKS as run",
        "fastest of ours, N=16384 fp32: cuda_walk 1.600 ms: torch/ours 12.50 (target >= 10)",
        "  as defaults for fp32: CAUSAL_KERNEL 'walk', FUSED_BACKWARD off, WALK_BLOCKS as run",
        "earliest crossover of ours with sdpa flash (bf16): N = 2048 (cuda) (target <= 2048)",
    ]
    rated = _frame().assign(tflops=23.1, matmul_tflops=757.0)
    assert "; 23.1 TFLOP/s, 3.1% of the run's 757 (matmul)" in cuda_core.targets(rated)


def test_settings_of_a_row_name_the_backends_defaults(cuda_core):
    """What to set in cuda_backend to make the fastest row's method the default, from its
    label (a WALK_BLOCKS suffix) or its walk_blocks column."""
    settings = cuda_core.settings_of
    assert settings("cuda_walk_mma_fused_1024") == (
        "CAUSAL_KERNEL 'walk_mma', FUSED_BACKWARD on, WALKS_TOGETHER True, WALK_BLOCKS 1024"
    )
    assert settings("cuda_walk_fused_apart", 128.0) == (
        "CAUSAL_KERNEL 'walk', FUSED_BACKWARD on, WALKS_TOGETHER False, WALK_BLOCKS 128"
    )
    assert (
        settings("cuda_walk_mma", 256)
        == "CAUSAL_KERNEL 'walk_mma', FUSED_BACKWARD off, WALK_BLOCKS 256"
    )
    assert settings("cuda_fused", float("nan")) == "CAUSAL_KERNEL 'chunks', FUSED_BACKWARD on"
    assert settings("cuda_walk_fused_256", None, "float32") == (  # together: bf16 only
        "CAUSAL_KERNEL 'walk', FUSED_BACKWARD on, WALK_BLOCKS 256"
    )
    for method in cuda_core.CUDA_METHODS:  # every method of ours has its settings
        assert settings(method, 128).startswith("CAUSAL_KERNEL")


def test_every_method_has_a_colour_of_its_own(cuda_core):
    """tab20 cycled once the committed H200 CSV's 35 methods were drawn: 15 pairs shared a
    colour, the sdpa baseline with a walk variant among them. The headline methods keep
    their colours whichever others are drawn, and come first in the legend."""
    import matplotlib.colors

    frame = pd.read_csv(BENCHMARKS / "results" / "cuda_h200.csv")
    colours = cuda_core.method_colours(frame["method"])
    methods = frame["method"].nunique()  # 35 when this was written; a later join adds more
    assert len(colours) == methods >= 35
    assert len({matplotlib.colors.to_hex(c) for c in colours.values()}) == methods
    assert list(colours)[:6] == list(cuda_core.HEADLINE_METHODS)
    assert cuda_core.method_colours(["sdpa", "torch"]) == {m: colours[m] for m in ("sdpa", "torch")}


def test_plot_writes_a_png(cuda_core, tmp_path):
    path = tmp_path / "cuda.png"
    assert set(cuda_core.plot_rows(_frame()).quantity) == {"time_ms"}  # a CSV before memory
    assert cuda_core.plot(_frame(), path)
    assert path.stat().st_size > 1000 and [p.name for p in tmp_path.iterdir()] == ["cuda.png"]
    assert not cuda_core.plot(_frame().assign(time_ms=float("nan")), tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_fla_layout_argument(cuda_core):
    """fla releases before 0.3 default to head_first=True, (B, H, N, D): the (B, N, H, D)
    inputs would be read as N heads of H tokens; they are told head_first=False."""

    def old_fla(q, k, v, scale=None, normalize=True, head_first=True): ...

    def new_fla(q, k, v, scale=None, normalize=True): ...

    assert cuda_core.takes_head_first(old_fla) and not cuda_core.takes_head_first(new_fla)


def test_arguments(cuda_core):
    args = cuda_core.parse_args(["--shapes", "1x8", "4x16", "--methods", "cuda", "cuda_fused"])
    assert args.shapes == [(1, 8), (4, 16)] and args.methods == ["cuda", "cuda_fused"]
    quick = cuda_core.parse_args(["--quick"])
    assert (quick.n, quick.shapes, quick.dims, quick.repeats) == ([1024, 8192], [(8, 16)], [64], 5)
    given = cuda_core.parse_args(["--quick", "--n", "512", "--repeats", "2", "--dims", "128"])
    assert (given.n, given.shapes, given.dims, given.repeats) == ([512], [(8, 16)], [128], 2)
    full = cuda_core.parse_args([])
    assert full.n == cuda_core.DEFAULT_N and full.repeats == 10 and len(full.shapes) == 3
    assert cuda_core.parse_args(["--walk-blocks", "128", "512"]).walk_blocks == [128, 512]
    twice = cuda_core.parse_args(
        ["--n", "512", "512", "--shapes", "1x8", "1x8", "--dims", "8", "8"]
    )
    assert (twice.n, twice.shapes, twice.dims) == ([512], [(1, 8)], [8])
    for bad in (
        ["--shapes", "8by16"],
        ["--shapes", "0x4"],
        ["--n", "0"],
        ["--methods", "x"],
        ["--walk-blocks", "0"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            cuda_core.parse_args(bad)
        assert exit_info.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
@pytest.mark.parametrize("name", ["cuda_core", "cuda_profile", "cuda_scaling"])
def test_refuses_without_a_gpu(name, tmp_path, capsys):
    out = tmp_path / "out.csv"
    assert benchmark_script(name).main(["--out", str(out)]) == 1
    assert "GPU" in capsys.readouterr().err and not out.exists()


def test_profile_arguments():
    profile = benchmark_script("cuda_profile")
    assert profile.parse_args(["--n", "1024", "--batch", "1"]).heads == 16
    assert profile.parse_args([]).variants == [
        "chunks", "chunks_fused", "walk", "walk_fused", "walk_fused_apart", "walk_mma",
        "walk_mma_fused", "walk_mma_fused_apart",
    ]  # fmt: skip
    with pytest.raises(SystemExit):
        profile.parse_args(["--steps", "0"])
    with pytest.raises(SystemExit):
        profile.parse_args(["--variants", "four"])


@pytest.mark.parametrize("method", ["fla", "cuda_walk"])
def test_nothing_measured_is_one_line_and_keeps_out(
    cuda_core, monkeypatch, tmp_path, capsys, method
):
    """On a GPU machine without fla (or without our build), only skipped methods used to end
    in a KeyError traceback after the runs."""
    monkeypatch.setattr(cuda_core.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_core, "matmul_tflops", lambda dtype: 100.0)
    monkeypatch.setattr(cuda_core, "load_fla", lambda: None)
    monkeypatch.setattr(cuda_core.ks, "backends", lambda: ["reference", "torch"])
    out = tmp_path / "cuda.csv"
    out.write_text("earlier results\n")
    assert cuda_core.main(["--quick", "--methods", method, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "nothing was measured" in err and "Traceback" not in err
    assert ("skipping cuda_walk" in err) == (method == "cuda_walk")
    assert out.read_text() == "earlier results\n"


def test_every_case_failing_is_one_line_and_keeps_out(cuda_core, monkeypatch, tmp_path, capsys):
    """A run whose every case failed (out of memory, say) wrote a CSV of NaN rows over --out,
    exited 0 and named a PNG it never wrote."""
    monkeypatch.setattr(cuda_core.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_core, "matmul_tflops", lambda dtype: 100.0)
    monkeypatch.setattr(cuda_core.torch.cuda, "get_device_name", lambda *args: "test GPU")
    monkeypatch.setattr(cuda_core.ks, "backends", lambda: ["reference", "torch"])
    monkeypatch.setattr(
        cuda_core,
        "measure",
        lambda method, mode, b, h, n, d, name, *rest: (
            dict(method=method, mode=mode, dtype=name, B=b, H=h, BH=b * h, N=n, F=d, M=d)
            | {"time_ms": float("nan"), "tflops": float("nan"), "error": "out of memory"}
        ),
    )
    out = tmp_path / "cuda.csv"
    out.write_text("earlier results\n")
    assert cuda_core.main(["--quick", "--methods", "torch", "--out", str(out)]) == 1
    assert "nothing was measured" in capsys.readouterr().err
    assert out.read_text() == "earlier results\n" and not out.with_suffix(".png").exists()


# ---------------------------------------------------------------- benchmarks/core.py (CPU)
@pytest.fixture(scope="module")
def core():
    return benchmark_script("core")


def test_core_counts_the_bytes_a_call_allocates_on_cpu(core):
    """CPU peak memory was the rise of the resident set: pages never touched did not count,
    and heap slack that glibc keeps resident after frees did (the torch backend's causal
    fwd+bwd at N = 1024 read 44 MiB for 16 MiB allocated, depending on the cases before)."""
    big = torch.ones(1 << 21)  # 8 MiB freed before the call: no part of it

    def call():
        untouched = torch.empty(1 << 20)  # 4 MiB allocated, never written
        return untouched, torch.ones(1 << 18)  # and 1 MiB, written

    del big
    assert core.peak_memory_mib(call, torch.device("cpu")) == 4.0 + 1.0


def test_core_runs_a_small_case(core, tmp_path):
    out = tmp_path / "core.csv"
    argv = ["--n", "64", "--repeats", "1", "--modes", "fwd", "--backends", "torch", "--out"]
    assert core.main([*argv, str(out)]) == 0
    frame = pd.read_csv(out)
    assert set(frame.backend) == {"torch", "sdpa"} and (frame.time_ms > 0).all()  # sdpa: softmax
    assert {"matmul_gflops", "frac_matmul", "device", "command"} <= set(frame.columns)
    assert [p.name for p in tmp_path.iterdir()] == ["core.csv"]  # no temp file left
    f_m_d = {tuple(line.split(",")[7:10]) for line in out.read_text().splitlines()[1:]}
    assert f_m_d == {("", "64", "64"), ("64", "64", "")}  # F, M, D as written: no "64.0"


def test_core_measures_the_yardstick_in_the_runs_dtype(core, tmp_path, monkeypatch):
    """frac_matmul of a bfloat16 run was against the float32 matmul rate."""
    seen = []

    def rate(device, dtype=torch.float32, size=None, repeats=5):
        seen.append(dtype)
        return 1.0  # GFLOP/s

    monkeypatch.setattr(ks.analysis, "matmul_rate", rate)
    out = tmp_path / "core.csv"
    argv = ["--n", "64", "--repeats", "1", "--modes", "fwd", "--backends", "torch"]
    assert core.main([*argv, "--dtype", "bfloat16", "--no-softmax", "--out", str(out)]) == 0
    frame = pd.read_csv(out)
    assert seen == [torch.bfloat16] and (frame.matmul_gflops == 1.0).all()
    assert frame.frac_matmul.tolist() == pytest.approx((frame.gflops / 1.0).tolist())


def test_core_refuses_unknown_backends_and_keeps_out_when_nothing_runs(core, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        core.parse_args(["--backends", "toch"])
    assert exit_.value.code == 2 and "toch" in capsys.readouterr().err
    out = tmp_path / "core.csv"
    out.write_text("earlier results\n")
    n = str(core.REFERENCE_MAX_N + 1)  # the reference backend skips N above its limit
    argv = ["--n", n, "--heads", "1", "--features", "2", "--values", "2", "--no-softmax"]
    argv += ["--repeats", "1", "--backends", "reference", "--out", str(out)]
    assert core.main(argv) == 1
    assert out.read_text() == "earlier results\n"
    assert "no case ran" in capsys.readouterr().err


def test_core_runs_only_backends_that_take_the_device(core, tmp_path, capsys, monkeypatch):
    """A backend built for another device (cuda beside CPU tensors) used to be called and
    crash the run; asked for by name, one that cannot run here is refused, --out kept."""
    cuda = ks.core.registered_backends()["cuda"]
    monkeypatch.setattr(cuda, "available", lambda: True)  # as on a GPU machine
    out = tmp_path / "core.csv"
    argv = ["--n", "64", "--repeats", "1", "--modes", "fwd", "--no-softmax", "--out", str(out)]
    assert core.main(argv) == 0
    assert "cuda" not in set(pd.read_csv(out).backend)
    assert "skipped (not built, or not for cpu): cuda" in capsys.readouterr().err
    out.write_text("earlier results\n")
    assert core.main([*argv, "--backends", "cuda"]) == 1
    assert "cuda cannot run float32 on cpu here" in capsys.readouterr().err
    assert out.read_text() == "earlier results\n"


def test_core_quick_keeps_what_is_given(core):
    assert (core.parse_args(["--quick"]).n, core.parse_args(["--quick"]).repeats) == (
        [1024, 4096],
        3,
    )
    given = core.parse_args(["--quick", "--n", "64", "--repeats", "1"])
    assert (given.n, given.repeats) == ([64], 1)
    assert core.parse_args([]).n == [1024, 2048, 4096, 8192, 16384]


def test_core_calls_leave_no_gradients_behind(core):
    """A call that left .grad on the shared inputs had them freed inside the next call's
    memory measurement, which then came out low by their size (0 MiB for a forward)."""
    x = [torch.rand(1, 1, 8, 4, requires_grad=True) for _ in range(3)]
    core._run(lambda: ks.causal_dot_product(*x, backend="torch"), x, backward=True)()
    assert all(t.grad is None for t in x)


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--heads", "0"], "--heads must be positive"),
        (["--device", "bogus"], "--device 'bogus'"),
        (["--device", "meta"], "expected cpu, cuda or cuda:N"),  # it timed no work
    ],
)
def test_core_checks_sizes_and_device(core, capsys, flags, match):
    with pytest.raises(SystemExit) as exit_:
        core.parse_args(flags)
    assert exit_.value.code == 2 and match in capsys.readouterr().err


def test_core_measures_a_value_given_twice_once(core):
    args = core.parse_args(["--n", "64", "32", "64", "--backends", "torch", "torch"])
    assert (args.n, args.backends, args.modes) == ([64, 32], ["torch"], ["fwd", "fwd+bwd"])


def test_core_counts_fwd_bwd_flops_as_three_forwards(core, tmp_path):
    """Softmax forward+backward was counted as 2.5 forwards (the backward's own ratio), so
    its FLOP rate came out 17% low next to linear attention's 3; torch's counter says 3."""
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = (torch.randn(1, 2, 64, 16, requires_grad=True) for _ in range(3))

    def explicit_softmax():
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v

    counts = {}
    for mode in ("fwd", "fwd+bwd"):
        with FlopCounterMode(display=False) as counter:
            out = explicit_softmax()
            if mode == "fwd+bwd":
                out.sum().backward()
        counts[mode] = counter.get_total_flops()
    assert counts["fwd+bwd"] == 3 * counts["fwd"]
    out = tmp_path / "core.csv"
    argv = ["--n", "64", "--repeats", "1", "--backends", "torch", "--out", str(out)]
    assert core.main(argv) == 0
    frame = pd.read_csv(out)
    frame["flops"] = frame.gflops * frame.time_ms * 1e6  # back from the rate
    flops = frame.set_index(["op", "causal", "mode"])["flops"]
    for op in ("softmax_attention", "linear_attention"):
        ratio = flops[(op, True, "fwd+bwd")] / flops[(op, True, "fwd")]
        assert ratio == pytest.approx(3, rel=1e-6), op


def test_core_runs_non_causal_attention_only_where_a_backend_has_its_own(core, tmp_path):
    """Non-causal linear attention on the cpu backend is the torch path: it was timed again
    under the label 'cpu'."""
    out = tmp_path / "core.csv"
    argv = ["--n", "64", "--repeats", "1", "--modes", "fwd", "--no-softmax", "--out", str(out)]
    assert core.main(argv) == 0
    frame = pd.read_csv(out)
    attention = frame[frame.op == "linear_attention"]
    non_causal = set(attention[~attention.causal].backend)
    assert non_causal <= {"torch", "reference", "cuda"} and "torch" in non_causal
    if "cpu" in ks.backends():
        assert "cpu" in set(attention[attention.causal].backend)


# ------------------------------------------- the GPU paths, run on the CPU with a fake timer
class _FakeEvent:
    """torch.cuda.Event on the CPU: record() reads a clock, elapsed_time() is in ms."""

    clock = time.perf_counter

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self, stream=None):
        self.at = type(self).clock()

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


class _FakeCudaMemory:
    """torch.cuda's allocator statistics on the CPU. ``allocated`` bytes stay live throughout,
    plus what ``held()`` says (e.g. gradients); ``allocate(nbytes)`` marks that many bytes
    live for a moment above them (a call's tensors), raising the peak since the last reset.
    ``log`` records resets, reads of the peak and whatever the test adds, in order."""

    def __init__(self, allocated: int = 0, held=lambda: 0):
        self.allocated, self.held = allocated, held
        self.peak = self.memory_allocated()
        self.log: list[str] = []

    def memory_allocated(self, device=None) -> int:
        return self.allocated + self.held()

    def allocate(self, nbytes: int) -> None:
        self.peak = max(self.peak, self.memory_allocated() + nbytes)

    def reset_peak_memory_stats(self, device=None) -> None:
        self.log.append("reset")
        self.peak = self.memory_allocated()

    def max_memory_allocated(self, device=None) -> int:
        self.log.append("read")
        return self.peak


@pytest.fixture
def cuda_memory(monkeypatch):
    """The fake allocator statistics in place of torch.cuda's (3 MiB live outside the calls),
    on a machine that says it has a GPU."""
    memory = _FakeCudaMemory(allocated=3 * 2**20)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("memory_allocated", "reset_peak_memory_stats", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, getattr(memory, name))
    return memory


@pytest.fixture
def gpu_on_cpu(cuda_core, monkeypatch, cuda_memory):
    """cuda_core as on a GPU machine, its tensors on the CPU, its events a CPU clock and its
    memory statistics ``cuda_memory``, where each call of a case allocates its output (the
    sizes of a case's calls go to ``cuda_memory.cases``, one list per case)."""
    import functools

    monkeypatch.setattr(cuda_core, "DEVICE", "cpu")
    monkeypatch.setattr(cuda_core.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_core.torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(cuda_core.torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(cuda_core.torch.cuda, "get_device_name", lambda *args: "test GPU")
    small = functools.partial(cuda_core.matmul_tflops, size=64, repeats=2)
    monkeypatch.setattr(cuda_core, "matmul_tflops", small)
    make_case = cuda_core.make_case
    cuda_memory.cases = []

    def case_allocating_its_output(*args, **kwargs):
        label, fn, inputs = make_case(*args, **kwargs)
        sizes = []
        cuda_memory.cases.append(sizes)
        cuda_memory.log.append("case")

        def run():
            out = fn()
            cuda_memory.allocate(out.nbytes)
            cuda_memory.log.append("call")
            sizes.append(out.nbytes)
            return out

        return label, run, inputs

    monkeypatch.setattr(cuda_core, "make_case", case_allocating_its_output)
    return cuda_core


def test_cuda_time_ms_is_the_median_after_the_warmup(cuda_core, monkeypatch):
    durations = iter([50.0, 50.0, 3.0, 1.0, 2.0, 9.0, 4.0])  # ms: two warm-ups, then five
    now = [0.0]

    def fn():
        now[0] += next(durations) / 1e3

    monkeypatch.setattr(_FakeEvent, "clock", lambda: now[0])
    monkeypatch.setattr(cuda_core.torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(cuda_core.torch.cuda, "synchronize", lambda *args: None)
    assert cuda_core.cuda_time_ms(fn, repeats=5, warmup=2) == pytest.approx(3.0)


def test_stream_time_ms_is_per_call_on_the_gpu_and_the_host(cuda_core, monkeypatch):
    """Four calls queued between two events, three times: the GPU's time (the events) and the
    host's (perf_counter up to the end event, not the synchronization) per call, medians."""
    gpu_clock, host_clock = [0.0], [0.0]
    per_call = iter([(2.0, 1.0)] * 4 + [(5.0, 3.0)] * 4 + [(3.0, 2.0)] * 4)  # ms: (GPU, host)

    def fn():
        gpu, host = next(per_call)
        gpu_clock[0] += gpu / 1e3
        host_clock[0] += host / 1e3

    def synchronize(*args):
        host_clock[0] += 1.0  # waiting for the GPU: not the host's time to issue the calls

    monkeypatch.setattr(_FakeEvent, "clock", lambda: gpu_clock[0])
    monkeypatch.setattr(cuda_core.torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(cuda_core.torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(cuda_core.time, "perf_counter", lambda: host_clock[0])
    gpu, host = cuda_core.stream_time_ms(fn, steps=4, repeats=3)
    assert gpu == pytest.approx(3.0) and host == pytest.approx(2.0)


def test_gpu_pipeline_runs_on_cpu(gpu_on_cpu, cuda_memory, monkeypatch, tmp_path, capsys):
    """The whole measurement (cases, warm-up, events, backward, FLOPs, peak memory, CSV, plot,
    printed tables) on CPU tensors; fla is a stand-in that checks the call it gets and computes
    in (B, N, H, D)."""
    cuda_core = gpu_on_cpu
    calls = []
    timer = cuda_core.cuda_time_ms

    def logged_timer(*args, **kwargs):
        ms = timer(*args, **kwargs)
        cuda_memory.log.append("timed")
        return ms

    monkeypatch.setattr(cuda_core, "cuda_time_ms", logged_timer)

    def chunk_linear_attn(q, k, v, scale=None, normalize=True, head_first=False):
        calls.append((tuple(q.shape), scale, normalize, head_first))
        out = ks.causal_dot_product(*(t.transpose(1, 2) for t in (q, k, v)), backend="torch")
        return out.transpose(1, 2), None

    monkeypatch.setattr(cuda_core, "load_fla", lambda: chunk_linear_attn)
    out = tmp_path / "cuda.csv"
    argv = ["--n", "64", "96", "--shapes", "1x2", "--dims", "16", "--repeats", "2"]
    argv += ["--warmup", "1", "--methods", "torch", "fla", "sdpa", "--out", str(out)]
    assert cuda_core.main(argv) == 0
    frame = pd.read_csv(out)
    assert len(frame) == 2 * 2 * 3 * 2  # dtypes × N × methods × modes
    assert set(frame.method) == {"torch", "fla", "sdpa", "sdpa_efficient"}
    assert calls and all(c[1:] == (1.0, False, False) for c in calls)
    assert {c[0] for c in calls} == {(1, 64, 2, 16), (1, 96, 2, 16)}  # (B, N, H, D)
    ok = frame[frame.method != "sdpa_efficient"]  # no memory-efficient kernel on the CPU
    assert (ok.time_ms > 0).all() and ok.error.isna().all()
    failed = frame[frame.method == "sdpa_efficient"]
    assert failed.time_ms.isna().all() and failed.error.str.contains("RuntimeError").all()
    for row in ok.itertuples():
        flop = cuda_core.flops(row.method, row.mode, row.B, row.H, row.N, row.F)
        assert row.tflops == pytest.approx(flop / (row.time_ms * 1e-3) / 1e12)
        assert row.frac_matmul == pytest.approx(row.tflops / row.matmul_tflops)
    assert cuda_core.flops("sdpa", "fwd+bwd", 1, 1, 8, 4) == 3 * 2 * 8 * 8 * 4
    assert cuda_core.flops("fla", "fwd+bwd", 1, 1, 8, 4) == 3 * 4 * 8 * 4 * 4
    columns = {"device", "date", "torch", "command", "matmul_tflops", "walk_blocks", "error"}
    assert columns <= set(frame.columns) and (frame.device == "test GPU").all()
    assert out.with_suffix(".png").stat().st_size > 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cuda.csv", "cuda.png"]
    # peak memory: one call after the timed ones (warm-up 1, repeats 2), above the 3 MiB live
    # before it, in MiB; none where the case failed
    assert len(cuda_memory.cases) == len(frame)
    per_case = "|".join(cuda_memory.log).split("case|")[1:]
    for row, sizes, log in zip(frame.itertuples(), cuda_memory.cases, per_case, strict=True):
        if row.method == "sdpa_efficient":
            assert math.isnan(row.peak_mib) and not sizes and log.strip("|") == ""
        else:
            assert log.strip("|") == "call|call|call|timed|reset|call|read"
            assert row.peak_mib == sizes[-1] / 2**20 > 0
    printed = capsys.readouterr().out
    assert "peak memory (MiB):" in printed and "time (ms, median):" in printed
    assert f"{frame.peak_mib.max():.3f}".rstrip("0") in printed
    drawn = cuda_core.plot_rows(frame)
    memory = drawn[drawn.quantity == "peak_mib"]
    assert len(memory) == frame.peak_mib.notna().sum()
    assert set(memory.panel) == {"float32: peak memory (MiB)", "bfloat16: peak memory (MiB)"}
    assert sorted(memory.value) == sorted(frame.peak_mib.dropna())


def _row(method, mode, b, h, n, d, name, *rest):
    return dict(method=method, mode=mode, dtype=name, B=b, H=h, BH=b * h, N=n, F=d, M=d) | {
        "walk_blocks": None,
        "time_ms": 1.0,
        "tflops": 1.0,
        "error": "",
    }


def test_partial_results_are_written_as_they_go(cuda_core, monkeypatch, tmp_path):
    """The CSV was written only at the end: a run killed at the device's time limit (or by
    Ctrl-C) left nothing of what it had measured."""
    monkeypatch.setattr(cuda_core.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_core.torch.cuda, "get_device_name", lambda *args: "test GPU")
    monkeypatch.setattr(cuda_core, "matmul_tflops", lambda dtype: 100.0)
    done = []

    def measure(*case):
        if len(done) == 3:
            raise KeyboardInterrupt  # as a kill in the fourth case
        done.append(case)
        return _row(*case)

    monkeypatch.setattr(cuda_core, "measure", measure)
    out = tmp_path / "cuda.csv"
    out.write_text("earlier results\n")
    with pytest.raises(KeyboardInterrupt):
        cuda_core.main(["--quick", "--methods", "torch", "sdpa", "--out", str(out)])
    frame = pd.read_csv(out)
    assert len(frame) == 3 and (frame.time_ms == 1.0).all() and (frame.device == "test GPU").all()
    assert [p.name for p in tmp_path.iterdir()] == ["cuda.csv"]  # no temp file left


@pytest.mark.parametrize("seen_by", ["empty_cache", "probe"])
def test_a_broken_cuda_context_stops_the_run_and_keeps_what_ran(
    gpu_on_cpu, monkeypatch, tmp_path, capsys, seen_by
):
    """An illegal address in one case (the walk has never run on a GPU) breaks the process's
    CUDA context: torch.cuda.empty_cache() in measure's cleanup then raised, and the run ended
    in a traceback with nothing written; where it did not raise, every later case, baselines
    included, failed with the same error."""
    cuda_core = gpu_on_cpu
    broken = []
    make_case = cuda_core.make_case

    def faulty_case(method, *rest):
        if method == "cuda_walk":
            broken.append(True)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return make_case("torch" if method == "cuda" else method, *rest)

    def empty_cache():
        if broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(cuda_core, "make_case", faulty_case)
    if seen_by == "empty_cache":
        monkeypatch.setattr(cuda_core.torch.cuda, "empty_cache", empty_cache)
    else:
        monkeypatch.setattr(cuda_core, "context_alive", lambda: not broken)
    monkeypatch.setattr(cuda_core.ks, "backends", lambda: ["reference", "torch", "cuda"])
    out = tmp_path / "cuda.csv"
    argv = ["--n", "64", "--shapes", "1x2", "--dims", "16", "--dtypes", "bfloat16"]
    argv += ["--repeats", "1", "--warmup", "0", "--methods", "cuda", "cuda_walk", "sdpa"]
    assert cuda_core.main([*argv, "--walk-blocks", "4", "8", "--out", str(out)]) == 1
    frame = pd.read_csv(out)
    assert frame.method.tolist() == ["torch", "torch", "cuda_walk_4"]  # cuda ran as torch
    assert frame.time_ms.notna().tolist() == [True, True, False]
    assert "illegal memory access" in frame.error.iloc[-1]
    assert out.with_suffix(".png").exists()
    assert "the CUDA context broke in cuda_walk_4 fwd" in capsys.readouterr().err


def test_the_context_check_sees_a_working_device(gpu_on_cpu):
    assert gpu_on_cpu.context_alive()


def test_peak_memory_leaves_out_the_gradients_of_the_timed_calls(
    cuda_core, cuda_memory, monkeypatch
):
    """The timed fwd+bwd calls leave gradients in .grad, and the next call drops them first
    (with_backward): measured around that call, they counted in what was allocated before it
    but not in its peak, which came out low by their size (here below zero)."""
    monkeypatch.setattr(cuda_core.torch.cuda, "synchronize", lambda *args: None)
    x = [torch.rand(1, 2, 64, 16, requires_grad=True) for _ in range(3)]
    cuda_memory.held = lambda: sum(t.grad.nbytes for t in x if t.grad is not None)

    def forward():
        out = ks.causal_dot_product(*x, backend="torch")
        cuda_memory.allocate(out.nbytes)
        return out

    call = cuda_core.with_backward(forward, x)
    call()  # as the timed calls: the gradients stay
    assert all(t.grad is not None for t in x) and cuda_memory.held() == 3 * 2 * 64 * 16 * 4
    assert cuda_core.peak_memory_mib(call, x) == 2 * 64 * 16 * 4 / 2**20  # the output


@pytest.mark.parametrize("failure", ["out of memory", "illegal address"])
def test_a_failing_memory_call_keeps_the_time(gpu_on_cpu, monkeypatch, tmp_path, capsys, failure):
    """The peak memory's call comes after the timed ones, under the same handling: running out
    of memory there keeps the case's time and the run goes on; an illegal address there stops
    the run as in a timed call, with what ran written."""
    cuda_core = gpu_on_cpu
    measured = cuda_core.peak_memory_mib
    failed = []

    def peak_memory_mib(call, inputs):
        if failed:
            return measured(call, inputs)
        failed.append(True)
        if failure == "out of memory":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(cuda_core, "peak_memory_mib", peak_memory_mib)
    monkeypatch.setattr(cuda_core, "context_alive", lambda: failure == "out of memory")
    out = tmp_path / "cuda.csv"
    argv = ["--n", "64", "96", "--shapes", "1x2", "--dims", "16", "--dtypes", "float32"]
    argv += ["--repeats", "1", "--warmup", "0", "--methods", "torch", "--modes", "fwd"]
    code = cuda_core.main([*argv, "--out", str(out)])
    frame = pd.read_csv(out)
    first = frame.iloc[0]
    assert first.time_ms > 0 and math.isnan(first.peak_mib)
    if failure == "out of memory":
        assert code == 0 and first.error == "peak memory: out of memory"
        assert frame.N.tolist() == [64, 96] and frame.peak_mib.iloc[1] > 0
    else:
        assert code == 1 and frame.N.tolist() == [64]
        assert first.error.startswith("peak memory: RuntimeError: CUDA error: an illegal")
        assert "the CUDA context broke in torch fwd" in capsys.readouterr().err


def test_the_fp32_yardstick_runs_without_tf32(cuda_core, monkeypatch):
    """matmul_tflops relied on the process's TF32 setting: with TF32 on (an import, or the
    environment, sets it), the fp32 yardstick would be the TF32 rate, ~7x the fp32 one."""
    seen = []
    randn = torch.randn
    monkeypatch.setattr(
        cuda_core.torch, "randn", lambda *shape, device=None, dtype=None: randn(*shape, dtype=dtype)
    )

    def timer(fn, repeats, warmup):
        fn()
        seen.append(torch.get_float32_matmul_precision())
        return 1.0

    monkeypatch.setattr(cuda_core, "cuda_time_ms", timer)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert cuda_core.matmul_tflops(torch.float32, size=8) == pytest.approx(2 * 8**3 / 1e9)
        assert torch.get_float32_matmul_precision() == "high"  # restored
    finally:
        torch.set_float32_matmul_precision(before)
    assert seen == ["highest"]


def test_fla_import_failure_says_why(cuda_core, monkeypatch, capsys):
    """A missing dependency of fla (the wheels are installed with --no-deps) dropped the fla
    column with no reason given, costing a device call to find out."""

    def import_module(name):
        raise ModuleNotFoundError("No module named 'einops'")

    monkeypatch.setattr(cuda_core.importlib, "import_module", import_module)
    assert cuda_core.load_fla() is None
    assert "No module named 'einops'" in capsys.readouterr().err


# --------------------------------------------------------- benchmarks/cuda_profile.py's loop
def _kernel_frame(variant: str) -> pd.DataFrame:
    """cuda_profile.kernel_times' frame for a variant: one kernel, 10 µs a step in 2 calls, in a
    step of 40 µs wall time, 12 µs with steps queued, 30 µs of the host's."""
    return pd.DataFrame(
        {"kernel": [f"{variant}_kernel"], "total_us": [10.0], "calls": [2]}
        | {"us_per_call": [5.0], "calls_per_step": [2], "us_per_step": [10.0], "share": [1.0]}
        | {"step_wall_us": [40.0], "step_stream_us": [12.0], "step_host_us": [30.0]}
    )


def test_profile_keeps_the_variants_that_ran(monkeypatch, tmp_path, capsys):
    """One variant failing (a kernel that has never run on a GPU) made the script return
    without writing the others' tables (RuntimeError), or crash (any other error). Several
    F = M run in turn, each row recording its own."""
    profile = benchmark_script("cuda_profile")
    monkeypatch.setattr(profile.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(profile.torch.cuda, "get_device_name", lambda *args: "test GPU")
    monkeypatch.setattr(profile.ks, "backends", lambda: ["reference", "torch", "cuda"])
    monkeypatch.setattr(profile, "context_alive", lambda: True)

    def kernel_times(dtype, b, h, n, d, variant, steps, walk_blocks=None, op="product"):
        if variant == "walk" and d == 128:
            raise ValueError("too many resources requested for launch")
        return _kernel_frame(variant)

    monkeypatch.setattr(profile, "kernel_times", kernel_times)
    out = tmp_path / "profile.csv"
    argv = ["--dim", "64", "128", "--dtypes", "bfloat16"]
    argv += ["--variants", "chunks", "walk", "walk_fused"]
    assert profile.main([*argv, "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert "walk (bfloat16, F=M=128, product)" in captured.err
    # each variant's step: the kernels' 10 µs of its 40 µs wall time (12 queued, 30 the host's)
    step = r"bfloat16\s+walk_fused\s+\S+\s+10\.0\s+40\.0\s+12\.0\s+30\.0\s+0\.25"
    assert re.search(step, captured.out), captured.out
    rows = pd.read_csv(out)
    assert list(zip(rows.F, rows.variant, strict=True)) == [
        (64, "chunks"), (64, "walk"), (64, "walk_fused"), (128, "chunks"), (128, "walk_fused")
    ]  # fmt: skip
    monkeypatch.setattr(profile, "context_alive", lambda: False)  # stop after a broken context
    assert profile.main([*argv, "--out", str(out)]) == 1
    assert pd.read_csv(out).variant.tolist() == ["chunks", "walk", "walk_fused", "chunks"]


@pytest.fixture
def profile_seen(monkeypatch) -> tuple:
    """cuda_profile.py as on a GPU with the cuda backend, its kernel_times a stand-in that
    records (variant, walk_blocks, op) in the list returned beside the module."""
    profile = benchmark_script("cuda_profile")
    monkeypatch.setattr(profile.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(profile.torch.cuda, "get_device_name", lambda *args: "test GPU")
    monkeypatch.setattr(profile.ks, "backends", lambda: ["reference", "torch", "cuda"])
    seen = []

    def kernel_times(dtype, b, h, n, d, variant, steps, walk_blocks=None, op="product"):
        seen.append((variant, walk_blocks, op))
        return _kernel_frame(variant)

    monkeypatch.setattr(profile, "kernel_times", kernel_times)
    return profile, seen


def test_profile_appends_a_second_walk_blocks(profile_seen, tmp_path):
    """--walk-blocks runs the walk variants at that WALK_BLOCKS and says so in a column (the
    chunk kernels have none); --append keeps an earlier run's rows in --out."""
    profile, seen = profile_seen
    out = tmp_path / "profile.csv"
    argv = ["--dim", "64", "--dtypes", "bfloat16", "--out", str(out)]
    assert profile.main([*argv, "--variants", "chunks", "walk_fused"]) == 0
    assert (
        profile.main([*argv, "--variants", "walk_fused", "--walk-blocks", "256", "--append"]) == 0
    )
    default = profile.cuda_backend.WALK_BLOCKS
    assert [case[:2] for case in seen] == [
        ("chunks", default), ("walk_fused", default), ("walk_fused", 256)
    ]  # fmt: skip
    rows = pd.read_csv(out)
    assert rows.variant.tolist() == ["chunks", "walk_fused", "walk_fused"]
    assert rows.walk_blocks.isna().tolist() == [True, False, False]
    assert rows.walk_blocks.tolist()[1:] == [default, 256]
    assert profile.main([*argv, "--variants", "walk"]) == 0  # without --append: this run only
    assert pd.read_csv(out).variant.tolist() == ["walk"]
    with pytest.raises(SystemExit):
        profile.parse_args(["--walk-blocks", "0"])


def test_profile_op_chooses_the_call(profile_seen, monkeypatch, tmp_path):
    """--op attention profiles ks.linear_attention (causal) in place of the product, --op full
    the non-causal one with padded keys, several ops each in turn, and the rows say which; the
    step's call of each op reaches the backend named cuda."""
    profile, seen = profile_seen
    out = tmp_path / "profile.csv"
    argv = ["--dim", "64", "--dtypes", "bfloat16", "--variants", "walk_mma_fused", "--out"]
    assert profile.main([*argv, str(out)]) == 0
    assert profile.main([*argv, str(out), "--op", "attention", "full", "--append"]) == 0
    assert [op for _, _, op in seen] == ["product", "attention", "full"]
    assert pd.read_csv(out).op.tolist() == ["product", "attention", "full"]
    calls = []
    monkeypatch.setattr(profile.ks, "causal_dot_product", lambda *a, **kw: calls.append(kw))
    monkeypatch.setattr(profile.ks, "linear_attention", lambda *a, **kw: calls.append(kw))
    q = torch.zeros(3, 2, 16, 4)
    for op in ("product", "attention", "full"):
        profile.OPS[op](q, q, q)
    mask = calls[2].pop("key_padding_mask")
    assert calls == [{"backend": "cuda"}, {"causal": True, "backend": "cuda"}] + [
        {"causal": False, "backend": "cuda"}
    ]
    # the last eighth of the keys of sequences 0 and 2 padded
    assert mask.shape == (3, 16) and mask.sum(1).tolist() == [14, 16, 14]
    with pytest.raises(SystemExit):
        profile.parse_args(["--op", "softmax"])


# --------------------------------------------------------- benchmarks/cuda_scaling.py
PROFILED = "void ks_cuda::(anonymous namespace)::{}<__nv_bfloat16, __nv_bfloat16{}>(int, long)"


def _kernel_times(product_us: float, dkv_us: float, product: str) -> pd.DataFrame:
    """cuda_profile.kernel_times' frame: a product walk (twice a step), the dk, dv walk, and a
    kernel that is not a walk."""
    names = [PROFILED.format(product, ", 1"), PROFILED.format("chunk_walk_mma_dkv_kernel", "")]
    names.append("void at::native::vectorized_elementwise_kernel<4>(int)")
    return pd.DataFrame(
        {"kernel": names, "total_us": [6 * product_us, 3 * dkv_us, 1.0], "calls": [6, 3, 3]}
    ).assign(us_per_call=lambda f: f.total_us / f.calls)


def test_scaling_names_kernels_and_reads_cost_and_bound():
    scaling = benchmark_script("cuda_scaling")
    number = scaling.kernel_number
    assert number(PROFILED.format("chunk_walk_backward_kernel", "")) == 11
    assert number(PROFILED.format("chunk_walk_mma_backward_kernel", "")) == 10
    assert number(PROFILED.format("chunk_walk_mma_dkv_kernel", "")) == 9
    assert number(PROFILED.format("chunk_walk_mma_kernel", ", 2")) == 8
    assert number(PROFILED.format("chunk_walk_dkv_kernel", "")) == 7
    assert number(PROFILED.format("chunk_walk_kernel", ", 1")) == 6
    assert number(PROFILED.format("chunk_output_kernel", "")) is None
    assert number("_ZN7ks_cuda12_GLOBAL__N_117chunk_walk_kernelI13__nv_bfloat16S2_Li1EEEvPKT_") == 6
    kernels = {"product": (8, 2), "dkv": (9, 1)}
    frames = []
    for load, product_us, dkv_us in ((1, 100.0, 200.0), (2, 110.0, 390.0), (4, 220.0, 780.0)):
        rows = scaling.walk_rows(
            _kernel_times(product_us, dkv_us, "chunk_walk_mma_kernel"), kernels
        )
        assert rows.kernel.tolist() == [8, 9] and rows.resident.tolist() == [2, 1]
        frames.append(rows.assign(dtype="bfloat16", variant="walk_mma_fused", load=load))
    rows = scaling.scaled(pd.concat(frames, ignore_index=True), n=8192)
    product = rows[rows.kernel == 8]
    assert product.us_per_chunk.tolist() == pytest.approx([100 / 128, 110 / 128, 220 / 128])
    assert product.cost.tolist() == pytest.approx([1.0, 1.1, 2.2])
    table = scaling.summary(rows).set_index("kernel")
    assert table.loc[8, "bound"] == "latency" and table.loc[8, "cost@2"] == pytest.approx(1.1)
    assert table.loc[9, "bound"] == ""  # one block resident: load 2 is two waves
    assert table.loc[9, "us_per_chunk"] == pytest.approx(200 / 128)
    assert [scaling.bound(c, 2) for c in (1.2, 1.5, 1.9)] == ["latency", "mixed", "throughput"]
    assert scaling.bound(float("nan"), 2) == scaling.bound(1.2, 0) == ""


def test_scaling_arguments():
    scaling = benchmark_script("cuda_scaling")
    args = scaling.parse_args([])
    assert (args.n, args.dim, args.loads, args.steps) == (8192, 64, [1, 2, 3, 4], 3)
    assert args.variants == [
        "walk_fused", "walk_fused_apart", "walk_mma_fused", "walk_mma_fused_apart"
    ]  # fmt: skip
    for bad in (["--loads", "2", "4"], ["--loads", "1", "0"], ["--n", "0"], ["--variants", "walk"]):
        with pytest.raises(SystemExit) as exit_info:
            scaling.parse_args(bad)
        assert exit_info.value.code == 2


def test_scaling_keeps_the_cases_that_ran(monkeypatch, tmp_path, capsys):
    """B·H is load x SMs with one walk per sequence (WALK_BLOCKS 1); a case that fails is
    named and the others are written; a broken context stops the run."""
    scaling = benchmark_script("cuda_scaling")
    monkeypatch.setattr(scaling.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(scaling.torch.cuda, "get_device_name", lambda *args: "test GPU")
    props = type("Props", (), {"multi_processor_count": 10})
    monkeypatch.setattr(scaling.torch.cuda, "get_device_properties", lambda *args: props)
    monkeypatch.setattr(scaling.cuda_backend, "extension", lambda: "extension")
    monkeypatch.setattr(scaling.ks, "backends", lambda: ["reference", "torch", "cuda"])
    monkeypatch.setattr(scaling.cuda_profile, "context_alive", lambda: True)
    monkeypatch.setattr(
        scaling, "walk_kernels", lambda ext, dtype, dim, variant: {"product": (8, 2), "dkv": (9, 1)}
    )
    calls = []

    def kernel_times(dtype, b, h, n, d, variant, steps, walk_blocks):
        calls.append((b, h, walk_blocks))
        if b == 30:
            raise RuntimeError("too many resources requested for launch")
        return _kernel_times(100.0 * b / 10, 200.0 * b / 10, "chunk_walk_mma_kernel")

    monkeypatch.setattr(scaling.cuda_profile, "kernel_times", kernel_times)
    out = tmp_path / "scaling.csv"
    argv = ["--loads", "1", "2", "3", "--dtypes", "bfloat16", "--variants", "walk_mma_fused"]
    assert scaling.main([*argv, "--out", str(out)]) == 1
    assert calls == [(10, 1, 1), (20, 1, 1), (30, 1, 1)]
    captured = capsys.readouterr()
    assert "walk_mma_fused in bfloat16 at load 3 failed" in captured.err
    assert "throughput" in captured.out  # the product's cost at load 2 is 2 with 2 resident
    rows = pd.read_csv(out)
    assert sorted(set(rows.load)) == [1, 2] and set(rows.BH) == {10, 20}
    assert (rows.device == "test GPU").all() and set(rows.kernel) == {8, 9}
    calls.clear()  # a variant whose kernels another measured (here: the same) is left out
    argv = ["--loads", "1", "--dtypes", "bfloat16", "--variants", "walk_mma_fused"]
    argv += ["walk_mma_fused_apart", "--out", str(tmp_path / "once.csv")]
    assert scaling.main(argv) == 0
    assert calls == [(10, 1, 1)] and set(pd.read_csv(tmp_path / "once.csv").variant) == {
        "walk_mma_fused"
    }
    monkeypatch.setattr(scaling.cuda_profile, "context_alive", lambda: False)
    calls.clear()
    assert scaling.main(["--loads", "3", "1", "--out", str(tmp_path / "broken.csv")]) == 1
    assert calls == [(30, 1, 1)] and not (tmp_path / "broken.csv").exists()


# three sizes, the causal products alone
CORE_SIZES = ["--n", "64", "96", "128", "--repeats", "1", "--backends", "torch", "--no-softmax"]


def _core_products_raise_at_96(core, monkeypatch, error: BaseException) -> None:
    """core.py's causal products raise ``error`` at N = 96; the other sizes run."""
    product = ks.causal_dot_product

    def causal_dot_product(phi_q, *args, **kwargs):
        if phi_q.shape[2] == 96:
            raise error
        return product(phi_q, *args, **kwargs)

    monkeypatch.setattr(core.ks, "causal_dot_product", causal_dot_product)


@pytest.mark.parametrize("where", ["gpu", "cpu"])
def test_core_out_of_memory_loses_one_size_only(core, tmp_path, monkeypatch, capsys, where):
    """One case running out of memory (a large N on a GPU) ended the run in a traceback, and
    the sizes measured before it were never written. A CPU's allocation failure is a plain
    RuntimeError, not torch.OutOfMemoryError: it was not caught at all."""
    failure = (
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        if where == "gpu"
        else RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't "
                          "allocate memory: you tried to allocate 68719476736 bytes")
    )  # fmt: skip
    _core_products_raise_at_96(core, monkeypatch, failure)
    out = tmp_path / "core.csv"
    assert core.main([*CORE_SIZES, "--out", str(out)]) == 0
    frame = pd.read_csv(out)
    failed = (frame.op == "causal_product") & (frame.N == 96)
    assert failed.sum() == 2 and (frame[failed].error == "out of memory").all()
    assert frame[failed].time_ms.isna().all() and (frame[~failed].time_ms > 0).all()
    assert set(frame.N) == {64, 96, 128} and "out of memory" in capsys.readouterr().err


def test_core_other_errors_still_raise_and_the_command_is_quoted(core, tmp_path, monkeypatch):
    """Only allocation failures are skipped; and the CSV's command was sys.argv joined by
    spaces (not main's argv; a path with a space read back as two arguments)."""

    def broken(*args, **kwargs):
        raise RuntimeError("shapes do not match")

    out = tmp_path / "a b" / "core.csv"
    argv = ["--n", "64", "--repeats", "1", "--modes", "fwd", "--backends", "torch"]
    assert core.main([*argv, "--no-softmax", "--out", str(out)]) == 0
    command = pd.read_csv(out).command.iloc[0]
    assert shlex.split(command) == ["python", "benchmarks/core.py", *argv, "--no-softmax",
                                    "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(core.ks, "causal_dot_product", broken)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        core.main([*argv, "--no-softmax", "--out", str(out)])


@pytest.mark.parametrize(
    "script, argv",
    [
        ("core", ["--n", "64"]),
        ("prefill", ["--quick"]),
        ("compiled_step", ["--quick"]),
        ("fp32_split_accuracy", []),
        ("cuda_core", []),
        ("cuda_counters", []),
        ("cuda_profile", []),
        ("cuda_scaling", []),
    ],
)
def test_an_out_that_cannot_be_written_is_refused_before_the_run(script, argv, tmp_path, capsys):
    """--out a folder, or under a file, failed with a traceback after the whole run (minutes
    of measurements lost); now argparse's one-line error, status 2, before anything runs."""
    module = benchmark_script(script)
    (tmp_path / "file").write_text("")
    for out, problem in (
        (tmp_path, "is a folder; give a file path"),
        (tmp_path / "file" / "x.csv", f"{tmp_path / 'file'} is not a folder"),
    ):
        with pytest.raises(SystemExit) as exit_:
            module.parse_args([*argv, "--out", str(out)])
        assert exit_.value.code == 2
        assert f"--out {out}: {problem}" in capsys.readouterr().err
    assert module.parse_args([*argv, "--out", str(tmp_path / "new" / "x.csv")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # the probe left nothing


def test_lm_benchmarks_do_not_write_over_the_committed_results_by_default():
    """`python benchmarks/prefill.py --quick`, as the README says, replaced the committed
    full-size prefill_cpu.csv (compiled_step.py likewise, also with --model classifier)."""
    committed = {p.name for p in (BENCHMARKS / "results").iterdir()}
    for script in ("prefill", "compiled_step"):
        out = benchmark_script(script).parse_args(["--quick"]).out
        assert Path(out).name not in committed, out


def test_resume_measures_only_the_cases_out_lacks(gpu_on_cpu, cuda_memory, tmp_path, capsys):
    """A later call of a GPU session goes on where the last stopped: --resume keeps the rows in
    --out as they are and measures only the cases they lack (sdpa in fp32 by its row label)."""
    cuda_core = gpu_on_cpu
    out = tmp_path / "cuda.csv"
    base = ["--shapes", "1x2", "--dims", "16", "--repeats", "1", "--warmup", "0"]
    base += ["--modes", "fwd", "--no-plot", "--out", str(out)]
    assert cuda_core.main([*base, "--n", "64", "--methods", "torch", "sdpa"]) == 0
    first = pd.read_csv(out)
    assert len(first) == 4 and len(cuda_memory.cases) == 4  # 2 dtypes × 2 methods
    assert [p.name for p in tmp_path.iterdir()] == ["cuda.csv"]  # --no-plot: no PNG
    argv = [*base, "--n", "64", "96", "--methods", "torch", "sdpa", "--resume"]
    assert cuda_core.main(argv) == 0
    whole = pd.read_csv(out)
    assert len(cuda_memory.cases) == 8  # only N=96's four cases ran
    assert len(whole) == 8 and sorted(whole.N.unique()) == [64, 96]
    pd.testing.assert_frame_equal(whole.iloc[:4], first)  # the earlier rows as they were
    capsys.readouterr()
    assert cuda_core.main(argv) == 0 and len(cuda_memory.cases) == 8  # nothing left to do
    assert "already in" in capsys.readouterr().err
    pd.testing.assert_frame_equal(pd.read_csv(out), whole)


def test_resume_keys_walk_cases_by_their_blocks_and_device(
    gpu_on_cpu, cuda_memory, monkeypatch, tmp_path, capsys
):
    """--resume took a walk row of one --walk-blocks for the case at another (one value
    labels rows plain ``cuda_walk``), so a session whose sweep changed its blocks measured
    nothing and kept the old rows; --from-csv kept one of two such rows. Rows of another
    GPU are not this one's cases: --resume refuses them."""
    cuda_core = gpu_on_cpu
    monkeypatch.setattr(cuda_core.ks, "backends", lambda: ["reference", "torch", "cuda"])
    monkeypatch.setattr(cuda_core, "make_case", _torch_for_cuda(cuda_core.make_case))
    out = tmp_path / "cuda.csv"
    base = ["--n", "32", "--shapes", "1x2", "--dims", "8", "--dtypes", "float32"]
    base += ["--modes", "fwd", "--repeats", "1", "--warmup", "0", "--no-plot"]
    base += ["--methods", "cuda_walk", "--out", str(out)]
    assert cuda_core.main([*base, "--walk-blocks", "128"]) == 0
    assert cuda_core.main([*base, "--walk-blocks", "256", "--resume"]) == 0
    assert len(cuda_memory.cases) == 2  # 256 is a case of its own
    rows = pd.read_csv(out)
    assert rows[["method", "walk_blocks"]].values.tolist() == [
        ["cuda_walk_128", 128],
        ["cuda_walk_256", 256],
    ]
    assert cuda_core.main([*base, "--walk-blocks", "128", "256", "--resume"]) == 0
    assert len(cuda_memory.cases) == 2  # both there, whatever their labels
    capsys.readouterr()
    monkeypatch.setattr(cuda_core.torch.cuda, "get_device_name", lambda *args: "other GPU")
    assert cuda_core.main([*base, "--walk-blocks", "512", "--resume"]) == 1
    assert "holds rows measured on test GPU, not on this other GPU" in capsys.readouterr().err
    pd.testing.assert_frame_equal(pd.read_csv(out), rows)


def test_walks_run_at_the_backends_walk_blocks_for_each_dtype(
    gpu_on_cpu, cuda_memory, monkeypatch, tmp_path
):
    """Without --walk-blocks a walk runs at the backend's WALK_BLOCKS for its dtype (a dict:
    each its own), read before the first case sets it; the rows say which."""
    cuda_core = gpu_on_cpu
    monkeypatch.setattr(cuda_core.ks, "backends", lambda: ["reference", "torch", "cuda"])
    seen = []
    make_case = _torch_for_cuda(cuda_core.make_case)

    def case(method, b, h, n, d, dtype, fla_fn, walk_blocks=None):
        seen.append((method, dtype, walk_blocks))
        cuda_core.cuda_backend.use_variant(cuda_core.CUDA_METHODS[method], walk_blocks)
        return make_case(method, b, h, n, d, dtype, fla_fn, walk_blocks)

    monkeypatch.setattr(cuda_core, "make_case", case)
    torch = cuda_core.torch
    by_dtype = {torch.float32: 96, torch.float16: 64, torch.bfloat16: 1024}
    monkeypatch.setattr(cuda_core.cuda_backend, "WALK_BLOCKS", by_dtype)
    out = tmp_path / "cuda.csv"
    argv = ["--n", "32", "--shapes", "1x2", "--dims", "8", "--dtypes", "bfloat16", "float32"]
    argv += ["--modes", "fwd", "--repeats", "1", "--warmup", "0", "--no-plot"]
    argv += ["--methods", "cuda_walk", "cuda", "--out", str(out)]
    assert cuda_core.main(argv) == 0
    assert seen == [
        ("cuda_walk", torch.bfloat16, 1024), ("cuda", torch.bfloat16, None),
        ("cuda_walk", torch.float32, 96), ("cuda", torch.float32, None),
    ]  # fmt: skip
    rows = pd.read_csv(out)
    assert rows.method.tolist() == ["cuda_walk", "cuda", "cuda_walk", "cuda"]
    assert rows.walk_blocks.tolist()[::2] == [1024, 96] and rows.walk_blocks.isna().tolist()[
        1::2
    ] == [True, True]


def _torch_for_cuda(make_case):
    """``make_case`` with our CUDA methods computed by the torch backend (on the CPU)."""

    def case(method, *rest):
        label, fn, inputs = make_case("torch" if method.startswith("cuda") else method, *rest)
        return method if method.startswith("cuda") else label, fn, inputs

    return case


def test_resume_after_a_broken_context_goes_on_without_that_method(
    gpu_on_cpu, monkeypatch, tmp_path, capsys
):
    """The GPU session reruns a run that a method stopped (an illegal address) without that
    method, with --resume: the rows before the break, the broken case's row included, stay."""
    cuda_core = gpu_on_cpu
    make_case = cuda_core.make_case

    def faulty_case(method, *rest):
        if method == "cuda_walk":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return make_case("torch" if method.startswith("cuda") else method, *rest)

    monkeypatch.setattr(cuda_core, "make_case", faulty_case)
    monkeypatch.setattr(cuda_core, "context_alive", lambda: False)
    monkeypatch.setattr(cuda_core.ks, "backends", lambda: ["reference", "torch", "cuda"])
    out = tmp_path / "cuda.csv"
    argv = ["--n", "64", "--shapes", "1x2", "--dims", "16", "--dtypes", "bfloat16"]
    argv += ["--repeats", "1", "--warmup", "0", "--modes", "fwd", "--out", str(out)]
    assert cuda_core.main([*argv, "--methods", "sdpa", "cuda_walk", "torch"]) == 1
    assert "the CUDA context broke in cuda_walk fwd" in capsys.readouterr().err
    monkeypatch.setattr(cuda_core, "context_alive", lambda: True)
    assert cuda_core.main([*argv, "--methods", "sdpa", "torch", "--resume"]) == 0
    frame = pd.read_csv(out)
    assert frame.method.tolist() == ["sdpa", "cuda_walk", "torch"]
    assert frame.time_ms.notna().tolist() == [True, False, True]
    assert "illegal memory access" in frame.error.iloc[1]


def test_from_csv_joins_runs_and_reports_without_a_gpu(cuda_core, tmp_path, capsys):
    """The session's CSVs come back from the GPU machine; --from-csv joins them here (a later
    row of the same case wins), writes the CSV and its plot, and prints the target ratios."""
    first, second = tmp_path / "targets.csv", tmp_path / "sweep.csv"
    _frame().to_csv(first, index=False)
    rerun = _frame().iloc[[0]].assign(time_ms=0.75)  # cuda bf16 2048 measured again
    extra = _frame().iloc[[0]].assign(N=4096, time_ms=2.0)
    pd.concat([rerun, extra]).to_csv(second, index=False)
    out = tmp_path / "joined" / "cuda_h200.csv"
    argv = ["--from-csv", str(first), str(second), "--out", str(out)]
    assert cuda_core.main(argv) == 0
    joined = pd.read_csv(out)
    assert len(joined) == len(_frame()) + 1
    cell = joined[(joined.method == "cuda") & (joined.N == 2048)]
    assert cell.time_ms.tolist() == [0.75]
    assert out.with_suffix(".png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "N=8192 bf16 cuda/fla: 1.200" in printed and "time (ms, median):" in printed
    bad = tmp_path / "bad.csv"
    bad.write_text("method,N\ncuda,8\n")
    assert cuda_core.main(["--from-csv", str(bad), "--out", str(tmp_path / "x.csv")]) == 1
    assert "bad.csv: not a results CSV of this script (no column 'mode')" in capsys.readouterr().err
    assert not (tmp_path / "x.csv").exists()
    with pytest.raises(SystemExit) as exit_info:
        cuda_core.parse_args(["--from-csv", str(tmp_path / "missing.csv")])
    assert exit_info.value.code == 2


def test_join_labels_walk_rows_by_their_blocks(cuda_core):
    """The targets run sweeps several WALK_BLOCKS (``cuda_walk_fused_128``, ...); the sweep
    runs one (``cuda_walk_fused``, walk_blocks 128). Joined, a case is one row, labelled with
    its blocks; a walk method no run labelled with blocks keeps its name."""
    case = dict(mode="fwd+bwd", dtype="float32", B=8, H=16, BH=128, F=64, M=64)
    targets = pd.DataFrame(
        [
            case | dict(method="cuda_walk_fused_128", walk_blocks=128, N=4096, time_ms=3.0),
            case | dict(method="cuda_walk_fused_256", walk_blocks=256, N=4096, time_ms=4.0),
            case | dict(method="cuda_walk", walk_blocks=512, N=4096, time_ms=5.0),
        ]
    )
    sweep = pd.DataFrame(
        [
            case | dict(method="cuda_walk_fused", walk_blocks=128, N=4096, time_ms=2.5),
            case | dict(method="cuda_walk_fused", walk_blocks=128, N=16384, time_ms=9.0),
            case | dict(method="torch", walk_blocks=None, N=16384, time_ms=18.0),
        ]
    )
    joined = cuda_core.join(targets, sweep).set_index(["method", "N"]).time_ms.to_dict()
    assert joined == {
        ("cuda_walk_fused_128", 4096): 2.5,
        ("cuda_walk_fused_256", 4096): 4.0,
        ("cuda_walk", 4096): 5.0,
        ("cuda_walk_fused_128", 16384): 9.0,
        ("torch", 16384): 18.0,
    }
    # bf16 at its own blocks (a per-dtype WALK_BLOCKS): a case of its own, labelled apart
    bf16 = case | dict(dtype="bfloat16", N=4096)
    other = pd.DataFrame(
        [
            bf16 | dict(method="cuda_walk", walk_blocks=1024, time_ms=1.0),
            bf16 | dict(method="cuda_walk_fused", walk_blocks=1024, time_ms=0.5),
            bf16 | dict(method="cuda_walk_fused", walk_blocks=4096, time_ms=0.6),
        ]
    )
    joined = cuda_core.join(targets, sweep, other).set_index(["dtype", "method", "N"]).time_ms
    assert joined.to_dict() == {
        ("float32", "cuda_walk_fused_128", 4096): 2.5,
        ("float32", "cuda_walk_fused_256", 4096): 4.0,
        ("float32", "cuda_walk", 4096): 5.0,
        ("float32", "cuda_walk_fused_128", 16384): 9.0,
        ("float32", "torch", 16384): 18.0,
        ("bfloat16", "cuda_walk", 4096): 1.0,
        ("bfloat16", "cuda_walk_fused_1024", 4096): 0.5,
        ("bfloat16", "cuda_walk_fused_4096", 4096): 0.6,
    }


# --- cuda_counters.py: ncu's CSV pages read back, and the run through a stand-in ncu ---

KERNEL_6 = (
    "void ks_cuda::(anonymous namespace)::chunk_walk_kernel<__nv_bfloat16, __nv_bfloat16, 1>"
    "(const T1 *, const T1 *, const T1 *, const float *, T2 *, float *, long, long)"
)
KERNEL_9 = (
    "void ks_cuda::(anonymous namespace)::chunk_walk_mma_dkv_kernel<__nv_bfloat16, float>"
    "(const T1 *, const T1 *, const T1 *, const T1 *, const float *, T2 *, T2 *, long, bool)"
)
LAUNCH = '"{id}","4242","python3","127.0.0.1","{kernel}","1","{stream}","(256, 1, 1)","(128, 1, 1)"'
DETAILS_HEAD = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
    '"Block Size","Grid Size","Section Name","Metric Name","Metric Unit","Metric Value",'
    '"Rule Name"'
)


def _details(launches) -> str:
    """A details page as ncu prints it: its own lines first, a rule row without a metric."""
    lines = ["==PROF== Connected to process 4242", DETAILS_HEAD]
    for i, (kernel, stream, ms) in enumerate(launches):
        launch = LAUNCH.format(id=i, kernel=kernel, stream=stream)
        lines += [
            f'{launch},"GPU Speed Of Light Throughput","Duration","usecond","{ms * 1000:,.2f}",""',
            f'{launch},"Compute Workload Analysis","Executed Ipc Active","inst/cycle","0.91",""',
            f'{launch},"Launch Statistics","Registers Per Thread","register/thread","128",""',
            f'{launch},"Warp State Statistics","","","","CPIStall"',
        ]
    return "\n".join(lines) + "\n"


def _raw(launches, units=True) -> str:
    stalls = ["barrier", "long_scoreboard", "math_pipe_throttle", "selected", "wait"]
    metrics = [f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in stalls]
    metrics += ["smsp__inst_executed_pipe_tensor.sum", "dram__bytes_read.sum"]
    metrics += ["sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"]
    fixed = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
    lines = [fixed + '"Block Size","Grid Size",' + ",".join(f'"{m}"' for m in metrics)]
    if units:
        lines.append(",".join(['""'] * 9 + ['"ratio"'] * 5 + ['"inst"', '"Mbyte"', '"%"']))
    for i, (kernel, stream, _) in enumerate(launches):
        values = ["0.5", "3.25", "1.5", "1", "0.75", "1,280", "512", "12.5"]
        lines.append(
            LAUNCH.format(id=i, kernel=kernel, stream=stream)
            + ","
            + ",".join(f'"{v}"' for v in values)
        )
    return "\n".join(lines) + "\n"


LAUNCHES = [(KERNEL_6, 13, 0.6), (KERNEL_6, 13, 0.7), (KERNEL_9, 14, 0.5), (KERNEL_9, 14, 0.4)]


@pytest.fixture(scope="module")
def counters():
    return benchmark_script("cuda_counters")


def test_counters_kernel_names_and_numbers(counters):
    assert counters.short_kernel(KERNEL_6) == "chunk_walk_kernel<__nv_bfloat16, __nv_bfloat16, 1>"
    assert counters.short_kernel("chunk_walk_dkv_kernel") == "chunk_walk_dkv_kernel"
    assert counters.short_kernel("void f<(int)2>(int)") == "f<(int)2>"
    assert counters.number("1,234.5") == 1234.5 and math.isnan(counters.number("n/a"))


def test_counters_details_page(counters):
    frame = counters.parse_details(_details(LAUNCHES))
    assert len(frame) == 3 * len(LAUNCHES)  # the rule rows (no metric) left out
    duration = frame[frame.metric == "Duration"]
    assert duration.value.tolist() == [600, 700, 500, 400] and set(duration.unit) == {"usecond"}
    assert frame.kernel.iloc[-1] == "chunk_walk_mma_dkv_kernel<__nv_bfloat16, float>"
    assert set(frame.stream) == {"13", "14"} and set(frame.grid) == {"(128, 1, 1)"}
    assert counters.parse_details("==PROF== no kernel was profiled\n").empty
    with pytest.raises(ValueError, match="lacks columns"):
        counters.parse_details('"ID","Kernel Name"\n"0","k"\n')


@pytest.mark.parametrize("units", [True, False], ids=["units_row", "no_units_row"])
def test_counters_raw_page_keeps_stalls_and_pipes(counters, units):
    frame = counters.parse_raw(_raw(LAUNCHES, units))
    assert len(frame) == 7 * len(LAUNCHES)  # five stall reasons, the tensor pipe twice
    assert not frame.metric.str.startswith("dram__").any()
    tensor = frame[frame.metric == "smsp__inst_executed_pipe_tensor.sum"]
    assert tensor.value.tolist() == [1280.0] * 4
    assert set(tensor.unit) == ({"inst"} if units else {""})


def test_counters_label_steps_by_stream_and_summarize(counters, capsys):
    frame = pd.concat(
        [counters.parse_details(_details(LAUNCHES)), counters.parse_raw(_raw(LAUNCHES))]
    )
    steps = [("bfloat16", "walk_fused"), ("bfloat16", "walk_mma_fused")]
    labelled = counters.label_launches(frame, steps)
    by_id = labelled.drop_duplicates("id").set_index("id")
    assert by_id.variant.tolist() == ["walk_fused"] * 2 + ["walk_mma_fused"] * 2
    assert set(by_id.dtype) == {"bfloat16"}
    table = counters.summary(labelled)
    assert table["time (usecond)"].tolist() == [600, 700, 500, 400]
    assert table["registers (register/thread)"].tolist() == [128] * 4
    assert table["tensor pipe %"].tolist() == [12.5] * 4
    # the three largest stalls, the cycles of issuing ("selected") left out
    assert set(table["stalls (cycles/instr)"]) == {
        "long_scoreboard 3.2, math_pipe_throttle 1.5, wait 0.75"
    }
    # an ncu whose raw page names no stall reason or pipe: the table without those columns
    details = counters.label_launches(counters.parse_details(_details(LAUNCHES)), steps)
    assert list(counters.summary(details).columns)[-1] == "registers (register/thread)"
    unlabelled = counters.label_launches(frame, steps[:1])  # a step without walk kernels
    assert set(unlabelled.variant) == {""}
    assert "2 streams with walk kernels for 1 profiled steps" in capsys.readouterr().err


FAKE_NCU = """#!{python}
import sys, pathlib
args = sys.argv[1:]
pathlib.Path({log!r}).write_text(" ".join(args))
if "--import" in args:
    page = args[args.index("--page") + 1]
    sys.stdout.write(pathlib.Path({pages!r}, page + ".csv").read_text())
    sys.exit(0)
dtype = args[args.index("--dtypes") + 1]
print({said!r})
if {report} and dtype != {broken!r}:
    pathlib.Path(args[args.index("--export") + 1] + ".ncu-rep").write_text("report")
print("cuda_counters.py: device Test GPU")
print(f"cuda_counters.py: profiled {{dtype}} walk_fused")
print(f"cuda_counters.py: profiled {{dtype}} walk_mma_fused")
"""


def _fake_ncu(
    tmp_path: Path, said: str = "==PROF== Disconnected", report: bool = True, broken: str = ""
) -> Path:
    """An ncu that prints ``said``, writes a report (not for dtype ``broken``) and, on
    --import, the canned pages."""
    pages = tmp_path / "pages"
    pages.mkdir(exist_ok=True)
    (pages / "details.csv").write_text(_details(LAUNCHES))
    (pages / "raw.csv").write_text(_raw(LAUNCHES))
    ncu = tmp_path / "ncu"
    text = FAKE_NCU.format(
        python=sys.executable, log=str(tmp_path / "ncu_args"), pages=str(pages), said=said,
        report=report, broken=broken,
    )  # fmt: skip
    ncu.write_text(text)
    ncu.chmod(0o755)
    return ncu


def test_counters_run_under_ncu_writes_a_long_csv(counters, tmp_path, capsys):
    ncu, out = _fake_ncu(tmp_path), tmp_path / "counters.csv"
    assert counters.main(["--ncu", str(ncu), "--out", str(out)]) == 0
    frame = pd.read_csv(out)
    assert set(frame.variant) == {"walk_fused", "walk_mma_fused"} and set(frame.device) == {
        "Test GPU"
    }
    assert (frame.N == 8192).all() and (frame.F == 64).all() and (frame.B == 8).all()
    assert "long_scoreboard 3.2" in capsys.readouterr().out
    args = (tmp_path / "ncu_args").read_text().split()  # the last call: an import
    assert "--import" in args and "--csv" in args


def test_counters_each_dtype_is_its_own_run(counters, tmp_path):
    """A dtype whose run gives no report (its child broke) keeps the others' rows; launch ids
    go on across the runs."""
    ncu, out = _fake_ncu(tmp_path, broken="float16"), tmp_path / "counters.csv"
    argv = ["--ncu", str(ncu), "--out", str(out), "--dtypes", "bfloat16", "float16", "float32"]
    assert counters.main(argv) == 1
    frame = pd.read_csv(out)
    assert sorted(set(frame.dtype)) == ["bfloat16", "float32"]
    assert sorted(set(frame.id)) == list(range(2 * len(LAUNCHES)))
    assert set(frame[frame.id >= len(LAUNCHES)].dtype) == {"float32"}


def test_counters_profile_command(counters, tmp_path):
    """ncu leaves the clocks alone, profiles only the marked step and only the walk kernels,
    and runs this script as its child with arguments the script takes."""
    args = counters.parse_args(["--dtypes", "bfloat16", "float32", "--n", "4096"])
    argv = counters.ncu_argv("ncu", tmp_path / "r", args)
    text = " ".join(argv)
    assert "--clock-control none" in text and "--profile-from-start off" in text
    assert f"--kernel-name {counters.KERNELS}" in text and "--section WarpStateStats" in text
    child = counters.parse_args(argv[argv.index("--child") :])
    assert child.child and child.dtypes == ["bfloat16", "float32"] and child.n == 4096


@pytest.mark.parametrize(
    ("said", "report", "rc"),
    [
        ("==ERROR== ERR_NVGPUCTRPERM - no permission to access the counters", False, 3),
        ("==ERROR== Failed to initialize the profiler: LibraryNotLoaded", True, 3),
        ("==ERROR== The application returned an error code (1).", False, 1),
    ],
    ids=["no_permission", "no_profiler", "child_failed"],
)
def test_counters_without_counters_or_report(counters, tmp_path, capsys, said, report, rc):
    ncu, out = _fake_ncu(tmp_path, said, report), tmp_path / "counters.csv"
    assert counters.main(["--ncu", str(ncu), "--out", str(out)]) == rc
    assert not out.exists()
    assert counters.main(["--ncu", str(tmp_path / "no_ncu"), "--out", str(out)]) == 3
    assert "ncu (Nsight Compute) is not here" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_counters_child_refuses_without_a_gpu(counters, capsys):
    assert counters.main(["--child"]) == 1
    assert "no GPU or no cuda backend" in capsys.readouterr().err


# --- cuda_sass.py: ptxas' report and cuobjdump's SASS read back; the real kernels with the tools
PTXAS_REPORT = """\
ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90a'
ptxas info    : Function properties for _Z3fooPf
    16 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 16 bytes cumulative stack size
ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_80'
ptxas info    : Function properties for _Z3fooPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers
"""
# a function with a loop of 4 instructions (0x0020 .. 0x0050) and one outside it
SASS = """\
\tcode for sm_90a
\t\tFunction : _Z3fooPf
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
        /*0010*/                   NOP ;
        /*0020*/                   LDSM.16.M88.4 R4, [R2] ;
        /*0030*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;
        /*0040*/              @!P0 LDG.E.U16 R9, desc[UR4][R2.64] ;
        /*0050*/               @P1 BRA 0x20 ;
        /*0060*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0070*/                   EXIT ;
\t\tFunction : _Z3barv
        /*0000*/                   EXIT ;
"""


@pytest.fixture(scope="module")
def cuda_sass():
    return benchmark_script("cuda_sass")


def test_cuda_sass_reads_ptxas_report_per_architecture(cuda_sass):
    table = cuda_sass.resources(PTXAS_REPORT, "sm_90a")
    assert table.to_dict("records") == [
        dict(mangled="_Z3fooPf", registers=128, spill_stores=12, spill_loads=8, stack=16)
    ]
    assert cuda_sass.resources(PTXAS_REPORT, "sm_80")["registers"].tolist() == [96]


def test_cuda_sass_counts_instructions_kinds_and_the_loop(cuda_sass):
    assert cuda_sass.opcode("@!P0 LDG.E.U16 R9, desc[UR4][R2.64]") == "LDG"
    table = cuda_sass.sass_counts(SASS).set_index("mangled")
    foo = table.loc["_Z3fooPf"]
    assert foo["instructions"] == 7  # the NOP left out
    assert foo["loop_instructions"] == 4
    assert (foo["hmma"], foo["ldsm"], foo["ldg"], foo["bar"], foo["stg"]) == (1, 1, 1, 1, 0)
    assert table.loc["_Z3barv", "loop_instructions"] == 0


def test_cuda_sass_sets_two_revisions_side_by_side(cuda_sass):
    now = pd.DataFrame(
        dict(kernel=["a", "b"], instructions=[90, 50], loop_instructions=[40, 0],
             registers=[128, 64], spill_stores=[0, 4])
    )  # fmt: skip
    before = now.assign(instructions=[100, 50], spill_stores=[8, 4])
    table = cuda_sass.side_by_side(now, before).set_index("kernel")
    assert table.loc["a", "d_instructions"] == -10 and table.loc["a", "d_spill_stores"] == -8
    assert table.loc["b", "d_instructions"] == 0 and table.loc["a", "instructions_before"] == 100


def test_cuda_sass_refuses_bad_arguments_and_missing_tools(cuda_sass, monkeypatch, capsys):
    with pytest.raises(SystemExit) as stop:
        cuda_sass.main(["--arch", "hopper"])
    assert stop.value.code == 2 and "--arch" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        cuda_sass.main(["--kernels", "walk("])
    assert stop.value.code == 2 and "--kernels" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        cuda_sass.main(["--flags", "-DX='unclosed"])
    assert stop.value.code == 2 and "--flags" in capsys.readouterr().err
    monkeypatch.setattr(cuda_sass.shutil, "which", lambda name: None)
    assert cuda_sass.main(["--cuobjdump", "/nonexistent/cuobjdump"]) == cuda_sass.UNAVAILABLE
    assert "nvcc, cuobjdump, c++filt not found" in capsys.readouterr().err


def test_cuda_sass_passes_the_variants_flags_to_nvcc(cuda_sass, monkeypatch, tmp_path):
    """--flags reaches nvcc for the working tree's build (after torch's flags), not REF's."""
    commands = []

    def run(command, **kwargs):
        commands.append(command)
        return subprocess.CompletedProcess(command, 0, stdout="", stderr="")

    monkeypatch.setattr(cuda_sass.subprocess, "run", run)
    unit = tmp_path / "cuda" / "a.cu"
    cuda_sass.compile_cubin(unit, "sm_90a", tmp_path / "a.cubin", ["-DKS_FP32_BF16X3"])
    cuda_sass.compile_cubin(unit, "sm_90a", tmp_path / "a.cubin")
    with_flag, without = commands
    at = without.index("-Xptxas")  # torch's flags before, ptxas' report and the files after
    assert with_flag == [*without[:at], "-DKS_FP32_BF16X3", *without[at:]]


def test_cuda_sass_on_the_kernels(cuda_sass, tmp_path):
    """The real sources (nvcc, cuobjdump and c++filt needed; cuobjdump is not in CUDA's nvcc-only
    installs, so this is skipped where it is missing): every instance of kernel 8 has tensor-core
    products and a chunk loop inside its code."""
    cuobjdump = cuda_sass.find_tool("cuobjdump")
    if not (shutil.which("nvcc") and cuobjdump and shutil.which("c++filt")):
        pytest.skip("needs nvcc, cuobjdump and c++filt")
    out = tmp_path / "sass.csv"
    assert cuda_sass.main(["--kernels", "chunk_walk_mma_kernel", "--out", str(out)]) == 0
    table = pd.read_csv(out)
    assert len(table) >= 7 and (table["hmma"] > 0).all()
    assert (table["loop_instructions"] > 0).all() and (
        table["loop_instructions"] < table["instructions"]
    ).all()
    assert set(table["arch"]) == {"sm_90a"} and table["command"].str.contains("--kernels").all()


# ---------------------------------------------------------------- benchmarks/prefill.py (CPU)
@pytest.fixture(scope="module")
def prefill():
    return benchmark_script("prefill")


def test_prefill_times_both_ways_and_they_agree(prefill, tmp_path):
    out = tmp_path / "prefill.csv"
    small = ["--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--batch", "2"]
    argv = ["--prompt-lens", "5", "9", "--repeats", "1", "--feature-map", "favor", *small]
    assert prefill.main([*argv, "--out", str(out)]) == 0
    frame = pd.read_csv(out, keep_default_na=False)
    assert len(frame) == 8  # 2 attentions x 2 lengths x 2 ways
    assert set(frame.way) == {"tokens", "block"} and (frame.time_ms > 0).all()
    assert set(frame.feature_map) == {"favor", ""}  # softmax rows have no map
    assert (frame.max_logit_diff < 1e-4).all()  # both ways leave the same state
    tokens = frame[frame.way == "tokens"].set_index(["attention", "prompt_len"]).time_ms
    block = frame[frame.way == "block"].set_index(["attention", "prompt_len"])
    assert block.speedup.tolist() == pytest.approx((tokens / block.time_ms).tolist())
    assert {"matmul_gflops", "frac_matmul", "device", "command", "date"} <= set(frame.columns)
    # the thread count (softmax's last bits depend on it) and the code's version, commit too
    assert (frame.threads == torch.get_num_threads()).all()
    assert frame.kernelstudy.str.startswith(ks.__version__).all()
    assert [p.name for p in tmp_path.iterdir()] == ["prefill.csv"]  # no temp file left


def test_ctrl_c_keeps_the_cases_measured_before(prefill, core, tmp_path, monkeypatch, capsys):
    """Ctrl-C in a CPU benchmark exited 130 with a traceback and wrote nothing: every case
    measured before it was lost. Now they are written, and the status is still 130."""
    read_prompt = prefill.read_prompt

    def interrupted_at_9(model, prompt, way):
        if prompt.shape[1] == 9:
            raise KeyboardInterrupt
        return read_prompt(model, prompt, way)

    monkeypatch.setattr(prefill, "read_prompt", interrupted_at_9)
    out = tmp_path / "prefill.csv"
    small = ["--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--attentions", "softmax"]
    assert (
        prefill.main(["--prompt-lens", "5", "9", "--repeats", "1", *small, "--out", str(out)])
        == 130
    )
    assert set(pd.read_csv(out).prompt_len) == {5}
    assert "interrupted: " in capsys.readouterr().err
    assert prefill.main(["--prompt-lens", "9", "--repeats", "1", *small, "--out", str(out)]) == 130
    assert set(pd.read_csv(out).prompt_len) == {5}  # none measured: --out left as it was
    assert "interrupted before any case" in capsys.readouterr().err

    _core_products_raise_at_96(core, monkeypatch, KeyboardInterrupt())
    out = tmp_path / "core.csv"
    assert core.main([*CORE_SIZES, "--out", str(out)]) == 130
    assert set(pd.read_csv(out).N) == {64}


# ---------------------------------------------------------------- benchmarks/compiled_step.py
@pytest.fixture(scope="module")
def compiled_step():
    return benchmark_script("compiled_step")


@pytest.fixture
def aot_eager(monkeypatch):
    """The script's torch.compile with the aot_eager backend: its timing, gradients and table
    are checked without inductor's cold C++ compiles (a minute of CPU on CI's two cores;
    inductor on the models: test_models.py), the mode asked for recorded."""
    modes = []
    real = torch.compile

    def compile_without_inductor(model, fullgraph, mode):
        modes.append(mode)
        return real(model, fullgraph=fullgraph, backend="aot_eager")

    monkeypatch.setattr(torch, "compile", compile_without_inductor)
    return modes


def test_compiled_step_times_both_ways_and_they_agree(
    compiled_step, tmp_path, monkeypatch, aot_eager
):
    """Also: compile_s is a cold compile (it read inductor's on-disk cache from an earlier
    run, 6 s for a cold 36 s): the first step of each way runs with inductor's caches off."""
    seen = []
    real = compiled_step.train_step

    def train_step(run, model, ids):
        seen.append((run is model, torch._inductor.config.force_disable_caches))
        return real(run, model, ids)

    monkeypatch.setattr(compiled_step, "train_step", train_step)
    out = tmp_path / "compiled.csv"
    small = ["--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--batch", "2"]
    argv = ["--seq-lens", "9", "--repeats", "1", "--attentions", "kernel", "softmax", *small]
    assert compiled_step.main([*argv, "--out", str(out)]) == 0
    assert seen[:2] == [(True, True), (False, True)]  # the first step of each way, cold
    assert sum(cold for _, cold in seen) == 4 and not torch._inductor.config.force_disable_caches
    frame = pd.read_csv(out, keep_default_na=False)
    assert len(frame) == 4  # 2 attentions x 1 length x 2 ways
    assert set(frame.way) == {"eager", "compiled"} and (frame.time_ms > 0).all()
    compiled = frame[frame.way == "compiled"].set_index("attention")
    eager = frame[frame.way == "eager"].set_index("attention")
    assert compiled.speedup.tolist() == pytest.approx((eager.time_ms / compiled.time_ms).tolist())
    assert (compiled.max_grad_diff < 1e-4).all() and (compiled.compile_s > 0).all()
    assert (eager.max_grad_diff == 0).all() and (eager.compile_s == 0).all()
    assert set(compiled["mode"]) == {"default"} and set(eager["mode"]) == {""}
    assert aot_eager == [compiled_step.MODES["default"]] * 2  # one compile per attention
    assert {"matmul_gflops", "frac_matmul", "device", "command", "date"} <= set(frame.columns)
    assert [p.name for p in tmp_path.iterdir()] == ["compiled.csv"]  # no temp file left


def test_compiled_step_times_a_classifier_too(compiled_step, tmp_path, aot_eager):
    out = tmp_path / "classifier.csv"
    small = ["--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--batch", "3"]
    argv = ["--model", "classifier", "--seq-lens", "7", "--repeats", "1", "--attentions", "kernel"]
    assert compiled_step.main([*argv, *small, "--out", str(out)]) == 0
    frame = pd.read_csv(out, keep_default_na=False)
    assert list(frame.way) == ["eager", "compiled"] and set(frame.model) == {"classifier"}
    assert frame.max_grad_diff.iloc[1] < 1e-4 and (frame.time_ms > 0).all()


def test_compiled_step_compares_gradients_relative_to_each_parameter(compiled_step):
    want = [torch.tensor([2.0, -4.0]), torch.zeros(3)]
    got = [torch.tensor([2.0, -4.4]), torch.tensor([0.0, 0.5, 0.0])]
    assert compiled_step.max_relative_diff(got, want) == pytest.approx(0.5)
    assert compiled_step.max_relative_diff(want, want) == 0.0


# the causal-LM benchmarks: the flags they share (lm_cases.py) and their own
LM_FLAG_CASES = [
    ("prefill", ["--prompt-lens", "0"], "--prompt-lens"),
    ("compiled_step", ["--seq-lens", "1"], "--seq-lens"),
    *(
        (script, flags, match)
        for script in ("prefill", "compiled_step")
        for flags, match in (
            (["--repeats", "0"], "--repeats"),
            (["--d-model", "10", "--n-heads", "4"], "divisible"),
            (["--feature-map", "nope"], "--feature-map"),
            (["--device", "tpu9"], "--device"),
            (["--device", "meta"], "expected cpu, cuda"),
        )
    ),
]


@pytest.mark.parametrize(("script", "flags", "match"), LM_FLAG_CASES)
def test_lm_benchmarks_check_their_arguments(script, capsys, flags, match):
    with pytest.raises(SystemExit) as exit_:
        benchmark_script(script).parse_args(flags)
    assert exit_.value.code == 2 and match in capsys.readouterr().err


def test_lm_benchmarks_measure_a_value_given_twice_once():
    flags = ["--attentions", "kernel", "kernel"]
    prefill = benchmark_script("prefill").parse_args([*flags, "--prompt-lens", "8", "8", "4"])
    assert (prefill.attentions, prefill.prompt_lens) == (["kernel"], [8, 4])
    step = benchmark_script("compiled_step").parse_args(["--seq-lens", "8", "8"])
    assert step.seq_lens == [8]


@pytest.mark.parametrize("script", ["prefill", "compiled_step"])
def test_lm_benchmarks_refuse_cuda_without_a_gpu(script, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out.csv"
    assert benchmark_script(script).main(["--device", "cuda", "--out", str(out)]) == 1
    assert "no CUDA GPU" in capsys.readouterr().err and not out.exists()


# ---------------------------------------------------------------- benchmarks/fp32_split_accuracy.py
@pytest.fixture(scope="module")
def split_accuracy():
    return benchmark_script("fp32_split_accuracy")


def test_split_operands_round_as_tensor_cores_do(split_accuracy):
    """tf32 keeps 10 mantissa bits, rounding to nearest with ties away from zero; hi + lo of a
    split holds 21 bits (tf32) or 16 (bf16) of the float32 operand."""
    one = torch.tensor([1 + 2**-11, 1 + 2**-12, -(1 + 2**-11), 1 + 3 * 2**-11])
    got = split_accuracy.round_mantissa(one, 10)
    assert got.tolist() == [1 + 2**-10, 1.0, -(1 + 2**-10), 1 + 2 * 2**-10]
    x = torch.randn(1000)
    for kind, bits in (("tf32", 21), ("bf16", 16)):
        hi, lo = split_accuracy.split(x, kind)
        assert ((hi + lo - x).abs() <= x.abs() * 2.0**-bits).all(), kind
    with pytest.raises(TypeError, match="float32"):
        split_accuracy.round_mantissa(x.double(), 10)


def test_split_accuracy_writes_each_method_s_error(split_accuracy, tmp_path):
    out = tmp_path / "split.csv"
    assert split_accuracy.main(["--shapes", "1x2x70x8x5", "--out", str(out)]) == 0
    frame = pd.read_csv(out)
    assert len(frame) == 10  # 2 quantities x 5 methods
    errors = frame.groupby("method").max_rel_err.max()
    assert errors["fp32"] < 1e-6 and errors["tf32x3"] < 1e-6
    assert errors["bf16x3"] < 1e-4 < errors["bf16x1"]  # the split keeps float32's tolerance
    assert errors["tf32x1"] > 10 * errors["tf32x3"]
    assert {"command", "date", "torch"} <= set(frame.columns)


@pytest.mark.parametrize("shape", ["1x2x3x4", "1x2x3x4x0", "axbxcxdxe"])
def test_split_accuracy_refuses_a_bad_shape(split_accuracy, capsys, shape):
    with pytest.raises(SystemExit) as exit_:
        split_accuracy.parse_args(["--shapes", shape])
    assert exit_.value.code == 2 and "BxHxNxFxM" in capsys.readouterr().err


def test_scripts_end_quietly_in_a_pipe_whose_reader_stopped(tmp_path):
    """The scripts printed a BrokenPipeError traceback and exited 1 under ``| head`` (the
    ``kernelstudy`` command is quiet there, with status 141), and ``2>&-`` (Python's
    ``sys.stderr`` None) ended a progress bar in AttributeError. Every script with a ``main``
    runs it through ``run_script``; ``cuda_core.py --from-csv`` (no GPU needed) shows both."""
    for path in sorted(BENCHMARKS.glob("*.py")):
        text = path.read_text()
        if "def main(" in text and path.name != "gpu_session.py":  # that one: no kernelstudy
            assert "sys.exit(run_script(main))" in text, path.name
    command = [
        sys.executable, str(BENCHMARKS / "cuda_core.py"), "--from-csv",
        str(BENCHMARKS / "results" / "cuda_h200.csv"), "--no-plot", "--out",
        str(tmp_path / "t.csv"),
    ]  # fmt: skip
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=buffered)
    proc.stdout.close()  # the reader is gone before the script writes
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=300) == 141 and "Traceback" not in err, err
    run = subprocess.run(command, preexec_fn=lambda: os.close(2), stdout=subprocess.PIPE)
    assert run.returncode == 0 and b"time (ms, median)" in run.stdout, run.stdout[-500:]
