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
