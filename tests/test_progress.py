"""Progress bars: the notebook widget only where ipywidgets is installed, and no
"IProgress not found" warning in a Jupyter kernel without it."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from pathlib import Path

import pytest
import tqdm as tqdm_package
import tqdm.std

import kernelstudy

PACKAGE = Path(kernelstudy.__file__).resolve().parent


def _fresh(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Forget modules ``names`` for this test (restored afterwards), so they import anew."""
    parents = {"tqdm": tqdm_package, "kernelstudy": kernelstudy}
    for name in names:
        # setitem first, so that a module first imported here is removed again afterwards
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name))
        monkeypatch.delitem(sys.modules, name)
        parent, _, child = name.rpartition(".")
        monkeypatch.setattr(parents[parent], child, None, raising=False)


def _jupyter_without_ipywidgets(monkeypatch: pytest.MonkeyPatch) -> None:
    """What tqdm.autonotebook sees in a Jupyter kernel: ipykernel's shell loaded, and an
    ``import ipywidgets`` that fails."""
    monkeypatch.setitem(sys.modules, "ipykernel.zmqshell", types.ModuleType("ipykernel.zmqshell"))
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import raises ImportError
    _fresh(monkeypatch, "tqdm.auto", "tqdm.autonotebook", "tqdm.notebook", "kernelstudy.progress")


def test_the_simulated_kernel_makes_tqdm_auto_warn(monkeypatch):
    pytest.importorskip("IPython")  # tqdm.autonotebook asks IPython for the shell
    _jupyter_without_ipywidgets(monkeypatch)
    with pytest.warns(tqdm.std.TqdmWarning, match="IProgress not found"):
        importlib.import_module("tqdm.auto")


def test_no_iprogress_warning_without_ipywidgets(monkeypatch):
    _jupyter_without_ipywidgets(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        progress = importlib.import_module("kernelstudy.progress")
        bar = progress.tqdm(range(3), disable=True)
        assert list(bar) == [0, 1, 2]
    assert not progress.widgets_available()
    assert progress.tqdm is tqdm.std.tqdm  # the plain text bar
    assert "tqdm.auto" not in sys.modules  # never asked for the notebook bar
    assert not [w for w in caught if "IProgress" in str(w.message)], caught


def test_widget_bar_when_ipywidgets_is_importable(monkeypatch):
    spec = importlib.machinery.ModuleSpec("ipywidgets", None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec)
    _fresh(monkeypatch, "kernelstudy.progress")
    progress = importlib.import_module("kernelstudy.progress")
    assert progress.widgets_available()
    assert progress.tqdm is importlib.import_module("tqdm.auto").tqdm


def test_the_package_imports_tqdm_only_through_progress():
    import kernelstudy.progress as progress
    import kernelstudy.search.evaluate
    import kernelstudy.search.runner
    import kernelstudy.study
    import kernelstudy.train.trainer

    for module in (
        kernelstudy.search.evaluate,
        kernelstudy.search.runner,
        kernelstudy.study,
        kernelstudy.train.trainer,
    ):
        assert module.tqdm is progress.tqdm, module.__name__
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name != "progress.py"
        and any(
            line.strip().startswith(
                ("from tqdm.auto", "import tqdm.auto", "from tqdm.autonotebook")
            )
            for line in path.read_text().splitlines()
        )
    ]
    assert not offenders, f"import tqdm from kernelstudy.progress instead: {offenders}"


def test_a_warning_under_a_bar_is_one_line_of_its_own(monkeypatch):
    """A warning raised while a bar was drawn (the CPU build failing at a trainer's first step)
    was written into the bar's line, with the file and line that warned and an echo of that
    source line. Inside ``warnings_above_bars`` (the entry points' block) it is one line of its
    own, ``Category: message``, above the bar; after the block Python's format is back, and
    where stderr is no terminal (a log, a test recording warnings) it is never replaced."""
    import io

    from kernelstudy.progress import tqdm, warnings_above_bars

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    buf = Terminal()
    monkeypatch.setattr(sys, "stderr", buf)
    before = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with warnings_above_bars():
            bar = tqdm(total=3, file=buf, desc="train")
            bar.update(1)
            warnings.warn("cannot build it", RuntimeWarning, stacklevel=1)
            bar.update(2)
            bar.close()
        assert warnings.showwarning is before
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: Python's own
    with warnings_above_bars():
        assert warnings.showwarning is before
    lines = buf.getvalue().split("\n")
    assert any(line.endswith("\rRuntimeWarning: cannot build it") for line in lines), lines
    assert "test_progress.py" not in buf.getvalue() and "warnings.warn" not in buf.getvalue()
