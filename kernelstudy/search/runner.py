"""Run a search config: one Optuna study per variant, K worker processes each.

:func:`run_search` checks everything first (config, storage URL, data, every
variant's model), then optimizes the variants one after another. Study
``<name>/<label>`` holds the trials of one variant; its user attrs name the
config, task and feature map so :mod:`.report` can read a study on its own,
``settings`` records what its trials' values depend on (:func:`variant_settings`), and
``val_reads_test`` whether the val split its trials chose on read the test data.
Re-running with the same storage continues the studies (see :mod:`.workers`), but
only with the same settings: a study whose trials ran with another task, model,
training, search space or generated data is refused rather than mixed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optuna
import pandas as pd

from ..arguments import check_count
from ..folders import results_dir
from ..progress import tqdm
from ..train import resolve_device
from .config import SearchConfig, Variant, load_config
from .objective import check_variants, objective, prepare_data, val_reads_test
from .storage import (
    default_storage_url,
    existing_database,
    existing_storage_url,
    load_study,
    open_storage,
    redact,
    sqlite_file,
)
from .workers import (
    FINISHED,
    finished_trials,
    is_duplicate,
    open_study,
    run_workers,
    search_finished,
    trained,
)

#: The study user attr that holds :func:`variant_settings`.
SETTINGS_ATTR = "settings"
#: The study user attr that says whether the val split of its trials read the test data
#: (:func:`~.objective.val_reads_test`); absent from studies searched before it was recorded.
VAL_READS_TEST_ATTR = "val_reads_test"
#: Study user attr: the search settings (pruner, sampler seed) under which searches ran its
#: trials, in their order (a repeat of the last left out): they steer which trials run, not
#: a trial's value.
SEARCHED_UNDER_ATTR = "searched_under"
#: ``[train]`` keys that change where or how visibly a run trains, not its result.
NEUTRAL_TRAIN_KEYS = ("device", "progress", "num_workers")
#: The :func:`variant_settings` that every variant of one table should share.
SHARED_SETTINGS = ("task", "task_options", "generate", "model", "train", "space", "budget")


def results_folder(out: str | Path | None = None) -> Path:
    """``out``, or where searches write without one: the studies' and notebooks' results
    folder (:func:`kernelstudy.folders.results_dir`: ``$KERNELSTUDY_RESULTS`` or
    ``results/``, of the checkout or, installed, of the working directory)."""
    return results_dir() if out is None else Path(out)


def storage_url(config: SearchConfig, storage: str | None, out: str | Path | None = None) -> str:
    """``storage``, or the default SQLite file ``<out>/<name>/optuna.db``."""
    return storage if storage else default_storage_url(results_folder(out), config.name)


def search_command(
    config: SearchConfig,
    quick: bool = False,
    out: str | Path | None = None,
    storage: str | None = None,
    labels: Sequence[str] = (),
) -> str:
    """The ``kernelstudy search`` command line that searches ``config`` as given (its
    ``--quick``, ``--out``, ``--storage`` and ``--variant`` options), for messages."""
    words = ["kernelstudy", "search", str(config.path)]
    words += ["--quick"] if quick else []
    words += [] if out is None else ["--out", str(out)]
    words += [] if storage is None else ["--storage", redact(storage)]
    for label in labels:
        words += ["--variant", label]
    return shlex.join(words)


def searched_storage_url(
    config: SearchConfig,
    storage: str | None,
    out: str | Path | None = None,
    quick: bool = False,
) -> str:
    """:func:`storage_url` for commands that read a search (evaluate, report): its SQLite
    file, the default or a given one, must exist (FileNotFoundError, naming the search
    command to run), so that none is created empty."""
    command = search_command(config, quick, out)
    out = results_folder(out)
    hint = f"run `{command}` first, or give --storage URL"
    if storage:
        return existing_database(storage, f"run `{command} --storage URL` first")
    return existing_storage_url(out, config.name, hint)


def check_device(config: SearchConfig, device: str | None) -> None:
    """ValueError now, before any trial, if ``device`` (or, when None, the config's
    ``[train] device``) is unknown or missing here (cuda without a GPU)."""
    if device is not None:
        resolve_device(device)
        return
    try:
        resolve_device(str(config.train.get("device", "auto")))
    except ValueError as err:
        raise ValueError(f"{config.path}: [train] device: {err} (pass --device)") from None


def select_variants(config: SearchConfig, labels: Sequence[str] | None) -> list[Variant]:
    """The variants named in ``labels`` (all when None; a label given twice counts once);
    ValueError for an unknown label, TypeError for a single str (its characters were taken
    for labels: ``"ab"`` chose variants ``a`` and ``b``)."""
    if isinstance(labels, str):
        raise TypeError(f"variants must be a list of labels, got the str {labels!r}")
    if not labels:
        return list(config.variants)
    return [config.variant(label) for label in dict.fromkeys(labels)]


def variant_settings(config: SearchConfig, variant: Variant) -> dict[str, Any]:
    """What a trial of ``variant`` depends on besides its own parameters (JSON values).

    The task and its options, the generated data's table, the model, training (less
    :data:`NEUTRAL_TRAIN_KEYS`), the fixed training space, the budget and the variant's
    attention. Not the data path (workers on other machines may mount it elsewhere),
    nor trials, pruner or sampler seed, which steer the search but not a trial's value.
    """
    settings = {
        "task": config.task,
        "task_options": config.task_options,
        "generate": config.generate,
        "model": config.model,
        "train": {k: v for k, v in config.train.items() if k not in NEUTRAL_TRAIN_KEYS},
        "space": config.training_space,
        "budget": config.budget,
        "attention": variant.attention,
        "feature_map": variant.feature_map,
        "fixed": variant.fixed,
    }
    return json.loads(json.dumps(settings, sort_keys=True))


def check_settings(config: SearchConfig, variants: Sequence[Variant], url: str) -> None:
    """ValueError when a study of ``variants`` in ``url`` holds trials run with other
    :func:`variant_settings` than ``config`` has now (naming the tables that differ).

    Studies without trials, or from before settings were recorded, pass.
    """
    storage = open_storage(url)
    studies = {s.study_name: s for s in optuna.get_all_study_summaries(storage)}
    for variant in variants:
        summary = studies.get(config.study_name(variant))
        if summary is None or summary.n_trials == 0:
            continue
        stored = summary.user_attrs.get(SETTINGS_ATTR)
        now = variant_settings(config, variant)
        if stored is None or stored == now:
            continue
        changed = sorted(k for k in now.keys() | stored.keys() if stored.get(k) != now.get(k))
        detail = "; ".join(f"{k}: {stored.get(k)!r} then, {now.get(k)!r} now" for k in changed)
        raise ValueError(
            f"study {summary.study_name!r} in {redact(url)} holds {summary.n_trials} trial(s) "
            f"run with other settings ({detail}). Its trials would not be comparable with "
            "new ones: restore those settings, or give the changed config another `name` "
            "or --out (another --storage alone shares OUT/NAME's summaries and reports)"
        )


def unshared_settings(studies: dict[str, optuna.Study]) -> list[str]:
    """The :data:`SHARED_SETTINGS` on which the studies (by label) disagree, sorted.

    Studies that hold no recorded settings are not compared."""
    recorded = [
        s.user_attrs[SETTINGS_ATTR] for s in studies.values() if SETTINGS_ATTR in s.user_attrs
    ]
    return sorted(
        k
        for k in SHARED_SETTINGS
        if len({json.dumps(r.get(k), sort_keys=True) for r in recorded}) > 1
    )


def searched_under(studies: dict[str, optuna.Study]) -> str:
    """The search settings (:data:`SEARCHED_UNDER_ATTR`) where the studies were not all
    searched under one: each study's, as "label: pruner median, seed 0"; "" where they
    were (studies that did not record them are not compared)."""
    recorded = {
        label: study.user_attrs[SEARCHED_UNDER_ATTR]
        for label, study in studies.items()
        if study.user_attrs.get(SEARCHED_UNDER_ATTR)
    }
    if len({json.dumps(runs, sort_keys=True) for runs in recorded.values()}) < 2:
        return ""
    return "; ".join(
        f"{label}: " + " then ".join(f"pruner {v['pruner']}, seed {v['seed']}" for v in runs)
        for label, runs in recorded.items()
    )


def steering(config: SearchConfig) -> dict[str, Any]:
    """The config's ``[search]`` pruner and sampler seed (their defaults where not given), as
    :func:`~.workers.open_study` and :func:`~.workers.run_workers` take them."""
    return {
        "pruner": str(config.search.get("pruner", "median")),
        "seed": int(config.search.get("seed", 0)),
    }


def record_searched_under(study: optuna.Study, config: SearchConfig) -> None:
    """Add the config's pruner and sampler seed (:func:`steering`) to the study's
    :data:`SEARCHED_UNDER_ATTR` (unless the last entry is the same): called where a search
    runs trials of it, not where it finds the study finished (a rerun under another seed that
    ran nothing recorded it)."""
    steering_now = steering(config)
    before = study.user_attrs.get(SEARCHED_UNDER_ATTR) or []
    if not before or before[-1] != steering_now:
        study.set_user_attr(SEARCHED_UNDER_ATTR, [*before, steering_now])


def variant_study(
    config: SearchConfig, variant: Variant, url: str, val_is_test: bool | None = None
) -> optuna.Study:
    """Create or join the study of ``variant`` and record what it is in its user attrs
    (:func:`check_settings` first, so that a joined study's settings agree).

    ``val_is_test``: whether the val split read the test data (None: not known, not
    recorded). Once recorded True it stays True while the study holds trials: the data
    path is no setting, and the trials run then were chosen on the test set whatever the
    data are now."""
    study = open_study(url, config.study_name(variant), **steering(config))
    attrs = {
        "config": config.name,
        "task": config.task,
        "label": variant.label,
        "attention": variant.attention,
        "feature_map": variant.feature_map or "softmax",
        "budget": config.budget,
        SETTINGS_ATTR: variant_settings(config, variant),
    }
    if val_is_test is not None:
        was = study.user_attrs.get(VAL_READS_TEST_ATTR) is True
        attrs[VAL_READS_TEST_ATTR] = val_is_test or (was and bool(study.get_trials(deepcopy=False)))
    for key, value in attrs.items():
        if study.user_attrs.get(key) != value:
            study.set_user_attr(key, value)
    return study


def _holds_a_study(url: str) -> bool:
    """Whether the database at ``url`` holds a study (True where it cannot be read: kept)."""
    try:
        storage = open_storage(url)
        try:
            return bool(optuna.get_all_study_summaries(storage, include_best_trial=False))
        finally:
            storage.engine.dispose()
    except Exception:
        return True


def run_search(
    config: SearchConfig | str | Path,
    trials: int | None = None,
    workers: int = 1,
    storage: str | None = None,
    out: str | Path | None = None,
    quick: bool = False,
    variants: Sequence[str] | None = None,
    device: str | None = None,
) -> pd.DataFrame:
    """Search every variant of ``config`` until each study holds ``trials`` trained trials
    (or gives up on more: :func:`~.workers.search_finished`).

    Returns :func:`search_summary` of the variants. All inputs are checked before
    the first trial: a bad config, an unreachable storage, missing data or a model
    that cannot be built raise ValueError / FileNotFoundError.
    """
    if not isinstance(config, SearchConfig):
        config = load_config(config, quick=quick)
    trials = config.trials if trials is None else trials
    trials = check_count("trials", trials, 1)
    workers = check_count("workers", workers, 1)
    check_device(config, device)
    chosen = select_variants(config, variants)
    out = results_folder(out)
    folder = None if storage else out / config.name  # the default storage's
    new_folder = folder is not None and not folder.exists()
    url = storage_url(config, storage, out)
    database = sqlite_file(url)
    created = database is not None and not database.exists()
    try:
        open_storage(url, writable=True)  # unreachable, malformed, read-only: ValueError now
        check_settings(config, chosen, url)  # before generated data may be rewritten
        data = prepare_data(config, out)
        over = check_variants(config, data)
        val_is_test = val_reads_test(config, data)  # the val split check_variants loaded
    except BaseException:  # an SQLite file this call made holds no study: not left behind
        # (`report` then said "no studies ... run search first"), unless another search of
        # the same storage has put one there since (its trials went with the file)
        if created and not _holds_a_study(url):
            database.unlink(missing_ok=True)
        if new_folder:  # nor the folder made for it, where nothing else was written there
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    for label, reason in over.items():
        if any(v.label == label for v in chosen):
            print(f"search {config.name}: {label} at its defaults: {reason}", file=sys.stderr)
    verbosity = optuna.logging.get_verbosity()  # the caller's (a notebook's), given back
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        # the trials this run finishes, of all variants (a variant's 20 trials of 5000 steps
        # took hours with a bar of variants standing still); those a resumed search finished
        # before leave the total, not count as done now (the rate and ETA were far too short)
        bar = tqdm(total=len(chosen) * trials, desc=f"search {config.name}", unit="trial")
        with bar:
            for variant in chosen:
                bar.set_postfix_str(variant.label)
                study = variant_study(config, variant, url, val_is_test)
                fn = functools.partial(
                    objective, config=config, label=variant.label, data=data, device=device
                )
                # finished before this run (a search that gave up on more: all of it)
                done = search_finished(study, trials)
                earlier = trials if done else min(finished_trials(study), trials)
                if not done:  # trials of it run now: under this pruner and sampler seed
                    record_searched_under(study, config)
                bar.total -= earlier
                bar.refresh()

                def show(finished: int, start: int = bar.n - earlier) -> None:
                    bar.update(start + min(finished, trials) - bar.n)

                run_workers(
                    url,
                    config.study_name(variant),
                    fn,
                    trials=trials,
                    workers=workers,
                    **steering(config),
                    progress=show,
                )
                show(trials)  # a search that gave up (search_finished) is done too
        return search_summary(config, url, [v.label for v in chosen])
    finally:
        optuna.logging.set_verbosity(verbosity)


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The complete trial with the highest value, or None when none completed."""
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return max(complete, key=lambda t: t.value) if complete else None


def search_summary(
    config: SearchConfig, url: str, labels: Sequence[str] | None = None
) -> pd.DataFrame:
    """One row per variant: trial counts by state, best validation accuracy, its test
    accuracy and sizes, and why trials were pruned before training (over budget)."""
    rows: list[dict[str, Any]] = []
    for label in labels or config.labels():
        study = load_study(url, config.study_name(config.variant(label)))
        rows.append(study_row(study, label))
    return pd.DataFrame(rows)


def study_row(study: optuna.Study, label: str) -> dict[str, Any]:
    """The :func:`search_summary` row of one variant's study (duplicate re-queues left out)."""
    trials = [t for t in study.get_trials(deepcopy=False) if not is_duplicate(t)]
    states = pd.Series([t.state.name for t in trials], dtype=object).value_counts()
    best = best_trial(study)
    over = [t for t in trials if "pruned_reason" in t.user_attrs]
    refused = [t for t in trials if "refused_reason" in t.user_attrs]
    row: dict[str, Any] = {
        "variant": label,
        "complete": int(states.get("COMPLETE", 0)),
        "pruned": int(states.get("PRUNED", 0)),
        "over_budget": len(over),
        "refused": len(refused),  # settings the model refuses (pruned before training)
        "failed": int(states.get("FAIL", 0)),
        # another worker's, or re-queued copies a finished search left to a longer one
        "running": int(states.get("RUNNING", 0)),
        "waiting": int(states.get("WAITING", 0)),
        "finished": sum(t.state in FINISHED for t in trials),
        # the trials that count towards [search] trials: not those pruned before training
        "trained": sum(trained(t) for t in trials),
        "best_trial": None if best is None else best.number,
        "val_accuracy": None if best is None else best.value,
    }
    attrs = ("test_accuracy", "params_model", "params_feature_map", "feature_dim", "train_time_s")
    source = best or (over[0] if over else None)
    for key in attrs:
        row[key] = None if source is None else source.user_attrs.get(key)
    if best is None and (over or refused):
        row["note"] = (
            over[0].user_attrs["pruned_reason"] if over else refused[0].user_attrs["refused_reason"]
        )
    return row
