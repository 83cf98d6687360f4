"""Hardware counters of the CUDA backend's causal walk kernels (Nsight Compute): why a kernel
takes its time, where ``cuda_profile.py`` says how long.

Runs one forward+backward step of ``ks.causal_dot_product(..., backend="cuda")`` per dtype and
kernel variant under ``ncu`` (clocks left alone: ``--clock-control none``) and reports, for
every launch of a walk kernel (kernels 6 and 7, ``walk``; 8 and 9, ``walk_mma``): duration,
instructions issued, issue-slot and tensor-pipe use, achieved occupancy, memory throughput and
the warp stall reasons, in cycles per issued instruction. Warm-up steps run outside the
profiled range (``--profile-from-start off``).

    python benchmarks/cuda_counters.py --out benchmarks/results/cuda_counters.csv

The CSV is long: one row per (launch, metric), with the section, unit, value, the launch's
kernel, grid and block, and the device, date and command; a table of the main metrics per
launch is printed. Each dtype is its own ncu run, and the CSV is rewritten after each (a run
stopped at a time limit keeps the dtypes before it). Exit status 3: no ``ncu`` here, or it
cannot read the counters (a machine whose runtime does not expose them); 1: a dtype gave no
report.
"""

from __future__ import annotations

import argparse
import datetime as dt
import glob
import io
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from kernelstudy.arguments import expanded_path
from kernelstudy.files import atomic_write_text, output_file_problem
from kernelstudy.progress import run_script

VARIANTS = ("walk", "walk_fused", "walk_mma", "walk_mma_fused")
SECTIONS = (
    "SpeedOfLight",
    "ComputeWorkloadAnalysis",
    "InstructionStats",
    "LaunchStats",
    "Occupancy",
    "WarpStateStats",
    "MemoryWorkloadAnalysis",
)
KERNELS = "regex:chunk_walk"  # kernels 6-11 (chunk_walk_kernel, chunk_walk_mma_dkv_kernel, ...)
# raw metrics kept beside the details page: stall reasons and the pipes' instruction counts
RAW_KEPT = re.compile(
    r"issue_stalled_\w+_per_issue_active|inst_executed_pipe_\w+\.sum$|pipe_\w+_cycles_active"
)
# the printed table: details-page metrics, one column each (those ncu reported)
SUMMARY = {
    "Duration": "time",
    "Executed Instructions": "instructions",
    "Issue Slots Busy": "issue slots",
    "Executed Ipc Active": "IPC",
    "Warp Cycles Per Issued Instruction": "cycles/instruction",
    "Achieved Occupancy": "occupancy",
    "Registers Per Thread": "registers",
    "Compute (SM) Throughput": "SM",
    "Memory Throughput": "memory",
}
# the tensor pipes' busy share (sm__pipe_tensor_op_hmma_cycles_active... on Ampere and Hopper)
TENSOR_PIPE = r"sm__pipe_tensor\w*_cycles_active\.avg\.pct_of_peak_sustained_active$"
COLUMNS = ["id", "kernel", "grid", "block", "stream", "section", "metric", "unit", "text", "value"]
UNAVAILABLE = 3  # the exit status without ncu, or without counters it can read
NO_COUNTERS = (
    "ERR_NVGPUCTRPERM",
    "Failed to initialize the profiler",
    "LibraryNotLoaded",
    "Device not supported",
    "not supported on this device",
)


def find_ncu(given: str | None = None) -> str | None:
    """The ncu executable: ``given``, else on PATH, else in CUDA's usual install folders."""
    if given:
        return given if Path(given).is_file() else shutil.which(given)
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu"):
        matches = sorted(glob.glob(pattern))
        if matches:
            return matches[-1]
    return None


def short_kernel(name: str) -> str:
    """``chunk_walk_mma_kernel<__nv_bfloat16, __nv_bfloat16, 1>`` from ncu's demangled name
    (its return type, namespaces and parameters left out)."""
    name = re.sub(r"^void\s+", "", name.strip())
    name = re.sub(r"[\w:]*\(anonymous namespace\)::|\bks_cuda::", "", name)
    depth = 0
    for i, ch in enumerate(name):  # cut at the parameter list: the first "(" outside <...>
        depth += (ch == "<") - (ch == ">")
        if ch == "(" and depth == 0:
            return name[:i]
    return name


def number(text: object) -> float:
    """ncu's printed value as a float (thousands separators dropped); NaN if not a number."""
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return float("nan")


def _csv_part(text: str) -> str:
    """The CSV ncu printed, from its header line on (ncu's own ``==PROF==`` lines dropped)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return ""
    return "\n".join(line for line in lines[start:] if not line.startswith("=="))


def parse_details(text: str) -> pd.DataFrame:
    """``ncu --import R --csv --page details``: one row per (launch, section, metric)."""
    part = _csv_part(text)
    if not part:
        return pd.DataFrame(columns=COLUMNS)
    frame = pd.read_csv(io.StringIO(part), dtype=str, keep_default_na=False)
    need = {"ID", "Kernel Name", "Section Name", "Metric Name", "Metric Unit", "Metric Value"}
    if not need <= set(frame.columns):
        raise ValueError(f"ncu's details page lacks columns {sorted(need - set(frame.columns))}")
    out = pd.DataFrame(
        {
            "id": frame["ID"].map(number).astype(int),
            "kernel": frame["Kernel Name"].map(short_kernel),
            "grid": frame.get("Grid Size", ""),
            "block": frame.get("Block Size", ""),
            "stream": frame.get("Stream", ""),
            "section": frame["Section Name"],
            "metric": frame["Metric Name"],
            "unit": frame["Metric Unit"],
            "text": frame["Metric Value"],
        }
    )
    out = out[out.metric != ""]  # rule rows (advice) carry no metric
    return out.assign(value=out.text.map(number))


def parse_raw(text: str, kept: re.Pattern = RAW_KEPT) -> pd.DataFrame:
    """``ncu --import R --csv --page raw`` (a header, a units row, one row per launch): the
    metrics whose names match ``kept``, one row per (launch, metric), section "raw"."""
    part = _csv_part(text)
    if not part:
        return pd.DataFrame(columns=COLUMNS)
    frame = pd.read_csv(io.StringIO(part), dtype=str, keep_default_na=False)
    if len(frame) and frame["ID"].iloc[0] == "":  # the units row
        units, frame = frame.iloc[0], frame.iloc[1:]
    else:
        units = pd.Series("", index=frame.columns)
    metrics = [c for c in frame.columns if kept.search(c)]
    rows = []
    for _, launch in frame.iterrows():
        for metric in metrics:
            rows.append(
                {
                    "id": int(number(launch["ID"])),
                    "kernel": short_kernel(launch.get("Kernel Name", "")),
                    "grid": launch.get("Grid Size", ""),
                    "block": launch.get("Block Size", ""),
                    "stream": launch.get("Stream", ""),
                    "section": "raw",
                    "metric": metric,
                    "unit": units[metric],
                    "text": launch[metric],
                    "value": number(launch[metric]),
                }
            )
    return pd.DataFrame(rows, columns=COLUMNS)


def stall_column(frame: pd.DataFrame, top: int = 3) -> pd.Series:
    """Per launch, its ``top`` stall reasons with their cycles per issued instruction, e.g.
    ``long_scoreboard 3.1, barrier 1.2``."""
    stalls = frame[frame.metric.str.contains("issue_stalled_", regex=False)]
    stalls = stalls.assign(
        reason=stalls.metric.str.extract(r"issue_stalled_(\w+?)_per_issue_active", expand=False)
    ).dropna(subset=["reason", "value"])
    stalls = stalls[~stalls.reason.isin(["selected"])]  # issuing, not stalled
    if stalls.empty:
        return pd.Series(dtype=str)

    def best(group: pd.DataFrame) -> str:
        group = group.sort_values("value", ascending=False).head(top)
        return ", ".join(f"{r} {v:.2g}" for r, v in zip(group.reason, group.value, strict=True))

    return stalls.groupby("id")[["reason", "value"]].apply(best)


def summary(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per launch: its variant, dtype, kernel and the :data:`SUMMARY` metrics (with
    their units in the column names), then its main stall reasons."""
    keys = ["id", "dtype", "variant", "kernel"]
    main = frame[frame.metric.isin(SUMMARY) & (frame.section != "raw")]
    table = frame.drop_duplicates("id")[keys].set_index("id")
    for metric, label in SUMMARY.items():
        rows = main[main.metric == metric].drop_duplicates("id").set_index("id")
        if rows.empty:
            continue
        unit = rows.unit.iloc[0]
        table[f"{label} ({unit})" if unit else label] = rows.value
    tensor = frame[frame.metric.str.match(TENSOR_PIPE)].groupby("id").value.max()
    if not tensor.empty:
        table["tensor pipe %"] = tensor
    stalls = stall_column(frame)
    if not stalls.empty:
        table["stalls (cycles/instr)"] = stalls
    return table.reset_index()


# --- the profiled program (run by ncu) ---


def child(args: argparse.Namespace) -> int:
    """One profiled fwd+bwd step per (dtype, variant), after warm-up steps outside the range."""
    import torch

    import kernelstudy as ks
    from kernelstudy.core import cuda_backend

    if not torch.cuda.is_available() or "cuda" not in ks.backends():
        print("cuda_counters.py: no GPU or no cuda backend here", file=sys.stderr)
        return 1
    # cuda_profile.py's step (this script's folder is on sys.path when run as a script)
    from cuda_profile import step_inputs

    print(f"cuda_counters.py: device {torch.cuda.get_device_name()}", flush=True)
    b, h, n, d = args.batch, args.heads, args.n, args.dim
    for name in args.dtypes:
        q, k, v, g = step_inputs(getattr(torch, name), b, h, n, d)
        for variant in args.variants:
            with cuda_backend.settings_kept():
                cuda_backend.use_variant(variant, walk_blocks=args.walk_blocks)
                for _ in range(2):
                    ks.causal_dot_product(q, k, v, backend="cuda").backward(g)
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
                with torch.cuda.stream(torch.cuda.Stream()):  # the step's label in the report
                    ks.causal_dot_product(q, k, v, backend="cuda").backward(g)
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
            print(f"cuda_counters.py: profiled {name} {variant}", flush=True)
    return 0


def label_launches(frame: pd.DataFrame, order: list[tuple[str, str]]) -> pd.DataFrame:
    """Adds dtype and variant to each launch: the child runs each profiled step on a stream of
    its own, in the printed ``order``, so the streams taken in the order of their first launch
    are the steps. Left blank (with a warning) where the counts differ."""
    frame = frame.assign(dtype="", variant="")
    first = frame.groupby("stream").id.min().sort_values()
    if len(first) != len(order):
        print(
            f"cuda_counters.py: {len(first)} streams with walk kernels for {len(order)} "
            "profiled steps: launches left unlabelled",
            file=sys.stderr,
        )
        return frame
    for stream, (dtype, variant) in zip(first.index, order, strict=True):
        frame.loc[frame.stream == stream, ["dtype", "variant"]] = [dtype, variant]
    return frame


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=8192, help="sequence length (8192)")
    p.add_argument("--batch", type=int, default=8, help="B (8)")
    p.add_argument("--heads", type=int, default=16, help="H (16)")
    p.add_argument("--dim", type=int, default=64, help="F = M (64)")
    p.add_argument(
        "--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16", "float32"]
    )
    p.add_argument(
        "--variants", nargs="+", default=["walk_fused", "walk_mma_fused"], choices=VARIANTS
    )
    p.add_argument("--walk-blocks", type=int, default=128, help="WALK_BLOCKS (128)")
    p.add_argument("--ncu", help="the ncu executable (default: on PATH or CUDA's folders)")
    p.add_argument(
        "--out", type=expanded_path, default=Path("benchmarks/results/cuda_counters.csv")
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if min(args.n, args.batch, args.heads, args.dim, args.walk_blocks) < 1:
        p.error("--n, --batch, --heads, --dim and --walk-blocks must be positive")
    if problem := output_file_problem(args.out):
        p.error(f"--out {args.out}: {problem}")
    return args


def child_argv(args: argparse.Namespace) -> list[str]:
    """This script's arguments for the profiled child."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--n", str(args.n)]
    argv += ["--batch", str(args.batch), "--heads", str(args.heads), "--dim", str(args.dim)]
    argv += ["--walk-blocks", str(args.walk_blocks), "--dtypes", *args.dtypes]
    return argv + ["--variants", *args.variants]


def ncu_argv(ncu: str, report: Path, args: argparse.Namespace) -> list[str]:
    argv = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--kernel-name"]
    argv += [KERNELS, "--export", str(report), "--force-overwrite"]
    for section in SECTIONS:
        argv += ["--section", section]
    return argv + child_argv(args)


def import_page(ncu: str, report: Path, page: str) -> str:
    """A page of the report as CSV, kernels named with their template arguments."""
    shown = [ncu, "--import", str(report), "--csv", "--page", page]
    done = subprocess.run(
        [*shown, "--print-kernel-base", "demangled"], capture_output=True, text=True
    )
    if done.returncode != 0:  # an ncu without that option: its default names
        done = subprocess.run(shown, capture_output=True, text=True)
    return done.stdout


def profile_one(ncu: str, args: argparse.Namespace, dtype: str) -> tuple[pd.DataFrame, int]:
    """The launches of one dtype's steps under ncu (its own run: a run stopped or broken keeps
    the other dtypes' rows) and the exit status: 0, 1 (no report, or ncu failed) or
    :data:`UNAVAILABLE` (no counters readable here)."""
    one = argparse.Namespace(**{**vars(args), "dtypes": [dtype]})
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "counters"
        run = subprocess.run(ncu_argv(ncu, report, one), capture_output=True, text=True)
        print(run.stdout, end="")
        print(run.stderr, end="", file=sys.stderr)
        if any(marker in run.stdout + run.stderr for marker in NO_COUNTERS):
            print("cuda_counters.py: ncu cannot read the counters here", file=sys.stderr)
            return pd.DataFrame(columns=COLUMNS), UNAVAILABLE
        path = report.with_suffix(".ncu-rep")
        if not path.is_file():
            print(
                f"cuda_counters.py: ncu wrote no report for {dtype} (exit {run.returncode})",
                file=sys.stderr,
            )
            return pd.DataFrame(columns=COLUMNS), 1
        pages = {page: import_page(ncu, path, page) for page in ("details", "raw")}
    frame = pd.concat([parse_details(pages["details"]), parse_raw(pages["raw"])])
    order = re.findall(r"cuda_counters\.py: profiled (\w+) (\w+)", run.stdout)
    device = re.search(r"cuda_counters\.py: device (.+)", run.stdout)
    frame = label_launches(frame.sort_values(["id", "section"], kind="stable"), order)
    frame = frame.assign(device=device.group(1).strip() if device else "")
    return frame, (0 if run.returncode == 0 and not frame.empty else 1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args)
    from kernelstudy.core.cuda_backend import command_line

    ncu = find_ncu(args.ncu)
    if ncu is None:
        print("cuda_counters.py: ncu (Nsight Compute) is not here", file=sys.stderr)
        return UNAVAILABLE
    frames, status = [], 0
    for dtype in args.dtypes:
        frame, code = profile_one(ncu, args, dtype)
        if code == UNAVAILABLE:  # no dtype will do better
            return UNAVAILABLE
        status = max(status, code)
        if frame.empty:
            continue
        offset = int(frames[-1].id.max()) + 1 if frames else 0  # ids go on across the runs
        frames.append(frame.assign(id=frame.id + offset))
        result = pd.concat(frames, ignore_index=True).assign(
            B=args.batch,
            H=args.heads,
            N=args.n,
            F=args.dim,
            walk_blocks=args.walk_blocks,
            date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            command=command_line(sys.argv),
        )
        atomic_write_text(args.out, result.to_csv(index=False))  # as it goes
    if not frames:
        print("cuda_counters.py: no walk-kernel launch was measured", file=sys.stderr)
        return 1
    with pd.option_context("display.max_colwidth", 50, "display.width", 250):
        print(summary(result).round(2).to_string(index=False))
    print(f"wrote {args.out}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(run_script(main))
