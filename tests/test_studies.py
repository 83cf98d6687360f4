"""The study runner (on a toy study) and the quick approximation study end to end."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import textwrap

import numpy as np
import pandas as pd
import pytest
import scipy.stats
import torch

import kernelstudy as ks
from kernelstudy import folders, study
from kernelstudy.files import exclusive_folder, read_csv_table

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


# A toy study with an extra table: each config also gives the powers x**1..x**3.
TABLES_SCRIPT = '''
"""A toy study with an extra table: squares, and powers in powers.csv."""

TABLES = ("powers",)
SEEN = []


def configs(params):
    return [{"x": x} for x in params["xs"]]


def run_config(config, device):
    x = config["x"]
    return {
        "results": [{"metric": "square", "value": float(x**2)}],
        "powers": [{"x": x, "p": p, "power": float(x**p)} for p in (1, 2, 3)],
    }


def summarize(frame, params, tables):
    SEEN.append(len(tables["powers"]))
    return f"{len(frame)} results, {len(tables['powers'])} powers"
'''


@pytest.fixture
def toy_studies(tmp_path, monkeypatch):
    root = tmp_path / "studies"
    root.mkdir()
    (root / "toy.py").write_text(textwrap.dedent(TOY_SCRIPT))
    (root / "toy.toml").write_text("[full]\nxs = [1, 2, 3, 4]\n\n[quick]\nxs = [1, 2]\n")
    (root / "tabled.py").write_text(textwrap.dedent(TABLES_SCRIPT))
    (root / "tabled.toml").write_text("[full]\nxs = [1, 2, 3]\n\n[quick]\nxs = [1, 2]\n")
    (root / "orphan.py").write_text("")  # no config file: not a study
    monkeypatch.setenv(study.ENV_STUDIES_DIR, str(root))
    return tmp_path


def test_runner_writes_results_and_resumes(toy_studies, capsys):
    out = toy_studies / "out"
    assert study.list_studies() == ["tabled", "toy"]
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


@pytest.mark.parametrize(
    "ids", [("942358339153", "000000000017"), ("096e55686685", "1e2846341546")]
)
def test_resume_with_ids_that_look_like_numbers(toy_studies, monkeypatch, ids):
    """1 in ~140 ids is all digits or reads as a float ("096e55686685" is 96e55686685 = inf):
    such ids used to come back from results.csv as numbers, so a resumed study recomputed
    and duplicated its configs and returned none of them."""
    by_x = dict(zip((1, 2), ids, strict=True))
    monkeypatch.setattr(study, "config_id", lambda config, device: by_x[config["x"]])
    out = toy_studies / "out"
    for _ in range(2):
        frame = study.run_study("toy", quick=True, out=out, verbose=False)
        assert sorted(frame.value) == [1.0, 4.0] and sorted(frame.config_id) == sorted(ids)
    table = pd.read_csv(out / "results.csv", dtype={"config_id": str})
    assert sorted(table.config_id) == sorted(ids)  # written once each, verbatim


def test_summary_provenance_names_the_runs_that_computed_the_rows(toy_studies, monkeypatch):
    out = toy_studies / "out"
    lines = lambda: [  # noqa: E731
        x for x in (out / "summary.md").read_text().splitlines() if "by `kernelstudy" in x
    ]
    stamps = iter(f"2026-01-0{d} 00:00 UTC" for d in range(1, 10))
    real = study.provenance
    monkeypatch.setattr(
        study, "provenance", lambda *a, **k: real(*a, **k).replace("UTC", next(stamps), 1)
    )
    study.run_study("toy", quick=True, out=out, verbose=False)
    first = lines()
    assert len(first) == 1 and first[0].startswith("Written ") and "--quick" in first[0]
    study.run_study("toy", quick=True, out=out, verbose=False)  # nothing to compute
    assert lines() == first
    study.run_study("toy", quick=False, out=out, verbose=False)  # computes x = 3, 4
    assert lines()[0] == first[0] and len(lines()) == 2 and "--quick" not in lines()[1]
    study.run_study("toy", quick=False, out=out, force=True, verbose=False)  # all afresh
    assert len(lines()) == 1 and lines()[0] not in first
    forced = lines()
    (out / "summary.md").unlink()  # the rows' runs are in runs.json, not only the summary
    study.run_study("toy", quick=False, out=out, verbose=False)
    assert lines() == forced
    (out / "summary.md").unlink()  # results with no record of their runs: summarized
    (out / "runs.json").unlink()
    study.run_study("toy", quick=False, out=out, verbose=False)
    assert len(lines()) == 1 and lines()[0].startswith("Summarized (nothing computed) ")


def _interrupt_at(monkeypatch, x: int) -> None:
    """Make the toy study's run_config raise KeyboardInterrupt at config ``x``."""
    module = study.load_study("toy")
    real = module.run_config

    def run_config(config, device):
        if config["x"] == x:
            raise KeyboardInterrupt
        return real(config, device)

    monkeypatch.setattr(module, "run_config", run_config)
    monkeypatch.setattr(study, "load_study", lambda name: module)


def _written(out) -> list[str]:
    text = (out / "summary.md").read_text().split("Earlier runs")[0]
    return [x for x in text.splitlines() if x.startswith("Written ")]


def test_an_interrupted_force_run_keeps_the_rows_it_did_not_reach(toy_studies, monkeypatch):
    """--force dropped every selected config's rows before running any: interrupted at
    the third config, the old rows of the third and fourth were gone from results.csv."""
    out = toy_studies / "out"
    study.run_study("toy", quick=False, out=out, verbose=False)
    _interrupt_at(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        study.run_study("toy", quick=False, out=out, force=True, verbose=False)
    assert sorted(pd.read_csv(out / "results.csv").x) == [1, 2, 3, 4]


def test_an_interrupted_runs_rows_keep_its_provenance(toy_studies, monkeypatch):
    """Lines were made only at the end: the rows of a run stopped before its summary
    (Ctrl-C, or an error in figures) stayed in results.csv with no line naming their run."""
    out = toy_studies / "out"
    stamps, real = iter(range(100)), study.provenance  # one line per run, minutes apart
    stamped = lambda *a, **k: real(*a, **k).replace(" UTC", f" UTC #{next(stamps)}", 1)  # noqa: E731
    _interrupt_at(monkeypatch, 3)
    monkeypatch.setattr(study, "provenance", stamped)
    with pytest.raises(KeyboardInterrupt):
        study.run_study("toy", quick=False, out=out, device="cpu", verbose=False)
    monkeypatch.undo()
    monkeypatch.setenv(study.ENV_STUDIES_DIR, str(toy_studies / "studies"))
    monkeypatch.setattr(study, "provenance", stamped)
    study.run_study("toy", quick=False, out=out, force=False, verbose=False, only={"x": 3})
    study.run_study("toy", quick=False, out=out, verbose=False)
    lines = _written(out)
    assert len(lines) == 3  # the interrupted run (x = 1, 2), --only x=3, the last (x = 4)
    assert "--only x=3" in lines[1] and "--only" not in lines[0] + lines[2]


def test_a_run_whose_rows_were_all_computed_again_leaves_the_summary(toy_studies, monkeypatch):
    """Beside rows from before runs.json (no line of their own there: the replaced summary's
    lines are kept for them), a run whose rows were all computed again kept its line: the
    summary named a run none of whose rows it holds."""
    out = toy_studies / "out"
    stamps, real = iter(range(100)), study.provenance  # one line per run
    stamped = lambda *a, **k: real(*a, **k).replace(" UTC", f" UTC #{next(stamps)}", 1)  # noqa: E731
    monkeypatch.setattr(study, "provenance", stamped)
    study.run_study("toy", quick=False, out=out, verbose=False)  # x = 1-4
    (first,) = _written(out)
    (out / "runs.json").unlink()  # rows from before runs.json: their run is the summary's
    study.run_study("toy", quick=False, out=out, force=True, verbose=False, only={"x": 3})
    assert _written(out)[0] == first and len(_written(out)) == 2
    second = _written(out)[1]
    study.run_study("toy", quick=False, out=out, force=True, verbose=False, only={"x": 3})
    lines = _written(out)
    assert first in lines and second not in lines and len(lines) == 2, lines
    study.run_study("toy", quick=False, out=out, verbose=False)  # nothing computed
    assert _written(out) == lines


def test_a_summary_names_only_the_runs_that_computed_its_rows(toy_studies):
    """A line of another size's run was kept when that size shared any config with this
    summary, even if that run computed none of its rows."""
    (toy_studies / "studies" / "toy.toml").write_text(
        "[full]\nxs = [1, 2, 3, 4]\n\n[quick]\nxs = [1, 2]\n"
    )
    out = toy_studies / "out"
    study.run_study("toy", quick=True, out=out, verbose=False)  # x = 1, 2
    (quick_line,) = _written(out)
    study.run_study("toy", quick=False, out=out, verbose=False)  # x = 3, 4 only
    assert len(_written(out)) == 2
    study.run_study("toy", quick=True, out=out, verbose=False)  # nothing computed
    assert _written(out) == [quick_line]
    text = (out / "summary.md").read_text()
    assert "Earlier runs with other rows" in text and "Summarized" not in text


def test_figures_of_the_replaced_summary_are_removed(toy_studies, monkeypatch):
    """A figure only the earlier run drew stayed beside a summary that does not show it,
    though the note said this run's figures replace the earlier run's."""
    out = toy_studies / "out"
    module = study.load_study("toy")
    real = module.figures

    def figures(frame, params):
        figs = real(frame, params)
        if len(frame) > 2:  # the full size draws one more
            figs["big_only"] = real(frame, params)["squares"]
        return figs

    monkeypatch.setattr(module, "figures", figures)
    monkeypatch.setattr(study, "load_study", lambda name: module)
    (out / "keep.png").parent.mkdir(parents=True)
    (out / "keep.png").write_bytes(b"not the study's")
    study.run_study("toy", quick=False, out=out, verbose=False)
    assert (out / "big_only.png").is_file()
    study.run_study("toy", quick=True, out=out, verbose=False)
    assert not (out / "big_only.png").exists() and (out / "squares.png").is_file()
    assert (out / "keep.png").is_file()  # not linked by the replaced summary: kept


def test_a_run_of_the_other_size_keeps_the_first_runs_provenance(toy_studies, capsys):
    """A quick run into a folder of a full run whose configurations it does not share
    replaced the summary and dropped the full run's "Written" line: written again, the full
    summary named no run that computed its rows. The line is kept apart, and a note says how
    to write the full summary again."""
    (toy_studies / "studies" / "toy.toml").write_text("[full]\nxs = [1, 2]\n\n[quick]\nxs = [5]\n")
    out = toy_studies / "out"
    written = lambda: [  # noqa: E731
        x for x in (out / "summary.md").read_text().splitlines() if x.startswith("Written ")
    ]
    study.run_study("toy", quick=False, out=out, verbose=False)
    (full_line,) = written()
    assert "--quick" not in full_line
    capsys.readouterr()
    study.run_study("toy", quick=True, out=out, verbose=False)
    err = capsys.readouterr().err
    assert "summary.md and the figures were the full cpu run's" in err
    assert f"`kernelstudy study toy --device cpu --out {out}`" in err
    text = (out / "summary.md").read_text()
    assert text.startswith("# toy (quick, cpu)") and "Earlier runs with other rows" in text
    assert full_line in written() and len(written()) == 2
    own = lambda: (out / "summary.md").read_text().split("Earlier runs")[0]  # noqa: E731
    quick_line = next(x for x in written() if x != full_line)
    assert quick_line in own() and full_line not in own()
    study.run_study("toy", quick=True, out=out, verbose=False)  # nothing computed: the
    assert quick_line in own() and full_line not in own()  # full line stays apart
    assert full_line in written()
    study.run_study("toy", quick=False, out=out, verbose=False)  # nothing computed
    assert (out / "summary.md").read_text().startswith("# toy (full, cpu)")
    assert full_line in own() and quick_line not in own()  # not the quick run's command
    assert quick_line in written()
    assert "Summarized (nothing computed)" not in (out / "summary.md").read_text()
    assert "were the quick cpu run's" in capsys.readouterr().err
    study.run_study("toy", quick=False, out=out, verbose=False)  # same size: no note
    assert "and the figures were" not in capsys.readouterr().err


def test_a_crafted_summary_title_puts_no_command_into_the_note(toy_studies, capsys):
    """The note's command took the device from the replaced summary's title, any text without
    spaces, unquoted: a shared folder's summary.md titled ``(quick, ;touch${IFS}x;)`` made
    the printed command run ``touch``. A title of no known device names no earlier run."""
    out = toy_studies / "out"
    study.run_study("toy", quick=False, out=out, verbose=False)
    summary = out / "summary.md"
    lines = summary.read_text().splitlines()
    summary.write_text("\n".join(["# toy (quick, ;touch${IFS}x;)", *lines[1:]]) + "\n")
    capsys.readouterr()
    study.run_study("toy", quick=False, out=out, verbose=False)
    err = capsys.readouterr().err
    assert "touch" not in err and "and the figures were" not in err


def _powers(out) -> pd.DataFrame:
    return pd.read_csv(out / "powers.csv")


def test_runner_writes_extra_tables_and_resumes_without_duplicates(toy_studies):
    out = toy_studies / "out"
    module_rows = study.run_study("tabled", quick=True, out=out, verbose=False)
    assert sorted(module_rows.value) == [1.0, 4.0]
    powers = _powers(out)
    assert list(powers.columns) == ["config_id", "x", "p", "power"]  # config_id, then the study's
    assert len(powers) == 6 and set(powers.config_id) == set(module_rows.config_id)
    assert "2 results, 6 powers" in (out / "summary.md").read_text()
    # Resume: nothing reruns, nothing is appended; the full size adds only x = 3.
    study.run_study("tabled", quick=True, out=out, verbose=False)
    assert len(_powers(out)) == 6
    study.run_study("tabled", quick=False, out=out, verbose=False)
    assert len(_powers(out)) == 9 and len(pd.read_csv(out / "results.csv")) == 3
    # Interrupted after the extra table was written but before results.csv: the config
    # reruns and replaces its rows instead of duplicating them.
    results = pd.read_csv(out / "results.csv")
    results[results.x != 3].to_csv(out / "results.csv", index=False)
    study.run_study("tabled", quick=False, out=out, verbose=False)
    powers = _powers(out)
    assert len(powers) == 9 and not powers.duplicated(["config_id", "p"]).any()
    # --force replaces the forced configs' rows in every table.
    study.run_study("tabled", quick=True, out=out, force=True, verbose=False)
    assert len(_powers(out)) == 9 and len(pd.read_csv(out / "results.csv")) == 3
    # --force with --only recomputes the matching configs and keeps every other row.
    results = pd.read_csv(out / "results.csv")
    results.loc[results.x != 2, "value"] = -1.0  # marks that must survive
    results.to_csv(out / "results.csv", index=False)
    study.run_study("tabled", quick=False, out=out, force=True, only={"x": 2}, verbose=False)
    kept = pd.read_csv(out / "results.csv").set_index("x")["value"]
    assert kept.to_dict() == {1: -1.0, 2: 4.0, 3: -1.0}
    assert len(_powers(out)) == 9
    assert not list(out.glob(".*.tmp"))


def test_fill_tables_keeps_results_and_only_filters(toy_studies, capsys):
    out = toy_studies / "out"
    study.run_study("tabled", quick=False, out=out, verbose=False)
    results = pd.read_csv(out / "results.csv")
    results.loc[results.x == 2, "value"] = -1.0  # a stored result the rerun cannot reproduce
    results.to_csv(out / "results.csv", index=False)
    (out / "powers.csv").unlink()
    study.run_study("tabled", quick=False, out=out, only={"x": 1})  # no fill: nothing runs
    assert not (out / "powers.csv").exists()
    assert "3 finished configurations have no rows in powers" in capsys.readouterr().err
    study.run_study("tabled", quick=False, out=out, fill_tables=True, only={"x": 1})
    assert sorted(_powers(out).x.unique()) == [1]
    assert "2 finished configurations have no rows in powers" in capsys.readouterr().err
    study.run_study("tabled", quick=False, out=out, fill_tables=True)
    err = capsys.readouterr().err
    assert "1 configurations rerun to fill powers did not reproduce" in err
    assert len(_powers(out)) == 9 and not _powers(out).duplicated(["config_id", "p"]).any()
    kept = pd.read_csv(out / "results.csv")
    assert sorted(kept.value) == [-1.0, 1.0, 9.0]  # results.csv untouched by the fill
    summary = (out / "summary.md").read_text()
    assert "--fill-tables" in summary and summary.count("Written ") == 3  # earlier lines kept
    with pytest.raises(ValueError, match="only"):
        study.run_study("tabled", out=out, only={"nope": 1}, verbose=False)
    assert study.main("tabled", ["--out", str(out), "--only", "x"]) == 1  # not KEY=VALUE
    assert study.main("tabled", ["--out", str(out), "--fill-tables", "--only", "x=3"]) == 0


def test_load_results_reads_an_extra_table(toy_studies, monkeypatch):
    monkeypatch.setenv(study.ENV_RESULTS_DIR, "res")
    powers = study.load_results("tabled", table="powers")  # missing: runs the quick study
    assert len(powers) == 6 and {"config_id", "p", "power"} <= set(powers.columns)
    path = toy_studies / "res" / "tabled" / "powers.csv"
    path.unlink()  # results.csv is there: the quick study fills the table
    assert len(study.load_results("tabled", table="powers")) == 6
    assert len(study.load_results("tabled")) == 2
    with pytest.raises(ValueError, match="no table 'nope'; tables: 'results', 'powers'"):
        study.load_results("tabled", table="nope")
    with pytest.raises(ValueError, match="no table"):
        study.load_results("toy", table="powers")


def test_runner_errors(toy_studies, monkeypatch):
    with pytest.raises(ValueError, match="unknown study 'nope'; available: tabled, toy"):
        study.run_study("nope", out=toy_studies / "x")
    with pytest.raises(ValueError, match="device"):
        study.run_study("toy", device="tpu", out=toy_studies / "x")
    monkeypatch.setenv(study.ENV_STUDIES_DIR, str(toy_studies / "missing"))
    with pytest.raises(FileNotFoundError, match="cannot find the studies/ directory"):
        study.list_studies()
    monkeypatch.delenv(study.ENV_STUDIES_DIR)
    (toy_studies / "empty").mkdir()
    monkeypatch.chdir(toy_studies / "empty")
    monkeypatch.setattr(folders, "__file__", str(toy_studies / "a" / "pkg" / "folders.py"))
    with pytest.raises(FileNotFoundError, match="KERNELSTUDY_STUDIES_DIR"):
        study.run_study("toy")


def test_an_empty_results_file_is_no_rows_and_a_garbled_one_is_named(toy_studies, capsys):
    out = toy_studies / "out"
    out.mkdir()
    (out / "results.csv").write_bytes(b"")  # e.g. created by hand: no rows yet
    assert sorted(study.run_study("toy", quick=True, out=out, verbose=False).value) == [1, 4]
    garbled = b'x,"value\n1,2\n'  # an unterminated quote
    (out / "results.csv").write_bytes(garbled)
    with pytest.raises(ValueError, match=r"results\.csv is not a readable CSV table"):
        study.run_study("toy", quick=True, out=out, verbose=False)
    assert study.main("toy", ["--quick", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "is not a readable CSV table" in err and "Traceback" not in err
    assert (out / "results.csv").read_bytes() == garbled  # left as it was


def test_a_results_file_saved_with_another_separator_is_named_not_taken_for_no_rows(toy_studies):
    """Re-saved with ';' (a spreadsheet's locale), results.csv read as one column and no
    config_id: every configuration ran again and the user's rows were merged into one column."""
    out = toy_studies / "out"
    study.run_study("toy", quick=True, out=out, verbose=False)
    frame = pd.read_csv(out / "results.csv")
    frame.to_csv(out / "results.csv", sep=";", index=False)
    saved = (out / "results.csv").read_bytes()
    with pytest.raises(ValueError, match=r"results\.csv has no config_id column.*separator"):
        study.run_study("toy", quick=True, out=out, verbose=False)
    assert (out / "results.csv").read_bytes() == saved
    (out / "results.csv").unlink()
    (out / "results.csv").mkdir()  # read as no rows: a configuration ran, then the write failed
    with pytest.raises(ValueError, match=r"results\.csv is a folder, not a CSV table"):
        study.run_study("toy", quick=True, out=out, verbose=False)


def test_a_config_that_is_not_utf8_is_named(toy_studies):
    """A binary --config gave "'utf-8' codec can't decode byte 0xff" naming neither the file
    nor the flag."""
    bad = toy_studies / "binary.toml"
    bad.write_bytes(b"x\xff = 1\n")
    with pytest.raises(ValueError, match=r"config '.*binary\.toml' is not valid TOML: 'utf-8'"):
        study.load_params("toy", config=bad)


def test_a_folder_that_takes_no_new_files_is_refused_before_any_configuration_runs(
    toy_studies, monkeypatch
):
    """A read-only results folder holding a .lock from an earlier run: the lock opened, and
    the first configuration was computed, then lost at its first write (a hidden temporary
    file's 'Permission denied')."""
    out = toy_studies / "out"
    study.run_study("toy", quick=True, out=out, verbose=False)
    saved = (out / "results.csv").read_bytes()
    import kernelstudy.files as files

    def read_only(folder, prefix, suffix):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(files, "new_temporary_file", read_only)  # as chmod 555 (not for root)
    with pytest.raises(ValueError, match=r"cannot hold study toy's files: cannot write in"):
        study.run_study("toy", quick=False, out=out, verbose=False)
    assert (out / "results.csv").read_bytes() == saved


def test_out_must_be_a_directory_and_force_is_in_the_provenance(toy_studies, capsys):
    out = toy_studies / "cli"
    assert study.main("toy", ["--quick", "--out", str(out), "--force"]) == 0
    capsys.readouterr()
    written = [x for x in (out / "summary.md").read_text().splitlines() if x.startswith("Written")]
    assert len(written) == 1 and "--quick --device cpu --force" in written[0]
    # the start line said "0 already in results.csv" of a forced run over finished rows
    assert study.main("toy", ["--quick", "--out", str(out), "--force"]) == 0
    err = capsys.readouterr().err
    assert "2 already in" in err and "(2 recomputed: --force); running 2" in err
    file = toy_studies / "a_file"
    file.write_text("")
    with pytest.raises(ValueError, match=f"--out {file} exists and is not a directory"):
        study.run_study("toy", out=file, verbose=False)
    assert study.main("toy", ["--out", str(file)]) == 1
    assert f"--out {file} exists and is not a directory" in capsys.readouterr().err
    assert file.read_text() == ""


def test_main_parses_options(toy_studies, capsys):
    out = toy_studies / "cli"
    assert study.main("toy", ["--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "# toy (quick, cpu)" in printed and "table of 2 rows" in printed
    assert study.main("toy", ["--out", str(out), "--device", "cuda"]) in (0, 1)


def test_repo_studies_are_listed():
    assert set(study.list_studies()) >= {"approximation", "rank", "speed", "generation"}


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
    summary = (tmp_path / "summary.md").read_text()
    assert summary.count("smallest R") >= 1
    verdict = study.load_study("approximation").performer_verdict(frame).iloc[0]
    assert verdict["MSE falls with R"] == "yes"
    # with 20 seeds the ratio of 0.92 at R=16 is not resolved once the 7 R's intervals
    # must hold together (simultaneous intervals); every other R is lower
    assert verdict["orthogonal vs iid, per R"] in (
        "7 lower (of 7)",
        "6 lower, 1 not resolved (of 7)",
    ), verdict
    assert list(tmp_path.glob("performer_attention_mse.png"))
    assert set(frame[frame.part == "maps"]["map"]) >= {"elu", "favor"}


def _performer_frame(ratio: float, spread: float, seeds: int = 40) -> pd.DataFrame:
    """Performer rows whose MSE is c/R·(heavy-tailed noise), orthogonal = ratio × iid in
    distribution but drawn independently of it."""

    rng = np.random.default_rng(0)
    rows = []
    for r in (16, 64, 256):
        for seed in range(seeds):
            for orth in (False, True):
                noise = float(np.exp(spread * rng.standard_normal()))
                value = (ratio if orth else 1.0) * noise / r
                for method, v in (("favor", value), ("uniform", 1.0)):
                    rows.append(
                        {"part": "performer", "metric": "attention_mse", "method": method,
                         "map": "favor", "head_dim": 8, "std": 0.5, "num_features": r,
                         "orthogonal": orth, "seed": seed, "value": v}
                    )  # fmt: skip
    return pd.DataFrame(rows)


def test_performer_slope_interval_is_over_seeds_not_rows():
    """The interval treated every (seed, R) row as independent, though a seed's rows share
    its data. Each seed here lies exactly on its own line (slopes −1 ± 0.1): the interval
    is that of the mean of the 10 seeds' slopes."""
    slope_of = study.load_study("approximation")._slope
    rng = np.random.default_rng(0)
    slopes = -1 + 0.1 * rng.standard_normal(10)
    rows = [
        {"seed": seed, "num_features": r, "value": float(np.exp(seed + s * np.log(r)))}
        for seed, s in enumerate(slopes)
        for r in (16, 64, 256, 1024)
    ]
    slope, lo, hi = slope_of(pd.DataFrame(rows))
    want = scipy.stats.ttest_1samp(slopes, 0).confidence_interval(0.95)  # Student t, 9 df
    assert slope == pytest.approx(slopes.mean(), rel=1e-9)
    assert (lo, hi) == pytest.approx((want.low, want.high), rel=1e-9)
    one_seed = pd.DataFrame([r for r in rows if r["seed"] == 0])
    assert all(np.isnan(slope_of(one_seed)))  # no spread to measure from one seed


def test_maps_without_a_kl_get_no_verdict_against_uniform():
    """Signed maps (identity, trig_rf) have no KL; their NaN compared as "no"."""
    rows = [
        {"part": "maps", "std": 1.0, "method": m, "stage": st, "feature_dim": f,
         "metric": metric, "value": v, "seed": 0}
        for m, st, f, kl in [
            ("uniform", "baseline", np.nan, 0.5),
            ("elu", "fixed", 8, 0.4),
            ("relu", "fixed", 8, 0.6),
            ("trig_rf", "random", 16, np.nan),
        ]
        for metric, v in (("attention_kl", kl), ("attention_mse", 1.0), ("output_rel_error", 1.0))
    ]  # fmt: skip
    table = study.load_study("approximation").maps_table(pd.DataFrame(rows))
    verdicts = dict(zip(table["method"], table["beats uniform (KL)"], strict=True))
    assert verdicts == {
        "uniform": "–",
        "elu": "yes (1 seed: by sign)",  # one seed: no interval, and the row says so
        "relu": "no (1 seed: by sign)",
        "trig_rf": "–",
    }


def test_approximation_fits_penalized_maps_also_without_their_penalty(monkeypatch):
    """The maps part fitted softplus_ffn, oglu and aoglu only with their orthogonality
    penalty, unsaid, beside maps fitted without one (glu, hedgehog): a fitted softplus_ffn
    hardly moved from its init. Each such map is now also fitted from the same init without
    it, as a map whose reg_weight is 0 is fitted."""
    approximation = study.load_study("approximation")
    config = {"part": "maps", "map": "softplus_ffn", "head_dim": 8, "std": 1.0,
              "target_feature_dim": 8, "seed": 0, "n": 16, "value_dim": 8, "fit_steps": 30,
              "fit_batch": 2, "fit_lr": 0.05}  # fmt: skip

    def kl(rows: pd.DataFrame) -> pd.Series:
        return rows[rows["metric"] == "attention_kl"].groupby("stage")["value"].mean()

    found = kl(approximation.run_config(config, "cpu"))
    assert set(found.index) == {"init", "fitted", approximation.UNPENALIZED}
    assert found["fitted"] != found[approximation.UNPENALIZED]  # the penalty was on, then off
    made = approximation.matched_map

    def without_penalty(*args, **kwargs):
        fm = made(*args, **kwargs)
        fm.hparams["reg_weight"] = 0.0
        return fm

    monkeypatch.setattr(approximation, "matched_map", without_penalty)
    unpenalized = kl(approximation.run_config(config, "cpu"))
    assert set(unpenalized.index) == {"init", "fitted"}  # no penalty: one fit
    assert unpenalized["fitted"] == pytest.approx(found[approximation.UNPENALIZED], rel=1e-6)
    monkeypatch.undo()
    assert set(kl(approximation.run_config({**config, "map": "glu"}, "cpu")).index) == {
        "init",
        "fitted",
    }


def test_partial_maps_part_is_summarized_as_partial():
    """With elu at one seed of three (``--only seed=0``, or a new extra_maps entry tried at one
    seed), the summary said "means over 3 seed(s)" and that every yes/no came from a t
    interval (elu's was the sign of one difference), and uniform's mean weighted each seed
    by how many map runs it had."""
    approximation = study.load_study("approximation")
    rows = [
        {"part": "maps", "std": 1.0, "method": m, "map": m, "stage": st, "feature_dim": 8,
         "metric": metric, "value": v, "seed": seed}
        for m, st, kls in [("relu", "fixed", (0.40, 0.41, 0.39)), ("elu", "fixed", (0.1,))]
        for seed, kl in enumerate(kls)
        for metric, v in (("attention_kl", kl), ("attention_mse", 1.0), ("output_rel_error", 1.0))
    ]  # fmt: skip
    uniform = {0: 0.2, 1: 0.5, 2: 0.5}  # one uniform row per map run and seed: seed 0 twice
    rows += [
        {"part": "maps", "std": 1.0, "method": "uniform", "map": m, "stage": "baseline",
         "feature_dim": np.nan, "metric": metric, "value": uniform[seed], "seed": seed}
        for m, seeds in (("relu", (0, 1, 2)), ("elu", (0,)))
        for seed in seeds
        for metric in ("attention_kl", "attention_mse", "output_rel_error")
    ]  # fmt: skip
    frame = pd.DataFrame(rows)
    table = approximation.maps_table(frame).set_index("method")
    assert table.loc["uniform", "attention_kl"] == pytest.approx(0.4)  # not 0.35
    assert table.loc["elu", "beats uniform (KL)"] == "yes (1 seed: by sign)"
    params = {"map_feature_dim": 8, "fit_steps": 1, "fit_batch": 1, "map_seeds": 3}
    text = approximation.summarize(frame, params)
    assert "means over 1–3 seed(s) (of 3 configured: a partial run)" in text
    assert "means over 3 seed(s);" in approximation.summarize(frame[frame["map"] != "elu"], params)


def test_performer_table_without_a_kind_or_with_one_seed():
    """It printed "nan", "nan [nan, nan]" and "0.987 [nan, nan]" where the rest of the
    summary prints "–": iid rows only (``--only orthogonal=False``), or one seed."""
    performer_table = study.load_study("approximation").performer_table
    frame = _performer_frame(ratio=0.5, spread=0.1)
    iid_only = performer_table(frame[frame["orthogonal"].astype(str) != "True"]).iloc[0]
    assert (iid_only["orthogonal"], iid_only["orth/iid"]) == ("–", "–")
    one_seed = performer_table(frame[frame["seed"] == 0]).iloc[0]
    assert one_seed["orth/iid"].endswith("(1 seed: no interval)"), one_seed["orth/iid"]
    assert "nan" not in one_seed["orth/iid"] + one_seed["iid"]


def test_performer_verdict_reports_noise_as_unresolved():
    """It compared means of 10 heavy-tailed MSEs and printed a flat yes/no: iid and
    orthogonal drawn from one distribution read as "orthogonal < iid at every R: no"."""
    verdict = study.load_study("approximation").performer_verdict
    same = verdict(_performer_frame(ratio=1.0, spread=2.0)).iloc[0]
    assert same["orthogonal vs iid, per R"] == "3 not resolved (of 3)", same
    assert same["MSE falls with R"] == "yes"  # the 1/R trend stands out of the noise
    better = verdict(_performer_frame(ratio=0.5, spread=0.1)).iloc[0]
    assert better["orthogonal vs iid, per R"] == "3 lower (of 3)", better
    slope = float(better["slope, iid"].split()[0])
    assert slope == pytest.approx(-1.0, abs=0.05)
    # A seed whose orthogonal MSE is inf was dropped, leaving "lower" from the others.
    frame = _performer_frame(ratio=0.5, spread=0.1)
    blown = (frame.orthogonal == True) & (frame.seed < 4) & (frame.method == "favor")  # noqa: E712
    frame.loc[blown & (frame.num_features == 64), "value"] = float("inf")
    row = verdict(frame).iloc[0]
    assert row["orthogonal vs iid, per R"] == "2 lower, 1 undefined (of 3)", row
    table = study.load_study("approximation").performer_table(frame)
    assert table.set_index("num_features").loc[64, "orth/iid"].startswith("– (4 seeds")


def test_smallest_r_beating_uniform_counts_only_the_r_each_kind_was_run_at():
    """A partial run (--only) left orthogonal rows at R=16 only, or none: the table said
    orthogonal does not beat uniform up to the largest R of the iid rows ("> 256")."""
    module = study.load_study("approximation")
    frame = _performer_frame(ratio=0.5, spread=0.1)  # MSE ~1/R (iid), 0.5/R (orthogonal)
    frame.loc[frame.method == "uniform", "value"] = 0.01
    smallest = lambda f: module.smallest_r_beating_uniform(module.performer_table(f)).iloc[0]  # noqa: E731
    full = smallest(frame)
    assert (full["smallest R, iid"], full["smallest R, orthogonal"]) == (256, 64)
    orth = (frame.orthogonal == True) & (frame.method != "uniform")  # noqa: E712
    row = smallest(frame[~(orth & (frame.num_features > 16))])
    assert (row["smallest R, iid"], row["smallest R, orthogonal"]) == (256, "> 16")
    row = smallest(frame[~orth])
    assert (row["smallest R, iid"], row["smallest R, orthogonal"]) == (256, "–")


def test_approximation_intervals_are_student_t_at_few_seeds():
    """The per-R orth/iid intervals said ~95% and were ± 2 standard errors: 82% coverage at 3
    seeds. At 3 seeds with orth/iid 0.8, 0.95, 0.7 the table printed [0.679, 0.967], an
    interval excluding 1, where the t interval (scipy) is [0.554, 1.19]."""
    module = study.load_study("approximation")
    rows = [
        {"part": "performer", "metric": "attention_mse", "method": method, "map": "favor",
         "head_dim": 8, "std": 0.5, "num_features": 16, "orthogonal": orth, "seed": seed,
         "value": value}
        for seed, o in enumerate((0.8, 0.95, 0.7))
        for method, orth, value in (
            ("favor", False, 1.0), ("favor", True, o), ("uniform", False, 2.0)
        )
    ]  # fmt: skip
    row = module.performer_table(pd.DataFrame(rows)).iloc[0]
    want = scipy.stats.ttest_1samp(np.log([0.8, 0.95, 0.7]), 0).confidence_interval(0.95)
    assert (row["log_ratio_lo"], row["log_ratio_hi"]) == pytest.approx((want.low, want.high))
    assert row["orth/iid"] == "0.81 [0.554, 1.19]"


def test_smallest_r_beating_uniform_pairs_the_seeds():
    """A mean MSE below uniform's decided "beats" though the map was below uniform on a few
    seeds only (the committed favor D=64 std=0.5 orthogonal at R=1024: paired p = 0.2). Here
    the map's mean is below uniform's at R=64 from one seed's luck (the others are 1.1×): not
    resolved, so the smallest R is 256, where every seed is below."""
    module = study.load_study("approximation")
    seeds = range(5)
    at = {16: [2.0] * 5, 64: [0.01, 1.1, 1.1, 1.1, 1.2], 256: [0.5, 0.4, 0.45, 0.5, 0.42]}
    rows = [
        {"part": "performer", "metric": "attention_mse", "method": method, "map": "favor",
         "head_dim": 8, "std": 0.5, "num_features": r, "orthogonal": orth, "seed": seed,
         "value": value}
        for r, values in at.items()
        for seed in seeds
        for method, orth, value in (
            ("favor", False, values[seed]), ("favor", True, values[seed]), ("uniform", False, 1.0)
        )
    ]  # fmt: skip
    table = module.performer_table(pd.DataFrame(rows))
    assert table.set_index("num_features").loc[64, "iid_mean"] < 1.0  # the mean said "beats"
    assert table.set_index("num_features").loc[64, "iid beats uniform"] == "not resolved"
    row = module.smallest_r_beating_uniform(table).iloc[0]
    assert (row["smallest R, iid"], row["smallest R, orthogonal"]) == (256, 256)
    one = module.smallest_r_beating_uniform(module.performer_table(pd.DataFrame(rows[:9])))
    assert one.iloc[0]["smallest R, iid"] == "> 16"  # one seed at R=16: above, by sign
    first = [r for r in rows if r["seed"] == 0]
    one = module.smallest_r_beating_uniform(module.performer_table(pd.DataFrame(first)))
    assert one.iloc[0]["smallest R, iid"] == "64 (1 seed: by sign)"


def test_maps_table_and_figure_leave_out_a_kl_undefined_on_some_seeds(tmp_path):
    """trig_rf's KL is undefined on a seed where a kernel row has a negative entry; the table
    (and figure) averaged the seeds where it was defined — 1 of 20 in a run whose heading
    said "means over 20 seed(s)" — a mean of fewer seeds, picked by their data."""
    module = study.load_study("approximation")
    rows = [
        {"part": "maps", "std": 1.0, "method": m, "map": m, "stage": st, "feature_dim": 8,
         "target_feature_dim": 8, "n": 16, "head_dim": 4, "metric": metric, "value": v,
         "seed": seed}
        for m, st, kls in [
            ("uniform", "baseline", (0.5, 0.5, 0.5)),
            ("elu", "fixed", (0.4, 0.41, 0.39)),
            ("trig_rf", "random", (0.02, np.nan, np.nan)),
        ]
        for seed, kl in enumerate(kls)
        for metric, v in (("attention_kl", kl), ("attention_mse", 1.0), ("output_rel_error", 1.0))
    ]  # fmt: skip
    frame = pd.DataFrame(rows)
    table = module.maps_table(frame).set_index("method")
    assert np.isnan(table.loc["trig_rf", "attention_kl"])  # not 0.02
    assert table.loc["trig_rf", "attention_mse"] == 1.0  # defined on every seed
    assert table.loc["elu", "attention_kl"] == pytest.approx(0.4)
    fig = module.figures(frame, {})["maps_attention_kl"]
    bars = [p.get_height() for ax in fig.axes for p in ax.patches if p.get_height() > 0]
    assert sorted(bars) == pytest.approx([0.4])  # elu only: no bar of trig_rf's one seed
    assert "no KL for trig_rf where a seed's rows had negative weights" in fig.texts[0].get_text()


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
    config = configs[0]
    frame = pd.DataFrame(module.run_config(config, "cpu"))
    assert {"time_ms", "gflops"} <= set(frame.metric)
    # the yardstick keeps its own labels (it was tagged as the config's method and pass)
    rate = frame[frame.metric == "gflops"]
    assert rate[["method", "causal", "pass"]].values.tolist() == [["matmul", False, "fwd"]]
    times = frame[frame.metric == "time_ms"]
    for key in ("method", "causal", "pass"):
        assert (times[key] == config[key]).all()
    frame["setting"] = config["setting"]
    params = study.load_params("speed", quick=True)
    text = module.summarize(frame.assign(backend="torch"), params)
    assert "Median time" in text and module.REFERENCE_NOTE not in text
    without = frame.drop(columns="backend")  # rows of an older table: no backend column
    assert module.REFERENCE_NOTE not in module.summarize(without, params)
    # the reference backend's quadratic growth is said to be by design (it read as a failed
    # O(N) claim: "linear [reference]" at N^2.2 with nothing telling it is the explicit N×N)
    reference = frame.assign(backend=frame["metric"].map({"time_ms": "reference"}))
    assert module.REFERENCE_NOTE in module.summarize(reference, params)


def test_generation_study_runs_and_reports_both_speedups():
    module, configs = _shrunk("generation", lengths=[4, 8], d_model=16, n_layers=1, batch=2)
    frames = [pd.DataFrame(module.run_config(c, "cpu")).assign(run=c["run"]) for c in configs]
    table = module.summary_table(pd.concat(frames))
    assert {"speed-up vs no cache", "speed-up vs KV cache"} <= set(table.columns)
    assert (table["speed-up vs KV cache"] > 0).all() and len(table) == 2


def test_rank_study_gaussian_and_copy_configs_run():
    module, configs = _shrunk("rank", steps=3, eval_every=2, train_samples=64, val_samples=4)
    gaussian = next(c for c in configs if c["part"] == "gaussian" and c["method"] == "elu")
    out = module.run_config({**gaussian, "n": 32}, "cpu")
    ranks = pd.DataFrame(out["results"]).set_index("metric").value
    assert ranks["numerical_rank"] <= gaussian["feature_dim"]
    spectrum = pd.DataFrame(out["spectra"])
    assert list(spectrum.i) == list(range(1, 33)) and spectrum.sigma_ratio.iloc[0] == 1.0
    copy = next(c for c in configs if c["part"] == "copy" and c["method"] == "elu")
    out = module.run_config(copy, "cpu")
    rows = pd.DataFrame(out["results"])
    assert set(pd.DataFrame(out["spectra"]).captured_with) == {"elu"}
    assert sorted(rows[rows.metric == "val_accuracy"].step) == [2, 3]
    assert rows[rows.metric == "val_accuracy"].value.between(0, 1).all()
    captured = rows[rows.metric == "numerical_rank"]
    assert (captured.value <= copy["feature_dim"]).all()
    # measured with the best validation step's weights (the trainer restores them): named
    curve = rows[rows.metric == "val_accuracy"].set_index("step").value
    assert set(captured.step) == {curve[curve == curve.max()].index.min()}


def test_rank_captured_part_leaves_out_the_excluded_maps():
    """The softmax copy model's captured q/k ran through every registered map but a
    hard-coded identity, whatever exclude_maps said: a map excluded as broken or
    non-positive still ran there (and a broken one stopped the study)."""
    module = study.load_study("rank")
    params = study.load_params("rank", quick=True)
    params = {**params, "exclude_maps": ["identity", "elu", "favor"]}
    params["copy"] = {**params["copy"], "steps": 2, "eval_every": 2, "train_samples": 64,
                      "val_samples": 4, "models": ["softmax"]}  # fmt: skip
    (softmax, *_) = [c for c in module.configs(params) if c["part"] == "copy"]
    assert softmax["exclude_maps"] == ["elu", "favor", "identity"]
    rows = pd.DataFrame(module.run_config(softmax, "cpu")["results"])
    captured = set(rows.captured_with.dropna())  # training rows have none
    expected = set(ks.list_feature_maps()) - {"identity", "elu", "favor"}
    assert captured == {"softmax"} | expected


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


def test_load_results_leaves_out_rows_of_an_edited_config(toy_studies, monkeypatch):
    """After the config changed, the old configurations' rows stay in results.csv (a rerun
    keeps them); load_results returned them mixed with the current ones, silently."""
    monkeypatch.setenv(study.ENV_RESULTS_DIR, "res")
    study.run_study("toy", out=toy_studies / "res" / "toy", verbose=False)  # xs 1..4
    toml = toy_studies / "studies" / "toy.toml"
    toml.write_text("[full]\nxs = [5, 6, 7, 8]\n\n[quick]\nxs = [5]\n")
    study.run_study("toy", out=toy_studies / "res" / "toy", verbose=False)
    assert len(pd.read_csv(toy_studies / "res" / "toy" / "results.csv")) == 8
    with pytest.warns(UserWarning, match="left out 4 rows of configurations that study 'toy'"):
        frame = study.load_results("toy", quick=False)
    assert sorted(frame.value) == [25.0, 36.0, 49.0, 64.0]


def test_a_second_run_into_the_same_out_is_refused(toy_studies):
    """Two runs into one --out each rewrote results.csv from their own copy: 3 of 6 rows
    were lost when two halves of a study ran at once."""
    from kernelstudy.files import FolderBusy, exclusive_folder

    out = toy_studies / "out"
    out.mkdir()
    with exclusive_folder(out, "a test"):  # as another process's run holds it
        script = (
            "import sys; from kernelstudy import study; "
            f"sys.exit(study.main('toy', ['--out', {str(out)!r}]))"
        )
        import os
        import subprocess
        import sys

        env = {**os.environ, study.ENV_STUDIES_DIR: str(toy_studies / "studies")}
        proc = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True
        )
        assert proc.returncode == 1, proc.stderr
        assert (
            "cannot run study toy in" in proc.stderr and "another process is at work" in proc.stderr
        )
        assert not (out / "results.csv").exists()
        with pytest.raises(FolderBusy), exclusive_folder(out, "a test"):
            pass  # flock is per open file: a second open in this process is refused too
    frame = study.run_study("toy", out=out, verbose=False)  # free again
    assert len(frame) == 4


RANK_TOY_TOML = """
head_dim = 8
std = 1.0
exclude_maps = ["identity"]

[copy]
copy_len = 4
n_symbols = 5
d_model = 8
d_ff = 16
feature_dim = 8
models = ["softmax", "elu"]
batch_size = 4
lr = 3e-3
train_samples = 16
val_samples = 4
seeds = 1
steps = 2
eval_every = 1

[full]
seq_lens = [8, 16]
feature_dims = [4, 8]
fixed_n = 16
seeds = 2

[quick]
seq_lens = [8, 16]
feature_dims = [4, 8]
fixed_n = 16
seeds = 1
"""

SPECTRA_COLUMNS = [
    "config_id", "part", "method", "feature_dim", "n", "seed", "captured_with", "i", "sigma_ratio"
]  # fmt: skip


@pytest.fixture
def rank_toy(tmp_path, monkeypatch):
    """The repository's rank study script with tiny sizes (a copy, with its own config)."""
    root = tmp_path / "studies"
    root.mkdir()
    shutil.copy(study.studies_dir() / "rank.py", root / "rank.py")
    (root / "rank.toml").write_text(RANK_TOY_TOML)
    monkeypatch.setenv(study.ENV_STUDIES_DIR, str(root))
    return tmp_path / "rank"


@pytest.mark.slow
def test_rank_study_saves_spectra_and_resumes_without_duplicates(rank_toy, one_thread):
    out = rank_toy
    results = study.run_study("rank", quick=True, out=out, verbose=False)
    spectra = pd.read_csv(out / "spectra.csv")
    assert list(spectra.columns) == SPECTRA_COLUMNS
    assert set(spectra.config_id) == set(results.config_id)  # every config, both parts
    assert set(spectra.part) == {"gaussian", "copy"}
    assert spectra[spectra.part == "gaussian"].captured_with.isna().all()
    assert spectra[spectra.part == "copy"].captured_with.notna().all()
    ratio = spectra.sigma_ratio
    assert ((ratio > 0) & (ratio <= 1)).all()
    for _, matrix in spectra.groupby(["config_id", "captured_with"], dropna=False):
        assert list(matrix.i) == list(range(1, len(matrix) + 1))
        assert len(matrix) == matrix.n.iloc[0]  # one value per singular value of the N x N matrix
        assert matrix.sigma_ratio.iloc[0] == 1.0
        assert matrix.sigma_ratio.is_monotonic_decreasing  # non-increasing
    gaussian = spectra[(spectra.part == "gaussian") & (spectra.method != "softmax")]
    low_rank = gaussian[(gaussian.feature_dim < gaussian.n) & (gaussian.i > gaussian.feature_dim)]
    assert (low_rank.sigma_ratio < 1e-10).all()  # rank <= F: round-off after F values
    assert (out / "spectra.png").is_file() and "spectra.csv" in (out / "summary.md").read_text()
    # The N sweep (summary table and figures) keeps maps whose own F is not D (hedgehog: 2D).
    by_n = (out / "summary.md").read_text().split("## Rank vs N")[1].split("## Rank vs F")[0]
    assert "| hedgehog     | 16 " in by_n and "| elu          | 8  " in by_n, by_n
    # A resumed run (and a larger one sharing the files) never duplicates rows.
    study.run_study("rank", quick=True, out=out, verbose=False)
    assert len(pd.read_csv(out / "spectra.csv")) == len(spectra)
    study.run_study("rank", quick=False, out=out, verbose=False, only={"part": "gaussian"})
    grown = pd.read_csv(out / "spectra.csv")
    assert (
        len(grown) > len(spectra)
        and not grown.duplicated(["config_id", "captured_with", "i"]).any()
    )
    loaded = study.load_results("rank", root=out.parent, table="spectra")  # read, not rerun
    pd.testing.assert_frame_equal(loaded, grown)


def _toy_copy(tmp_path, monkeypatch, name: str, toml: str):
    """A studies/ directory holding the repository's ``NAME.py`` with its own tiny config."""
    root = tmp_path / "studies"
    root.mkdir(exist_ok=True)
    shutil.copy(study.studies_dir() / f"{name}.py", root / f"{name}.py")
    (root / f"{name}.toml").write_text(toml)
    monkeypatch.setenv(study.ENV_STUDIES_DIR, str(root))


def _partial(name: str, out, *only: str) -> str:
    """The summary.md of study ``name`` run quick with ``--only`` each of ``only`` (exit code 0)."""
    args = ["--quick", "--out", str(out)] + [a for item in only for a in ("--only", item)]
    assert study.main(name, args) == 0
    return (out / "summary.md").read_text()


def test_rank_study_summarizes_a_partial_run(rank_toy, one_thread, capsys):
    """Summary and figures of a run restricted with --only cover the parts that have rows."""
    summary = _partial("rank", rank_toy / "copy", "part=copy", "method=elu")
    assert "## Gaussian q/k\n\nNot run yet: no rows of part 'gaussian'" in summary
    assert "## Copy task" in summary and (rank_toy / "copy" / "copy_accuracy.png").is_file()
    summary = _partial("rank", rank_toy / "gaussian", "part=gaussian", "n=8")
    assert "## Copy task\n\nNot run yet: no rows of part 'copy'" in summary
    assert "Kernel rank ≤ F holds in every row: yes" in summary


def test_approximation_study_summarizes_a_partial_run(tmp_path, one_thread, capsys):
    summary = _partial("approximation", tmp_path / "maps", "part=maps", "map=elu")
    assert "Not run yet: no rows of part 'performer'" in summary
    assert "## Every registered map at F" in summary
    summary = _partial("approximation", tmp_path / "perf", "part=performer", "num_features=16")
    assert "Not run yet: no rows of part 'maps'" in summary
    assert "## The Performer finding" in summary


GENERATION_TOY_TOML = """
n_layers = 1
d_model = 16
n_heads = 2
vocab_size = 16
feature_map = "elu"
batch = 2
prompt_len = 1
repeats = 1
time_limit_s = 60.0

[quick]
lengths = [4, 8]
"""


def test_generation_study_summarizes_a_partial_run(tmp_path, monkeypatch, one_thread, capsys):
    _toy_copy(tmp_path, monkeypatch, "generation", GENERATION_TOY_TOML)
    summary = _partial("generation", tmp_path / "out", "run=linear, RNN state")
    assert "| linear, RNN state (tok/s) | RNN state (MiB) |" in summary
    missing = "Not run yet (no rows; their columns are left out): run='softmax, no cache', "
    assert missing + "run='softmax, KV cache'" in summary
    assert "--only 'run=linear, RNN state'" in summary  # the recorded command can be pasted
    # --only values are quoted in the error message: the run names hold commas.
    with pytest.raises(ValueError, match="run in 'linear, RNN state', 'softmax, KV cache', "):
        study.run_study("generation", quick=True, out=tmp_path / "out", only={"run": "nope"})


def test_load_results_gives_one_size_and_one_device(toy_studies, monkeypatch):
    """The quick and full runs share results.csv: loading it used to mix both sizes (and
    devices), so a notebook averaged N=128 and N=256 rows together."""
    (toy_studies / "studies" / "toy.toml").write_text(
        "[full]\nxs = [3, 4]\n\n[quick]\nxs = [1, 2]\n"
    )
    root = toy_studies / "res"
    for quick in (True, False):
        study.run_study("toy", quick=quick, out=root / "toy", verbose=False)
    assert len(pd.read_csv(root / "toy" / "results.csv")) == 4  # one file, both sizes
    assert sorted(study.load_results("toy", root=root).value) == [1.0, 4.0]
    assert sorted(study.load_results("toy", root=root, quick=False).value) == [9.0, 16.0]
    path = root / "toy" / "results.csv"
    table = pd.read_csv(path, dtype={"config_id": str})
    table.loc[0, "device"] = "cuda"
    table.to_csv(path, index=False)
    with pytest.raises(ValueError, match=r"devices \['cpu', 'cuda'\]: pass device="):
        study.load_results("toy", root=root)
    assert len(study.load_results("toy", root=root, device="cpu")) == 1


def test_a_mistyped_map_in_a_study_config_is_refused():
    """A map name the registry does not know dropped out of the study without a word."""
    for name, key, change in [
        ("approximation", "performer_maps", ["favor", "favour"]),
        ("approximation", "exclude_maps", ["glu_typo"]),
        ("rank", "exclude_maps", ["nope"]),
    ]:
        params = {**study.load_params(name, quick=True), key: change}
        with pytest.raises(ValueError, match=f"{key}: unknown name"):
            study.load_study(name).configs(params)
    params = study.load_params("speed", quick=True)
    params["performer"] = {**params["performer"], "feature_map": "favour"}
    with pytest.raises(ValueError, match="performer.feature_map: unknown name"):
        study.load_study("speed").configs(params)
    params = study.load_params("rank", quick=True)
    params["copy"] = {**params["copy"], "models": ["softmax", "elu+1"]}
    with pytest.raises(ValueError, match="copy.models: unknown name"):
        study.load_study("rank").configs(params)
    params = {**study.load_params("generation", quick=True), "feature_map": "elu+1"}
    with pytest.raises(ValueError, match="feature_map: unknown name"):
        study.load_study("generation").configs(params)
    # a map of one's own as "module:Class" (it was refused, as not registered)
    params["feature_map"] = "kernelstudy.feature_maps.elementary:EluFeatureMap"
    assert study.load_study("generation").configs(params)
    params["feature_map"] = "no_such_module:Map"
    with pytest.raises(ValueError, match="feature_map: cannot import feature map"):
        study.load_study("generation").configs(params)


def test_a_study_config_with_no_seeds_is_refused():
    """0 seeds dropped a part without a word (its summary section then said `--only part=...`
    runs it, which found no configuration) or failed as "No objects to concatenate"."""
    for name, key, part in [
        ("approximation", "seeds", "performer"),
        ("approximation", "map_seeds", "maps"),
        ("rank", "seeds", "gaussian"),
        ("rank", "copy.seeds", "copy"),
    ]:
        params = study.load_params(name, quick=True)
        if key.startswith("copy."):
            params["copy"] = {**params["copy"], "seeds": 0}
        else:
            params[key] = 0
        with pytest.raises(ValueError, match=f"{key} must be an int >= 1, got 0"):
            study.load_study(name).configs(params)
        params = study.load_params(name, quick=True)  # the shipped ones run every part
        assert part in {c["part"] for c in study.load_study(name).configs(params)}


def test_load_results_picks_the_device_in_extra_tables_too(toy_studies):
    """Extra tables have no device column: device='cpu' returned a CUDA run's rows too."""
    out = toy_studies / "res" / "tabled"
    study.run_study("tabled", out=out, verbose=False)
    params = study.load_params("tabled")
    to_cuda = {
        study.config_id(c, "cpu"): study.config_id(c, "cuda")
        for c in study.load_study("tabled").configs(params)
    }
    for table, column in (("results", "value"), ("powers", "power")):
        cpu = pd.read_csv(out / f"{table}.csv", dtype={"config_id": str})
        cuda = cpu.assign(config_id=cpu["config_id"].map(to_cuda))
        cuda[column] += 1000
        if "device" in cuda:
            cuda["device"] = "cuda"
        pd.concat([cpu, cuda]).to_csv(out / f"{table}.csv", index=False)
    root = toy_studies / "res"
    powers = study.load_results("tabled", root=root, quick=False, table="powers", device="cpu")
    assert len(powers) == 9 and powers["power"].max() == 27
    with pytest.raises(ValueError, match="devices \\['cpu', 'cuda'\\]: pass device="):
        study.load_results("tabled", root=root, quick=False, table="powers")


def test_another_studys_rows_written_before_the_lock_is_taken_are_refused(toy_studies, monkeypatch):
    """The other-study check ran before the lock only: a run of another study that ended
    in between got this study's rows mixed into its results.csv."""
    import contextlib

    out, real = toy_studies / "out", study.exclusive_folder

    @contextlib.contextmanager
    def late(folder, what, **kwargs):
        if "toy" in what:  # another process's run of 'tabled' ends just before the lock
            study.run_study("tabled", out=out, verbose=False)
        with real(folder, what, **kwargs):
            yield

    monkeypatch.setattr(study, "exclusive_folder", late)
    with pytest.raises(ValueError, match="holds results of study 'tabled', not 'toy'"):
        study.run_study("toy", out=out, verbose=False)
    assert set(pd.read_csv(out / "results.csv")["study"]) == {"tabled"}


def test_load_results_runs_the_study_over_an_empty_results_file(toy_studies, capsys) -> None:
    """An empty results.csv (0 bytes) is no rows to run_study, but load_results returned it
    as a frame without columns, and the notebooks failed on it (KeyError 'part', 'n')."""
    folder = toy_studies / "results" / "toy"
    folder.mkdir(parents=True)
    (folder / "results.csv").write_text("")
    frame = study.load_results("toy", root=toy_studies / "results")
    assert sorted(frame["value"]) == [1.0, 4.0]
    err = capsys.readouterr().err
    assert f"empty {folder / 'results.csv'}: running the quick 'toy' study" in err
    # a progress bar over the configurations: a notebook waited minutes with no sign of it
    assert "toy: 100%" in err and "2/2" in err


def test_a_study_script_interrupted_exits_130_without_a_traceback(
    toy_studies, monkeypatch, capsys
) -> None:
    """`python studies/NAME.py` ended a Ctrl-C with a traceback; `kernelstudy study NAME`
    says that the finished rows are kept and exits 130."""

    def interrupted(name, args):
        raise KeyboardInterrupt

    monkeypatch.setattr(study, "run_from_args", interrupted)
    try:
        code = study.main("toy", ["--quick", "--out", str(toy_studies / "out")])
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped main() (a traceback)")
    assert code == 130
    assert capsys.readouterr().err == study.INTERRUPTED_RESUMABLE + "\n"


def test_provenance_records_the_modules_of_user_maps(monkeypatch):
    """A study over maps of a user's module reproduces only with that module imported."""
    monkeypatch.setenv("KERNELSTUDY_FEATURE_MAPS", "user_maps")
    monkeypatch.delenv("PYTHONPATH", raising=False)  # recorded too when set (test below)
    line = study.provenance("approximation", True, "cpu")
    assert "`KERNELSTUDY_FEATURE_MAPS=user_maps kernelstudy study approximation --quick" in line


def test_rows_of_configurations_the_study_no_longer_has_are_noted(toy_studies, capsys):
    """Rows of a map no longer registered (or an edited config) were left out of the
    summary without a word; they are kept, and the run says so."""
    out = toy_studies / "out"
    study.run_study("toy", quick=True, out=out, verbose=False)
    config = toy_studies / "studies" / "toy.toml"
    config.write_text("[full]\nxs = [1, 3]\n\n[quick]\nxs = [1]\n")  # x=2 is gone
    capsys.readouterr()
    study.run_study("toy", quick=True, out=out, verbose=False)
    err = capsys.readouterr().err
    assert "holds rows of 1 configuration(s) that study 'toy' no longer has" in err
    assert len(pd.read_csv(out / "results.csv")) == 2  # kept
    config.write_text("[full]\nxs = [1, 2]\n\n[quick]\nxs = [1]\n")  # x=2 is the full size's
    study.run_study("toy", quick=True, out=out, verbose=False)
    assert "no longer has" not in capsys.readouterr().err


def test_rank_summary_names_maps_missing_from_the_captured_table():
    """The softmax copy model's q/k run through every map registered when it ran; a map
    registered later never got a row, and the table did not say so."""
    rank = study.load_study("rank")
    root = study.studies_dir() / "results" / "rank"  # the committed full run
    frame = pd.read_csv(root / "results.csv", low_memory=False)
    params = study.load_params("rank", False)
    assert "Not in this table" not in rank.summarize(frame, params)
    without = frame[~((frame["method"] == "softmax") & (frame["captured_with"] == "elu"))]
    assert "Not in this table: elu (registered after" in rank.summarize(without, params)


def test_a_study_run_removes_temporary_files_of_a_killed_run(toy_studies):
    """A run killed while saving a figure left `.squares.png.<hex>.tmp` in the folder for
    good; the next run (holding the folder's lock) removes it."""
    out = toy_studies / "out"
    out.mkdir()
    stale = out / ".squares.png.4a65e785ebd92961.tmp"
    stale.write_bytes(b"half a figure")
    study.run_study("toy", quick=True, out=out, verbose=False)
    assert not stale.exists() and (out / "squares.png").is_file()


def test_load_results_says_when_a_run_covers_part_of_its_configurations(toy_studies, capsys):
    """A folder of an interrupted or --only run was returned as if complete."""
    root = toy_studies / "res"
    study.run_study("toy", quick=False, out=root / "toy", verbose=False, only={"x": 2})
    capsys.readouterr()
    frame = study.load_results("toy", root=root, quick=False)
    assert list(frame["x"]) == [2]
    err = capsys.readouterr().err
    assert "has rows of 1 of the 4 configurations of the full cpu run" in err
    assert "`kernelstudy study toy --device cpu --out" in err
    # read while a run is at work there: its rows so far, not an interrupted run whose
    # command (refused while the run holds the folder) would run the rest
    with exclusive_folder(root / "toy", "a study"):
        study.load_results("toy", root=root, quick=False)
    err = capsys.readouterr().err
    assert "rows of 1 of the 4 configurations of the full cpu run so far: a run is" in err
    assert "interrupted" not in err and "runs the rest" not in err
    study.run_study("toy", quick=False, out=root / "toy", verbose=False)
    capsys.readouterr()
    assert len(study.load_results("toy", root=root, quick=False)) == 4
    assert "note:" not in capsys.readouterr().err


def test_load_results_fills_a_missing_table_without_replacing_the_runs_summary(toy_studies, capsys):
    """A notebook reading an extra table missing beside a full run's results ran the quick
    study into that folder to fill it: the full run's summary.md (and figures) became the
    quick run's, and results.csv got the quick-only configurations' rows. The table is now
    filled alone, for the configurations results.csv holds."""
    toml = toy_studies / "studies" / "tabled.toml"
    toml.write_text("[full]\nxs = [1, 2, 3]\n\n[quick]\nxs = [1, 4]\n")  # 4: quick only
    root = toy_studies / "res"
    out = root / "tabled"
    study.run_study("tabled", quick=False, out=out, verbose=False)
    (out / "powers.csv").unlink()
    kept = {f: (out / f).read_bytes() for f in ("results.csv", "summary.md")}
    assert kept["summary.md"].startswith(b"# tabled (full, cpu)")
    capsys.readouterr()
    powers = study.load_results("tabled", root=root, table="powers")  # quick, as notebooks do
    for name, data in kept.items():
        assert (out / name).read_bytes() == data, f"{name} was rewritten"
    err = capsys.readouterr().err
    assert "filling it for the quick cpu run's configurations" in err
    assert sorted(powers.x.unique()) == [1]  # the quick configuration results.csv has
    # the full run's others are named, with the command that fills them, not computed (a
    # notebook's read would train models): they were left out without a word
    assert "has no rows for 2 of the configurations" in err and "--device cpu --fill-tables" in err
    runs = json.loads((out / "runs.json").read_text())
    line = runs[f"powers/{powers.config_id[0]}"]
    assert "--quick --device cpu --fill-tables" in line  # a command that writes these rows
    assert not list(out.glob(".*.tmp"))
    assert len(study.load_results("tabled", root=root, table="powers")) == 3  # read, not rerun
    # results.csv has no configuration of the quick size: those of the full run are filled
    toml.write_text("[full]\nxs = [1, 2, 3]\n\n[quick]\nxs = [4, 5]\n")
    (out / "powers.csv").unlink()
    powers = study.load_results("tabled", root=root, table="powers")
    assert sorted(powers.x.unique()) == [1, 2, 3]
    for name, data in kept.items():
        assert (out / name).read_bytes() == data, f"{name} was rewritten"
    # rows of no current configuration: nothing to fill, and load_results says so
    toml.write_text("[full]\nxs = [6]\n\n[quick]\nxs = [7]\n")
    (out / "powers.csv").unlink()
    capsys.readouterr()
    with pytest.warns(UserWarning, match="left out"):
        study.load_results("tabled", root=root)
    assert study.load_results("tabled", root=root, table="powers").empty
    assert "no rows in" in capsys.readouterr().err and not (out / "powers.csv").exists()
    with pytest.raises(ValueError, match="tables_only: study 'toy' has no extra tables"):
        study.run_study("toy", out=toy_studies / "toy", tables_only=True)


def test_a_table_lacking_rows_is_named_once_with_the_command_of_its_run(toy_studies, capsys):
    """A configuration both sizes have was named under both runs: beside a quick-only run
    the note also gave the full run's command (the whole full study); with --config, the
    command left the file out."""
    toml = toy_studies / "studies" / "tabled.toml"
    toml.write_text("[full]\nxs = [1, 2, 3]\n\n[quick]\nxs = [1, 4]\n")  # 1: both sizes
    root = toy_studies / "res"
    out = root / "tabled"
    study.run_study("tabled", quick=True, out=out, verbose=False)
    powers = pd.read_csv(out / "powers.csv")
    powers[powers.x != 1].to_csv(out / "powers.csv", index=False)  # a fill cut short
    capsys.readouterr()
    study.load_results("tabled", root=root, table="powers")
    notes = [x for x in capsys.readouterr().err.splitlines() if x.startswith("note:")]
    assert len(notes) == 1 and "has no rows for 1 of the configurations" in notes[0]
    assert "of the quick cpu run: `kernelstudy study tabled --quick --device cpu" in notes[0]
    mine = toy_studies / "mine.toml"
    mine.write_text("[full]\nxs = [1, 2, 3]\n\n[quick]\nxs = [1, 4]\n")
    study.load_results("tabled", root=root, table="powers", config_file=mine)
    assert f"--config {mine}" in capsys.readouterr().err


def test_rank_spectra_filled_beside_a_full_run_keep_its_summary(rank_toy, one_thread):
    """The rank notebook's load("rank", table="spectra") over full results without
    spectra.csv rewrote their summary.md at the quick size (and its figures)."""
    out = rank_toy
    study.run_study("rank", quick=False, out=out, verbose=False)
    (out / "spectra.csv").unlink()
    files = ["results.csv", "summary.md", *(p.name for p in out.glob("*.png"))]
    kept = {f: (out / f).read_bytes() for f in files}
    spectra = study.load_results("rank", root=out.parent, table="spectra")
    assert list(spectra.columns) == SPECTRA_COLUMNS and set(spectra.part) == {"gaussian", "copy"}
    for name, data in kept.items():
        assert (out / name).read_bytes() == data, f"{name} was rewritten"
    assert sorted(p.name for p in out.glob("*.png")) == sorted(f for f in files if ".png" in f)


@pytest.mark.parametrize(
    ("name", "key", "value", "why"),
    [
        ("generation", "lengths", [64, 512, 128], "128 comes after the larger 512"),
        ("generation", "lengths", [64, 128, 128], "128 repeats"),
        ("generation", "lengths", [0, 64], r"not a positive int: \[0\]"),
        ("speed", "seq_lens", [1024, 256, 4096], "256 comes after the larger 1024"),
        ("speed", "seq_lens_cuda", [1024, 4096, 4096], "4096 repeats"),
        ("speed", "seq_lens", [256, 512.0], r"not a positive int: \[512.0\]"),
        ("speed", "seq_lens", [], r"\[\]"),
        ("rank", "seq_lens", [64, -128], r"not a positive int: \[-128\]"),
    ],
)
def test_sequence_lengths_must_ascend(tmp_path, monkeypatch, capsys, name, key, value, why):
    """The time-limit skip assumes ascending lengths (once one runs past the limit, the
    longer ones are skipped): [64, 512, 128] skipped 128 after a slow 512, as too slow."""
    params = {**study.load_params(name, quick=True), key: value}
    expected = f"{key} must be a non-empty list of positive ints in strictly ascending order"
    with pytest.raises(ValueError, match=f"{expected}, got .*{why}"):
        study.load_study(name).configs(params)
    # a run refuses the config before computing anything, and the script says so
    monkeypatch.setattr(study, "load_params", lambda *args, **kwargs: params)
    out = tmp_path / "out"
    assert study.main(name, ["--quick", "--out", str(out)]) == 1
    assert expected in capsys.readouterr().err
    assert not (out / "results.csv").exists()


@pytest.mark.parametrize(
    ("name", "key", "value", "expected"),
    [
        ("approximation", "head_dims", [], "a non-empty list of ints >= 1"),  # IndexError
        ("approximation", "map_stds", "1.0", "a non-empty list of finite numbers > 0"),
        ("approximation", "seq_len", "abc", "an int >= 1"),
        ("approximation", "fit_lr", 0, "a finite number > 0"),
        ("rank", "copy.steps", -1, "an int >= 1"),  # failed after the Gaussian part ran
        ("rank", "feature_dims", [8, True], "a non-empty list of ints >= 1"),
        ("speed", "performer.methods", ["linear", "flash"], "'softmax_sdpa', "),
        ("speed", "rnn_benchmark.causal", [True, True], "true and false, each at most once"),
        ("speed", "warmup", -1, "an int >= 0"),
        ("generation", "n_heads", 0, "an int >= 1"),
        ("generation", "time_limit_s", math.inf, "a finite number > 0"),
    ],
)
def test_a_mistyped_config_entry_fails_before_any_run(
    tmp_path, monkeypatch, capsys, name, key, value, expected
):
    """Most plain entries were checked only by the run that used them: a string list was
    looped over as characters ("1.0" gave the stds '1', '.', '0'), head_dims = [] raised
    IndexError, and rank's copy.steps = -1 failed after the Gaussian part had run."""
    params = copy.deepcopy(study.load_params(name, quick=True))
    table, _, leaf = key.rpartition(".")
    (params[table] if table else params)[leaf] = value
    message = f"{re.escape(key)} must be .*{re.escape(expected)}"
    with pytest.raises(ValueError, match=message):
        study.load_study(name).configs(params)
    monkeypatch.setattr(study, "load_params", lambda *args, **kwargs: params)
    out = tmp_path / "out"
    assert study.main(name, ["--quick", "--out", str(out)]) == 1
    assert f"{key} must be" in capsys.readouterr().err
    assert not out.exists()


def test_check_params_names_a_missing_entry_and_an_unknown_kind():
    with pytest.raises(ValueError, match="config entry copy.steps is missing"):
        study.check_params({"copy": {}}, {"copy.steps": "count"})
    with pytest.raises(ValueError, match="kind 'int' of n is not one of"):
        study.check_params({"n": 1}, {"n": "int"})
    study.check_params({"n": np.int64(2), "s": [0.5, 2]}, {"n": "count", "s": "positives"})


def test_committed_results_are_rows_of_the_current_configurations():
    """The checks of the configs change no configuration: every committed row's config_id is
    still one of the study's (else load_results leaves the rows out)."""
    for name in ("approximation", "generation", "rank", "speed"):
        path = study.studies_dir() / "results" / name / "results.csv"
        held = set(pd.read_csv(path, dtype={"config_id": str}, low_memory=False).config_id)
        known = set().union(*study._known_ids(name, study.load_study(name)).values())
        assert held <= known, f"{name}: {len(held - known)} configurations changed"


def test_rank_summary_checks_the_bound_on_every_matrix_not_on_means():
    """ "Kernel rank ≤ F holds in every row" was checked on the means over seeds: a matrix of
    rank 9 under F = 8 beside one of rank 7 averaged to 8 and read "yes"."""
    rank = study.load_study("rank")
    params = {**study.load_params("rank", quick=True), "fixed_n": 16, "seeds": 2}

    def frame(ranks):
        rows = [
            {"part": "gaussian", "method": m, "feature_dim": f, "n": 16, "seed": seed}
            | {"metric": metric, "value": float(r if metric == "numerical_rank" else 4)}
            for m, f, by_seed in (("softmax", 0, (16, 16)), ("elu", 8, ranks))
            for seed, r in enumerate(by_seed)
            for metric in rank.MEASURES
        ]
        return pd.DataFrame(rows)

    holds = "Kernel rank ≤ F holds in every row: "
    assert holds + "yes" in rank.summarize(frame((8, 7)), params)
    assert holds + "**no**" in rank.summarize(frame((9, 7)), params)


def test_only_with_one_key_twice_is_refused(toy_studies, capsys):
    """`--only x=1 --only x=2` ran x=2 alone (the last value won, without a word)."""
    out = toy_studies / "out"
    assert study.main("toy", ["--out", str(out), "--only", "x=1", "--only", "x=2"]) == 1
    assert "--only x= given twice ('1', '2')" in capsys.readouterr().err
    assert not (out / "results.csv").exists()
    assert study.parse_only(["x=1", "x=1"]) == {"x": "1"}  # the same value twice is harmless
    # an unknown key lists the known ones (rank's maps are under "method", not "map")
    assert study.main("toy", ["--out", str(out), "--only", "y=1"]) == 1
    assert "only: no configuration of study 'toy' has an entry 'y' (their entries: x)" in (
        capsys.readouterr().err
    )


def test_load_results_runs_a_missing_study_on_the_device_asked_for(toy_studies, monkeypatch):
    """load_results(device="cuda") over a missing results.csv ran the study on the CPU, then
    left every row out as not CUDA's: an empty frame, and a CPU run written in its place."""
    devices = []
    real = study.run_study

    def run_study(*args, **kwargs):
        devices.append(kwargs.get("device", "cpu"))
        return real(*args, **{**kwargs, "device": "cpu"})  # as if on CUDA (none here)

    monkeypatch.setattr(study, "run_study", run_study)
    study.load_results("toy", root=toy_studies / "res", device="cuda")
    assert devices == ["cuda"]


def test_rank_summary_counts_the_seeds_its_means_are_over():
    """The summary said "mean over {seeds} seeds" from the config, also for a partial run
    (interrupted, or --only seed=0) whose means are over fewer."""
    rank = study.load_study("rank")
    rows = pd.DataFrame(
        [
            {"part": "gaussian", "method": m, "feature_dim": 8, "n": 16, "seed": seed}
            | {"metric": metric, "value": 4.0}
            for m, seeds in (("elu", (0, 1)), ("favor", (0,)))
            for seed in seeds
            for metric in rank.MEASURES
        ]
    )
    params = {**study.load_params("rank", quick=True), "fixed_n": 16, "seeds": 2}
    assert "mean over 1–2 (of 2 configured: a partial run) seeds" in rank.summarize(rows, params)
    full = rows[rows["method"] == "elu"]
    assert "mean over 2 seeds." in rank.summarize(full, params)
    assert rank.seed_count(full, 3) == "2 (of 3 configured: a partial run)"


def _paired_frame(log_ratios: np.ndarray, metric: str = "attention_mse") -> pd.DataFrame:
    """Performer rows at R = 16, 64, 256 whose per-seed log(orth/iid) are ``log_ratios``."""
    rows = []
    for r in (16, 64, 256):
        for seed, d in enumerate(log_ratios):
            for orth, value in ((False, 1.0 / r), (True, float(np.exp(d)) / r)):
                rows.append(
                    {"part": "performer", "metric": metric, "method": "favor", "map": "favor",
                     "head_dim": 8, "std": 0.5, "num_features": r, "orthogonal": orth,
                     "seed": seed, "value": value}
                )  # fmt: skip
    return pd.DataFrame(rows)


def test_performer_verdict_counts_r_by_simultaneous_intervals():
    """Each R's own ~95% interval decided "lower"/"higher": over 7 R × 12 settings about 4
    calls come by chance. A paired ratio 2.3 standard errors below 1 at each of 3 R reads
    "lower" per R, but not when the 3 intervals must hold together (Bonferroni: 2.5 SE)."""
    module = study.load_study("approximation")
    e = np.random.default_rng(0).standard_normal(40)
    e = (e - e.mean()) / e.std(ddof=1)  # mean 0, sd 1 exactly
    frame = _paired_frame(-2.3 / np.sqrt(40) + e)
    table = module.performer_table(frame)
    assert (table["log_ratio_hi"] < 0).all()  # each R's own interval excludes 1
    row = module.performer_verdict(frame).iloc[0]
    assert row["orthogonal vs iid, per R"] == "3 not resolved (of 3)", row
    clear = module.performer_verdict(_paired_frame(-4 / np.sqrt(40) + e)).iloc[0]
    assert clear["orthogonal vs iid, per R"] == "3 lower (of 3)", clear


def test_performer_verdict_has_no_verdict_where_a_kind_has_no_rows():
    """A partial run (--only orthogonal=True) read "MSE falls with R: not resolved (iid)" and
    "7 not resolved (of 7)" for comparisons without a single iid row (NaN bounds)."""
    module = study.load_study("approximation")
    e = np.random.default_rng(0).standard_normal(8)
    frame = _paired_frame(-1.0 + 0.1 * e)
    row = module.performer_verdict(frame[frame["orthogonal"]]).iloc[0]
    assert (row["slope, iid"], row["MSE falls with R"]) == ("–", "– (iid), yes (orthogonal)")
    assert row["orthogonal vs iid, per R"] == "3 undefined (of 3)"
    assert row["orth/iid range"] == "–"
    one_r = module.performer_verdict(frame[frame["num_features"] == 64]).iloc[0]
    assert (one_r["slope, iid"], one_r["MSE falls with R"]) == ("–", "–")  # one R: no slope
    assert one_r["orthogonal vs iid, per R"] == "1 lower (of 1)"


def test_approximation_summary_gives_the_verdict_on_the_kernel_mse():
    """The Performer's 1/R rate and orthogonal-vs-iid theorem are about the kernel MSE; the
    summary's verdict was on the attention MSE only (the kernel MSE had a table, no test)."""
    module = study.load_study("approximation")
    e = np.random.default_rng(0).standard_normal(40)
    frame = pd.concat([_paired_frame(0.1 * e), _paired_frame(-0.5 + 0.1 * e, metric="kernel_mse")])
    params = study.load_params("approximation", quick=True)
    summary = module.summarize(frame, params)
    kernel = summary.split("## The Performer finding on the kernel MSE", 1)[1].split("\n## ")[0]
    assert "| 3 lower (of 3)" in kernel
    attention = summary.split("## The Performer finding (attention-matrix MSE)")[1]
    assert "| 3 not resolved (of 3)" in attention.split("\n## ")[0]


def test_maps_beat_uniform_only_where_the_paired_seeds_agree():
    """ "beats uniform (KL)" compared the mean KL over 3 seeds with uniform's, with no
    interval: a map below uniform on one seed and above it on two read "yes"."""
    rows = [
        {"part": "maps", "std": 1.0, "method": m, "stage": st, "feature_dim": f,
         "metric": metric, "value": v, "seed": seed}
        for m, st, f, kls in [
            ("uniform", "baseline", np.nan, (0.5, 0.5, 0.5)),
            ("elu", "fixed", 8, (0.1, 0.55, 0.55)),  # mean 0.40 < 0.5
            ("relu", "fixed", 8, (0.40, 0.41, 0.39)),
        ]
        for seed, kl in enumerate(kls)
        for metric, v in (("attention_kl", kl), ("attention_mse", 1.0), ("output_rel_error", 1.0))
    ]  # fmt: skip
    table = study.load_study("approximation").maps_table(pd.DataFrame(rows))
    verdicts = dict(zip(table["method"], table["beats uniform (KL)"], strict=True))
    assert verdicts == {"uniform": "–", "elu": "not resolved", "relu": "yes"}


def test_rank_copy_table_shows_each_seeds_final_accuracy():
    """The copy table gave means over 3 seeds only (FAVOR+ 54 %, hedgehog 62 %), which hid
    seeds at 26 %–83 % and 30 %–95 %: an ordering of the maps the seeds do not support."""
    rank = study.load_study("rank")
    rows = pd.DataFrame(
        [
            {"part": "copy", "method": m, "seed": seed, "step": step, "metric": "val_accuracy",
             "value": acc * step / 400}
            for m, accs in (("favor", (0.26, 0.54, 0.83)), ("elu", (0.72, 0.73, 0.85)))
            for seed, acc in enumerate(accs)
            for step in (100, 200, 300, 400)
        ]
    )  # fmt: skip
    table = rank.copy_table(rows).set_index("method")
    assert table.loc["favor", "step 400, per seed"] == "0.26, 0.54, 0.83"
    assert table.loc["elu", "step 400"] == pytest.approx(0.7667, abs=1e-3)


def test_rank_captured_table_pairs_ranks_with_the_accuracy_of_the_weights_measured():
    """The copy models' ranks are measured on the weights of each run's best validation step
    (restore_best), but nothing said so: beside the copy table's last-step accuracies they
    read as the last step's (hedgehog seed 0: ranks of a model at 69.7 %, shown beside
    21.6 %). The table gives the measured weights' accuracy and steps; rows of older runs,
    without the step, show "–"."""
    rank = study.load_study("rank")
    curves = [
        {"part": "copy", "method": m, "seed": seed, "step": step, "metric": "val_accuracy",
         "value": step / 1000 + seed / 10}
        for m in ("favor", "elu")
        for seed in (0, 1)
        for step in (100, 200, 300, 400)
    ]  # fmt: skip
    ranks = [
        {"part": "copy", "method": m, "seed": seed, "step": step, "metric": measure,
         "captured_with": m, "feature_dim": 16, "value": 3.0 + seed}
        for m, steps in (("favor", (200, 400)), ("elu", (None, None)))
        for seed, step in enumerate(steps)
        for measure in rank.MEASURES
    ]  # fmt: skip
    table = rank.captured_table(pd.DataFrame(curves + ranks)).set_index("trained model")
    assert table.loc["favor", "val accuracy"] == pytest.approx((0.2 + 0.5) / 2)
    assert table.loc["favor", "at step"] == "200, 400"
    assert table.loc["favor", "effective_rank"] == pytest.approx(3.5)
    assert table.loc["elu", "at step"] == "–" and pd.isna(table.loc["elu", "val accuracy"])


def test_speed_summary_fits_the_growth_with_n():
    """The study tests "linear attention is O(N)" but its summary gave times per N only:
    the exponent, the claim's quantity, was left to the reader."""
    speed = study.load_study("speed")
    rows = [
        {"setting": "rnn_benchmark", "method": m, "backend": b, "causal": True, "pass": "fwd",
         "n": n, "metric": metric, "value": c * n**k}
        for m, b, k in (("linear", "torch", 1.0), ("softmax_sdpa", None, 2.0))
        for n in (256, 512, 1024, 2048)
        for metric, c in (("time_ms", 1e-3), ("peak_memory_mb", 1e-2))
    ] + [{"setting": "rnn_benchmark", "method": "matmul", "backend": None, "causal": False,
          "pass": "fwd", "n": 0, "metric": "gflops", "value": 100.0}]  # fmt: skip
    table = speed.exponent_table(pd.DataFrame(rows)).set_index("label")
    assert table.loc["linear [torch]", "k"] == pytest.approx(1.0)
    assert table.loc["softmax_sdpa", "k"] == pytest.approx(2.0)
    assert table.loc["linear [torch]", "N"] == "512–2048"
    summary = speed.summarize(pd.DataFrame(rows), study.load_params("speed", quick=True))
    assert "time ∝ N^k" in summary


def test_generation_summary_flags_a_kv_cache_slower_than_its_quadratic_work():
    """KV-cache generation took 6.3× longer at 4096 tokens than at 2048, beyond the 4× its
    O(L²) work allows (then the cache was grown by torch.cat, copying it every step); the
    summary read the 11.5× speed-up against it as attention's alone. The cause it names is
    the memory traffic of today's cache (a buffer that doubles), not per-step copies."""
    gen = study.load_study("generation")
    rows = [
        {"run": run, "length": n, "metric": "time_s", "value": t}
        for run, times in (
            ("linear, RNN state", (1.0, 2.0, 4.0)),
            ("softmax, KV cache", (1.0, 3.5, 22.0)),
        )
        for n, t in zip((1024, 2048, 4096), times, strict=True)
    ]
    rows += [{**r, "metric": "tokens_per_s", "value": 8 * r["length"] / r["value"]} for r in rows]
    frame = pd.DataFrame(rows)
    assert gen.superquadratic_growth(frame) == ["2048→4096: 6.3× (≤ 4× for O(L²))"]
    summary = gen.summarize(frame, study.load_params("generation"))
    assert "faster than its O(length²) work allows at 2048→4096" in summary
    assert "concatenation" not in summary and "copied when it doubles" in summary
    quadratic = frame[~((frame.length == 4096) & (frame.run == "softmax, KV cache"))]
    assert "O(length²) work allows" not in gen.summarize(quadratic, study.load_params("generation"))
    # the committed summary's 0.997 and 1.06 came from runs of separate invocations: it says
    # how each throughput was measured and that the ratio spans invocations
    assert "median time of 3 generations in one invocation" in summary
    assert "speed-up near 1 also holds the machine's drift" in summary


def test_approximation_kernel_table_gives_the_ratio_of_mean_mses():
    """The Performer's theorem bounds the expected MSE, so its ratio orth/iid (mean over
    mean, seeds resampled in pairs) sits beside the geometric mean of the paired ratios; the
    two part where one seed's MSE dwarfs the others (heavy tails)."""
    approximation = study.load_study("approximation")
    rows = [
        {"part": "performer", "metric": "kernel_mse", "map": "favor", "head_dim": 4, "std": 1,
         "num_features": 8, "method": "favor", "orthogonal": orth, "seed": seed,
         "value": (2.0 if orth else 4.0) * (1000.0 if (seed, orth) == (0, True) else 1.0)}
        for seed in range(10)
        for orth in (False, True)
    ]  # fmt: skip
    frame = pd.DataFrame(rows)
    table = approximation.performer_table(frame, "kernel_mse")
    ratio, interval = table["ratio of means"].iloc[0].split(" ", 1)
    assert float(ratio) == pytest.approx((2000 + 9 * 2) / 40, rel=1e-3)  # mean / mean
    assert math.exp(table["log_ratio"].iloc[0]) == pytest.approx(1000**0.1 / 2, rel=1e-6)
    lo, hi = (float(x) for x in interval.strip("[]").split(", "))
    assert lo < float(ratio) < hi
    assert (
        table["ratio of means"].iloc[0]
        == approximation.performer_table(frame, "kernel_mse")["ratio of means"].iloc[0]
    )  # a fixed generator: the same text every time


# A feature map given as a table (the config dict ks.create_feature_map takes) in the
# generation and speed studies: one label per map in configs, CSV, --only and summaries.

FAVOR_TABLE = {"name": "favor", "num_features": 16, "orthogonal": False}
FAVOR_LABEL = "favor(num_features=16, orthogonal=False)"


def test_a_feature_map_table_has_one_label_that_round_trips():
    """However a table is ordered or its numbers typed, one map has one label, and the label
    gives the map back (a dict in a CSV column must compare and parse)."""
    reordered = {"orthogonal": False, "num_features": 16, "name": "favor"}
    assert study.map_label(FAVOR_TABLE) == study.map_label(reordered) == FAVOR_LABEL
    assert study.parse_map_label(FAVOR_LABEL) == FAVOR_TABLE
    assert list(study.check_map_spec("feature_map", reordered)) == list(FAVOR_TABLE)
    # an int for a float hyperparameter is the float it stands for
    one = study.map_label({"name": "softplus_ffn", "reg_weight": 0})
    assert one == study.map_label({"name": "softplus_ffn", "reg_weight": 0.0})
    assert one == "softplus_ffn(reg_weight=0.0)"
    for spec in (
        {"name": "glu", "depth": 2, "seed": 3},
        {"name": "favor", "row_norms": "sqrt_d", "num_features": 8},
        {"name": "kernelstudy.feature_maps.glu:GLUFeatureMap", "depth": 3},  # a map of one's own
    ):
        label = study.map_label(spec)
        parsed = study.parse_map_label(label)
        assert study.check_map_spec("x", parsed) == study.check_map_spec("x", spec)
        assert study.map_label(parsed) == label
    # a name, and a table of a name alone, are the name (the ids of string maps stay)
    assert study.map_label("elu") == study.map_label({"name": "elu"}) == "elu"
    assert study.parse_map_label("elu") == "elu"
    for bad in ("favor(16)", "favor(num_features=16", "favor(name='elu')", "(depth=2)"):
        with pytest.raises(ValueError, match="expected a feature-map label"):
            study.parse_map_label(bad)


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        ({"name": "favour"}, ValueError, r"feature_map\.name: unknown name\(s\) \['favour'\]"),
        (
            {"name": "favor", "nm_features": 8},
            ValueError,
            r"feature_map: feature map 'favor' has no hyperparameter\(s\) \['nm_features'\]; "
            "it takes: .*num_features",
        ),
        (
            {"name": "favor", "num_features": 0},
            ValueError,
            r"feature_map\.num_features must be >= 1",
        ),
        ({"name": "favor", "orthogonal": "no"}, TypeError, r"feature_map\.orthogonal must be bool"),
        ({"name": "glu", "head_dim": 8}, ValueError, "feature_map: the table may not set head_dim"),
        ({"num_features": 8}, ValueError, "feature_map: a feature-map table needs a 'name'"),
        ({"name": 3}, TypeError, r"feature_map\.name must be a feature-map name \(a str\)"),
        (["favor"], TypeError, "feature_map must be a feature-map name or a table such as"),
        # each value is valid, but not together at the head dimension: refused when built
        ({"name": "aoglu", "rank": 1000}, ValueError, "feature_map: rank must be <= head_dim="),
    ],
)
@pytest.mark.parametrize("name", ["generation", "speed"])
def test_a_bad_feature_map_table_is_refused_before_any_run(
    tmp_path, monkeypatch, capsys, name, spec, error, message
):
    params = study.load_params(name, quick=True)
    if name == "speed":  # the setting's map, without the setting's own F beside it
        params["performer"] = {**params["performer"], "feature_map": spec, "num_features": 0}
        message = message.replace("feature_map", "performer.feature_map", 1)
    else:
        params["feature_map"] = spec
    with pytest.raises(error, match=message):
        study.load_study(name).configs(params)
    monkeypatch.setattr(study, "load_params", lambda *args, **kwargs: params)
    out = tmp_path / "out"
    assert study.main(name, ["--quick", "--out", str(out)]) == 1
    assert "feature_map" in capsys.readouterr().err
    assert not (out / "results.csv").exists()


def test_speed_num_features_beside_a_map_table():
    """The setting's num_features is the F the map is matched to; a table that sets the map's
    size itself is refused beside it (which one would win?); one that does not keeps its
    other hyperparameters."""
    speed = study.load_study("speed")
    params = study.load_params("speed", quick=True)
    params["performer"] = {**params["performer"], "feature_map": FAVOR_TABLE}  # R = 100 too
    with pytest.raises(
        ValueError,
        match="performer: num_features = 100 and feature_map's num_features = 16 both set the "
        r"map's size; give one \(num_features = 0 in \[performer\], or no num_features",
    ):
        speed.configs(params)
    params["performer"]["num_features"] = -1
    with pytest.raises(ValueError, match=r"performer\.num_features must be an int >= 0"):
        speed.configs(params)
    params["performer"]["num_features"] = 0
    table = [c for c in speed.configs(params) if c["setting"] == "performer"]
    assert {c["feature_map"] for c in table} == {FAVOR_LABEL}
    fm = speed.feature_map(table[0])
    assert fm == FAVOR_TABLE  # built by benchmark_attention, as a name is
    params["performer"].update(feature_map={"name": "favor", "orthogonal": False}, num_features=24)
    matched = [c for c in speed.configs(params) if c["setting"] == "performer"][0]
    fm = speed.feature_map(matched)
    assert fm.feature_dim == 24 and fm.hparams["orthogonal"] is False
    assert matched["feature_map"] == "favor(orthogonal=False)"
    for spec in ("elu", {"name": "elu"}):  # elu's F is D: "R=24" would be shown, not used
        params["performer"].update(feature_map=spec, num_features=24)
        with pytest.raises(ValueError, match="feature map 'elu' has no size hyperparameter"):
            speed.configs(params)


SPEED_TOY_TOML = """
repeats = 1
warmup = 0
time_limit_s = 60.0
max_quadratic_gb = 1.0

[rnn_benchmark]
batch = 1
heads = 2
head_dim = 8
feature_map = "elu"
methods = ["linear"]
causal = [false]
passes = ["fwd"]

[performer]
batch = 1
heads = 1
head_dim = 8
feature_map = { name = "favor", orthogonal = false, num_features = 16 }
methods = ["linear"]
causal = [false]
passes = ["fwd"]

[full]
seq_lens = [16, 32, 64]
seq_lens_cuda = [16, 32, 64]

[quick]
seq_lens = [16, 32]
seq_lens_cuda = [16, 32]
"""


def test_speed_study_runs_a_map_table(tmp_path, monkeypatch, one_thread, capsys):
    _toy_copy(tmp_path, monkeypatch, "speed", SPEED_TOY_TOML)
    out = tmp_path / "speed"
    # --only takes the label as the CSV column shows it
    summary = _partial("speed", out, f"feature_map={FAVOR_LABEL}")
    rows = pd.read_csv(out / "results.csv")
    assert set(rows.setting) == {"performer"} and set(rows.feature_map) == {FAVOR_LABEL}
    assert study.parse_map_label(rows.feature_map.iloc[0]) == FAVOR_TABLE
    assert set(rows[rows.method == "linear"].feature_dim) == {16}  # the table's R
    assert f"## performer: B=1, H=1, D=8, map={FAVOR_LABEL}; matmul" in summary
    summary = _partial("speed", out, "feature_map=elu")  # a name, as before
    rows = pd.read_csv(out / "results.csv")
    assert dict(zip(rows.setting, rows.feature_map, strict=False)) == {
        "rnn_benchmark": "elu",
        "performer": FAVOR_LABEL,
    }
    assert "## rnn_benchmark: B=1, H=2, D=8, map=elu; matmul" in summary
    speed = study.load_study("speed")
    figures = speed.figures(
        study.load_results("speed", root=tmp_path), study.load_params("speed", True)
    )
    assert (
        figures["performer_time"]._suptitle.get_text()
        == f"performer: B=1, H=1, D=8, map={FAVOR_LABEL}"
    )
    for fig in figures.values():
        ks.analysis.plots.close(fig)


def test_generation_study_runs_a_map_table(tmp_path, monkeypatch, one_thread, capsys):
    toml = GENERATION_TOY_TOML.replace(
        'feature_map = "elu"',
        'feature_map = { num_features = 16, name = "favor", orthogonal = false }',
    )
    _toy_copy(tmp_path, monkeypatch, "generation", toml)
    out = tmp_path / "out"
    summary = _partial("generation", out, "run=linear, RNN state", f"feature_map={FAVOR_LABEL}")
    assert f"vocab 16, map {FAVOR_LABEL}; batch 2" in summary
    rows = pd.read_csv(out / "results.csv")
    assert set(rows.feature_map) == {FAVOR_LABEL} and set(rows.run) == {"linear, RNN state"}
    # the linear run's RNN state holds F = 16 features per head, not elu's F = D = 8
    gen = study.load_study("generation")
    params = study.load_params("generation", quick=True)
    config = gen.configs({**params, "feature_map": "elu"})[0]
    assert config["run"] == "linear, RNN state"
    elu = pd.DataFrame(gen.run_config(config, "cpu"))
    state = rows[rows.metric == "state_mb"].value.to_numpy()
    assert (state > elu[elu.metric == "state_mb"].value.to_numpy()).all()
    figures = gen.figures(rows, params)
    assert figures["generation_tokens_per_s"]._suptitle.get_text() == (
        f"feature map of the linear run: {FAVOR_LABEL}"
    )
    for fig in figures.values():
        ks.analysis.plots.close(fig)


def _maps_as_tables(name: str, params: dict) -> None:
    """``params`` of study ``name`` with every map it names given as a table of that name."""
    if name == "speed":
        for setting in study.load_study(name).SETTINGS:
            params[setting] = {
                **params[setting],
                "feature_map": {"name": params[setting]["feature_map"]},
            }
    elif name == "generation":
        params["feature_map"] = {"name": params["feature_map"]}
    elif name == "approximation":
        params["performer_maps"] = [{"name": m} for m in params["performer_maps"]]
    else:
        models = params["copy"]["models"]
        params["copy"] = {
            **params["copy"],
            "models": [m if m == "softmax" else {"name": m} for m in models],
        }


@pytest.mark.parametrize("name", ["generation", "speed", "approximation", "rank"])
def test_map_names_keep_their_config_ids(name):
    """A map given by name is in its configurations as before (the committed rows keep their
    ids), and a table of a name alone is that name: same configurations, same ids."""
    module = study.load_study(name)
    path = study.studies_dir() / "results" / name / "results.csv"
    held = set(pd.read_csv(path, dtype={"config_id": str}, low_memory=False).config_id)
    params = study.load_params(name, quick=False)
    ids = {study.config_id(c, "cpu") for c in module.configs(params)}
    assert ids == held  # the committed full CPU run: every configuration, same ids
    _maps_as_tables(name, params)
    assert {study.config_id(c, "cpu") for c in module.configs(params)} == held


# approximation and rank: configured maps (tables, "module:Class") beside the registered ones.

APPROXIMATION_TOY_TOML = """
seq_len = 16
value_dim = 8
fit_lr = 0.01
extra_maps = [{ orthogonal = false, name = "favor" }, { name = "glu", depth = 2 }]
# the same sizes for the quick and the full run
performer_maps = ["favor", { name = "favor", row_norms = "sqrt_d" }]
head_dims = [8]
stds = [0.5]
num_features = [8, 16]
seeds = 2
map_stds = [1.0]
map_feature_dim = 16
map_seeds = 2
fit_steps = 2
fit_batch = 2
exclude_maps = ["identity"]
"""

GLU_LABEL = "glu(depth=2)"
IID_FAVOR_LABEL = "favor(orthogonal=False)"


def _quick_config(name: str, **entries) -> dict:
    """The first quick configuration of study ``name`` with these entries."""
    configs = study.load_study(name).configs(study.load_params(name, quick=True))
    return next(c for c in configs if all(c.get(k) == v for k, v in entries.items()))


def test_extra_maps_join_the_parts_that_compare_every_registered_map():
    """extra_maps adds configured maps (by label) to approximation's maps part and rank's
    Gaussian part, matched to the part's F like the registered maps; without it (or empty)
    every configuration is the one it was."""
    extra = [{"orthogonal": False, "name": "favor"}, {"name": "glu", "depth": 2}]
    user = "kernelstudy.feature_maps.glu:GLUFeatureMap"  # a map "of one's own", by name
    approximation = study.load_study("approximation")
    params = study.load_params("approximation", quick=True)
    before = approximation.configs(params)
    assert approximation.configs({**params, "extra_maps": []}) == before
    added = approximation.configs({**params, "extra_maps": [*extra, user]})
    assert [c for c in added if c in before] == before  # the registered maps' as they were
    new = [c for c in added if c not in before]
    assert {c["map"] for c in new} == {IID_FAVOR_LABEL, GLU_LABEL, user}
    assert {c["part"] for c in new} == {"maps"}
    assert len(new) == 3 * len(params["map_stds"]) * params["map_seeds"]
    assert {c["target_feature_dim"] for c in new} == {params["map_feature_dim"]}

    rank = study.load_study("rank")
    params = study.load_params("rank", quick=True)
    before = rank.configs(params)
    assert rank.configs({**params, "extra_maps": []}) == before
    added = rank.configs({**params, "extra_maps": extra})
    assert [c for c in added if c in before] == before
    new = [c for c in added if c not in before]
    assert {c["part"] for c in new} == {"gaussian"}
    # favor is matched to each F of the sweep (and D in the N sweep); glu keeps F = D
    f_of = lambda label: {c["feature_dim"] for c in new if c["method"] == label}  # noqa: E731
    assert f_of(IID_FAVOR_LABEL) == {params["head_dim"], *params["feature_dims"]}
    assert f_of(GLU_LABEL) == {params["head_dim"]}
    plain = {(c["feature_dim"], c["n"]) for c in before if c.get("method") == "favor"}
    assert {(c["feature_dim"], c["n"]) for c in new if c["method"] == IID_FAVOR_LABEL} == plain


@pytest.mark.parametrize(
    ("extra", "error", "message"),
    [
        (  # the size is the study's: matched to the part's F
            [{"name": "favor", "num_features": 8}],
            ValueError,
            r"extra_maps\[0\]: the table may not set num_features: it is favor's size "
            "hyperparameter",
        ),
        ([{"name": "glu", "seed": 3}], ValueError, r"extra_maps\[0\]: the table may not set seed"),
        (  # a registered map is there already (or excluded on purpose)
            ["elu"],
            ValueError,
            r"extra_maps\[0\]: 'elu' is a registered map, which the .* has unless exclude_maps",
        ),
        ([{"name": "favor"}], ValueError, r"extra_maps\[0\]: 'favor' is a registered map"),
        (
            [{"name": "glu", "depth": 2}, {"depth": 2, "name": "glu"}],
            ValueError,
            r"extra_maps\[1\]: 'glu\(depth=2\)' is given twice \(also extra_maps\[0\]\)",
        ),
        ([{"name": "glu", "dpth": 2}], ValueError, r"extra_maps\[0\]: feature map 'glu' has no"),
        ([{"name": "glu", "depth": "2"}], TypeError, r"extra_maps\[0\]\.depth must be"),
        (["favour"], ValueError, r"extra_maps: unknown name\(s\) \['favour'\]"),
        ({"name": "glu", "depth": 2}, TypeError, "extra_maps must be a list of feature maps"),
        # valid values, not together at the head dimension: refused when built
        (
            [{"name": "aoglu", "rank": 1000}],
            ValueError,
            r"extra_maps\[0\]: rank must be <= head_dim",
        ),
    ],
)
@pytest.mark.parametrize("name", ["approximation", "rank"])
def test_a_bad_extra_map_is_refused_before_any_run(
    tmp_path, monkeypatch, capsys, name, extra, error, message
):
    params = {**study.load_params(name, quick=True), "extra_maps": extra}
    with pytest.raises(error, match=message):
        study.load_study(name).configs(params)
    monkeypatch.setattr(study, "load_params", lambda *args, **kwargs: params)
    out = tmp_path / "out"
    assert study.main(name, ["--quick", "--out", str(out)]) == 1
    assert "extra_maps" in capsys.readouterr().err
    assert not (out / "results.csv").exists()


@pytest.mark.parametrize(
    ("maps", "error", "message"),
    [
        (  # the part sweeps R, iid and orthogonal, per seed, with the stabilizer off
            ["favor", {"name": "favor", "num_features": 8}],
            ValueError,
            r"performer_maps\[1\]: the table may not set num_features: it is favor's size",
        ),
        (
            [{"name": "favor", "orthogonal": False}],
            ValueError,
            r"performer_maps\[0\]: the table may not set orthogonal",
        ),
        ([{"name": "trig_rf", "seed": 1}], ValueError, r"performer_maps\[0\]: .* not set seed"),
        (
            [{"name": "favor", "stabilize": True}],
            ValueError,
            r"performer_maps\[0\]: the table may not set stabilize: .* stabilizer off",
        ),
        # a map without random features failed only once its run started
        (["favor", "glu"], ValueError, r"performer_maps\[1\]: feature map 'glu' is not a random"),
        (["favor", "favor"], ValueError, r"performer_maps\[1\]: 'favor' is given twice"),
    ],
)
def test_a_bad_performer_map_is_refused_before_any_run(tmp_path, monkeypatch, maps, error, message):
    params = {**study.load_params("approximation", quick=True), "performer_maps": maps}
    with pytest.raises(error, match=message):
        study.load_study("approximation").configs(params)
    monkeypatch.setattr(study, "load_params", lambda *args, **kwargs: params)
    assert study.main("approximation", ["--quick", "--out", str(tmp_path / "out")]) == 1
    assert not (tmp_path / "out" / "results.csv").exists()


def test_a_bad_copy_model_table_is_refused_before_any_run():
    rank = study.load_study("rank")
    params = study.load_params("rank", quick=True)
    for models, message in [
        (["softmax", {"name": "favor", "num_features": 8}], r"copy\.models\[1\]: .* num_features"),
        (["softmax", {"name": "glu", "seed": 0}], r"copy\.models\[1\]: the table may not set seed"),
        (
            ["softmax", {"name": "aoglu", "rank": 99}],
            r"copy\.models\[1\]: rank must be <= head_dim",
        ),
        (["softmax", "softmax"], r"copy\.models\[1\]: 'softmax' is given twice"),
    ]:
        with pytest.raises(ValueError, match=message):
            rank.configs({**params, "copy": {**params["copy"], "models": models}})
    configs = rank.configs(
        {**params, "copy": {**params["copy"], "models": ["softmax", {"name": "glu", "depth": 2}]}}
    )
    assert {c["method"] for c in configs if c["part"] == "copy"} == {"softmax", GLU_LABEL}


def test_approximation_study_runs_map_tables(tmp_path, monkeypatch, one_thread, capsys):
    """An extra map and a performer-map table run with their hyperparameters, under their
    label in results.csv, --only, the summary's tables and the figures."""
    _toy_copy(tmp_path, monkeypatch, "approximation", APPROXIMATION_TOY_TOML)
    approximation = study.load_study("approximation")
    out = tmp_path / "approximation"
    summary = _partial("approximation", out, "part=maps", f"map={IID_FAVOR_LABEL}")
    rows = read_csv_table(out / "results.csv")  # exactly (pandas 2's default parser rounds)
    maps = rows[rows.method != "uniform"]
    assert set(rows["map"]) == {IID_FAVOR_LABEL} and set(maps.method) == {IID_FAVOR_LABEL}
    assert set(maps.feature_dim) == {16}  # matched to map_feature_dim through num_features
    # the table's hyperparameter reached the map: the same numbers as iid FAVOR+ built by hand
    config = _quick_config("approximation", map=IID_FAVOR_LABEL, seed=1)
    fm = ks.analysis.matched_feature_map("favor", 8, 16, seed=1, orthogonal=False)
    assert fm.hparams["orthogonal"] is False
    q, k, v = approximation._data(config, 1, "cpu", stream=2)
    want = ks.analysis.approximation_error(fm, q, k, v).set_index(["method", "metric"]).value
    got = rows[rows.seed == 1].set_index(["method", "metric"]).value
    assert got[IID_FAVOR_LABEL].to_dict() == want["favor"].to_dict()
    assert "## Every registered map and 2 configured map(s) of extra_maps at F = 16" in summary
    assert f"| 1   | {IID_FAVOR_LABEL} | random   | 16 |" in summary
    # a registered map of the same name is its own row, not averaged with the table's
    _partial("approximation", out, "part=maps", "map=favor")
    table = approximation.maps_table(pd.read_csv(out / "results.csv"))
    assert sorted(table.method) == ["favor", IID_FAVOR_LABEL, "uniform"]
    # a performer-map table: swept over R, iid and orthogonal, with its own row_norms
    label = "favor(row_norms='sqrt_d')"
    summary = _partial("approximation", out, "part=performer", f"map={label}")
    rows = read_csv_table(out / "results.csv")
    perf = rows[(rows.part == "performer") & (rows.method != "uniform")]
    assert set(perf["map"]) == set(perf.method) == {label}
    assert set(zip(perf.num_features, perf.orthogonal, strict=True)) == {
        (r, o) for r in (8, 16) for o in (False, True)
    }
    fm = ks.analysis.random_feature_map("favor", 8, 16, orthogonal=True, seed=0, row_norms="sqrt_d")
    config = _quick_config("approximation", map=label, num_features=16, orthogonal=True)
    q, k, _ = approximation._data(config, 0, "cpu", stream=1)
    want = ks.analysis.approximation_error(fm, q, k).set_index(["method", "metric"]).value
    ran = perf[(perf.num_features == 16) & perf.orthogonal & (perf.seed == 0)]
    assert ran.set_index("metric").value.to_dict() == want["favor"].to_dict()
    assert f"| {label} | 8 | 0.5 | 16 |" in summary
    figures = approximation.figures(
        study.load_results("approximation", root=tmp_path), study.load_params("approximation", True)
    )
    ticks = [t.get_text() for ax in figures["maps_attention_kl"].axes for t in ax.get_xticklabels()]
    assert IID_FAVOR_LABEL in ticks and "favor" in ticks
    titles = [ax.get_title() for ax in figures["performer_attention_mse"].axes]
    assert any(f"{label} D=8" in t for t in titles), titles
    for fig in figures.values():
        ks.analysis.plots.close(fig)


def test_rank_study_runs_map_tables(rank_toy, one_thread, capsys):
    """An extra map in the Gaussian part and a table in copy.models run with their
    hyperparameters, under their label in results.csv, spectra.csv and the summary."""
    toml = RANK_TOY_TOML.replace(
        'exclude_maps = ["identity"]',
        'exclude_maps = ["identity"]\nextra_maps = [{ name = "favor", orthogonal = false }]',
    ).replace('models = ["softmax", "elu"]', 'models = ["softmax", { name = "glu", depth = 2 }]')
    (study.studies_dir() / "rank.toml").write_text(toml)
    rank = study.load_study("rank")
    out = rank_toy
    summary = _partial("rank", out, "part=gaussian", f"method={IID_FAVOR_LABEL}", "n=16")
    rows = pd.read_csv(out / "results.csv")
    spectra = pd.read_csv(out / "spectra.csv")
    assert set(rows.method) == set(spectra.method) == {IID_FAVOR_LABEL}
    assert set(rows.feature_dim) == {4, 8}  # each F of the sweep, through num_features
    config = _quick_config("rank", method=IID_FAVOR_LABEL, feature_dim=4)
    fm = ks.analysis.matched_feature_map("favor", 8, 4, seed=0, orthogonal=False)
    q, k = ks.analysis.gaussian_qk(16, 8, 1.0, seed=10_000, device="cpu")
    want = ks.analysis.attention_rank(
        ks.analysis.attention_matrix(q.double(), k.double(), fm)[0, 0]
    )
    got = rows[rows.config_id == study.config_id(config, "cpu")].set_index("metric").value
    assert got["effective_rank"] == pytest.approx(float(want["effective_rank"]), rel=1e-12)
    assert f"| {IID_FAVOR_LABEL} | 4 | 16 |" in summary
    summary = _partial("rank", out, "part=copy", f"method={GLU_LABEL}")
    rows = pd.read_csv(out / "results.csv")
    copy = rows[rows.part == "copy"]
    assert set(copy.method) == set(copy.captured_with.dropna()) == {GLU_LABEL}
    assert f"| {GLU_LABEL} |" in summary.split("## Copy task")[1]
    assert "The maps of extra_maps are measured on Gaussian q/k only" in summary
    model = rank._copy_model(_quick_config("rank", method=GLU_LABEL), 8, 10)
    assert model.encoder.layers[0].attn.feature_map.hparams["depth"] == 2


class SeedlessRandomMap(ks.feature_maps.FeatureMap):
    """A user's map without a ``seed`` hyperparameter whose weights come from torch's global
    generator, φ(x) = softplus(x W), F = D."""

    name = "tests.test_studies:SeedlessRandomMap"
    trainable = True

    def __init__(self, head_dim: int, num_heads: int = 1, **hparams) -> None:
        super().__init__(head_dim, num_heads, **hparams)
        self.weight = torch.nn.Parameter(torch.randn(head_dim, head_dim))

    @property
    def feature_dim(self) -> int:
        return self.head_dim

    def features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        return torch.nn.functional.softplus(x @ self.weight)


def test_a_seedless_users_map_is_built_the_same_for_the_same_seed():
    """Studies built a map without a seed hyperparameter from the global generator as it
    happened to be: its rows changed from run to run and with the configs run before."""
    label = SeedlessRandomMap.name
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = study.matched_map(label, 8, 8, seed=1)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's stream goes on as it was
    torch.rand(7)  # another config ran before this one
    again = study.matched_map(label, 8, 8, seed=1)
    other = study.matched_map(label, 8, 8, seed=2)
    assert torch.equal(first.weight, again.weight)
    assert not torch.equal(first.weight, other.weight)


def test_matched_map_leaves_the_cuda_generators_alone(monkeypatch):
    """torch.manual_seed seeds every CUDA generator too, and fork_rng(devices=[]) restores
    only the CPU one: on a GPU machine each map built reset the CUDA stream to its seed."""
    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)
    monkeypatch.setattr(torch.cuda, "manual_seed", seeded.append)
    first = study.matched_map(SeedlessRandomMap.name, 8, 8, seed=1)
    assert seeded == []
    assert torch.equal(first.weight, study.matched_map(SeedlessRandomMap.name, 8, 8, seed=1).weight)


def test_a_study_runs_a_config_file_of_ones_own(toy_studies, capsys):
    """--config reads a copy of the study's TOML kept outside the checkout: other sizes
    without editing studies/NAME.toml; its configurations get their own rows."""
    out = toy_studies / "out"
    mine = toy_studies / "mine.toml"
    mine.write_text("[full]\nxs = [5]\n\n[quick]\nxs = [2, 6]\n")
    assert study.main("toy", ["--quick", "--out", str(out), "--config", str(mine)]) == 0
    summary = (out / "summary.md").read_text()
    assert f"--config {mine}" in summary  # the provenance line reruns it as it was
    assert sorted(pd.read_csv(out / "results.csv").x) == [2, 6]
    frame = study.run_study("toy", quick=True, out=out, verbose=False)  # the shipped config
    assert sorted(frame.x) == [1, 2]  # x=2 is one configuration in both: computed once
    assert sorted(pd.read_csv(out / "results.csv").x) == [1, 2, 6]
    capsys.readouterr()
    assert study.main("toy", ["--quick", "--config", str(toy_studies / "none.toml")]) == 1
    assert "none.toml' is not a file" in capsys.readouterr().err
    mine.write_text("xs = [\n")
    assert study.main("toy", ["--quick", "--out", str(out), "--config", str(mine)]) == 1
    assert "is not valid TOML" in capsys.readouterr().err


def test_load_results_reads_the_rows_of_a_config_file_of_ones_own(toy_studies):
    """load_results had no config_file: every row of a --config run was left out as of
    configurations the study "no longer has" (the notebooks showed "Not run yet")."""
    out = toy_studies / "toy"
    mine = toy_studies / "mine.toml"
    mine.write_text("[full]\nxs = [5]\n\n[quick]\nxs = [6, 7]\n")
    study.run_study("toy", quick=True, out=out, verbose=False, config_file=mine)
    with pytest.warns(UserWarning, match="pass its file as config_file"):
        assert study.load_results("toy", root=toy_studies).empty
    frame = study.load_results("toy", root=toy_studies, config_file=mine)
    assert sorted(frame.x) == [6, 7]


def test_the_note_on_a_partial_config_file_run_names_the_file(toy_studies, capsys):
    """Its "runs the rest" command left --config out: run as printed, it computed the
    shipped config's study into the folder."""
    mine = toy_studies / "mine.toml"
    mine.write_text("[full]\nxs = [5]\n\n[quick]\nxs = [6, 7]\n")
    study.run_study("toy", quick=True, out=toy_studies / "toy", verbose=False,
                    config_file=mine, only={"x": 6})  # fmt: skip
    capsys.readouterr()
    assert list(study.load_results("toy", root=toy_studies, config_file=mine).x) == [6]
    err = capsys.readouterr().err
    assert "has rows of 1 of the 2 configurations of the quick cpu run" in err
    assert f"--quick --device cpu --config {mine} --out" in err


def test_a_config_file_of_one_size_runs_again(toy_studies, capsys):
    """A --config file with only [full] (or only [quick]) computed its rows and then failed
    in the summary (a KeyError traceback here; "config entry head_dims is missing" for the
    approximation study), when the summary looked up the other size's configurations."""
    out = toy_studies / "out"
    assert study.main("toy", ["--quick", "--out", str(out)]) == 0  # the shipped quick run
    mine = toy_studies / "my full.toml"
    mine.write_text("[full]\nxs = [5, 6]\n")
    assert study.main("toy", ["--out", str(out), "--config", str(mine)]) == 0
    assert sorted(pd.read_csv(out / "results.csv").x) == [1, 2, 5, 6]
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# toy (full, cpu)") and "table of 2 rows" in summary
    assert study.main("toy", ["--out", str(out), "--config", str(mine)]) == 0  # and again
    assert "Traceback" not in capsys.readouterr().err


def test_provenance_records_where_user_maps_were_found(monkeypatch):
    monkeypatch.setenv("KERNELSTUDY_FEATURE_MAPS", "user_maps")
    monkeypatch.setenv("PYTHONPATH", "/home/me/my maps")
    line = study.provenance("rank", True, "cpu")
    assert "`PYTHONPATH='/home/me/my maps' KERNELSTUDY_FEATURE_MAPS=user_maps kernelstudy" in line


def test_a_config_file_of_ones_own_takes_the_studys_rows_as_known(toy_studies, capsys):
    """Run with --config beside rows of studies/NAME.toml, the note said the study "no longer
    has" configurations its own config has."""
    out = toy_studies / "out"
    mine = toy_studies / "mine.toml"
    mine.write_text("[full]\nxs = [5]\n\n[quick]\nxs = [2, 6]\n")
    study.run_study("toy", quick=True, out=out, verbose=False)  # x = 1, 2
    capsys.readouterr()
    study.run_study("toy", quick=True, out=out, verbose=False, config_file=mine)
    assert "no longer has" not in capsys.readouterr().err
    (toy_studies / "studies" / "toy.toml").write_text("[full]\nxs = [3]\n\n[quick]\nxs = [3]\n")
    study.run_study("toy", quick=True, out=out, verbose=False, config_file=mine)
    assert "rows of 1 configuration(s) that study 'toy' no longer has" in capsys.readouterr().err


def test_a_config_file_without_an_entry_the_study_reads_is_named(toy_studies, capsys):
    """A copy with a misspelled key failed with a KeyError traceback naming no file; then
    a misspelled key beside the right one was read as no key (rank's [quick.copy] 'modles'
    trained the full list of models): every key must be one the shipped config has."""
    mine = toy_studies / "mine.toml"
    mine.write_text("[full]\nxs = [5]\n\n[quick]\nx = [2]\n")  # xs misspelled
    assert study.main("toy", ["--quick", "--config", str(mine)]) == 1
    err = capsys.readouterr().err
    assert f"config '{mine}': unknown key(s) 'x' (did you mean 'xs'?)" in err
    mine.write_text("[full]\nxs = [5]\n\n[quick]\nxs = [2]\nxs_extra = 1\n")
    with pytest.raises(ValueError, match="unknown key"):
        study.load_params("toy", quick=True, config=mine)
    mine.write_text("xs = [5]\nquick = 5\n")  # AttributeError: 'int' object has no 'items'
    with pytest.raises(ValueError, match=r"quick must be a table \(\[quick\]\)"):
        study.load_params("toy", quick=True, config=mine)


def test_a_rank_config_with_a_misspelled_nested_key_is_refused(tmp_path):
    shipped = (study.studies_dir() / "rank.toml").read_text()
    mine = tmp_path / "rank.toml"
    mine.write_text(shipped.replace("[quick.copy]\nsteps", "[quick.copy]\nstpes"))
    with pytest.raises(ValueError, match=r"'copy.stpes' \(did you mean 'copy.steps'\?\)"):
        study.load_params("rank", quick=True, config=mine)
    mine.write_text(shipped)
    assert study.load_params("rank", quick=True, config=mine) == study.load_params("rank", True)


@pytest.mark.parametrize(
    "name, old, new",
    [
        ("generation", 'feature_map = "elu"', 'feature_map = { name = "glu", depth = 2 }'),
        (
            "speed",
            'feature_map = "elu"',
            'feature_map = { name = "favor", num_features = 64, orthogonal = false }',
        ),
    ],
)
def test_a_config_copy_may_give_a_map_as_a_table(tmp_path, name, old, new):
    """The configs' own comments offer ``feature_map = { name = ..., ... }``, but a --config
    copy giving one was refused ('feature_map.depth' unknown): the key check recursed into
    a table where the shipped config has a name. A misspelled section key is still named."""
    shipped = (study.studies_dir() / f"{name}.toml").read_text()
    assert old in shipped
    mine = tmp_path / f"{name}.toml"
    mine.write_text(shipped.replace(old, new, 1))
    params = study.load_params(name, quick=True, config=mine)
    spec = params["feature_map"] if name == "generation" else params["rnn_benchmark"]["feature_map"]
    assert isinstance(spec, dict) and spec["name"] in ("glu", "favor")
    mine.write_text(shipped.replace("[quick]\n", "[quick]\nrepeatz = 2\n", 1))
    with pytest.raises(ValueError, match=r"'repeatz' \(did you mean 'repeats'\?\)"):
        study.load_params(name, quick=True, config=mine)


def test_a_study_writes_where_load_results_reads_from_any_working_directory(
    toy_studies, monkeypatch, capsys
):
    """``kernelstudy study NAME`` wrote ./results/NAME under the working directory, while
    load_results (and the notebooks) read results/ of the checkout: run from elsewhere, the
    results just written were not found, and the quick study ran again into the checkout."""
    elsewhere = toy_studies / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert study.results_dir() == toy_studies / "results"  # the studies folder's parent
    assert study.main("toy", ["--quick"]) == 0
    assert (toy_studies / "results" / "toy" / "results.csv").is_file()
    assert not (elsewhere / "results").exists()
    capsys.readouterr()
    frame = study.load_results("toy")
    assert sorted(frame.value) == [1.0, 4.0] and "running" not in capsys.readouterr().err
    monkeypatch.setenv(study.ENV_RESULTS_DIR, "mine")
    assert study.main("toy", ["--quick"]) == 0
    assert (toy_studies / "mine" / "toy" / "results.csv").is_file()


def test_folders_and_provenance_under_odd_settings(toy_studies, monkeypatch):
    """KERNELSTUDY_STUDIES_DIR="." put the results inside the studies folder (the parent of
    "." by name is "."); the provenance command left KERNELSTUDY_FEATURE_MAPS unquoted
    ("plug_a, plug_b" ran plug_b as a command when pasted)."""
    monkeypatch.chdir(toy_studies / "studies")
    monkeypatch.setenv(study.ENV_STUDIES_DIR, ".")
    assert study.results_dir() == toy_studies / "results"
    (toy_studies / "proj").mkdir()  # a link is not followed: results beside the link
    (toy_studies / "proj" / "studies").symlink_to(toy_studies / "studies")
    monkeypatch.setenv(study.ENV_STUDIES_DIR, str(toy_studies / "proj" / "studies"))
    assert study.results_dir() == toy_studies / "proj" / "results"
    monkeypatch.setenv("KERNELSTUDY_FEATURE_MAPS", "plug_a, plug_b")
    line = study.provenance("toy", True, "cpu")
    assert "KERNELSTUDY_FEATURE_MAPS='plug_a, plug_b' kernelstudy study toy --quick" in line


def test_a_study_runs_again_under_an_ascii_locale_with_a_non_ascii_out(toy_studies, tmp_path):
    """Under LC_ALL=C without UTF-8 mode, summary.md (written as UTF-8) was read back in the
    locale's codec: every rerun failed; with a non-ASCII --out (undecodable argv bytes), the
    summary could not be written at all after the whole run."""
    import subprocess
    import sys

    out = tmp_path / "résultats"
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    env[study.ENV_STUDIES_DIR] = str(toy_studies / "studies")
    command = [sys.executable, "-m", "kernelstudy", "study", "toy", "--quick", "--out", str(out)]
    for _ in range(2):  # computed, then read back and written again
        run = subprocess.run(command, env=env, capture_output=True)
        assert run.returncode == 0, run.stderr[-1000:]
    assert str(out) in (out / "summary.md").read_text(encoding="utf-8")
    # a path that is no UTF-8 (latin-1 bytes) under UTF-8 mode: written, read back, printed
    raw = os.fsencode(tmp_path) + b"/r\xe9s"
    env = {**os.environ, "PYTHONUTF8": "1", study.ENV_STUDIES_DIR: str(toy_studies / "studies")}
    command = [os.fsencode(sys.executable), b"-m", b"kernelstudy", b"study", b"toy", b"--quick"]
    for _ in range(2):
        run = subprocess.run([*command, b"--out", raw], env=env, capture_output=True)
        assert run.returncode == 0, run.stderr[-1000:]
        assert raw in run.stdout  # its bytes, as given
    assert raw in open(raw + b"/summary.md", "rb").read()
