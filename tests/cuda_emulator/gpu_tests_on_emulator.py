"""A pytest plugin that runs the GPU tests (``tests/test_cuda_backend.py``) on a machine without
a GPU: CPU tensors, the kernels run by the emulator (``tests/test_cuda_emulated.py``'s
``EmulatedExtension``). For sessions without a GPU, to check a changed GPU test's own logic and
the backend's Python side before a GPU session runs them::

    python -m pytest -p tests.cuda_emulator.gpu_tests_on_emulator tests/test_cuda_backend.py \
        -k "linear_attention and not 4099 and not 256" -n 2

Only with ``tests/test_cuda_backend.py``: it makes ``torch.cuda.is_available()`` say True for the
whole run. Tests that need CUDA itself (autocast on "cuda", memory statistics, streams, CUDA
graphs, the profiler) fail with "Torch not compiled with CUDA enabled" or the like, and those that
tell CPU from CUDA tensors fail too, as does ``torch.library.opcheck`` of the kernels' custom ops
(the emulator's outputs sit past a guard in their buffers: a storage offset its fake tensors lack).
Emulating the large shapes (N = 4099 or 32768, F = 256, the grouped shapes) takes minutes each. On
2026-11-30 (this machine, 2 cores), the large shapes left out: 231 of the 243 tests of the
non-causal and normalized attention, the fused backward, reruns and misaligned inputs passed in 14
minutes (the 12 others need CUDA itself), and all 178 of the walks', products', cumulative sums'
and row terms' in 5 minutes (the test that names the walk kernels that run needs CUDA's profiler).
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
