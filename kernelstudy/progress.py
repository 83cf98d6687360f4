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
import importlib.util
import os
import sys


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


__all__ = ["tqdm", "usable_output_streams", "widgets_available"]
