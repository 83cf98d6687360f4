"""The study runner shared by every study under ``studies/``.

A study is a script ``studies/NAME.py`` plus a config file ``studies/NAME.toml``.
The TOML holds shared parameters at top level and the sizes in two tables,
``[full]`` and ``[quick]`` (the chosen one overrides the top level). The script
defines plain functions:

- ``configs(params) -> list[dict]``: the configurations (flat JSON-able dicts);
- ``run_config(config, device) -> DataFrame | list[dict]``: result rows of one config;
- optional ``figures(frame, params) -> dict[str, Figure]`` and
  ``summarize(frame, params) -> str`` (a markdown table);
- optional ``TABLES``: names of extra long-format tables the study writes beside
  ``results.csv`` (e.g. ``("spectra",)`` writes ``spectra.csv``). ``run_config`` then
  returns a dict ``{"results": rows, NAME: rows, ...}`` and ``figures``/``summarize``
  get a third argument, a dict ``NAME -> DataFrame`` of the current configurations' rows.

:func:`run_study` runs every configuration not yet in ``results.csv`` (one
config at a time, rewriting the CSV atomically after each, so an interrupted
study resumes where it stopped), then writes the figures (PNG) and ``summary.md``
from the rows of the current configurations. Rows get the config's entries as
columns plus ``study``, ``config_id`` (a hash of config and device) and ``device``.
Rows of an extra table get only ``config_id`` (first column) besides the columns the
study gives them; join with ``results.csv`` on it for the rest. Extra tables are
rewritten atomically after each config too, before ``results.csv``, and a config's old
rows are replaced, never duplicated, so an interrupted study resumes cleanly.
``fill_tables=True`` (``--fill-tables``) reruns the finished configurations that have no
rows in an extra table, writing only those rows (``results.csv`` is kept as it is, and a
rerun that does not reproduce its stored rows is reported); ``only`` (``--only
KEY=VALUE``) restricts the configurations run to those matching; ``tables_only=True``
(what :func:`load_results` does for an extra table missing beside rows in ``results.csv``)
fills the extra tables of finished configurations only, leaving ``results.csv``, the
summary and figures as they are. The summary ends with one provenance line ("Written
<date> by `<command>` on <machine> ...") per run that computed rows it uses: ``runs.json``
records the run of each config's rows as they are written (so an interrupted run's rows
keep theirs), and a rerun that computes nothing keeps the lines. ``--force`` replaces a
config's rows when its new ones are written (an interrupted forced run loses none), and
figures the replaced summary showed that this run does not draw are deleted.

The checks a script makes of its config and its feature maps' labels are in
:mod:`kernelstudy.study_params`; this module re-exports them for the scripts.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import importlib.util
import json
import math
import os
import re
import shlex
import sys
import time
import tomllib
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pandas as pd

from .arguments import nonempty_user_path, user_path
from .feature_maps.registry import ENV_FEATURE_MAPS
from .files import (
    atomic_write,
    atomic_write_text,
    exclusive_folder,
    folder_in_use,
    read_csv_table,
)
from .folders import ENV_RESULTS_DIR as ENV_RESULTS_DIR  # re-exported: the studies' API
from .folders import ENV_STUDIES_DIR as ENV_STUDIES_DIR  # re-exported, as the one above
from .folders import results_dir, studies_dir
from .progress import (
    INTERRUPTED_RESUMABLE,
    closed_pipe_exit,
    tqdm,
    usable_output_streams,
    warnings_above_bars,
)
from .revision import with_commit
from .study_params import (  # re-exported: the studies' API
    PARAM_KINDS as PARAM_KINDS,
)
from .study_params import (
    STUDY_SET_MAP_ENTRIES as STUDY_SET_MAP_ENTRIES,
)
from .study_params import (
    check_lengths as check_lengths,
)
from .study_params import (
    check_map_builds as check_map_builds,
)
from .study_params import (
    check_map_list as check_map_list,
)
from .study_params import (
    check_map_names as check_map_names,
)
from .study_params import (
    check_map_spec as check_map_spec,
)
from .study_params import (
    check_names as check_names,
)
from .study_params import (
    check_params as check_params,
)
from .study_params import (
    map_label as map_label,
)
from .study_params import (
    map_name_and_hparams as map_name_and_hparams,
)
from .study_params import (
    matched_map as matched_map,
)
from .study_params import (
    parse_map_label as parse_map_label,
)

RESULTS = "results"
RESULTS_FILE = f"{RESULTS}.csv"
SUMMARY_FILE = "summary.md"
#: ``{"TABLE/CONFIG_ID": provenance line}``: the run that computed each config's rows.
RUNS_FILE = "runs.json"
DEVICES = ("cpu", "cuda")


def list_studies() -> list[str]:
    """Names of the runnable studies (``studies/NAME.py`` with a ``NAME.toml``)."""
    root = studies_dir()
    return sorted(p.stem for p in root.glob("*.py") if (root / f"{p.stem}.toml").is_file())


def _check_name(name: str) -> Path:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    known = list_studies()
    if name not in known:
        raise ValueError(f"unknown study {name!r}; available: {', '.join(known)}")
    return studies_dir()


def load_params(
    name: str, quick: bool = False, config: str | os.PathLike | None = None
) -> dict[str, Any]:
    """The parameters of study ``name``: top-level TOML entries updated (recursively) by the
    ``[quick]`` or ``[full]`` table, plus ``quick`` (bool). ``config``: a TOML file to read
    instead of ``studies/NAME.toml`` (the same keys; a copy edited outside the checkout)."""
    root = _check_name(name)
    path = root / f"{name}.toml" if config is None else Path(config)
    if not path.is_file():
        raise ValueError(f"config {str(path)!r} is not a file (a study TOML such as {name}.toml)")
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"config {str(path)!r} is not valid TOML: {err}") from None
    for table in ("quick", "full"):
        if not isinstance(raw.get(table, {}), dict):
            raise ValueError(f"config {str(path)!r}: {table} must be a table ([{table}])")
    if config is not None:  # an edited copy: every key must be one of the shipped file's
        with open(root / f"{name}.toml", "rb") as f:
            _check_known_keys(raw, tomllib.load(f), path)
    size = "quick" if quick else "full"
    params = {k: v for k, v in raw.items() if k not in ("quick", "full")}
    params = _merge(params, raw.get(size, {}))
    params["quick"] = bool(quick)
    return params


def _check_known_keys(raw: dict[str, Any], shipped: dict[str, Any], path: Path) -> None:
    """ValueError naming the keys of config ``raw`` (read from ``path``) that the shipped
    study config ``shipped`` has nowhere (at the top, in ``[quick]`` or ``[full]``, at the
    same depth of tables), with the closest known key: a misspelled key was read as no key
    (the study ran its default instead, silently)."""
    known = _sized_key_paths(shipped)
    # recursed into only where the shipped config has a table: elsewhere a table is a value
    # (``feature_map = { name = "glu", depth = 2 }`` where the shipped value is a name)
    tables = _sized_key_paths(shipped, tables_only=True)
    unknown = sorted(_sized_key_paths(raw, within=tables) - known)
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(
            f"config {str(path)!r}: unknown key(s) {', '.join(hints)}; the study takes the keys "
            "of its shipped config, at the top or in [quick]/[full]"
        )


def _sized_key_paths(
    raw: dict[str, Any], within: set[str] | None = None, tables_only: bool = False
) -> set[str]:
    """The dotted key paths of a study config, those of ``[quick]`` and ``[full]`` without
    that prefix (``quick.copy.steps`` is ``copy.steps``), tables recursed into (not lists;
    with ``within``, only the tables at those paths). ``tables_only``: the tables' paths."""

    def paths(table: dict[str, Any], prefix: str = "") -> set[str]:
        out = set()
        for key, value in table.items():
            path = prefix + str(key)
            is_table = isinstance(value, dict)
            if is_table or not tables_only:
                out.add(path)
            if is_table and (within is None or path in within):
                out |= paths(value, f"{path}.")
        return out

    top = {k: v for k, v in raw.items() if k not in ("quick", "full")}
    return paths(top).union(
        *(paths(raw[t]) for t in ("quick", "full") if isinstance(raw.get(t), dict))
    )


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``base`` updated by ``override``, recursing into tables present in both."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _table_keys(table: dict[str, Any]) -> set[Any]:
    """The keys of ``table`` and of the tables in it, at any depth."""
    keys = set(table)
    for value in table.values():
        if isinstance(value, dict):
            keys |= _table_keys(value)
    return keys


def load_study(name: str) -> ModuleType:
    """Import ``studies/NAME.py`` as a module (it must define ``configs`` and ``run_config``)."""
    root = _check_name(name)
    path = root / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"kernelstudy_study_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(root))  # a study may import helpers beside it (studies/_*.py)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(root))
    for attr in ("configs", "run_config"):
        if not callable(getattr(module, attr, None)):
            raise ValueError(f"study script {path} must define a function {attr}()")
    return module


def config_id(config: dict[str, Any], device: str) -> str:
    """A short stable hash of a configuration and the device it runs on."""
    text = json.dumps({**config, "device": device}, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _read_results(path: Path) -> pd.DataFrame:
    # config_id as text: an all-digit id ("942358339153") or one like "096e55686685" would
    # otherwise read as a number and no longer match its config
    table = read_csv_table(path, text_columns=("config_id",))
    if table is None:
        return pd.DataFrame()
    if "config_id" not in table and not table.empty:  # its rows were no config's: all rerun
        raise ValueError(
            f"{path} has no config_id column, so it is not a study's table (saved with another "
            f"separator than ','? its first column: {str(table.columns[0])[:60]!r}); move it "
            "away to start afresh"
        )
    return table


def study_tables(module: ModuleType) -> tuple[str, ...]:
    """The extra tables a study script declares in ``TABLES`` (validated), e.g. ``("spectra",)``."""
    tables = getattr(module, "TABLES", ())
    if isinstance(tables, str) or not all(isinstance(t, str) for t in tables):
        raise ValueError(
            f"TABLES of study {module.__name__} must be a tuple of str, got {tables!r}"
        )
    for table in tables:
        if not table.isidentifier() or table in (RESULTS, Path(SUMMARY_FILE).stem):
            raise ValueError(
                f"TABLES of study {module.__name__}: {table!r} is not a valid table name "
                f"(an identifier other than {RESULTS!r} and {Path(SUMMARY_FILE).stem!r})"
            )
    return tuple(tables)


def _split_rows(rows: Any, tables: tuple[str, ...]) -> dict[str, pd.DataFrame]:
    """``run_config``'s return value as one DataFrame per table (``results`` first)."""
    if not tables:
        return {RESULTS: pd.DataFrame(rows)}
    if not isinstance(rows, dict) or not set(rows) <= {RESULTS, *tables}:
        raise ValueError(
            f"run_config of a study with TABLES = {tables} must return a dict with keys "
            f"{RESULTS!r} and the tables' names, got "
            + (f"keys {sorted(rows)}" if isinstance(rows, dict) else type(rows).__name__)
        )
    return {t: pd.DataFrame(rows.get(t, [])) for t in (RESULTS, *tables)}


def _tag_results(new: pd.DataFrame, config: dict, cid: str, name: str, device: str):
    """Result rows of one config with its entries, ``study``, ``config_id`` and ``device``."""
    new = new.copy()
    if new.empty:
        new = pd.DataFrame([{"metric": "no_rows", "value": math.nan}])
    for key, value in config.items():
        if key not in new:
            new[key] = value if not isinstance(value, list | dict) else json.dumps(value)
    new.insert(0, "config_id", cid)
    new.insert(0, "study", name)
    new["device"] = device
    return new


def _append(frame: pd.DataFrame, new: pd.DataFrame, cid: str) -> pd.DataFrame:
    """``frame`` without the rows of config ``cid``, then ``new``."""
    if not frame.empty and "config_id" in frame:
        frame = frame[frame["config_id"] != cid]
    if frame.empty:
        return new.reset_index(drop=True)
    return pd.concat([frame, new], ignore_index=True) if not new.empty else frame


def _reproduces(stored: pd.DataFrame, new: pd.DataFrame, rtol: float = 1e-9) -> bool:
    """Whether rerun result rows match the stored ones (same metrics, values within rtol)."""
    if len(stored) != len(new) or "value" not in new or "metric" not in new:
        return False
    a = pd.to_numeric(stored["value"], errors="coerce").to_numpy(dtype=float)
    b = pd.to_numeric(new["value"], errors="coerce").to_numpy(dtype=float)
    same_metrics = list(stored["metric"].astype(str)) == list(new["metric"].astype(str))
    return same_metrics and bool(np.allclose(a, b, rtol=rtol, atol=0.0, equal_nan=True))


def _matches(config: dict, only: dict[str, str]) -> bool:
    return all(key in config and str(config[key]) == value for key, value in only.items())


def parse_only(items: Sequence[str] | None) -> dict[str, str]:
    """``["KEY=VALUE", ...]`` (the ``--only`` options) as a dict; values compare as strings."""
    only = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--only takes KEY=VALUE (a config entry), got {item!r}")
        if key in only and only[key] != value:  # the last one won, without a word
            raise ValueError(
                f"--only {key}= given twice ({only[key]!r}, {value!r}): a configuration has "
                "one value per entry; run each value on its own"
            )
        only[key] = value
    return only


def run_study(
    name: str,
    quick: bool = False,
    out: str | os.PathLike | None = None,
    device: str = "cpu",
    force: bool = False,
    verbose: bool = True,
    fill_tables: bool = False,
    only: dict[str, Any] | None = None,
    tables_only: bool = False,
    progress: bool | None = None,
    config_file: str | os.PathLike | None = None,
) -> pd.DataFrame:
    """Run study ``name`` and return the result rows of its current configurations.

    Args:
        name: a study from :func:`list_studies`.
        quick: the ``[quick]`` sizes (a few minutes at most on a laptop CPU).
        out: output directory (default ``NAME`` in :func:`results_dir`, the folder
            :func:`load_results` and the notebooks read: ``results/NAME`` of the checkout,
            of the working directory for an installed package, or ``$KERNELSTUDY_RESULTS``);
            gets ``results.csv``, one ``TABLE.csv`` per extra table of the study,
            ``runs.json`` (the run that computed each config's rows), ``summary.md`` and
            ``*.png``.
        device: ``"cpu"`` or ``"cuda"``.
        force: recompute configurations already in ``results.csv``.
        verbose: show tqdm progress and print the summary table and file paths.
        fill_tables: also rerun configurations already in ``results.csv`` that have no rows
            in one of the study's extra tables, to write those rows only (their
            ``results.csv`` rows are kept; reruns that do not reproduce them are reported).
        only: run only the configurations whose entries equal these (compared as strings),
            e.g. ``{"part": "gaussian"}``; the summary and figures still cover all of them.
        tables_only: fill the extra tables only: as ``fill_tables``, rerun the configurations
            already in ``results.csv`` (of this size, matching ``only``; with ``force``,
            every one of them) that have no rows in one of the tables, but run no other
            configuration and write only those tables' rows (and their ``runs.json``
            lines): ``results.csv``, ``summary.md`` and the figures stay as they are (they
            may be another size's run: see :func:`load_results`).
        progress: show a tqdm bar over the configurations run (default: ``verbose``).
        config_file: a TOML file read instead of ``studies/NAME.toml`` (:func:`load_params`), for
            other sizes without editing the checkout; its configurations get their own
            config ids, so a shared ``out`` keeps both runs' rows apart.
    """
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available on this machine")
    only = {str(k): str(v) for k, v in (only or {}).items()}
    module = load_study(name)
    tables = study_tables(module)
    if tables_only and not tables:
        raise ValueError(f"tables_only: study {name!r} has no extra tables (TABLES)")
    params = load_params(name, quick, config_file)
    # the folder load_results reads: ./results from another working directory was not it
    out_dir = Path(out) if out is not None else results_dir() / name
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} exists and is not a directory")
    paths = {t: out_dir / f"{t}.csv" for t in (RESULTS, *tables)}
    results_path = paths[RESULTS]

    try:
        configs = list(module.configs(params))
    except KeyError as err:  # a config (a copy, say) without an entry the study reads
        key = err.args[0] if err.args else None
        if key in _table_keys(params):
            raise
        source = config_file if config_file is not None else studies_dir() / f"{name}.toml"
        raise ValueError(
            f"config {str(source)!r} has no entry {key!r}, which study {name!r} reads "
            f"(studies/{name}.toml has them all)"
        ) from None
    ids = [config_id(c, device) for c in configs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"study {name!r} produced duplicate configurations")
    if only:
        unknown = sorted(set(only) - {k for c in configs for k in c})
        if unknown:
            keys = sorted({k for c in configs for k in c})
            raise ValueError(
                f"only: no configuration of study {name!r} has an entry "
                f"{', '.join(map(repr, unknown))} (their entries: {', '.join(keys)})"
            )
        if not any(_matches(c, only) for c in configs):
            values = {k: sorted({str(c[k]) for c in configs if k in c}) for k in only}
            raise ValueError(
                f"only: no configuration of study {name!r} has {only}; values: "
                + "; ".join(f"{k} in {', '.join(map(repr, v))}" for k, v in values.items())
            )
    _check_held(_read_results(results_path), name, out_dir)  # before making the folder
    out_dir.mkdir(parents=True, exist_ok=True)
    with exclusive_folder(out_dir, f"study {name}", clean=True):
        # read (and check) again under the lock: a run that ended meanwhile may have written
        frames = {t: _read_results(path) for t, path in paths.items()}
        _check_held(frames[RESULTS], name, out_dir)
        finished = _ids(frames[RESULTS])
        done = set(finished)
        if force and done:  # recompute the selected configurations; keep every other row
            # and each old row until its config's new rows replace it: an interrupted
            # --force run lost the old rows of every config it had not reached
            done -= {i for c, i in zip(configs, ids, strict=True) if _matches(c, only)}
        unfilled = set()  # finished configs with no rows in an extra table
        for t in tables:
            unfilled |= done - _ids(frames[t])
        if tables_only:  # finished configs only: results.csv gets no rows (without
            # force, done is finished, so unfilled is what the tables lack)
            todo = [
                (c, i)
                for c, i in zip(configs, ids, strict=True)
                if i in finished and (force or i in unfilled) and _matches(c, only)
            ]
        else:
            todo = [
                (c, i)
                for c, i in zip(configs, ids, strict=True)
                if (i not in done or (fill_tables and i in unfilled)) and _matches(c, only)
            ]
        if verbose:
            refill = sum(i in done for _, i in todo)
            print(
                f"study {name} ({'quick' if quick else 'full'}, {device}): {len(configs)} "
                f"configurations, {len(finished & set(ids))} already in {results_path}"
                + (f" ({len((finished - done) & set(ids))} recomputed: --force)" if force else "")
                + f"; running {len(todo)}"
                + (f" matching {only}" if only else "")
                + (
                    f" for {', '.join(tables)} only (results.csv and summary.md kept)"
                    if tables_only
                    else f", {refill} of them only to fill {', '.join(tables)}"
                    if refill
                    else ""
                ),
                file=sys.stderr,
            )
            left = (unfilled & set(ids)) - {i for _, i in todo}
            if left:
                print(
                    f"{len(left)} finished configurations have no rows in {', '.join(tables)} "
                    + ("(not matching --only)" if fill_tables else "(--fill-tables computes them)"),
                    file=sys.stderr,
                )
        options = (
            (["--force"] if force else [])
            + (["--fill-tables"] if fill_tables or tables_only else [])
            + [f"--only {shlex.quote(f'{k}={v}')}" for k, v in only.items()]
            + ([f"--out {shlex.quote(str(out))}"] if out is not None else [])
            + ([f"--config {shlex.quote(str(config_file))}"] if config_file is not None else [])
        )
        this_run = provenance(name, quick, device, options=" ".join(options)) if todo else ""
        runs_path = out_dir / RUNS_FILE
        runs = _read_runs(runs_path)
        not_reproduced = []
        replaced_lines = set()  # the runs whose rows this run computes again
        start = time.perf_counter()
        bar = verbose if progress is None else progress
        for config, cid in tqdm(todo, desc=name, unit="config", disable=not bar or not todo):
            new = _split_rows(module.run_config(dict(config), device), tables)
            # the run's line first: a config's rows in any table have it (an interrupted
            # run's rows kept no line when lines were made only at the end)
            computed = [*tables, *([] if cid in done or tables_only else [RESULTS])]
            replaced_lines |= {runs[k] for t in computed if (k := f"{t}/{cid}") in runs}
            runs.update({f"{t}/{cid}": this_run for t in computed})
            atomic_write_text(runs_path, json.dumps(runs, indent=0, sort_keys=True) + "\n")
            for t in tables:  # extra tables first: a config in results.csv has its rows there
                rows = new[t].copy()
                rows.insert(0, "config_id", cid)
                frames[t] = _append(frames[t], rows, cid)
                atomic_write_text(paths[t], frames[t].to_csv(index=False))
            rows = _tag_results(new[RESULTS], config, cid, name, device)
            if cid in done:  # filling an extra table: keep the stored results
                stored = frames[RESULTS][frames[RESULTS]["config_id"] == cid]
                if not _reproduces(stored, rows):
                    not_reproduced.append(cid)
                continue
            if tables_only:  # results.csv is another run's: left as it is
                continue
            frames[RESULTS] = _append(frames[RESULTS], rows, cid)
            atomic_write_text(results_path, frames[RESULTS].to_csv(index=False))
        elapsed = time.perf_counter() - start
        if not_reproduced:
            print(
                f"warning: {len(not_reproduced)} configurations rerun to fill "
                f"{', '.join(tables)} did not reproduce their rows in {results_path} (kept): "
                + ", ".join(not_reproduced[:10])
                + (" ..." if len(not_reproduced) > 10 else ""),
                file=sys.stderr,
            )

        result = _current(_read_results(results_path), ids)
        if tables_only:  # no figures, no summary: those of the folder's run stay
            if verbose:
                print(f"ran {len(todo)} configurations in {elapsed:.1f} s; wrote:", file=sys.stderr)
                for t in tables:
                    print(f"  {paths[t]}", file=sys.stderr)
            return result
        extra = {t: _current(_read_results(paths[t]), ids) for t in tables}
        written = [results_path, *(paths[t] for t in tables if paths[t].is_file())]
        figures = getattr(module, "figures", None)
        args = (result, params, extra) if tables else (result, params)
        if callable(figures) and not result.empty:
            written += _save_figures(figures(*args), out_dir)
        summary = ""
        if callable(getattr(module, "summarize", None)) and not result.empty:
            summary = module.summarize(*args)
        doc = " ".join((module.__doc__ or name).strip().split("\n\n")[0].split())
        text = f"# {name} ({'quick' if quick else 'full'}, {device})\n\n{doc}\n\n{summary}\n"
        figs = [p.name for p in written if p.suffix == ".png"]
        if figs:
            text += "\n" + "\n".join(f"![{Path(f).stem}]({f})" for f in figs) + "\n"
        # One line per run that computed rows this summary uses, from runs.json; rows from
        # before runs.json keep the lines of the summary being replaced that fit them. The
        # lines of runs (another size or device) of rows this summary does not use but the
        # tables still hold are kept apart: a summary of theirs written again finds them.
        replaced, earlier = _read_summary(out_dir / SUMMARY_FILE)
        # a run none of whose rows are left (this run computed them all again) is not one of
        # the rows without a runs.json line: its line goes (it was kept while such rows were)
        retired = replaced_lines - set(runs.values())
        earlier = [x for x in earlier if x not in retired]
        held = {t: _ids(_read_results(paths[t])) for t in paths}
        mine = {f"{t}/{i}" for t in paths for i in held[t] & set(ids)}
        lines = list(dict.fromkeys(runs[k] for k in sorted(mine, key=_row_order(ids)) if k in runs))
        unrecorded = {k.partition("/")[2] for k in mine if k not in runs}

        def uses(run: tuple[bool, str] | None) -> bool:
            """Whether rows of this summary without a runs.json line may be that run's."""
            if run is None or run == (quick, device):
                return bool(unrecorded)
            sizes = _configs_of_size(name, module, run[0], config_file)
            return bool(unrecorded & {config_id(c, run[1]) for c in sizes})

        kept = {run: uses(run) for run in {_run_of(line) for line in earlier}}
        lines = list(dict.fromkeys([x for x in earlier if kept[_run_of(x)]] + lines))
        theirs = {f"{t}/{i}" for t in paths for i in held[t] - set(ids)}
        others = [runs[k] for k in sorted(theirs) if k in runs]
        if held[RESULTS] - set(ids):
            others += [x for x in earlier if not kept[_run_of(x)]]
            _note_rows_of_no_config(name, module, held[RESULTS], results_path, config_file)
        others = [x for x in dict.fromkeys(others) if x not in lines]
        if todo and this_run not in lines:  # it filled tables' rows of configs run before
            lines.append(this_run)
        if not lines:
            lines.append(
                provenance(
                    name, quick, device, " ".join(options), verb="Summarized (nothing computed)"
                )
            )
        text += "\n" + "\n\n".join(lines) + "\n"
        if others:
            text += (
                "\nEarlier runs with other rows in these tables (another size or device, or "
                "configurations the config no longer has; this summary does not use them):\n\n"
                + "\n\n".join(others)
                + "\n"
            )
        if replaced not in (None, (quick, device)):
            size, was = ("quick", " --quick") if replaced[0] else ("full", "")
            print(
                f"note: {out_dir / SUMMARY_FILE} and the figures were the {size} "
                f"{replaced[1]} run's; this run's replace them (its rows stay in "
                f"{results_path}: `kernelstudy study {name}{was} --device "
                f"{shlex.quote(replaced[1])} "
                f"--out {shlex.quote(str(out_dir))}` writes them again without computing)",
                file=sys.stderr,
            )
        stale = set(_linked_figures(out_dir / SUMMARY_FILE)) - set(figs)
        atomic_write_text(out_dir / SUMMARY_FILE, text)
        for fig in stale:  # the replaced summary's, which this run did not draw again
            (out_dir / fig).unlink(missing_ok=True)
        written.append(out_dir / SUMMARY_FILE)
        if verbose:
            print(text)
            print(f"ran {len(todo)} configurations in {elapsed:.1f} s; wrote:", file=sys.stderr)
            for p in written:
                print(f"  {p}", file=sys.stderr)
        return result


def _check_held(frame: pd.DataFrame, name: str, out_dir: Path) -> None:
    """ValueError when ``frame`` holds rows of another study than ``name``: appending would
    mix the studies and overwrite the other's summary."""
    held = set(frame.get("study", pd.Series(dtype=object)).dropna()) - {name}
    if held:
        raise ValueError(
            f"{out_dir} holds results of study {sorted(held)[0]!r}, not {name!r}: "
            "give another --out"
        )


# devices by name only: a summary.md's title becomes a printed command (a crafted one said
# "(quick, ;touch${IFS}x;)", which the note's command then ran)
_TITLE = re.compile(rf"# \S+ \((quick|full), ({'|'.join(DEVICES)})\)$")
_COMMAND = re.compile(rf"`kernelstudy study \S+( --quick)? --device ({'|'.join(DEVICES)})[\s`]")


def _run_of(line: str) -> tuple[bool, str] | None:
    """(quick, device) of the run a provenance line names (None if it names none)."""
    match = _COMMAND.search(line)
    return None if match is None else (match.group(1) is not None, match.group(2))


def _read_summary(summary: Path) -> tuple[tuple[bool, str] | None, list[str]]:
    """Of the summary being replaced: (quick, device) of the run it is of, from its title
    (None without one), and its "Written ..." provenance lines (each once)."""
    if not summary.is_file():
        return None, []
    # as atomic_write_text wrote it: a path's undecodable bytes come back as they went
    text = summary.read_text(encoding="utf-8", errors="surrogateescape").splitlines()
    match = _TITLE.match(text[0].strip()) if text else None
    run = None if match is None else (match.group(1) == "quick", match.group(2))
    lines = [line for line in text if line.startswith("Written ")]
    return run, list(dict.fromkeys(lines))


def _read_runs(path: Path) -> dict[str, str]:
    """``runs.json``: ``{"TABLE/CONFIG_ID": provenance line}`` ({} when missing); ValueError
    naming the file when it is not such a mapping."""
    if not path.is_file():
        return {}
    try:
        runs = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not readable JSON ({err}); delete it to go on") from None
    if not isinstance(runs, dict) or not all(isinstance(v, str) for v in runs.values()):
        raise ValueError(f"{path} is not a mapping of rows to runs; delete it to go on")
    return runs


def _row_order(ids: list[str]):
    """Sort key of ``TABLE/CONFIG_ID`` keys: by the config's place in ``ids``."""
    place = {cid: n for n, cid in enumerate(ids)}
    return lambda key: (place.get(key.partition("/")[2], len(place)), key)


_FIGURE = re.compile(r"^!\[[^\]]*\]\(([\w.-]+\.png)\)$")


def _linked_figures(summary: Path) -> list[str]:
    """The PNG file names a summary links (``![stem](stem.png)`` lines)."""
    if not summary.is_file():
        return []
    lines = summary.read_text(encoding="utf-8", errors="surrogateescape").splitlines()
    return [m.group(1) for x in lines if (m := _FIGURE.match(x))]


def _ids(frame: pd.DataFrame) -> set[str]:
    """The ``config_id`` values that have rows in ``frame``."""
    return set(frame["config_id"]) if "config_id" in frame else set()


def _current(frame: pd.DataFrame, ids: list[str]) -> pd.DataFrame:
    """The rows of ``frame`` whose ``config_id`` is one of ``ids``."""
    if "config_id" not in frame:
        return frame
    return frame[frame["config_id"].isin(ids)].reset_index(drop=True)


def _note_rows_of_no_config(
    name: str,
    module: ModuleType,
    held: set[str],
    path: Path,
    config: str | os.PathLike | None = None,
) -> None:
    """Say on stderr when ``path`` holds rows of configurations that neither size of the
    study has on any device (an edited config, or a feature map not registered now): the
    summary leaves them out without a word otherwise. With ``config`` (a TOML file of one's
    own), the configurations of both it and ``studies/NAME.toml`` are the study's."""
    known = set().union(*_known_ids(name, module).values())
    if config is not None:
        known |= set().union(*_known_ids(name, module, config).values())
    unknown = held - known
    if unknown:
        print(
            f"note: {path} holds rows of {len(unknown)} configuration(s) that study {name!r} "
            "no longer has (its config changed, or a feature map they name is not registered "
            "now); the summary leaves them out, and the rows stay",
            file=sys.stderr,
        )


def provenance(
    name: str, quick: bool, device: str, options: str = "", verb: str = "Written"
) -> str:
    """A markdown note of how and where results were produced: command (plus ``options``, extra
    command-line options), date (UTC), machine, versions and torch's thread count."""
    import platform
    from datetime import UTC, datetime

    import torch

    import kernelstudy

    if device == "cuda" and torch.cuda.is_available():
        machine = torch.cuda.get_device_name()
    else:
        machine = _cpu_model() or platform.machine()
    command = f"kernelstudy study {name}" + (" --quick" if quick else "") + f" --device {device}"
    plugins = os.environ.get(ENV_FEATURE_MAPS, "").strip()
    if plugins:  # maps defined outside kernelstudy: the command needs them to reproduce
        command = f"{ENV_FEATURE_MAPS}={shlex.quote(plugins)} {command}"
        path = os.environ.get("PYTHONPATH", "").strip()
        if path:  # where those modules were found
            command = f"PYTHONPATH={shlex.quote(path)} {command}"
    command += f" {options}" if options else ""
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    version = with_commit(kernelstudy.__version__)  # +git.<commit> in a checkout
    return (
        f"{verb} {date} by `{command}` on {machine} ({os.cpu_count()} CPUs, "
        f"{torch.get_num_threads()} torch threads); kernelstudy {version}, "
        f"torch {torch.__version__}, Python {platform.python_version()}."
    )


def _cpu_model() -> str | None:
    """The CPU's model name from ``/proc/cpuinfo`` (Linux), else None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def load_results(
    name: str,
    root: str | os.PathLike | None = None,
    quick: bool = True,
    table: str = RESULTS,
    device: str | None = None,
    config_file: str | os.PathLike | None = None,
) -> pd.DataFrame:
    """The rows of study ``name`` from ``ROOT/NAME/results.csv`` (``root`` defaults to
    :func:`results_dir`), or from ``ROOT/NAME/TABLE.csv`` for one of the study's extra tables
    (e.g. ``table="spectra"`` for the rank study's singular-value spectra). When that file is
    missing or empty (0 bytes), runs the study first (``quick`` sizes by default, on
    ``device``, else the CPU) and writes its outputs there; an extra table missing beside
    rows in ``results.csv`` is filled alone for the configurations those rows are of
    (``quick``'s size first; ``tables_only``), so the folder's results, summary and figures,
    perhaps of a full run, are not replaced.

    Rows of configurations the study no longer has (its config was edited since) are left
    out, with a warning. The quick and the full run share the file, so rows of one size
    come back: where rows only the quick and rows only the full size has are both there,
    those of ``quick``'s size. Rows of several devices raise a ValueError unless ``device``
    picks one (their timings are not to be averaged together). ``config_file``: the copy of
    the study's TOML a run was given (``--config``): its configurations are the current ones
    (without it, that run's rows were all left out as of configurations the study no longer
    has), and a study run or table filled here uses it too."""
    _check_name(name)
    if device is not None and device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES} or None, got {device!r}")
    if table != RESULTS:
        tables = study_tables(load_study(name))
        if table not in tables:
            known = ", ".join(repr(t) for t in (RESULTS, *tables))
            raise ValueError(f"study {name!r} has no table {table!r}; tables: {known}")
    path = Path(root if root is not None else results_dir()) / name / f"{table}.csv"
    # an empty file (0 bytes) is no rows, as for run_study: read as a frame without columns,
    # it failed every notebook with a KeyError
    known = None
    present = path.is_file() and path.stat().st_size > 0
    held = set() if table == RESULTS else _ids(_read_results(path.parent / RESULTS_FILE))
    if held and not present:  # beside results (a full run's, say): fill the table alone
        known = _known_ids(name, load_study(name), config_file)
        state = "empty" if path.is_file() else "no"
        _fill_table(name, quick, device, path, held, known, state, config_file)
    elif not present:
        state = "empty" if path.is_file() else "no"
        size = "quick" if quick else "full"
        print(f"{state} {path}: running the {size} '{name}' study", file=sys.stderr)
        run_study(
            name,
            quick=quick,
            out=path.parent,
            device=device or "cpu",
            verbose=False,
            progress=True,  # a notebook waits minutes here: show how far it is
            config_file=config_file,
        )
    frame = _read_results(path)
    if "config_id" not in frame or frame.empty:
        return frame
    known = known or _known_ids(name, load_study(name), config_file)
    if table != RESULTS:
        _note_unfilled(_ids(frame), held, name, quick, path, known, config_file)
    frame = _one_run(frame, name, quick, device, path, known)
    if table == RESULTS:
        _note_incomplete(frame, name, quick, path, known, config_file)
    return frame


def _study_command(name: str, quick: bool, device: str, config_file: str | Path | None) -> str:
    """The command line of the study run of this size, device and ``--config`` (the notes on
    partial results name it, with their options and ``--out``)."""
    flags = (" --quick" if quick else "") + f" --device {device}"
    if config_file is not None:
        flags += f" --config {shlex.quote(str(config_file))}"
    return f"kernelstudy study {name}{flags}"


def _note_unfilled(
    ids: set[str],
    held: set[str],
    name: str,
    quick: bool,
    path: Path,
    known: dict[tuple[bool, str], set[str]],
    config_file: str | os.PathLike | None = None,
) -> None:
    """Say on stderr, for each run (size, device), when extra table ``path`` (``ids``: the
    configurations it has rows of) lacks configurations of that run that ``results.csv``
    beside it holds (``held``), and how to fill them: a table filled for one size beside a
    run of the other (a full rank run's F sweep at N = 512), or whose fill was cut short,
    came back partial without a word. They are not computed here: a notebook's read would
    train models for minutes. A configuration both sizes have is ``quick``'s size's."""
    claimed: set[str] = set()
    for size in (quick, not quick):
        for device in DEVICES:
            run = held & known[(size, device)]
            lacking = run - ids - claimed
            claimed |= run
            if lacking:
                command = _study_command(name, size, device, config_file)
                out = shlex.quote(str(path.parent))
                print(
                    f"note: {path} has no rows for {len(lacking)} of the configurations "
                    f"{path.parent / RESULTS_FILE} holds of the {'quick' if size else 'full'} "
                    f"{device} run: `{command} --fill-tables --out {out}` computes them (and "
                    "that run's configurations not yet in results.csv, if any)",
                    file=sys.stderr,
                )


def _fill_table(
    name: str,
    quick: bool,
    device: str | None,
    path: Path,
    held: set[str],
    known: dict[tuple[bool, str], set[str]],
    state: str,
    config_file: str | os.PathLike | None = None,
) -> None:
    """Write extra table ``path`` (missing or empty) for the configurations with rows in
    ``results.csv`` beside it (``held``: their ids) of one run: ``quick``'s size first, on
    ``device`` (else the first device that has some), with ``tables_only``. Running the quick
    study there to fill it replaced a full run's summary.md and figures with quick ones, and
    added the quick-only configurations' rows to its results.csv. The run's configurations
    this does not fill (those of another size) are named by :func:`_note_unfilled`, not
    computed. ``known``: :func:`_known_ids`."""
    for size in (quick, not quick):
        for dev in [device] if device is not None else DEVICES:
            if known[(size, dev)] & held:
                print(
                    f"{state} {path}: filling it for the {'quick' if size else 'full'} {dev} "
                    f"run's configurations in {path.parent / RESULTS_FILE} (kept, as are "
                    f"{SUMMARY_FILE} and the figures)",
                    file=sys.stderr,
                )
                run_study(
                    name,
                    quick=size,
                    out=path.parent,
                    device=dev,
                    verbose=False,
                    tables_only=True,
                    progress=True,
                    config_file=config_file,
                )
                return
    print(
        f"note: {state} {path}, and no rows in {path.parent / RESULTS_FILE} are of a current "
        f"configuration of study {name!r}" + (f" on {device}" if device else "") + ": "
        f"`kernelstudy study {name} --fill-tables --out {shlex.quote(str(path.parent))}` (with "
        "--quick for the quick size) runs them and fills it",
        file=sys.stderr,
    )


def _configs_of_size(
    name: str, module: ModuleType, quick: bool, config: str | os.PathLike | None
) -> list[dict[str, Any]]:
    """The study's configurations at one size: [] where a ``config`` file (a copy of the
    study's TOML) leaves that size's entries out. A file with only ``[quick]`` failed in the
    summary of its second run, after computing ("config entry head_dims is missing", or a
    script's KeyError), when the summary looked up the full size's configurations."""
    try:
        return list(module.configs(load_params(name, quick, config)))
    except (ValueError, TypeError, KeyError):
        if config is None:  # the study's own file: its error is the study's to fix
            raise
        return []


def _known_ids(
    name: str, module: ModuleType, config: str | os.PathLike | None = None
) -> dict[tuple[bool, str], set[str]]:
    """``{(quick, device): config ids}`` of the study's configurations (of ``config``, a TOML
    file, if given), for both sizes and every device of :data:`DEVICES`."""
    known = {}
    for quick in (True, False):
        configs = _configs_of_size(name, module, quick, config)
        for device in DEVICES:
            known[(quick, device)] = {config_id(c, device) for c in configs}
    return known


def _note_incomplete(
    frame: pd.DataFrame,
    name: str,
    quick: bool,
    path: Path,
    known: dict[tuple[bool, str], set[str]],
    config_file: str | Path | None = None,
) -> None:
    """Say on stderr when the rows of one run cover only part of its configurations (an
    interrupted or ``--only`` run): a notebook would otherwise show a partial study as if
    complete. The run is the size (``quick``'s first) whose configurations hold every row;
    ``known``: :func:`_known_ids`; ``config_file``: the run's ``--config``, named in the
    command that runs the rest."""
    if frame.empty:
        return
    devices = sorted(set(frame["device"].astype(str))) if "device" in frame else ["cpu"]
    if len(devices) != 1:
        return
    present = set(frame["config_id"])
    for size in (quick, not quick):
        expected = known.get((size, devices[0]), set())
        if present <= expected:
            if len(present) < len(expected):
                note = (
                    f"note: {path} has rows of {len(present)} of the {len(expected)} "
                    f"configurations of the {'quick' if size else 'full'} {devices[0]} run"
                )
                if folder_in_use(path.parent):
                    note += f" so far: a run is at work in {path.parent} (it holds its .lock)"
                else:
                    command = _study_command(name, size, devices[0], config_file)
                    out = shlex.quote(str(path.parent))
                    note += (
                        f" (an interrupted or --only run); `{command} --out {out}` runs the rest"
                    )
                print(note, file=sys.stderr)
            return


def _one_run(
    frame: pd.DataFrame,
    name: str,
    quick: bool,
    device: str | None,
    path: Path,
    known: dict[tuple[bool, str], set[str]],
) -> pd.DataFrame:
    """The rows (with config ids) of the current configurations (a warning says how many
    others were left out), of one size (``quick``'s where both sizes are there) and one
    device; ``known``: :func:`_known_ids`."""
    # config_id → device (extra tables have no device column)
    device_of = {cid: d for (_, d), cids in known.items() for cid in cids}
    ids = {q: set().union(*(known[(q, d)] for d in DEVICES)) for q in (True, False)}
    has = {q: frame["config_id"].isin(ids[q]) for q in (True, False)}
    current = has[True] | has[False]
    if not current.all():  # rows of configurations the study no longer has (edited config)
        warnings.warn(
            f"{path}: left out {int((~current).sum())} rows of configurations that study "
            f"{name!r} no longer has (its config changed, or a feature map they name is not "
            "registered now; rows of a run given --config: pass its file as config_file); "
            "rerun it to replace them",
            UserWarning,
            stacklevel=3,
        )
        frame = frame[current]
        has = {q: h[current] for q, h in has.items()}
    if (has[True] & ~has[False]).any() and (has[False] & ~has[True]).any():  # both runs
        frame = frame[has[quick]]  # (configurations the sizes share are the same rows)
    if "device" in frame:
        row_device = frame["device"].astype(str)
    else:  # an extra table: the device is the one its config_id was made for
        row_device = frame["config_id"].map(device_of).astype(str)
    devices = sorted(set(row_device))
    if device is not None:
        frame = frame[row_device == device]
    elif len(devices) > 1:
        raise ValueError(f"{path} holds results of devices {devices}: pass device= to pick one")
    return frame.reset_index(drop=True)


def _save_figures(figures: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    paths = []
    for stem, fig in figures.items():
        path = out_dir / f"{stem}.png"
        atomic_write(
            path, lambda f, fig=fig: fig.savefig(f, format="png", dpi=120, bbox_inches="tight")
        )
        plt.close(fig)
        paths.append(path)
    return paths


def not_run_section(title: str, part: str) -> str:
    """A summary section for a study part with no rows yet (left out by ``--only``, or
    interrupted before it)."""
    return f"## {title}\n\nNot run yet: no rows of part {part!r} (`--only part={part}` runs it)."


def markdown_table(frame: pd.DataFrame, floatfmt: str = ".3g") -> str:
    """A GitHub-markdown table of ``frame`` (floats formatted with ``floatfmt``, NaN as '–')."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            if math.isnan(v):
                return "–"
            if (v.is_integer() and abs(v) < 1e9) or 1e3 <= abs(v) < 1e7:
                return f"{v:.0f}"
            return format(v, floatfmt)
        return str(v)

    header = [str(c) for c in frame.columns]
    body = [[cell(v) for v in row] for row in frame.itertuples(index=False)]
    widths = [
        max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)
    ]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in body
    ]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--quick --out --config --device --force --fill-tables --only`` (the options of
    every study) to ``parser``."""
    parser.add_argument("--quick", action="store_true", help="small sizes (minutes on a CPU)")
    parser.add_argument(
        "--out",
        default=None,
        type=nonempty_user_path,
        help="output directory (default results/NAME of the checkout, or of the working "
        "directory for an installed package, or beside $KERNELSTUDY_STUDIES_DIR where set; "
        "$KERNELSTUDY_RESULTS in place of results where set)",
    )
    parser.add_argument(
        "--config",
        default=None,
        type=user_path,
        metavar="PATH",
        help="a TOML file read instead of studies/NAME.toml (a copy with other settings)",
    )
    parser.add_argument(
        "--device", choices=DEVICES, default="cpu", help="where to run (default %(default)s)"
    )
    parser.add_argument("--force", action="store_true", help="recompute finished configurations")
    parser.add_argument(
        "--fill-tables",
        action="store_true",
        help="rerun finished configurations that lack rows in the study's extra tables "
        "(e.g. spectra.csv), writing only those rows; results.csv is kept",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="run only configurations with this entry (repeatable), e.g. --only part=gaussian",
    )
    return parser


def run_from_args(name: str, args: argparse.Namespace) -> pd.DataFrame:
    """:func:`run_study` with the options of :func:`add_arguments`."""
    return run_study(
        name,
        quick=args.quick,
        out=args.out,
        device=args.device,
        force=args.force,
        fill_tables=args.fill_tables,
        only=parse_only(args.only),
        config_file=args.config,
    )


def main(name: str, argv: Sequence[str] | None = None) -> int:
    """Entry of ``python studies/NAME.py [--quick] [--out DIR] [--config PATH] [--device D]
    [--force] [--fill-tables] [--only KEY=VALUE]``."""
    usable_output_streams()
    parser = add_arguments(argparse.ArgumentParser(prog=f"studies/{name}.py"))
    args = parser.parse_args(argv)
    try:
        with warnings_above_bars():
            run_from_args(name, args)
        sys.stdout.flush()  # here, not at exit: a closed pipe's error is caught below
    except BrokenPipeError:  # as `kernelstudy study ... | head`
        return closed_pipe_exit()
    except (ValueError, TypeError, OSError) as err:  # OSError: an unusable --out
        print(f"study {name}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # as `kernelstudy study`: the rows written so far are kept
        print(INTERRUPTED_RESUMABLE, file=sys.stderr)
        return 130
    return 0
