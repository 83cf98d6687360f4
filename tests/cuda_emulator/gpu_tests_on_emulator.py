"""A pytest plugin that runs the GPU tests (``tests/test_cuda_backend.py``) on a machine without
a GPU: CPU tensors, the kernels run by the emulator (``tests/test_cuda_emulated.py``'s
``EmulatedExtension``). For sessions without a GPU, to check a changed GPU test's own logic and
the backend's Python side before a GPU session runs them::

    python -m pytest -p tests.cuda_emulator.gpu_tests_on_emulator tests/test_cuda_backend.py \
        -k "linear_attention and not 4099 and not 256" -n 2

Only with ``tests/test_cuda_backend.py``: it makes ``torch.cuda.is_available()`` say True for the
whole run. The tests that need CUDA itself (autocast on "cuda", memory statistics, streams, CUDA
graphs, the profiler, telling CPU from CUDA tensors) and three too large to emulate are skipped
with the reason (``NEEDS_CUDA`` and ``TOO_LARGE`` below), so a failure here is one to look at.
Emulating the large shapes (N = 4099 or 32768, F = 256, the grouped shapes) takes minutes each:
leave them out with ``-k``. On 2026-12-02 (this machine, 2 cores), with
``-k "not 4099 and not 32768 and not 256 and not grouped"``, of 549 cases: 437 passed (about an
hour), 53 skipped themselves, and the 59 now skipped by ``NEEDS_CUDA`` (44, each failing for its
reason) and ``TOO_LARGE`` (15, each past 400 s) did not pass.
Timing, occupancy and the GPU's own rounding are not emulated: a pass here is no pass on a GPU.
``KS_EMULATOR_DEFINES="-DKS_FP32_BF16X3"`` builds the kernels with those defines (a build
variant's tests: ``-k "walk_mma and (float32 or fp32)"``, as ``benchmarks/gpu_session.py``
runs them).
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
from pathlib import Path

import pytest
import torch

torch.cuda.is_available = lambda: True  # before the GPU tests' module-level skip reads it
torch.cuda.get_device_capability = lambda *args: (9, 0)
torch.cuda.synchronize = lambda *args: None
# dynamo saves and restores the CUDA generator's state around each frame it compiles
torch.cuda.get_rng_state = lambda *args: torch.empty(0, dtype=torch.uint8)
torch.cuda.set_rng_state = lambda *args: None

from kernelstudy.core import cuda_backend  # noqa: E402

from .. import test_cuda_emulated as emulated  # noqa: E402

# built once; $KS_EMULATOR_DEFINES (shell words): defines for the kernels' build, e.g. the build
# variant -DKS_FP32_BF16X3 that the GPU session's bf16x3 stage tests
_DEFINES = tuple(shlex.split(os.environ.get("KS_EMULATOR_DEFINES", "")))
# linked in a folder removed once the library is loaded (its mapping outlives the file), in
# $KS_EMULATOR_LINK_DIR where set (the test of this plugin looks there: not the shared temp dir)
_link_dir = os.environ.get("KS_EMULATOR_LINK_DIR") or None
with tempfile.TemporaryDirectory(prefix="cuda_emulator", dir=_link_dir) as _folder:
    _LIBRARY = emulated.build_emulator(Path(_folder), _DEFINES)


def _supports(x: torch.Tensor) -> bool:
    return x.dtype in emulated.DTYPES


# outputs copied out of their guard buffers: the binding allocates them (a view returned by a
# Function fails forward-mode AD's layout assertion on dual tensors)
cuda_backend.extension = lambda: emulated._OutputsCopied(emulated.EmulatedExtension(_LIBRARY))
cuda_backend.supports = _supports
cuda_backend.is_available = lambda: True
# the registered backend holds the functions it was registered with
_registry = sys.modules["kernelstudy.core.backends"]._BACKENDS
_registry["cuda"].supports = _supports
_registry["cuda"].available = lambda: True


@pytest.fixture(autouse=True)
def _cpu_tensors(monkeypatch):
    """The GPU tests make their tensors on DEVICE: the CPU here."""
    from .. import test_cuda_backend

    monkeypatch.setattr(test_cuda_backend, "DEVICE", "cpu")


# GPU tests the emulator cannot run, skipped with the reason, so that a failure on the emulator
# is one to look at (on 2026-12-02 each of these failed here for the reason given, or ran past
# 400 s a case)
NEEDS_CUDA = {
    "test_registered_and_chosen_for_cuda_tensors": "tells CPU from CUDA tensors",
    "test_the_extensions_errors_reach_python": "a child process on a real CUDA device",
    "test_normalized_attention_builds_no_n_f_m_tensor": "CUDA's memory statistics",
    "test_a_layer_under_autocast_compiles_whole": "autocast on cuda",
    "test_a_backward_inside_autocast_changes_nothing": "autocast on cuda",
    "test_compiled_with_cuda_graphs_the_kernels_replay": "CUDA graphs",
    "test_kernels_run_on_the_current_stream": "CUDA streams",
    "test_walk_kernels_name_the_kernels_that_run": "CUDA's profiler",
}
TOO_LARGE = {
    "test_walk_carries_in_groups_match_whole_sequences": "N = 32768, 16 sequences",
    "test_offsets_past_2_to_the_31": "tensors of more than 2**31 elements",
    "test_more_sequences_than_grid_y_holds": "70,000 sequences",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Skip what the emulator cannot run (``NEEDS_CUDA``, ``TOO_LARGE``); a name there that the
    GPU tests no longer define is a usage error (a renamed test would otherwise go unskipped)."""
    from .. import test_cuda_backend

    for name in (*NEEDS_CUDA, *TOO_LARGE):
        if not hasattr(test_cuda_backend, name):
            raise pytest.UsageError(f"gpu_tests_on_emulator: no GPU test named {name}")
    for item in items:
        name = getattr(item, "originalname", item.name)
        if name in NEEDS_CUDA:
            item.add_marker(pytest.mark.skip(reason=f"needs CUDA itself: {NEEDS_CUDA[name]}"))
        elif name in TOO_LARGE:
            item.add_marker(pytest.mark.skip(reason=f"too large to emulate: {TOO_LARGE[name]}"))
