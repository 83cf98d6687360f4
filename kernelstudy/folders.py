"""Where the studies and their results live (layer-free: the studies and the searches write
their results in one place, where the notebooks read them)."""

from __future__ import annotations

import os
from pathlib import Path

ENV_STUDIES_DIR = "KERNELSTUDY_STUDIES_DIR"
ENV_RESULTS_DIR = "KERNELSTUDY_RESULTS"


def packaged_studies_dir() -> Path:
    """The copy of ``studies/`` (scripts and configs) an installed package carries."""
    return Path(__file__).resolve().parent / "_studies"


def studies_dir() -> Path:
    """The ``studies/`` directory: ``$KERNELSTUDY_STUDIES_DIR`` if set, else the installed
    package's copy, else the one next to the package (a source checkout, an editable install)."""
    if os.environ.get(ENV_STUDIES_DIR):  # an explicit setting is the only place looked at
        candidates = [Path(os.environ[ENV_STUDIES_DIR])]
    else:
        # the package's own copy first (absent in a checkout): a folder named studies/ beside
        # an installed package (another distribution's) is not ours
        candidates = [packaged_studies_dir(), Path(__file__).resolve().parents[1] / "studies"]
    for path in candidates:
        if path.is_dir() and any(path.glob("*.toml")):
            return path
    looked = ", ".join(str(p) for p in candidates)
    raise FileNotFoundError(
        f"cannot find the studies/ directory (looked in: {looked}); reinstall kernelstudy or "
        f"set {ENV_STUDIES_DIR}"
    )


def results_dir() -> Path:
    """Where studies and searches write their results and notebooks read them (``NAME/`` in
    it): ``$KERNELSTUDY_RESULTS``, else ``results/``, both relative to the repository root
    in a checkout (``studies/results`` holds the committed full-size runs) and to the
    current directory for an installed package; with ``$KERNELSTUDY_STUDIES_DIR`` set, to
    that folder's parent (results sit beside one's own studies). Decided without looking
    for studies there: searches, which run none, write here too."""
    own = os.environ.get(ENV_STUDIES_DIR)
    checkout = Path(__file__).resolve().parents[1]
    if own and Path(own).resolve() != packaged_studies_dir():
        # of "." too (its parent by name is "."); a link is not followed: results sit beside
        # the folder named, not beside the one it points to
        root = Path(os.path.abspath(own)).parent
    elif own or packaged_studies_dir().is_dir() or not (checkout / "studies").is_dir():
        root = Path.cwd()
    else:
        root = checkout
    return root / (os.environ.get(ENV_RESULTS_DIR) or "results")
