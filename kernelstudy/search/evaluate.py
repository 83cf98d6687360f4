"""The evaluation protocol: re-train each variant's best configuration with N seeds.

For every variant, the complete trial with the best validation accuracy is rebuilt
(``optuna.trial.FixedTrial`` over its parameters) and trained with N seeds, ``0, 1, …``
without the search's own (:func:`evaluation_seeds`); the weights of the best validation
evaluation are restored and scored on the test split. One row per run goes to
``<out>/<name>/evaluation.csv`` (rewritten atomically after each run), so an interrupted
evaluation resumes: runs already there for the same trial (number and parameters) and seed
are skipped. The summary (``evaluation_summary.csv``, and the report) has, per variant, the
test accuracy's mean, std (ddof=1) and run count ``n``, ``best_by_val`` (the test accuracy
of the run of highest validation accuracy) and ``max_test`` (the highest test accuracy of
the runs, chosen on the test set), over the runs of its current best trial: runs of a trial
that a longer search has since beaten stay in the file but count no more, and every seed run
so far counts (``--seeds 2`` after ``--seeds 5`` still has n = 5). A run whose training
diverges is recorded (``status`` "diverged: …", no test accuracy) and the others go on; the
summary counts such runs, and any without a finite test accuracy, in ``diverged``, apart
from ``n``. Accuracies here are fractions (0–1); the report gives %.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
import pandas as pd

from ..arguments import check_count
from ..files import atomic_write_text, exclusive_folder, read_csv_table
from ..progress import tqdm
from .config import SearchConfig, load_config
from .objective import OverBudget, prepare_data, suggest_settings, train_run
from .runner import (
    SETTINGS_ATTR,
    best_trial,
    check_device,
    check_settings,
    results_folder,
    search_command,
    searched_storage_url,
    select_variants,
    variant_settings,
)
from .storage import load_study, open_storage, redact

EVALUATION = "evaluation.csv"
SUMMARY = "evaluation_summary.csv"
COLUMNS = [
    "variant",
    "trial",
    "seed",
    "test_accuracy",
    "val_accuracy",
    "params_model",
    "params_feature_map",
    "feature_dim",
    "train_time_s",
    "peak_memory_bytes",
    "params",
    "status",
    "settings",
    "device",  # where the run trained, and its autocast dtype: a summary pools every run
    "amp",
]


def evaluation_path(config: SearchConfig, out: str | Path | None = None) -> Path:
    """``OUT/NAME/evaluation.csv``: the per-seed test accuracies of ``kernelstudy evaluate``."""
    return results_folder(out) / config.name / EVALUATION


def read_evaluation(path: str | Path) -> pd.DataFrame:
    """The per-seed rows written so far (an empty frame when there are none); variant
    labels read as written ("256" and "NA" stay text)."""
    table = read_csv_table(path, text_columns=["variant", "settings"])
    if table is None:
        return pd.DataFrame(columns=COLUMNS)
    if "settings" in table:  # read as text (a key of digits is no number); "" = not recorded
        table["settings"] = table["settings"].replace("", None)
    return table


def trial_params(trial: optuna.trial.FrozenTrial) -> str:
    """A trial's parameters as sorted JSON: with its number, what an evaluation run is of
    (another storage, or a study made afresh, may give the number to other parameters)."""
    return json.dumps(trial.params, sort_keys=True)


def settings_key(settings: Mapping[str, Any]) -> str:
    """A short hash of a variant's :func:`~.runner.variant_settings`: an evaluation row
    records the settings it was trained with."""
    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def search_seed(settings: Mapping[str, Any] | None) -> int:
    """The seed a search trained its trials with, from a variant's recorded
    :func:`~.runner.variant_settings` (``[train] seed``; 0 by default, and where none were
    recorded)."""
    return int(((settings or {}).get("train") or {}).get("seed", 0))


def evaluation_seeds(count: int, searched_with: int) -> list[int]:
    """The ``count`` seeds an evaluation trains a best trial with: 0, 1, … without
    ``searched_with``, the search's own. Its run of the best trial is the one that won the
    search on validation accuracy: as one of the n runs it would lift the mean (the winner's
    curse) and, by that validation accuracy, likely be best_by_val's pick."""
    return [seed for seed in range(count + 1) if seed != searched_with][:count]


def current_runs(
    runs: pd.DataFrame,
    best: Mapping[str, optuna.trial.FrozenTrial],
    keys: Mapping[str, str] | None = None,
    searched_with: Mapping[str, int] | None = None,
) -> pd.DataFrame:
    """The rows of ``runs`` of each variant's current ``best`` trial, any seed but the one
    ``searched_with`` gives for the variant (the search's own run, :func:`evaluation_seeds`;
    rows of it from evaluations before it was left out stay in the file), trained with
    the settings whose :func:`settings_key` ``keys`` gives for the variant (a new study of
    a changed config numbers its trials, and seeds its sampler, as the old one did; rows
    written before parameters or settings were recorded match without them)."""
    if runs.empty:
        return runs
    searched_with = searched_with or {}
    missing = pd.Series(None, index=runs.index)
    params = runs["params"] if "params" in runs else missing
    settings = runs["settings"] if "settings" in runs else missing
    keys = keys or {}
    keep = [
        label in best
        and int(trial) == best[label].number
        and (pd.isna(p) or p == trial_params(best[label]))
        and (pd.isna(key) or label not in keys or key == keys[label])
        and int(seed) != searched_with.get(label)
        for label, trial, seed, p, key in zip(
            runs["variant"], runs["trial"], runs["seed"], params, settings, strict=True
        )
    ]
    return runs[keep]


def diverged(runs: pd.DataFrame) -> pd.Series:
    """True for the rows of runs whose training diverged (no test accuracy)."""
    if "status" not in runs:
        return pd.Series(False, index=runs.index)
    return runs["status"].astype(str).str.startswith("diverged")


#: The columns of :func:`summarize_evaluation` (after ``variant``).
SUMMARY_COLUMNS = ["mean", "std", "n", "best_by_val", "max_test", "diverged"]


def summarize_evaluation(runs: pd.DataFrame) -> pd.DataFrame:
    """Test accuracy per variant (in row order) over its runs with a finite test accuracy:
    ``mean``, ``std`` (ddof=1: NaN for one run) and their count ``n``; ``best_by_val``,
    the test accuracy of the run of highest validation accuracy (ties: the lowest seed;
    nothing is chosen on the test set); ``max_test``, the highest test accuracy of the n
    runs (chosen on the test set: an optimistic bound). ``diverged`` counts the runs left
    out of ``n``: training diverged, or no finite test accuracy."""
    if runs.empty:
        return pd.DataFrame(columns=["variant", *SUMMARY_COLUMNS])
    order = list(dict.fromkeys(runs["variant"]))
    test = pd.to_numeric(runs["test_accuracy"], errors="coerce")
    counted = ~diverged(runs) & test.map(math.isfinite)
    ok = runs[counted].assign(test_accuracy=test[counted])
    acc = ok.groupby("variant", sort=False)["test_accuracy"]
    table = pd.DataFrame(
        {"mean": acc.mean(), "std": acc.std(ddof=1), "n": acc.count(), "max_test": acc.max()}
    ).reindex(order)
    table["n"] = table["n"].fillna(0).astype(int)
    table["best_by_val"] = pd.Series(
        {label: _best_by_val(group) for label, group in ok.groupby("variant", sort=False)},
        dtype=float,
    ).reindex(order)
    lost = (~counted).groupby(runs["variant"], sort=False).sum().reindex(order)
    table["diverged"] = lost.astype(int)
    return table[SUMMARY_COLUMNS].rename_axis("variant").reset_index()


def _best_by_val(runs: pd.DataFrame) -> float:
    """The test accuracy of the run of highest validation accuracy (ties, and runs without
    one: the lowest seed first); NaN when no run has a validation accuracy."""
    if "val_accuracy" not in runs:  # rows from before it was recorded
        return math.nan
    val = pd.to_numeric(runs["val_accuracy"], errors="coerce")
    if not val.notna().any():
        return math.nan
    ranked = runs.assign(_val=val).dropna(subset=["_val"])
    keys = ["_val", "seed"] if "seed" in ranked else ["_val"]
    ranked = ranked.sort_values(keys, ascending=[False, True][: len(keys)], kind="stable")
    return float(ranked["test_accuracy"].iloc[0])


def run_evaluation(
    config: SearchConfig | str | Path,
    seeds: int = 5,
    storage: str | None = None,
    out: str | Path | None = None,
    quick: bool = False,
    variants: Sequence[str] | None = None,
    device: str | None = None,
) -> pd.DataFrame:
    """Re-train each variant's best trial with ``seeds`` seeds; return the summary frame.

    Variants without a complete trial (e.g. every trial over budget) are skipped
    with a message. Writes ``evaluation.csv`` and ``evaluation_summary.csv``.
    """
    if not isinstance(config, SearchConfig):
        config = load_config(config, quick=quick)
    seeds = check_count("seeds", seeds, 1)
    check_device(config, device)
    chosen = select_variants(config, variants)
    url = searched_storage_url(config, storage, out, quick)
    command = search_command(config, quick, out, storage, [v.label for v in chosen])
    out = results_folder(out)
    open_storage(url)
    check_settings(config, chosen, url)  # the best trials re-train as they were searched
    data = prepare_data(config, out)
    best: dict[str, optuna.trial.FrozenTrial] = {}
    searched = {s.study_name for s in optuna.get_all_study_summaries(open_storage(url))}
    if not any(config.study_name(v) in searched for v in chosen):
        raise ValueError(
            f"{redact(url)} holds no study of {config.name} "
            f"({', '.join(v.label for v in chosen)}): run `{command}` first, or give "
            "the --storage/--out it used"
        )
    for variant in chosen:
        if config.study_name(variant) not in searched:  # e.g. after a --variant search
            print(
                f"evaluate {config.name}: {variant.label} has not been searched; skipped",
                file=sys.stderr,
            )
            continue
        trial = best_trial(load_study(url, config.study_name(variant)))
        if trial is None:
            print(
                f"evaluate {config.name}: {variant.label} has no complete trial; skipped",
                file=sys.stderr,
            )
            continue
        best[variant.label] = trial
    path = evaluation_path(config, out)
    path.parent.mkdir(parents=True, exist_ok=True)
    settings = {v.label: variant_settings(config, v) for v in config.variants}
    settings.update(_searched_settings(config, url, exclude=best))  # the others': as they ran
    keys = {label: settings_key(s) for label, s in settings.items()}
    searched_with = {label: search_seed(s) for label, s in settings.items()}
    plan = [
        (variant, best[variant.label], seed)
        for variant in chosen
        if variant.label in best
        for seed in evaluation_seeds(seeds, searched_with[variant.label])
    ]
    with exclusive_folder(path.parent, f"evaluate {config.name}"):
        return _evaluate(config, url, data, plan, best, keys, searched_with, path, seeds, device)


def _evaluate(
    config: SearchConfig,
    url: str,
    data: Any,
    plan: list[tuple[Any, optuna.trial.FrozenTrial, int]],
    best: dict[str, optuna.trial.FrozenTrial],
    keys: dict[str, str],
    searched_with: dict[str, int],
    path: Path,
    seeds: int,
    device: str | None,
) -> pd.DataFrame:
    """The runs of ``plan`` not yet in ``path``, then the summaries (under the folder lock:
    two evaluations each rewrote the whole file from their own copy)."""
    runs = read_evaluation(path)
    current = current_runs(runs, best, keys, searched_with)
    done = {(r.variant, int(r.seed)) for r in current.itertuples()}
    todo = [p for p in plan if (p[0].label, p[2]) not in done]
    over: set[str] = set()
    bar = tqdm(todo, desc=f"evaluate {config.name}", unit="run", disable=not todo)  # no 0-run bar
    for variant, trial, seed in bar:
        if variant.label in over:
            continue
        settings = suggest_settings(optuna.trial.FixedTrial(trial.params), config, variant)
        try:
            result = {**train_run(config, variant, settings, data, seed, device), "status": "ok"}
        except OverBudget as err:  # a study searched under the older rule (share of the whole)
            print(
                f"evaluate {config.name}: {variant.label}: its best trial {trial.number} is over "
                f"the budget ({err}); skipped",
                file=sys.stderr,
            )
            over.add(variant.label)
            continue
        except FloatingPointError as err:  # recorded, so the other runs go on and a rerun
            # does not repeat it (the same seed diverges again)
            print(f"evaluate {config.name}: {variant.label} seed {seed}: {err}", file=sys.stderr)
            result = {"test_accuracy": float("nan"), "status": f"diverged: {err}"}
        row = {"variant": variant.label, "trial": trial.number, "seed": seed, **result}
        row["params"], row["settings"] = trial_params(trial), keys[variant.label]
        new = pd.DataFrame([{k: row.get(k) for k in COLUMNS}])
        if runs.empty:
            runs = new
        else:  # all-NA columns (a diverged run's) left out of the concat: pandas 2 warns
            columns = runs.columns.union(new.columns, sort=False)
            filled = new.dropna(axis=1, how="all")
            runs = pd.concat([runs, filled], ignore_index=True).reindex(columns=columns)
        atomic_write_text(path, runs.to_csv(index=False))
    current = current_runs(runs, best, keys, searched_with)
    for label, count in current.groupby("variant")["seed"].nunique().items():
        if count > seeds:  # the summary, as the report, counts every seed evaluated so far
            print(
                f"evaluate {config.name}: {label} has runs of {count} seeds; the summary counts "
                f"them all, not the first {seeds}",
                file=sys.stderr,
            )
    # the summary file covers every variant evaluated so far, not only those chosen now
    every = {**_searched_best(config, url, exclude=best), **best}
    atomic_write_text(
        path.parent / SUMMARY,
        summarize_evaluation(current_runs(runs, every, keys, searched_with)).to_csv(index=False),
    )
    return summarize_evaluation(current)


def _searched_settings(
    config: SearchConfig, url: str, exclude: Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
    """The settings each searched variant's study recorded (not ``exclude``'s): the summary
    file keeps the evaluations of those settings, as the report does, though the config may
    have changed since."""
    out = {}
    for summary in optuna.get_all_study_summaries(open_storage(url)):
        for variant in config.variants:
            if summary.study_name == config.study_name(variant) and variant.label not in exclude:
                stored = summary.user_attrs.get(SETTINGS_ATTR)
                if stored is not None:
                    out[variant.label] = stored
    return out


def _searched_best(
    config: SearchConfig, url: str, exclude: Mapping[str, Any]
) -> dict[str, optuna.trial.FrozenTrial]:
    """The best trial of every variant of ``config`` searched in ``url`` (not ``exclude``)."""
    searched = {s.study_name for s in optuna.get_all_study_summaries(open_storage(url))}
    out = {}
    for variant in config.variants:
        name = config.study_name(variant)
        if variant.label in exclude or name not in searched:
            continue
        trial = best_trial(load_study(url, name))
        if trial is not None:
            out[variant.label] = trial
    return out
