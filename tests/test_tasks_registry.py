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
    with pytest.raises(ValueError, match="split"):
        load_task("listops", tmp_path, "validation")
    with pytest.raises(ValueError, match="needs a data path"):
        load_task("text")
    with pytest.raises(ValueError, match="synthetic"):
        load_task("mqar", tmp_path)
    for name in ("listops", "text", "retrieval", "image", "pathfinder"):
        with pytest.raises(FileNotFoundError):
            load_task(name, tmp_path / "missing")


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
