"""The study runner (on a toy study) and the quick approximation study end to end."""

from __future__ import annotations

import textwrap

import pandas as pd
import pytest

import kernelstudy as ks
from kernelstudy import study

TOY_SCRIPT = '''
"""A toy study: squares."""
import pandas as pd

CALLS = []


def configs(params):
    return [{"x": x} for x in params["xs"]]


def run_config(config, device):
    CALLS.append(config["x"])
    return [{"metric": "square", "value": float(config["x"] ** 2)}]


def summarize(frame, params):
    return "table of " + str(len(frame)) + " rows"


def figures(frame, params):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    ax.plot(frame["x"], frame["value"])
    return {"squares": fig}
'''


@pytest.fixture
def toy_studies(tmp_path, monkeypatch):
    root = tmp_path / "studies"
    root.mkdir()
    (root / "toy.py").write_text(textwrap.dedent(TOY_SCRIPT))
    (root / "toy.toml").write_text("[full]\nxs = [1, 2, 3, 4]\n\n[quick]\nxs = [1, 2]\n")
    (root / "orphan.py").write_text("")  # no config file: not a study
    monkeypatch.setenv(study.ENV_STUDIES_DIR, str(root))
    return tmp_path


def test_runner_writes_results_and_resumes(toy_studies, capsys):
    out = toy_studies / "out"
    assert study.list_studies() == ["toy"]
    frame = study.run_study("toy", quick=True, out=out, verbose=False)
    assert sorted(frame.value) == [1.0, 4.0]
    assert {"study", "config_id", "device", "x"} <= set(frame.columns)
    assert (out / "results.csv").is_file() and (out / "squares.png").is_file()
    assert "table of 2 rows" in (out / "summary.md").read_text()
    # Resume: finished configs are not recomputed (a marked value survives) ...
    csv = pd.read_csv(out / "results.csv")
    csv.loc[csv.x == 1, "value"] = -1.0
    csv.to_csv(out / "results.csv", index=False)
    frame = study.run_study("toy", quick=False, out=out, verbose=False)
    assert sorted(frame.value) == [-1.0, 4.0, 9.0, 16.0]
    # ... unless forced; the quick and full runs share one CSV without duplicates.
    frame = study.run_study("toy", quick=True, out=out, force=True, verbose=False)
    assert sorted(frame.value) == [1.0, 4.0]
    assert len(pd.read_csv(out / "results.csv")) == 4
    assert not list(out.glob(".*.tmp"))


def test_runner_errors(toy_studies, monkeypatch):
    with pytest.raises(ValueError, match="unknown study 'nope'; available: toy"):
        study.run_study("nope", out=toy_studies / "x")
    with pytest.raises(ValueError, match="device"):
        study.run_study("toy", device="tpu", out=toy_studies / "x")
    monkeypatch.setenv(study.ENV_STUDIES_DIR, str(toy_studies / "missing"))
    with pytest.raises(FileNotFoundError, match="cannot find the studies/ directory"):
        study.list_studies()
    monkeypatch.delenv(study.ENV_STUDIES_DIR)
    (toy_studies / "empty").mkdir()
    monkeypatch.chdir(toy_studies / "empty")
    monkeypatch.setattr(study, "__file__", str(toy_studies / "a" / "pkg" / "study.py"))
    with pytest.raises(FileNotFoundError, match="KERNELSTUDY_STUDIES_DIR"):
        study.run_study("toy")


def test_main_parses_options(toy_studies, capsys):
    out = toy_studies / "cli"
    assert study.main("toy", ["--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "# toy (quick, cpu)" in printed and "table of 2 rows" in printed
    assert study.main("toy", ["--out", str(out), "--device", "cuda"]) in (0, 1)


def test_repo_studies_are_listed():
    assert set(study.list_studies()) >= {"approximation", "rank", "speed", "generation"}


@pytest.mark.skipif("favor" not in ks.list_feature_maps(), reason="favor map not registered yet")
def test_quick_approximation_reproduces_performer(tmp_path):
    frame = study.run_study("approximation", quick=True, out=tmp_path, verbose=False)
    perf = frame[(frame.part == "performer") & (frame.method == "favor")]
    for metric in ("attention_mse", "kernel_mse"):
        means = (
            perf[perf.metric == metric]
            .groupby(["num_features", "orthogonal"])["value"]
            .mean()
            .unstack("orthogonal")
        )
        assert means.index.is_monotonic_increasing and len(means) >= 5
        for col in means:  # MSE falls with R
            assert means[col].is_monotonic_decreasing, (metric, means)
        assert (means[True] < means[False]).all(), (metric, means)  # orthogonal beats iid
    assert (tmp_path / "summary.md").read_text().count("smallest R") >= 1
    assert list(tmp_path.glob("performer_attention_mse.png"))
    assert set(frame[frame.part == "maps"]["map"]) >= {"elu", "favor"}


def _shrunk(name: str, **changes) -> tuple[object, list[dict]]:
    """A repo study's module and its quick configs with sizes overridden (smoke tests)."""
    module = study.load_study(name)
    configs = [
        {**c, **{k: v for k, v in changes.items() if k in c}}
        for c in module.configs(study.load_params(name, quick=True))
    ]
    return module, configs


def test_speed_study_runs_a_config():
    module, configs = _shrunk("speed", seq_lens=[16, 32], repeats=1)
    frame = pd.DataFrame(module.run_config(configs[0], "cpu"))
    assert {"time_ms", "gflops"} <= set(frame.metric)
    for key in ("setting", "method", "causal", "pass"):
        frame[key] = configs[0][key]
    assert "Median time" in module.summarize(frame, study.load_params("speed", quick=True))


def test_generation_study_runs_and_reports_both_speedups():
    module, configs = _shrunk("generation", lengths=[4, 8], d_model=16, n_layers=1, batch=2)
    frames = [pd.DataFrame(module.run_config(c, "cpu")).assign(run=c["run"]) for c in configs]
    table = module.summary_table(pd.concat(frames))
    assert {"speed-up vs no cache", "speed-up vs KV cache"} <= set(table.columns)
    assert (table["speed-up vs KV cache"] > 0).all() and len(table) == 2


def test_rank_study_gaussian_and_copy_configs_run():
    module, configs = _shrunk("rank", steps=3, eval_every=2, train_samples=64, val_samples=4)
    gaussian = next(c for c in configs if c["part"] == "gaussian" and c["method"] == "elu")
    rows = pd.DataFrame(module.run_config({**gaussian, "n": 32}, "cpu"))
    ranks = rows.set_index("metric").value
    assert ranks["numerical_rank"] <= gaussian["feature_dim"]
    copy = next(c for c in configs if c["part"] == "copy" and c["method"] == "elu")
    rows = pd.DataFrame(module.run_config(copy, "cpu"))
    assert sorted(rows[rows.metric == "val_accuracy"].step) == [2, 3]
    assert rows[rows.metric == "val_accuracy"].value.between(0, 1).all()
    captured = rows[rows.metric == "numerical_rank"]
    assert (captured.value <= copy["feature_dim"]).all()


def test_load_results_reads_or_runs_the_study(toy_studies, monkeypatch):
    """``load_results``: runs the quick study into ``$KERNELSTUDY_RESULTS/NAME`` when missing,
    then reads what is there without running again; a relative setting is from the repo root."""
    monkeypatch.setenv(study.ENV_RESULTS_DIR, "res")
    assert study.results_dir() == toy_studies / "res"
    frame = study.load_results("toy")
    assert sorted(frame.value) == [1.0, 4.0]  # quick sizes
    summary = toy_studies / "res" / "toy" / "summary.md"
    assert summary.is_file() and "--quick" in summary.read_text()
    path = toy_studies / "res" / "toy" / "results.csv"
    marked = frame.assign(value=-1.0)
    marked.to_csv(path, index=False)
    assert (study.load_results("toy").value == -1.0).all()  # read, not recomputed
    full = study.load_results("toy", root=toy_studies / "other", quick=False)
    assert sorted(full.value) == [1.0, 4.0, 9.0, 16.0]
    with pytest.raises(ValueError, match="unknown study"):
        study.load_results("nope")
