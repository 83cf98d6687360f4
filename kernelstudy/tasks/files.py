"""Finding the user's data files and reporting what is wrong with them, by file and line."""

from __future__ import annotations

import contextlib
import csv
import sys
from collections.abc import Iterator, Sequence
from os import PathLike
from pathlib import Path

PathArg = str | PathLike[str]


def data_error(path: PathArg, message: str, line: int | None = None) -> ValueError:
    """A ValueError reading ``<path>, line <n>: <message>``."""
    where = f"{path}, line {line}" if line is not None else f"{path}"
    return ValueError(f"{where}: {message}")


def decode_error(path: PathArg, err: UnicodeDecodeError, hint: str = "") -> ValueError:
    """A :func:`data_error` for text that is not UTF-8, at the first line that fails to decode.

    ``err`` comes from a buffered text read, whose offsets are not the file's, so the
    file is scanned again in binary to find the line.
    """
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as bad:
                message = f"not UTF-8 text (byte {raw[bad.start]:#04x} at column {bad.start + 1})"
                return data_error(path, message + hint, line_no)
    return data_error(path, f"not UTF-8 text ({err.reason}){hint}")


def check_path(name: str, value: object) -> Path:
    """``value`` as a Path if it is a str or os.PathLike, else TypeError naming ``name``
    (``open`` would take an int for a file descriptor, and read or close that); an empty
    string (an unset variable) is a ValueError, not the current directory."""
    if not isinstance(value, str | PathLike):
        raise TypeError(f"{name} must be a path (str or os.PathLike), got {value!r}")
    if not str(value):
        raise ValueError(f"{name} must not be empty")
    return Path(value)


def require_dir(path: PathArg, what: str = "data directory") -> Path:
    """``path`` as a Path if it is a directory, else FileNotFoundError (NotADirectoryError
    for a file)."""
    p = Path(path)
    if not p.is_dir():
        if p.exists():
            raise NotADirectoryError(f"{what} is a file, not a directory: {p}")
        raise FileNotFoundError(f"{what} not found: {p}")
    return p


# Where a folder of the LRA release (``listops-1000``, ``tsv_data``, ``pathfinder32``) lies below
# the path a user gives: the folder itself, or inside ``lra_release/``. The published archive
# (``lra_release.gz``) unpacks to ``lra_release/lra_release/<folder>``, so the directory it was
# unpacked in holds the folder two levels down and the outer ``lra_release/`` one level down.
RELEASE_PREFIXES = ("", "lra_release/", "lra_release/lra_release/")


def release_candidates(folder: str, name: str) -> list[str]:
    """Relative paths of ``folder/name`` in the LRA release, nearest first (see
    ``RELEASE_PREFIXES``)."""
    return [f"{prefix}{folder}/{name}" for prefix in RELEASE_PREFIXES]


def locate(root: PathArg, candidates: Sequence[str], what: str) -> Path:
    """The first of ``root/c`` (c in ``candidates``) that exists, else FileNotFoundError
    (NotADirectoryError if ``root`` is a file)."""
    base = Path(root)
    if not base.exists():
        raise FileNotFoundError(f"{what}: {base} does not exist")
    if not base.is_dir():
        raise NotADirectoryError(f"{what}: {base} is a file; pass the directory that holds it")
    for candidate in candidates:
        p = base / candidate
        if p.exists():
            return p
    tried = ", ".join(str(base / c) for c in candidates)
    raise FileNotFoundError(f"{what} not found; looked for {tried}")


def parse_label(
    text: str, path: PathArg, line: int, num_classes: int, allow_float: bool = False
) -> int:
    """The class index written as ``text`` (``"1"``; ``"1.0"`` if ``allow_float``), in range."""
    value: int | None = None
    token = text.strip()
    if token.isascii() and token.isdigit():  # not int()'s "１", "٣" or "1_0"
        value = int(token)
    elif token.isascii() and "_" not in token:
        if allow_float:
            try:
                number = float(token)
            except ValueError:
                number = float("nan")
            if number.is_integer():
                value = int(number)
    if value is None or not 0 <= value < num_classes:
        raise data_error(path, f"bad label {text!r} (expected an int in [0, {num_classes}))", line)
    return value


@contextlib.contextmanager
def _large_csv_fields() -> Iterator[None]:
    old = csv.field_size_limit()
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    try:
        yield
    finally:
        csv.field_size_limit(old)


def read_table(
    path: PathArg, delimiter: str, quoted: bool = True
) -> Iterator[tuple[int, list[str]]]:
    """Rows of a CSV/TSV file as ``(line number, fields)``: with csv-module quoting
    (``quoted``), or one row per line split at ``delimiter`` with quotes as text (LRA's TSVs).

    The line number is that of the row's first line. Blank rows are skipped.
    """
    quoting = csv.QUOTE_MINIMAL if quoted else csv.QUOTE_NONE
    # utf-8-sig: a byte-order mark (spreadsheet exports) is not part of the first field
    with open(path, encoding="utf-8-sig", newline="") as f, _large_csv_fields():
        reader = csv.reader(f, delimiter=delimiter, quoting=quoting)
        start = 1
        try:
            for row in reader:
                if row:
                    yield start, row
                start = reader.line_num + 1
        except UnicodeDecodeError as err:
            raise decode_error(path, err) from None
        except csv.Error as err:
            raise data_error(path, f"unreadable row ({err})", start) from err
