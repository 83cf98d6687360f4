"""A search config run as one study: search → evaluate → report, as ``kernelstudy study NAME``
runs the other studies (DESIGN: each claim is a study runnable by name).

The Long Range Arena claims (``studies/lra_*.toml``) are Optuna searches, not study scripts:
``kernelstudy study lra_listops --quick`` runs the three commands the README lists in turn,
into the same ``--out``, each resuming what it finds there (the searches' trials, the
evaluation's runs).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..folders import studies_dir
from .config import load_config
from .evaluate import run_evaluation
from .report import write_report
from .runner import run_search

#: Evaluation seeds per variant: the evaluate command's default, and fewer at ``--quick``.
SEEDS = 5
QUICK_SEEDS = 2


def list_search_studies() -> list[str]:
    """Names of the search configs in the studies folder: ``NAME.toml`` without a
    ``NAME.py`` (a study script's own config) that reads as a search config."""
    root = studies_dir()
    names = []
    for path in sorted(root.glob("*.toml")):
        if (root / f"{path.stem}.py").is_file():
            continue
        try:
            load_config(path)
        except (ValueError, OSError):
            continue
        names.append(path.stem)
    return names


def run_search_study(
    name: str,
    quick: bool = False,
    out: str | os.PathLike | None = None,
    device: str | None = None,
    seeds: int | None = None,
) -> dict[str, Path]:
    """Search every variant of ``studies/NAME.toml`` (its trials, one worker), evaluate each
    variant's best trial with ``seeds`` seeds (default :data:`SEEDS`, :data:`QUICK_SEEDS` at
    ``quick``) and write the report; returns :func:`~.report.write_report`'s paths.
    ``out``: the results folder (default as for ``kernelstudy search``); ``device``: a torch
    device (default: the config's)."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    known = list_search_studies()
    if name not in known:
        raise ValueError(f"unknown search study {name!r}; available: {', '.join(known)}")
    config = studies_dir() / f"{name}.toml"
    seeds = (QUICK_SEEDS if quick else SEEDS) if seeds is None else seeds
    options = {"out": out, "quick": quick, "device": device}
    run_search(config, **options)
    run_evaluation(config, seeds=seeds, **options)
    return write_report([config], out=out, quick=quick)
