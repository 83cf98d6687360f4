"""The study runner shared by every study under ``studies/``.

A study is a script ``studies/NAME.py`` plus a config file ``studies/NAME.toml``.
The TOML holds shared parameters at top level and the sizes in two tables,
``[full]`` and ``[quick]`` (the chosen one overrides the top level). The script
defines plain functions:

- ``configs(params) -> list[dict]``: the configurations (flat JSON-able dicts);
- ``run_config(config, device) -> DataFrame | list[dict]``: result rows of one config;
- optional ``figures(frame, params) -> dict[str, Figure]`` and
  ``summarize(frame, params) -> str`` (a markdown table).

:func:`run_study` runs every configuration not yet in ``results.csv`` (one
config at a time, rewriting the CSV atomically after each, so an interrupted
study resumes where it stopped), then writes the figures (PNG) and ``summary.md``
from the rows of the current configurations. Rows get the config's entries as
columns plus ``study``, ``config_id`` (a hash of config and device) and ``device``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import sys
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

ENV_STUDIES_DIR = "KERNELSTUDY_STUDIES_DIR"
ENV_RESULTS_DIR = "KERNELSTUDY_RESULTS"
RESULTS_FILE = "results.csv"
SUMMARY_FILE = "summary.md"
DEVICES = ("cpu", "cuda")


def studies_dir() -> Path:
    """The ``studies/`` directory: ``$KERNELSTUDY_STUDIES_DIR`` if set, else the one next to the
    package (a source checkout), else ``./studies``."""
    if os.environ.get(ENV_STUDIES_DIR):  # an explicit setting is the only place looked at
        candidates = [Path(os.environ[ENV_STUDIES_DIR])]
    else:
        candidates = [Path(__file__).resolve().parents[1] / "studies", Path.cwd() / "studies"]
    for path in candidates:
        if path.is_dir() and any(path.glob("*.toml")):
            return path
    looked = ", ".join(str(p) for p in candidates)
    raise FileNotFoundError(
        f"cannot find the studies/ directory (looked in: {looked}); run from a kernelstudy "
        f"checkout or set {ENV_STUDIES_DIR}"
    )


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


def load_params(name: str, quick: bool = False) -> dict[str, Any]:
    """The parameters of study ``name``: top-level TOML entries updated (recursively) by the
    ``[quick]`` or ``[full]`` table, plus ``quick`` (bool)."""
    root = _check_name(name)
    with open(root / f"{name}.toml", "rb") as f:
        raw = tomllib.load(f)
    size = "quick" if quick else "full"
    params = {k: v for k, v in raw.items() if k not in ("quick", "full")}
    params = _merge(params, raw.get(size, {}))
    params["quick"] = bool(quick)
    return params


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``base`` updated by ``override``, recursing into tables present in both."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


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


def write_atomic(path: Path, write) -> None:
    """Write ``path`` via ``write(tmp_path)`` then ``os.replace`` (never a half-written file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _read_results(path: Path) -> pd.DataFrame:
    if not path.is_file():
        return pd.DataFrame()
    return pd.read_csv(path, keep_default_na=True)


def run_study(
    name: str,
    quick: bool = False,
    out: str | os.PathLike | None = None,
    device: str = "cpu",
    force: bool = False,
    verbose: bool = True,
) -> pd.DataFrame:
    """Run study ``name`` and return the result rows of its current configurations.

    Args:
        name: a study from :func:`list_studies`.
        quick: the ``[quick]`` sizes (a few minutes at most on a laptop CPU).
        out: output directory (default ``results/NAME`` under the working directory);
            gets ``results.csv``, ``summary.md`` and ``*.png``.
        device: ``"cpu"`` or ``"cuda"``.
        force: recompute configurations already in ``results.csv``.
        verbose: show tqdm progress and print the summary table and file paths.
    """
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available on this machine")
    module = load_study(name)
    params = load_params(name, quick)
    out_dir = Path(out) if out is not None else Path("results") / name
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / RESULTS_FILE

    configs = list(module.configs(params))
    ids = [config_id(c, device) for c in configs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"study {name!r} produced duplicate configurations")
    existing = _read_results(results_path)
    done = set(existing["config_id"]) if "config_id" in existing else set()
    if force and done:
        existing = existing[~existing["config_id"].isin(ids)]
        done = set()
    todo = [(c, i) for c, i in zip(configs, ids, strict=True) if i not in done]
    if verbose:
        skipped = len(configs) - len(todo)
        print(
            f"study {name} ({'quick' if quick else 'full'}, {device}): {len(configs)} "
            f"configurations, {skipped} already in {results_path}"
            + (", running the rest" if todo else ""),
            file=sys.stderr,
        )
    frame = existing
    start = time.perf_counter()
    for config, cid in tqdm(todo, desc=name, unit="config", disable=not verbose or not todo):
        rows = module.run_config(dict(config), device)
        new = pd.DataFrame(rows)
        if new.empty:
            new = pd.DataFrame([{"metric": "no_rows", "value": math.nan}])
        for key, value in config.items():
            if key not in new:
                new[key] = value if not isinstance(value, list | dict) else json.dumps(value)
        new.insert(0, "config_id", cid)
        new.insert(0, "study", name)
        new["device"] = device
        frame = pd.concat([frame, new], ignore_index=True) if not frame.empty else new
        write_atomic(results_path, lambda p, f=frame: f.to_csv(p, index=False))
    elapsed = time.perf_counter() - start

    result = _read_results(results_path)
    result = result[result["config_id"].isin(ids)].reset_index(drop=True)
    written = [results_path]
    figures = getattr(module, "figures", None)
    if callable(figures) and not result.empty:
        written += _save_figures(figures(result, params), out_dir)
    summary = ""
    if callable(getattr(module, "summarize", None)) and not result.empty:
        summary = module.summarize(result, params)
    doc = " ".join((module.__doc__ or name).strip().split("\n\n")[0].split())
    text = f"# {name} ({'quick' if quick else 'full'}, {device})\n\n{doc}\n\n{summary}\n"
    figs = [p.name for p in written if p.suffix == ".png"]
    if figs:
        text += "\n" + "\n".join(f"![{Path(f).stem}]({f})" for f in figs) + "\n"
    text += "\n" + provenance(name, quick, device) + "\n"
    write_atomic(out_dir / SUMMARY_FILE, lambda p: p.write_text(text))
    written.append(out_dir / SUMMARY_FILE)
    if verbose:
        print(text)
        print(f"ran {len(todo)} configurations in {elapsed:.1f} s; wrote:", file=sys.stderr)
        for p in written:
            print(f"  {p}", file=sys.stderr)
    return result


def provenance(name: str, quick: bool, device: str) -> str:
    """A markdown note of how and where results were produced: command, date (UTC), machine,
    versions and torch's thread count."""
    import platform
    from datetime import UTC, datetime

    import torch

    import kernelstudy

    if device == "cuda" and torch.cuda.is_available():
        machine = torch.cuda.get_device_name()
    else:
        machine = _cpu_model() or platform.machine()
    command = f"kernelstudy study {name}" + (" --quick" if quick else "") + f" --device {device}"
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"Written {date} by `{command}` on {machine} ({os.cpu_count()} CPUs, "
        f"{torch.get_num_threads()} torch threads); kernelstudy {kernelstudy.__version__}, "
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


def results_dir() -> Path:
    """Where notebooks look for study results: ``$KERNELSTUDY_RESULTS`` (relative paths from the
    repository root, e.g. ``studies/results`` for the committed full-size runs), else
    ``results/`` under the repository root (where ``kernelstudy study NAME`` writes from it)."""
    return studies_dir().parent / (os.environ.get(ENV_RESULTS_DIR) or "results")


def load_results(
    name: str, root: str | os.PathLike | None = None, quick: bool = True
) -> pd.DataFrame:
    """The rows of study ``name`` from ``ROOT/NAME/results.csv`` (``root`` defaults to
    :func:`results_dir`); when that file is missing, runs the study first (``quick`` sizes by
    default) and writes its outputs there."""
    _check_name(name)
    path = Path(root if root is not None else results_dir()) / name / RESULTS_FILE
    if not path.is_file():
        size = "quick" if quick else "full"
        print(f"no {path}: running the {size} '{name}' study", file=sys.stderr)
        run_study(name, quick=quick, out=path.parent, verbose=False)
    return _read_results(path)


def _save_figures(figures: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    paths = []
    for stem, fig in figures.items():
        path = out_dir / f"{stem}.png"
        write_atomic(
            path, lambda p, fig=fig: fig.savefig(p, format="png", dpi=120, bbox_inches="tight")
        )
        plt.close(fig)
        paths.append(path)
    return paths


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
    """Add ``--quick --out --device --force`` (the options of every study) to ``parser``."""
    parser.add_argument("--quick", action="store_true", help="small sizes (minutes on a CPU)")
    parser.add_argument("--out", default=None, help="output directory (default results/NAME)")
    parser.add_argument("--device", choices=DEVICES, default="cpu")
    parser.add_argument("--force", action="store_true", help="recompute finished configurations")
    return parser


def main(name: str, argv: Sequence[str] | None = None) -> int:
    """Entry of ``python studies/NAME.py [--quick] [--out DIR] [--device D] [--force]``."""
    parser = add_arguments(argparse.ArgumentParser(prog=f"studies/{name}.py"))
    args = parser.parse_args(argv)
    try:
        run_study(name, quick=args.quick, out=args.out, device=args.device, force=args.force)
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"study {name}: error: {err}", file=sys.stderr)
        return 1
    return 0
