"""Progress bars: tqdm's notebook widget where ipywidgets is installed, else the text bar.

``tqdm.auto`` chooses the widget bar in every Jupyter kernel; without ipywidgets it
warns "IProgress not found. Please update jupyter and ipywidgets." and falls back to
the text bar. The package's modules import ``tqdm`` from here instead, which asks for
the widget bar (through ``tqdm.auto``) only when ipywidgets can be imported, so a
notebook without ipywidgets gets the text bar and no warning. Outside Jupyter both
choices give the text bar.
"""

from __future__ import annotations

import codecs
import contextlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable, Iterator


def widgets_available() -> bool:
    """Whether ipywidgets can be imported (tqdm's notebook bar is drawn with it)."""
    try:
        return importlib.util.find_spec("ipywidgets") is not None
    except (ImportError, ValueError):  # a broken package, or a sys.modules entry without a spec
        return False


if widgets_available():
    from tqdm.auto import tqdm
else:
    from tqdm.std import tqdm


def _output_errors(err: UnicodeError) -> tuple[bytes, int]:
    """The output streams' error handler: a path's undecodable bytes (U+DC80-U+DCFF, as
    ``surrogateescape`` decoded them from argv) go back as those bytes, other characters the
    encoding lacks as backslash escapes (``\\xb1`` for ``±``)."""
    if not isinstance(err, UnicodeEncodeError):
        raise err
    text = err.object[err.start : err.end]
    out = b"".join(
        bytes([ord(c) - 0xDC00])
        if 0xDC80 <= ord(c) <= 0xDCFF
        else c.encode("ascii", "backslashreplace")
        for c in text
    )
    return out, err.end


OUTPUT_ERRORS = "kernelstudy.output"
codecs.register_error(OUTPUT_ERRORS, _output_errors)


def usable_output_streams() -> None:
    """For the command-line entry points: a closed stdout or stderr (``2>&-``, ``pythonw``:
    Python sets it to None) becomes /dev/null, where the bars and messages went nowhere but
    the work failed at the first write; text the stream's encoding cannot hold (``±``, ``φ``
    in a summary under a latin-1 or C locale without UTF-8 mode) is written with backslash
    escapes, where a finished run ended in UnicodeEncodeError, and a path's undecodable bytes
    as those bytes (:func:`_output_errors`)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:
            null = open(os.devnull, "w", encoding="utf-8", errors=OUTPUT_ERRORS)  # noqa: SIM115
            setattr(sys, name, null)
        elif hasattr(stream, "reconfigure"):
            stream.reconfigure(errors=OUTPUT_ERRORS)


@contextlib.contextmanager
def warnings_above_bars() -> Iterator[None]:
    """For the command-line entry points: within the block, where stderr is a terminal, each
    warning shown is one line, ``Category: message``, written with ``tqdm.write`` (above a
    progress bar being drawn, which is redrawn below it). Python's own format wrote it into
    the bar's line, with the file and line that warned and an echo of that source line.
    Elsewhere (a log file, a notebook, a test recording warnings) nothing changes."""
    isatty = getattr(sys.stderr, "isatty", None)
    if not (callable(isatty) and isatty()):
        yield
        return

    def show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ARG001
        tqdm.write(f"{category.__name__}: {message}", file=file or sys.stderr)

    saved, warnings.showwarning = warnings.showwarning, show
    try:
        yield
    finally:
        if warnings.showwarning is show:
            warnings.showwarning = saved


#: What a command that keeps its finished work says on Ctrl-C (``train``: the checkpoint
#: saved at the interrupt; a study: its rows; a search: its trials; an evaluation: its runs)
INTERRUPTED_RESUMABLE = "interrupted: what finished is kept; the same command goes on from it"


def closed_pipe_exit() -> int:
    """For an entry point that caught BrokenPipeError (output piped into a reader that
    stopped, ``| head``): stdout becomes /dev/null, else Python's flush at exit fails again
    ("Exception ignored ... BrokenPipeError", status 120); returns 141, 128 + SIGPIPE, as a
    killed writer's status."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141


def run_script(main: Callable[[], int | None]) -> int:
    """A benchmark script's ``main()`` run as the ``kernelstudy`` command runs its own: with
    closed output streams usable (:func:`usable_output_streams`), warnings as lines above
    the bars (:func:`warnings_above_bars`), quiet with status 141 in a
    pipe whose reader stopped (:func:`closed_pipe_exit`), status 130 and "interrupted" on
    Ctrl-C where ``main`` does not handle it itself. Returns the exit status."""
    usable_output_streams()
    try:
        with warnings_above_bars():
            status = int(main() or 0)
        sys.stdout.flush()  # here, not at exit: a closed pipe's error is caught below
        return status
    except BrokenPipeError:
        return closed_pipe_exit()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


__all__ = [
    "INTERRUPTED_RESUMABLE",
    "closed_pipe_exit",
    "run_script",
    "tqdm",
    "usable_output_streams",
    "warnings_above_bars",
    "widgets_available",
]
