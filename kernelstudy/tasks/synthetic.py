"""Synthetic causal-LM tasks: sequence copy and multi-query associative recall (MQAR).

Both are generated up front from ``seed`` and the split (each split its own
stream), so with the same options an index always gives the same sequence (other
options, ``num_samples`` included, draw other sequences). Items follow the LM
interface of ``base``: ``input_ids``, ``targets`` (the next token), ``loss_mask``
(the positions scored) and ``mask`` (real tokens), all (L,).
"""

from __future__ import annotations

import numpy as np
import torch

from ..arguments import check_count
from .base import SPLITS, SequenceTask, check_split

DEFAULT_SAMPLES = {"train": 10_000, "val": 1_000, "test": 1_000}


def _rng(seed: int, split: str) -> np.random.Generator:
    return np.random.default_rng([check_count("seed", seed, 0), SPLITS.index(split)])


def _num_samples(num_samples: int | None, split: str) -> int:
    if num_samples is None:
        return DEFAULT_SAMPLES[split]
    return check_count("num_samples", num_samples, 1)


def _compact(x: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids ``x`` in the smallest unsigned dtype that holds ``vocab_size`` ids (uint8 for
    Copy, uint16 for MQAR's 8192): 1/8 to 1/4 of int64's memory; items come out int64."""
    return x.astype(np.min_scalar_type(vocab_size - 1))


class _LMTask(SequenceTask):
    """Holds generated ``inputs`` (N, L) and derives targets by shifting."""

    num_classes = None
    pad_id = 0
    inputs: np.ndarray  # (N, L) token ids, the smallest unsigned dtype (see _compact)
    loss_masks: np.ndarray  # (N, L) bool
    masks: np.ndarray  # (N, L) bool

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x = torch.from_numpy(self.inputs[index].astype(np.int64))
        targets = torch.full_like(x, self.pad_id)
        targets[:-1] = x[1:]
        return {
            "input_ids": x,
            "targets": targets,
            "loss_mask": torch.from_numpy(self.loss_masks[index]),
            "mask": torch.from_numpy(self.masks[index]),
        }


class CopyTask(_LMTask):
    """Copy a random symbol sequence: ``SEP s_1 … s_n SEP s_1 … s_n PAD …``.

    Tokens: 0 pad, 1 separator, 2 … ``n_symbols`` + 1 the symbols. The copy length
    n is uniform in [``min_copy``, ``max_copy``]; ``max_copy`` defaults to all of the
    room, ``(seq_len - 2) // 2``, ``min_copy`` to a quarter of ``max_copy`` (at least 1).
    Each split draws its own examples; at small settings two splits share many. The loss
    covers the predictions of the second copy: positions n+1 … 2n, whose targets are
    s_1 … s_n. The setting of
    "Transformers are RNNs" is ``seq_len=128, n_symbols=10``.
    """

    name = "copy"
    vocabulary_options = ("n_symbols",)

    def __init__(
        self,
        split: str = "train",
        seq_len: int = 128,
        n_symbols: int = 10,
        num_samples: int | None = None,
        min_copy: int | None = None,
        max_copy: int | None = None,
        seed: int = 0,
    ) -> None:
        check_split(split)
        self.max_length = check_count("seq_len", seq_len, 4)
        self.n_symbols = check_count("n_symbols", n_symbols, 1)
        self.vocab_size = self.n_symbols + 2
        self.separator_id = 1
        room = (self.max_length - 2) // 2
        hi = room if max_copy is None else check_count("max_copy", max_copy, 1)
        lo = max(1, hi // 4) if min_copy is None else check_count("min_copy", min_copy, 1)
        if not lo <= hi <= room:
            raise ValueError(
                f"need 1 <= min_copy <= max_copy <= (seq_len - 2) // 2 = {room}, "
                f"got min_copy={lo}, max_copy={hi}"
            )
        self.min_copy, self.max_copy = lo, hi
        n = _num_samples(num_samples, split)

        rng = _rng(seed, split)
        length = rng.integers(lo, hi + 1, size=(n, 1))
        symbols = rng.integers(2, n_symbols + 2, size=(n, hi))
        pos = np.arange(seq_len)[None, :]
        first = (pos >= 1) & (pos <= length)
        second = (pos >= length + 2) & (pos < 2 * length + 2)
        index = np.where(first, pos - 1, np.where(second, pos - length - 2, 0))
        copied = np.take_along_axis(symbols, np.minimum(index, hi - 1), axis=1)
        x = np.where(first | second, copied, self.pad_id)
        x[(pos == 0) | (pos == length + 1)] = self.separator_id
        self.inputs = _compact(x, self.vocab_size)
        self.loss_masks = (pos >= length + 1) & (pos <= 2 * length)
        self.masks = pos < 2 * length + 2


class MQARTask(_LMTask):
    """Multi-query associative recall: key-value pairs, then queries answered by their values.

    Layout: ``k_1 v_1 … k_D v_D`` then, in the remaining ``seq_len - 2D`` positions,
    ``num_queries`` (default D) of the keys, each followed by its value, at random
    non-overlapping places; other places hold the blank token. Tokens: 0 pad
    (unused), 1 blank, keys ``[2, 2 + K)``, values ``[2 + K, vocab_size)`` with
    ``K = (vocab_size - 2) // 2``. Keys are distinct within a sequence. The loss
    covers the query positions (target: the value).
    """

    name = "mqar"
    vocabulary_options = ("vocab_size",)

    def __init__(
        self,
        split: str = "train",
        seq_len: int = 64,
        num_kv_pairs: int = 8,
        num_queries: int | None = None,
        vocab_size: int = 8192,
        num_samples: int | None = None,
        seed: int = 0,
    ) -> None:
        check_split(split)
        self.max_length = check_count("seq_len", seq_len, 1)
        d = check_count("num_kv_pairs", num_kv_pairs, 1)
        q = d if num_queries is None else check_count("num_queries", num_queries, 1)
        self.vocab_size = check_count("vocab_size", vocab_size, 4)
        n_keys = (vocab_size - 2) // 2
        n_values = vocab_size - 2 - n_keys
        if q > d:
            raise ValueError(f"num_queries ({q}) must be <= num_kv_pairs ({d})")
        if d > n_keys:
            raise ValueError(f"num_kv_pairs ({d}) needs vocab_size >= {2 * d + 2}")
        if 2 * d + 2 * q > seq_len:
            raise ValueError(
                f"seq_len ({seq_len}) must hold {d} pairs and {q} queries: >= {2 * d + 2 * q}"
            )
        self.num_kv_pairs, self.num_queries = d, q
        self.blank_id = 1
        n = _num_samples(num_samples, split)

        rng = _rng(seed, split)
        keys = np.stack([rng.choice(n_keys, size=d, replace=False) for _ in range(n)]) + 2
        values = rng.integers(0, n_values, size=(n, d)) + 2 + n_keys
        x = np.full((n, seq_len), self.blank_id, dtype=np.int64)
        x[:, 0 : 2 * d : 2] = keys
        x[:, 1 : 2 * d : 2] = values
        # Query places: q sorted draws from the shrunk region, spread out by their rank.
        room = seq_len - 2 * d - q
        slots = np.sort(np.argsort(rng.random((n, room)), axis=1)[:, :q], axis=1)
        starts = 2 * d + slots + np.arange(q)
        asked = np.argsort(rng.random((n, d)), axis=1)[:, :q]
        rows = np.arange(n)[:, None]
        x[rows, starts] = keys[rows, asked]
        x[rows, starts + 1] = values[rows, asked]
        self.inputs = _compact(x, self.vocab_size)
        self.loss_masks = np.zeros_like(x, dtype=bool)
        self.loss_masks[rows, starts] = True
        self.masks = np.ones_like(x, dtype=bool)
