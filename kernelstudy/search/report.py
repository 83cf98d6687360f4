"""Results of searches and evaluations: the paper-shaped table and the cost figures.

``kernelstudy report CONFIG_OR_STUDY ...`` reads the studies (and the evaluation
CSV when :mod:`.evaluate` has run) of one or more configs and writes, under
``<out>/<name>/`` (``<out>/report/`` for several):

- ``table.csv`` / ``table.md``: rows are variants, columns are tasks × (mean, std,
  best, n) of test accuracy in %, as in Yorsh & Kovalenko's table, the number of
  evaluation runs that diverged (``diverged``, not counted in n), and the published
  number (``paper``) where the variant and task match. Without an evaluation a
  variant's entry is its best trial's test accuracy (n = 1, diverged missing).
- ``paper_reference.csv`` / ``.md``: the published table itself.
- ``trials.csv``: every trial of every study, with its sizes and costs (re-queued
  duplicates, pruned before they ran, left out).
- ``search_summary.csv``: trial counts and the best trial per variant.
- figures: ``accuracy_vs_parameters.png``, ``accuracy_vs_feature_dim.png``,
  ``accuracy_vs_train_time.png``, ``optimization_history.png``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import pandas as pd

from ..files import atomic_write, atomic_write_text
from .config import load_config
from .evaluate import (
    EVALUATION,
    current_runs,
    read_evaluation,
    settings_key,
    summarize_evaluation,
)
from .runner import (
    DEFAULT_OUT,
    SETTINGS_ATTR,
    best_trial,
    searched_storage_url,
    study_row,
    unshared_settings,
)
from .storage import existing_database, existing_storage_url, open_storage, redact
from .workers import is_duplicate

#: Tasks whose ``val`` split reads the test data (IMDB has none: ``tasks/text.py``, as LRA).
VAL_IS_TEST = ("text",)

#: Yorsh & Kovalenko's published test accuracies (%, mean of five runs, their Table 1); their
#: Matching is LRA Retrieval. Their "linear kernel" is the single-layer FFN Softplus(XW), not
#: elu+1 (which their table does not have).
PAPER: dict[str, dict[str, float]] = {
    "Transformer": {"text": 64.27, "retrieval": 57.46, "listops": 36.37},
    "Linear kernel": {"text": 65.77, "retrieval": 73.51, "listops": 18.54},
    "1xGLU": {"text": 65.82, "retrieval": 72.17, "listops": 18.67},
    "2xGLU": {"text": 65.99, "retrieval": 73.36, "listops": 18.42},
    "3xGLU": {"text": 65.87, "retrieval": 72.60, "listops": 18.68},
    "Orth. linear kernel": {"text": 65.86, "retrieval": 72.63, "listops": 18.19},
    "1xOGLU": {"text": 65.95, "retrieval": 72.50, "listops": 18.45},
    "2xOGLU": {"text": 66.02, "retrieval": 72.96, "listops": 18.32},
    "3xAOGLU": {"text": 66.06, "retrieval": 72.57, "listops": 18.45},
}
#: Our variant labels → the paper's row names.
PAPER_LABELS = {
    "Transformer": "Transformer",
    "Softplus FFN": "Linear kernel",
    "Orthogonal FFN": "Orth. linear kernel",
    **{label: label for label in ("1xGLU", "2xGLU", "3xGLU", "1xOGLU", "2xOGLU", "3xAOGLU")},
}
PAPER_TASKS = {"text": "Text", "retrieval": "Matching", "listops": "ListOps"}
FIGURES = (
    "accuracy_vs_parameters",
    "accuracy_vs_feature_dim",
    "accuracy_vs_train_time",
    "optimization_history",
)


@dataclass
class StudySet:
    """The variant studies of one config (or study-name prefix) and the evaluation runs of
    each variant's current best trial."""

    name: str
    task: str
    studies: dict[str, optuna.Study]
    evaluation: pd.DataFrame


def load_results(
    target: str | Path, storage: str | None = None, out: str | Path = DEFAULT_OUT, quick=False
) -> StudySet:
    """The studies of ``target``: a config file, or a study name (prefix of ``NAME/label``)."""
    path = Path(target)
    if path.suffix == ".toml" or path.is_file():
        config = load_config(path, quick=quick)
        name, url = config.name, searched_storage_url(config, storage, out, quick)
        labels = [config.study_name(v) for v in config.variants]
    else:
        name = str(target)
        hint = f"{target!r} is no config file either; give one, or a study name with --storage URL"
        url = existing_database(storage, hint) if storage else existing_storage_url(out, name, hint)
        labels = None
    store = open_storage(url)
    names = [s.study_name for s in optuna.get_all_study_summaries(store)]
    if labels is None:
        labels = [n for n in names if n.startswith(f"{name}/")]
    missing = [n for n in labels if n not in names]
    if not labels or len(missing) == len(labels):
        raise ValueError(
            f"no studies of {name!r} in {redact(url)} (has: {', '.join(names) or 'none'}); "
            "run `kernelstudy search` first"
        )
    studies = {
        n.split("/", 1)[1]: optuna.load_study(study_name=n, storage=store)
        for n in labels
        if n in names
    }
    task = next(iter(studies.values())).user_attrs.get("task", "?")
    if task in VAL_IS_TEST:
        print(
            f"report {name}: warning: task {task!r} has no validation split (its val reads "
            "the test data), so the search chose on the test set and test accuracies are "
            "optimistic",
            file=sys.stderr,
        )
    unshared = unshared_settings(studies)
    if unshared:
        print(
            f"report {name}: warning: its variants were searched with different "
            f"{', '.join(unshared)} settings, so their rows are not comparable",
            file=sys.stderr,
        )
    best = {label: best_trial(study) for label, study in studies.items()}
    keys = {  # the settings each study's trials ran with: evaluation rows of others are left
        label: settings_key(study.user_attrs[SETTINGS_ATTR])
        for label, study in studies.items()
        if SETTINGS_ATTR in study.user_attrs
    }
    evaluation = current_runs(
        read_evaluation(Path(out) / name / EVALUATION),
        {label: trial for label, trial in best.items() if trial is not None},
        keys,
    )
    return StudySet(name, task, studies, evaluation)


def trials_frame(results: Sequence[StudySet]) -> pd.DataFrame:
    """One row per trial of every study: state, value, parameters and user attrs.

    Duplicate re-queues (pruned before they ran, see :mod:`.workers`) are left out."""
    rows: list[dict[str, Any]] = []
    for res in results:
        for label, study in res.studies.items():
            for t in study.get_trials(deepcopy=False):
                if is_duplicate(t):
                    continue
                row: dict[str, Any] = {
                    "config": res.name,
                    "task": res.task,
                    "variant": label,
                    "number": t.number,
                    "state": t.state.name,
                    "val_accuracy": t.value,
                }
                row.update(t.user_attrs)
                row.update({f"param.{k}": v for k, v in t.params.items()})
                rows.append(row)
    if not rows:  # studies made but no trial yet: the columns still exist
        return pd.DataFrame(
            columns=["config", "task", "variant", "number", "state", "val_accuracy"]
        )
    return pd.DataFrame(rows)


def results_table(results: Sequence[StudySet]) -> pd.DataFrame:
    """The paper-shaped table: index variants; columns (task, mean/std/best/n/diverged
    [/paper]), accuracies in %; ``n`` counts the evaluation runs that finished and
    ``diverged`` those whose training diverged (missing before ``evaluate``).
    A task reported by two configs is headed ``task (config name)``; two results of one
    name (a config given twice) raise ValueError, as their columns would share a heading."""
    names = [res.name for res in results]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"report: {', '.join(map(repr, twice))} given more than once")
    tasks = [res.task for res in results]
    frames = []
    for res in results:
        summary = summarize_evaluation(res.evaluation).set_index("variant")
        rows = {}
        for label, study in res.studies.items():
            if label in summary.index:  # evaluated: n = 0 when every run diverged
                s = summary.loc[label]
                rows[label] = {
                    "mean": 100 * s["mean"],
                    "std": 100 * s["std"],
                    "best": 100 * s["best"],
                    "n": int(s["n"]),
                    "diverged": int(s["diverged"]),
                }
            else:  # not evaluated (yet): the search trial's test accuracy, one run
                acc = study_row(study, label)["test_accuracy"]
                pct = math.nan if acc is None else 100 * acc
                rows[label] = {
                    "mean": pct,
                    "std": math.nan,
                    "best": pct,
                    "n": int(acc is not None),
                    "diverged": math.nan,  # no evaluation runs to count
                }
            paper = PAPER.get(PAPER_LABELS.get(label, ""), {}).get(res.task)
            if paper is not None:
                rows[label]["paper"] = paper
        frame = pd.DataFrame.from_dict(rows, orient="index")
        head = res.task if tasks.count(res.task) == 1 else f"{res.task} ({res.name})"
        frame.columns = pd.MultiIndex.from_product([[head], frame.columns])
        frames.append(frame)
    table = pd.concat(frames, axis=1)
    order = list(dict.fromkeys(label for res in results for label in res.studies))
    table = table.reindex(order).rename_axis("variant")
    for column in [c for c in table.columns if c[1] in ("n", "diverged")]:  # NaN: float
        table[column] = table[column].astype("Int64")
    return table


def paper_table() -> pd.DataFrame:
    """Yorsh & Kovalenko's published table (test accuracy, %)."""
    frame = pd.DataFrame.from_dict(PAPER, orient="index")[list(PAPER_TASKS)]
    return frame.rename(columns=PAPER_TASKS).rename_axis("model")


def markdown(frame: pd.DataFrame, digits: int = 2) -> str:
    """A GitHub-markdown table (MultiIndex columns joined by a space; NaN as '–')."""
    flat = frame.reset_index()
    header = [" ".join(str(p) for p in c if p) if isinstance(c, tuple) else str(c) for c in flat]

    def cell(v: Any) -> str:
        if v is pd.NA:
            return "–"
        if isinstance(v, float):
            return "–" if math.isnan(v) else f"{v:.{digits}f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in flat.itertuples(False)]
    return "\n".join(lines) + "\n"


def figures(trials: pd.DataFrame) -> dict[str, Any]:
    """The four figures (matplotlib Figures) from :func:`trials_frame`. The backend is left
    as it is (a notebook's inline backend shows them)."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid")
    done = trials[trials["state"] == "COMPLETE"].copy()
    if "test_accuracy" not in done:
        done["test_accuracy"] = math.nan
    done["accuracy"] = 100 * done["test_accuracy"].astype(float)
    done["label"] = done["variant"] + (" / " + done["task"] if done["task"].nunique() > 1 else "")
    out: dict[str, Any] = {}
    specs = [
        ("accuracy_vs_parameters", "params_feature_map", "extra parameters (feature maps)", True),
        ("accuracy_vs_feature_dim", "feature_dim", "feature dimension per head", False),
        ("accuracy_vs_train_time", "train_time_s", "training time (s)", False),
    ]
    for stem, column, xlabel, symlog in specs:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        data = done.dropna(subset=[column]) if column in done else done.iloc[:0]
        if len(data):
            sns.scatterplot(data=data, x=column, y="accuracy", hue="label", style="label", ax=ax)
            ax.legend(fontsize=7, loc="best")
        if symlog:
            ax.set_xscale("symlog", linthresh=10)
            top = float(data[column].max()) if len(data) else 10.0
            ax.set_xlim(-0.5, max(top, 10.0) * 2)
        ax.set(xlabel=xlabel, ylabel="test accuracy (%)", title=f"accuracy vs {xlabel}")
        out[stem] = fig
    fig, ax = plt.subplots(figsize=(6.5, 4))
    # complete trials only, as best_trial: a pruned trial's value is its last report
    hist = trials[trials["state"] == "COMPLETE"].dropna(subset=["val_accuracy"])
    hist = hist.sort_values(["config", "variant", "number"])
    if len(hist):
        hist = hist.assign(
            best=hist.groupby(["config", "variant"])["val_accuracy"].cummax() * 100,
            label=hist["variant"] + (" / " + hist["task"] if hist["task"].nunique() > 1 else ""),
        )
        sns.lineplot(data=hist, x="number", y="best", hue="label", marker="o", ax=ax)
        ax.legend(fontsize=7, loc="best")
    ax.set(xlabel="trial", ylabel="best validation accuracy so far (%)")
    ax.set_title("optimization history")
    out["optimization_history"] = fig
    return out


def write_report(
    targets: Sequence[str | Path],
    storage: str | None = None,
    out: str | Path = DEFAULT_OUT,
    quick: bool = False,
) -> dict[str, Path]:
    """Write the table, reference table, trials, summary and figures; return their paths."""
    import matplotlib.pyplot as plt

    if not targets:
        raise ValueError("report needs at least one config file or study name")
    results = [load_results(t, storage, out, quick) for t in targets]
    folder = Path(out) / (results[0].name if len(results) == 1 else "report")
    table = results_table(results)
    trials = trials_frame(results)
    summary = pd.DataFrame(
        [
            {"config": r.name, "task": r.task, **study_row(s, label)}
            for r in results
            for label, s in r.studies.items()
        ]
    )
    paths = {
        "table_csv": folder / "table.csv",
        "table_md": folder / "table.md",
        "paper_csv": folder / "paper_reference.csv",
        "paper_md": folder / "paper_reference.md",
        "trials": folder / "trials.csv",
        "summary": folder / "search_summary.csv",
    }
    atomic_write_text(paths["table_csv"], table.round(2).to_csv())
    atomic_write_text(paths["table_md"], markdown(table))
    atomic_write_text(paths["paper_csv"], paper_table().to_csv())
    atomic_write_text(paths["paper_md"], markdown(paper_table()))
    atomic_write_text(paths["trials"], trials.to_csv(index=False))
    atomic_write_text(paths["summary"], summary.to_csv(index=False))
    for stem, fig in figures(trials).items():
        path = folder / f"{stem}.png"
        save = lambda f, fig=fig: fig.savefig(f, format="png", dpi=110, bbox_inches="tight")  # noqa: E731
        atomic_write(path, save)
        plt.close(fig)
        paths[stem] = path
    return paths
