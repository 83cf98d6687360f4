"""``kernelstudy train``: outputs, resume, config files and bad configurations failing early."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from kernelstudy.cli import main
from kernelstudy.files import exclusive_folder
from kernelstudy.tasks import write_listops
from kernelstudy.train import commands
from kernelstudy.train.commands import load_splits, parse_key_values, parse_value

from .conftest import write_text_data

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def listops(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A few hundred short ListOps expressions in the LRA files."""
    out = tmp_path_factory.mktemp("listops")
    write_listops(out, n_train=240, n_val=48, n_test=48, min_length=10, max_length=40, seed=0)
    return out


TINY = ["--d-model", "16", "--heads", "2", "--layers", "1", "--batch-size", "16"]


def listops_args(data: Path, out: Path, *extra: str, map_args: bool = True) -> list[str]:
    """A tiny FAVOR+ run on ``data``; later flags in ``extra`` override earlier ones."""
    maps = ["--map-arg", "num_features=8", "--map-arg", "seed=3"] if map_args else []
    return [
        "train",
        "--task",
        "listops",
        "--data",
        str(data),
        "--attention",
        "favor",
        *maps,
        "--max-length",
        "40",
        "--steps",
        "8",
        "--eval-every",
        "3",
        "--device",
        "cpu",
        "--out",
        str(out),
        *TINY,
        *extra,
    ]


def test_help_in_process_and_as_a_module(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--task", "--data", "--attention", "--map-arg", "--out", "--config", "--resume"):
        assert flag in text
    proc = subprocess.run(
        [sys.executable, "-m", "kernelstudy.cli", "train", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--map-arg" in proc.stdout and "usage: kernelstudy train" in proc.stdout


def test_tiny_listops_run_writes_checkpoint_metrics_and_summary(
    listops: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "runs" / "favor"
    assert main(listops_args(listops, out)) == 0
    printed = capsys.readouterr().out
    assert "completed after 8/8 steps" in printed and "test accuracy" in printed
    names = {p.name for p in out.iterdir()}
    assert names == {
        ".lock",  # kept out of --out while another `kernelstudy train` runs there
        "config.json",
        "checkpoint.pt",
        "metrics.csv",
        "run.json",
        "model.pt",
        "summary.json",
    }
    metrics = pd.read_csv(out / "metrics.csv")
    assert list(metrics["step"]) == [3, 6, 8]
    assert metrics["val_accuracy"].between(0, 1).all()

    summary = json.loads((out / "summary.json").read_text())
    record = json.loads((out / "run.json").read_text())
    assert summary["status"] == "completed" and summary["steps_completed"] == 8
    assert summary["val_accuracy"] == pytest.approx(metrics["val_accuracy"].iloc[-1])
    assert summary["test_accuracy"] == record["test"]["accuracy"]
    # the test scored the restored best weights: their step and validation accuracy
    assert summary["model_step"] == record["best"]["step"] in (3, 6, 8)
    best_row = metrics[metrics["step"] == summary["model_step"]].iloc[0]
    assert summary["model_val_accuracy"] == pytest.approx(best_row["val_accuracy"])
    assert f"(weights of step {summary['model_step']})" in printed
    assert 0 <= summary["test_accuracy"] <= 1
    assert 0.1 <= summary["test_majority_accuracy"] <= 1
    assert summary["parameters"]["model"] == record["parameters"]["total"] > 0
    assert summary["parameters"]["feature_map"] == 0  # FAVOR+ features are buffers
    assert summary["feature_dim"] == 8 and summary["peak_memory_bytes"] > 0
    assert summary["wall_time_s"] > 0 and summary["device"] == "cpu"
    assert summary["task_info"]["max_length"] == 40 and summary["task_info"]["size"] == 240

    config = json.loads((out / "config.json").read_text())
    assert config["feature_map"] == {"num_features": 8, "seed": 3}
    assert config["model"] == {"d_model": 16, "n_heads": 2, "n_layers": 1}
    assert config["task_options"] == {"max_length": 40}
    assert config["train"]["steps"] == 8 and config["data"] == str(listops.resolve())
    state = torch.load(out / "model.pt", weights_only=True)
    assert state["encoder.layers.0.attn.feature_map.weight"].shape[0] == 8


def test_rerun_resumes_and_matches_an_uninterrupted_run(
    listops: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    extra = ("--model-arg", "dropout=0.1")
    assert main(listops_args(listops, straight, *extra)) == 0
    assert main(listops_args(listops, resumed, *extra, "--stop-after", "4")) == 0
    paused = json.loads((resumed / "summary.json").read_text())
    assert paused["status"] == "paused" and paused["steps_completed"] == 4
    assert paused["test_accuracy"] is None
    capsys.readouterr()

    assert main(listops_args(listops, resumed, *extra)) == 0
    captured = capsys.readouterr()
    assert "resuming" in captured.err and "completed after 8/8" in captured.out
    a = pd.read_csv(straight / "metrics.csv").drop(columns="elapsed_s")
    b = pd.read_csv(resumed / "metrics.csv").drop(columns="elapsed_s")
    pd.testing.assert_frame_equal(a, b)
    sa = json.loads((straight / "summary.json").read_text())
    sb = json.loads((resumed / "summary.json").read_text())
    assert sa["test_accuracy"] == sb["test_accuracy"] and sa["test_loss"] == sb["test_loss"]
    wa, wb = (torch.load(d / "model.pt", weights_only=True) for d in (straight, resumed))
    assert wa.keys() == wb.keys()
    for k in wa:  # tensors, and a random map's extra state (its seed and draw count)
        assert torch.equal(wa[k], wb[k]) if torch.is_tensor(wa[k]) else wa[k] == wb[k], k

    # a finished run re-run is a no-op that reports the same result
    assert main(listops_args(listops, resumed, *extra)) == 0
    assert json.loads((resumed / "summary.json").read_text())["test_loss"] == sa["test_loss"]
    assert len(pd.read_csv(resumed / "metrics.csv")) == 3

    # other settings in the same --out are refused, unless --overwrite
    capsys.readouterr()
    assert main(listops_args(listops, resumed, *extra, "--lr", "0.01")) == 1
    assert "changed: train.lr" in capsys.readouterr().err
    assert main(listops_args(listops, resumed, "--lr", "0.01", "--overwrite", "--steps", "3")) == 0
    assert json.loads((resumed / "config.json").read_text())["train"]["lr"] == 0.01
    assert list(pd.read_csv(resumed / "metrics.csv")["step"]) == [3]


@pytest.mark.parametrize("eval_batches", [None, 1])
def test_eval_batch_size_may_change_at_a_resume_unless_eval_batches_caps_it(
    listops: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], eval_batches: int | None
) -> None:
    """Capped at ``eval_batches``, the evaluation scores the first batches, so another
    batch size scores other examples: the resume is refused."""
    out = tmp_path / "run"

    def run(eval_batch_size: int, *extra: str) -> int:
        config = tmp_path / f"eval{eval_batch_size}.toml"
        cap = "" if eval_batches is None else f"eval_batches = {eval_batches}\n"
        config.write_text(f"[train]\n{cap}eval_batch_size = {eval_batch_size}\n")
        return main(listops_args(listops, out, "--config", str(config), *extra))

    assert run(8, "--stop-after", "4") == 0
    capsys.readouterr()
    if eval_batches is None:
        assert run(16) == 0
        assert "completed after 8/8" in capsys.readouterr().out
    else:
        assert run(16) == 1
        assert "changed: train.eval_batch_size" in capsys.readouterr().err
        assert run(8) == 0


def test_overwrite_that_fails_or_is_interrupted_leaves_no_old_run_to_resume(
    listops: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "run"
    assert main(listops_args(listops, out, "--steps", "4")) == 0
    # A bad --stop-after is refused before anything is written.
    new = listops_args(listops, out, "--steps", "4", "--lr", "0.02")
    assert main([*new, "--overwrite", "--stop-after", "-1"]) == 1
    assert "--stop-after must be >= 0" in capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["train"]["lr"] != 0.02

    # Interrupted before its first checkpoint: the old run's files are gone with it.
    def interrupted(self, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(commands.Trainer, "fit", interrupted)
        assert main([*new, "--overwrite"]) == 130
    assert json.loads((out / "config.json").read_text())["train"]["lr"] == 0.02
    assert not any((out / name).exists() for name in ("checkpoint.pt", "summary.json"))
    capsys.readouterr()
    assert main(new) == 0  # starts afresh: nothing of the old run to resume
    assert "resuming" not in capsys.readouterr().err


def test_a_run_killed_in_its_first_checkpoint_runs_again_with_the_same_command(
    listops: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """metrics.csv was written before the first checkpoint: a kill (or a full disk) while that
    was saved left metrics without a checkpoint, which the same command, requeued, refused as
    a finished run's results."""
    out = tmp_path / "run"

    def killed(self, path=None):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(commands.Trainer, "save_checkpoint", killed)
        assert main(listops_args(listops, out)) == 1
    assert not (out / "checkpoint.pt").exists()
    assert main(listops_args(listops, out)) == 0
    assert pd.read_csv(out / "metrics.csv")["step"].tolist() == [3, 6, 8]


def test_an_unknown_backend_in_the_environment_is_refused_before_anything_is_written(
    listops: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    """KERNELSTUDY_BACKEND is read at the first step: a misspelled one failed there, after
    config.json and run.json were written."""
    monkeypatch.setenv("KERNELSTUDY_BACKEND", "nonsense")
    out = tmp_path / "run"
    assert main(listops_args(listops, out)) == 1
    assert "KERNELSTUDY_BACKEND must be one of" in capsys.readouterr().err
    assert not out.exists()


def test_results_without_a_checkpoint_are_not_overwritten_by_other_settings(
    listops: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With checkpoint.pt deleted (to save space), other settings used to start a fresh
    run silently over model.pt, summary.json and metrics.csv."""
    out = tmp_path / "run"
    assert main(listops_args(listops, out, "--steps", "4")) == 0
    (out / "checkpoint.pt").unlink()
    summary = (out / "summary.json").read_text()
    assert main(listops_args(listops, out, "--steps", "4", "--lr", "0.05")) == 1
    assert "other settings (changed: train.lr)" in capsys.readouterr().err
    assert (out / "summary.json").read_text() == summary
    # nor by the same settings: that retrained from step 0, deleting summary.json at once
    # (an interruption then left a partial run's metrics over the finished run's)
    assert main(listops_args(listops, out, "--steps", "4")) == 1
    err = capsys.readouterr().err
    assert "but no checkpoint.pt to resume it from; use another --out, or --overwrite" in err
    assert (out / "summary.json").read_text() == summary
    assert main(listops_args(listops, out, "--steps", "4", "--lr", "0.05", "--overwrite")) == 0


def test_a_config_json_that_is_no_runs_is_not_replaced(
    listops: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An --out folder holding another program's config.json (a project folder a shared
    TOML's ``out`` chose) had the file silently replaced by the run's settings."""
    out = tmp_path / "project"
    out.mkdir()
    (out / "config.json").write_text('{"my": "project settings"}')
    assert main(listops_args(listops, out, "--steps", "2")) == 1
    assert "config.json holds no run settings" in capsys.readouterr().err
    assert (out / "config.json").read_text() == '{"my": "project settings"}'
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]


def test_a_task_type_that_does_not_fit_the_task_is_refused_before_anything_is_written(
    listops: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It failed at the first training step, after config.json had been written."""
    config = tmp_path / "lm.toml"
    config.write_text('[train]\ntask_type = "lm"\n')
    out = tmp_path / "run"
    assert main(listops_args(listops, out, "--config", str(config))) == 1
    err = capsys.readouterr().err
    assert "[train] task_type 'lm' does not fit task 'listops' (a classification task)" in err
    assert not out.exists()


def test_a_run_saved_before_a_train_field_existed_resumes(
    listops: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A paused run whose config.json predates ``[train] compile`` was refused as "other
    settings (changed: train.compile)": the saved table's missing field now reads as its
    default, as the trainer's own resume check reads the checkpoint's."""
    out = tmp_path / "run"
    assert main(listops_args(listops, out, "--steps", "4", "--stop-after", "2")) == 0
    # paused before any evaluation: no best step to name (it printed "at step None")
    assert "paused after 2/4 steps: val accuracy n/a (best n/a), " in capsys.readouterr().out
    saved = json.loads((out / "config.json").read_text())
    del saved["train"]["compile"]
    (out / "config.json").write_text(json.dumps(saved))
    capsys.readouterr()
    assert main(listops_args(listops, out, "--steps", "4")) == 0
    assert "resuming" in capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["steps"] == 4


def test_a_damaged_run_directory_is_one_line_naming_the_file(
    listops: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main(listops_args(listops, out, "--steps", "4", "--stop-after", "2")) == 0
    capsys.readouterr()
    checkpoint = out / "checkpoint.pt"
    checkpoint.write_bytes(checkpoint.read_bytes()[:100])  # truncated
    assert main(listops_args(listops, out, "--steps", "4")) == 1
    err = capsys.readouterr().err
    assert f"{checkpoint} is not a readable checkpoint" in err and "Traceback" not in err
    for text, message in (("{", "is not readable JSON"), ('{"task": "listops"}', "no [train]")):
        (out / "config.json").write_text(text)
        assert main(listops_args(listops, out, "--steps", "4")) == 1
        err = capsys.readouterr().err
        assert "config.json" in err and message in err


def test_config_file_data_path_is_relative_to_the_file(
    listops: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = listops.parent / "listops_run.toml"
    config.write_text(f'task = "listops"\ndata = "{listops.name}"\nattention = "elu"\n')
    monkeypatch.chdir(tmp_path)  # somewhere the relative path does not exist
    out = tmp_path / "run"
    args = ["train", "--config", str(config), "--out", str(out), "--steps", "2", *TINY]
    assert main([*args, "--max-length", "40", "--device", "cpu"]) == 0
    assert json.loads((out / "config.json").read_text())["data"] == str(listops.resolve())


def test_config_file_with_flags_overriding_and_a_synthetic_task(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "copy.toml"
    config.write_text(
        """
task = "copy"
attention = "glu"
out = "IGNORED"  # a path relative to this file

[task_options]
seq_len = 12
n_symbols = 4
num_samples = 64

[task_options.val]
num_samples = 16

[feature_map]
seed = 1

[model]
d_model = 16
n_heads = 2
n_layers = 1
dropout = 0.0

[train]
steps = 50
batch_size = 16
eval_every = 0
device = "cpu"
"""
    )
    out = tmp_path / "copy"
    args = ["train", "--config", str(config), "--out", str(out), "--steps", "4"]
    split_args = ["--task-arg", "test.num_samples=24", "--task-arg", "val.seed=3"]
    assert main([*args, "--task-arg", "n_symbols=5", *split_args]) == 0
    settings = json.loads((out / "config.json").read_text())
    assert settings["task"] == "copy" and settings["data"] is None
    assert settings["task_options"] == {
        "seq_len": 12,
        "n_symbols": 5,
        "num_samples": 64,
        "val": {"num_samples": 16, "seed": 3},  # the file's table with the flag added
        "test": {"num_samples": 24},
    }
    sizes = {name: len(split) for name, split in load_splits(settings).items()}
    assert sizes == {"train": 64, "val": 16, "test": 24}
    assert settings["train"]["steps"] == 4 and settings["train"]["batch_size"] == 16
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task_info"]["vocab_size"] == 7 and summary["task_info"]["num_classes"] is None
    assert summary["test_majority_accuracy"] is None
    assert 0 <= summary["test_sequence_accuracy"] <= summary["test_accuracy"] <= 1
    # GLU maps are trainable: one per layer, counted apart from the model
    assert 0 < summary["parameters"]["feature_map"] < summary["parameters"]["model"]
    assert summary["feature_dim"] == 8  # head_dim
    # Without --out, the file's out is relative to the file, not to the working directory.
    assert main(["train", "--config", str(config), "--steps", "2"]) == 0
    assert (tmp_path / "IGNORED" / "summary.json").is_file()
    assert list(pd.read_csv(out / "metrics.csv")["step"]) == [4]


def test_value_parsing() -> None:
    assert parse_value("256") == 256 and isinstance(parse_value("256"), int)
    assert parse_value("0.5") == 0.5 and parse_value("1e-3") == 1e-3
    assert parse_value("true") is True and parse_value("False") is False
    assert parse_value("none") is None and parse_value("chi") == "chi"
    assert parse_key_values(["a=1", "b=x=y"], "--map-arg") == {"a": 1, "b": "x=y"}
    for bad in ("num_features", "=3", "num_features=", "1x=2", "a b=1"):
        with pytest.raises(ValueError, match="KEY=VALUE"):
            parse_key_values([bad], "--map-arg")
    with pytest.raises(ValueError, match="twice"):
        parse_key_values(["a=1", "a=2"], "--map-arg")


#: (flags appended to a good command, expected message, keep the good --map-args)
BAD = [
    (["--task", "listop"], "unknown task 'listop'; did you mean 'listops'", True),
    (["--attention", "favr"], "unknown feature map 'favr'; did you mean 'favor'", False),
    (
        ["--d-model", "30", "--heads", "4"],
        # the fields, then the flags that set them (the user typed --heads, not n_heads)
        "d_model (30) must be divisible by n_heads (4) (set by --d-model, --heads or [model]",
        True,
    ),
    (["--data", "{tmp}/missing"], "data directory not found", True),
    (["--map-arg", "num_features"], "--map-arg expects KEY=VALUE", False),
    (["--map-arg", "num_feature=8"], "unknown hyperparameter(s) ['num_feature']", False),
    (["--map-arg", "num_features=many"], "num_features must be int", False),
    (["--attention", "softmax"], "with --attention softmax", True),
    (["--model-arg", "pooling=max"], "pooling must be one of", True),
    (["--model-arg", "poolin=cls"], "unknown model option(s) ['poolin']", True),
    (["--model-arg", "dropout=abc"], "dropout must be a float in [0, 1), got 'abc'", True),
    (["--task-arg", "max_len=3"], "unknown option(s) max_len for task 'listops'", True),
    (["--task-arg", "val.max_len=3"], "unknown option(s) val.max_len for task 'listops'", True),
    (["--task-arg", "dev.max_length=3"], "--task-arg expects KEY=VALUE", True),
    (["--model-arg", "pooling"], "(e.g. --model-arg pooling=cls)", True),
    (["--heads", "2", "--model-arg", "n_heads=4"], "--heads 2 and --model-arg n_heads=4", True),
    (["--task-arg", "max_length=30"], "--max-length 40 and --task-arg max_length=30", True),
    (["--steps", "0"], "steps must be an int >= 1", True),
    (["--resume"], "--resume: no checkpoint", True),
    (["--config", "{tmp}/none.toml"], "config file not found", True),
]


@pytest.mark.parametrize(("flags", "message", "map_args"), BAD)
def test_bad_configurations_exit_1_before_training(
    listops: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    message: str,
    map_args: bool,
) -> None:
    out = tmp_path / "run"
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    assert main(listops_args(listops, out, *flags, map_args=map_args)) == 1
    err = capsys.readouterr().err
    assert err.startswith("kernelstudy train: error:") and message in err, err
    assert not out.exists()  # nothing written, no checkpoint


def test_task_specific_failures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    cases = [
        (["--task", "listops"], "task 'listops' reads files: give --data DIR"),
        (["--task", "copy", "--data", str(tmp_path)], "synthetic and takes no --data"),
        (["--task", "image", "--data", str(tmp_path), "--max-length", "9"], "fixed sequence"),
        (["--task", "listops", "--data", str(tmp_path)], "basic_train.tsv"),  # no files
        (["--task", "copy", "--device", "cdua"], "device 'cdua': expected auto, cpu, cuda or"),
        (["--task", "copy", "--device", "cdua"], "; did you mean 'cuda'?"),
        (["--task", "copy"], "no output directory"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--task", "copy", "--device", "cuda"], "CUDA is not available"))
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("task = copy\n")
    cases.append((["--config", str(bad_toml)], "not a valid TOML"))
    other = tmp_path / "other.toml"
    other.write_text('task = "copy"\nsteps = 3\n')
    cases.append((["--config", str(other)], "unknown key(s) ['steps']"))
    for args in cases:
        out_args = [] if "no output directory" in args[1] else ["--out", str(out)]
        assert main(["train", *args[0], *out_args]) == 1, args
        err = capsys.readouterr().err
        assert args[1] in err, (args, err)
        assert not out.exists()


def test_progress_flag_wins_over_the_config_file() -> None:
    """``--no-progress`` used to lose against ``[train] progress = true``."""
    settings = {"train": {"steps": 1, "progress": True, "device": "cpu"}, "out": "/tmp/x"}
    assert commands.train_config_of(settings, False).progress is False
    assert commands.train_config_of(settings, None).progress is True  # the file, no flag
    plain = {"train": {"steps": 1, "device": "cpu"}, "out": "/tmp/x"}
    assert commands.train_config_of(plain, True).progress is True
    assert commands.train_config_of(plain, None).progress is sys.stderr.isatty()


def test_learned_positions_cover_a_longer_val_split(
    listops: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """max_len came from the train split alone: a longer val split (a per-split task option)
    failed at the first evaluation, after training had started."""
    longer = ["--max-length", "20", "--task-arg", "val.max_length=40"]
    learned = ["--model-arg", "positions=learned"]
    out = tmp_path / "run"
    assert main(listops_args(listops, out, *longer, *learned, "--steps", "4")) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    short = tmp_path / "short"
    args = listops_args(listops, short, *longer, *learned, "--model-arg", "max_len=30")
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "max_len=30 is below the length the splits pad to (the task's max_length, 40)" in err
    assert not short.exists()  # refused before anything was written


@pytest.mark.parametrize("failure", [KeyboardInterrupt, FloatingPointError])
def test_a_continuation_that_does_not_return_leaves_no_stale_summary(
    listops: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    failure: type[BaseException],
) -> None:
    """The summary of an earlier pause survived an interrupted or failed continuation,
    disagreeing with its run.json."""
    out = tmp_path / "run"
    assert main(listops_args(listops, out, "--stop-after", "4")) == 0
    assert json.loads((out / "summary.json").read_text())["status"] == "paused"

    def fails(self, **kwargs):
        raise failure("stopped")

    monkeypatch.setattr(commands.Trainer, "fit", fails)
    assert main(listops_args(listops, out)) == (130 if failure is KeyboardInterrupt else 1)
    assert not (out / "summary.json").exists()
    assert (out / "checkpoint.pt").exists()  # the pause is still there to resume


def test_a_second_train_in_the_same_out_exits_1_and_deletes_nothing(
    listops: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two processes training into one --out both ran, each over the other's checkpoint."""
    out = tmp_path / "run"
    assert main(listops_args(listops, out, "--steps", "4")) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    with exclusive_folder(out, "kernelstudy train"):  # a lock is per open file: this holds
        for extra in ((), ("--overwrite",)):
            assert main(listops_args(listops, out, "--steps", "4", *extra)) == 1
            err = capsys.readouterr().err
            assert f"cannot run kernelstudy train in {out}: another process is at work" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert main(listops_args(listops, out, "--steps", "4", "--overwrite")) == 0


def test_feature_map_penalties_count_by_default(listops: Path, tmp_path: Path) -> None:
    """`kernelstudy train` ran with reg_weight 0, so an OGLU map's orthogonality penalty,
    which the README says is added to the loss (and searches add), was silently left out."""
    for extra, regularized in (([], True), (["--reg-weight", "0"], False)):
        out = tmp_path / f"oglu{len(extra)}"
        args = listops_args(listops, out, "--attention", "oglu", "--steps", "2", map_args=False)
        assert main([*args, *extra]) == 0
        metrics = pd.read_csv(out / "metrics.csv")
        assert ("train_reg" in metrics.columns) == regularized
        assert json.loads((out / "config.json").read_text())["train"]["reg_weight"] == (
            1.0 if regularized else 0.0
        )


def test_summary_gives_the_training_time_apart_from_the_wall_time(
    listops: Path, tmp_path: Path
) -> None:
    """summary.json had only wall_time_s, which counts every evaluation, the test scoring
    and the checkpoints: not the model's training time."""
    out = tmp_path / "timed"
    assert main(listops_args(listops, out, "--eval-every", "1")) == 0
    summary = json.loads((out / "summary.json").read_text())
    record = json.loads((out / "run.json").read_text())
    assert summary["train_time_s"] == record["train_time_s"]
    assert 0 < summary["train_time_s"] < summary["wall_time_s"] == record["wall_time_s"]


@pytest.mark.parametrize("layout", ["aclImdb", "val.tsv"])
def test_a_run_whose_val_split_reads_the_test_data_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: str
) -> None:
    """IMDB's val split is its test split (as in LRA): the best checkpoint, which the test
    scores, was chosen on the test set without a word in the output or summary.json."""
    data = write_text_data(tmp_path / "data", layout)
    out = tmp_path / "run"
    args = ["train", "--task", "text", "--data", str(data), "--max-length", "24"]
    args += ["--steps", "2", "--eval-every", "1", "--device", "cpu", "--out", str(out), *TINY]
    assert main(args) == 0
    reads_test = layout == "aclImdb"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_reads_test"] is reads_test
    err = capsys.readouterr().err
    assert ("chosen on the test set" in err) is reads_test, err


def test_an_empty_out_or_data_is_refused_not_the_current_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--out ""`` (an unset variable) wrote the run into the current directory (and with
    --overwrite deleted a run there first); ``TrainConfig(out_dir="")`` did the same."""
    monkeypatch.chdir(tmp_path)
    for flags, message in (
        (["--task", "copy", "--out", ""], "--out must not be empty"),
        (["--task", "listops", "--data", "", "--out", "run"], "--data must not be empty"),
        # an unset variable replaced the config's attention with elu+1, silently
        (["--task", "copy", "--attention", "", "--out", "run"], "--attention must not be empty"),
    ):
        assert main(["train", *flags]) == 1
        assert message in capsys.readouterr().err
    for command in (["search", "x.toml"], ["evaluate", "x.toml"], ["study", "rank"]):
        with pytest.raises(SystemExit) as exit_:  # searches wrote into the current directory
            main([*command, "--out", ""])
        assert exit_.value.code == 2 and "must not be empty" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    from kernelstudy.train import TrainConfig

    with pytest.raises(ValueError, match="out_dir must not be empty"):
        TrainConfig(out_dir="")
    with pytest.raises(TypeError, match="out_dir must be a path"):
        TrainConfig(out_dir=5)
    assert TrainConfig(out_dir=tmp_path).out_dir == str(tmp_path)


def test_compile_flag_trains_the_model_compiled(listops: Path, tmp_path: Path) -> None:
    """``--compile`` sets ``[train] compile``: the run's steps go through the model compiled
    whole (the resolved settings say so), and it trains and scores as a plain run does."""
    out = tmp_path / "compiled"
    assert main(listops_args(listops, out, "--compile", "--steps", "3")) == 0
    settings = json.loads((out / "config.json").read_text())
    assert settings["train"]["compile"] is True
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and 0.0 <= summary["test_accuracy"] <= 1.0


def test_help_gives_the_defaults_that_apply_and_what_is_required(capsys) -> None:
    """``train --help`` named no default (the flags default to None, so that --config's values
    stand) and listed --task and --out as optional. Each default it names is the one a run
    without the flag takes (TrainConfig's, the models')."""
    import inspect
    import re

    from kernelstudy.nn.models import CausalLM, SequenceClassifier
    from kernelstudy.train import TrainConfig

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    defaults = TrainConfig()
    for flag, value in {
        "--steps": defaults.steps,
        "--batch-size": defaults.batch_size,
        "--lr": f"{defaults.lr:g}",
        "--seed": defaults.seed,
        "--eval-every": defaults.eval_every,
    }.items():
        assert re.search(rf"{flag} [A-Z_]+ [^()]*\([^()]*default {value}\)", text), flag
    for model in (SequenceClassifier, CausalLM):
        params = inspect.signature(model).parameters
        for flag, name in (
            ("--d-model", "d_model"),
            ("--heads", "n_heads"),
            ("--layers", "n_layers"),
        ):
            assert re.search(
                rf"{flag} [A-Z_]+ [^()]*\([^()]*default {params[name].default}\)", text
            ), flag
    for flag in ("--task", "--out"):
        assert re.search(rf"{flag} \S+ [^()]*\(required: here or in --config\)", text), flag


def test_a_run_without_a_bar_prints_a_line_per_evaluation(tmp_path, capsys) -> None:
    """Outside a terminal (a batch job's log) the bar is off, and a run said nothing until
    it ended. It prints a line per evaluation now; ``--no-progress`` and ``[train] progress =
    false`` keep it quiet."""
    command = [
        "train", "--task", "copy", "--task-arg", "seq_len=8", "--task-arg", "num_samples=32",
        "--d-model", "8", "--heads", "2", "--layers", "1", "--steps", "4", "--eval-every", "2",
        "--batch-size", "4", "--device", "cpu",
    ]  # fmt: skip
    assert main([*command, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 2/4", "step 4/4"], err
    assert all("train_loss" in line and "val_accuracy" in line for line in lines), err
    assert main([*command, "--no-progress", "--out", str(tmp_path / "b")]) == 0
    assert "step 2/4" not in capsys.readouterr().err
    quiet = tmp_path / "quiet.toml"  # [train] progress = false: as --no-progress
    quiet.write_text("[train]\nprogress = false\n")
    assert main([*command, "--config", str(quiet), "--out", str(tmp_path / "c")]) == 0
    assert "step 2/4" not in capsys.readouterr().err


def test_a_refused_training_value_names_its_flag(capsys) -> None:
    """``--steps 0`` said "steps must be an int >= 1", naming the field, not the flag typed."""
    for flag, value in (("--steps", "0"), ("--batch-size", "0"), ("--lr", "-1")):
        assert main(["train", "--task", "copy", flag, value, "--out", "x"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"kernelstudy train: error: {flag}: "), err
        assert "in --config)" in err, err
