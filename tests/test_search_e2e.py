"""The search commands end to end on generated ListOps: search → evaluate → report, the
parameter budget, interrupt and resume, bad inputs, and --help."""

from __future__ import annotations

import contextlib
import copy
import math
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import optuna
import pandas as pd
import pytest
import torch
from optuna.trial import TrialState

from kernelstudy.cli import main
from kernelstudy.folders import ENV_STUDIES_DIR
from kernelstudy.search import evaluate as evaluate_module
from kernelstudy.search import objective as objective_module
from kernelstudy.search.config import load_config
from kernelstudy.search.evaluate import (
    current_runs,
    evaluation_seeds,
    read_evaluation,
    search_seed,
    trial_params,
)
from kernelstudy.search.objective import (
    check_variants,
    data_dir,
    default_settings,
    prepare_data,
)
from kernelstudy.search.report import StudySet, markdown, results_table
from kernelstudy.search.runner import search_summary, storage_url, variant_study
from kernelstudy.search.storage import load_study
from kernelstudy.search.workers import DUPLICATE_ATTR, requeue_failed

from .conftest import write_text_data

ROOT = Path(__file__).resolve().parents[1]

TINY = """
name = "tiny"
task = "listops"
generate = {{ n_train = 300, n_val = 60, n_test = 60, min_length = 5, max_length = 32 }}
[task_options]
max_length = 32
[model]
d_model = {d_model}
n_heads = {n_heads}
n_layers = 1
d_ff = 32
[train]
steps = {steps}
batch_size = 16
eval_every = 10
amp = false
[search]
trials = 2
seed = 0
[space]
lr = {{ low = 1e-3, high = 1e-2 }}
{variants}
"""
VARIANTS = {
    "Transformer": 'attention = "softmax"',
    "elu+1": 'feature_map = "elu"',
    "1xGLU": 'feature_map = "glu"\nfixed = { depth = 1 }',
    "3xGLU": 'feature_map = "glu"\nfixed = { depth = 3 }',
    "poly23": 'feature_map = "polynomial"\nfixed = { degree = { low = 2, high = 3 } }',
    "favor16/32": 'feature_map = "favor"\nfixed = { num_features = { choices = [16, 32] } }',
    "aoglu2-4": 'feature_map = "aoglu"\nfixed = { rank = { low = 2, high = 4 } }',
}


def write_config(tmp_path, labels, d_model=16, n_heads=2, steps=20, text=None) -> Path:
    variants = "".join(f'\n[[variants]]\nlabel = "{x}"\n{VARIANTS[x]}\n' for x in labels)
    path = tmp_path / "tiny.toml"
    path.write_text(
        text or TINY.format(d_model=d_model, n_heads=n_heads, steps=steps, variants=variants)
    )
    return path


def ks(*args) -> int:
    return main([str(a) for a in args])


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("KERNELSTUDY_BACKEND", os.environ.get("KERNELSTUDY_BACKEND", "torch"))


def studies(out: Path, name: str = "tiny") -> dict[str, optuna.Study]:
    url = f"sqlite:///{out / name / 'optuna.db'}"
    return {
        s.study_name: optuna.load_study(study_name=s.study_name, storage=url)
        for s in optuna.get_all_study_summaries(url)
    }


def test_quick_study_search_evaluate_report(tmp_path, capsys):
    cfg, out = write_config(tmp_path, ["Transformer", "elu+1", "1xGLU"]), tmp_path / "res"
    assert ks("search", cfg, "--out", out) == 0
    # the bar counts trials, all variants' (it counted variants: still for hours in one)
    assert re.search(r"search tiny: 100%\S* 6/6 \[[^]]*trial", capsys.readouterr().err)
    found = studies(out)
    assert sorted(found) == ["tiny/1xGLU", "tiny/Transformer", "tiny/elu+1"]
    for study in found.values():
        done = study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))
        assert len(done) == 2
        assert len(study.user_attrs["searched_under"]) == 1  # its pruner and sampler seed
        for t in study.get_trials(states=(TrialState.COMPLETE,)):
            assert 0.0 <= t.user_attrs["test_accuracy"] <= 1.0
            assert t.user_attrs["params_model"] > 0 and t.user_attrs["train_time_s"] > 0
            # the figures' "training time": the steps alone, not the evaluations in the wall time
            assert t.user_attrs["train_time_s"] < t.user_attrs["wall_time_s"]
            assert t.user_attrs["peak_memory_bytes"] > 0
            assert t.intermediate_values  # reported to the pruner during training
    glu = found["tiny/1xGLU"].best_trial.user_attrs
    assert 0 < glu["params_feature_map"] <= 0.1 * glu["params_model"]
    assert glu["feature_dim"] == 8

    assert ks("evaluate", cfg, "--seeds", "2", "--out", out) == 0
    runs = pd.read_csv(out / "tiny" / "evaluation.csv")
    # not seed 0, the search's own: its run won the search on validation accuracy
    assert len(runs) == 6 and sorted(set(runs["seed"])) == [1, 2]
    assert set(runs["device"]) == {"cpu"} and runs["amp"].isna().all()  # (a summary pools them)
    stamp = (out / "tiny" / "evaluation.csv").stat().st_mtime_ns
    capsys.readouterr()
    assert ks("evaluate", cfg, "--seeds", "2", "--out", out) == 0  # resumes: nothing to do
    assert (out / "tiny" / "evaluation.csv").stat().st_mtime_ns == stamp
    assert "0run" not in capsys.readouterr().err  # no bar of nothing to run

    capsys.readouterr()
    assert ks("report", cfg, "--out", out) == 0
    printed = capsys.readouterr().out
    assert "| variant | listops mean" in printed
    table = pd.read_csv(out / "tiny" / "table.csv", header=[0, 1], index_col=0)
    assert list(table.index) == ["Transformer", "elu+1", "1xGLU"]
    assert (table[("listops", "n")] == 2).all()
    best, mean = table[("listops", "max_test")], table[("listops", "mean")]
    assert ((best >= mean - 1e-9) & (mean > 0) & (best <= 100)).all()
    assert (table[("listops", "best_by_val")] <= best).all()
    assert table.loc["Transformer", ("listops", "paper")] == 36.37  # the published number
    assert table.loc["1xGLU", ("listops", "paper")] == 18.67
    assert math.isnan(table.loc["elu+1", ("listops", "paper")])  # not in the paper's table
    for stem in ("parameters", "feature_dim", "train_time"):
        assert (out / "tiny" / f"accuracy_vs_{stem}.png").stat().st_size > 5000
    assert (out / "tiny" / "optimization_history.png").stat().st_size > 5000
    assert "Matching" in (out / "tiny" / "paper_reference.md").read_text()
    # A report by study name and storage URL reads the same studies.
    url = f"sqlite:///{out / 'tiny' / 'optuna.db'}"
    assert ks("report", "tiny", "--storage", url, "--out", out) == 0
    # Runs of a trial that is no longer the best, or of the best's number with other
    # parameters (another storage), stay in the file but are not counted.
    elu = runs[runs.variant == "elu+1"].iloc[0]
    stale = [
        {**elu, "trial": elu.trial + 100, "seed": 7, "test_accuracy": 0.0},
        {**elu, "seed": 8, "params": '{"lr": 1.0}', "test_accuracy": 0.0},
        {**elu, "seed": 0, "test_accuracy": 0.0},  # the search's own seed (an older evaluation)
    ]
    pd.concat([runs, pd.DataFrame(stale)]).to_csv(out / "tiny" / "evaluation.csv", index=False)
    assert ks("report", cfg, "--out", out) == 0
    again = pd.read_csv(out / "tiny" / "table.csv", header=[0, 1], index_col=0)
    assert again.loc["elu+1", ("listops", "n")] == 2
    assert again.loc["elu+1", ("listops", "mean")] == table.loc["elu+1", ("listops", "mean")]


def test_a_resumed_search_counts_only_the_trials_it_runs(tmp_path, capsys):
    """The bar counted the trials a resumed search had finished before as done at its start,
    so its rate and ETA were those of instant trials; they leave its total instead."""
    cfg, out = write_config(tmp_path, ["elu+1"]), tmp_path / "res"
    assert ks("search", cfg, "--out", out) == 0
    assert re.search(r"search tiny: 100%\S* 2/2 ", capsys.readouterr().err)
    assert ks("search", cfg, "--trials", "3", "--out", out) == 0
    err = capsys.readouterr().err
    assert re.search(r"search tiny: 100%\S* 1/1 ", err), err  # of 3: 2 finished before


def test_a_suggested_combination_the_model_refuses_is_pruned(tmp_path, monkeypatch):
    """A polynomial map over its feature cap (lowered here to keep the test small) is
    refused when built: such a trial is pruned with the reason and the study goes on."""
    monkeypatch.setattr("kernelstudy.feature_maps.polynomial.MAX_FEATURES", 100)
    cfg = write_config(tmp_path, ["poly23"], steps=2)  # head_dim 8: F = 64 or 512
    cfg.write_text(cfg.read_text().replace("trials = 2", "trials = 6"))
    assert ks("search", cfg, "--out", tmp_path / "res") == 0
    trials = studies(tmp_path / "res")["tiny/poly23"].get_trials()
    by_degree = {d: [t for t in trials if t.params["fm.degree"] == d] for d in (2, 3)}
    assert by_degree[2] and by_degree[3]  # the sampler tried both
    assert all(t.state == TrialState.COMPLETE for t in by_degree[2])
    for t in by_degree[3]:
        assert t.state == TrialState.PRUNED
        assert "refused by the model: degree=3 at head_dim=8" in t.user_attrs["refused_reason"]
    row = search_summary(load_config(cfg), f"sqlite:///{tmp_path / 'res' / 'tiny' / 'optuna.db'}")
    assert row.loc[0, "over_budget"] == 0 and row.loc[0, "pruned"] == len(by_degree[3])
    # counted, and not towards the 6 trials asked for: 6 trained (all of degree 2)
    assert row.loc[0, "refused"] == len(by_degree[3]) and row.loc[0, "trained"] == 6


def test_learned_positions_cover_a_longer_val_split(tmp_path):
    """A val split padded longer than train's (a per-split max_length) with learned
    positions: the model was sized from the train split only, so every trial trained and
    then failed at its first evaluation ("position 47 is beyond max_len=32")."""
    cfg = write_config(tmp_path, ["elu+1"], steps=2)
    text = cfg.read_text().replace(
        "[model]\n", '[task_options.val]\nmax_length = 48\n[model]\npositions = "learned"\n'
    )
    cfg.write_text(text.replace("trials = 2", "trials = 1"))
    assert ks("search", cfg, "--out", tmp_path / "res") == 0
    (trial,) = studies(tmp_path / "res")["tiny/elu+1"].get_trials()
    assert trial.state == TrialState.COMPLETE


def test_a_search_gives_optuna_its_log_level_back(tmp_path):
    """run_search set Optuna's process-wide level to WARNING for good: a notebook's INFO
    logging of its own studies went quiet for the rest of the session."""
    import optuna

    from kernelstudy.search import run_search

    cfg = write_config(tmp_path, ["elu+1"], steps=1)
    cfg.write_text(cfg.read_text().replace("trials = 2", "trials = 1"))
    before = optuna.logging.get_verbosity()
    try:
        optuna.logging.set_verbosity(optuna.logging.DEBUG)
        run_search(load_config(cfg), out=tmp_path / "res")
        assert optuna.logging.get_verbosity() == optuna.logging.DEBUG
    finally:
        optuna.logging.set_verbosity(before)


def test_a_search_whose_every_trial_runs_out_of_memory_exits_1(tmp_path, capsys, monkeypatch):
    """Every trial failing (here: out of memory in the first step) used to keep the search
    running forever; it stops after a few in a row, naming the error, and a rerun retries."""

    def oom(self):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr("kernelstudy.train.trainer.Trainer._train_step", oom)
    cfg = write_config(tmp_path, ["elu+1"], steps=2)
    assert ks("search", cfg, "--out", tmp_path / "res") == 1
    err = capsys.readouterr().err
    assert "last 5 trials failed" in err and "OutOfMemoryError: CUDA out of memory" in err
    trials = studies(tmp_path / "res")["tiny/elu+1"].get_trials()
    assert len(trials) == 5 and all(t.state == TrialState.FAIL for t in trials)


def test_a_trial_whose_validation_accuracy_is_never_finite_fails_as_diverged(
    tmp_path, capsys, monkeypatch
):
    """A NaN validation score is never the best; a run with no finite one has no best
    value, which the objective took as float(None) (a TypeError ending the search)."""

    def nan_accuracy(self, data, max_batches=None):
        return {"loss": math.nan, "accuracy": math.nan}

    monkeypatch.setattr("kernelstudy.train.trainer.Trainer.evaluate", nan_accuracy)
    cfg = write_config(tmp_path, ["elu+1"], steps=2)
    assert ks("search", cfg, "--out", tmp_path / "res") == 1
    assert "no finite validation accuracy in 2 steps" in capsys.readouterr().err
    trials = studies(tmp_path / "res")["tiny/elu+1"].get_trials()
    assert trials and all(t.state == TrialState.FAIL for t in trials)
    assert all(t.user_attrs["fail_reason"].startswith("FloatingPointError") for t in trials)


@pytest.mark.parametrize("restore_best", [True, False])
def test_a_trial_is_ranked_by_the_validation_accuracy_of_the_weights_it_scores(
    tmp_path, monkeypatch, restore_best
):
    """With ``restore_best = false`` the test accuracy is the last step's weights', but the
    trial's value (what best_trial and best_by_val rank by) was the best validation accuracy
    seen, of weights never scored: a run that peaked early and fell away ranked first."""
    scores = iter([0.9, 0.3])  # an early peak (step 10), then worse (step 20)

    def falling(self, data, max_batches=None):
        return {"loss": 1.0, "accuracy": next(scores, 0.5)}  # then the test score

    monkeypatch.setattr("kernelstudy.train.trainer.Trainer.evaluate", falling)
    text = TINY.replace("amp = false", f"amp = false\nrestore_best = {str(restore_best).lower()}")
    text = text.replace("trials = 2", "trials = 1")
    variants = '\n[[variants]]\nlabel = "elu+1"\nfeature_map = "elu"\n'
    text = text.format(d_model=16, n_heads=2, steps=20, variants=variants)
    cfg = write_config(tmp_path, [], text=text)
    assert ks("search", cfg, "--out", tmp_path / "res") == 0
    (trial,) = studies(tmp_path / "res")["tiny/elu+1"].get_trials()
    assert trial.value == trial.user_attrs["val_accuracy"] == (0.9 if restore_best else 0.3)
    assert trial.user_attrs["test_accuracy"] == 0.5


def test_a_diverging_evaluation_run_is_recorded_and_the_others_go_on(tmp_path, capsys, monkeypatch):
    """A FloatingPointError (divergence) in one seed used to end `evaluate` with a traceback,
    skipping every later seed and variant, and a rerun hit the same seed again."""
    cfg = write_config(tmp_path, ["elu+1", "Transformer"], steps=2)
    assert ks("search", cfg, "--out", tmp_path / "res") == 0
    real = evaluate_module.train_run

    def diverge_on_seed_1(config, variant, settings, data, seed, device):
        if seed == 1 and variant.label == "elu+1":
            raise FloatingPointError("non-finite training loss nan at step 2")
        return real(config, variant, settings, data, seed, device)

    monkeypatch.setattr(evaluate_module, "train_run", diverge_on_seed_1)
    assert ks("evaluate", cfg, "--seeds", "2", "--out", tmp_path / "res") == 0
    assert "elu+1 seed 1: non-finite training loss" in capsys.readouterr().err
    runs = read_evaluation(tmp_path / "res" / "tiny" / "evaluation.csv")
    assert len(runs) == 4 and list(runs.status).count("ok") == 3
    lost = runs[runs.status.str.startswith("diverged")]
    assert list(lost.seed) == [1] and lost.test_accuracy.isna().all()
    summary = pd.read_csv(tmp_path / "res" / "tiny" / "evaluation_summary.csv").set_index("variant")
    assert summary.loc["elu+1", "n"] == 1 and summary.loc["elu+1", "diverged"] == 1
    assert summary.loc["Transformer", "n"] == 2 and summary.loc["Transformer", "diverged"] == 0
    monkeypatch.setattr(evaluate_module, "train_run", None)  # a rerun trains nothing
    assert ks("evaluate", cfg, "--seeds", "2", "--out", tmp_path / "res") == 0
    assert "summary counts" not in capsys.readouterr().err
    # fewer seeds than were run: the summary still counts them all, and says so
    assert ks("evaluate", cfg, "--seeds", "1", "--out", tmp_path / "res") == 0
    err = capsys.readouterr().err
    assert "Transformer has runs of 2 seeds; the summary counts them all, not the first 1" in err
    assert pd.read_csv(tmp_path / "res" / "tiny" / "evaluation_summary.csv").equals(
        summary.reset_index()
    )
    # one variant re-evaluated: the summary file keeps the other (it was left with one)
    assert ks("evaluate", cfg, "--seeds", "2", "--variant", "elu+1", "--out", tmp_path / "res") == 0
    again = pd.read_csv(tmp_path / "res" / "tiny" / "evaluation_summary.csv")
    pd.testing.assert_frame_equal(again, summary.reset_index())
    # every run of a variant diverged: the report shows no accuracy and n = 0, not the
    # search trial's accuracy as one run
    runs.loc[runs.variant == "elu+1", "status"] = "diverged: nan"
    runs.loc[runs.variant == "elu+1", "test_accuracy"] = math.nan
    runs.to_csv(tmp_path / "res" / "tiny" / "evaluation.csv", index=False)
    assert ks("report", cfg, "--out", tmp_path / "res") == 0
    table = pd.read_csv(tmp_path / "res" / "tiny" / "table.csv", header=[0, 1], index_col=0)
    assert table.loc["elu+1", ("listops", "n")] == 0
    assert table.loc["elu+1", ("listops", "diverged")] == 2
    assert math.isnan(table.loc["elu+1", ("listops", "mean")])
    assert table.loc["Transformer", ("listops", "n")] == 2
    assert table.loc["Transformer", ("listops", "diverged")] == 0
    assert (
        "| elu+1 | – | – | 0 | – | – | 2 |" in (tmp_path / "res" / "tiny" / "table.md").read_text()
    )


def test_report_before_the_first_trial(tmp_path, capsys):
    """A study made (as search does before its first trial) but empty: report used to fail
    with KeyError 'state'; it writes the table and empty figures."""
    cfg = write_config(tmp_path, ["elu+1"], steps=2)
    config = load_config(cfg)
    variant_study(config, config.variants[0], storage_url(config, None, tmp_path / "res"))
    assert ks("report", cfg, "--out", tmp_path / "res") == 0
    assert (tmp_path / "res" / "tiny" / "optimization_history.png").is_file()


def test_narrowings_that_leave_the_default_out_can_start(tmp_path):
    """check_variants builds each model at its defaults: choices without the default
    (favor's 256 features, [space] lr), or a range on a hyperparameter whose default is None
    (aoglu's rank), made FixedTrial refuse the default and stopped the search from starting."""
    cfg = write_config(tmp_path, ["favor16/32", "aoglu2-4"], steps=2)
    cfg.write_text(
        cfg.read_text().replace(
            "lr = { low = 1e-3, high = 1e-2 }", "lr = { choices = [3e-4, 3e-3] }"
        )
    )
    config = load_config(cfg)
    assert check_variants(config, prepare_data(config, tmp_path / "res")) == {}
    favor = default_settings(config, config.variant("favor16/32"))
    assert favor.feature_map_kwargs["num_features"] == 16 and favor.training["lr"] == 3e-4
    assert default_settings(config, config.variant("aoglu2-4")).feature_map_kwargs["rank"] == 2


def test_budget_prunes_three_glus_before_training(tmp_path, monkeypatch, capsys):
    cfg = write_config(tmp_path, ["1xGLU", "3xGLU"], d_model=32, n_heads=2)
    config = load_config(cfg)
    over = check_variants(config, prepare_data(config, tmp_path / "res"))
    assert list(over) == ["3xGLU"] and "budget of 10%" in over["3xGLU"]

    def no_training(*args, **kwargs):
        raise AssertionError("an over-budget trial must not train")

    monkeypatch.setattr("kernelstudy.search.objective.Trainer", no_training)
    assert ks("search", cfg, "--out", tmp_path / "res", "--variant", "3xGLU") == 0
    trials = studies(tmp_path / "res")["tiny/3xGLU"].get_trials()
    assert len(trials) == 2 and all(t.state == TrialState.PRUNED for t in trials)
    for t in trials:
        assert "over the budget" in t.user_attrs["pruned_reason"]
        fm, total = t.user_attrs["params_feature_map"], t.user_attrs["params_model"]
        assert fm > 0.1 * (total - fm)  # extra over the model without its maps
    # A larger budget in the config admits it.
    cfg.write_text(cfg.read_text().replace("seed = 0", "seed = 0\nbudget = 0.2"))
    looser = load_config(cfg)
    assert looser.budget == 0.2 and check_variants(looser, data_dir(looser, tmp_path / "res")) == {}
    # A rerun (under another sampler seed) finds the search given up: no trial runs, the bar
    # counts none as done now (it jumped by the variant's trials: a rate and ETA far too
    # short), and the study records no search under that seed (it ran none)
    cfg.write_text(cfg.read_text().replace("budget = 0.2", "").replace("seed = 0", "seed = 1"))
    capsys.readouterr()
    assert ks("search", cfg, "--out", tmp_path / "res", "--variant", "3xGLU") == 0
    err = capsys.readouterr().err
    assert "search tiny: 0trial " in err and "2/2" not in err  # (tqdm of total 0: no "/")
    study = studies(tmp_path / "res")["tiny/3xGLU"]
    assert len(study.get_trials()) == 2
    assert study.user_attrs["searched_under"] == [{"pruner": "median", "seed": 0}]


def _ctrl_c_when(
    proc: subprocess.Popen,
    ready: Callable[[], bool],
    what: str,
    signum: int = signal.SIGINT,
    returncode: int = 130,
) -> str:
    """Ctrl-C (``signum``) the search ``proc`` once ``ready()`` (within 120 s, while it
    runs); its stderr (text) after it exited with ``returncode``."""
    deadline = time.time() + 120
    while not ready():
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"the search never {what}")
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.2)
    proc.send_signal(signum)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()  # not left training on after the test
        _, err = proc.communicate()
        pytest.fail(f"the search did not stop within 60 s of its signal:\n{err[-2000:]}")
    assert proc.returncode == returncode, err[-2000:]
    return err


def test_interrupt_and_resume_loses_and_duplicates_nothing(tmp_path):
    cfg, out = write_config(tmp_path, ["elu+1"], steps=400), tmp_path / "res"
    assert ks("search", cfg, "--out", out, "--trials", "1") == 0
    db = out / "tiny" / "optuna.db"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "kernelstudy.cli", "search", str(cfg), "--out", str(out)]
    proc = subprocess.Popen([*cmd, "--trials", "3"], env=env, stderr=subprocess.PIPE, text=True)
    study = optuna.load_study(study_name="tiny/elu+1", storage=f"sqlite:///{db}")

    def second_trial_trains() -> bool:
        running = study.get_trials(states=(TrialState.RUNNING,))
        return bool(running and running[0].intermediate_values)

    _ctrl_c_when(proc, second_trial_trains, "started training a second trial")
    killed = [t for t in study.get_trials() if t.state == TrialState.FAIL]
    assert len(killed) == 1 and not study.get_trials(states=(TrialState.RUNNING,))

    assert ks("search", cfg, "--out", out, "--trials", "3") == 0
    trials = study.get_trials()
    numbers = [t.number for t in trials]
    assert numbers == sorted(set(numbers)) == list(range(len(trials)))
    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(finished) == 3 and finished[0].number == 0
    retried = [t for t in finished if killed[0].number in t.system_attrs.get("retry_history", [])]
    assert len(retried) == 1 and retried[0].params == killed[0].params
    assert {t.state for t in trials} <= {TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL}


def test_duplicate_requeue_trains_once_and_reports_ignore_it(tmp_path, monkeypatch):
    cfg, out = write_config(tmp_path, ["elu+1"]), tmp_path / "res"
    assert ks("search", cfg, "--out", out, "--trials", "1") == 0
    study = studies(out)["tiny/elu+1"]
    done = study.get_trials()[0]
    study.add_trial(
        optuna.create_trial(
            state=TrialState.FAIL, params=done.params, distributions=done.distributions
        )
    )
    failed = study.get_trials()[-1]
    # Two workers that start together both find it failed and not retried: two copies.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=2)
    for _ in range(2):
        retry(study, copy.deepcopy(failed))
    assert requeue_failed(study) == []
    copies = [t.number for t in study.get_trials(states=(TrialState.WAITING,))]
    assert copies == [failed.number + 1, failed.number + 2]

    trained: list[int] = []
    real_train_run = objective_module.train_run

    def counting_train_run(*args, trial=None, **kwargs):
        trained.append(trial.number)
        return real_train_run(*args, trial=trial, **kwargs)

    monkeypatch.setattr(objective_module, "train_run", counting_train_run)
    assert ks("search", cfg, "--out", out, "--trials", "3") == 0
    trials = {t.number: t for t in study.get_trials()}
    dup = trials[copies[1]]
    # The first copy trained; the second was pruned before building a model; one new trial
    # took the duplicate's place, so 3 trials finished besides it.
    assert trained == [copies[0], copies[1] + 1]
    assert trials[copies[0]].state == TrialState.COMPLETE
    assert trials[copies[0]].params == failed.params
    assert dup.state == TrialState.PRUNED and dup.user_attrs[DUPLICATE_ATTR] == failed.number
    assert "duplicate re-queue" in dup.user_attrs["pruned_reason"]
    assert set(dup.user_attrs) == {DUPLICATE_ATTR, "pruned_reason"}  # no model was built
    config = load_config(cfg)
    row = search_summary(config, f"sqlite:///{out / 'tiny' / 'optuna.db'}").iloc[0]
    assert row["finished"] == 3 and row["over_budget"] == 0 and row["failed"] == 1
    assert row["complete"] + row["pruned"] == 3

    # evaluate and report: the duplicate is nowhere.
    assert ks("evaluate", cfg, "--seeds", "1", "--out", out) == 0
    runs = pd.read_csv(out / "tiny" / "evaluation.csv")
    assert dup.number not in set(runs["trial"])
    assert ks("report", cfg, "--out", out) == 0
    listed = pd.read_csv(out / "tiny" / "trials.csv")
    assert sorted(listed["number"]) == sorted(n for n in trials if n != dup.number)
    summary = pd.read_csv(out / "tiny" / "search_summary.csv")
    assert summary.loc[0, "finished"] == 3 and summary.loc[0, "over_budget"] == 0


def test_changed_settings_refuse_to_join_a_study_with_trials(tmp_path, capsys, monkeypatch):
    cfg, out = write_config(tmp_path, ["elu+1", "1xGLU"], steps=10), tmp_path / "res"
    assert ks("search", cfg, "--out", out, "--trials", "1", "--variant", "elu+1") == 0
    data = data_dir(load_config(cfg), out) / "basic_train.tsv"
    before = data.read_bytes()
    original = cfg.read_text()

    def no_training(*args, **kwargs):
        raise AssertionError("no trial may train against a study of other settings")

    monkeypatch.setattr("kernelstudy.search.objective.Trainer", no_training)
    edits = {
        "train": ("steps = 10", "steps = 11"),
        "model": ("d_ff = 32", "d_ff = 48"),
        "task_options": ("[task_options]\nmax_length = 32", "[task_options]\nmax_length = 30"),
        "generate": ("n_train = 300", "n_train = 200"),
        "space": ("low = 1e-3", "low = 2e-3"),
    }
    for table, (old, new) in edits.items():
        assert old in original, table
        cfg.write_text(original.replace(old, new))
        for command in ("search", "evaluate"):
            capsys.readouterr()
            assert ks(command, cfg, "--out", out, "--variant", "elu+1") == 1
            err = capsys.readouterr().err
            assert "holds 1 trial(s) run with other settings" in err and f"{table}:" in err, err
    assert data.read_bytes() == before  # refused before the generated data were rewritten

    # Settings that do not change a trial's value, and a study without trials, are fine.
    monkeypatch.undo()
    cfg.write_text(original.replace("[train]", "[train]\nprogress = false"))
    assert ks("search", cfg, "--out", out, "--trials", "2", "--variant", "elu+1") == 0
    cfg.write_text(original.replace("n_train = 300", "n_train = 200"))
    assert ks("search", cfg, "--out", out, "--trials", "1", "--variant", "1xGLU") == 0
    # ... and the new [generate] table's data went to a folder of their own (the first
    # config's are kept as they were: a search of it running at once reads them).
    new = data_dir(load_config(cfg), out) / "basic_train.tsv"
    assert new.parent != data.parent and data.read_bytes() == before
    assert len(new.read_text().splitlines()) == 201  # header + n_train rows
    # The report still reads both, but says their rows are not comparable.
    capsys.readouterr()
    assert ks("report", cfg, "--out", out) == 0
    err = capsys.readouterr().err
    assert "searched with different generate settings" in err, err


@pytest.mark.parametrize(
    "edit, extra, message",
    [
        (lambda s: s.replace('feature_map = "elu"', 'feature_map = "eluu"'), [], "'eluu'"),
        (lambda s: s.replace('task = "listops"', 'task = "listopz"'), [], "unknown task"),
        (lambda s: s + "\n[[variants]\n", [], "not valid TOML"),
        (lambda s: s, ["--device", "bogus"], "device 'bogus': expected auto, cpu, cuda"),
        (lambda s: s, ["--storage", "sqlite:///"], "in-memory database"),
        (
            lambda s: s,
            ["--storage", "postgresql://nouser@127.0.0.1:1/x"],
            r"storage postgresql://nouser@127\.0\.0\.1:1/x cannot be opened",
        ),
    ],
)
def test_bad_inputs_exit_1_before_training(tmp_path, capsys, monkeypatch, edit, extra, message):
    cfg = write_config(tmp_path, ["Transformer", "elu+1"])
    cfg.write_text(edit(cfg.read_text()))

    def no_training(*args, **kwargs):
        raise AssertionError("no training may start on bad input")

    monkeypatch.setattr("kernelstudy.search.objective.Trainer", no_training)
    out = tmp_path / "res"
    for command in ("search", "evaluate"):
        capsys.readouterr()
        assert ks(command, cfg, "--out", out, *extra) == 1
        err = capsys.readouterr().err
        assert f"kernelstudy {command}: error:" in err and re.search(message, err), err
    assert not list((out / "tiny").glob("data*"))  # failed before even generating data


def test_unbuildable_model_fails_before_training(tmp_path, capsys, monkeypatch):
    cfg = write_config(tmp_path, ["Transformer", "elu+1"], d_model=16, n_heads=3)
    monkeypatch.setattr("kernelstudy.search.objective.Trainer", None)  # any training would fail
    assert ks("search", cfg, "--out", tmp_path / "res") == 1
    err = capsys.readouterr().err
    assert "variant 'Transformer'" in err and "n_heads" in err, err
    assert not studies(tmp_path / "res")  # no study was even created


def test_missing_inputs(tmp_path, capsys):
    assert ks("search", tmp_path / "nothere.toml") == 1
    assert "nothere.toml does not exist" in capsys.readouterr().err
    assert ks("report", "nostudy", "--out", tmp_path) == 1
    assert "no study database" in capsys.readouterr().err
    assert ks("search", write_config(tmp_path, ["elu+1"]), "--variant", "GLU9") == 1
    assert "no variant 'GLU9'" in capsys.readouterr().err
    # evaluate and report before any search: said, and no empty database (or data) left
    cfg, out = write_config(tmp_path, ["elu+1"]), tmp_path / "fresh"
    for command in ("evaluate", "report"):
        assert ks(command, cfg, "--out", out) == 1
        assert f"run `kernelstudy search {cfg} --out {out}` first" in capsys.readouterr().err
        assert ks(command, cfg, "--quick", "--out", out) == 1  # the command to run, as given
        assert f"run `kernelstudy search {cfg} --quick --out {out}`" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("command", ["search", "evaluate", "report"])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ks(command, "--help")
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert f"usage: kernelstudy {command}" in text and "--storage" in text


@pytest.mark.parametrize("name", ["listops", "text", "retrieval", "image", "pathfinder"])
def test_shipped_lra_configs(name, tmp_path):
    path = ROOT / "studies" / f"lra_{name}.toml"
    full, quick = load_config(path), load_config(path, quick=True)
    assert full.task == quick.task == name and quick.name == f"lra_{name}_quick"
    assert full.labels() == quick.labels() and "3xAOGLU" in full.labels()
    assert full.model["d_model"] > quick.model["d_model"]
    # [quick.variants.Performer]: a smaller R range in quick mode only; the rest as declared.
    r_full = full.variant("Performer").fixed["num_features"]
    r_quick = quick.variant("Performer").fixed["num_features"]
    assert r_full == {"low": 16, "high": 256, "log": True}
    assert r_quick["high"] < r_full["high"] and r_quick["log"]
    assert [v for v in full.variants if v.label != "Performer"] == [
        v for v in quick.variants if v.label != "Performer"
    ]
    if name == "listops":
        assert full.task_options["max_length"] == 2000
        assert data_dir(quick, tmp_path).parent == tmp_path / "lra_listops_quick"
        assert check_variants(quick, prepare_data(quick, tmp_path)) == {}  # all within budget


def test_evaluation_rows_keep_text_labels_and_belong_to_one_trial(tmp_path):
    """A label such as "256" was read back as an int and matched no variant: evaluate
    re-ran its seeds and the report ignored them."""
    trial = optuna.trial.create_trial(params={"lr": 0.01}, distributions={
        "lr": optuna.distributions.FloatDistribution(1e-3, 1e-1)}, value=0.5)  # fmt: skip
    trial.number = 3
    rows = pd.DataFrame(
        [
            {"variant": "256", "trial": 3, "seed": 0, "params": trial_params(trial)},
            {"variant": "NA", "trial": 3, "seed": 0, "params": None},  # before params
            {"variant": "256", "trial": 3, "seed": 1, "params": '{"lr": 0.5}'},
            {"variant": "256", "trial": 2, "seed": 2, "params": trial_params(trial)},
        ]
    )
    rows.to_csv(tmp_path / "evaluation.csv", index=False)
    runs = read_evaluation(tmp_path / "evaluation.csv")
    assert list(runs["variant"]) == ["256", "NA", "256", "256"]
    kept = current_runs(runs, {"256": trial, "NA": trial})
    assert list(zip(kept["variant"], kept["seed"], strict=True)) == [("256", 0), ("NA", 0)]


def test_evaluation_leaves_out_the_search_seed(tmp_path):
    """Seeds 0 … N-1 included [train] seed, whose run of the best trial is the one that won
    the search on validation accuracy: one of the n runs biased upward (the winner's curse),
    and by its validation accuracy likely best_by_val's pick. The seeds skip it, and rows of
    it that an older evaluation wrote stay in the file but count no more."""
    assert evaluation_seeds(3, 0) == [1, 2, 3]
    assert evaluation_seeds(3, 1) == [0, 2, 3]
    assert evaluation_seeds(2, 7) == [0, 1]
    assert search_seed({"train": {"seed": 4}}) == 4
    assert search_seed({"train": {}}) == search_seed(None) == 0  # the default; not recorded
    cfg = write_config(tmp_path, ["elu+1"], steps=2)
    cfg.write_text(cfg.read_text().replace("amp = false", "amp = false\nseed = 1"))
    out = tmp_path / "res"
    assert ks("search", cfg, "--out", out) == 0
    assert ks("evaluate", cfg, "--seeds", "2", "--out", out) == 0
    runs = read_evaluation(out / "tiny" / "evaluation.csv")
    assert sorted(runs["seed"]) == [0, 2]
    own = {**runs.iloc[0].to_dict(), "seed": 1, "test_accuracy": 1.0, "val_accuracy": 1.0}
    pd.concat([runs, pd.DataFrame([own])]).to_csv(out / "tiny" / "evaluation.csv", index=False)
    assert ks("report", cfg, "--out", out) == 0
    table = pd.read_csv(out / "tiny" / "table.csv", header=[0, 1], index_col=0)
    assert table.loc["elu+1", ("listops", "n")] == 2
    assert table.loc["elu+1", ("listops", "max_test")] < 100  # the seed-1 row is not counted


def test_two_configs_of_one_task_get_their_own_column_groups(tmp_path):
    def study_set(name: str, accuracy: float) -> StudySet:
        study = optuna.create_study(direction="maximize")
        trial = optuna.trial.create_trial(value=0.5, user_attrs={"test_accuracy": accuracy})
        study.add_trial(trial)
        return StudySet(name, "listops", {"elu+1": study}, pd.DataFrame(columns=["variant"]))

    table = results_table([study_set("small", 0.25), study_set("large", 0.5)])
    assert table.loc["elu+1", ("listops (small)", "mean")] == 25.0
    assert table.loc["elu+1", ("listops (large)", "mean")] == 50.0
    single = results_table([study_set("small", 0.25)])
    assert list(single.columns.get_level_values(0).unique()) == ["listops"]
    other = study_set("large", 0.5)
    other.studies["favor"] = other.studies.pop("elu+1")  # variants of one config only
    mixed = results_table([study_set("small", 0.25), other])
    assert str(mixed[("listops (small)", "n")].dtype) == "Int64"
    printed = markdown(mixed)
    # n not "1.00"; diverged missing: no evaluation runs
    assert "| elu+1 | 25.00 | – | 1 | 25.00 | 25.00 | – | – | – | – | – | – | – |" in printed
    assert str(mixed[("listops (small)", "diverged")].dtype) == "Int64"
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    made = optuna.create_study(storage=empty).study_name  # a database that holds no study
    optuna.delete_study(study_name=made, storage=empty)
    with pytest.raises(
        ValueError, match=r"it holds: no studies\); run `kernelstudy search CONFIG`"
    ):
        load_study(empty, "tiny/elu+1")
    with pytest.raises(ValueError, match=r"'small' given more than once"):  # duplicate columns
        results_table([study_set("small", 0.25), study_set("small", 0.25)])


def test_evaluate_does_not_reuse_runs_of_other_settings(tmp_path):
    """A new study of a changed config numbers and samples its trials as the old one did:
    its evaluation skipped every run and reported the old model's accuracies."""
    out = tmp_path / "res"
    cfg = write_config(tmp_path, ["elu+1"], d_model=16, steps=10)
    assert ks("search", cfg, "--out", out, "--trials", "1") == 0
    assert ks("evaluate", cfg, "--out", out, "--seeds", "1") == 0
    cfg = write_config(tmp_path, ["elu+1"], d_model=32, steps=10)  # a new model
    other = f"sqlite:///{tmp_path / 'other.db'}"
    assert ks("search", cfg, "--out", out, "--trials", "1", "--storage", other) == 0
    assert ks("evaluate", cfg, "--out", out, "--seeds", "1", "--storage", other) == 0
    runs = read_evaluation(out / "tiny" / "evaluation.csv")
    assert (
        len(runs) == 2 and runs["params_model"].nunique() == 2 and runs["settings"].nunique() == 2
    )
    summary = pd.read_csv(out / "tiny" / "evaluation_summary.csv")
    assert summary["n"].tolist() == [1]


def test_two_evaluations_of_one_out_do_not_lose_rows(tmp_path):
    """Each rewrote evaluation.csv from its own copy: running two --variant evaluations at
    once kept one's rows."""
    from kernelstudy.files import exclusive_folder

    out = tmp_path / "res"
    cfg = write_config(tmp_path, ["elu+1"], steps=10)
    assert ks("search", cfg, "--out", out, "--trials", "1") == 0
    with exclusive_folder(out / "tiny", "another evaluation"):  # as another process's run
        assert ks("evaluate", cfg, "--out", out, "--seeds", "1") == 1
    assert not (out / "tiny" / "evaluation.csv").exists()
    assert ks("evaluate", cfg, "--out", out, "--seeds", "1") == 0


def test_evaluate_skips_a_variant_not_searched_yet(tmp_path, capsys):
    out = tmp_path / "res"
    cfg = write_config(tmp_path, ["elu+1", "1xGLU"], steps=10)
    assert ks("search", cfg, "--out", out, "--trials", "1", "--variant", "elu+1") == 0
    assert ks("evaluate", cfg, "--out", out, "--seeds", "1") == 0
    assert "1xGLU has not been searched; skipped" in capsys.readouterr().err
    summary = pd.read_csv(out / "tiny" / "evaluation_summary.csv")
    assert summary["variant"].tolist() == ["elu+1"]


def test_evaluation_rows_with_a_numeric_looking_settings_key_still_count(tmp_path):
    """The key column was type-inferred: an all-digit key came back as an int and its rows
    never matched again (every evaluate re-trained them)."""
    out = tmp_path / "res"
    cfg = write_config(tmp_path, ["elu+1"], steps=10)
    assert ks("search", cfg, "--out", out, "--trials", "1") == 0
    assert ks("evaluate", cfg, "--out", out, "--seeds", "1") == 0
    path = out / "tiny" / "evaluation.csv"
    runs = read_evaluation(path)
    config = load_config(cfg)
    best = {"elu+1": load_study(storage_url(config, None, out), "tiny/elu+1").best_trial}
    for key in ("0123456789012345", "12345678e1234567"):
        runs["settings"] = key
        runs.to_csv(path, index=False)
        back = read_evaluation(path)
        assert back["settings"].tolist() == [key]
        assert len(current_runs(back, best, {"elu+1": key})) == 1
    runs["settings"] = None  # rows from before keys were recorded still count
    runs.to_csv(path, index=False)
    assert len(current_runs(read_evaluation(path), best, {"elu+1": "abc"})) == 1


def test_evaluate_with_a_storage_of_no_study_fails_and_keeps_the_summary(tmp_path, capsys):
    out = tmp_path / "res"
    cfg = write_config(tmp_path, ["elu+1"], steps=10)
    assert ks("search", cfg, "--out", out, "--trials", "1") == 0
    assert ks("evaluate", cfg, "--out", out, "--seeds", "1") == 0
    summary = (out / "tiny" / "evaluation_summary.csv").read_bytes()
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    optuna.create_study(storage=empty, study_name="other")
    assert ks("evaluate", cfg, "--out", out, "--seeds", "1", "--storage", empty) == 1
    assert "holds no study of tiny" in capsys.readouterr().err
    assert (out / "tiny" / "evaluation_summary.csv").read_bytes() == summary
    # a mistyped SQLite file is named, not created empty (by evaluate, report or load_study)
    typo = tmp_path / "typo.db"
    for command in (["evaluate", cfg, "--seeds", "1"], ["report", cfg], ["report", "tiny"]):
        assert ks(*command, "--out", out, "--storage", f"sqlite:///{typo}") == 1
        assert f"no study database {typo}" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="no study database"):
        load_study(f"sqlite:///{typo}", "tiny/elu+1")
    assert not typo.exists()
    assert (out / "tiny" / "evaluation_summary.csv").read_bytes() == summary


def test_the_summary_keeps_other_variants_evaluated_with_their_studys_settings(tmp_path):
    """Evaluating A after B's config changed dropped B's results from the summary file,
    which the report still showed."""
    out = tmp_path / "res"
    cfg = write_config(tmp_path, ["elu+1", "1xGLU"], steps=10)
    assert ks("search", cfg, "--out", out, "--trials", "1") == 0
    assert ks("evaluate", cfg, "--out", out, "--seeds", "1") == 0
    text = cfg.read_text().replace("fixed = { depth = 1 }", "fixed = { depth = 1, shared = true }")
    assert text != cfg.read_text()
    cfg.write_text(text)  # 1xGLU's settings change; its study keeps the old ones
    assert ks("evaluate", cfg, "--out", out, "--seeds", "1", "--variant", "elu+1") == 0
    summary = pd.read_csv(out / "tiny" / "evaluation_summary.csv")
    assert set(summary["variant"]) == {"elu+1", "1xGLU"}


def test_evaluate_skips_a_best_trial_over_the_current_budget(tmp_path, capsys, monkeypatch):
    """A study searched under the older budget rule can hold a best trial that the current
    one refuses: evaluate stopped there with exit 1."""
    out = tmp_path / "res"
    cfg = write_config(tmp_path, ["elu+1", "1xGLU"], steps=10)
    assert ks("search", cfg, "--out", out, "--trials", "1") == 0
    real = objective_module.over_budget

    def glu_over(sizes, budget):
        return "a test's rule" if sizes["params_feature_map"] else real(sizes, budget)

    monkeypatch.setattr(objective_module, "over_budget", glu_over)
    assert ks("evaluate", cfg, "--out", out, "--seeds", "2") == 0
    assert "1xGLU: its best trial 0 is over the budget (a test's rule); skipped" in (
        capsys.readouterr().err
    )
    runs = read_evaluation(out / "tiny" / "evaluation.csv")
    assert runs["variant"].tolist() == ["elu+1", "elu+1"]


def _reports(db: Path) -> int:
    """How many intermediate values the trials in SQLite file ``db`` reported (0 before
    its tables exist)."""
    import sqlite3

    if not db.is_file():
        return 0
    try:
        with contextlib.closing(sqlite3.connect(db, timeout=5)) as con:
            return con.execute("SELECT COUNT(*) FROM trial_intermediate_values").fetchone()[0]
    except sqlite3.Error:
        return 0


def test_ctrl_c_of_a_one_worker_search_prints_no_traceback(tmp_path):
    """Ctrl-C of `kernelstudy search` with one worker printed Optuna's "Trial 0 failed ...
    KeyboardInterrupt" warning and traceback before the search's own "interrupted"; the
    trial is failed as a worker's is, so a resume re-runs it."""
    cfg, out = write_config(tmp_path, ["elu+1"], steps=100_000), tmp_path / "res"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "kernelstudy.cli", "search", str(cfg), "--out", str(out)]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    db = out / "tiny" / "optuna.db"
    # until the first trial trains (read without Optuna, which would create the tables as
    # the search does)
    err = _ctrl_c_when(proc, lambda: _reports(db) > 0, "started training")
    assert err.rstrip().endswith(
        "interrupted: what finished is kept; the same command goes on from it"
    )
    assert "Traceback" not in err and "failed" not in err, err[-2000:]
    study = optuna.load_study(study_name="tiny/elu+1", storage=f"sqlite:///{db}")
    assert [t.state for t in study.get_trials()] == [TrialState.FAIL]
    assert requeue_failed(study) == [0]  # what a resumed search does first


def test_sigterm_of_a_one_worker_search_fails_its_trial_then_terminates(tmp_path):
    """SIGTERM (``timeout``, a job scheduler) ended a one-worker search at once and left its
    trial RUNNING until the heartbeat went stale, so a rerun within that time neither failed
    nor retried it; a multi-worker search's workers failed theirs. Now the trial is failed
    first, and the process ends by the SIGTERM as before."""
    cfg, out = write_config(tmp_path, ["elu+1"], steps=100_000), tmp_path / "res"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "kernelstudy.cli", "search", str(cfg), "--out", str(out)]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    db = out / "tiny" / "optuna.db"
    err = _ctrl_c_when(proc, lambda: _reports(db) > 0, "started training", signal.SIGTERM, -15)
    assert "Traceback" not in err, err[-2000:]
    study = optuna.load_study(study_name="tiny/elu+1", storage=f"sqlite:///{db}")
    assert [t.state for t in study.get_trials()] == [TrialState.FAIL]
    assert requeue_failed(study) == [0]


def test_the_summary_chooses_best_by_validation_and_counts_every_run(tmp_path):
    """The summary's "best" was the highest *test* accuracy of the runs (chosen on the test
    set, unlabelled); it is now the test accuracy of the run with the highest validation accuracy
    (ties: the lowest seed), and the test-chosen maximum is labelled as such. A run recorded
    "ok" but with no test accuracy was in neither n nor diverged (dropped silently)."""
    from kernelstudy.search.evaluate import summarize_evaluation

    nan = math.nan
    rows = [  # variant, seed, val, test, status
        ("a", 2, 0.9, 0.60, "ok"),
        ("a", 0, 0.9, 0.50, "ok"),  # ties seed 2 on val: the lower seed is chosen
        ("a", 1, 0.7, 0.80, "ok"),  # the best test, not the best validation
        ("a", 3, 0.8, nan, "ok"),  # no test accuracy: not in n, but counted
        ("a", 4, nan, nan, "diverged: nan loss"),
        ("one", 0, 0.6, 0.40, "ok"),
        ("lost", 0, nan, nan, "diverged: nan loss"),
    ]
    runs = pd.DataFrame(
        rows, columns=["variant", "seed", "val_accuracy", "test_accuracy", "status"]
    )
    summary = summarize_evaluation(runs).set_index("variant")
    assert list(summary.index) == ["a", "one", "lost"]
    a = summary.loc["a"]
    assert a["n"] == 3 and a["diverged"] == 2
    assert a["mean"] == pytest.approx((0.6 + 0.5 + 0.8) / 3)
    assert a["std"] == pytest.approx(pd.Series([0.6, 0.5, 0.8]).std(ddof=1))
    assert a["best_by_val"] == 0.50 and a["max_test"] == 0.80
    assert "best" not in summary.columns  # no unlabelled "best"
    one = summary.loc["one"]
    assert one["n"] == 1 and math.isnan(one["std"]) and one["best_by_val"] == 0.40
    lost = summary.loc["lost"]
    assert lost["n"] == 0 and lost["diverged"] == 1 and math.isnan(lost["best_by_val"])
    assert list(summarize_evaluation(runs.iloc[:0]).columns) == list(
        summarize_evaluation(runs).columns
    )


def test_report_of_a_minimized_study_is_refused(tmp_path):
    """The best trial is the one of highest validation accuracy; a study of another
    direction (made by another tool under the same name) would be read upside down."""
    from kernelstudy.search.report import load_results

    url = f"sqlite:///{tmp_path / 'other.db'}"
    study = optuna.create_study(storage=url, study_name="mini/elu+1", direction="minimize")
    for value in (0.2, 0.9):
        study.add_trial(optuna.trial.create_trial(value=value, user_attrs={"test_accuracy": 0.5}))
    with pytest.raises(ValueError, match="mini/elu\\+1.*minimize"):
        load_results("mini", storage=url, out=tmp_path)


def test_report_of_a_real_search_labels_its_numbers(tmp_path, capsys):
    """A tiny search: one variant evaluated, one not, one with no complete trial (over the
    budget). The table's notes say what each column is and which rows are single search
    runs or empty; the summary gives the feature maps' share over the softmax model (checked
    against models built by hand); the figures' legends count their runs."""
    from kernelstudy.nn.models import SequenceClassifier
    from kernelstudy.search.report import figures, load_results, trials_frame
    from kernelstudy.tasks import load_task

    cfg, out = (
        write_config(tmp_path, ["Transformer", "elu+1", "1xGLU", "3xGLU"], d_model=32),
        (tmp_path / "res"),
    )
    cfg.write_text(cfg.read_text().replace("steps = 20", "steps = 10"))
    assert ks("search", cfg, "--out", out) == 0
    assert ks("evaluate", cfg, "--out", out, "--seeds", "2", "--variant", "elu+1") == 0
    printed = capsys.readouterr().out
    assert "test accuracy as a fraction" in printed and "best_by_val" in printed
    assert ks("report", cfg, "--out", out) == 0
    printed = capsys.readouterr().out
    md = (out / "tiny" / "table.md").read_text()
    assert md in printed
    assert "best_by_val" in md and "max_test" in md and "chosen on the test set" in md
    assert "ddof=1" in md
    assert "not evaluated" in md and "Transformer, 1xGLU" in md  # single search runs
    assert re.search(r"3xGLU: no complete trial \(2 pruned, 2 of them over the budget", md)
    table = pd.read_csv(out / "tiny" / "table.csv", header=[0, 1], index_col=0)
    assert table.loc["elu+1", ("listops", "n")] == 2
    assert table.loc["Transformer", ("listops", "n")] == 1
    assert table.loc["3xGLU", ("listops", "n")] == 0
    runs = read_evaluation(out / "tiny" / "evaluation.csv")
    best = runs.sort_values(["val_accuracy", "seed"], ascending=[False, True]).iloc[0]
    assert table.loc["elu+1", ("listops", "best_by_val")] == round(100 * best.test_accuracy, 2)
    assert table.loc["elu+1", ("listops", "max_test")] == round(100 * runs.test_accuracy.max(), 2)
    # parameters: by hand, a 1xGLU map is W_f and W_g of head_dim² each, one layer
    vocab = load_task("listops", data_dir(load_config(cfg), out), "train").vocab_size
    kw = dict(d_model=32, n_heads=2, n_layers=1, d_ff=32, max_len=32)
    softmax = sum(
        p.numel() for p in SequenceClassifier(vocab, 10, attention="softmax", **kw).parameters()
    )
    glu = SequenceClassifier(vocab, 10, attention="kernel", feature_map="glu",
                             feature_map_kwargs={"depth": 1}, **kw)  # fmt: skip
    assert sum(p.numel() for p in glu.parameters()) == softmax + 2 * 16 * 16
    summary = pd.read_csv(out / "tiny" / "search_summary.csv").set_index("variant")
    assert summary.loc["1xGLU", "params_model"] == softmax + 512
    assert summary.loc["1xGLU", "params_feature_map"] == 512
    assert summary.loc["1xGLU", "extra_params_pct"] == pytest.approx(100 * 512 / softmax)
    assert summary.loc["3xGLU", "extra_params_pct"] == pytest.approx(100 * 3 * 512 / softmax)
    assert summary.loc["Transformer", "extra_params_pct"] == 0.0
    assert summary.loc["elu+1", "extra_params_pct"] == 0.0
    figs = figures(trials_frame([load_results(cfg, out=out)]))
    for stem in ("accuracy_vs_parameters", "optimization_history"):
        labels = [t.get_text() for t in figs[stem].axes[0].get_legend().get_texts()]
        assert "elu+1 (2 trials)" in labels, (stem, labels)
    axis = figs["accuracy_vs_parameters"].axes[0]
    assert "%" in axis.get_xlabel() and "(%)" in axis.get_ylabel()
    assert "one run each" in axis.get_title()


def test_table_notes_say_when_test_accuracies_were_chosen_on_the_test_set(tmp_path):
    """The text task's val reads the test data, and a [train] restore_best = false scores
    the last step's weights: both were at most a warning on stderr, while table.md (what
    a reader keeps) said nothing. A variant evaluated and one not are told apart."""
    from kernelstudy.search.report import table_notes

    def study(settings, value=0.5):
        s = optuna.create_study(direction="maximize")
        s.set_user_attr("settings", settings)
        s.add_trial(optuna.trial.create_trial(value=value, user_attrs={"test_accuracy": 0.5}))
        return s

    train = {"steps": 10}
    text = StudySet(
        "lra_text",
        "text",
        {
            "elu+1": study({"train": train}),
            "1xGLU": study({"train": {**train, "restore_best": False}}),
        },
        pd.DataFrame({"variant": ["elu+1"], "trial": [0], "seed": [0], "test_accuracy": [0.5]}),
    )
    notes = "\n".join(table_notes([text]))
    # studies without the search's record of what val read: text's may have read the test data
    assert "text: the val split reads the test data unless the data are a directory" in notes
    assert "chosen on the test set" in notes
    assert "1xGLU: trained with restore_best = false" in notes
    assert (
        "not evaluated (no `kernelstudy evaluate` runs of the current best trial): 1xGLU;" in notes
    )
    assert "different train settings" in notes  # the two variants' [train] differ
    listops = StudySet("tiny", "listops", {"elu+1": study({"train": train})}, text.evaluation)
    notes = "\n".join(table_notes([listops]))
    assert "validation split" not in notes and "restore_best" not in notes
    assert "not evaluated" not in notes and "different" not in notes


def test_report_names_the_variants_not_searched(tmp_path, capsys):
    """A config's variant without a study (`search --variant` of the others) had no row and
    no mention: it was dropped from the table silently."""
    cfg, out = write_config(tmp_path, ["elu+1", "1xGLU"], steps=2), tmp_path / "res"
    assert ks("search", cfg, "--out", out, "--trials", "1", "--variant", "elu+1") == 0
    assert ks("report", cfg, "--out", out) == 0
    md = (out / "tiny" / "table.md").read_text()
    assert "| elu+1 |" in md and "| 1xGLU |" not in md
    assert "listops: not searched (no study, no row): 1xGLU." in md


TEXT_CONFIG = """
name = "words"
task = "text"
data = {data}
[task_options]
max_length = 24
[model]
d_model = 16
n_heads = 2
n_layers = 1
d_ff = 32
[train]
steps = 2
batch_size = 4
eval_every = 2
amp = false
[search]
trials = 1
seed = 0
[[variants]]
label = "elu+1"
feature_map = "elu"
"""


@pytest.mark.parametrize(
    ("layout", "reads_test"), [("val.tsv", False), ("no val", True), ("aclImdb", True)]
)
def test_the_report_says_the_search_chose_on_the_test_set_only_where_val_read_it(
    tmp_path, capsys, layout, reads_test
):
    """The report said of every text study that its val split read the test data, a false
    claim for a directory with a real val.tsv; the search now records what the val split it
    loaded read, and the warning and the note under table.md follow that."""
    import json

    data = write_text_data(tmp_path / "data", layout)
    cfg = tmp_path / "words.toml"
    cfg.write_text(TEXT_CONFIG.format(data=json.dumps(str(data))))
    out = tmp_path / "res"
    fallback = layout == "no val"  # the search is told where it loads the splits
    with pytest.warns(UserWarning, match="no val.tsv") if fallback else contextlib.nullcontext():
        assert ks("search", cfg, "--out", out) == 0
    (study,) = studies(out, "words").values()
    assert study.user_attrs["val_reads_test"] is reads_test
    capsys.readouterr()
    assert ks("report", cfg, "--out", out) == 0
    err = capsys.readouterr().err
    md = (out / "words" / "table.md").read_text()
    assert ("chose on the test set" in err) is reads_test, err
    assert ("chosen on the test set, so" in md) is reads_test, md
    assert "validation split" not in md or reads_test


def test_a_val_that_read_the_test_data_stays_recorded_while_the_study_has_trials(tmp_path):
    """The data path is no setting: a study searched on a val split that read the test data,
    then continued on data with a val table, still holds trials chosen on the test set."""
    config = load_config(write_config(tmp_path, ["elu+1"], steps=2))
    url, variant = storage_url(config, None, tmp_path / "res"), config.variants[0]
    assert variant_study(config, variant, url, True).user_attrs["val_reads_test"] is True
    # no trial ran on that data: what the val split reads now decides
    assert variant_study(config, variant, url, False).user_attrs["val_reads_test"] is False
    variant_study(config, variant, url, True).add_trial(optuna.trial.create_trial(value=0.5))
    assert variant_study(config, variant, url, False).user_attrs["val_reads_test"] is True
    assert variant_study(config, variant, url).user_attrs["val_reads_test"] is True  # unknown


def test_a_search_that_fails_its_checks_leaves_no_folder(tmp_path, capsys, monkeypatch):
    """The default storage's folder OUT/NAME was made before the checks and left empty
    when they failed (the SQLite file in it was removed). A folder the checks wrote into
    (generated data, kept for the next run) stays."""
    from kernelstudy.search import runner

    def refuse(*args, **kwargs):
        raise ValueError("settings refused")

    monkeypatch.setattr(runner, "check_settings", refuse)
    cfg, out = write_config(tmp_path, ["elu+1"]), tmp_path / "res"
    assert ks("search", cfg, "--out", out) == 1
    assert "settings refused" in capsys.readouterr().err
    assert out.exists() and not (out / "tiny").exists()
    monkeypatch.undo()
    cfg = write_config(tmp_path, ["elu+1"], d_model=8, n_heads=3)  # fails after the data
    assert ks("search", cfg, "--out", out) == 1
    assert "n_heads" in capsys.readouterr().err
    assert [p.name for p in (out / "tiny").iterdir()] == [data_dir(load_config(cfg), out).name]


def test_a_search_config_runs_as_a_study_by_name(tmp_path, monkeypatch, capsys):
    """DESIGN: each claim is a study runnable as ``kernelstudy study NAME``; the LRA claims,
    search configs (``studies/lra_*.toml``, no script), answered "unknown study 'lra_text'".
    Now the name runs search → evaluate → report into the search's folder, and again resumes."""
    from kernelstudy.search.pipeline import QUICK_SEEDS, SEEDS, list_search_studies

    lra = {"lra_image", "lra_listops", "lra_pathfinder", "lra_retrieval", "lra_text"}
    assert set(list_search_studies()) == lra  # the shipped ones; approximation.toml is not
    root = tmp_path / "studies"
    root.mkdir()
    write_config(root, ["Transformer", "elu+1"])  # studies/tiny.toml
    (root / "broken.toml").write_text("not = [valid")  # not a search: not listed
    monkeypatch.setenv(ENV_STUDIES_DIR, str(root))
    assert ks("study") == 0
    assert capsys.readouterr().out.splitlines() == ["tiny (a search: search, evaluate, report)"]
    out = tmp_path / "res"
    assert ks("study", "tiny", "--out", out) == 0
    printed = capsys.readouterr().out
    assert "| variant | listops mean" in printed and f"table_md: {out / 'tiny'}" in printed
    assert sorted(studies(out)) == ["tiny/Transformer", "tiny/elu+1"]
    table = pd.read_csv(out / "tiny" / "table.csv", header=[0, 1], index_col=0)
    assert list(table.index) == ["Transformer", "elu+1"]
    assert (table[("listops", "n")] == SEEDS).all() and SEEDS > QUICK_SEEDS
    stamp = (out / "tiny" / "evaluation.csv").stat().st_mtime_ns
    assert ks("study", "tiny", "--out", out) == 0  # resumes: nothing searched or trained
    assert (out / "tiny" / "evaluation.csv").stat().st_mtime_ns == stamp
    capsys.readouterr()
    for option in (["--force"], ["--only", "x=1"], ["--fill-tables"]):
        assert ks("study", "tiny", *option, "--out", out) == 1
        assert f"{option[0]} do(es) not apply to 'tiny', a search" in capsys.readouterr().err
    assert ks("study", "tinyy", "--out", out) == 1
    assert "unknown study 'tinyy'" in capsys.readouterr().err
