"""Files written atomically (readers never see a half-written one), the CSV tables so
written read back, and a lock that keeps two writers out of one folder."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
import secrets
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd


try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the lock below does nothing there
    fcntl = None  # type: ignore[assignment]


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> Path:
    """Write ``path`` through ``write(file)`` into a temp file in the same folder, then
    ``os.replace`` it: readers see the old file or the new one, never a partial one. The
    file gets the permissions ``open`` would give it (an existing file's, else 0o666 less
    the umask), not the temp file's 0o600. A symlink is written through (its target gets
    the new content; the link stays), and the folder is synced after the rename, so the new
    file survives a crash once this returns. The temp file is locked while written
    (:func:`lock_while_written`): one whose writer was killed is told apart by
    :func:`remove_abandoned_files`."""
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    # the name cut to 200 characters: the temp name adds 22, and names stop at 255
    fd, tmp = new_temporary_file(path.parent, f".{path.name[:200]}.", ".tmp")
    held = lock_while_written(fd)
    try:
        with naming_the_file(path), os.fdopen(fd, "wb") as f:
            if path.exists():
                mode = path.stat().st_mode & 0o7777
                if hasattr(os, "fchmod"):
                    os.fchmod(f.fileno(), mode)
                else:  # Windows before Python 3.13
                    os.chmod(tmp, mode)
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        release_lock(held)
    sync_folder(path.parent)
    return path


def sync_folder(folder: Path) -> None:
    """fsync ``folder``, so that a rename in it is on disk (a no-op where folders cannot
    be opened or synced, as on Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def new_temporary_file(folder: str | os.PathLike, prefix: str, suffix: str) -> tuple[int, Path]:
    """A new file ``folder/<prefix><random><suffix>`` opened for writing: ``(fd, path)``.
    Made with mode 0o666 less the umask, as ``open`` makes files (mkstemp's are 0o600, and
    reading the umask means setting it, which races with other threads)."""
    for _ in range(100):
        path = Path(folder) / f"{prefix}{secrets.token_hex(8)}{suffix}"
        try:
            # O_BINARY: Windows opens a descriptor in text mode, "\n" written as "\r\n"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
            return os.open(path, flags, 0o666), path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name {prefix}*{suffix} in {folder}")


def output_file_problem(path: str | os.PathLike) -> str | None:
    """Why :func:`atomic_write` could not make ``path``, for a check before a long run rather
    than a traceback after it: ``path`` is a folder, a part of its folder's path is a file,
    or that folder (or, where it is still to be made, its nearest existing parent) takes no
    new file (a probe file made and removed). None where it can."""
    path = Path(path)
    if path.is_dir():
        return "is a folder; give a file path"
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a folder"
    try:
        # not named as a temporary file: a run cleaning the folder would delete it meanwhile
        fd, probe = new_temporary_file(existing, ".kernelstudy_probe.", ".probe")
        os.close(fd)
        probe.unlink(missing_ok=True)
    except OSError as err:
        return f"cannot write in {existing} ({err.strerror or err})"
    return None


@contextlib.contextmanager
def naming_the_file(path: str | os.PathLike) -> Iterator[None]:
    """Name ``path`` in an OSError of the block that names no file: a full disk or a file
    size limit said only "[Errno 28] No space left on device" (also behind torch.save's
    RuntimeError "unexpected pos", whose cause it is)."""
    try:
        yield
    except BaseException as err:
        cause = err.__context__ if isinstance(err, RuntimeError) else err
        if isinstance(cause, OSError) and cause.filename is None and cause.errno is not None:
            if cause is err:
                err.filename = str(path)
                raise
            raise OSError(cause.errno, cause.strerror, str(path)) from err
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    # surrogateescape: a path Python decoded from undecodable bytes (a non-UTF-8 locale)
    # goes back as those bytes, where strict UTF-8 refused it after a study's whole run
    return atomic_write(path, lambda f: f.write(text.encode("utf-8", "surrogateescape")))


def read_csv_table(
    path: str | os.PathLike, text_columns: Sequence[str] = ()
) -> pd.DataFrame | None:
    """A results table written by this package: None when the file is missing or empty
    (0 bytes: no rows); ValueError naming the file when it is not a readable CSV.
    ``text_columns`` are read verbatim as str (a label "256" stays "256", "NA" stays "NA")."""
    import pandas as pd  # here: the tasks layer uses this module's writers without pandas

    path = Path(path)
    # Read once and parsed twice: two reads of a file that a writer replaced in between
    # paired one version's config ids with the other's rows.
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except IsADirectoryError:  # not "no rows": a run would compute, then fail to replace it
        raise ValueError(f"{path} is a folder, not a CSV table; move it away") from None
    if not data:
        return None
    try:
        # low_memory=False: a column empty in the first rows and text later (spectra.csv's
        # captured_with) gets one dtype, without pandas' mixed-types warning
        # pandas < 3's default float parser stops near 17 digits: about one value in three
        # read back changed (1.7e-13), and a resumed study rewrote its stored values;
        # pandas 3 reads them exactly (and deprecates the option)
        exact = {"float_precision": "round_trip"} if pd.__version__.startswith("2.") else {}
        table = pd.read_csv(io.BytesIO(data), low_memory=False, **exact)
        _check_row_lengths(path, data)
        for name in (c for c in text_columns if c in table):
            verbatim = pd.read_csv(
                io.BytesIO(data), usecols=[name], dtype=str, keep_default_na=False
            )
            table[name] = verbatim[name]
        return table
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"{path} is not a readable CSV table ({first}); move it away to start afresh"
        ) from err


def _check_row_lengths(path: Path, data: bytes) -> None:
    """ValueError naming the line of a row with fewer fields than the header: pandas reads
    a row cut short (a damaged or hand-edited file) as a whole one with NaN cells, and a
    resumed study took the configuration for done."""
    reader = csv.reader(io.StringIO(data.decode("utf-8-sig"), newline=""))
    try:
        header = next(reader, [])
        for row in reader:
            if row and len(row) < len(header):
                raise ValueError(
                    f"{path} is not a readable CSV table (line {reader.line_num} has "
                    f"{len(row)} fields, the header {len(header)}: cut short?); "
                    "move it away to start afresh"
                )
    except csv.Error:  # a field beyond the csv module's (process-wide) size limit, which
        return  # pandas read: the table is taken as pandas read it, unchecked


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` as indented JSON atomically (non-JSON values become strings)."""
    return atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")


class FolderBusy(ValueError):
    """Another process holds the lock of a folder (see :func:`exclusive_folder`)."""


#: The temporary files of :func:`atomic_write`: ``.<name>.<16 hex digits>.tmp``.
_TEMPORARY = re.compile(r"\..+\.[0-9a-f]{16}\.tmp")


def remove_stale_temporary_files(folder: str | os.PathLike) -> list[Path]:
    """Delete the temporary files that writers killed mid-write (SIGKILL skips their
    clean-up) left in ``folder``, and return them. Only for a folder whose every writer
    holds its :func:`exclusive_folder` lock, called with the lock held: another writer's
    file in progress would go too."""
    removed = []
    for path in Path(folder).glob(".*.tmp"):
        if _TEMPORARY.fullmatch(path.name) and path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def lock_while_written(fd: int) -> int | None:
    """Lock the open file ``fd`` (advisory) as being written, so that
    :func:`remove_abandoned_files` leaves it alone, and return a duplicate descriptor that
    holds the lock until :func:`release_lock` closes it (or its process dies), also after
    ``fd`` is closed. None where there are no locks (Windows: an open descriptor would keep
    the file from being renamed or deleted there)."""
    if fcntl is None:
        return None
    held = os.dup(fd)
    with contextlib.suppress(OSError):  # a file system without locks
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return held


def release_lock(held: int | None) -> None:
    """Close a descriptor :func:`lock_while_written` returned (None: nothing to close)."""
    if held is not None:
        os.close(held)


def remove_abandoned_files(
    folder: str | os.PathLike, pattern: str, min_age_s: float = 60.0
) -> list[Path]:
    """Delete the files matching ``pattern`` in ``folder`` whose writer is gone (killed by
    SIGKILL mid-write: nothing holds their :func:`lock_while_written` lock), and return
    them; an empty one only once unchanged for ``min_age_s`` seconds (a file just made may not
    be locked yet: its writer locks it before the first byte). For
    folders without one lock over all writers; nothing is deleted where files cannot be
    locked."""
    if fcntl is None:
        return []
    removed = []
    now = time.time()
    for path in Path(folder).glob(pattern):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # gone meanwhile, or not ours to read
            continue
        try:
            info = os.fstat(fd)
            if info.st_size == 0 and now - info.st_mtime < min_age_s:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live writer holds it (or no locks here)
            continue
        finally:
            os.close(fd)
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _lock_file(path: Path) -> IO[bytes]:
    """``path`` opened to be locked: made where missing; read-only where it is another user's
    (a shared folder, their umask): ``flock`` needs no write access."""
    try:
        return open(path, "a+b")
    except PermissionError:
        if not path.is_file():
            raise
        return open(path, "rb")


def _lock_soon(fd: int, wait: float = 0.25) -> None:
    """``flock`` ``fd`` exclusively, trying for ``wait`` seconds (a reader's probe of
    :func:`folder_in_use` holds it for an instant); BlockingIOError if still held."""
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


def folder_in_use(folder: str | os.PathLike) -> bool:
    """Whether a process holds ``folder``'s :func:`exclusive_folder` lock now (False where
    there is no lock file or the file system has no locks)."""
    if fcntl is None:
        return False
    try:
        handle = open(Path(folder) / ".lock", "rb")
    except OSError:
        return False
    with handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        return False


@contextlib.contextmanager
def exclusive_folder(folder: str | os.PathLike, what: str, clean: bool = False) -> Iterator[None]:
    """Hold an advisory lock on ``folder`` (a ``.lock`` file in it) for the block, or raise
    :class:`FolderBusy` at once if another process holds it: two runs that each rewrite
    a whole table there from their own copy would drop each other's rows. ``what`` names
    the work in the message. The lock goes with the process (also when it is killed).
    ``clean``: the folder's writers all take the lock, so temporary files there are left by
    killed ones and are deleted once it is held (:func:`remove_stale_temporary_files`)."""
    path = Path(folder) / ".lock"
    problem = output_file_problem(path)  # a read-only folder: before hours of work, not after
    if problem is not None:
        raise ValueError(f"{folder} cannot hold {what}'s files: {problem}; give another --out")
    if fcntl is None:
        warnings.warn(
            f"no file locks on this system (no fcntl): nothing keeps a second run out of {folder}",
            RuntimeWarning,
            stacklevel=3,
        )
        yield
        return
    with _lock_file(path) as handle:
        try:
            _lock_soon(handle.fileno())
        except BlockingIOError:
            raise FolderBusy(  # the holder's work is not known here: another study, say
                f"cannot run {what} in {folder}: another process is at work there (it holds "
                f"{path}); wait for it to end, or give another --out"
            ) from None
        except OSError as err:  # a file system without locks (some network mounts)
            warnings.warn(
                f"cannot lock {path} ({err.strerror}): nothing keeps a second run out of {folder}",
                RuntimeWarning,
                stacklevel=3,
            )
            yield
            return
        try:
            if clean:
                remove_stale_temporary_files(folder)
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
