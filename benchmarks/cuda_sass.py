"""Static machine-code statistics of the CUDA kernels (no GPU needed): what a kernel change
does to registers, spills and instruction counts before any GPU runs it.

Compiles every ``.cu`` of ``csrc/cuda`` for one architecture with the flags torch gives nvcc
(``-O3``, as the extension is built; the units at once), reads ptxas' resource report
(registers, spill bytes, stack) and the SASS that ``cuobjdump -sass`` prints, and counts per
kernel: all instructions, those of the kernel's longest loop (the walk kernels' chunk loop),
and a few kinds (HMMA tensor-core products, LDSM, cp.async's LDGSTS, shared and global loads
and stores, barriers).
With ``--against REF`` the same is done for the sources at a git revision and the two are set
side by side with the differences. ``--flags`` adds nvcc flags to the working tree's build (not
REF's): a build variant against the default.

    python benchmarks/cuda_sass.py --against HEAD --out /tmp/sass.csv
    python benchmarks/cuda_sass.py --flags=-DKS_FP32_BF16X3 --against HEAD --kernels mma

Static counts are not dynamic ones: a branch taken once a chunk and an unrolled copy weigh the
same here. They say where instructions went, not how long a kernel takes; ``cuda_counters.py``
(Nsight Compute, on a GPU) counts what runs. Needs nvcc, ``cuobjdump`` (CUDA's, or the
``nvidia-cuda-cuobjdump`` wheel's) and c++filt; exit status 3 without them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd

from kernelstudy.arguments import expanded_path
from kernelstudy.files import atomic_write_text
from kernelstudy.progress import run_script

REPO = Path(__file__).resolve().parents[1]
SOURCES = Path("csrc") / "cuda"  # every .cu there: at a revision of one unit, or of several
UNAVAILABLE = 3
# ptxas -v: one entry per kernel and architecture
ENTRY = re.compile(
    r"Compiling entry function '(?P<name>\S+)' for '(?P<arch>\w+)'.*?"
    r"(?P<stack>\d+) bytes stack frame, (?P<stores>\d+) bytes spill stores, "
    r"(?P<loads>\d+) bytes spill loads.*?Used (?P<regs>\d+) registers",
    re.DOTALL,
)
FUNCTION = re.compile(r"^\s*Function : (\S+)\s*$", re.MULTILINE)
# "/*0a30*/  @!P0 BRA 0x170 ;": address and instruction text
INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+([^;]*);", re.MULTILINE)
BRANCH_TARGET = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)\s*$")
# counted kinds: column -> opcode (the mnemonic before its first ".")
KINDS = {
    "hmma": "HMMA",
    "ldsm": "LDSM",
    "ldgsts": "LDGSTS",
    "lds": "LDS",
    "sts": "STS",
    "ldg": "LDG",
    "stg": "STG",
    "bar": "BAR",
    "local": ("LDL", "STL"),
}


# the printed columns (the CSV has them all)
SHOWN = [
    "kernel", "registers", "spill_stores", "instructions", "loop_instructions", "hmma",
    "d_instructions", "d_loop_instructions", "d_registers", "d_spill_stores",
]  # fmt: skip


def torch_nvcc_flags() -> list[str]:
    """The defines and options torch's cpp_extension gives nvcc (as tests/test_nvcc_compile.py)."""
    try:
        from torch.utils.cpp_extension import COMMON_NVCC_FLAGS
    except ImportError:  # no torch: the defines torch 2.x passes
        return [
            "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
            "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
            "--expt-relaxed-constexpr",
        ]  # fmt: skip
    return list(COMMON_NVCC_FLAGS)


def find_tool(name: str, given: str | None = None) -> str | None:
    """``given``, else ``name`` on PATH, else beside nvcc (CUDA's bin folder)."""
    if given:
        return given if Path(given).is_file() else shutil.which(given)
    found = shutil.which(name)
    if found is None and (nvcc := shutil.which("nvcc")):
        beside = Path(nvcc).resolve().parent / name
        found = str(beside) if beside.is_file() else None
    return found


def compile_cubin(source: Path, arch: str, out: Path, flags: Sequence[str] = ()) -> str:
    """Compiles ``source`` (a .cu of a ``csrc/cuda`` folder) to ``out`` (a cubin for ``arch``,
    e.g. sm_90a) with the extra nvcc ``flags``; returns ptxas' resource report. Raises
    RuntimeError with nvcc's message if it fails."""
    number = re.sub(r"\D", "", arch)
    suffix = "a" if arch.endswith("a") else ""
    command = [
        "nvcc", "-cubin", "-std=c++17", "-O3", "-gencode",
        f"arch=compute_{number}{suffix},code=sm_{number}{suffix}", *torch_nvcc_flags(),
        *flags, "-Xptxas", "-v", "-I", str(source.parents[1]), "-I", str(source.parent),
        str(source), "-o", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"nvcc failed on {source}:\n{result.stderr[-4000:]}")
    return result.stdout + result.stderr


def demangle(names: list[str]) -> list[str]:
    """Kernel names without namespace, return type or parameters, e.g.
    ``chunk_walk_kernel<float, float, 2>`` (c++filt)."""
    text = subprocess.run(
        ["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True
    ).stdout
    short = []
    for name in text.splitlines():
        name = re.sub(r"^void |ks_cuda::\(anonymous namespace\)::", "", name)
        short.append(name[: name.index("(")] if "(" in name else name)
    return short


def resources(report: str, arch: str) -> pd.DataFrame:
    """ptxas -v's report for ``arch``: one row per kernel (mangled name), with registers,
    spill_stores, spill_loads and stack (bytes)."""
    rows = [
        {
            "mangled": m["name"],
            "registers": int(m["regs"]),
            "spill_stores": int(m["stores"]),
            "spill_loads": int(m["loads"]),
            "stack": int(m["stack"]),
        }
        for m in ENTRY.finditer(report)
        if m["arch"] == arch
    ]
    return pd.DataFrame(
        rows, columns=["mangled", "registers", "spill_stores", "spill_loads", "stack"]
    )


def opcode(instruction: str) -> str:
    """The mnemonic of a SASS instruction, without predicate or modifiers (``@!P0 LDG.E`` ->
    ``LDG``)."""
    words = instruction.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def longest_loop(instructions: list[tuple[int, str]]) -> int:
    """Instructions between the target and the source of the backward branch that spans the
    most of them (0 without one): the body of a kernel's outermost loop."""
    best = 0
    for i, (address, text) in enumerate(instructions):
        target = BRANCH_TARGET.search(text)
        if target and int(target[1], 16) < address:
            start = next(j for j, (a, _) in enumerate(instructions) if a >= int(target[1], 16))
            best = max(best, i - start + 1)
    return best


def sass_counts(sass: str) -> pd.DataFrame:
    """Per function of ``cuobjdump -sass``'s text (mangled name): instructions (NOPs left out),
    loop_instructions (``longest_loop``) and one column per kind of ``KINDS``."""
    rows = []
    parts = FUNCTION.split(sass)
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        instructions = [
            (int(a, 16), text.strip())
            for a, text in INSTRUCTION.findall(body)
            if opcode(text) != "NOP"
        ]
        ops = Counter(opcode(text) for _, text in instructions)
        row = {
            "mangled": name,
            "instructions": len(instructions),
            "loop_instructions": longest_loop(instructions),
        }
        for column, kinds in KINDS.items():
            row[column] = sum(ops[k] for k in ((kinds,) if isinstance(kinds, str) else kinds))
        rows.append(row)
    return pd.DataFrame(rows, columns=["mangled", "instructions", "loop_instructions", *KINDS])


def statistics(root: Path, arch: str, cuobjdump: str, flags: Sequence[str] = ()) -> pd.DataFrame:
    """Every kernel of ``root``'s sources compiled for ``arch`` (with the extra nvcc ``flags``):
    resources and SASS counts, one
    row per kernel (demangled), sorted by name. A kernel that several units compile (the
    scan that every input type's unit uses) has one row."""
    sources = sorted((root / SOURCES).glob("*.cu"))
    if not sources:
        raise RuntimeError(f"no .cu files in {root / SOURCES}")
    with tempfile.TemporaryDirectory() as tmp:

        def one(source: Path) -> pd.DataFrame:
            cubin = Path(tmp) / f"{source.stem}.cubin"
            report = compile_cubin(source, arch, cubin, flags)
            sass = subprocess.run(
                [cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True
            ).stdout
            return resources(report, arch).merge(sass_counts(sass), on="mangled", how="outer")

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            table = pd.concat(list(pool.map(one, sources)), ignore_index=True)
    table.insert(0, "kernel", demangle(table["mangled"].tolist()))
    table = table.drop(columns="mangled").drop_duplicates("kernel")
    return table.sort_values("kernel", ignore_index=True)


def sources_at(revision: str, into: Path) -> Path:
    """The ``csrc`` folder of the repository at git ``revision``, unpacked under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", revision, "csrc"],
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        raise RuntimeError(f"git archive {revision} failed: {archive.stderr.decode()[-2000:]}")
    tar = into / "csrc.tar"
    tar.write_bytes(archive.stdout)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    return into


def side_by_side(now: pd.DataFrame, before: pd.DataFrame) -> pd.DataFrame:
    """``now`` with each count of ``before`` beside it (``<column>_before``) and the change
    in instructions, loop instructions, registers and spill stores (``d_<column>``)."""
    table = now.merge(before, on="kernel", how="outer", suffixes=("", "_before"))
    for column in ("instructions", "loop_instructions", "registers", "spill_stores"):
        table[f"d_{column}"] = table[column] - table[f"{column}_before"]
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_90a", help="target architecture (default sm_90a)")
    parser.add_argument("--against", metavar="REF", help="git revision to compare with")
    parser.add_argument("--kernels", default="", help="regex: only kernels whose name matches")
    parser.add_argument(
        "--flags",
        default="",
        help="extra nvcc flags for the working tree's build, not REF's (e.g. -DKS_FP32_BF16X3)",
    )
    parser.add_argument("--cuobjdump", help="cuobjdump executable (default: PATH, beside nvcc)")
    parser.add_argument("--out", type=expanded_path, help="CSV file to write")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"sm_\d+a?", args.arch):
        parser.error(f"--arch must look like sm_90a or sm_80, got {args.arch!r}")
    try:
        re.compile(args.kernels)
    except re.error as err:
        parser.error(f"--kernels is not a regular expression: {err}")
    try:
        flags = shlex.split(args.flags)
    except ValueError as err:
        parser.error(f"--flags is not a shell-quoted list of flags: {err}")
    cuobjdump = find_tool("cuobjdump", args.cuobjdump)
    missing = [t for t, p in (("nvcc", shutil.which("nvcc")), ("cuobjdump", cuobjdump)) if not p]
    missing += [] if shutil.which("c++filt") else ["c++filt"]
    if missing:
        print(f"cuda_sass.py: {', '.join(missing)} not found", file=sys.stderr)
        return UNAVAILABLE
    try:
        table = statistics(REPO, args.arch, cuobjdump, flags)
        if args.against:
            with tempfile.TemporaryDirectory() as tmp:
                table = side_by_side(
                    table, statistics(sources_at(args.against, Path(tmp)), args.arch, cuobjdump)
                )
    except (RuntimeError, subprocess.CalledProcessError) as err:
        print(f"cuda_sass.py: {err}", file=sys.stderr)
        return 1
    table = table[table["kernel"].str.contains(args.kernels, regex=True)]
    with pd.option_context("display.width", 200, "display.max_rows", None):
        print(table[[c for c in SHOWN if c in table.columns]].to_string(index=False))
    if args.out:
        table = table.assign(
            arch=args.arch,
            flags=" ".join(flags),
            against=args.against or "",
            date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            command=" ".join(
                [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]
            ),
        )
        atomic_write_text(args.out, table.to_csv(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
