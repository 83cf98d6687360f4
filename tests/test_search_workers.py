"""Many workers on one study: SQLite always, PostgreSQL where a server is given.

``.ci/run`` starts PostgreSQL on loopback and sets KERNELSTUDY_TEST_POSTGRES_URL.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid

import optuna
import pytest
from optuna.trial import TrialState

from kernelstudy.search.workers import _worker, open_study, run_workers

POSTGRES_ENV = "KERNELSTUDY_TEST_POSTGRES_URL"
FAST_HEARTBEAT = (1, 3)


def quick_objective(trial: optuna.Trial) -> float:
    x = trial.suggest_float("x", -1.0, 1.0)
    time.sleep(0.05)
    trial.report(-(x**2), 0)
    return -(x**2)


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
