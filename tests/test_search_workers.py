"""Many workers on one study: SQLite always, PostgreSQL where a server is given.

``.ci/run`` starts PostgreSQL on loopback and sets KERNELSTUDY_TEST_POSTGRES_URL.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import subprocess
import sys
import time
import uuid
import warnings

import optuna
import pytest
import torch
from optuna.trial import TrialState

from kernelstudy.search import workers as workers_module
from kernelstudy.search.workers import (
    DUPLICATE_ATTR,
    MAX_ATTEMPTS_PER_TRIAL,
    MAX_FAILURES_IN_A_ROW,
    TrialsKeepFailing,
    _worker,
    finished_trials,
    open_study,
    record_failures,
    requeue_failed,
    retried_from,
    run_workers,
)

from .conftest import process_alive

POSTGRES_ENV = "KERNELSTUDY_TEST_POSTGRES_URL"
FAST_HEARTBEAT = (1, 3)


def quick_objective(trial: optuna.Trial) -> float:
    x = trial.suggest_float("x", -1.0, 1.0)
    time.sleep(0.05)
    trial.report(-(x**2), 0)
    return -(x**2)


def marking_objective(trial: optuna.Trial) -> float:
    """quick_objective that leaves a mark on every trial it runs."""
    trial.set_user_attr("ran", True)
    return quick_objective(trial)


def broken_objective(trial: optuna.Trial) -> float:
    trial.suggest_float("x", -1.0, 1.0)
    raise ValueError("a model that cannot be built")


def thread_counting_objective(trial: optuna.Trial) -> float:
    trial.set_user_attr("threads", torch.get_num_threads())
    return quick_objective(trial)


def half_over_budget_objective(trial: optuna.Trial) -> float:
    """quick_objective whose x < 0 is pruned before training, as objective.train_run prunes
    an over-budget model (user attr ``pruned_reason``)."""
    x = trial.suggest_float("x", -1.0, 1.0)
    if x < 0:
        trial.set_user_attr("pruned_reason", "feature-map parameters over the budget")
        raise optuna.TrialPruned("over the budget")
    return -(x**2)


def over_budget_after_first_objective(trial: optuna.Trial) -> float:
    """Trains trial 0 only; later ones are refused by the model (``refused_reason``)."""
    x = trial.suggest_float("x", -1.0, 1.0)
    if trial.number > 0:
        trial.set_user_attr("refused_reason", "refused by the model: too many features")
        raise optuna.TrialPruned("refused")
    return -(x**2)


def all_over_budget_objective(trial: optuna.Trial) -> float:
    trial.suggest_float("x", -1.0, 1.0)
    trial.set_user_attr("pruned_reason", "feature-map parameters over the budget")
    raise optuna.TrialPruned("over the budget")


def test_trials_pruned_before_training_do_not_count(tmp_path):
    """A trial pruned before training (over the parameter budget, refused by the model)
    counted towards ``trials``: a variant half of whose space was over the budget trained
    about half as many trials as the others. It now trains ``trials``; a variant whose first
    ``trials`` all were over the budget stops there (every setting of a map over the budget),
    and one that keeps being refused stops after MAX_ATTEMPTS_PER_TRIAL x ``trials``."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = run_workers(url, "half", half_over_budget_objective, trials=6, workers=1)
    states = [t.state for t in study.get_trials()]
    assert finished_trials(study) == states.count(TrialState.COMPLETE) == 6
    assert states.count(TrialState.PRUNED) > 0  # (seed 0: x < 0 drawn too)
    study = run_workers(url, "all", all_over_budget_objective, trials=3, workers=1)
    assert len(study.get_trials()) == 3 and finished_trials(study) == 0
    study = run_workers(url, "first", over_budget_after_first_objective, trials=2, workers=1)
    assert len(study.get_trials()) == MAX_ATTEMPTS_PER_TRIAL * 2 and finished_trials(study) == 1
    assert run_workers(url, "first", over_budget_after_first_objective, trials=2) is not None
    assert len(study.get_trials()) == MAX_ATTEMPTS_PER_TRIAL * 2  # a rerun: nothing more


def test_workers_share_the_cores(tmp_path):
    """Each spawned worker took torch's default thread count: 2 workers on 2 cores ran
    small trials 10-35x slower than one."""
    url = f"sqlite:///{tmp_path / 'threads.db'}"
    study = run_workers(url, "threads", thread_counting_objective, trials=2, workers=2)
    want = max(1, torch.get_num_threads() // 2)
    assert {t.user_attrs["threads"] for t in study.get_trials()} == {want}
    # recorded with each trial: its training time depends on them (the report's figure)
    assert {
        (t.user_attrs["workers"], t.user_attrs["torch_threads"]) for t in study.get_trials()
    } == {(2, want)}
    study = run_workers(url, "one", quick_objective, trials=1, workers=1)
    assert study.get_trials()[0].user_attrs["workers"] == 1


def slow_objective(trial: optuna.Trial) -> float:
    x = trial.suggest_float("x", -1.0, 1.0)
    time.sleep(1.0)
    return -(x**2)


@pytest.mark.parametrize("workers", [1, 2])
def test_progress_counts_the_finished_trials(tmp_path, monkeypatch, workers):
    """A search's bar counted variants only: a variant's trials (hours at full size) showed no
    progress. ``progress`` gets the finished trials at the start (those of a resumed study),
    after each trial of one worker, and while several run (every PROGRESS_SECONDS), ending at
    the total."""
    monkeypatch.setattr(workers_module, "PROGRESS_SECONDS", 0.2)
    url = f"sqlite:///{tmp_path / 'progress.db'}"
    seen: list[int] = []
    run_workers(url, "p", slow_objective, trials=2, workers=workers, progress=seen.append)
    # two workers may each finish a trial past the second (the search's bar clips)
    assert seen[0] == 0 and 2 <= seen[-1] <= workers + 1 and seen == sorted(seen), seen
    if workers == 1:
        assert seen == [0, 1, 2], seen  # after each trial
    finished = seen[-1]
    seen.clear()
    run_workers(url, "p", slow_objective, trials=finished + 1, workers=1, progress=seen.append)
    assert seen == [finished, finished + 1], seen  # resumed: those finished come first


def test_a_storage_error_in_the_progress_read_skips_the_update():
    """The parent of several workers reads the finished trials for the bar every 2 s; an error
    there (a busy or unreachable database) ended the search with its workers left running."""

    class Unreadable:
        def get_trials(self, *args, **kwargs):
            raise optuna.exceptions.StorageInternalError("database is locked")

    seen: list[int] = []
    workers_module._report_progress(seen.append, Unreadable())
    assert seen == []
    workers_module._report_progress(None, Unreadable())  # no bar: nothing read


def hanging_objective(trial: optuna.Trial) -> float:
    trial.suggest_float("x", -1.0, 1.0)
    time.sleep(600)
    return 0.0


def _url(kind: str, tmp_path) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'study.db'}"
    url = os.environ.get(POSTGRES_ENV)
    if not url:
        pytest.skip(f"no PostgreSQL server: set {POSTGRES_ENV} (.ci/run starts one)")
    return url


def test_failed_workers_raise_as_a_single_failed_worker_does(tmp_path):
    """Every worker crashing used to end the search with exit code 0."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    with pytest.raises(ValueError, match="cannot be built"):
        run_workers(url, "one", broken_objective, trials=2, workers=1)
    with pytest.raises(ChildProcessError, match="2 of 2 worker"):
        run_workers(url, "two", broken_objective, trials=2, workers=2)


def self_killing_objective(trial: optuna.Trial) -> float:
    """Dies as the out-of-memory killer ends a process: SIGKILL, no traceback."""
    import signal

    trial.suggest_float("x", -1.0, 1.0)
    os.kill(os.getpid(), signal.SIGKILL)
    return 0.0


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
def test_workers_killed_by_a_signal_are_named_as_such(tmp_path):
    """A worker killed by a signal prints nothing, yet the error said "exited with an error
    (above)": it now names the signal, and says where a traceback is."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    with pytest.raises(ChildProcessError) as err:
        run_workers(url, "killed", self_killing_objective, trials=2, workers=2)
    assert str(err.value).endswith("2 of 2 worker(s) failed: 2 were killed by signal 9 (SIGKILL)")
    from kernelstudy.search import workers

    assert workers._exits([1, -9, 1], 4) == (
        "3 of 4 worker(s) failed: 2 exited with an error (traceback above), "
        "1 was killed by signal 9 (SIGKILL)"
    )


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_two_workers_record_every_trial_once(kind, tmp_path):
    url, name = _url(kind, tmp_path), f"workers-{uuid.uuid4().hex[:8]}"
    study = run_workers(url, name, quick_objective, trials=8, workers=2, heartbeat=FAST_HEARTBEAT)
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert 8 <= len(complete) <= 9  # each worker stops once the study holds 8
    assert len({t.number for t in trials}) == len(trials)
    assert all(t.value == -(t.params["x"] ** 2) for t in complete)
    # Running the same command again joins the study and adds nothing: it is finished.
    again = run_workers(url, name, quick_objective, trials=8, workers=1, heartbeat=FAST_HEARTBEAT)
    assert len(again.get_trials(deepcopy=False)) == len(trials)


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_killed_worker_trial_is_failed_and_retried(kind, tmp_path):
    url, name = _url(kind, tmp_path), f"killed-{uuid.uuid4().hex[:8]}"
    study = open_study(url, name, heartbeat=FAST_HEARTBEAT)
    ctx = mp.get_context("spawn")
    args = (url, name, hanging_objective, 3, "median", 0, FAST_HEARTBEAT)
    proc = ctx.Process(target=_worker, args=args)
    proc.start()
    deadline = time.time() + 60
    while time.time() < deadline:
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if running and "x" in running[0].params:  # started and past its suggestion
            break
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("the worker never started a trial")
    proc.kill()
    proc.join()
    killed = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))[0]
    time.sleep(FAST_HEARTBEAT[1] + 1)
    run_workers(url, name, quick_objective, trials=3, workers=1, heartbeat=FAST_HEARTBEAT)
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    assert trials[killed.number].state == TrialState.FAIL
    complete = [t for t in trials.values() if t.state == TrialState.COMPLETE]
    assert len(complete) == 3
    # The failed trial's parameters were re-queued and finished by the other worker.
    assert any(t.params["x"] == killed.params["x"] for t in complete)


def _race_requeue(study: optuna.Study, x: float) -> int:
    """A failed trial re-queued twice, as two workers starting at the same instant do: both
    read the trials, see it not yet retried, and each add a copy. Returns its number."""
    study.add_trial(
        optuna.create_trial(
            state=TrialState.FAIL,
            params={"x": x},
            distributions={"x": optuna.distributions.FloatDistribution(-1.0, 1.0)},
        )
    )
    failed = study.get_trials(deepcopy=False)[-1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        with_retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=2)
    for _ in range(2):  # what requeue_failed does in each worker
        with_retry(study, copy.deepcopy(failed))
    assert requeue_failed(study) == []  # both copies mark it retried
    return failed.number


@pytest.mark.parametrize("kind, workers", [("sqlite", 1), ("sqlite", 2), ("postgres", 2)])
def test_duplicate_requeue_runs_once(kind, workers, tmp_path):
    url, name = _url(kind, tmp_path), f"dup-{uuid.uuid4().hex[:8]}"
    study = open_study(url, name, heartbeat=FAST_HEARTBEAT)
    failed = _race_requeue(study, 0.25)
    copies = [t for t in study.get_trials() if retried_from(t) == failed]
    assert len(copies) == 2 and all(t.state == TrialState.WAITING for t in copies)

    run_workers(url, name, marking_objective, trials=3, workers=workers, heartbeat=FAST_HEARTBEAT)
    trials = {t.number: t for t in study.get_trials()}
    first, second = (trials[t.number] for t in copies)
    # The lower-numbered copy ran; the other was pruned before the objective, with a reason.
    assert first.state == TrialState.COMPLETE and first.user_attrs["ran"]
    assert first.params == {"x": 0.25} and first.value == -(0.25**2)
    assert second.state == TrialState.PRUNED and "ran" not in second.user_attrs
    assert second.user_attrs[DUPLICATE_ATTR] == failed
    assert f"trial {first.number} re-runs it" in second.user_attrs["pruned_reason"]
    assert not second.intermediate_values
    # The duplicate cost no trial: 3 real ones finished (a 2nd worker may add one more).
    ran = [t for t in trials.values() if t.user_attrs.get("ran")]
    assert all(t.state == TrialState.COMPLETE for t in ran)
    assert finished_trials(study) == len(ran) and 3 <= len(ran) <= 2 + workers


def test_a_resumed_study_does_not_replay_the_first_runs_points(tmp_path):
    url = f"sqlite:///{tmp_path / 'resume.db'}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = open_study(url, "resume", seed=0)
        first.optimize(quick_objective, n_trials=4)
        again = open_study(url, "resume", seed=0)  # a rerun of the same command
        again.optimize(quick_objective, n_trials=4)
    xs = [t.params["x"] for t in again.get_trials()]
    assert len(set(xs)) == 8  # TPE's 10 random start-up draws: none repeated


def test_two_commands_started_together_propose_different_points(tmp_path):
    """Samplers seeded once per worker (``seed + index``) gave worker 0 of two commands
    started together on one study the same points, trial after trial."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = open_study(url, "shared", seed=0), open_study(url, "shared", seed=0)
        xs = []
        for _ in range(4):  # interleaved, as two machines' workers are
            for study in (a, b):
                trial = study.ask()
                xs.append(trial.suggest_float("x", -1.0, 1.0))
                study.tell(trial, -(xs[-1] ** 2))
    assert len(set(xs)) == len(xs)


def test_one_worker_with_one_seed_proposes_the_same_points_again(tmp_path):
    """Per-trial seeding keeps a single worker's search reproducible, past TPE's 10
    random start-up trials; another seed, or another study (variant), draws otherwise."""
    runs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for run in ("a", "b"):
            study = open_study(f"sqlite:///{tmp_path / run}.db", "s", seed=3)
            study.optimize(quick_objective, n_trials=13)
            runs.append([t.params["x"] for t in study.get_trials()])
        other = open_study(f"sqlite:///{tmp_path / 'c'}.db", "s", seed=4)
        other.optimize(quick_objective, n_trials=3)
        renamed = open_study(f"sqlite:///{tmp_path / 'd'}.db", "another variant", seed=3)
        renamed.optimize(quick_objective, n_trials=3)
    assert runs[0] == runs[1]
    assert [t.params["x"] for t in other.get_trials()] != runs[0][:3]
    assert [t.params["x"] for t in renamed.get_trials()] != runs[0][:3]


def test_a_finished_search_still_fails_and_requeues_a_dead_workers_trial(tmp_path):
    """A rerun that found the study finished returned at once, leaving the trial of a
    worker killed meanwhile RUNNING for good (Optuna checks heartbeats only when a trial
    starts), and the summary did not show it."""
    from kernelstudy.search.runner import study_row

    url, name = f"sqlite:///{tmp_path / 'study.db'}", "dead"
    run_workers(url, name, quick_objective, trials=2, workers=1, heartbeat=FAST_HEARTBEAT)
    study = open_study(url, name, heartbeat=FAST_HEARTBEAT)
    proc = mp.get_context("spawn").Process(
        target=_worker, args=(url, name, hanging_objective, 3, "median", 0, FAST_HEARTBEAT)
    )
    proc.start()
    deadline = time.time() + 60
    while True:  # until the worker's trial runs past its suggestion (and heartbeat)
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if running and "x" in running[0].params:
            break
        if time.time() > deadline:
            proc.kill()
            pytest.fail("the worker never started a trial")
        time.sleep(0.2)
    proc.kill()
    proc.join()
    killed = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))[0]
    assert study_row(study, "v")["running"] == 1
    time.sleep(FAST_HEARTBEAT[1] + 1)
    run_workers(url, name, quick_objective, trials=2, workers=1, heartbeat=FAST_HEARTBEAT)
    trials = study.get_trials(deepcopy=False)
    assert trials[killed.number].state == TrialState.FAIL
    waiting = [t for t in trials if t.state == TrialState.WAITING]
    assert [retried_from(t) for t in waiting] == [killed.number]
    row = study_row(study, "v")
    assert (row["finished"], row["failed"], row["running"], row["waiting"]) == (2, 1, 0, 1)


def failing_objective(trial: optuna.Trial) -> float:
    trial.suggest_float("x", -1.0, 1.0)
    raise FloatingPointError("non-finite training loss nan at step 3")


def test_a_search_whose_trials_all_fail_stops(tmp_path, capfd):
    """Failures caught by Optuna (out of memory, divergence) do not count as finished, so a
    search whose every trial failed used to run forever, filling the database. With several
    workers each printed a TrialsKeepFailing traceback and the search ended in "2 of 2
    worker(s) failed: 2 exited with an error"; it now says why, as one worker does."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    with pytest.raises(TrialsKeepFailing, match=r"last 5 trials failed.*trial 4.*step 3"):
        run_workers(url, "fails", failing_objective, trials=3, workers=1)
    trials = open_study(url, "fails").get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL] * MAX_FAILURES_IN_A_ROW
    assert "FloatingPointError" in trials[0].user_attrs["fail_reason"]
    capfd.readouterr()
    why = r"2 of 2 worker\(s\) stopped after 5 failed trials in a row; the last one .*step 3"
    with pytest.raises(TrialsKeepFailing, match=why):
        run_workers(url, "fails_two", failing_objective, trials=3, workers=2)
    assert "TrialsKeepFailing" not in capfd.readouterr().err  # (trials' own warnings stay)


def diverging_below_zero(trial: optuna.Trial) -> float:
    """Diverges (deterministically, as seeded training does) for x < 0."""
    x = trial.suggest_float("x", -1.0, 1.0)
    if x < 0:
        raise FloatingPointError("non-finite training loss nan at step 3")
    return -(x**2)


def test_a_resume_reruns_interrupted_trials_but_not_diverged_ones(tmp_path):
    """Diverged trials re-queued at every resume failed again (training is seeded) and five
    in a row stopped the search; a re-queued copy kept the failure's fail_reason."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = open_study(url, "resume")
    for x in (-0.5, -0.4, -0.3, -0.2, -0.1):
        study.enqueue_trial({"x": x})
    study.optimize(record_failures(diverging_below_zero), n_trials=5, catch=(FloatingPointError,))
    oom = optuna.trial.create_trial(
        state=TrialState.FAIL,
        params={"x": 0.5},
        distributions={"x": optuna.distributions.FloatDistribution(-1.0, 1.0)},
        user_attrs={"fail_reason": "RuntimeError: out of memory"},
    )
    study.add_trial(oom)
    assert requeue_failed(study) == [5]  # the interrupted one only
    copy_ = study.get_trials()[-1]
    assert copy_.state == TrialState.WAITING and "fail_reason" not in copy_.user_attrs
    run_workers(url, "resume", diverging_below_zero, trials=2)  # no TrialsKeepFailing
    states = [t.state for t in open_study(url, "resume").get_trials()]
    assert states[:6] == [TrialState.FAIL] * 6 and states[6] == TrialState.COMPLETE


@pytest.mark.parametrize(
    "error",
    [
        ValueError("Cannot tell a COMPLETE trial."),
        optuna.exceptions.UpdateFinishedTrialError("Trial#2 has already finished"),
    ],
    ids=["tell", "update"],
)
def test_a_trial_another_worker_finished_does_not_stop_this_one(tmp_path, monkeypatch, error):
    """Two workers on SQLite can take the same waiting trial; the second to finish could not
    report it and its worker died, failing the search (about 1 run in 6 of
    test_duplicate_requeue_runs_once[sqlite-2])."""
    real = optuna.Study.optimize
    raised = []

    def optimize_once_told_elsewhere(self, *args, **kwargs):
        if not raised:
            raised.append(True)
            raise error
        return real(self, *args, **kwargs)

    monkeypatch.setattr(optuna.Study, "optimize", optimize_once_told_elsewhere)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = run_workers(url, "told", quick_objective, trials=2, workers=1)
    assert raised and finished_trials(study) == 2


def _failed_commit(replaced_by_assertion: bool) -> Exception:
    """What Optuna raises when SQLite cannot commit (a full disk): its StorageInternalError
    from sqlite3's OperationalError, or "Should not reach" from its clean-up after that."""
    import sqlite3

    try:
        try:
            raise sqlite3.OperationalError("database or disk is full")
        except sqlite3.OperationalError as err:
            raise optuna.exceptions.StorageInternalError("invalid data, e.g. max length") from err
    except optuna.exceptions.StorageInternalError as err:
        if not replaced_by_assertion:
            return err
        try:
            raise AssertionError("Should not reach.")
        except AssertionError as final:
            assert final.__context__ is err
            return final


@pytest.mark.parametrize("replaced", [False, True], ids=["storage_error", "assertion"])
def test_a_database_that_takes_no_more_writes_is_one_error_naming_it(
    tmp_path, monkeypatch, replaced
):
    """A disk that filled mid-search ended in Optuna's traceback, whose last line said
    "invalid data ... exceeding max length" or "AssertionError: Should not reach."."""
    error = _failed_commit(replaced)

    def full(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(optuna.Study, "optimize", full)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    with pytest.raises(ValueError, match=r"study\.db failed: database or disk is full; the "):
        _worker(url, "full", quick_objective, trials=2, pruner="none", seed=0)
    monkeypatch.setattr(
        optuna.Study,
        "optimize",
        lambda *a, **k: (_ for _ in ()).throw(AssertionError("a bug of our own")),
    )
    with pytest.raises(AssertionError, match="a bug of our own"):  # not the database's
        _worker(url, "full", quick_objective, trials=2, pruner="none", seed=0)


def test_a_read_only_database_is_refused_when_opened(tmp_path, monkeypatch):
    """A read-only SQLite file (or folder) failed only at the first trial's commit."""
    from kernelstudy.search import storage

    url = f"sqlite:///{tmp_path / 'study.db'}"
    storage.open_storage(url)  # made, and writable
    real = storage.RDBStorage

    def read_only(*args, **kwargs):  # as without write permission (root has it regardless)
        made = real(*args, **kwargs)
        made.engine.dispose()
        from sqlalchemy import create_engine

        made.engine = create_engine(f"sqlite:///file:{tmp_path / 'study.db'}?mode=ro&uri=true")
        return made

    monkeypatch.setattr(storage, "RDBStorage", read_only)
    with pytest.raises(ValueError, match="study.db takes no writes: attempt to write a readonly"):
        storage.open_storage(url, writable=True)
    storage.open_storage(url)  # a report or an evaluation only reads it: taken as it is


def test_ctrl_c_fails_the_workers_running_trials_at_once(tmp_path):
    """After a Ctrl-C the parent used to terminate its workers outright: their running
    trials stayed RUNNING until the heartbeat went stale. Now each worker fails its trial."""
    import signal
    import threading

    url, name = f"sqlite:///{tmp_path / 'study.db'}", "ctrl-c"
    study = open_study(url, name)  # the default heartbeat: stale only after minutes

    done = threading.Event()

    def interrupt_when_both_run() -> None:
        deadline = time.time() + 60
        while time.time() < deadline and not done.is_set():
            running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if len(running) == 2 and all("x" in t.params for t in running):
                break
            time.sleep(0.2)
        if not done.is_set():
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C: the parent raises KeyboardInterrupt

    watcher = threading.Thread(target=interrupt_when_both_run)
    watcher.start()
    start = time.time()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_workers(url, name, hanging_objective, trials=2, workers=2)
    finally:
        done.set()  # a failure above must not leave a SIGINT on its way to pytest
        watcher.join()
    assert time.time() - start < 90
    states = [t.state for t in study.get_trials(deepcopy=False)]
    assert states == [TrialState.FAIL, TrialState.FAIL]
    # A resumed search re-runs both, with their parameters.
    failed = {t.params["x"] for t in study.get_trials(deepcopy=False)}
    run_workers(url, name, quick_objective, trials=2, workers=1)
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    assert {t.params["x"] for t in complete} == failed


def _signal_in_the_final_save(monkeypatch, signum: int) -> None:
    """Send this process ``signum`` from inside Optuna's save of a trial's final state."""
    storage = optuna.storages.RDBStorage
    real = storage.set_trial_state_values

    def save_and_get_signalled(self, trial_id, state, values=None):
        if state != TrialState.RUNNING:  # the save at the end of the trial
            os.kill(os.getpid(), signum)
        return real(self, trial_id, state, values)

    monkeypatch.setattr(storage, "set_trial_state_values", save_and_get_signalled)


def _quiet_worker_exit(url: str, name: str, objective) -> int | str | None:
    """A multi-worker search's worker (``_quiet_worker``) run here on 3 trials of ``objective``:
    its exit code (it exits by SystemExit), with the signal handlers and Optuna's verbosity it
    sets put back."""
    import signal

    from kernelstudy.search import workers

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    verbosity = optuna.logging.get_verbosity()
    try:
        with pytest.raises(SystemExit) as stopped:
            workers._quiet_worker(None, url, name, objective, 3, "median", 0)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        optuna.logging.set_verbosity(verbosity)
    return stopped.value.code


def test_a_stop_that_arrives_while_optuna_saves_a_result_waits_for_the_save(tmp_path, monkeypatch):
    """The parent's SIGTERM raised inside Optuna's final save of a trial: Optuna's cleanup
    failed with an UnboundLocalError traceback, the worker exited 1, the trial stayed
    RUNNING. The stop now waits for the save and the worker exits 130."""
    import signal

    from kernelstudy.search import workers

    url, name = f"sqlite:///{tmp_path / 'study.db'}", "stop-in-save"
    open_study(url, name)
    _signal_in_the_final_save(monkeypatch, signal.SIGTERM)
    assert _quiet_worker_exit(url, name, quick_objective) == workers.STOPPED_EXIT_CODE
    states = [t.state for t in open_study(url, name).get_trials(deepcopy=False)]
    assert states == [TrialState.COMPLETE]  # saved, and no second trial was started


def test_a_stop_that_arrives_inside_a_report_waits_for_it(tmp_path, monkeypatch):
    """A SIGTERM raised inside ``trial.report``'s storage call (where a one-worker search's
    stop right after a report lands) interrupted it there, with the storage mid-call; it now
    waits for the report, then interrupts the objective: the value is stored, the trial
    failed (a resumed search re-runs it), the worker exits 130."""
    import signal

    from kernelstudy.search import workers

    url, name = f"sqlite:///{tmp_path / 'study.db'}", "stop-in-report"
    open_study(url, name)
    storage = optuna.storages.RDBStorage
    real = storage.set_trial_intermediate_value

    def report_and_get_signalled(self, trial_id, step, value):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(self, trial_id, step, value)

    monkeypatch.setattr(storage, "set_trial_intermediate_value", report_and_get_signalled)
    trained = []

    def objective(trial: optuna.Trial) -> float:
        trial.report(0.5, 0)
        trained.append(trial.number)  # never reached: the stop interrupts after the report
        return 0.5

    assert _quiet_worker_exit(url, name, objective) == workers.STOPPED_EXIT_CODE and not trained
    (trial,) = open_study(url, name).get_trials(deepcopy=False)
    assert trial.state == TrialState.FAIL and trial.intermediate_values == {0: 0.5}


ORPHAN_SCRIPT = """
import os, sys, time
from kernelstudy.search.workers import run_workers

def objective(trial):
    open(os.path.join(sys.argv[1], f"pid{os.getpid()}"), "w").close()
    time.sleep(120)
    return 0.0

if __name__ == "__main__":
    run_workers(f"sqlite:///{sys.argv[1]}/s.db", "s", objective, trials=4, workers=2)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux-only")
def test_workers_stop_when_the_search_is_killed(tmp_path):
    """A SIGKILL of `kernelstudy search --workers 2` left both workers training on their
    own (a re-run then ran beside them)."""
    script = tmp_path / "search.py"
    script.write_text(ORPHAN_SCRIPT)
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)])
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("pid*"))) < 2 and time.monotonic() < deadline:
            assert parent.poll() is None, "the search ended early"
            time.sleep(0.2)
        workers = [int(p.name[3:]) for p in tmp_path.glob("pid*")]
        assert len(workers) == 2, "the workers did not start their trials"
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 60
    while any(map(process_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(process_alive, workers))


def test_ctrl_c_of_one_worker_while_optuna_saves_a_result_waits_for_the_save(tmp_path, monkeypatch):
    """A one-worker search runs in the caller's process: a Ctrl-C that arrived inside
    Optuna's final save of a trial raised there, and Optuna's cleanup failed with an
    UnboundLocalError traceback and left the trial RUNNING. It now stops the search after the
    save, with KeyboardInterrupt, and leaves Ctrl-C and Optuna's verbosity as they were."""
    import signal

    url, name = f"sqlite:///{tmp_path / 'study.db'}", "ctrl-c-in-save"
    _signal_in_the_final_save(monkeypatch, signal.SIGINT)
    verbosity = optuna.logging.get_verbosity()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):
        run_workers(url, name, quick_objective, trials=3, workers=1)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert optuna.logging.get_verbosity() == verbosity
    states = [t.state for t in open_study(url, name).get_trials(deepcopy=False)]
    assert states == [TrialState.COMPLETE]  # saved, and no second trial was started


def interrupting_objective(trial: optuna.Trial) -> float:
    """Ctrl-C during the first trial's training."""
    import signal

    trial.suggest_float("x", -1.0, 1.0)
    if trial.number == 0:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)  # interrupted
    return 0.0


def test_ctrl_c_of_one_worker_fails_its_trial_without_optunas_traceback(tmp_path):
    """Optuna logged "Trial 0 failed ... KeyboardInterrupt()" and its traceback before the
    search's own "interrupted"."""
    import logging

    url, name = f"sqlite:///{tmp_path / 'study.db'}", "ctrl-c-in-trial"
    logged: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = logged.append  # type: ignore[method-assign]
    logger = logging.getLogger("optuna")
    logger.addHandler(handler)
    start = time.time()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_workers(url, name, interrupting_objective, trials=2, workers=1)
    finally:
        logger.removeHandler(handler)
    assert time.time() - start < 20  # at once, not after the trial
    assert not [r.getMessage() for r in logged if r.levelno >= logging.WARNING]
    study = open_study(url, name)
    assert [t.state for t in study.get_trials(deepcopy=False)] == [TrialState.FAIL]
    # A resumed search re-runs it, with its parameters.
    failed = study.get_trials(deepcopy=False)[0].params
    run_workers(url, name, quick_objective, trials=2, workers=1)
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    assert len(complete) == 2 and failed in [t.params for t in complete]


def map_building_objective(trial: optuna.Trial) -> float:
    """quick_objective that first builds the map a test module registered."""
    import kernelstudy as ks

    ks.create_feature_map("workers_test_map", head_dim=4)
    return quick_objective(trial)


def test_spawned_workers_know_the_maps_the_parent_registered(tmp_path, monkeypatch):
    """A map registered by a module the search's process imported (not listed in
    KERNELSTUDY_FEATURE_MAPS) worked with 1 worker and failed in every worker of 2: a
    spawned child starts with kernelstudy's own maps. The workers import those modules."""
    from kernelstudy.feature_maps import registry

    (tmp_path / "workers_test_maps.py").write_text(
        "from kernelstudy.feature_maps import register_feature_map\n"
        "from kernelstudy.feature_maps.elementary import EluFeatureMap\n\n\n"
        '@register_feature_map("workers_test_map")\n'
        "class WorkersTestMap(EluFeatureMap):\n"
        "    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "workers_test_maps", raising=False)
    import workers_test_maps  # noqa: F401

    try:
        assert "workers_test_maps" in registry.registered_modules()
        url = f"sqlite:///{tmp_path / 'maps.db'}"
        study = run_workers(url, "maps", map_building_objective, trials=2, workers=2)
        assert finished_trials(study) >= 2  # each worker stops once 2 have finished
        assert not study.get_trials(states=(TrialState.FAIL,))
    finally:
        registry._REGISTRY.pop("workers_test_map", None)


def test_a_map_module_not_importable_by_name_is_not_sent_to_the_workers(tmp_path):
    """A map registered by a file run with runpy (module name ``<run_path>``) made every
    spawned worker fail to import it, also in a search that never used the map."""
    import runpy

    from kernelstudy.feature_maps import registry

    path = tmp_path / "loose_maps.py"
    path.write_text(
        "from kernelstudy.feature_maps import register_feature_map\n"
        "from kernelstudy.feature_maps.elementary import EluFeatureMap\n\n\n"
        '@register_feature_map("loose_test_map")\n'
        "class LooseTestMap(EluFeatureMap):\n"
        "    pass\n"
    )
    try:
        runpy.run_path(str(path))
        assert registry._REGISTRY["loose_test_map"].__module__ == "<run_path>"
        assert "<run_path>" not in registry.registered_modules()
        url = f"sqlite:///{tmp_path / 'loose.db'}"
        study = run_workers(url, "loose", quick_objective, trials=2, workers=2)
        assert finished_trials(study) >= 2
    finally:
        registry._REGISTRY.pop("loose_test_map", None)
