r"""One GPU session of the CUDA core (issue 5) in one command: build, test, profile and
benchmark, each stage held to its share of a time budget, every result under one folder.

A session's device machine is lent for minutes (15 in all in late 2026, its start included; 10
a command; one left idle 30 s goes back) and returns at most 8 files from ``$OUT``. So the check
is prepared commands, run in the repository root on the GPU machine:

    python3 benchmarks/gpu_session.py --budget 540 --out "$OUT"   # device run timeout_s 590

runs every stage, each held to its share of the budget. Every stage no longer fits 540 s, and
15 minutes of device time (its start of a minute or two included) hold one such call and a
short second one, issued as soon as the first returns (the machine still warm). So the first
takes what the issue needs (the tests, the targets, the race check) and the profile; the second
the sweep, or why the walks take their time:

    python3 benchmarks/gpu_session.py --budget 540 --stages tests targets profile racecheck \
        --out "$OUT"
    python3 benchmarks/gpu_session.py --budget 150 --stages sweep --resume-from DIR --out "$OUT"

or the trial of fp32 on bf16 parts (``-DKS_FP32_BF16X3``: its own build, tests, race check and
timings, about 4 minutes), after a first call that gives the tests and race check what they
need: ``--budget 400 --stages tests racecheck`` then ``--budget 300 --stages bf16x3``
(timeout_s 590 and 190, or 450 and 350; with the fla wheels carried in ``.whl/``: ``--plan``
prints how to fetch them, the stages and their time limits, and runs nothing). Stages, in the
order of what the issue needs most:

=========  ===========================================================  ==============
stage      what                                                         writes
=========  ===========================================================  ==============
env        the carried wheels installed (``.whl/*.whl`` into a folder   session.json
           on the children's PYTHONPATH); GPU, driver, versions, fla
           importable, copy bandwidth and matmul rates
build      the CUDA extension; if it fails, the compiler's own output   session.log
           and the session stops (nothing after it can run the kernels)
tests      ``pytest -v tests/test_cuda_backend.py`` (a test that        tests.log
           crashes pytest: left out and the rest run again; tests
           that found wrong numbers: again on the fallback build)
targets    ``cuda_core.py``: the issue's targets (B=8, H=16, D=64, N     targets.csv
           512-16384, bf16 and fp32, every method, WALK_BLOCKS 128
           and 256; the ``_apart`` methods at bf16's target N only),
           and the walks in bf16 at N=8192 and fp32 at N=16384 with
           WALK_BLOCKS 512 to 16384 (toward one chunk a segment:
           chunk-parallel)
profile    ``cuda_profile.py`` at N=8192, F=M 64 then 128, bf16, fp32   profile.csv
           and fp16, every variant (the ``_apart`` ones: kernels 10
           and 11 against two launches); then the normalized causal
           attention on the defaults (bf16, fp32: its backward's
           row terms and sums), the walks again at WALK_BLOCKS 256 (F=M=64,
           bf16 and fp32: the carry pass) and the register walks at
           4096 (bf16: chunk-parallel)
scaling    ``cuda_scaling.py``: the walk kernels' time at 1-4 blocks     scaling.csv
           per SM, bf16 and fp32 (latency or throughput, without ncu)
counters   ``cuda_counters.py``: Nsight Compute's counters of the walk   counters.csv
           kernels (6-11) at the targets' shape, bf16 and fp32
           (skipped where ncu cannot read them)
sweep      ``cuda_core.py --resume`` over the issue's grid (N 512-32768,  sweep.csv
           B·H 8 and 64, D 64 and 128): fp32 D=128 first (the part
           no session has measured), then bf16 and fp32 at D=64, bf16
           at D=128, until its time is up; ours as ``cuda`` and the
           targets stage's fastest of ours in the part's dtype (bf16
           at N=8192, fp32 at N=16384)
racecheck  ``compute-sanitizer --tool racecheck``, twelve small tests    tests.log
bf16x3     fp32's register walks on bf16 parts (``-DKS_FP32_BF16X3``,   tests.log,
           not the default): built in a folder of its own, the fp32      session.json
           ``walk_mma`` GPU tests on it, then fp32 fwd+bwd at the
           target's shape (N 8192, 16384) on the default build and
           on it in turns, twice; the rows and ratios in
           ``session.json``
=========  ===========================================================  ==============

Every stage runs as a child process under a time limit: the smaller of its cap and what is left
of the budget after the minimum of every later stage; a stage whose limit falls more than
``STOP_S`` below its own minimum (what stopping the stage before it may take) is skipped. A
child that runs past its limit is killed with its process group; what it wrote stays. A
benchmark stopped by a method that breaks the CUDA context (an illegal address) is rerun without
that method, resuming its CSV. The last lines printed are the stages' outcomes, the test counts
and the issue's target ratios; ``session.json`` holds the same, and is rewritten after every
stage. A later call goes on from an earlier call's files: ``--resume-from DIR`` copies DIR's
``targets.csv`` and ``sweep.csv`` into ``--out`` first (the methods its ``session.json`` says
broke the CUDA context stay out), and ``--stages`` picks the stages to run (env and build always
run).

Where tests find a kernel's numbers wrong, the tests stage runs them again on a second build
(a folder of its own) with ``-DKS_WMMA_GENERIC_LOADS``: kernels 1-7 then load their WMMA
fragments by wmma's own calls, as in the 2026-11-28 session whose tests passed, in place of the
hand-written ``.shared`` loads (``csrc/cuda/wmma_ops.cuh``). If some of them pass there, the
rest of the session runs on that build: ``session.json`` (``fallback``, ``cuda_flags``) and
every CSV's command say so, and a later call should be led by
``KERNELSTUDY_CUDA_FLAGS=-DKS_WMMA_GENERIC_LOADS`` (the stage's note says it).

This script imports nothing beyond the standard library, so no CUDA error can stop it; its
children import torch. Back on a machine without a GPU, draw and report the results with
``python benchmarks/cuda_core.py --from-csv OUT/targets.csv OUT/sweep.csv --out ...``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime as dt
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
WHEELS = REPO / ".whl"
SITE = Path(tempfile.gettempdir()) / "kernelstudy_session_site"
BUILD_DIR = Path(tempfile.gettempdir()) / "kernelstudy_session_build"
FLAGS_ENV = "KERNELSTUDY_CUDA_FLAGS"  # cuda_backend.CUDA_FLAGS_ENV (this script imports no torch)
# Where the tests fail, the failed ones run again on a build with this flag: kernels 1-7 load
# their WMMA fragments by wmma's own calls, the code whose tests passed on 2026-11-28, in place
# of the .shared loads written since (never yet run on a GPU). If it passes tests the default
# build fails, the rest of the session runs on it, and session.json and every CSV say so.
FALLBACK_FLAG = "-DKS_WMMA_GENERIC_LOADS"
FALLBACK_BUILD_DIR = Path(tempfile.gettempdir()) / "kernelstudy_session_build_fallback"
# the files a session writes into --out (the device tool returns at most 8)
FILES = (
    "session.json",
    "session.log",
    "tests.log",
    "targets.csv",
    "profile.csv",
    "scaling.csv",
    "counters.csv",
    "sweep.csv",
)
CUDA_METHODS = ("cuda", "cuda_fused", "cuda_walk", "cuda_walk_fused", "cuda_walk_fused_apart")
CUDA_METHODS += ("cuda_walk_mma", "cuda_walk_mma_fused", "cuda_walk_mma_fused_apart")
# the fused walks' backward as two launches: other than their twins only in bfloat16 (kernels 10
# and 11), so the targets stage times them in its bfloat16 pass alone
APART = tuple(m for m in CUDA_METHODS if m.endswith("_apart"))
WALKS = tuple(m for m in CUDA_METHODS if "walk" in m)  # the methods WALK_BLOCKS applies to
BASELINES = ("torch", "fla", "sdpa")
TARGET_N = (512, 1024, 2048, 4096, 8192, 16384)
# what the ratios read: the crossover with SDPA and N=8192 in bfloat16, N=16384 in float32
TARGET_FIRST = (("bfloat16", (512, 1024, 2048, 8192)), ("float32", (16384,)))
SWEEP_N = (512, 1024, 2048, 4096, 8192, 16384, 32768)
# the sweep's parts in order: (dtype, D), each over every N and shape; fp32 D=128 first, the
# part the 2026-11-28 session ran out of time for (it measured the other three)
SWEEP_PARTS = (("float32", 128), ("bfloat16", 64), ("float32", 64), ("bfloat16", 128))
SWEEP_SHAPES = ("1x8", "4x16")  # B·H = 8 and 64, the grid (128: the targets stage)
RACECHECK_TESTS = (
    "test_walk_segments_match_reference[walk-2x2x200x33x70-torch.bfloat16-5]",
    "test_walk_segments_match_reference[walk_mma-2x2x200x33x70-torch.bfloat16-5]",
    "test_walk_segments_match_reference[walk_mma-3x2x130x96x40-torch.bfloat16-5]",  # 2 slices
    # kernel 6 in float32 with two feature slices (its state sums changed after the last run)
    "test_walk_segments_match_reference[walk-3x2x130x96x40-torch.float32-5]",
    "test_fused_backward_matches_reference[walk_mma-1x4x64x16x16-torch.bfloat16]",
    "test_fused_backward_matches_reference[walk_mma-1x4x64x16x16-torch.float32]",
    "test_fused_backward_matches_reference[chunks-3x2x130x96x40-torch.float32]",
    # kernels 11 and 10 (the fused backward's two walks in one grid), with segments
    "test_backward_walks_together_give_the_bits_of_two_launches[walk-7]",
    "test_backward_walks_together_give_the_bits_of_two_launches[walk_mma-7]",
    # kernel 1 with a 16-bit k beside fp32 v, kernel 3's store with a bias and padded rows
    "test_full_backward_kernels_read_the_inputs_dtype[chunks-torch.bfloat16]",
    # kernels 8, 12 and 9 in fp16, whose tiles' loads now go in batches (TileBatch)
    "test_walk_segments_match_reference[walk_mma-2x2x200x33x70-torch.float16-5]",
    "test_fused_backward_matches_reference[walk_mma-1x4x64x16x16-torch.float16]",
)
# The bf16x3 stage: the build variant in a folder of its own, its tests (kernels 8, 9 and 12 in
# fp32), and fp32 fwd+bwd at the shape timed on the default build and on it in turns
BF16X3_FLAG = "-DKS_FP32_BF16X3"
BF16X3_BUILD_DIR = Path(tempfile.gettempdir()) / "kernelstudy_session_build_bf16x3"
# pytest -k: ids say fp32 in the test's name or float32 in its parameters ("float32 and
# walk_mma" left out the causal product's and normalized attention's fp32 reference tests)
BF16X3_TESTS = "walk_mma and (float32 or fp32)"
BF16X3_TIMING = ["--n", "8192", "16384", "--shapes", "8x16", "--dims", "64", "--dtypes"]
BF16X3_TIMING += ["float32", "--modes", "fwd+bwd", "--methods", "cuda_walk_mma_fused", "torch"]
BF16X3_TIMING += ["--repeats", "7", "--warmup", "2", "--no-plot"]
BF16X3_ROUNDS = 2  # default, bf16x3, default, bf16x3
# the race check of its split tiles (a barrier between reading a tile and writing its parts)
BF16X3_RACECHECK = (
    "test_walk_segments_match_reference[walk_mma-2x2x200x33x70-torch.float32-5]",
    "test_fused_backward_matches_reference[walk_mma-1x4x64x16x16-torch.float32]",
)
FETCH_WHEELS = (
    "echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all: "
    "--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 -d .whl "
    "fla-core==0.5.2"
)


@dataclasses.dataclass(frozen=True)
class Stage:
    """A stage: at most ``cap_s`` seconds, skipped when fewer than ``min_s`` (less ``STOP_S``)
    are left for it."""

    name: str
    min_s: float
    cap_s: float
    what: str


STAGES = (
    Stage("env", 20, 90, "wheels, GPU, versions, copy bandwidth and matmul rates"),
    Stage("build", 60, 240, "the CUDA extension (the session stops if it fails)"),
    Stage("tests", 60, 240, "pytest -v tests/test_cuda_backend.py"),
    Stage("targets", 45, 180, "cuda_core.py at the issue's targets, every method"),
    Stage("profile", 15, 120, "cuda_profile.py, per-kernel times at N=8192"),
    Stage("scaling", 15, 60, "cuda_scaling.py, walk kernels' time vs blocks per SM"),
    Stage("counters", 30, 75, "cuda_counters.py, ncu's counters of the walk kernels"),
    Stage("sweep", 30, 600, "cuda_core.py --resume over the issue's grid"),
    Stage(
        "racecheck", 40, 150, f"compute-sanitizer racecheck on {len(RACECHECK_TESTS)} small tests"
    ),
    Stage("bf16x3", 150, 330, "fp32 on bf16 parts (-DKS_FP32_BF16X3): its tests, A/B timings"),
)
STAGE_NAMES = tuple(s.name for s in STAGES)
# what runs without --stages: every stage but bf16x3 (a build variant's trial, asked for by name)
DEFAULT_STAGES = tuple(n for n in STAGE_NAMES if n != "bf16x3")
ALWAYS = ("env", "build")
# a child stopped at its limit may take this long to go (the grace after SIGTERM), so the next
# stage may find up to this much less than its minimum left and still runs
STOP_S = 5
#: The device tool runs one command for this long at most.
DEVICE_LIMIT_S = 600
#: The script ends within about 10 s of its budget (a child stopped at its limit takes that
#: long to go): budgets above this would be killed before their last stages.
MAX_BUDGET_S = DEVICE_LIMIT_S - 10


def time_limit(stages: tuple[Stage, ...], index: int, left_s: float) -> float:
    """Seconds stage ``index`` may take: its cap, or what is left after the minimum of every
    later stage if that is less (more than ``STOP_S`` below its minimum: the stage is skipped)."""
    later = sum(s.min_s for s in stages[index + 1 :])
    return min(stages[index].cap_s, left_s - later)


@dataclasses.dataclass
class Outcome:
    """What became of a stage (``status``: ok, failed, timeout, skipped, partial: a sweep cut
    short by the budget, or killed: the script stopped in it, with what it had recorded)."""

    name: str
    status: str
    seconds: float = 0.0
    limit_s: float = 0.0
    note: str = ""


class Session:
    """Runs the stages into ``out``, each child's output appended to a log there."""

    def __init__(self, out: Path, budget_s: float, clock: Callable[[], float] = time.monotonic):
        self.out = out
        self.budget_s = budget_s
        self.clock = clock
        self.start = clock()
        self.record: dict = {
            "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "budget_s": budget_s,
            "argv": sys.argv,
            "cuda_flags": os.environ.get(FLAGS_ENV, ""),  # the build's extra nvcc flags
            "stages": [],
        }
        (out / "session.log").touch()
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # a call led by the fallback's flag finds the build an earlier call made with it
        fallback = FALLBACK_FLAG in self.env.get(FLAGS_ENV, "").split()
        self.env["KERNELSTUDY_BUILD_DIR"] = str(FALLBACK_BUILD_DIR if fallback else BUILD_DIR)
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
        )

    def left_s(self) -> float:
        return self.budget_s - (self.clock() - self.start)

    def log(self, text: str) -> None:
        """A line on the console and in session.log."""
        print(text, flush=True)
        with open(self.out / "session.log", "a") as f:
            f.write(text + "\n")

    def save(self) -> None:
        """session.json, atomically (a kill between stages leaves the last complete one)."""
        path = self.out / "session.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.record, indent=2, default=str) + "\n")
        os.replace(tmp, path)

    def run(self, argv: list[str], limit_s: float, log: str = "session.log") -> tuple[int, bool]:
        """Runs ``argv`` in the repository root with its output appended to ``log`` in out;
        (exit status, timed out). Past ``limit_s`` its process group is stopped."""
        with open(self.out / log, "a") as f:
            f.write(f"$ {' '.join(argv)}  # limit {limit_s:.0f} s\n")
            f.flush()
            # its own process group (to stop it with what it starts) in this session: a
            # new session would outlive the device command that runs this script
            child = subprocess.Popen(
                argv, cwd=REPO, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                process_group=0,
            )  # fmt: skip
            try:
                return child.wait(timeout=max(limit_s, 0.1)), False
            except subprocess.TimeoutExpired:
                stop(child)
                f.write(f"# stopped at its limit of {limit_s:.0f} s\n")
                return child.returncode, True
            except BaseException:  # SIGTERM (see run_session) or Ctrl-C: the child goes too
                stop(child)
                raise

    def python(self, args: list[str], limit_s: float, log: str = "session.log"):
        return self.run([PYTHON, *args], limit_s, log)

    def run_read(self, argv: list[str], limit_s: float, log: str) -> tuple[int, bool, str]:
        """:meth:`run`, and what it added to ``log`` (its command line, then the child's output):
        what a stage reads back of one child among the others' lines in the same log."""
        return self._appended(log, lambda: self.run(argv, limit_s, log))

    def python_read(
        self, args: list[str], limit_s: float, log: str = "session.log"
    ) -> tuple[int, bool, str]:
        """:meth:`python`, and what it added to ``log`` (as :meth:`run_read`)."""
        return self._appended(log, lambda: self.python(args, limit_s, log))

    def _appended(self, log: str, call: Callable[[], tuple[int, bool]]) -> tuple[int, bool, str]:
        path = self.out / log
        offset = path.stat().st_size if path.exists() else 0
        rc, late = call()
        with open(path) as f:
            f.seek(offset)
            return rc, late, f.read()


def stop(child: subprocess.Popen) -> None:
    """Stops ``child`` and everything it started: SIGTERM, then SIGKILL after ``STOP_S``."""
    for sig, wait in ((signal.SIGTERM, STOP_S), (signal.SIGKILL, 5)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            break
        try:
            child.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# --- the stages: each takes the session and its time limit, returns (status, note) ---


def stage_env(session: Session, limit_s: float) -> tuple[str, str]:
    wheels = sorted(WHEELS.glob("*.whl"))
    deadline = session.clock() + limit_s
    note = ""
    if wheels:
        install = [PYTHON, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        install += ["--no-cache-dir", "--upgrade", "--target", str(SITE), *map(str, wheels)]
        rc, late = session.run(install, limit_s)
        if rc == 0:
            session.env["PYTHONPATH"] = os.pathsep.join([str(SITE), session.env["PYTHONPATH"]])
        else:
            note = f"installing {len(wheels)} wheels failed (rc {rc}): fla is left out; "
    else:
        note = "no wheels in .whl: fla is left out (fetch them with --plan's command); "
    probe_json = Path(tempfile.gettempdir()) / f"kernelstudy_probe_{os.getpid()}.json"
    rc, late = session.python(
        [__file__, "--probe", str(probe_json)], deadline - session.clock()
    )  # fmt: skip
    if probe_json.exists():
        session.record["env"] = json.loads(probe_json.read_text())
        probe_json.unlink()
    if late:
        return "timeout", note + "the probe ran past its limit"
    if rc != 0:
        return "failed", note + "no usable CUDA GPU (see session.log)"
    env = session.record["env"]
    if env.get("fla_error"):
        note += f"fla does not import: {env['fla_error']}; "
    for name in other_device_results(session.out, env.get("device")):
        note += f"{name} (resumed) holds another GPU's rows: measured afresh; "
    return "ok", note + f"{env.get('device')}, torch {env.get('torch')}"


def other_device_results(out: Path, device: str | None) -> list[str]:
    """Removes the results CSVs in ``out`` (copies that ``--resume-from`` brought) measured on
    another GPU than ``device``, and returns their names: cuda_core.py's ``--resume`` refuses
    them (a CSV holds one device's rows), which failed the targets and the sweep of a session
    that resumed an H100's files on an H200. The earlier call's folder keeps its own."""
    removed = []
    for name in ("targets.csv", "sweep.csv"):
        try:
            with open(out / name, newline="") as f:
                devices = {row.get("device") or device for row in csv.DictReader(f)}
        except (OSError, ValueError, csv.Error):
            continue  # absent, or not a results CSV: cuda_core.py says so itself
        if device is not None and devices - {device}:
            (out / name).unlink()
            removed.append(name)
    return removed


def stage_build(session: Session, limit_s: float) -> tuple[str, str]:
    rc, late = session.python([__file__, "--probe-build"], limit_s)
    if late:
        return "timeout", "the build ran past its limit"
    if rc != 0:
        return "failed", "the CUDA extension did not build: the compiler's output is in session.log"
    return "ok", f"built in {session.env['KERNELSTUDY_BUILD_DIR']}"


PYTEST = ["-m", "pytest", "-v", "-p", "no:cacheprovider"]
FALLBACK_MIN_S = 60  # the fallback's build (58 s on 2026-11-28) and the rerun need about this


MAX_CRASHES = 3  # tests left out, one rerun each, before the stage gives up on a crashing run


def stage_tests(session: Session, limit_s: float) -> tuple[str, str]:
    """The GPU tests. A test that kills pytest (a segfault: on 2026-11-30 the 4th test did, and
    the other 600 went unrun) is left out and the rest run again, up to :data:`MAX_CRASHES`
    times; where tests fail, :func:`try_fallback` in what is left of the limit."""
    deadline = session.clock() + limit_s
    crashed: list[str] = []
    while True:
        left_out = [f"--deselect={test}" for test in crashed]
        rc, late, log = session.python_read(
            [*PYTEST, "--durations=15", *left_out, "tests/test_cuda_backend.py"],
            deadline - session.clock(),
            log="tests.log",
        )
        test = None if late or 0 <= rc <= 5 else crashed_test(log)  # pytest's own exits: 0-5
        if test is None or test in crashed or len(crashed) >= MAX_CRASHES:
            break
        crashed.append(test)
        session.log(f"  pytest died (exit {rc}) in {test}: the tests again without it")
        if deadline - session.clock() < 20:
            break
    counts = test_counts(log)
    session.record["tests"] = counts
    session.record["tests_crashed"] = crashed
    text = ", ".join(f"{n} {what}" for what, n in counts.items()) or "no summary line"
    if crashed:
        text += f"; left out after crashing pytest: {', '.join(crashed)}"
    if late:
        return "timeout", f"stopped at its limit: {text} (the -v lines say how far it got)"
    if rc == 0 and not crashed:
        return "ok", text
    if rc == 0:
        return "failed", text
    failed = failed_tests(log)
    return "failed", f"{text}; {try_fallback(session, wrong_numbers(log, failed), deadline)}"


def crashed_test(log: str) -> str | None:
    """The test a ``pytest -v`` run died in: the last test id it printed without an outcome
    (``tests/...::test_x[a] Fatal Python error: Segmentation fault``), or None."""
    lines = re.findall(r"^(tests/\S+::\S+)(.*)$", log, re.MULTILINE)
    if not lines:
        return None
    test, rest = lines[-1]
    outcome = re.match(r"\s*(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", rest)
    return None if outcome else test


def failed_tests(log: str) -> list[str]:
    """The node ids of the tests a ``pytest -v`` log says failed or erred, in order, once each."""
    found = re.findall(r"^(tests/\S+::\S+) (?:FAILED|ERROR)", log, re.MULTILINE)
    found += re.findall(r"^(?:FAILED|ERROR) (tests/\S+::\S+)", log, re.MULTILINE)
    return list(dict.fromkeys(found))


# What a failure's ``E`` lines show when a test found a kernel's numbers wrong: the tolerance
# helpers of tests/conftest.py, bit-equality and finiteness checks, torch.testing's messages.
NUMBER_CHECKS = re.compile(
    r"rel_err\(|rel_rms\(|close_in_dtype\(|torch\.equal|torch\.isfinite|"
    r"Tensor-likes are not (?:close|equal)"
)


def wrong_numbers(log: str, failed: list[str]) -> list[str]:
    """Those of the ``failed`` tests whose failure in a ``pytest -v`` log is a kernel's numbers
    compared and found wrong (:data:`NUMBER_CHECKS` in the ``E`` lines of its section, headed
    ``____ test_x[params] ____``, two underscores a side where the name is long): the only
    failures the fallback build can mend. A crash of a child, a wrong kernel name or a tracing
    error is not (on 2026-11-30 the fallback's build and rerun spent 84 s of device time on two
    such failures)."""
    sections = re.split(r"^_+ (\S+) _+$", log, flags=re.MULTILINE)
    numeric = set()
    for name, body in zip(sections[1::2], sections[2::2], strict=True):
        errors = "\n".join(line for line in body.splitlines() if line.startswith("E "))
        if NUMBER_CHECKS.search(errors):
            numeric.add(name)
    return [test for test in failed if test.rsplit("::", 1)[-1] in numeric]


def variant_env(env: dict[str, str], flag: str, folder: Path) -> dict[str, str]:
    """``env`` with ``flag`` added to the build's flags and the build in ``folder`` (the
    default build stays where it is)."""
    flags = f"{env.get(FLAGS_ENV, '')} {flag}".strip()
    return {**env, FLAGS_ENV: flags, "KERNELSTUDY_BUILD_DIR": str(folder)}


def try_fallback(session: Session, failed: list[str], deadline: float) -> str:
    """Builds the extension with :data:`FALLBACK_FLAG` (in a folder of its own: the default
    build stays) and runs the ``failed`` tests on it (those that found a kernel's numbers wrong:
    :func:`wrong_numbers`); if some pass, the session goes on with that build
    (``session.env``). Not where every failed test is a ``walk_mma`` one: the flag changes
    kernels 1-7 only, and those tests fail first by kernels 8-12 (mma.sync, no WMMA). What came
    of it, in words, also in ``session.json``."""
    flags = session.env.get(FLAGS_ENV, "")
    if not failed or FALLBACK_FLAG in flags.split():
        return "no fallback" if failed else "no failed test found a kernel's numbers wrong"
    if all("walk_mma" in test for test in failed):  # kernels 8-12 first: the flag leaves them
        return "every failed test runs walk_mma (kernels 8-12 on mma.sync): no fallback build"
    if deadline - session.clock() < FALLBACK_MIN_S:
        return f"no time left for the fallback build ({FALLBACK_FLAG})"
    default_env = session.env
    session.env = variant_env(default_env, FALLBACK_FLAG, FALLBACK_BUILD_DIR)
    outcome = {"flags": session.env[FLAGS_ENV], "tests": len(failed)}
    session.record["fallback"] = outcome
    rc, late = session.python([__file__, "--probe-build"], deadline - session.clock())
    if late or rc != 0:
        session.env = default_env
        outcome["result"] = "the fallback did not build (session.log)"
        return outcome["result"]
    with open(session.out / "tests.log", "a") as f:
        f.write(f"\n# the {len(failed)} failed tests again, built with {FALLBACK_FLAG}\n")
    rc, late, log = session.python_read(
        [*PYTEST, *failed], deadline - session.clock(), log="tests.log"
    )
    counts = test_counts(log)
    outcome["counts"] = counts
    still = counts.get("failed", 0) + counts.get("error", 0)
    passed = counts.get("passed", 0)
    if passed:
        session.record["cuda_flags"] = session.env[FLAGS_ENV]
        outcome["result"] = (
            f"with {FALLBACK_FLAG} {passed} of the {len(failed)} failed tests pass ({still} "
            f"fail): the session goes on with that build (lead a later call with "
            f"{FLAGS_ENV}='{session.env[FLAGS_ENV]}')"
        )
    else:
        session.env = default_env
        outcome["result"] = (
            f"with {FALLBACK_FLAG} none of the {len(failed)} failed tests passes"
            f"{' (stopped at its limit)' if late else ''}: the default build stays"
        )
    return outcome["result"]


def test_counts(log: str) -> dict[str, int]:
    """pytest's closing counts ({'passed': 390, 'failed': 2, ...}), or, for a run stopped before
    its summary, the counts of its ``-v`` lines."""
    summary = [line for line in log.splitlines() if re.match(r"^=+ .*\d+ \w+.* in [\d.]+s", line)]
    if summary:
        return {w: int(n) for n, w in re.findall(r"(\d+) (\w+)", summary[-1])}
    counts: dict[str, int] = {}
    for word in re.findall(r"::\S+ (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", log):
        counts[word.lower()] = counts.get(word.lower(), 0) + 1
    return counts


CONTEXT_BROKE = re.compile(r"the CUDA context broke in (\S+)")


def method_of(label: str) -> str | None:
    """The ``cuda_core.py`` method a row label stands for (a walk label carries its
    WALK_BLOCKS: cuda_walk_fused_256 is cuda_walk_fused; sdpa_efficient is sdpa)."""
    methods = sorted((*CUDA_METHODS, *BASELINES), key=len, reverse=True)
    return next((m for m in methods if label == m or label.startswith(m + "_")), None)


def broken_method(log_tail: str) -> str | None:
    """The method of ``cuda_core.py`` whose case broke the CUDA context, from its last words."""
    found = CONTEXT_BROKE.findall(log_tail)
    return method_of(found[-1]) if found else None


def not_dropped(session: Session, methods) -> list[str]:
    """``methods`` less those that broke the CUDA context in this session (or the one it
    resumes)."""
    dropped = session.record.get("dropped_methods", [])
    return [m for m in methods if m not in dropped]


def benchmark(
    session: Session, args: list[str], methods: list[str], deadline: float
) -> tuple[str, str]:
    """``cuda_core.py args --methods methods --resume --no-plot`` until it ends or the
    deadline; a method that breaks the CUDA context is dropped and the rest rerun."""
    dropped = []
    while methods:
        rc, late, log = session.python_read(
            ["benchmarks/cuda_core.py", *args, "--methods", *methods, "--resume", "--no-plot"],
            deadline - session.clock(),
        )
        if late:
            return (
                "timeout",
                f"stopped at its limit{'; dropped ' + ', '.join(dropped) if dropped else ''}",
            )
        method = broken_method(log)
        if rc == 0 or method is None or method not in methods:
            note = f"dropped {', '.join(dropped)} (broke the CUDA context)" if dropped else ""
            return ("ok" if rc == 0 else "failed"), note
        dropped.append(method)
        session.record.setdefault("dropped_methods", []).append(method)
        session.log(f"  {method} broke the CUDA context: rerunning without it")
        methods = [m for m in methods if m != method]
    return "failed", f"every method broke the CUDA context: {', '.join(dropped)}"


# where the targets stage says which of our methods is fastest in each dtype (fwd+bwd, B·H 128)
FASTEST_AT = {"bfloat16": 8192, "float32": 16384}

# WALK_BLOCKS past 256 for the walks at each dtype's FASTEST_AT N (bf16 8192, fwd+bwd about 2 ms
# a call on 2026-11-28; fp32 16384, about 16 ms: 24 rows, a few seconds), after the target
# cases. At the targets' B·H = 128 and N = 8192, 1024 cuts each sequence into 8 segments of 16
# chunks and 16384 into 128 segments of one chunk: the chunk-parallel schedule (every chunk's
# state from the carry pass, kernel 12 and 2 for the register walks, each chunk its own block, as
# fla's kernels), with the register walk (kernel 8, two blocks an SM) in place of the chunk
# kernels' WMMA output kernel. On 2026-11-28 (kernel 6, kernel 1's carries) 512 was never the
# fastest.
WIDE_WALK_BLOCKS = (512, 1024, 4096, 16384)


def stage_targets(session: Session, limit_s: float) -> tuple[str, str]:
    """The cases the issue's ratios read first (:data:`TARGET_FIRST`), then the walks at
    :data:`WIDE_WALK_BLOCKS`, then the rest of the grid, resuming the same CSV: on 2026-11-28 the
    whole grid in one pass ran out of time before float32 N=16384."""
    deadline = session.clock() + limit_s
    common = ["--shapes", "8x16", "--dims", "64", "--repeats", "7", "--warmup", "2"]
    common += ["--out", str(session.out / "targets.csv")]
    methods = not_dropped(session, (*CUDA_METHODS, *BASELINES))
    usual = (128, 256)
    # (dtypes, N, WALK_BLOCKS, only the walks)
    passes = [((dtype,), ns, usual, False) for dtype, ns in TARGET_FIRST]
    passes += [((dtype,), (n,), WIDE_WALK_BLOCKS, True) for dtype, n in FASTEST_AT.items()]
    passes.append((("bfloat16", "float32"), TARGET_N, usual, False))
    status, note = "ok", ""
    for dtypes, ns, blocks, walks in passes:
        args = ["--n", *map(str, ns), "--dtypes", *dtypes, *common]
        args += ["--walk-blocks", *map(str, blocks)]
        run = methods if dtypes == ("bfloat16",) else [m for m in methods if m not in APART]
        if walks:
            run = [m for m in run if m in WALKS]
        status, note = benchmark(session, args, run, deadline)
        if status != "ok":
            break
        methods = not_dropped(session, methods)
    return status, note


# the walks profiled again after every variant at the default: at WALK_BLOCKS 256 (two segments
# a sequence at the targets' B·H: the grouped carry pass, kernel 1 against kernel 12, two blocks
# an SM), and the register walks in bf16 at 4096 (32 segments of 4 chunks: where the time of the
# chunk-parallel end of the targets stage's wide pass goes, kernels 12, 2 and 8 to 10)
PROFILE_AGAIN = (
    # the normalized attention that models call, on the defaults: its backward's row terms and
    # cumulative sums beside the products; and the non-causal one with padded keys (the
    # encoders': reduction and read-outs, whose backward's torch passes are gone since)
    ["--dim", "64", "--dtypes", "bfloat16", "float32", "--variants", "walk_mma_fused"]
    + ["--op", "attention", "full", "--append"],
    ["--dim", "64", "--dtypes", "bfloat16", "float32", "--walk-blocks", "256", "--variants"]
    + ["walk", "walk_fused", "walk_mma", "walk_mma_fused", "--append"],
    ["--dim", "64", "--dtypes", "bfloat16", "--walk-blocks", "4096", "--variants"]
    + ["walk_mma", "walk_mma_fused", "--append"],
)


def stage_profile(session: Session, limit_s: float) -> tuple[str, str]:
    deadline = session.clock() + limit_s
    out = ["--n", "8192", "--out", str(session.out / "profile.csv")]
    first = ["--dim", "64", "128", "--dtypes", "bfloat16", "float32", "float16"]
    failed = False
    for args in (first, *PROFILE_AGAIN):  # a variant that failed leaves the others' rows
        rc, late = session.python(
            ["benchmarks/cuda_profile.py", *out, *args], deadline - session.clock()
        )
        if late:
            return "timeout", ""
        failed = failed or rc != 0
    return ("failed" if failed else "ok"), ""


def stage_scaling(session: Session, limit_s: float) -> tuple[str, str]:
    """Latency or throughput: the walk kernels' time at 1-4 blocks per SM (needs no ncu)."""
    argv = ["benchmarks/cuda_scaling.py", "--dtypes", "bfloat16", "float32"]
    argv += ["--out", str(session.out / "scaling.csv")]
    rc, late = session.python(argv, limit_s)
    return ("timeout" if late else "ok" if rc == 0 else "failed"), ""


# cuda_counters.py's exit status without readable counters (its UNAVAILABLE; this script
# imports nothing beyond the standard library)
COUNTERS_UNAVAILABLE = 3


def stage_counters(session: Session, limit_s: float) -> tuple[str, str]:
    """Why the walk kernels take their time: issue slots, tensor pipe, stalls (ncu)."""
    argv = ["benchmarks/cuda_counters.py", "--dtypes", "bfloat16", "float32"]
    argv += ["--out", str(session.out / "counters.csv")]
    rc, late = session.python(argv, limit_s)
    if late:
        return "timeout", "stopped at its limit"
    if rc == COUNTERS_UNAVAILABLE:
        return "skipped", "no ncu here, or it cannot read the counters (session.log)"
    return ("ok" if rc == 0 else "failed"), ""


def fastest_variant(targets_csv: Path, dtype: str = "bfloat16") -> tuple[str, int | None] | None:
    """Our fastest method in ``dtype`` at its :data:`FASTEST_AT` N, fwd+bwd, in the targets CSV,
    with its WALK_BLOCKS (a walk label ends in it), or None without such a row. Read without
    pandas."""
    if not targets_csv.is_file():
        return None
    best = None
    with open(targets_csv) as f:
        for row in csv.DictReader(f):
            if (row["dtype"], row["mode"], row["N"]) != (dtype, "fwd+bwd", str(FASTEST_AT[dtype])):
                continue
            label, ms = row["method"], float(row["time_ms"] or "nan")
            if not label.startswith("cuda") or ms != ms:
                continue
            if best is None or ms < best[0]:
                best = (ms, label)
    if best is None:
        return None
    label = best[1]
    method = method_of(label)
    blocks = label[len(method) + 1 :]
    return method, int(blocks) if blocks.isdigit() else None


def stage_sweep(session: Session, limit_s: float) -> tuple[str, str]:
    """Each part of the grid with ``cuda`` (the chunk kernels), the fastest of our methods in
    its dtype in the targets stage (at that method's WALK_BLOCKS) and the baselines."""
    deadline = session.clock() + limit_s
    statuses = []
    session.record["sweep_methods"] = {}
    fastest = {dtype: fastest_variant(session.out / "targets.csv", dtype) for dtype in FASTEST_AT}
    for dtype, dim in SWEEP_PARTS:
        if deadline - session.clock() < 5:
            statuses.append(f"{dtype} D={dim}: no time")
            continue
        methods = ["cuda"]
        blocks: list[str] = []
        best = fastest[dtype]
        if best is not None and best[0] != "cuda":
            methods.append(best[0])
            blocks = ["--walk-blocks", str(best[1])] if best[1] else []
        # a method that broke the CUDA context (fla, say) stays out: it would break it again
        methods = not_dropped(session, [*methods, *BASELINES])
        session.record["sweep_methods"][f"{dtype} D={dim}"] = methods + blocks[1:]
        args = ["--n", *map(str, SWEEP_N), "--shapes", *SWEEP_SHAPES, "--dims", str(dim)]
        args += ["--dtypes", dtype, *blocks, "--repeats", "5", "--warmup", "2"]
        args += ["--out", str(session.out / "sweep.csv")]
        status, note = benchmark(session, args, methods, deadline)
        statuses.append(f"{dtype} D={dim}: {status}{' (' + note + ')' if note else ''}")
    if any(": failed" in s for s in statuses):
        return "failed", "; ".join(statuses)
    ok = all(s.endswith(": ok") for s in statuses)  # else cut short by the budget
    return ("ok" if ok else "partial"), "; ".join(statuses)


def racecheck(
    session: Session, tests: tuple[str, ...], limit_s: float
) -> tuple[int, bool, str, int] | None:
    """``tests`` (of tests/test_cuda_backend.py) under compute-sanitizer's racecheck in one
    process (starting torch under the sanitizer costs more than a small test, so one start
    serves them all), appended to tests.log: (exit status, timed out, its part of the log,
    hazards reported); None without the sanitizer."""
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        return None
    argv = [sanitizer, "--tool", "racecheck", "--print-limit", "5", PYTHON, *PYTEST]
    argv += [f"tests/test_cuda_backend.py::{t}" for t in tests]
    # after the tests stage's lines (8 files come back): only its own part counts
    rc, late, log = session.run_read(argv, limit_s, log="tests.log")
    hazards = sum(map(int, re.findall(r"RACECHECK SUMMARY: (\d+) hazards? displayed", log)))
    return rc, late, log, hazards


def stage_racecheck(session: Session, limit_s: float) -> tuple[str, str]:
    checked = racecheck(session, RACECHECK_TESTS, limit_s)
    if checked is None:
        return "skipped", "compute-sanitizer is not on the PATH"
    rc, late, log, hazards = checked
    counts = ", ".join(f"{n} {what}" for what, n in test_counts(log).items())
    note = f"{counts or 'no test finished'}; hazards reported: {hazards}"
    if late:
        return "timeout", note
    return ("ok" if rc == 0 and hazards == 0 else "failed"), note


def stage_bf16x3(session: Session, limit_s: float) -> tuple[str, str]:
    """fp32's register walks on bf16 parts (:data:`BF16X3_FLAG`, not the default): built in a
    folder of its own, the fp32 walk_mma GPU tests on it and a race check of two (into
    tests.log), then fp32 fwd+bwd at the target's shape timed on the default build and on it
    in turns. The timings' rows (cuda_core.py's columns with ``build`` and ``round``) go to
    session.json (``bf16x3``: 8 files at most come back), their ratios to the summary."""
    deadline = session.clock() + limit_s
    default_env = session.env
    bf16x3_env = variant_env(default_env, BF16X3_FLAG, BF16X3_BUILD_DIR)
    outcome: dict = {"flags": bf16x3_env[FLAGS_ENV]}
    session.record["bf16x3"] = outcome

    def on_variant(call: Callable[[], tuple]) -> tuple:
        session.env = bf16x3_env
        try:
            return call()
        finally:
            session.env = default_env

    rc, late = on_variant(lambda: session.python([__file__, "--probe-build"], limit_s))
    if late or rc != 0:
        return ("timeout" if late else "failed"), "the bf16x3 build failed (session.log)"
    with open(session.out / "tests.log", "a") as f:
        f.write(f"\n# the fp32 register walks' tests, built with {BF16X3_FLAG}\n")
    argv = [*PYTEST, "-k", BF16X3_TESTS, "tests/test_cuda_backend.py"]
    rc, late, log = on_variant(
        lambda: session.python_read(argv, deadline - session.clock(), log="tests.log")
    )
    outcome["tests"] = test_counts(log)
    session.save()  # each step's record kept as it comes: a kill mid-stage lost them all
    note = "tests: " + (", ".join(f"{n} {w}" for w, n in outcome["tests"].items()) or "none")
    if late:
        return "timeout", note
    tests_ok = rc == 0
    checked = on_variant(lambda: racecheck(session, BF16X3_RACECHECK, deadline - session.clock()))
    if checked is not None:
        rc, late, _, hazards = checked
        outcome["racecheck_hazards"] = hazards
        session.save()
        note += f"; racecheck hazards: {hazards}"
        if late:
            return "timeout", note
        tests_ok = tests_ok and rc == 0 and hazards == 0
    rows: list[dict] = []
    outcome["rows"] = rows
    with tempfile.TemporaryDirectory() as tmp:
        for turn in range(BF16X3_ROUNDS):
            for build in ("default", "bf16x3"):
                csv_path = Path(tmp) / f"{build}_{turn}.csv"
                timing = ["benchmarks/cuda_core.py", *BF16X3_TIMING, "--out", str(csv_path)]

                def run(timing=timing) -> tuple[int, bool]:
                    return session.python(timing, deadline - session.clock())

                rc, late = on_variant(run) if build == "bf16x3" else run()
                if csv_path.is_file():
                    with open(csv_path, newline="") as f:
                        rows += [
                            {**row, "build": build, "round": turn} for row in csv.DictReader(f)
                        ]
                    session.save()
                if late:
                    return "timeout", f"{note}; timings cut short at round {turn} ({build})"
    lines = bf16x3_ratios(rows)
    outcome["ratios"] = lines
    note += "; " + ("; ".join(lines) if lines else "no timings")
    return ("ok" if tests_ok and lines else "failed"), note


def bf16x3_ratios(rows: list[dict]) -> list[str]:
    """Per N of the bf16x3 stage's rows: the register walk's median time on each build, their
    ratio, and the torch backend's time over each (the fp32 target's ratio)."""
    times: dict[tuple[str, str, int], list[float]] = {}
    for row in rows:
        if row.get("error") or not row.get("time_ms"):
            continue
        key = (row["method"], row["build"], int(row["N"]))
        times.setdefault(key, []).append(float(row["time_ms"]))
    lines = []
    for n in sorted({k[2] for k in times}):
        walk = [
            statistics.median(times.get(("cuda_walk_mma_fused", b, n), [math.nan]))
            for b in ("default", "bf16x3")
        ]
        torch_ms = statistics.median(
            [t for (m, _, n_), ts in times.items() if m == "torch" and n_ == n for t in ts]
            or [math.nan]
        )
        lines.append(
            f"fp32 N={n}: 3xTF32 {walk[0]:.3f} ms, bf16x3 {walk[1]:.3f} ms "
            f"({walk[0] / walk[1]:.2f}x); torch/3xTF32 {torch_ms / walk[0]:.2f}x, "
            f"torch/bf16x3 {torch_ms / walk[1]:.2f}x"
        )
    return lines


RUNNERS = {
    "env": stage_env,
    "build": stage_build,
    "tests": stage_tests,
    "targets": stage_targets,
    "profile": stage_profile,
    "scaling": stage_scaling,
    "counters": stage_counters,
    "sweep": stage_sweep,
    "racecheck": stage_racecheck,
    "bf16x3": stage_bf16x3,
}


def run_session(
    out: Path,
    budget_s: float,
    chosen: tuple[str, ...] = DEFAULT_STAGES,
    resume_from: Path | None = None,
) -> int:
    """Runs the ``chosen`` stages (env and build always) into ``out``; 1 when a stage failed or
    ran past its limit, else 0 (a sweep cut short by the budget is ``partial``, a stage left no
    time ``skipped``: neither fails the session)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:  # a session's files are its own; earlier ones come in by resume_from
        (out / name).unlink(missing_ok=True)
    if resume_from is not None:
        for name in ("targets.csv", "sweep.csv"):
            if (resume_from / name).is_file():
                shutil.copyfile(resume_from / name, out / name)
    session = Session(out, budget_s)
    # a kill of this script (the device command's limit) stops the running child first
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        if resume_from is not None:  # a method that broke the CUDA context there stays out
            session.record["dropped_methods"] = earlier_dropped(resume_from / "session.json")
        stages = tuple(s for s in STAGES if s.name in chosen or s.name in ALWAYS)
        session.log(
            f"GPU session: budget {budget_s:.0f} s, stages {' '.join(s.name for s in stages)}"
        )
        failed = False
        for i, stage in enumerate(stages):
            limit = time_limit(stages, i, session.left_s())
            if limit < stage.min_s - STOP_S:
                outcome = Outcome(stage.name, "skipped", limit_s=limit, note="no time left")
            else:
                session.log(f"[{stage.name}] {stage.what} (limit {limit:.0f} s)")
                began = session.clock()
                try:
                    status, note = RUNNERS[stage.name](session, limit)
                except (SystemExit, KeyboardInterrupt):  # killed (the device's limit): its
                    seconds = session.clock() - began  # outcome saved with what it recorded
                    killed = Outcome(stage.name, "killed", seconds, limit, note="killed")
                    session.record["stages"].append(dataclasses.asdict(killed))
                    session.save()
                    session.log(f"[{stage.name}] killed after {seconds:.0f} s")
                    raise
                outcome = Outcome(stage.name, status, session.clock() - began, limit, note=note)
            failed |= outcome.status in ("failed", "timeout") or (
                stage.name in ALWAYS and outcome.status != "ok"
            )
            session.record["stages"].append(dataclasses.asdict(outcome))
            session.save()
            session.log(
                f"[{stage.name}] {outcome.status} in {outcome.seconds:.0f} s: {outcome.note}"
            )
            if stage.name in ALWAYS and outcome.status != "ok":
                session.log(f"the session stops: {stage.name} is needed by every later stage")
                break
        summarize(session)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 1 if failed else 0


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)


def earlier_dropped(path: Path) -> list[str]:
    """The methods an earlier call's ``session.json`` dropped ([] without a readable one)."""
    try:
        dropped = json.loads(path.read_text()).get("dropped_methods", [])
        return [m for m in dropped if m in (*CUDA_METHODS, *BASELINES)]
    except (OSError, ValueError, AttributeError, TypeError):
        return []


def summarize(session: Session) -> None:
    """The closing lines: each stage's outcome, the failed tests and, where measured, the
    target ratios (through ``cuda_core.py --from-csv``)."""
    session.log("\nstage      status    seconds  limit  note")
    for s in session.record["stages"]:
        session.log(
            f"{s['name']:<10} {s['status']:<9} {s['seconds']:7.0f} {s['limit_s']:6.0f}  "
            f"{s['note'][:200]}"
        )
    tests = session.out / "tests.log"
    if tests.is_file():
        failed = [x for x in tests.read_text().splitlines() if x.startswith(("FAILED", "ERROR"))]
        for line in failed[:30]:
            session.log(line[:300])
        if len(failed) > 30:
            session.log(f"... and {len(failed) - 30} more (tests.log)")
    csvs = [
        str(session.out / n) for n in ("targets.csv", "sweep.csv") if (session.out / n).is_file()
    ]
    if csvs:
        argv = [PYTHON, "benchmarks/cuda_core.py", "--from-csv", *csvs, "--no-plot"]
        try:
            with tempfile.TemporaryDirectory(prefix="kernelstudy_session_") as scratch:
                done = subprocess.run(
                    [*argv, "--out", str(Path(scratch) / "joined.csv")], cwd=REPO,
                    env=session.env, capture_output=True, text=True, timeout=60,
                )  # fmt: skip
        except subprocess.TimeoutExpired:
            session.log("the target ratios took over 60 s; read them here with --from-csv")
        else:
            lines = done.stdout.splitlines()
            session.log("\n".join(x for x in lines if "target" in x or x.startswith("crossover")))
            if done.returncode != 0:
                session.log(done.stderr.strip()[-1000:])
    for line in session.record.get("bf16x3", {}).get("ratios", []):
        session.log(f"bf16x3: {line}")
    files = sorted(p.name for p in session.out.iterdir())
    session.log(f"files in {session.out}: {' '.join(files)}")


# --- the children that import torch ---


def probe(path: Path) -> int:
    """Writes the device's facts to ``path`` (JSON); 1 without a usable CUDA GPU."""
    import importlib.metadata as metadata
    import statistics

    facts: dict = {"python": sys.version.split()[0]}
    try:
        import torch
    except ImportError as err:
        facts["error"] = f"torch does not import: {err}"
        path.write_text(json.dumps(facts))
        return 1
    facts["torch"], facts["cuda"] = torch.__version__, torch.version.cuda
    for name in ("triton", "fla-core", "flash-linear-attention"):
        try:
            facts[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            facts[name] = None
    nvcc = shutil.which("nvcc")
    if nvcc:
        text = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        facts["nvcc"] = text.strip().splitlines()[-1] if text.strip() else ""
    smi = shutil.which("nvidia-smi")
    if smi:
        query = [smi, "--query-gpu=driver_version,clocks.sm,clocks.mem", "--format=csv,noheader"]
        facts["nvidia_smi"] = subprocess.run(query, capture_output=True, text=True).stdout.strip()
    if not torch.cuda.is_available():
        facts["error"] = "torch sees no CUDA GPU"
        path.write_text(json.dumps(facts))
        print(facts["error"], file=sys.stderr)
        return 1
    props = torch.cuda.get_device_properties(0)
    facts["device"] = props.name
    facts["capability"] = f"{props.major}.{props.minor}"
    facts["sms"] = props.multi_processor_count
    facts["memory_gib"] = round(props.total_memory / 2**30, 1)
    try:
        import fla.ops.linear_attn  # noqa: F401

        facts["fla_error"] = ""
    except Exception as err:
        facts["fla_error"] = f"{type(err).__name__}: {err}"[:300]

    def median_ms(fn, *args, repeats=10) -> float:
        for _ in range(3):
            fn(*args)
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    src = torch.rand(2**29, device="cuda")  # 2 GiB: well past the L2
    ms = median_ms(torch.Tensor.copy_, torch.empty_like(src), src)
    facts["copy_tb_s"] = round(2 * src.nbytes / (ms * 1e-3) / 1e12, 2)  # read + write
    del src
    torch.set_float32_matmul_precision("highest")
    for dtype in (torch.bfloat16, torch.float32):
        a, b = (torch.randn(8192, 8192, device="cuda", dtype=dtype) for _ in range(2))
        ms = median_ms(torch.matmul, a, b)
        facts[f"matmul_{str(dtype).split('.')[-1]}_tflops"] = round(2 * 8192**3 / ms / 1e9, 1)
    path.write_text(json.dumps(facts))
    print(json.dumps(facts, indent=1))
    return 0


def probe_build() -> int:
    """Builds the CUDA extension (into $KERNELSTUDY_BUILD_DIR); on failure reruns its ninja
    build verbosely, so the compiler's own messages reach the log. 1 if it did not build."""
    began = time.monotonic()
    import kernelstudy as ks
    from kernelstudy.core import cuda_backend

    module = cuda_backend.extension()
    print(f"build: {time.monotonic() - began:.1f} s; backends: {ks.backends()}")
    if module is not None:
        return 0
    folder = (
        Path(os.environ.get("KERNELSTUDY_BUILD_DIR", BUILD_DIR)) / cuda_backend.extension_name()
    )
    ninja = shutil.which("ninja")
    if ninja and (folder / "build.ninja").is_file():
        subprocess.run([ninja, "-v", "-C", str(folder)], stderr=subprocess.STDOUT)
    return 1


def plan(budget_s: float, chosen: tuple[str, ...] = DEFAULT_STAGES) -> str:
    """The ``chosen`` stages (env and build always) with their time limits when every earlier
    stage takes its cap."""
    stages = tuple(s for s in STAGES if s.name in chosen or s.name in ALWAYS)
    default = tuple(s.name for s in stages) == DEFAULT_STAGES
    picked = "" if default else f" --stages {' '.join(chosen)}"
    lines = [
        "Before the session, here (the fla wheel, pure Python; Triton is on the GPU machine):",
        f"    {FETCH_WHEELS}",
        "On the GPU machine (device run, carry ['.whl'], timeout_s = "
        f"{min(budget_s + 50, DEVICE_LIMIT_S):.0f}: the budget + 50, at most the tool's "
        f"{DEVICE_LIMIT_S}):",
        f"    python3 benchmarks/gpu_session.py --budget {budget_s:.0f}{picked} --out $OUT",
        "",
        "stage      min  cap  limit if every earlier stage runs to its cap (the least it gets)",
    ]
    left = budget_s
    for i, s in enumerate(stages):
        limit = time_limit(stages, i, left)
        shown = f"{limit:.0f} s" if limit >= s.min_s else "skipped"
        lines.append(f"{s.name:<10} {s.min_s:>3.0f} {s.cap_s:>4.0f}  {shown:<8} {s.what}")
        left -= max(limit, 0) if limit >= s.min_s else 0
    lines.append(f"files in --out (at most 8): {' '.join(FILES)}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, help="folder for the session's files (the device's $OUT)")
    p.add_argument("--budget", type=float, default=540, help="seconds for all stages (540)")
    p.add_argument(
        "--stages",
        nargs="+",
        choices=STAGE_NAMES,
        default=list(DEFAULT_STAGES),
        help="stages to run (env and build always run; default: all but bf16x3)",
    )
    p.add_argument(
        "--resume-from",
        type=Path,
        metavar="DIR",
        help="an earlier call's files: its targets.csv and sweep.csv are copied into --out and "
        "their cases are not measured again",
    )
    p.add_argument("--plan", action="store_true", help="print the stages and limits; run nothing")
    p.add_argument("--probe", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--probe-build", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.budget <= 0:
        p.error(f"--budget must be positive, got {args.budget}")
    if args.budget > MAX_BUDGET_S:  # a plan printed a command the device would kill
        p.error(
            f"--budget {args.budget:g} s: the device runs a command {DEVICE_LIMIT_S} s at most "
            f"and this script may end 10 s past its budget; give {MAX_BUDGET_S} or less"
        )
    if not (args.plan or args.probe or args.probe_build) and args.out is None:
        p.error("--out is required (the folder for the session's files)")
    least = sum(s.min_s for s in STAGES if s.name in args.stages or s.name in ALWAYS)
    if not (args.plan or args.probe or args.probe_build) and args.budget < least:
        p.error(
            f"--budget {args.budget:g} s is less than the stages' minimums add up to "
            f"({least:g} s for {' '.join(s.name for s in STAGES if s.name in args.stages)})"
        )
    if args.resume_from is not None and not args.resume_from.is_dir():
        p.error(f"--resume-from: no folder {str(args.resume_from)!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe:
        return probe(args.probe)
    if args.probe_build:
        return probe_build()
    if args.plan:
        print(plan(args.budget, tuple(args.stages)))
        return 0
    return run_session(args.out, args.budget, tuple(args.stages), args.resume_from)


if __name__ == "__main__":
    sys.exit(main())
