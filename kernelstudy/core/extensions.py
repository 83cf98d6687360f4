"""Builds the compiled kernels of ``csrc/`` on first use (shared by the CPU and CUDA backends).

Extensions are compiled with :func:`torch.utils.cpp_extension.load` (ninja) the first time a
backend needs them and cached on disk, in the default torch extensions directory or under
``$KERNELSTUDY_BUILD_DIR`` if set; later runs only check that the build is up to date. Nothing
is compiled at install time. If the compiler is missing or the build fails,
:func:`load_extension` returns None after one warning, and the core falls back to the ``torch``
backend.

torch's ``cpp_extension`` is imported through :func:`cpp_extension`, which drops the "No CUDA
runtime is found, using CUDA_HOME=..." line that a CUDA build of torch gives at that import on
a machine with a CUDA toolkit but no usable GPU (the CPU extension uses no CUDA).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BUILD_DIR_ENV = "KERNELSTUDY_BUILD_DIR"
STALE_LOCK_SECONDS = 600  # a build lock this old was left by a killed build

_LOADED: dict[str, ModuleType | None] = {}
# The record torch's cpp_extension logs at its import (``_find_cuda_home``) when torch has
# CUDA but no device is usable.
_CPP_EXTENSION_LOGGER = "torch.utils.cpp_extension"
_NO_CUDA_RUNTIME = "No CUDA runtime is found"


class _DropNoCudaRuntime(logging.Filter):
    """Drops torch's "No CUDA runtime is found, using CUDA_HOME=..." record, passes the rest."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_NO_CUDA_RUNTIME)


@contextlib.contextmanager
def _without_no_cuda_runtime_line() -> Iterator[None]:
    """Within the block, the cpp_extension logger drops the "No CUDA runtime is found" record
    and nothing else (torch releases before about 2.8 printed it instead: it shows there)."""
    logger = logging.getLogger(_CPP_EXTENSION_LOGGER)
    drop = _DropNoCudaRuntime()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def cpp_extension() -> ModuleType:
    """``torch.utils.cpp_extension``, imported without its "No CUDA runtime is found, using
    CUDA_HOME=..." line. A CUDA build of torch gives that line at the import on a machine with
    a CUDA toolkit (nvcc on PATH, /usr/local/cuda, ``$CUDA_HOME``) but no usable GPU, where
    kernelstudy builds only the CPU extension, which uses no CUDA; with a GPU it never appears.
    Every other message of the import stays."""
    with _without_no_cuda_runtime_line():
        from torch.utils import cpp_extension as module
    return module


def csrc_dir() -> Path:
    """The ``csrc/`` folder of the kernels' sources.

    It sits at the repository root next to ``kernelstudy/`` (source checkouts, editable
    installs); an installed package carries a copy as ``kernelstudy/_csrc``.
    """
    package = Path(__file__).resolve().parents[1]
    candidates = [package / "_csrc", package.parent / "csrc"]
    for candidate in candidates:  # a folder only named csrc beside the package is not ours
        if (candidate / "cpu" / "binding.cpp").is_file():
            return candidate
    raise FileNotFoundError(
        "kernelstudy: cannot find the csrc/ kernel sources; looked in "
        + ", ".join(str(c) for c in candidates)
    )


def native_cflags() -> list[str]:
    """Optimization flags for host code: -O3, and the host's vector units on x86-64.

    Code built with these runs only on CPUs like this one: name such extensions with
    :func:`build_name` (``native=True``) so that a build cache shared between machines never
    loads it elsewhere.
    """
    flags = ["-O3"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags.append("-march=native")
    return flags


def host_tag() -> str:
    """A short hash of this CPU's model and instruction-set flags (e.g. ``"3f2a91c0"``)."""
    text = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        text += "".join(x for x in lines if x.startswith(("model name", "flags")))[:4096]
    except OSError:
        pass
    return hashlib.sha1(text.encode()).hexdigest()[:8]


def build_name(base: str, native: bool) -> str:
    """``base`` and a short hash of what its build depends on that ninja does not track:
    torch's version, commit and CUDA version (its headers come in as system headers, which
    ninja's dependency files leave out: after an upgrade in place the old build was loaded,
    or failed with undefined symbols in every process), Python's version, the sources'
    folder (two installs sharing one cache rebuilt each other's build at every switch),
    and with ``native`` this CPU (:func:`host_tag`; code built with :func:`native_cflags`
    runs only on CPUs like it). E.g. ``"kernelstudy_cpu_3f2a91c0"``."""
    import torch

    parts = [
        torch.__version__,
        str(getattr(torch.version, "git_version", "")),
        str(torch.version.cuda),
        platform.python_version(),
        str(csrc_dir()),
        host_tag() if native else "",
    ]
    return f"{base}_{hashlib.sha1(chr(0).join(parts).encode()).hexdigest()[:8]}"


def _build_directory(name: str) -> str | None:
    root = os.environ.get(BUILD_DIR_ENV)
    if not root:
        return None  # torch's default: $TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions/...
    path = Path(root).expanduser() / name
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def _lock_is_a_baton() -> bool:
    """Whether torch's build lock is a file that exists only while a build runs (FileBaton)."""
    return hasattr(cpp_extension(), "FileBaton")


def _torch_build_directory(name: str) -> str | None:
    """Where torch builds ``name`` when no build directory is given (None if unknown)."""
    try:
        return cpp_extension()._get_build_directory(name, verbose=False)
    except Exception:  # private torch API: no directory if it changed
        return None


@contextlib.contextmanager
def _build_lock(build_directory: str | None) -> Iterator[bool]:
    """Hold an OS lock (flock) on ``<build_directory>/kernelstudy.lock`` while this process
    builds or loads an extension; yields whether it is held. The OS releases it when its
    holder dies, so it is never stale; while it is held, no other kernelstudy process is
    inside torch's build of that directory (no lock where flock is missing, e.g. Windows;
    the ninja of a process killed by ``kill -9`` outlives it, without the lock)."""
    try:
        import fcntl
    except ImportError:
        fcntl = None
    f = None
    if fcntl is not None and build_directory is not None:
        try:
            f = open(Path(build_directory) / "kernelstudy.lock", "a")  # noqa: SIM115
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        except BaseException as err:
            if f is not None:
                f.close()
            f = None
            if not isinstance(err, OSError):  # Ctrl-C while waiting
                raise
            # OSError: a read-only cache, a file system without locks: build unlocked
    if f is None:
        yield False
        return
    try:
        yield True
    finally:
        f.close()  # closing the file releases its lock


def _remove_stale_lock(build_directory: str | None, exclusive: bool = False) -> str | None:
    """Delete the build lock of a killed build (torch would otherwise wait on it forever).

    Only for torch versions whose lock is a file that exists while a build runs (FileBaton).
    With ``exclusive`` (this process holds :func:`_build_lock`, so no other kernelstudy
    process is building this directory; a compiler that a ``kill -9`` of its python did not
    reach may still run to its end beside this build) any such file was left by a killed
    build and goes at once:
    an age rule alone left a process started soon after the kill waiting forever. Without
    it, only a file older than :data:`STALE_LOCK_SECONDS` goes.
    Newer torch versions take an OS lock (flock) on a file that stays after the build, so
    its age says nothing and removing it would let a second build run beside a live one;
    the OS releases that lock when its holder dies, so it is never stale.

    Returns the message to warn with once the build is over, or None (warned here, under
    warnings as errors it was taken for a failed build, and the backend stayed off)."""
    if build_directory is None or not _lock_is_a_baton():
        return None
    lock = Path(build_directory) / "lock"
    try:
        if exclusive or time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            lock.unlink()
            return f"kernelstudy: removed a stale build lock {lock}"
    except OSError:
        pass  # no lock (the usual case), or someone else removed it
    return None


@contextlib.contextmanager
def _closed_output_as_devnull() -> Iterator[None]:
    """Within the block, a closed stdout or stderr (None: started with ``>&-``, ``pythonw``)
    is /dev/null: torch's build flushes stdout on every load, even a cached one, which raised
    AttributeError there, and the compiled backends fell back to 'torch' with a warning that
    named that error."""
    closed = [name for name in ("stdout", "stderr") if getattr(sys, name) is None]
    with contextlib.ExitStack() as stack:
        for name in closed:
            setattr(sys, name, stack.enter_context(open(os.devnull, "w")))  # noqa: SIM115
        try:
            yield
        finally:
            for name in closed:
                setattr(sys, name, None)


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """Within the block, ``PATH`` also holds the ``ninja`` package's program when no ninja is on
    ``PATH`` (a virtual environment's python run without activating it: cron, IDEs, Jupyter
    kernels), where torch's build looks for it."""
    try:
        import ninja

        folder = None if shutil.which("ninja") else ninja.BIN_DIR
    except (ImportError, AttributeError):  # not installed: torch's message says to install it
        folder = None
    if folder is None:
        yield
        return
    path = os.environ.get("PATH")
    os.environ["PATH"] = folder + os.pathsep + (path or "")
    try:
        yield
    finally:
        if path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = path


def _missing_tool(cuda: bool) -> str | None:
    """Why the build cannot start, or None."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not on PATH; set CXX)"
    if cuda:
        import torch

        if torch.version.cuda is None:
            return "this PyTorch build has no CUDA"
        if cpp_extension().CUDA_HOME is None:
            return "no CUDA toolkit (nvcc) found; set CUDA_HOME"
    return None


def _first_error(err: Exception) -> str:
    """The compiler's first ``error:`` line of a failed build, else the exception's first line."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    message = (errors or lines or [type(err).__name__])[0]
    return message[:300]


#: Builds of one extension a call tries when ninja was interrupted (:func:`_interrupted`).
BUILD_ATTEMPTS = 3


def _interrupted(err: BaseException) -> bool:
    """Whether a build failed because ninja was stopped by a signal to the process group
    (a terminal's Ctrl-C, a hang-up under ``nohup``, a scheduler's SIGTERM). Python had
    deferred or ignored it (else it would have raised here itself: a training step ends
    first and saves its checkpoint, a ``nohup`` job goes on): the build is started again,
    rather than given up for the process (the step ran on the torch backend, so a resumed
    run differed from an uninterrupted one)."""
    return "interrupted by user" in str(err)


def _warn(name: str, reason: str) -> None:
    warnings.warn(
        f"kernelstudy: cannot build the {name!r} extension ({reason}); "
        "falling back to the 'torch' backend",
        RuntimeWarning,
        stacklevel=3,
    )


def load_extension(
    name: str,
    sources: list[Path],
    *,
    cuda: bool = False,
    extra_cflags: list[str] | None = None,
    extra_cuda_cflags: list[str] | None = None,
    extra_ldflags: list[str] | None = None,
) -> ModuleType | None:
    """Build (or load the cached build of) an extension module; None if it cannot be built.

    Args:
        name: module name, unique per extension (e.g. ``"kernelstudy_cpu"``).
        sources: ``.cpp`` (and, with ``cuda``, ``.cu``) files, usually under :func:`csrc_dir`.
        cuda: compile ``.cu`` files with nvcc and link the CUDA runtime.
        extra_cflags, extra_cuda_cflags, extra_ldflags: passed on to the compilers and linker.

    The result is cached per process: a failed build is not retried and warns once. A build
    a signal interrupted (Python deferring or ignoring it) is started again, up to
    :data:`BUILD_ATTEMPTS` times.
    """
    if name in _LOADED:
        return _LOADED[name]
    module: ModuleType | None = None
    removed_lock = None
    reason = _missing_tool(cuda)
    if reason is None:
        try:
            build_directory = _build_directory(name)
            directory = build_directory or _torch_build_directory(name)
            with (
                _build_lock(directory) as exclusive,
                _ninja_on_path(),
                _closed_output_as_devnull(),
            ):
                removed_lock = _remove_stale_lock(directory, exclusive)
                for attempt in range(1, BUILD_ATTEMPTS + 1):
                    try:
                        module = cpp_extension().load(
                            name=name,
                            sources=[str(s) for s in sources],
                            extra_cflags=list(extra_cflags or []),
                            extra_cuda_cflags=list(extra_cuda_cflags or []),
                            extra_ldflags=list(extra_ldflags or []),
                            extra_include_paths=[str(csrc_dir())],
                            build_directory=build_directory,
                            with_cuda=cuda,
                            verbose=False,
                        )
                        break
                    except Exception as err:
                        if not _interrupted(err) or attempt == BUILD_ATTEMPTS:
                            raise
        except Exception as err:  # compiler errors, missing headers, import errors
            reason = f"build failed: {_first_error(err)}"
    _LOADED[name] = module  # first: with warnings as errors _warn raises, and every call
    if removed_lock is not None:  # then built again (or, unchanged, reported a wrong cause)
        warnings.warn(removed_lock, RuntimeWarning, stacklevel=2)
    if module is None:
        _warn(name, reason or "unknown error")
    return module
