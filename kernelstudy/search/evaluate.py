"""The evaluation protocol: re-train each variant's best configuration with N seeds.

For every variant, the complete trial with the best validation accuracy is
rebuilt (``optuna.trial.FixedTrial`` over its parameters) and trained with seeds
``0 … N-1``; the weights of the best validation evaluation are restored and
scored on the test split. One row per run goes to ``<out>/<name>/evaluation.csv``
(rewritten atomically after each run), so an interrupted evaluation resumes:
runs already there for the same trial and seed are skipped. The summary
(``evaluation_summary.csv``) has the mean, std and best test accuracy per variant.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optuna
import pandas as pd

from ..files import atomic_write_text, read_csv_table
from ..progress import tqdm
from ..train import resolve_device
from .config import SearchConfig, load_config
from .objective import prepare_data, suggest_settings, train_run
from .runner import DEFAULT_OUT, best_trial, check_settings, select_variants, storage_url
from .storage import load_study, open_storage

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
]


def evaluation_path(config: SearchConfig, out: str | Path = DEFAULT_OUT) -> Path:
    """``OUT/NAME/evaluation.csv``: the per-seed test accuracies of ``kernelstudy evaluate``."""
    return Path(out) / config.name / EVALUATION


def read_evaluation(path: str | Path) -> pd.DataFrame:
    """The per-seed rows written so far (an empty frame when there are none)."""
    table = read_csv_table(path)
    return pd.DataFrame(columns=COLUMNS) if table is None else table


def summarize_evaluation(runs: pd.DataFrame) -> pd.DataFrame:
    """Mean, std, best test accuracy and the run count per variant (in row order)."""
    if runs.empty:
        return pd.DataFrame(columns=["variant", "mean", "std", "best", "n"])
    order = list(dict.fromkeys(runs["variant"]))
    acc = runs.groupby("variant", sort=False)["test_accuracy"]
    table = pd.DataFrame(
        {"mean": acc.mean(), "std": acc.std(ddof=1), "best": acc.max(), "n": acc.count()}
    )
    return table.reindex(order).rename_axis("variant").reset_index()


def run_evaluation(
    config: SearchConfig | str | Path,
    seeds: int = 5,
    storage: str | None = None,
    out: str | Path = DEFAULT_OUT,
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
    if not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"seeds must be a positive int, got {seeds!r}")
    if device is not None:
        resolve_device(device)
    chosen = select_variants(config, variants)
    url = storage_url(config, storage, out)
    open_storage(url)
    check_settings(config, chosen, url)  # the best trials re-train as they were searched
    data = prepare_data(config, out)
    plan: list[tuple[Any, optuna.trial.FrozenTrial, int]] = []
    for variant in chosen:
        best = best_trial(load_study(url, config.study_name(variant)))
        if best is None:
            print(
                f"evaluate {config.name}: {variant.label} has no complete trial; skipped",
                file=sys.stderr,
            )
            continue
        plan += [(variant, best, seed) for seed in range(seeds)]
    path = evaluation_path(config, out)
    path.parent.mkdir(parents=True, exist_ok=True)
    runs = read_evaluation(path)
    done = {(r.variant, int(r.trial), int(r.seed)) for r in runs.itertuples()}
    todo = [p for p in plan if (p[0].label, p[1].number, p[2]) not in done]
    for variant, trial, seed in tqdm(todo, desc=f"evaluate {config.name}", unit="run"):
        settings = suggest_settings(optuna.trial.FixedTrial(trial.params), config, variant)
        result = train_run(config, variant, settings, data, seed, device)
        row = {"variant": variant.label, "trial": trial.number, "seed": seed, **result}
        new = pd.DataFrame([{k: row.get(k) for k in COLUMNS}])
        runs = new if runs.empty else pd.concat([runs, new], ignore_index=True)
        atomic_write_text(path, runs.to_csv(index=False))
    current = {(v.label, t.number, s) for v, t, s in plan}
    keep = [(r.variant, int(r.trial), int(r.seed)) in current for r in runs.itertuples()]
    summary = summarize_evaluation(runs[keep])
    atomic_write_text(path.parent / SUMMARY, summary.to_csv(index=False))
    return summary
