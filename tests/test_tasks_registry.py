"""The task registry and the shared interface: names, options, paths, batching."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from kernelstudy.tasks import (
    SequenceTask,
    list_tasks,
    load_task,
    needs_path,
    split_options,
    task_options,
    write_listops,
)


def test_names() -> None:
    assert list_tasks() == ["listops", "text", "retrieval", "image", "pathfinder", "copy", "mqar"]
    assert not needs_path("copy") and needs_path("image")
    assert "max_length" in task_options("listops") and "seq_len" in task_options("copy")


def test_bad_configurations_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="did you mean 'listops'"):
        load_task("listop", tmp_path)
    with pytest.raises(ValueError, match="unknown option"):
        load_task("copy", num_symbols=3)
    with pytest.raises(
        TypeError, match=r"task name must be a str such as 'listops', got \['copy'\]"
    ):
        load_task(["copy"])
    with pytest.raises(ValueError, match="split"):
        load_task("listops", tmp_path, "validation")
    with pytest.raises(ValueError, match="needs a data path"):
        load_task("text")
    with pytest.raises(ValueError, match="synthetic"):
        load_task("mqar", tmp_path)
    for name in ("listops", "text", "retrieval", "image", "pathfinder"):
        with pytest.raises(FileNotFoundError):
            load_task(name, tmp_path / "missing")


def test_per_split_options_override_the_shared_ones(tmp_path: Path) -> None:
    options = {"seq_len": 6, "num_samples": 40, "val": {"num_samples": 3}, "test": {}}
    sizes = {split: len(load_task("copy", split=split, **options)) for split in ("train", "val")}
    assert sizes == {"train": 40, "val": 3}
    assert load_task("copy", split="test", **options).max_length == 6
    assert split_options("copy", options, "val") == {"seq_len": 6, "num_samples": 3}
    # Every split's table is checked, not only the one being loaded.
    with pytest.raises(ValueError, match=r"unknown option\(s\) val.samples for task 'copy'"):
        load_task("copy", split="train", val={"samples": 3})
    with pytest.raises(ValueError, match="'test' must be a table of options for the test split"):
        load_task("copy", split="train", test=5)
    with pytest.raises(ValueError, match="split must be one of"):
        split_options("copy", {}, "dev")
    write_listops(tmp_path, n_train=12, n_val=4, n_test=4, min_length=20, max_length=40, seed=0)
    short = load_task("listops", tmp_path, "val", max_length=2000, val={"max_length": 25})
    assert short.max_length == 25 and short[0]["input_ids"].shape == (25,)
    assert load_task("listops", tmp_path, "train", val={"max_length": 25}).max_length == 2000


@pytest.mark.parametrize(
    ("name", "option", "value"), [("pathfinder", "split_seed", 1), ("image", "val_fraction", 0.2)]
)
def test_options_that_divide_the_samples_are_refused_per_split(name, option, value):
    """A per-split ``split_seed`` gave a val split 9/10 of whose images were in train."""
    for split in ("train", "val", "test"):
        with pytest.raises(ValueError, match=f"task option val.{option}: .*splits overlap"):
            split_options(name, {"val": {option: value}}, split)
    assert split_options(name, {option: value}, "val") == {option: value}


@pytest.mark.parametrize(
    ("name", "option", "value"),
    [
        ("mqar", "vocab_size", 64),
        ("copy", "n_symbols", 4),
        ("text", "num_classes", 3),
        # LRA's inputs: a model trained on one token stream, scored on another
        ("listops", "closing_brackets", False),
        ("image", "zero_is_padding", True),
        ("pathfinder", "zero_is_padding", True),
    ],
)
def test_options_that_say_what_tokens_mean_are_refused_per_split(name, option, value):
    """A per-split MQAR vocab_size trained and scored on different token meanings (val
    accuracy 0.002, no error)."""
    for split in ("train", "val", "test"):
        with pytest.raises(ValueError, match=f"task option test.{option}: .*tokens or labels"):
            split_options(name, {"test": {option: value}}, split)
    assert split_options(name, {option: value}, "test") == {option: value}


@pytest.mark.parametrize("name", ["listops", "copy", "mqar"])
def test_every_task_batches_through_a_dataloader(tmp_path: Path, name: str) -> None:
    if name == "listops":
        write_listops(tmp_path, 8, 1, 1, min_length=10, max_length=50, seed=0)
        task = load_task(name, tmp_path, "train", max_length=64)
    else:
        task = load_task(name, num_samples=8)
    assert isinstance(task, SequenceTask)
    batch = next(iter(DataLoader(task, batch_size=4, collate_fn=task.collate)))
    assert batch["input_ids"].shape == (4, task.max_length)
    assert batch["input_ids"].dtype == torch.long and batch["mask"].dtype == torch.bool
    assert int(batch["input_ids"].max()) < task.vocab_size
    if task.num_classes is None:
        assert batch["targets"].shape == batch["loss_mask"].shape == (4, task.max_length)
    else:
        assert batch["label"].shape == (4,)
    assert task.info()["size"] == 8


def test_options_that_are_not_a_mapping_are_a_type_error() -> None:
    """A list of options failed as "'list' object has no attribute 'items'"."""
    with pytest.raises(TypeError, match=r"options must be a mapping of task options, got \["):
        split_options("copy", ["seq_len", 6], "train")
