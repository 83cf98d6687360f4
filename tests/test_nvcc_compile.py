"""Every CUDA kernel under csrc/ compiles with nvcc for sm_80 and sm_90a, with the flags torch
gives nvcc when it builds the extension.

``.cu`` files hold kernels and launchers only (CUDA headers, no torch), so they compile
without PyTorch's include paths; a kernel that does not compile fails CI even on machines
without a GPU. ptxas' resource report also checks each sm_90a kernel's register spills against
a budget (a new spill fails). Skipped only where nvcc (or, for the spills, c++filt) is absent.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kernelstudy.core.extensions import csrc_dir

CSRC = csrc_dir()
CU_FILES = sorted(CSRC.rglob("*.cu"))
NVCC = shutil.which("nvcc")
CXXFILT = shutil.which("c++filt")
ARCHS = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90a,code=sm_90a"]
# The flags torch's cpp_extension gives nvcc when it builds the extension on a GPU machine
# (COMMON_NVCC_FLAGS): among them __CUDA_NO_HALF_CONVERSIONS__ and
# __CUDA_NO_BFLOAT16_CONVERSIONS__, under which an implicit float <-> __half / __nv_bfloat16
# conversion or a __half operator does not compile. Without them here, such a change would pass
# this test and fail only at the GPU session's first build (the core then falls back to torch).
try:
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS as TORCH_NVCC_FLAGS
except ImportError:  # no torch: the defines torch 2.x passes
    TORCH_NVCC_FLAGS = [
        "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
        "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
        "--expt-relaxed-constexpr",
    ]  # fmt: skip
TORCH_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](torch|ATen|c10|pybind11)/', re.MULTILINE)


def _id(path):
    return str(path.relative_to(CSRC))


@pytest.mark.parametrize("source", CU_FILES, ids=_id)
def test_cu_includes_no_torch_headers(source):
    assert not TORCH_INCLUDE.search(source.read_text()), f"{_id(source)} includes torch headers"


# Register spills on sm_90a (bytes of spill stores per thread), from ptxas. Spills cost local
# memory traffic in the hot loop, so a change that adds one should be seen: every kernel not
# listed must not spill, and a listed one not more than its budget (the state of 2026-11-24,
# measured with nvcc 13.0). Lower a budget when a change removes a spill.
SPILL_BUDGET = {
    "chunk_output_kernel<__nv_bfloat16, float, __nv_bfloat16>": 4,
    "chunk_output_kernel<__nv_bfloat16, float, float>": 4,
    "chunk_output_kernel<float, float, float>": 28,
    "chunk_output_kernel<__half, float, __half>": 16,
    "chunk_output_kernel<__half, float, float>": 16,
    # 128-register cap (2 blocks per SM) with fp32 operand tiles (fp32 and fp16 inputs)
    "chunk_dqk_kernel<float, float, float>": 352,
    "chunk_dqk_kernel<__half, float, __half>": 372,
    "chunk_dqk_kernel<__half, float, float>": 368,
    "chunk_dv_kernel<float, float, float>": 4,
    "chunk_dv_kernel<__half, float, __half>": 8,
    "chunk_dv_kernel<__half, float, float>": 8,
    "chunk_walk_kernel<__half, __half, 2>": 4,
    "chunk_walk_kernel<__half, float, 2>": 4,
}
ENTRY = re.compile(
    r"Compiling entry function '(\S+)' for '(\w+)'.*?(\d+) bytes spill stores.*?"
    r"Used (\d+) registers",
    re.DOTALL,
)


@pytest.fixture(scope="module")
def ptxas_reports(tmp_path_factory) -> dict:
    """nvcc -c with ptxas' resource report for every .cu: {source: CompletedProcess}, the
    outputs of its architectures joined. Each (source, architecture) is its own nvcc process,
    as many at once as the machine has cores (one process compiling both took twice the time
    on CI's two cores; nvcc's own --threads would interleave the two reports' lines)."""
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    out = tmp_path_factory.mktemp("nvcc")
    arch_pairs = [ARCHS[i : i + 2] for i in range(0, len(ARCHS), 2)]

    def compile_one(source: Path, gencode: list[str]) -> subprocess.CompletedProcess:
        arch = gencode[1].rsplit("=", 1)[-1]
        command = [
            NVCC, "-c", "-std=c++17", *gencode, *TORCH_NVCC_FLAGS, "-Xptxas", "-v", "-I",
            str(CSRC), "-I", str(source.parent), str(source), "-o",
            str(out / f"{source.stem}_{arch}.o"),
        ]  # fmt: skip
        return subprocess.run(command, capture_output=True, text=True, timeout=900)

    jobs = [(source, gencode) for source in CU_FILES for gencode in arch_pairs]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        done = list(pool.map(lambda job: compile_one(*job), jobs))
    reports = {}
    for source in CU_FILES:
        parts = [r for (s, _), r in zip(jobs, done, strict=True) if s == source]
        reports[source] = subprocess.CompletedProcess(
            [r.args for r in parts],
            next((r.returncode for r in parts if r.returncode != 0), 0),
            "".join(r.stdout for r in parts),
            "".join(r.stderr for r in parts),
        )
    return reports


def kernel_resources(report: str, arch: str) -> dict[str, tuple[int, int]]:
    """{kernel: (spill store bytes, registers)} for `arch` from ptxas -v output; kernel names
    demangled without namespace or parameters, e.g. ``chunk_walk_kernel<float, float, 2>``."""
    entries = [e for e in ENTRY.findall(report) if e[1] == arch]
    names = subprocess.run(
        [CXXFILT], input="\n".join(e[0] for e in entries), capture_output=True, text=True
    ).stdout.splitlines()
    resources = {}
    for (_, _, spill, regs), name in zip(entries, names, strict=True):
        name = re.sub(r"^void |ks_cuda::\(anonymous namespace\)::", "", name)
        resources[name[: name.index("(")] if "(" in name else name] = (int(spill), int(regs))
    return resources


@pytest.mark.parametrize("source", CU_FILES, ids=_id)
def test_cu_compiles(source, ptxas_reports):
    result = ptxas_reports[source]
    assert result.returncode == 0, f"nvcc failed on {_id(source)}:\n{result.stderr[-6000:]}"


@pytest.mark.skipif(CXXFILT is None, reason="c++filt is not on PATH")
def test_register_spills_within_budget(ptxas_reports):
    source = CSRC / "cuda" / "linear_attention.cu"
    assert ptxas_reports[source].returncode == 0
    resources = kernel_resources(
        ptxas_reports[source].stdout + ptxas_reports[source].stderr, "sm_90a"
    )
    assert len(resources) >= 40 and set(SPILL_BUDGET) <= set(resources)
    over = {
        name: (spill, SPILL_BUDGET.get(name, 0))
        for name, (spill, _) in resources.items()
        if spill > SPILL_BUDGET.get(name, 0)
    }
    assert not over, f"spill stores (bytes, budget) above budget on sm_90a: {over}"
