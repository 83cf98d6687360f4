"""Training batches with a resumable position: epoch after epoch, reproducible order."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler
from torch.utils.data.dataloader import default_collate

from ..arguments import check_count, check_flag
from .checkpoint import MAX_SEED, get_rng_state, set_rng_state


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of ``epoch``'s data order: one per (seed, epoch), in the 32 bits
    that torch's CPU generator keeps of a seed (a larger one was cut to them anyway)."""
    return (seed * 1_000_003 + epoch) % 2**32


class EpochBatchSampler(Sampler[list[int]]):
    """Batches of indices whose order in epoch ``e`` is a pure function of ``(seed, e)``.

    Set ``epoch`` and ``start`` (the first batch to yield) before iterating; a
    resumed run then skips consumed batches without loading them.
    """

    def __init__(
        self, size: int, batch_size: int, seed: int, shuffle: bool = True, drop_last: bool = True
    ) -> None:
        if isinstance(size, int) and not isinstance(size, bool) and size == 0:
            raise ValueError("the training data is empty")
        self.size = check_count("size", size, 1)
        self.batch_size = check_count("batch_size", batch_size, 1)
        self.seed = check_count("seed", seed, 0, MAX_SEED)
        self.shuffle = check_flag("shuffle", shuffle)
        self.drop_last = check_flag("drop_last", drop_last) and size >= batch_size
        self.epoch, self.start = 0, 0

    def __len__(self) -> int:
        full, rest = divmod(self.size, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[list[int]]:
        # built eagerly, so ``start`` is read when the DataLoader iterator is created
        if self.shuffle:
            g = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
            order = torch.randperm(self.size, generator=g).tolist()
        else:
            order = list(range(self.size))
        b = self.batch_size
        batches = [order[i * b : (i + 1) * b] for i in range(len(self))]
        return iter(batches[self.start :])


def _collate_of(dataset: Any) -> Any:
    return getattr(dataset, "collate", None) or default_collate


def make_loader(
    data: Dataset | DataLoader,
    batch_size: int,
    seed: int = 0,
    shuffle: bool = True,
    num_workers: int = 0,
    name: str = "train_data",
    drop_last: bool | None = None,
) -> DataLoader:
    """``data`` itself if it is a DataLoader, else a DataLoader over the Dataset: shuffled
    through :class:`EpochBatchSampler` (training) or in order (evaluation). ``drop_last``
    (default: ``shuffle``) drops a last partial batch."""
    if isinstance(data, DataLoader):
        return data
    check_count("batch_size", batch_size, 1)
    check_count("seed", seed, 0, MAX_SEED)
    check_flag("shuffle", shuffle)
    drop_last = shuffle if drop_last is None else check_flag("drop_last", drop_last)
    check_count("num_workers", num_workers, 0)
    if not isinstance(data, Dataset):
        raise TypeError(f"{name} must be a torch Dataset or DataLoader, got {type(data).__name__}")
    generator = torch.Generator().manual_seed(seed)
    if isinstance(data, IterableDataset):
        return DataLoader(data, batch_size=batch_size, collate_fn=_collate_of(data))
    if len(data) == 0:
        raise ValueError(f"{name} is empty")
    sampler = EpochBatchSampler(len(data), batch_size, seed, shuffle=shuffle, drop_last=drop_last)
    return DataLoader(
        data,
        batch_sampler=sampler,
        collate_fn=_collate_of(data),
        num_workers=num_workers,
        generator=generator,
        worker_init_fn=shielded_worker if num_workers else None,
        multiprocessing_context=worker_context() if num_workers else None,
    )


def worker_context() -> mp.context.BaseContext | None:
    """How the DataLoader's workers start: ``fork`` on Linux where no start method was
    chosen (Python up to 3.13's default there), else Python's default (None).

    Python 3.14 starts workers on Linux through a forkserver process in the training
    process's group, and a SIGTERM to the group (``timeout``, a scheduler) killed it: the
    workers' pipes closed, the run failed ("DataLoader worker exited unexpectedly") and kept
    no checkpoint, where it checkpoints and ends as interrupted (:func:`shielded_worker`
    keeps the forked workers out of the signal). A start method set by the program is kept
    (a forked worker's ``__main__`` need not be importable; a spawned one's must)."""
    if not sys.platform.startswith("linux") or mp.get_start_method(allow_none=True) is not None:
        return None
    return mp.get_context("fork")


def shielded_worker(worker_id: int) -> None:
    """A DataLoader ``worker_init_fn``: the worker leaves the training process's group and
    ignores SIGINT, so that a Ctrl-C or a ``timeout`` (both signal the whole group) reach
    the training process alone, which ends its step and saves its checkpoint
    (:class:`~.interrupt.DeferredInterrupt`). A worker that got them died, and the run
    failed with "DataLoader worker exited unexpectedly", its steps since the last
    evaluation lost. Workers still end with the training process (torch's watchdog) and
    when it stops them (SIGTERM to each)."""
    if hasattr(os, "setpgrp"):
        os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _generators(loader: DataLoader) -> list[torch.Generator]:
    found = []
    for owner in (loader, loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
    return found


class BatchStream:
    """Endless batches from ``loader``, epoch after epoch; ``state_dict`` is its position.

    With an :class:`EpochBatchSampler` a resume jumps straight to the position. With
    any other DataLoader it restores the random states seen when the epoch began,
    re-creates the iterator and skips the consumed batches (so the order is exact as
    long as the loader's randomness comes from torch's generators).

    Results do not depend on the number of workers, and a resume is exact, as long as a
    Dataset's items do not draw random numbers (augmentation): with workers, an item's
    draws come from its worker's generator, seeded per worker, not per batch; draw from
    a generator seeded by (seed, epoch, index) instead. The built-in tasks draw none.
    """

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self.epoch, self.batch = 0, 0
        self._it: Iterator | None = None
        self._epoch_rng: dict[str, Any] | None = None

    @property
    def _sampler(self) -> EpochBatchSampler | None:
        bs = self.loader.batch_sampler
        return bs if isinstance(bs, EpochBatchSampler) else None

    def _start_epoch(self, skip: int, fresh: bool) -> None:
        sampler = self._sampler
        if sampler is not None:
            sampler.epoch, sampler.start = self.epoch, skip
            if self.loader.generator is not None:
                self.loader.generator.manual_seed(epoch_seed(sampler.seed, self.epoch))
            self._it = iter(self.loader)
            return
        if fresh:
            self._epoch_rng = {
                "global": get_rng_state(),
                "loader": [g.get_state() for g in _generators(self.loader)],
            }
        elif self._epoch_rng is not None:
            if self.epoch > 0 and self.loader.persistent_workers and self.loader.num_workers:
                # persistent workers draw their base seed once, at the first epoch's iter();
                # later epochs draw only the order: so does this resume's epoch
                iter(self.loader)
            set_rng_state(self._epoch_rng["global"])
            for g, state in zip(_generators(self.loader), self._epoch_rng["loader"], strict=False):
                g.set_state(state)
        self._it = iter(self.loader)
        for _ in range(skip):
            next(self._it)

    def __iter__(self) -> BatchStream:
        return self

    def release(self) -> None:
        """End the worker processes of a loader :func:`make_loader` built (multi-process,
        not persistent): a finished ``fit`` held them, idle, as long as its Trainer lived.
        The next batch starts the loader again at this position (its sampler jumps there)
        and leaves the global random state as it found it. A loader of one's own keeps its
        iterator: a restart would replay its epoch's batches, exact only where all its
        randomness comes from torch's generators (and endless streams would replay all)."""
        if self._it is None or self._sampler is None:
            return
        if not self.loader.num_workers or self.loader.persistent_workers:
            return
        self._it = None  # the iterator's finalizer shuts its workers down

    def __next__(self) -> Any:
        if self._it is None and self.batch > 0:  # release() ended it mid-epoch
            state = get_rng_state()  # a restart replays the epoch's start: keep the present
            try:
                self._start_epoch(self.batch, fresh=False)
            finally:
                set_rng_state(state)
        if self._it is None:
            self._start_epoch(0, fresh=True)
        try:
            batch = next(self._it)
        except StopIteration:
            if self.batch == 0:
                raise ValueError("the training data loader yields no batches") from None
            self.epoch, self.batch = self.epoch + 1, 0
            self._start_epoch(0, fresh=True)
            batch = next(self._it)
        self.batch += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The stream's position (epoch, batch within it) and the RNG state of the epoch's
        order: what :meth:`load_state_dict` resumes from."""
        return {"epoch": self.epoch, "batch": self.batch, "epoch_rng": self._epoch_rng}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Jump to a saved position (call before restoring the current RNG states)."""
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
        self._epoch_rng = state.get("epoch_rng")
        self._it = None
        if self.batch > 0:
            self._start_epoch(self.batch, fresh=False)
