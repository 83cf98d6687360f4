"""The model that fits a task: classifier, two-tower matcher or causal LM."""

from __future__ import annotations

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


def model_for_task(task: Any, **model_kwargs: Any) -> nn.Module:
    """Build the model for ``task`` with its vocabulary, classes and ``max_len``.

    ``model_kwargs`` go to :class:`SequenceClassifier`, :class:`MatchingClassifier` or
    :class:`CausalLM` (e.g. ``d_model``, ``attention``, ``feature_map``, ``pooling``).
    """
    kind = task_type_of(task)
    model_kwargs.setdefault("max_len", int(getattr(task, "max_length", 4096)))
    if kind == "lm":
        return CausalLM(task.vocab_size, **model_kwargs)
    cls = MatchingClassifier if kind == "matching" else SequenceClassifier
    return cls(task.vocab_size, task.num_classes, **model_kwargs)
