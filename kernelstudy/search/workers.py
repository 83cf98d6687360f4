"""Run K worker processes on one Optuna study; the same command on another machine joins it.

Each worker opens the storage by URL and calls ``study.optimize`` until the
study holds ``trials`` finished (complete or pruned) trials. Trials of a worker
that dies stop sending heartbeats; another worker marks them failed and
re-queues their parameters (see :mod:`kernelstudy.search.storage`).
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import warnings
from collections.abc import Callable

import optuna
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.study import MaxTrialsCallback
from optuna.trial import TrialState

from .storage import GRACE_PERIOD, HEARTBEAT_INTERVAL, MAX_RETRY, open_storage

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


def make_pruner(kind: str) -> optuna.pruners.BasePruner:
    """``median`` (MedianPruner after 2 trials), ``hyperband`` or ``none``."""
    if kind == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)
    if kind == "hyperband":
        return optuna.pruners.HyperbandPruner()
    if kind == "none":
        return optuna.pruners.NopPruner()
    raise ValueError(f"pruner must be 'median', 'hyperband' or 'none', got {kind!r}")


def open_study(
    url: str,
    name: str,
    direction: str = "maximize",
    pruner: str = "median",
    seed: int = 0,
    heartbeat: tuple[int, int] = (HEARTBEAT_INTERVAL, GRACE_PERIOD),
) -> optuna.Study:
    """Create study ``name`` in ``url`` or join it if it exists (TPE sampler, seeded).

    ``heartbeat`` is (interval, grace period) in seconds.
    """
    return optuna.create_study(
        study_name=name,
        storage=open_storage(url, heartbeat_interval=heartbeat[0], grace_period=heartbeat[1]),
        direction=direction,
        sampler=optuna.samplers.TPESampler(seed=seed),
        pruner=make_pruner(pruner),
        load_if_exists=True,
    )


def finished_trials(study: optuna.Study) -> int:
    """How many trials of ``study`` are complete or pruned."""
    return len(study.get_trials(deepcopy=False, states=FINISHED))


def requeue_failed(study: optuna.Study, max_retry: int = MAX_RETRY) -> list[int]:
    """Re-queue (as WAITING, same parameters) every FAIL trial not yet retried.

    Trials failed by the heartbeat are re-queued by the storage itself; this covers
    trials that failed in the open (an interrupted search, a crash caught by Optuna),
    so a resumed search runs them again. Returns the numbers re-queued.
    """
    trials = study.get_trials(deepcopy=False)
    retried = {n for t in trials for n in t.system_attrs.get("retry_history", [])}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retry = RetryHeartbeatStaleTrialCallback(max_retry=max_retry)
    done = []
    for trial in trials:
        if trial.state == TrialState.FAIL and trial.number not in retried:
            before = len(study.get_trials(deepcopy=False))
            retry(study, trial)
            if len(study.get_trials(deepcopy=False)) > before:
                done.append(trial.number)
    return done


def _worker(
    url: str,
    name: str,
    objective: Callable[[optuna.Trial], float],
    trials: int,
    pruner: str,
    seed: int,
    heartbeat: tuple[int, int] = (HEARTBEAT_INTERVAL, GRACE_PERIOD),
) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = open_study(url, name, pruner=pruner, seed=seed, heartbeat=heartbeat)
    if finished_trials(study) >= trials:
        return
    study.optimize(
        objective,
        callbacks=[MaxTrialsCallback(trials, states=FINISHED)],
        catch=(RuntimeError, FloatingPointError),
    )


def run_workers(
    url: str,
    name: str,
    objective: Callable[[optuna.Trial], float],
    trials: int,
    workers: int = 1,
    pruner: str = "median",
    seed: int = 0,
    heartbeat: tuple[int, int] = (HEARTBEAT_INTERVAL, GRACE_PERIOD),
) -> optuna.Study:
    """Optimize study ``name`` with ``workers`` processes until ``trials`` trials are finished.

    ``objective`` must be picklable (a module-level function or a
    ``functools.partial`` of one). Worker ``i`` seeds its sampler with
    ``seed + i`` so workers do not propose the same points.
    """
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    if not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be a positive int, got {trials!r}")
    # Creates the study once (checking the URL) before any worker starts.
    study = open_study(url, name, pruner=pruner, seed=seed, heartbeat=heartbeat)
    requeue_failed(study)
    if workers == 1:
        _worker(url, name, objective, trials, pruner, seed, heartbeat)
        return study
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_worker, args=(url, name, objective, trials, pruner, seed + i, heartbeat)
        )
        for i in range(workers)
    ]
    for p in procs:
        p.start()
    failed = 0
    for p in procs:
        p.join()
        failed += p.exitcode != 0
    if failed:
        print(
            f"search {name}: {failed} of {workers} worker(s) exited with an error", file=sys.stderr
        )
    return study
