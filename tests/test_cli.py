"""The kernelstudy command: help, version, listings and exit codes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernelstudy as ks
from kernelstudy.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert ks.__version__ in capsys.readouterr().out


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "backends" in out and "maps" in out


def test_python_dash_m_runs_the_command():
    """``python -m kernelstudy`` is the ``kernelstudy`` command (it had no __main__)."""
    proc = subprocess.run(
        [sys.executable, "-m", "kernelstudy", "frobnicate"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "usage: kernelstudy" in proc.stderr


def test_out_flags_expand_the_home_folder(tmp_path, monkeypatch):
    """`--out=~/x` (which no shell expands) made a folder named `~` under the current one for
    `study`, `data` and `search`; `train` expanded it."""
    from kernelstudy.cli import build_parser

    monkeypatch.setenv("HOME", str(tmp_path))
    parser = build_parser()
    for argv in (
        ["data", "listops", "--out=~/d"],
        ["study", "approximation", "--out=~/d"],
        ["search", "studies/lra_listops.toml", "--out=~/d"],
    ):
        assert parser.parse_args(argv).out == str(tmp_path / "d"), argv
    for argv in (  # `--config=~/x` was read as it stood: "config file not found: ~/x"
        ["study", "approximation", "--config=~/c.toml"],
        ["train", "--config=~/c.toml"],
    ):
        assert parser.parse_args(argv).config == str(tmp_path / "c.toml"), argv
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "core.py"  # its own parser
    spec = importlib.util.spec_from_file_location("benchmark_core_for_test", path)
    core = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(core)
    assert core.parse_args(["--out=~/b.csv"]).out == tmp_path / "b.csv"  # was ./~/b.csv


BUFFERED = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}


def test_output_into_a_closed_pipe_is_quiet_with_sigpipes_status():
    """`kernelstudy maps | head -1` printed "error: [Errno 32] Broken pipe" and exited 1: a
    BrokenPipeError is an OSError, which main reports as a user's error. With stdout
    buffered (no PYTHONUNBUFFERED, as usual), short output was written only at exit, past
    main's handlers: "Exception ignored ... BrokenPipeError" and status 120."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kernelstudy", "maps", "--format", "csv"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=BUFFERED,
    )
    proc.stdout.close()  # the reader is gone before the command writes (it imports torch first)
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 141 and err == "", err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_output_to_a_full_disk_is_an_error_not_lost_with_status_0():
    """Buffered output to a full disk failed at exit: status 0 and nothing said, or 120."""
    with open("/dev/full", "w") as full:
        run = subprocess.run(
            [sys.executable, "-m", "kernelstudy", "maps"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env=BUFFERED,
        )
    assert run.returncode == 1
    assert run.stderr.strip() == "kernelstudy maps: error: [Errno 28] No space left on device"


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert "usage" in err and out == ""


def test_unknown_command_is_usage_error():
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2


def test_backends_lists_available(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    for name in ks.backends():
        assert name in out


def test_maps_table_and_csv(capsys):
    assert main(["maps"]) == 0
    out = capsys.readouterr().out
    for name in ks.list_feature_maps():
        assert name in out
    assert main(["maps", "el*", "--format", "csv"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("name,") and len(lines) == 1 + len(ks.list_feature_maps("el*"))


def test_maps_without_a_match_is_an_error(capsys):
    assert main(["maps", "zzz*"]) == 1
    assert "no feature map matches 'zzz*' (known: " in capsys.readouterr().err


def test_unusable_out_paths_are_one_line_errors(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["study", "approximation", "--quick", "--out", str(afile)]) == 1
    assert main(["study", "approximation", "--quick", "--out", str(afile / "sub")]) == 1
    args = ["--train", "4", "--val", "2", "--test", "2", "--min-length", "5"]
    assert main(["data", "listops", "--out", str(afile), *args, "--max-length", "20"]) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 3 and "Traceback" not in err


def test_study_only_without_a_match_is_an_error(tmp_path, capsys):
    out = tmp_path / "rank"
    assert main(["study", "rank", "--quick", "--out", str(out), "--only", "part=x"]) == 1
    assert "no configuration of study 'rank' has {'part': 'x'}" in capsys.readouterr().err
    assert not (out / "results.csv").exists()


def test_console_script_runs():
    res = subprocess.run(
        [sys.executable, "-m", "kernelstudy.cli", "backends"], capture_output=True, text=True
    )
    assert res.returncode == 0 and "torch" in res.stdout


def test_study_lists_studies(capsys):
    assert main(["study"]) == 0
    out = capsys.readouterr().out.split()
    assert "approximation" in out
    assert main(["study", "--quick", "--force"]) == 1  # were ignored
    assert "--quick, --force need(s) a study NAME" in capsys.readouterr().err


def test_unknown_study_is_an_error(capsys):
    assert main(["study", "nosuchstudy", "--quick"]) == 1
    assert "nosuchstudy" in capsys.readouterr().err


def test_data_listops_writes_lra_files(tmp_path, capsys):
    args = ["data", "listops", "--out", str(tmp_path), "--train", "20", "--val", "3"]
    args += ["--test", "3", "--min-length", "20", "--max-length", "80", "--seed", "3"]
    assert main(args) == 0
    for split, n in (("train", 20), ("val", 3), ("test", 3)):
        lines = (tmp_path / f"basic_{split}.tsv").read_text().splitlines()
        assert lines[0].split("\t") == ["Source", "Target"] and len(lines) == n + 1
    bad = ["data", "listops", "--out", str(tmp_path / "b"), "--min-length", "50"]
    bad += ["--max-length", "10"]
    assert main(bad) == 1
    assert "need --max-length >= --min-length + 2" in capsys.readouterr().err  # the flags
    assert main(["data", "listops", "--out", str(tmp_path / "s"), "--seed", "-3"]) == 1
    assert "--seed must be an int >= 0, got -3" in capsys.readouterr().err  # the flag
    assert not (tmp_path / "s").exists()
    # an empty split was written as a header alone, which train then refused
    assert main(["data", "listops", "--out", str(tmp_path / "e"), "--val", "0"]) == 1
    assert "--val must be an int >= 1, got 0" in capsys.readouterr().err
    # existing files (LRA's release has the same names) are kept unless --overwrite
    before = (tmp_path / "basic_train.tsv").read_bytes()
    assert main([*args[:-1], "4"]) == 1
    err = capsys.readouterr().err
    assert "basic_train.tsv" in err and "pass --overwrite to replace" in err
    assert "overwrite=True" not in err  # the flag, not write_listops' argument
    assert (tmp_path / "basic_train.tsv").read_bytes() == before
    assert main([*args[:-1], "4", "--overwrite"]) == 0
    assert (tmp_path / "basic_train.tsv").read_bytes() != before
    # bad lengths fail before any directory is made
    short = ["--min-length", "1", "--max-length", "3", "--out", str(tmp_path / "d2")]
    assert main(["data", "listops", *short]) == 1
    assert not (tmp_path / "d2").exists()


def test_a_study_refuses_another_studys_results(tmp_path, capsys):
    """Appending to another study's results.csv mixed the two and overwrote its summary."""
    out = tmp_path / "mixed"
    out.mkdir()
    (out / "results.csv").write_text("study,config_id,metric,value\nrank,abc,x,1.0\n")
    assert main(["study", "approximation", "--quick", "--out", str(out)]) == 1
    assert "holds results of study 'rank', not 'approximation'" in capsys.readouterr().err
    assert (out / "results.csv").read_text().count("\n") == 2
    assert (
        main(["study", "rank", "--quick", "--out", str(tmp_path / "x"), "--only", "part=no"]) == 1
    )
    assert not (tmp_path / "x").exists()  # nothing made for a refused run
    assert not (tmp_path / "e").exists()


def test_a_bad_count_names_no_function(tmp_path, capsys):
    """argparse printed "invalid _positive value: 'abc'" for --trials abc."""
    with pytest.raises(SystemExit) as done:
        main(["search", str(tmp_path / "x.toml"), "--trials", "abc"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "--trials: must be a positive int, got 'abc'" in err and "_positive" not in err


def test_out_of_memory_is_a_one_line_error(monkeypatch, capsys):
    """torch's allocation failure (a RuntimeError) escaped main() as a traceback."""
    import kernelstudy.cli as cli

    def allocate(args):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 400000000000000 bytes."
        )

    monkeypatch.setattr(cli, "_cmd_backends", allocate)  # build_parser binds it when called
    assert main(["backends"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kernelstudy backends: error: out of memory (") and "\n" == err[-1]
    assert err.count("\n") == 1 and "you tried to allocate" in err

    def huge(args):  # a width of 2^62: the byte count overflows before any allocation
        torch.empty(2**62, 8)

    monkeypatch.setattr(cli, "_cmd_backends", huge)
    assert main(["backends"]) == 1
    assert "out of memory (" in capsys.readouterr().err

    def broken(args):
        raise RuntimeError("an unexpected failure")  # a bug keeps its traceback

    monkeypatch.setattr(cli, "_cmd_backends", broken)
    with pytest.raises(RuntimeError, match="unexpected"):
        main(["backends"])


def test_ctrl_c_exits_with_status_130(monkeypatch, capsys):
    """Ctrl-C during a command is the one line "interrupted" and exit status 130 (128 +
    SIGINT), as the module docstring says, not 1 (an error of the command)."""
    import kernelstudy.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_backends", interrupted)
    assert main(["backends"]) == 130
    assert capsys.readouterr().err == "interrupted\n"
    # a command that keeps its finished work says so (it said "interrupted" alone)
    import kernelstudy.train.commands as train_commands

    monkeypatch.setattr(train_commands, "cmd_train", interrupted)
    assert main(["train", "--out", "x"]) == 130
    assert capsys.readouterr().err == cli.INTERRUPTED_RESUMABLE + "\n"


def test_study_device_without_a_name_is_refused(capsys) -> None:
    """`kernelstudy study --device cuda` listed the studies and ignored --device."""
    assert main(["study", "--device", "cuda"]) == 1
    captured = capsys.readouterr()
    assert "--device need(s) a study NAME" in captured.err and captured.out == ""


def test_maps_format_option_is_described(capsys):
    """`kernelstudy maps --help` showed --format with no description or default."""
    with pytest.raises(SystemExit):
        main(["maps", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--format {table,csv} plain-text table or CSV on stdout (default table)" in out


class _Corrupt(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        raise ValueError(f"sample_{i}.png: truncated b'IDAT' chunk")


def test_an_error_in_a_loader_worker_is_one_line():
    """With num_workers the CLI printed torch's "Caught ValueError in DataLoader worker
    process 0." and 15 lines of the worker's traceback, the message on the last."""
    from kernelstudy.cli import error_text

    loader = torch.utils.data.DataLoader(_Corrupt(), num_workers=1)
    with pytest.raises(ValueError) as caught:
        next(iter(loader))
    assert str(caught.value).startswith("Caught ValueError in DataLoader worker process 0")
    assert error_text(caught.value) == "sample_0.png: truncated b'IDAT' chunk"
    assert error_text(ValueError("a\nb")) == "a\nb"


def test_closed_output_streams_and_narrow_encodings_do_not_fail_a_command(tmp_path):
    """With stderr closed (`2>&-`, pythonw: sys.stderr is None) `train` exited 1 at its
    isatty() without a word, and a study crashed in its progress bar; with stdout closed,
    finished work ended in AttributeError at the flush. Text the output encoding cannot
    hold (a summary's ± under a latin-1 locale) ended a finished run in UnicodeEncodeError."""
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "kernelstudy", "train", "--task", "copy", "--task-arg",
        "seq_len=8", "--task-arg", "num_samples=16", "--d-model", "8", "--heads", "2",
        "--layers", "1", "--steps", "2", "--batch-size", "4", "--device", "cpu", "--out",
        str(out),
    ]  # fmt: skip
    for fd in (1, 2):
        run = subprocess.run(command, preexec_fn=lambda fd=fd: os.close(fd), env=BUFFERED)
        assert run.returncode == 0 and (out / "run.json").is_file()
        shutil.rmtree(out)
    narrow = {**BUFFERED, "PYTHONIOENCODING": "ascii"}
    script = (
        "import sys, kernelstudy.cli as c; print('\\u00b1 \\u03c6'); sys.exit(c.main(['maps']))"
    )
    run = subprocess.run([sys.executable, "-c", script], env=narrow, capture_output=True)
    assert run.returncode == 1  # this print is before main: the strict encoder raises
    # ± escaped; a path's undecodable byte (as argv decoding gave it: U+DCE9) as that byte
    code = (
        "import sys, kernelstudy.cli as c; r = c.main(['backends']); "
        "print('\\u00b1\\udce9'); sys.exit(r)"
    )
    run = subprocess.run([sys.executable, "-c", code], env=narrow, capture_output=True)
    assert run.returncode == 0 and run.stdout.endswith(b"\\xb1\xe9\n"), run.stderr[-500:]
