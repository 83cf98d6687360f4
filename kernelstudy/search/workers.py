"""Run K worker processes on one Optuna study; the same command on another machine joins it.

Each worker opens the storage by URL and calls ``study.optimize`` until the
study holds ``trials`` trials that trained (complete, or pruned while training), or
gives up on more (:func:`search_finished`): trials pruned before training (over the
parameter budget, refused by the model) do not count. Trials of a worker
that dies stop sending heartbeats; another worker marks them failed and
re-queues their parameters (see :mod:`kernelstudy.search.storage`).

A re-queued copy records the failed trial it re-runs (the last entry of its
``retry_history`` system attr). Two workers that start at the same instant can
both re-queue one failed trial (:func:`requeue_failed` reads, then adds); the
copies are deduplicated when they start: every copy but the lowest-numbered one
is pruned at once, before its objective runs, with user attrs ``duplicate_of``
(the failed trial) and ``pruned_reason``. Duplicates do not count towards
``trials``, and the summaries and reports leave them out.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

import numpy as np
import optuna
import torch
from optuna.exceptions import StorageInternalError, UpdateFinishedTrialError
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState

from ..arguments import check_count
from ..feature_maps.registry import registered_modules
from .storage import GRACE_PERIOD, HEARTBEAT_INTERVAL, MAX_RETRY, open_storage, redact

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
#: User attr of a re-queued copy pruned as a duplicate: the number of the failed trial.
DUPLICATE_ATTR = "duplicate_of"
#: User attrs of a trial pruned before it trained: over the parameter budget (and duplicate
#: re-queues, which carry a reason too), or settings the model refuses (objective.train_run).
UNTRAINED_ATTRS = ("pruned_reason", "refused_reason")
#: A search gives up after this many finished trials per trial asked for, trained or not.
MAX_ATTEMPTS_PER_TRIAL = 5


def make_pruner(kind: str) -> optuna.pruners.BasePruner:
    """``median`` (MedianPruner after 2 trials), ``hyperband`` or ``none``."""
    if kind == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)
    if kind == "hyperband":
        return optuna.pruners.HyperbandPruner()
    if kind == "none":
        return optuna.pruners.NopPruner()
    raise ValueError(f"pruner must be 'median', 'hyperband' or 'none', got {kind!r}")


class TrialSeededSampler(optuna.samplers.BaseSampler):
    """Optuna's TPE sampler with a random state drawn afresh for each trial from
    ``(seed, study name, trial number)``.

    Trial numbers are unique within a study, so workers that share a seed (the workers of
    one command, or the same command run on two machines at once) never draw from the
    same random state, and a resumed search does not replay the random start-up points of
    the first. A single worker stays reproducible: trial ``n`` sees the same history and
    the same random state on every run. (Seeding each worker once, from ``seed`` and its
    index, gave worker 0 of two commands started together the same proposals.) The study
    name keeps the variants of one config (one study each) from drawing alike.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._tpe = optuna.samplers.TPESampler(seed=seed)  # replaced before each trial

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        name = zlib.crc32(study.study_name.encode())
        entropy = [self.seed, name, trial.number]
        mixed = int(np.random.SeedSequence(entropy).generate_state(1)[0])
        self._tpe = optuna.samplers.TPESampler(seed=mixed)
        self._tpe.before_trial(study, trial)

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict:
        return self._tpe.infer_relative_search_space(study, trial)

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict
    ) -> dict[str, Any]:
        return self._tpe.sample_relative(study, trial, search_space)

    def sample_independent(
        self, study: optuna.Study, trial: FrozenTrial, param_name: str, param_distribution: Any
    ) -> Any:
        return self._tpe.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        state: TrialState,
        values: Sequence[float] | None,
    ) -> None:
        self._tpe.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._tpe.reseed_rng()


def open_study(
    url: str,
    name: str,
    pruner: str = "median",
    seed: int = 0,
    heartbeat: tuple[int, int] = (HEARTBEAT_INTERVAL, GRACE_PERIOD),
) -> optuna.Study:
    """Create study ``name`` in ``url`` or join it if it exists (TPE, seeded per trial by
    :class:`TrialSeededSampler`), maximizing (the validation accuracy, as the report reads
    it). ``heartbeat`` is (interval, grace period) in seconds."""
    return optuna.create_study(
        study_name=name,
        storage=open_storage(
            url, heartbeat_interval=heartbeat[0], grace_period=heartbeat[1], writable=True
        ),
        direction="maximize",
        sampler=TrialSeededSampler(seed),
        pruner=make_pruner(pruner),
        load_if_exists=True,
    )


def is_duplicate(trial: FrozenTrial) -> bool:
    """Whether ``trial`` is a re-queued copy pruned because another copy runs (see above)."""
    return DUPLICATE_ATTR in trial.user_attrs


def trained(trial: FrozenTrial) -> bool:
    """Whether finished ``trial`` trained: complete, or pruned by the pruner while training,
    not before (over the budget, refused by the model, a duplicate re-queue)."""
    return trial.state in FINISHED and not any(a in trial.user_attrs for a in UNTRAINED_ATTRS)


def finished_trials(study: optuna.Study) -> int:
    """How many trials of ``study`` count towards a search's ``trials``: those that trained
    (:func:`trained`). Trials pruned before training counted too, so a variant part of whose
    space is over the budget got fewer trained trials than the others (GLU with its depth
    searched: a third of them over the budget on LRA Text)."""
    return sum(trained(t) for t in study.get_trials(deepcopy=False, states=FINISHED))


def search_finished(study: optuna.Study, trials: int) -> bool:
    """Whether ``study`` holds ``trials`` trained trials, or gives up on more: its first
    ``trials`` finished trials were all pruned before training (as every setting of a
    variant whose maps alone exceed the budget is), or it holds
    ``MAX_ATTEMPTS_PER_TRIAL * trials`` finished trials in all (duplicates left out)."""
    done = [t for t in study.get_trials(deepcopy=False, states=FINISHED) if not is_duplicate(t)]
    count = sum(trained(t) for t in done)
    return (
        count >= trials
        or (count == 0 and len(done) >= trials)
        or len(done) >= MAX_ATTEMPTS_PER_TRIAL * trials
    )


def retried_from(trial: FrozenTrial) -> int | None:
    """The number of the failed trial that ``trial`` re-runs, or None for a fresh trial."""
    history = trial.system_attrs.get("retry_history") or []
    return int(history[-1]) if history else None


def duplicate_of(trial: optuna.Trial) -> tuple[int, int] | None:
    """``(failed, first)`` when ``trial`` re-runs failed trial ``failed`` and a lower-numbered
    copy ``first`` of it exists (waiting, running or finished); else None.

    The lowest-numbered copy is the one that runs, whichever worker popped it, so the
    outcome does not depend on timing.
    """
    trials = trial.study.get_trials(deepcopy=False)
    me = next((t for t in trials if t.number == trial.number), None)
    failed = None if me is None else retried_from(me)
    if failed is None:
        return None
    first = min(t.number for t in trials if retried_from(t) == failed)
    return None if first >= trial.number else (failed, first)


def skip_duplicates(
    objective: Callable[[optuna.Trial], float],
) -> Callable[[optuna.Trial], float]:
    """``objective`` preceded by the duplicate check: a duplicate copy is pruned at once."""

    @functools.wraps(objective)
    def run(trial: optuna.Trial) -> float:
        dup = duplicate_of(trial)
        if dup is not None:
            failed, first = dup
            reason = f"duplicate re-queue of failed trial {failed}: trial {first} re-runs it"
            trial.set_user_attr(DUPLICATE_ATTR, failed)
            trial.set_user_attr("pruned_reason", reason)
            raise optuna.TrialPruned(reason)
        return objective(trial)

    return run


#: A worker whose last this-many trials all failed stops with :class:`TrialsKeepFailing`.
MAX_FAILURES_IN_A_ROW = 5
#: User attr of a failed trial: its error.
FAIL_REASON_ATTR = "fail_reason"
#: The errors that fail a trial and let the search go on (out of memory, divergence).
TRIAL_ERRORS = (RuntimeError, FloatingPointError)
#: How the ``fail_reason`` of a diverged trial starts (it is not re-queued).
DIVERGED = f"{FloatingPointError.__name__}:"
#: How Optuna's ValueError starts when a trial was finished by another worker.
TOLD_ELSEWHERE = "Cannot tell a "


def _timed_with(
    objective: Callable[[optuna.Trial], float], workers: int
) -> Callable[[optuna.Trial], float]:
    """``objective`` that first records what its trial's times were measured beside: the
    search's worker processes (``workers``: they share the cores, or one GPU) and this
    process's torch threads (user attrs ``workers``, ``torch_threads``)."""

    @functools.wraps(objective)
    def run(trial: optuna.Trial) -> float:
        trial.set_user_attr("workers", workers)
        trial.set_user_attr("torch_threads", torch.get_num_threads())
        return objective(trial)

    return run


class TrialsKeepFailing(RuntimeError):
    """Every recent trial of a worker failed (e.g. out of memory, or a diverging model)."""


def record_failures(
    objective: Callable[[optuna.Trial], float],
) -> Callable[[optuna.Trial], float]:
    """``objective`` that stores the error of a failing trial in its user attr
    :data:`FAIL_REASON_ATTR` (Optuna only logs it) before re-raising it."""

    @functools.wraps(objective)
    def run(trial: optuna.Trial) -> float:
        try:
            return objective(trial)
        except TRIAL_ERRORS as err:
            trial.set_user_attr(FAIL_REASON_ATTR, f"{type(err).__name__}: {err}"[:500])
            raise

    return run


class StopAtFinished:
    """Optuna callback: stop the study once :func:`search_finished` (``n`` trained trials),
    or once this worker's last ``max_failures`` trials all failed (``failure`` then says
    why; caught failures do not count as finished, so without it such a search never ends)."""

    def __init__(self, n: int, max_failures: int = MAX_FAILURES_IN_A_ROW) -> None:
        self.n, self.max_failures = n, max_failures
        self.failures = 0
        self.failure: str | None = None

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.failures = self.failures + 1 if trial.state == TrialState.FAIL else 0
        if self.failures >= self.max_failures:
            reason = trial.user_attrs.get(FAIL_REASON_ATTR, "see the warning above")
            self.failure = (
                f"study {study.study_name}: the last {self.failures} trials failed; the last "
                f"one (trial {trial.number}): {reason}"
            )
            study.stop()
        elif search_finished(study, self.n):
            study.stop()


def requeue_failed(study: optuna.Study, max_retry: int = MAX_RETRY) -> list[int]:
    """Re-queue (as WAITING, same parameters) every FAIL trial not yet retried, but for
    diverged ones (a ``FloatingPointError``: training is seeded, so a copy diverges again,
    and five such copies in a row stopped the resumed search with
    :class:`TrialsKeepFailing`). Copies do not inherit the failure's ``fail_reason``.

    Trials failed by the heartbeat are re-queued by the storage itself; this covers
    trials that failed in the open (an interrupted search, a crash caught by Optuna),
    so a resumed search runs them again. Returns the numbers re-queued.

    Reading and adding are not one transaction: two workers starting together can
    both re-queue a trial; :func:`skip_duplicates` runs only the first copy.
    """
    trials = study.get_trials(deepcopy=False)
    retried = {n for t in trials for n in t.system_attrs.get("retry_history", [])}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retry = RetryHeartbeatStaleTrialCallback(max_retry=max_retry)
    done = []
    for trial in trials:
        if trial.state != TrialState.FAIL or trial.number in retried:
            continue
        if str(trial.user_attrs.get(FAIL_REASON_ATTR, "")).startswith(DIVERGED):
            continue
        frozen = copy.deepcopy(trial)  # the callback appends to its retry_history
        frozen.user_attrs = {k: v for k, v in trial.user_attrs.items() if k != FAIL_REASON_ATTR}
        before = len(study.get_trials(deepcopy=False))
        retry(study, frozen)
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
    progress: Callable[[int], None] | None = None,
    threads: int | None = None,
    request: _StopRequest | None = None,
    workers: int = 1,
) -> None:
    """Optimize study ``name`` until :func:`search_finished` (``trials`` trained trials).
    ``request``: the stop request its signal handler sets (none: nothing stops it but an
    exception); ``progress(finished)`` is called after each trial (:func:`finished_trials`);
    ``workers``: how many worker processes the search runs at once, recorded with each trial
    (user attrs ``workers`` and ``torch_threads``: its training time depends on them)."""
    request = _StopRequest() if request is None else request
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if threads is not None:  # several workers share the cores
        torch.set_num_threads(threads)
    study = open_study(url, name, pruner=pruner, seed=seed, heartbeat=heartbeat)
    if search_finished(study, trials):
        return
    stop = StopAtFinished(trials)
    callbacks = [stop, request.callback]
    if progress is not None:
        callbacks.append(lambda study, _trial: progress(finished_trials(study)))
    while True:
        if request.requested:  # before any trial: none is started only to be failed
            raise KeyboardInterrupt
        try:
            study.optimize(
                request.wrap(skip_duplicates(record_failures(_timed_with(objective, workers)))),
                callbacks=callbacks,
                catch=TRIAL_ERRORS,
            )
            break
        except (ValueError, UpdateFinishedTrialError) as err:
            # Two workers on SQLite can take the same waiting trial (it has no row locks):
            # the second to finish cannot report it ("Cannot tell a COMPLETE trial", or
            # "Trial#2 has already finished"). The trial counts once, from the first; this
            # worker goes on.
            if isinstance(err, ValueError) and not str(err).startswith(TOLD_ELSEWHERE):
                raise
        except (StorageInternalError, AssertionError) as err:
            # a commit that failed (disk full, read-only file): Optuna's "invalid data, e.g.
            # exceeding max length", or "Should not reach" from its own clean-up after it
            cause = _storage_cause(err)
            if cause is None:
                raise
            raise ValueError(
                f"storage {redact(url)} failed: {cause}; the finished trials are kept: free "
                "space (or make it writable) and run the command again to go on"
            ) from err
    if stop.failure is not None:
        raise TrialsKeepFailing(stop.failure)


def _storage_cause(err: BaseException) -> str | None:
    """The first line of the database's own error behind ``err`` (its causes and contexts),
    or None when ``err`` did not come from the database."""
    seen: set[int] = set()
    found = None
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if type(err).__name__ == "OperationalError":  # sqlite3's, sqlalchemy's, psycopg's
            found = str(err).strip().splitlines()[0] if str(err).strip() else None
        err = err.__cause__ or err.__context__
    return found


#: Seconds a stopped worker gets to fail its trial before it is killed.
STOP_TIMEOUT = 30.0
PROGRESS_SECONDS = 2.0  # how often a multi-worker search counts the finished trials
#: Exit code of a worker stopped by SIGTERM (the parent's stop after a Ctrl-C).
STOPPED_EXIT_CODE = 130
#: Exit code of a worker stopped by :class:`TrialsKeepFailing` (the parent raises it).
KEEP_FAILING_EXIT_CODE = 3


class _StopRequest:
    """A stop signal (a worker's SIGTERM, the Ctrl-C of a one-worker search): it interrupts
    the objective at once (Optuna then marks the trial failed, so a resumed search re-runs
    it); arriving elsewhere (Optuna saving a result, sampling) it waits for the end of that
    step, since an interrupt inside Optuna's own storage calls left the trial RUNNING and
    failed with an UnboundLocalError traceback. Either way Optuna's "trial failed" warning
    and its traceback are silenced: the interruption is reported once, by the caller.

    ``second_at_once``: a second signal interrupts at once wherever it arrives (a user's
    second Ctrl-C when a storage call hangs)."""

    def __init__(self, second_at_once: bool = False) -> None:
        self.requested = False
        self.signum: int | None = None  # the first signal's
        self.in_objective = False
        self.second_at_once = second_at_once

    def handle(self, signum: int, frame: FrameType | None) -> None:
        again = self.requested
        self.requested = True
        self.signum = signum if self.signum is None else self.signum
        optuna.logging.set_verbosity(optuna.logging.ERROR)  # no "trial failed" traceback
        if self.in_objective or (again and self.second_at_once):
            raise KeyboardInterrupt

    def wrap(self, objective: Callable[[optuna.Trial], float]) -> Callable[[optuna.Trial], float]:
        """``objective`` that a stop request interrupts (or does not start). The trial it gets
        defers the request over its own calls (:class:`_StorageCalls`)."""

        @functools.wraps(objective)
        def run(trial: optuna.Trial) -> float:
            if self.requested:
                raise KeyboardInterrupt
            self.in_objective = True
            try:
                return objective(_StorageCalls(trial, self))  # type: ignore[arg-type]
            finally:
                self.in_objective = False

        return run

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A stretch of the objective that a stop request does not interrupt: it interrupts
        right after it (a request that arrived in it raises KeyboardInterrupt on leaving)."""
        interruptible, self.in_objective = self.in_objective, False
        try:
            yield
        finally:
            self.in_objective = interruptible
        if interruptible and self.requested:
            raise KeyboardInterrupt

    def callback(self, study: optuna.Study, trial: FrozenTrial) -> None:
        """Optuna callback: stop the study after a trial once a stop was requested."""
        if self.requested:
            study.stop()


class _StorageCalls:
    """The trial an objective gets under a :class:`_StopRequest`: the trial's methods (Optuna's
    storage: suggest, report, should_prune, set_user_attr) run deferred, as Optuna's own saves
    are, since an interrupt inside one leaves the storage mid-call. A one-worker search sent
    SIGTERM right after a report (its first intermediate value in the database: likely inside
    ``trial.report`` or ``should_prune``) once did not end within a minute (CI, 2026-11-30).
    Other attributes pass through."""

    def __init__(self, trial: optuna.Trial, request: _StopRequest) -> None:
        self._trial, self._request = trial, request

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._trial, name)
        if not callable(value):
            return value

        @functools.wraps(value)
        def call(*args: Any, **kwargs: Any) -> Any:
            with self._request.deferred():
                return value(*args, **kwargs)

        return call


def _stop_with_parent(parent: int) -> None:
    """A SIGTERM (a stop request) for this worker when its parent dies: a ``kill -9`` of the
    search left its workers training on their own. Linux only (``prctl``); elsewhere a
    worker finishes its trials."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() != parent:  # it died before that: no signal will come
            os.kill(os.getpid(), signal.SIGTERM)


def _quiet_worker(
    parent: int | None,
    *args: Any,
    modules: Sequence[str] = (),
    threads: int | None = None,
    workers: int = 1,
) -> None:
    """:func:`_worker` in a child process that ignores Ctrl-C (which reaches the whole
    process group: each worker printed two tracebacks). The parent stops the workers with
    SIGTERM and reports the interruption once; a worker takes SIGTERM as a stop request
    (:class:`_StopRequest`), so Optuna marks its running trial failed at once (a resumed
    search re-runs it) instead of leaving it RUNNING until its heartbeat goes stale. The
    parent's death, even by SIGKILL, stops it too (:func:`_stop_with_parent`). ``modules``
    (a keyword): those of the maps the parent had registered, imported first (a spawned
    child starts with kernelstudy's own maps only); ``threads``: torch's thread count here;
    ``workers``: how many run at once (recorded with each trial)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as err:  # the search may not use its maps: a trial that does fails
            print(f"search worker: cannot import {module} ({err})", file=sys.stderr)
    request = _StopRequest()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, request.handle)
    if parent is not None:  # the pid of the process that started it
        _stop_with_parent(parent)
    try:
        _worker(*args, threads=threads, request=request, workers=workers)
    except KeyboardInterrupt:
        if not request.requested:
            raise
    except TrialsKeepFailing:  # the parent says why, once (each worker printed a traceback)
        sys.exit(KEEP_FAILING_EXIT_CODE)
    if request.requested:
        sys.exit(STOPPED_EXIT_CODE)


def _interruptible_worker(*args: Any) -> None:
    """:func:`_worker` in this process (a one-worker search) with Ctrl-C as a stop request
    (:class:`_StopRequest`), as the workers of a multi-worker search take their SIGTERM:
    the running trial is failed (a resumed search re-runs it), without Optuna's "trial
    failed" traceback, which Ctrl-C printed before the search's own "interrupted"; then
    KeyboardInterrupt is raised. A second Ctrl-C interrupts at once. Where SIGINT is not
    Python's default (ignored, or a caller's handler), or off the main thread, it is left
    alone. A SIGTERM (``timeout``, a job scheduler) is a stop request too where it has the
    default action; once the trial is failed, the process ends by that SIGTERM (it left
    the trial RUNNING until its heartbeat went stale)."""
    in_main = threading.current_thread() is threading.main_thread()
    if not in_main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        _worker(*args)
        return
    request = _StopRequest(second_at_once=True)
    verbosity = optuna.logging.get_verbosity()
    term = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    signal.signal(signal.SIGINT, request.handle)
    if term:
        signal.signal(signal.SIGTERM, request.handle)
    try:
        _worker(*args, request=request)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if term:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        optuna.logging.set_verbosity(verbosity)  # the handler's ERROR too
        if term and request.signum == signal.SIGTERM:
            signal.raise_signal(signal.SIGTERM)  # its default action, now the trial is failed
    if request.requested:  # the study stopped after its trial: the caller reports it
        raise KeyboardInterrupt


def run_workers(
    url: str,
    name: str,
    objective: Callable[[optuna.Trial], float],
    trials: int,
    workers: int = 1,
    pruner: str = "median",
    seed: int = 0,
    heartbeat: tuple[int, int] = (HEARTBEAT_INTERVAL, GRACE_PERIOD),
    progress: Callable[[int], None] | None = None,
) -> optuna.Study:
    """Optimize study ``name`` with ``workers`` processes until ``trials`` trials trained
    (:func:`search_finished`).

    ``objective`` must be picklable (a module-level function or a
    ``functools.partial`` of one). Every worker samples with :class:`TrialSeededSampler`
    of ``seed`` (distinct draws per trial number). A trial of a dead worker (stale
    heartbeat) is failed and re-queued first, even when the study is already finished.
    A worker that exits with an error raises ``ChildProcessError`` once all have ended.
    ``progress(finished)`` gets the number of finished trials (:func:`finished_trials`) at
    the start, after each trial of a single worker, and every :data:`PROGRESS_SECONDS` while
    several run.
    """
    workers = check_count("workers", workers, 1)
    trials = check_count("trials", trials, 1)
    # Creates the study once (checking the URL) before any worker starts.
    study = open_study(url, name, pruner=pruner, seed=seed, heartbeat=heartbeat)
    # Optuna fails stale trials only when a trial starts: a finished study kept them RUNNING.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    requeue_failed(study)
    if progress is not None:
        progress(finished_trials(study))
    if workers == 1:
        _interruptible_worker(url, name, objective, trials, pruner, seed, heartbeat, progress)
        return study
    ctx = mp.get_context("spawn")
    # each worker would take torch's default thread count (all cores): 2 workers on 2
    # cores ran small trials 10-35x slower than one
    threads = max(1, torch.get_num_threads() // workers)
    procs = [
        ctx.Process(
            target=_quiet_worker,
            args=(os.getpid(), url, name, objective, trials, pruner, seed, heartbeat),
            # maps of the user's modules registered here, known in each worker too (a map a
            # script registered worked with 1 worker and failed in every worker of 2)
            kwargs={"modules": registered_modules(), "threads": threads, "workers": workers},
        )
        for _ in range(workers)
    ]
    try:
        for p in procs:
            p.start()
        for p in procs:
            while p.is_alive():
                p.join(timeout=PROGRESS_SECONDS if progress is not None else None)
                _report_progress(progress, study)
        _report_progress(progress, study)  # and at the end
    except KeyboardInterrupt:
        started = [p for p in procs if p.pid is not None]
        for p in started:
            p.terminate()  # SIGTERM: each worker fails its running trial and exits
        for p in started:
            p.join(timeout=STOP_TIMEOUT)
            if p.is_alive():  # stuck (e.g. in a storage call): its trial goes stale instead
                p.kill()
                p.join()
        raise
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed and all(code == KEEP_FAILING_EXIT_CODE for code in failed):
        raise TrialsKeepFailing(_keep_failing(study, len(failed), workers))
    if failed:  # as one worker's error ends a single-process search
        raise ChildProcessError(f"search {name}: {_exits(failed, workers)}")
    return study


def _report_progress(progress: Callable[[int], None] | None, study: optuna.Study) -> None:
    """``progress(finished trials)`` while several workers run; a storage error in this
    read for the display (a busy or unreachable database) skips the update, where it ended
    the search with its workers left running."""
    if progress is None:
        return
    try:
        finished = finished_trials(study)
    except Exception:  # any storage error: the workers meet and report their own
        return
    progress(finished)


def _keep_failing(study: optuna.Study, stopped: int, workers: int) -> str:
    """The :class:`TrialsKeepFailing` message of workers that stopped as their trials kept
    failing, with the last failed trial's error (as one worker's message gives it)."""
    failed = study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
    last = max(failed, key=lambda t: t.number, default=None)
    reason = "" if last is None else last.user_attrs.get(FAIL_REASON_ATTR, "")
    why = f"; the last one (trial {last.number}): {reason}" if reason else ""
    return (
        f"study {study.study_name}: {stopped} of {workers} worker(s) stopped after "
        f"{MAX_FAILURES_IN_A_ROW} failed trials in a row{why}"
    )


def _exits(codes: Sequence[int], workers: int) -> str:
    """What ended the failed workers, from their exit codes: an error (its traceback is
    above) or a signal (nothing is printed then: killed by the system's out-of-memory
    killer, say), e.g. ``"2 of 3 worker(s) failed: 1 exited with an error (traceback above),
    1 was killed by signal 9 (SIGKILL)"``."""
    parts = []
    errors = sum(c > 0 and c != KEEP_FAILING_EXIT_CODE for c in codes)
    if errors:
        parts.append(f"{errors} exited with an error (traceback above)")
    keep_failing = sum(c == KEEP_FAILING_EXIT_CODE for c in codes)
    if keep_failing:
        parts.append(f"{keep_failing} stopped as their trials kept failing")
    for code in sorted({c for c in codes if c < 0}):
        try:
            signame = f" ({signal.Signals(-code).name})"
        except ValueError:
            signame = ""
        count = sum(c == code for c in codes)
        parts.append(f"{count} {'was' if count == 1 else 'were'} killed by signal {-code}{signame}")
    return f"{len(codes)} of {workers} worker(s) failed: " + ", ".join(parts)
