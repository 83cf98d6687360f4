"""Results of searches and evaluations: the paper-shaped table and the cost figures.

``kernelstudy report CONFIG_OR_STUDY ...`` reads the studies (and the evaluation
CSV when :mod:`.evaluate` has run) of one or more configs and writes, under
``<out>/<name>/`` (``<out>/report/`` for several):

- ``table.csv`` / ``table.md``: rows are variants, columns are tasks × test accuracy in %
  over the evaluation runs (seeds) of the variant's best trial (highest validation
  accuracy): ``mean``, ``std`` (ddof=1), their count ``n``, ``best_by_val`` (the run of
  highest validation accuracy), ``max_test`` (the highest test accuracy: chosen on the
  test set, labelled so), the runs left out of n (``diverged``), and the published mean
  (``paper``) where the variant and task match. Without an evaluation a variant's entry
  is its best trial's test accuracy (n = 1, diverged missing); a variant with no complete
  trial has n = 0. ``table.md`` ends with notes saying so, and naming such rows.
- ``paper_reference.csv`` / ``.md``: the published table itself.
- ``trials.csv``: every trial of every study, with its sizes and costs (re-queued
  duplicates, pruned before they ran, left out).
- ``search_summary.csv``: trial counts and the best trial per variant, with its parameters
  (``params_model``, ``params_feature_map`` and ``extra_params_pct``, the maps' share over
  the same model with softmax attention, in %: the paper's budget is 10).
- figures: ``accuracy_vs_parameters.png``, ``accuracy_vs_feature_dim.png``,
  ``accuracy_vs_train_time.png`` (one point per complete search trial, one run each),
  ``optimization_history.png``; legends count each variant's trials.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import pandas as pd

from ..files import atomic_write, atomic_write_text
from .config import load_config, shipped_hint
from .evaluate import (
    EVALUATION,
    current_runs,
    read_evaluation,
    search_seed,
    settings_key,
    summarize_evaluation,
)
from .runner import (
    SETTINGS_ATTR,
    VAL_READS_TEST_ATTR,
    best_trial,
    results_folder,
    search_command,
    searched_storage_url,
    searched_under,
    study_row,
    unshared_settings,
)
from .storage import existing_database, existing_storage_url, open_storage, redact
from .workers import FINISHED, is_duplicate

#: Tasks whose ``val`` split read the test data in studies searched before the search
#: recorded it (:data:`~.runner.VAL_READS_TEST_ATTR`): text's does for IMDB (as in LRA), a
#: single file and a directory without a val table, not for a directory with one.
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
#: The figures :func:`figures` draws, by name (the stems of their PNG files), in its order.
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
    #: the config's variants that have no study (not searched): no row in the table
    unsearched: list[str] = field(default_factory=list)
    #: a quick search (a config's [quick] table, or a study name ending ``_quick``): a tiny
    #: model on short or generated data, whose columns get no ``paper`` numbers
    quick: bool = False


def load_results(
    target: str | Path,
    storage: str | None = None,
    out: str | Path | None = None,
    quick: bool = False,
) -> StudySet:
    """The studies of ``target``: a config file, or a study name (prefix of ``NAME/label``)."""
    path = Path(target)
    command = "kernelstudy search CONFIG"  # a study name: its config is not known here
    if path.suffix == ".toml" or path.is_file():
        config = load_config(path, quick=quick)
        name, url = config.name, searched_storage_url(config, storage, out, quick)
        labels = [config.study_name(v) for v in config.variants]
        command = search_command(config, quick, out, storage)
    else:
        name = str(target)
        if quick:  # a name is a search's own: --quick would be dropped without a word
            raise ValueError(
                f"--quick reads a config file's [quick] table; {target!r} is no config file: "
                "give the file, or the quick search's own name (its [quick] name, as "
                f"'{target}_quick' in the studies' configs) without --quick"
            )
        hint = (
            f"{target!r} is no config file either; give one, or a study name with --storage "
            f"URL{shipped_hint(path)}"
        )
        url = (
            existing_database(storage, hint)
            if storage
            else existing_storage_url(results_folder(out), name, hint)
        )
        labels = None
    store = open_storage(url)
    names = [s.study_name for s in optuna.get_all_study_summaries(store)]
    if labels is None:
        labels = [n for n in names if n.startswith(f"{name}/")]
    missing = [n for n in labels if n not in names]
    if not labels or len(missing) == len(labels):
        raise ValueError(
            f"no studies of {name!r} in {redact(url)} (has: {', '.join(names) or 'none'}); "
            f"run `{command}` first"
        )
    studies = {
        n.split("/", 1)[1]: optuna.load_study(study_name=n, storage=store)
        for n in labels
        if n in names
    }
    for study in studies.values():  # best_trial takes the highest value
        if study.directions != [optuna.study.StudyDirection.MAXIMIZE]:
            ways = ", ".join(d.name.lower() for d in study.directions)
            raise ValueError(
                f"study {study.study_name!r} in {redact(url)} is set to {ways}; a search's "
                "studies maximize the validation accuracy, and the report takes its best "
                "trial as the highest"
            )
    task = next(iter(studies.values())).user_attrs.get("task", "?")
    recorded, unrecorded = val_read_test(task, studies)
    if recorded:
        print(
            f"report {name}: warning: the val split{_of(recorded, studies)} read the test data, "
            "so the search chose on the test set and test accuracies are optimistic",
            file=sys.stderr,
        )
    if unrecorded:
        print(
            f"report {name}: warning: task {task!r} reads the test data as val unless the "
            "data are a directory holding a val.tsv or val.csv, and the search"
            f"{_of(unrecorded, studies)} ran before it recorded which: if it read them, the "
            "search chose on the test set and test accuracies are optimistic",
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
        read_evaluation(results_folder(out) / name / EVALUATION),
        {label: trial for label, trial in best.items() if trial is not None},
        keys,
        {
            label: search_seed(study.user_attrs.get(SETTINGS_ATTR))
            for label, study in studies.items()
        },
    )
    unsearched = [n.split("/", 1)[1] for n in missing]
    quick = quick or name.endswith("_quick")  # a name: the shipped [quick] names end so
    return StudySet(name, task, studies, evaluation, unsearched, quick)


def val_read_test(task: str, studies: dict[str, optuna.Study]) -> tuple[list[str], list[str]]:
    """The variants (labels) whose search chose on a val split that read the test data, as
    their studies recorded, and those whose studies, searched before that was recorded, hold
    nothing to say so, of a task in :data:`VAL_IS_TEST` (where it may have)."""
    recorded = [
        label for label, s in studies.items() if s.user_attrs.get(VAL_READS_TEST_ATTR) is True
    ]
    unrecorded = [
        label
        for label, s in studies.items()
        if VAL_READS_TEST_ATTR not in s.user_attrs and task in VAL_IS_TEST
    ]
    return recorded, unrecorded


def _of(labels: list[str], studies: dict[str, optuna.Study]) -> str:
    """`` of LABELS`` when ``labels`` are not all the studies, else nothing."""
    return "" if len(labels) == len(studies) else f" of {', '.join(labels)}"


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
    """The paper-shaped table: index variants; columns (task, mean/std/n/best_by_val/
    max_test/diverged[/paper]), accuracies in % (see :func:`summarize_evaluation`); ``n``
    counts the evaluation runs with a test accuracy and ``diverged`` the others (missing
    before ``evaluate``, when an entry is the search's best trial, one run).
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
                    "n": int(s["n"]),
                    "best_by_val": 100 * s["best_by_val"],
                    "max_test": 100 * s["max_test"],
                    "diverged": int(s["diverged"]),
                }
            else:  # not evaluated (yet): the search trial's test accuracy, one run
                acc = study_row(study, label)["test_accuracy"]
                pct = math.nan if acc is None else 100 * acc
                rows[label] = {
                    "mean": pct,
                    "std": math.nan,
                    "n": int(acc is not None),
                    "best_by_val": pct,
                    "max_test": pct,
                    "diverged": math.nan,  # no evaluation runs to count
                }
            paper = PAPER.get(PAPER_LABELS.get(label, ""), {}).get(res.task)
            if paper is not None and not res.quick:  # a quick model is no paper's
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


def table_notes(results: Sequence[StudySet]) -> list[str]:
    """What :func:`results_table`'s columns are, and which of its rows are no evaluation:
    variants not evaluated (a search run each), those with no complete trial (and why), and
    those whose trials and checkpoints were chosen on the test set (:func:`val_read_test`)."""
    notes = [
        "Test accuracy in %. mean, std (ddof=1) and n: over the n evaluation runs (seeds) "
        "of each variant's best trial (highest validation accuracy), each scored at its "
        "checkpoint of highest validation accuracy; the seeds leave out the search's own "
        "([train] seed, 0 by default), whose run won the search on validation accuracy and "
        "would bias the mean and best_by_val upward; diverged: runs left out of n "
        "(training diverged, or no finite test accuracy).",
        "best_by_val: the test accuracy of the run of highest validation accuracy (ties: the "
        "lowest seed). max_test: the highest test accuracy of the n runs, chosen on the "
        "test set (an optimistic bound; the paper reports the mean and best of five runs "
        "without saying how best was chosen).",
    ]
    if any(PAPER_LABELS.get(label) in PAPER for r in results for label in r.studies if not r.quick):
        notes.append(
            "paper: Yorsh & Kovalenko's Table 1, the mean of five runs (their Matching is "
            "LRA Retrieval; their Text and Matching read BPE tokens, not bytes; their "
            "Transformer row is LRA's published Transformer, Tay et al.)."
        )
    tasks = [res.task for res in results]
    for res in results:
        where = f"{res.task}: " if len(results) == 1 else f"{res.task} ({res.name}): "
        evaluated = set(res.evaluation["variant"]) if len(res.evaluation) else set()
        single, empty = [], []
        for label, study in res.studies.items():
            if best_trial(study) is None:
                empty.append(_no_trial(label, study))
            elif label not in evaluated:
                single.append(label)
        if single:
            notes.append(
                f"{where}not evaluated (no `kernelstudy evaluate` runs of the current best "
                f"trial): {', '.join(single)}; each entry is that search trial's test "
                "accuracy, one run (n = 1, diverged –): the run that won the search on "
                "validation accuracy, so an optimistic one (as the seeds above leave out)."
            )
        notes += [where + text for text in empty]
        if res.unsearched:
            notes.append(f"{where}not searched (no study, no row): {', '.join(res.unsearched)}.")
        last = [
            label
            for label, study in res.studies.items()
            if ((study.user_attrs.get(SETTINGS_ATTR) or {}).get("train") or {}).get("restore_best")
            is False
        ]
        if last:
            notes.append(
                f"{where}{', '.join(last)}: trained with restore_best = false, so their test "
                "accuracies are of the last step's weights, not of the checkpoint of highest "
                "validation accuracy."
            )
        recorded, unrecorded = val_read_test(res.task, res.studies)
        chosen = (
            "the search's trials, every checkpoint and best_by_val were chosen on the test "
            "set, so these test accuracies are optimistic."
        )
        if recorded:
            notes.append(
                f"{where}the val split{_of(recorded, res.studies)} read the test data (the "
                f"data hold no validation split): {chosen}"
            )
        if unrecorded:
            notes.append(
                f"{where}the val split{_of(unrecorded, res.studies)} reads the test data unless "
                "the data are a directory holding a val.tsv or val.csv, and the search ran "
                f"before it recorded which: if it read them, {chosen}"
            )
        unequal = _unequal_trials(res.studies)
        if unequal:
            notes.append(f"{where}{unequal}")
        steered = searched_under(res.studies)
        if steered:
            notes.append(
                f"{where}the variants were searched under different pruners or sampler seeds, "
                f"which choose the trials that run: {steered}."
            )
        mixed = _mixed_devices(res.evaluation)
        if mixed:
            notes.append(
                f"{where}runs trained on different devices or precisions are pooled in one "
                f"mean: {mixed}."
            )
        unshared = unshared_settings(res.studies)
        if unshared:
            notes.append(
                f"{where}the variants were searched with different {', '.join(unshared)} "
                "settings: their rows are not comparable."
            )
    if len(set(tasks)) < len(tasks):
        notes.append("A task of several configs is headed `task (config name)`.")
    return notes


def _mixed_devices(evaluation: pd.DataFrame) -> str:
    """The variants whose evaluation runs trained on more than one kind of device (its type:
    cpu, cuda; not which GPU) or autocast dtype (columns ``device``, ``amp``; rows without
    them, of older evaluations, left out), with them: "" where none."""
    if evaluation.empty or "device" not in evaluation:
        return ""
    amp = evaluation["amp"] if "amp" in evaluation else pd.Series(None, index=evaluation.index)
    # the device's type: "cuda" and "cuda:0" (--device cuda, cuda:0) are one kind of run
    kind = [
        None if pd.isna(d) else str(d).split(":")[0] + ("" if pd.isna(a) or not a else f" {a}")
        for d, a in zip(evaluation["device"], amp, strict=True)
    ]
    runs = evaluation.assign(kind=kind).dropna(subset=["kind"])
    parts = [
        f"{label} ({', '.join(sorted(kinds))})"
        for label, kinds in runs.groupby("variant", sort=False)["kind"].unique().items()
        if len(kinds) > 1
    ]
    return "; ".join(parts)


def _unequal_trials(studies: dict[str, optuna.Study]) -> str | None:
    """A note where the variants with a complete trial trained different numbers of trials
    (a search's ``trials``, or its trials pruned before training: over the budget, refused by
    the model): their tuning was not equal. None where all trained as many."""
    trained_count, untrained_count = {}, {}
    for label, study in studies.items():
        row = study_row(study, label)  # (duplicate re-queues left out)
        if row["best_trial"] is None:  # noted apart (no complete trial)
            continue
        trained_count[label] = row["trained"]
        untrained_count[label] = row["finished"] - row["trained"]
    # several workers may each finish a trial once the count is reached (the --trials
    # help): up to workers - 1 more, no inequality of the search
    workers = [
        int(t.user_attrs.get("workers", 1))
        for study in studies.values()
        for t in study.get_trials(deepcopy=False, states=FINISHED)
    ]
    counts = trained_count.values()
    if not counts or max(counts) - min(counts) <= max(workers, default=1) - 1:
        return None
    listed = ", ".join(
        f"{label} {n}" + (f" ({untrained_count[label]} more pruned before training)"
                          if untrained_count[label] else "")
        for label, n in trained_count.items()
    )  # fmt: skip
    return (
        f"the variants' searches trained different numbers of trials, so their tuning was "
        f"not equal: {listed}."
    )


def _no_trial(label: str, study: optuna.Study) -> str:
    """Why a variant has no accuracy: its trials by state (re-queued duplicates left out)."""
    row = study_row(study, label)
    parts = [f"{row['pruned']} pruned, {row['over_budget']} of them over the budget"]
    if row["refused"]:
        parts[0] += f", {row['refused']} refused by the model"
    parts += [f"{row[k]} {k}" for k in ("failed", "running", "waiting") if row[k]]
    text = f"{label}: no complete trial ({'; '.join(parts)}): no accuracy (n = 0)"
    return text + (f"; {row['note']}." if row.get("note") else ".")


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


def _timed_beside(trials: pd.DataFrame) -> str:
    """What the trials' training times were measured beside (user attr ``workers``: the
    search's worker processes, which share the cores or a GPU): "" for one worker (or
    trials that did not record it), else a note for the axis label."""
    counts = sorted(
        {int(w) for w in trials.get("workers", pd.Series(dtype=float)).dropna()}
    )  # fmt: skip
    if counts in ([], [1]):
        return ""
    if len(counts) == 1:
        return f", {counts[0]} workers at once"
    return f", with {' or '.join(map(str, counts))} workers at once: not comparable"


def figures(trials: pd.DataFrame) -> dict[str, Any]:
    """The four figures (matplotlib Figures) from :func:`trials_frame`. The backend is left
    as it is (a notebook's inline backend shows them)."""
    import matplotlib.pyplot as plt
    import seaborn as sns
    from matplotlib.ticker import MaxNLocator

    sns.set_theme(style="whitegrid")
    done = trials[trials["state"] == "COMPLETE"].copy()
    for column in ("test_accuracy", "params_model", "params_feature_map"):
        if column not in done:
            done[column] = math.nan
    done["accuracy"] = 100 * done["test_accuracy"].astype(float)
    done["extra_params_pct"] = [
        _extra_pct(m, f)
        for m, f in zip(done["params_model"], done["params_feature_map"], strict=True)
    ]
    several = trials["task"].nunique() > 1 or trials["config"].nunique() > 1
    done["variant_key"] = done["variant"] + (" / " + done["config"] if several else "")
    out: dict[str, Any] = {}
    specs = [
        (
            "accuracy_vs_parameters",
            "extra_params_pct",
            "feature-map parameters (% over the model with softmax attention)",
        ),
        ("accuracy_vs_feature_dim", "feature_dim", "feature dimension per head (features)"),
        ("accuracy_vs_train_time", "train_time_s", f"training time (s){_timed_beside(done)}"),
    ]
    for stem, column, xlabel in specs:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        data = done.dropna(subset=[column, "accuracy"]) if column in done else done.iloc[:0]
        if len(data):
            data = data.assign(label=_counted(data["variant_key"]))
            sns.scatterplot(data=data, x=column, y="accuracy", hue="label", style="label", ax=ax)
            ax.legend(fontsize=7, loc="best")
        ax.set(xlabel=xlabel, ylabel="test accuracy (%)")
        ax.set_title(
            f"test accuracy vs {xlabel.split(' (')[0]}: {len(data)} complete search "
            "trials, one run each",
            fontsize=9,
        )
        out[stem] = fig
    fig, ax = plt.subplots(figsize=(6.5, 4))
    # complete trials only, as best_trial: a pruned trial's value is its last report
    hist = trials[trials["state"] == "COMPLETE"].dropna(subset=["val_accuracy"])
    hist = hist.sort_values(["config", "variant", "number"])
    if len(hist):
        key = hist["variant"] + (" / " + hist["config"] if several else "")
        hist = hist.assign(
            best=hist.groupby(["config", "variant"])["val_accuracy"].cummax() * 100,
            label=_counted(key),
        )
        sns.lineplot(data=hist, x="number", y="best", hue="label", marker="o", ax=ax)
        ax.legend(fontsize=7, loc="best")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="trial number", ylabel="best validation accuracy so far (%)")
    ax.set_title(
        f"optimization history: {len(hist)} complete trials (pruned and failed ones left out)",
        fontsize=9,
    )
    out["optimization_history"] = fig
    return {name: out[name] for name in FIGURES}  # in FIGURES' order, each one there


def _counted(keys: pd.Series) -> pd.Series:
    """Legend labels: each key with the number of its rows, ``elu+1 (5 trials)``."""
    counts = keys.map(keys.value_counts())
    return (
        keys + " (" + counts.astype(str) + counts.map(lambda n: " trial)" if n == 1 else " trials)")
    )


def _extra_pct(params_model: Any, params_feature_map: Any) -> float:
    """The feature maps' parameters in % of the rest of the model (the same model with
    softmax attention: attention projections are the same in both); NaN when unknown."""
    try:
        total, fm = float(params_model), float(params_feature_map)
    except (TypeError, ValueError):
        return math.nan
    if math.isnan(total) or math.isnan(fm):
        return math.nan
    if total <= fm:
        return math.inf if fm else 0.0
    return 100 * fm / (total - fm)


def write_report(
    targets: Sequence[str | Path],
    storage: str | None = None,
    out: str | Path | None = None,
    quick: bool = False,
) -> dict[str, Path]:
    """Write the table, reference table, trials, summary and figures; return their paths."""
    import matplotlib.pyplot as plt

    if isinstance(targets, str | Path):  # its characters were taken as targets
        raise TypeError(f"targets must be a list of config files or study names, got {targets!r}")
    if not targets:
        raise ValueError("report needs at least one config file or study name")
    results = [load_results(t, storage, out, quick) for t in targets]
    folder = results_folder(out) / (results[0].name if len(results) == 1 else "report")
    table = results_table(results)
    trials = trials_frame(results)
    rows = [
        {"config": r.name, "task": r.task, **study_row(s, label)}
        for r in results
        for label, s in r.studies.items()
    ]
    for row in rows:
        row["extra_params_pct"] = _extra_pct(row["params_model"], row["params_feature_map"])
    summary = pd.DataFrame(rows)
    paths = {
        "table_csv": folder / "table.csv",
        "table_md": folder / "table.md",
        "paper_csv": folder / "paper_reference.csv",
        "paper_md": folder / "paper_reference.md",
        "trials": folder / "trials.csv",
        "summary": folder / "search_summary.csv",
    }
    atomic_write_text(paths["table_csv"], table.round(2).to_csv())
    notes = "".join(f"- {note}\n" for note in table_notes(results))
    atomic_write_text(paths["table_md"], markdown(table) + "\n" + notes)
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
