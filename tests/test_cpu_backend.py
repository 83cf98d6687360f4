"""The compiled ``cpu`` backend (csrc/cpu) equals the reference on awkward shapes.

Tolerances: fp32 max relative error ≤ 1e-5 against a float64 reference (outputs and the
gradients of q, k and v); float64 checked with ``torch.autograd.gradcheck``. The kernel's
results must not depend on the thread count.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import os
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
import torch

import kernelstudy as ks
from kernelstudy.core import causal_dot_product_reference as reference
from kernelstudy.core import cpu_backend, extensions, linear_attention_reference
from kernelstudy.core.cpu_backend import causal_dot_product_cpu

from .conftest import rel_err

# Skipped only where nothing can compile it: a build that fails with a compiler present
# (a broken kernel source, say) fails here, rather than leaving every cpu test out of the
# run (the other test files take the cpu backend from ks.backends()) with a warning only.
_NO_COMPILER = extensions._missing_tool(cuda=False)
if _NO_COMPILER is not None:
    pytest.skip(f"the cpu extension cannot be built here: {_NO_COMPILER}", allow_module_level=True)


def test_the_cpu_extension_builds_where_a_compiler_is():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = cpu_backend.available()
    why = [str(w.message) for w in caught] or "its RuntimeWarning, in the warnings summary"
    assert built, f"the cpu extension did not build: {why}"


# (B, H, N, F, M): N=1; N not a multiple of the chunk (64) or segment (512); F≠M (96, 40);
# B·H = 1 with several segments (split within the sequence when B·H < threads); B·H = 37.
SHAPES = [
    (1, 1, 1, 4, 3),
    (2, 3, 37, 8, 5),
    (3, 2, 130, 96, 40),
    (1, 1, 257, 7, 11),
    (1, 1, 1500, 16, 24),
    (37, 1, 70, 8, 8),
    (1, 2, 1100, 3, 1),
]


def _features(b, h, n, f, m, dtype=torch.float32):
    q = torch.rand(b, h, n, f, dtype=dtype)
    k = torch.rand(b, h, n, f, dtype=dtype)
    v = torch.randn(b, h, n, m, dtype=dtype)
    return [t.requires_grad_(True) for t in (q, k, v)]


def _output_and_grads(fn, q, k, v, seed=1):
    out = fn(q, k, v)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return (out, *torch.autograd.grad(out, (q, k, v), g))


def _exact(q, k, v):
    """The reference in float64 (ground truth for the fp32 comparisons)."""
    return reference(q.double(), k.double(), v.double())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(shape):
    q, k, v = _features(*shape)
    got = _output_and_grads(causal_dot_product_cpu, q, k, v)
    want = _output_and_grads(_exact, q, k, v)
    assert got[0].shape == shape[:3] + (shape[4],) and got[0].dtype == torch.float32
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == torch.float32, name
        assert rel_err(a, b) <= 1e-5, name


def test_non_contiguous_inputs():
    b, h, n, f, m = 2, 3, 150, 12, 10
    q = torch.rand(b, n, h, f).transpose(1, 2).requires_grad_(True)  # (B,H,N,F), strided
    k = torch.rand(b, h, f, n).transpose(2, 3).requires_grad_(True)
    v = torch.randn(b, h, n, 2 * m)[..., ::2].detach().requires_grad_(True)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    got = _output_and_grads(causal_dot_product_cpu, q, k, v)
    want = _output_and_grads(_exact, q, k, v)
    for a, b_ in zip(got, want, strict=True):
        assert rel_err(a, b_) <= 1e-5


@pytest.mark.parametrize("shape", [(1, 2, 9, 3, 4), (2, 1, 70, 5, 3)])
def test_gradcheck_float64(shape):
    q, k, v = _features(*shape, dtype=torch.float64)
    assert torch.autograd.gradcheck(causal_dot_product_cpu, (q, k, v))


@pytest.mark.parametrize("shape", [(1, 1, 1500, 16, 24), (1, 2, 1100, 16, 16), (3, 1, 600, 8, 8)])
def test_thread_count_does_not_change_results(shape):
    q, k, v = _features(*shape)
    runs = [
        _output_and_grads(lambda *x, t=t: causal_dot_product_cpu(*x, num_threads=t), q, k, v)
        for t in (1, 2, np.int64(3))  # numpy's ints count too
    ]
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert torch.equal(a, b)


def test_torch_thread_setting_does_not_change_results():
    q, k, v = _features(1, 1, 1200, 8, 8)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _output_and_grads(lambda *x: ks.causal_dot_product(*x, backend="cpu"), q, k, v)
        torch.set_num_threads(2)
        two = _output_and_grads(lambda *x: ks.causal_dot_product(*x, backend="cpu"), q, k, v)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_computed_in_float32(dtype):
    q, k, v = _features(2, 2, 70, 8, 6, dtype=dtype)
    out, dq, dk, dv = _output_and_grads(causal_dot_product_cpu, q, k, v)
    assert out.dtype == torch.float32
    assert dq.dtype == dk.dtype == dv.dtype == dtype
    assert rel_err(out, _exact(q, k, v)) <= 1e-5


def test_empty_sequence_and_no_features():
    q, k, v = _features(2, 1, 0, 4, 3)
    out = causal_dot_product_cpu(q, k, v)
    assert out.shape == (2, 1, 0, 3)
    q, k, v = _features(2, 1, 7, 0, 3)  # F = 0: every score 0 (the kernel is not entered)
    out = causal_dot_product_cpu(q, k, v)
    assert out.shape == (2, 1, 7, 3) and not out.any()
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert dq.shape == q.shape and not dv.any()


@pytest.mark.parametrize("causal", [False, True])
def test_linear_attention_matches_reference(causal):
    q, k, v = _features(2, 3, 130, 16, 12)
    mask = torch.ones(2, 130, dtype=torch.bool)
    mask[1, 100:] = False

    def run(backend):
        def fn(q, k, v):
            if backend == "reference":
                return linear_attention_reference(q, k, v, causal=causal, key_padding_mask=mask)
            return ks.linear_attention(q, k, v, causal=causal, key_padding_mask=mask, backend="cpu")

        return _output_and_grads(fn, q, k, v)

    for a, b in zip(run("cpu"), run("reference"), strict=True):
        assert rel_err(a, b, floor=1e-3) <= 1e-5


def test_registered_and_chosen_automatically(monkeypatch):
    monkeypatch.delenv("KERNELSTUDY_BACKEND", raising=False)
    assert "cpu" in ks.backends()
    x = torch.rand(1, 1, 4, 2)
    assert ks.core.resolve_backend("auto", x).name == "cpu"
    assert ks.core.resolve_backend("auto", x.half()).name == "cpu"
    assert not ks.core.registered_backends()["cpu"].supports(x.to("meta"))


def test_bad_inputs_raise_clear_errors():
    q, k, v = (t.detach() for t in _features(1, 2, 10, 4, 3))
    with pytest.raises(ValueError, match="q is on meta"):
        causal_dot_product_cpu(q.to("meta"), k.to("meta"), v.to("meta"))
    with pytest.raises(ValueError, match="backend='cpu' does not take"):
        ks.causal_dot_product(q.to("meta"), k.to("meta"), v.to("meta"), backend="cpu")
    with pytest.raises(TypeError, match="share one dtype"):
        causal_dot_product_cpu(q, k.double(), v)
    with pytest.raises(ValueError, match="same last dimension"):
        causal_dot_product_cpu(q, k[..., :3], v)
    with pytest.raises(ValueError, match="sequence length"):
        causal_dot_product_cpu(q, k, v[:, :, :5])
    with pytest.raises(ValueError, match="4 dimensions"):
        causal_dot_product_cpu(q[0], k, v)
    with pytest.raises(TypeError, match="v must be a torch.Tensor"):
        causal_dot_product_cpu(q, k, v.numpy())
    with pytest.raises(TypeError, match="floating-point"):
        causal_dot_product_cpu(q.int(), k.int(), v.int())
    with pytest.raises(ValueError, match="num_threads"):
        causal_dot_product_cpu(q, k, v, num_threads=0)


def test_a_state_too_large_to_allocate_is_a_memory_error_not_an_abort():
    """The per-thread buffers were allocated inside the OpenMP region, where an exception
    cannot leave: std::bad_alloc ended the process (terminate, status 134). Here the
    (F, M) state needs 2^50 bytes, beyond any address space, whatever the overcommit.

    The state is allocated first: the chunk buffers (64 rows of F and of M, 4 GiB each here)
    were zeroed before it, so the failing call touched 17 GiB (and spent half a minute)."""
    code = (
        "import resource, torch, kernelstudy as ks\n"
        "q = torch.rand(1, 1, 1, 2**24); v = torch.rand(1, 1, 1, 2**24)\n"
        "try:\n"
        "    ks.causal_dot_product(q, q, v, backend='cpu')\n"
        "except MemoryError as err:\n"
        "    print('MemoryError', err)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"  # KiB on Linux
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert run.returncode == 0 and run.stdout.startswith("MemoryError"), run.stderr[-2000:]
    peak_gib = int(run.stdout.split()[-1]) / 2**20
    assert peak_gib < 2, f"the failing call touched {peak_gib:.1f} GiB"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_rejected():
    q, k, v = (t.detach().cuda() for t in _features(1, 2, 10, 4, 3))
    with pytest.raises(ValueError, match="q is on cuda"):
        causal_dot_product_cpu(q, k, v)


def test_csrc_dir_holds_the_sources():
    assert (extensions.csrc_dir() / "cpu" / "binding.cpp").is_file()


def test_failed_build_returns_none_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setenv(extensions.BUILD_DIR_ENV, str(tmp_path / "build"))
    source = tmp_path / "broken.cpp"
    source.write_text("#error this extension does not compile\n")
    with pytest.warns(RuntimeWarning, match="cannot build the 'kernelstudy_test_broken'.*#error"):
        assert extensions.load_extension("kernelstudy_test_broken", [source]) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # cached: no second build, no second warning
        assert extensions.load_extension("kernelstudy_test_broken", [source]) is None


def test_an_interrupted_build_is_started_again(tmp_path, monkeypatch):
    """A signal to the process group reaches ninja too (a terminal's Ctrl-C, which a training
    step defers; a hang-up under nohup, which Python ignores): its "interrupted by user"
    was taken for a failed build, with a warning and the backend off for the process (an
    interrupted training step ran on the torch backend: the resumed run differed)."""
    monkeypatch.setenv(extensions.BUILD_DIR_ENV, str(tmp_path / "build"))
    source = tmp_path / "fine.cpp"
    source.write_text("// builds\n")
    built, calls = object(), []

    def builder(interruptions):
        class Builder:  # torch's cpp_extension: interrupted, then a success
            @staticmethod
            def load(**kwargs):
                calls.append(kwargs["name"])
                if len(calls) <= interruptions:
                    raise RuntimeError(
                        "Error building extension 'x': [1/2] c++ ...\n"
                        "ninja: build stopped: interrupted by user."
                    )
                return built

        return lambda: Builder

    monkeypatch.setattr(extensions, "cpp_extension", builder(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "cannot build" warning
        assert extensions.load_extension("kernelstudy_test_interrupted", [source]) is built
    assert len(calls) == 2
    calls.clear()  # interrupted at every attempt: a failed build, as before
    monkeypatch.setattr(extensions, "cpp_extension", builder(extensions.BUILD_ATTEMPTS))
    with pytest.warns(RuntimeWarning, match="cannot build .*kernelstudy_test_interrupted_3"):
        assert extensions.load_extension("kernelstudy_test_interrupted_3", [source]) is None
    assert len(calls) == extensions.BUILD_ATTEMPTS


def test_missing_compiler_returns_none(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "kernelstudy-no-such-compiler")
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        assert extensions.load_extension("kernelstudy_test_nocxx", [tmp_path / "x.cpp"]) is None


def test_a_failure_is_cached_when_warnings_are_errors(tmp_path, monkeypatch):
    """Under ``-W error`` the warning raised before the failure was cached: every later
    call built again (``ks.backends()`` raised each time), and an unchanged broken source
    then reported a missing .so instead of its compiler error."""
    monkeypatch.setenv("CXX", "kernelstudy-no-such-compiler")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match="no C\\+\\+ compiler"):
            extensions.load_extension("kernelstudy_test_nocxx_error", [tmp_path / "x.cpp"])
        assert (
            extensions.load_extension("kernelstudy_test_nocxx_error", [tmp_path / "x.cpp"]) is None
        )


def test_a_removed_stale_lock_under_warnings_as_errors_keeps_the_build(tmp_path, monkeypatch):
    """The "removed a stale build lock" note was warned inside the build's try: under
    ``-W error`` it was taken for a failed build, and the backend stayed off for the whole
    process though the build went on to succeed."""
    lock, source = _baton_build(tmp_path, monkeypatch, "kernelstudy_test_lock_error")
    built = object()

    class Builder:  # torch's cpp_extension, its build a success
        @staticmethod
        def load(**kwargs):
            return built

    monkeypatch.setattr(extensions, "cpp_extension", lambda: Builder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match="removed a stale build lock"):
            extensions.load_extension("kernelstudy_test_lock_error", [source])
        assert extensions.load_extension("kernelstudy_test_lock_error", [source]) is built
    assert not lock.exists()


def test_build_names_follow_torch_python_and_the_sources_folder(monkeypatch):
    """ninja does not track torch's headers (system headers): a build named by the CPU only
    was loaded after torch was upgraded in place (or failed with undefined symbols in every
    process, never rebuilt), and two installs sharing one cache rebuilt each other's."""
    name = extensions.build_name("kernelstudy_x", native=True)
    assert name == extensions.build_name("kernelstudy_x", native=True)
    assert name.startswith("kernelstudy_x_") and len(name) == len("kernelstudy_x_") + 8
    assert name != extensions.build_name("kernelstudy_x", native=False)
    assert cpu_backend.extension_name() == extensions.build_name("kernelstudy_cpu", True)
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    upgraded = extensions.build_name("kernelstudy_x", native=True)
    monkeypatch.undo()
    monkeypatch.setattr(extensions, "csrc_dir", lambda: extensions.Path("/elsewhere/csrc"))
    other_install = extensions.build_name("kernelstudy_x", native=True)
    assert len({name, upgraded, other_install}) == 3


@pytest.mark.parametrize(
    "needs", [(True, False, False), (False, True, False), (False, False, True)]
)
def test_some_gradients(needs):
    features = _features(2, 2, 90, 6, 5)
    q, k, v = (t.detach().requires_grad_(need) for t, need in zip(features, needs, strict=True))
    g = torch.randn(2, 2, 90, 5)
    wanted = [t for t in (q, k, v) if t.requires_grad]
    got = torch.autograd.grad(causal_dot_product_cpu(q, k, v), wanted, g)
    want = torch.autograd.grad(_exact(q, k, v), wanted, g.double())
    assert rel_err(got[0], want[0]) <= 1e-5


@pytest.mark.parametrize("baton", [True, False], ids=["file_baton", "flock"])
def test_stale_build_lock_is_removed(tmp_path, monkeypatch, baton):
    """A build killed midway leaves torch's lock file (FileBaton); it must not block later
    builds forever. Where torch locks with flock the file stays after every build and is no
    sign of a dead one: removing it let a second build run beside a live one."""
    if not baton and extensions._lock_is_a_baton():
        pytest.skip("this torch locks builds with FileBaton: a kept lock would block the build")
    monkeypatch.setattr(extensions, "_lock_is_a_baton", lambda: baton)
    monkeypatch.setattr(extensions, "_LOADED", {})  # each case builds afresh
    monkeypatch.setenv(extensions.BUILD_DIR_ENV, str(tmp_path / "build"))
    lock = tmp_path / "build" / "kernelstudy_test_lock" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (0, 0))
    source = tmp_path / "broken.cpp"
    source.write_text("#error this extension does not compile\n")
    with pytest.warns(RuntimeWarning) as record:
        assert extensions.load_extension("kernelstudy_test_lock", [source]) is None
    messages = [str(w.message) for w in record]
    assert any("stale build lock" in m for m in messages) == baton
    assert any("does not compile" in m for m in messages)  # the compiler's error line
    if not baton:
        assert os.stat(lock).st_mtime == 0  # the old file, not removed and made anew


def _baton_build(tmp_path, monkeypatch, name):
    """A FileBaton torch (simulated), a fresh build directory and a source that fails fast;
    returns the lock file of torch's build and the source."""
    monkeypatch.setattr(extensions, "_lock_is_a_baton", lambda: True)
    monkeypatch.setattr(extensions, "_LOADED", {})
    monkeypatch.setenv(extensions.BUILD_DIR_ENV, str(tmp_path / "build"))
    lock = tmp_path / "build" / name / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()  # fresh: the build that left it was killed a moment ago
    source = tmp_path / "broken.cpp"
    source.write_text("#error this extension does not compile\n")
    return lock, source


@pytest.mark.skipif(os.name != "posix", reason="kernelstudy's build lock needs flock")
def test_fresh_baton_lock_of_a_killed_build_is_removed(tmp_path, monkeypatch):
    """Where torch's lock is a FileBaton, a build killed (SIGKILL, OOM, a job's time limit)
    leaves the file and torch waits while it exists. Removing it only when older than
    STALE_LOCK_SECONDS left a job restarted soon after the kill waiting forever; under
    kernelstudy's own OS lock no live build can own it, so it goes at once."""
    lock, source = _baton_build(tmp_path, monkeypatch, "kernelstudy_test_fresh")
    with pytest.warns(RuntimeWarning) as record:
        assert extensions.load_extension("kernelstudy_test_fresh", [source]) is None
    messages = [str(w.message) for w in record]
    assert any("stale build lock" in m for m in messages)
    assert any("does not compile" in m for m in messages)


@pytest.mark.skipif(os.name != "posix", reason="kernelstudy's build lock needs flock")
def test_build_waits_for_a_live_build_and_keeps_its_lock(tmp_path, monkeypatch):
    """While another builder holds kernelstudy's lock (a live build), its baton stays and
    the second load waits for it instead of building beside it."""
    lock, source = _baton_build(tmp_path, monkeypatch, "kernelstudy_test_live")
    done = threading.Event()

    def second_process():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            extensions.load_extension("kernelstudy_test_live", [source])
        done.set()

    with extensions._build_lock(str(lock.parent)) as held:
        assert held
        thread = threading.Thread(target=second_process)
        thread.start()
        thread.join(timeout=1.0)
        assert not done.is_set() and lock.exists()  # waiting, the live build's lock kept
    thread.join()
    assert done.is_set()


# A CUDA build of torch without a usable GPU (this CPU build of torch stands in for one),
# with a CUDA toolkit ($CUDA_HOME): torch.utils.cpp_extension gives its line at import.
_AS_CUDA_TORCH_WITHOUT_A_GPU = """
import importlib, sys
import torch
torch.cuda._is_compiled = lambda: True
torch.cuda.is_available = lambda: False
torch.version.cuda = "12.8"
import kernelstudy as ks
x = torch.rand(2, 1, 70, 4, dtype=torch.float64)
got = ks.causal_dot_product(x, x, x, backend="cpu")
assert "cpu" in ks.backends(), ks.backends()
assert torch.allclose(got, ks.causal_dot_product(x, x, x, backend="reference"))
print("LOADED", file=sys.stderr, flush=True)
importlib.reload(sys.modules["torch.utils.cpp_extension"])  # its import, not kernelstudy's
"""


def test_cpu_backend_loads_without_the_no_cuda_runtime_line(tmp_path):
    """A CUDA build of torch on a machine with nvcc (or $CUDA_HOME) but no GPU logs "No CUDA
    runtime is found, using CUDA_HOME=..." when torch.utils.cpp_extension is imported: loading
    the CPU extension, which uses no CUDA, printed it. The extension still loads; torch's own
    import of that module, outside kernelstudy's, still gives the line."""
    name = cpu_backend.extension_name()
    built = extensions._build_directory(name) or extensions._torch_build_directory(name)
    env = {**os.environ, "CUDA_HOME": str(tmp_path)}
    if built is not None:  # the build this module made: only loaded (torch's default
        env[extensions.BUILD_DIR_ENV] = os.path.dirname(built)  # folder names the CUDA version)
    run = subprocess.run(
        [sys.executable, "-c", _AS_CUDA_TORCH_WITHOUT_A_GPU],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    before, loaded, after = run.stderr.partition("LOADED")
    assert loaded and "No CUDA runtime" not in before + run.stdout, before
    assert f"No CUDA runtime is found, using CUDA_HOME='{tmp_path}'" in after


def test_only_the_no_cuda_runtime_line_is_dropped():
    """The record is dropped from torch's cpp_extension logger; every other record passes,
    and after the block the line does too."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    records: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: records.append(record.getMessage())
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False  # its records to records only
    line = "No CUDA runtime is found, using CUDA_HOME='%s'"
    try:
        for quiet in (True, False):
            with extensions._without_no_cuda_runtime_line() if quiet else contextlib.nullcontext():
                logger.warning(line, "/usr/local/cuda")
                logger.warning("Error checking compiler version for %s", "c++")
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
    assert records[:1] == ["Error checking compiler version for c++"]
    assert records[1:] == [line % "/usr/local/cuda", "Error checking compiler version for c++"]


def test_cpu_backend_loads_with_stdout_or_stderr_closed():
    """Started with stdout closed (``>&-``: Python's ``sys.stdout`` is None), every load of the
    extension failed in torch's flush of it ("build failed: 'NoneType' object has no attribute
    'flush'") and the 'cpu' backend was gone, with a warning naming that error
    (``benchmarks/core.py >&-`` wrote no cpu rows). Now it loads with either stream closed."""
    name = cpu_backend.extension_name()
    built = extensions._build_directory(name) or extensions._torch_build_directory(name)
    env = dict(os.environ)
    if built is not None:  # this session's build: only loaded
        env[extensions.BUILD_DIR_ENV] = os.path.dirname(built)
    for closed, report in ((1, 2), (2, 1)):
        code = (
            "import os, warnings, kernelstudy as ks\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    names = ks.backends()\n"
            f"os.write({report}, repr((names, [str(w.message) for w in caught])).encode())"
        )
        run = subprocess.run(
            [sys.executable, "-c", code],
            preexec_fn=lambda fd=closed: os.close(fd),
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert run.returncode == 0, (closed, run.stdout, run.stderr)
        names, caught = ast.literal_eval(run.stderr if report == 2 else run.stdout)
        assert "cpu" in names and caught == [], (closed, caught)
