"""The layers of DESIGN.md: a package imports only the packages below it (the table's
"may import", and what those may import), plus the layer-free modules (argument checks,
atomic files, where results live, progress bars), which import no package of kernelstudy."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kernelstudy"
#: Layer-free modules at the top of the package: any layer may use them.
NEUTRAL = {"arguments", "files", "folders", "pickled_arrays", "progress", "revision"}
#: What each layer may import directly (DESIGN.md's table, closed under "may import").
BELOW = {
    "core": set(),
    "feature_maps": {"core"},
    "nn": {"core", "feature_maps"},
    "analysis": {"core", "feature_maps", "nn"},
    "tasks": set(),
    "train": {"nn", "tasks", "core", "feature_maps"},
    "search": {"train", "feature_maps", "nn", "tasks", "core"},
    **{name: set() for name in NEUTRAL},
}


def imported_parts(source: str, folders: tuple[str, ...]) -> set[str]:
    """The top-level parts of kernelstudy (``core``, ``files``, ...) that ``source``, a module
    in ``kernelstudy/<folders>/``, imports."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [(node.module or "").split(".")]
        elif isinstance(node, ast.ImportFrom):  # from ..x import y: relative to the folder
            base = ["kernelstudy", *folders[: len(folders) - node.level + 1]]
            module = [p for p in (node.module or "").split(".") if p]
            names = [base + module + ([] if module else [a.name]) for a in node.names]
        else:
            continue
        found |= {n[1] for n in names if n[0] == "kernelstudy" and len(n) > 1}
    return found


def _parts(path: Path) -> set[str]:
    return imported_parts(path.read_text(), path.relative_to(PACKAGE).parts[:-1])


def _layer(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else path.stem


@pytest.mark.parametrize("layer", sorted(BELOW))
def test_a_layer_imports_only_what_lies_below_it(layer):
    files = [p for p in PACKAGE.rglob("*.py") if _layer(p) == layer]
    assert files, f"no module of layer {layer}"
    allowed = BELOW[layer] | {layer} | (set() if layer in NEUTRAL else NEUTRAL)
    wrong = {
        str(p.relative_to(PACKAGE)): sorted(_parts(p) - allowed)
        for p in files
        if _parts(p) - allowed
    }
    assert not wrong, f"{layer} may import {sorted(allowed)}; these import more: {wrong}"


def test_the_import_reader_sees_relative_and_absolute_imports():
    source = (
        "from ..core.validation import check_qkv\nfrom .. import files\n"
        "import kernelstudy.nn\nfrom . import listops\nfrom kernelstudy.search import x\n"
    )
    assert imported_parts(source, ("tasks",)) == {"core", "files", "nn", "tasks", "search"}
    assert imported_parts("from .arguments import check_count\n", ()) == {"arguments"}
    assert imported_parts("import torch\nfrom . import core\n", ()) == {"core"}
