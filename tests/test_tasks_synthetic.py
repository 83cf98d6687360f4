"""Synthetic LM tasks: copy and multi-query associative recall are well-formed and solvable."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kernelstudy.tasks import CopyTask, MQARTask, load_task


def test_copy_layout_targets_and_loss_mask() -> None:
    ds = load_task("copy", split="train", num_samples=200)
    assert (ds.vocab_size, ds.num_classes, ds.max_length, ds.pad_id, ds.pairs) == (
        12,
        None,
        128,
        0,
        False,
    )
    lengths = set()
    for i in range(len(ds)):
        item = ds[i]
        x, y, loss, mask = item["input_ids"], item["targets"], item["loss_mask"], item["mask"]
        assert x.shape == y.shape == loss.shape == mask.shape == (128,)
        assert torch.equal(y[:-1], x[1:]) and y[-1] == 0
        n = int(loss.sum())
        lengths.add(n)
        assert ds.min_copy <= n <= ds.max_copy == 63
        assert x[0] == 1 and x[n + 1] == 1  # separators
        symbols = x[1 : n + 1]
        assert ((symbols >= 2) & (symbols < 12)).all()
        assert torch.equal(x[n + 2 : 2 * n + 2], symbols)
        assert (x[2 * n + 2 :] == 0).all() and int(mask.sum()) == 2 * n + 2
        # The scored targets are exactly the copy, in order.
        assert torch.equal(y[loss], symbols)
        assert loss.nonzero().flatten().tolist() == list(range(n + 1, 2 * n + 1))
    assert len(lengths) > 10  # variable copy lengths


def test_copy_is_solved_by_a_copying_rule() -> None:
    """Predicting x[t - n] (t within the second copy) reaches 100% on the scored positions."""
    ds = CopyTask(num_samples=50, seq_len=32, n_symbols=4, min_copy=15, max_copy=15)
    batch = ds.collate([ds[i] for i in range(len(ds))])
    n = 15
    pred = torch.roll(batch["input_ids"], shifts=n, dims=1)  # pred[t] = x[t - n]
    loss = batch["loss_mask"]
    # At position t the model must emit x[t+1] = x[t+1-(n+1)] = x[t-n].
    assert torch.equal(pred[loss], batch["targets"][loss])


def test_copy_seeds_splits_and_errors() -> None:
    a, b = CopyTask(num_samples=10, seed=3), CopyTask(num_samples=10, seed=3)
    assert torch.equal(a[4]["input_ids"], b[4]["input_ids"])
    assert not torch.equal(a[4]["input_ids"], CopyTask(num_samples=10, seed=4)[4]["input_ids"])
    val = CopyTask("val", num_samples=10, seed=3)
    assert not torch.equal(a[4]["input_ids"], val[4]["input_ids"])
    assert len(CopyTask("test")) == 1000
    with pytest.raises(ValueError, match="max_copy"):
        CopyTask(seq_len=16, max_copy=8)
    with pytest.raises(ValueError, match="min_copy"):
        CopyTask(min_copy=10, max_copy=5)
    with pytest.raises(ValueError, match="split"):
        CopyTask("dev")
    with pytest.raises(ValueError, match="num_samples"):
        CopyTask(num_samples=0)


def test_copy_defaults_and_numpy_sizes() -> None:
    """``min_copy`` defaults to a quarter of ``max_copy`` (the docstring said of the room);
    a numpy ``n_symbols`` gave a numpy ``vocab_size`` that ``json.dumps(info())`` refused."""
    lengths = CopyTask(num_samples=400, seq_len=66, max_copy=12).masks.sum(1) // 2 - 1
    assert lengths.min() == 3 and lengths.max() == 12  # 12 // 4 to 12
    task = CopyTask(num_samples=4, n_symbols=np.int64(4))
    assert type(task.vocab_size) is int and json.loads(json.dumps(task.info()))["vocab_size"] == 6


def test_mqar_queries_are_answered_by_their_values() -> None:
    ds = load_task("mqar", split="val", seq_len=48, num_kv_pairs=6, vocab_size=40, num_samples=300)
    assert (ds.vocab_size, ds.num_classes, ds.max_length) == (40, None, 48)
    n_keys = (40 - 2) // 2
    for i in range(len(ds)):
        item = ds[i]
        x, y, loss = item["input_ids"], item["targets"], item["loss_mask"]
        keys, values = x[0:12:2], x[1:12:2]
        assert len(set(keys.tolist())) == 6
        assert ((keys >= 2) & (keys < 2 + n_keys)).all()
        assert ((values >= 2 + n_keys) & (values < 40)).all()
        assert torch.equal(y[:-1], x[1:]) and item["mask"].all()
        answer = dict(zip(keys.tolist(), values.tolist(), strict=True))
        queries = loss.nonzero().flatten()
        assert len(queries) == 6 and (queries >= 12).all()
        assert (queries[1:] - queries[:-1] >= 2).all()  # pairs do not overlap
        assert len(set(x[queries].tolist())) == 6  # each key asked once
        for t in queries.tolist():
            assert y[t].item() == answer[x[t].item()]
        filler = torch.ones(48, dtype=torch.bool)
        filler[:12] = False
        filler[queries] = False
        filler[queries + 1] = False
        assert (x[filler] == 1).all()


def test_mqar_configuration_errors() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        MQARTask(seq_len=20, num_kv_pairs=6)
    with pytest.raises(ValueError, match="num_queries"):
        MQARTask(num_kv_pairs=4, num_queries=5)
    with pytest.raises(ValueError, match="vocab_size"):
        MQARTask(num_kv_pairs=8, vocab_size=10)
    few = MQARTask(num_kv_pairs=8, num_queries=2, num_samples=5)
    assert int(few[0]["loss_mask"].sum()) == 2


def test_synthetic_token_ids_are_held_compact_and_come_out_as_int64():
    """The (N, L) ids were held as int64: 8 bytes a token where Copy's 12 ids need one byte
    and MQAR's 8192 two. Items are int64 as before, and the same sequences."""
    copy = CopyTask("train", seq_len=64, n_symbols=10, num_samples=50, seed=3)
    mqar = MQARTask("train", seq_len=64, num_kv_pairs=8, vocab_size=8192, num_samples=50, seed=3)
    big = MQARTask("train", seq_len=16, num_kv_pairs=2, vocab_size=70_000, num_samples=5)
    assert (copy.inputs.dtype, mqar.inputs.dtype, big.inputs.dtype) == (
        np.uint8,
        np.uint16,
        np.uint32,
    )
    for task in (copy, mqar, big):
        item = task[len(task) - 1]
        assert item["input_ids"].dtype == item["targets"].dtype == torch.int64
        assert int(item["input_ids"].max()) < task.vocab_size
        assert torch.equal(item["targets"][:-1], item["input_ids"][1:])
    assert int(big.inputs.max()) > 2**16  # ids above uint16 kept
