"""Progress bars: tqdm's notebook widget where ipywidgets is installed, else the text bar.

``tqdm.auto`` chooses the widget bar in every Jupyter kernel; without ipywidgets it
warns "IProgress not found. Please update jupyter and ipywidgets." and falls back to
the text bar. The package's modules import ``tqdm`` from here instead, which asks for
the widget bar (through ``tqdm.auto``) only when ipywidgets can be imported, so a
notebook without ipywidgets gets the text bar and no warning. Outside Jupyter both
choices give the text bar.
"""

from __future__ import annotations

import importlib.util


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

__all__ = ["tqdm", "widgets_available"]
