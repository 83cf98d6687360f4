"""The model that fits a task: classifier, two-tower matcher or causal LM."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from ..nn.models import CausalLM, MatchingClassifier, SequenceClassifier


def task_type_of(task: Any) -> str:
    """``matching`` (``task.pairs``), ``lm`` (``task.num_classes`` None) or ``classification``."""
    if not hasattr(task, "num_classes") or not hasattr(task, "vocab_size"):
        raise TypeError(
            "task must have vocab_size and num_classes (a kernelstudy.tasks.SequenceTask), "
            f"got {type(task).__name__}"
        )
    if getattr(task, "pairs", False):
        return "matching"
    return "lm" if task.num_classes is None else "classification"


def longest_split(splits: Iterable[Any]) -> int | None:
    """The length the longest of ``splits`` pads to (their ``max_length``; a val or test
    split may be longer than train's), None when none has one: ``longest`` of
    :func:`model_for_task`."""
    return max((int(getattr(split, "max_length", 0)) for split in splits), default=0) or None


def model_for_task(task: Any, longest: int | None = None, **model_kwargs: Any) -> nn.Module:
    """Build the model for ``task`` with its vocabulary, classes and ``max_len``.

    ``model_kwargs`` go to :class:`SequenceClassifier`, :class:`MatchingClassifier` or
    :class:`CausalLM` (e.g. ``d_model``, ``attention``, ``feature_map``, ``pooling``).
    ``longest``: the length the longest split pads to (a val or test split may be longer
    than ``task``'s); ``max_len`` defaults to it, and a learned encoding's ``max_len`` must
    reach it (else a run fails at its first evaluation, after training has started).
    """
    kind = task_type_of(task)
    own = int(getattr(task, "max_length", 4096))
    if longest is None:
        model_kwargs.setdefault("max_len", own)
    else:
        model_kwargs.setdefault("max_len", max(own, longest))
        if model_kwargs.get("positions") == "learned" and model_kwargs["max_len"] < longest:
            raise ValueError(
                f"model option max_len={model_kwargs['max_len']} is below the length the "
                f"splits pad to (the task's max_length, {longest}), which learned positions "
                "must cover"
            )
    if kind == "lm":
        return CausalLM(task.vocab_size, **model_kwargs)
    cls = MatchingClassifier if kind == "matching" else SequenceClassifier
    return cls(task.vocab_size, task.num_classes, **model_kwargs)
