"""The shared interface of every task, and the packed token storage the loaders use.

A task is a ``torch.utils.data.Dataset`` whose items are dicts of tensors, all
padded to the task's fixed ``max_length`` (call it L):

- classification (``num_classes`` set, ``pairs`` False): ``input_ids`` (L,) long,
  ``mask`` (L,) bool (True = real token), ``label`` () long;
- document pairs (``pairs`` True): ``input_ids_1``, ``mask_1``, ``input_ids_2``,
  ``mask_2`` (L,) each, ``label`` () long;
- causal language modelling (``num_classes`` None): ``input_ids`` (L,),
  ``targets`` (L,) long (the next token at every position), ``loss_mask`` (L,)
  bool (the positions scored), ``mask`` (L,) bool.

``collate`` stacks items into a batch: every tensor gains a leading batch dim B.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

SPLITS = ("train", "val", "test")


class SequenceTask(Dataset):
    """Base class of all tasks; subclasses set the attributes and implement the item access."""

    name: str = ""
    vocab_size: int
    num_classes: int | None
    max_length: int
    pad_id: int
    pairs: bool = False
    #: options that divide one pool of samples into train/val/test: they must be the
    #: same for every split, or the splits would overlap
    partition_options: tuple[str, ...] = ()
    #: options that say what tokens or labels mean: the same for every split, or the model
    #: (sized by the train split) would read the other splits' tokens as other ones
    vocabulary_options: tuple[str, ...] = ()
    #: True on a ``val`` split that reads the test data (data without a validation split):
    #: what is chosen on it (a search's trials, the best checkpoint) is chosen on the test set
    val_reads_test: bool = False

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    @staticmethod
    def collate(items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Stack a list of items: each ``(L,)`` tensor becomes ``(B, L)``, each label ``(B,)``."""
        if not items:
            raise ValueError("collate needs at least one item")
        return {key: torch.stack([item[key] for item in items]) for key in items[0]}

    def info(self) -> dict[str, object]:
        """The interface attributes as a plain dict (for logs and run records)."""
        return {
            "task": self.name,
            "vocab_size": self.vocab_size,
            "num_classes": self.num_classes,
            "max_length": self.max_length,
            "pad_id": self.pad_id,
            "pairs": self.pairs,
            "size": len(self),
        }

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.info().items() if k != "task")
        return f"{type(self).__name__}({fields})"


def check_split(split: str) -> str:
    """``split`` if it is one of train/val/test, else a ValueError."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    return split


class PackedSequences:
    """Variable-length token sequences stored in one flat array plus offsets.

    Sequence ``i`` is ``data[offsets[i]:offsets[i + 1]]``. Far smaller than a list of
    arrays when there are many sequences. Token ids must be integers that ``dtype`` holds
    (else ValueError/TypeError: a cast would wrap 300 to 44 in uint8).
    """

    def __init__(self, sequences: Sequence[np.ndarray | bytes], dtype: type = np.uint8) -> None:
        arrays = [
            np.frombuffer(s, dtype=np.uint8) if isinstance(s, bytes) else np.asarray(s)
            for s in sequences
        ]
        lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
        self.offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self.offsets[1:])
        # empty sequences left out: np.asarray([]) is float64
        data = np.concatenate([a for a in arrays if a.size] or [np.zeros(0, dtype)])
        if data.dtype.kind not in "iu":
            raise TypeError(f"sequences must hold integer token ids, got dtype {data.dtype}")
        limits = np.iinfo(dtype)
        checked = np.can_cast(data.dtype, dtype) or not data.size  # every value fits
        if not checked and (data.min() < limits.min or data.max() > limits.max):
            raise ValueError(
                f"token ids in [{data.min()}, {data.max()}] do not fit dtype "
                f"{np.dtype(dtype).name} ([{limits.min}, {limits.max}])"
            )
        self.data = data.astype(dtype, copy=False)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        i = operator.index(index)
        n = len(self)
        if i < 0:  # offsets[-1] is the end, not the last sequence's start
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {index} is out of range for {n} sequences")
        return self.data[self.offsets[i] : self.offsets[i + 1]]

    def lengths(self) -> np.ndarray:
        """(N,) int64 length of every sequence."""
        return np.diff(self.offsets)

    @classmethod
    def from_flat(cls, data: np.ndarray, offsets: np.ndarray) -> PackedSequences:
        """Sequences already packed: ``data`` (T,) integers, ``offsets`` (N+1,) from 0 to T."""
        offsets = np.asarray(offsets, dtype=np.int64)
        if data.ndim != 1 or data.dtype.kind not in "iu":
            raise TypeError(f"data must be a 1-D integer array, got {data.dtype} {data.shape}")
        if offsets.ndim != 1 or not len(offsets) or offsets[0] != 0 or offsets[-1] != len(data):
            raise ValueError(f"offsets must run from 0 to len(data) = {len(data)}")
        if (np.diff(offsets) < 0).any():
            raise ValueError("offsets must not decrease")
        packed = cls.__new__(cls)
        packed.data, packed.offsets = data, offsets
        return packed


class PackedBytesBuilder:
    """Byte strings packed as they are read, into one growing buffer.

    A list of ``bytes`` then a concatenation holds every document twice at its peak
    (2.4 GB for LRA Retrieval's training pairs); this holds them once, plus the
    buffer's growth margin. ``build`` hands the buffer over without a copy.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._ends = [0]

    def append(self, sequence: bytes | memoryview) -> None:
        """Add one sequence (its bytes are the token ids)."""
        self._buffer += sequence
        self._ends.append(len(self._buffer))

    def __len__(self) -> int:
        return len(self._ends) - 1

    def build(self) -> PackedSequences:
        """The packed sequences, uint8; the builder is then empty."""
        data = (
            np.frombuffer(self._buffer, dtype=np.uint8) if self._buffer else np.zeros(0, np.uint8)
        )
        packed = PackedSequences.from_flat(data, np.asarray(self._ends, dtype=np.int64))
        self._buffer, self._ends = bytearray(), [0]
        return packed


def pad_tokens(
    ids: np.ndarray, max_length: int, pad_id: int, offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncate/pad ``ids + offset`` to ``max_length``.

    Returns ``input_ids`` (L,) long and ``mask`` (L,) bool, True on real tokens.
    """
    n = min(len(ids), max_length)
    input_ids = torch.full((max_length,), pad_id, dtype=torch.long)
    input_ids[:n] = torch.from_numpy(ids[:n].astype(np.int64)) + offset
    mask = torch.zeros(max_length, dtype=torch.bool)
    mask[:n] = True
    return input_ids, mask
