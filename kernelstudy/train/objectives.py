"""Training objectives: the loss and metric statistics of a model on one batch.

Batches are dicts of tensors with a leading batch dim B (see ``kernelstudy.tasks``):

- ``classification``: ``input_ids`` (B,N), ``mask`` (B,N) bool, ``label`` (B,);
  ``model(input_ids, mask) → (B,C)``.
- ``matching``: ``input_ids_1``, ``mask_1``, ``input_ids_2``, ``mask_2``, ``label``;
  ``model(input_ids_1, mask_1, input_ids_2, mask_2) → (B,C)``.
- ``lm``: ``input_ids`` (B,N), ``targets`` (B,N), optional ``loss_mask`` and ``mask``
  (B,N) bool; ``model(input_ids, mask) → (B,N,V)``; the loss covers ``loss_mask``
  positions (``mask`` when absent, else all).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

TASK_TYPES = ("classification", "matching", "lm")
REQUIRED_KEYS = {
    "classification": ("input_ids", "label"),
    "matching": ("input_ids_1", "input_ids_2", "label"),
    "lm": ("input_ids", "targets"),
}
#: optional mask keys each task type reads
MASK_KEYS = {
    "classification": ("mask",),
    "matching": ("mask_1", "mask_2"),
    "lm": ("loss_mask", "mask"),
}

Batch = Mapping[str, torch.Tensor]


def infer_task_type(batch: Batch) -> str:
    """``matching`` if the batch has ``input_ids_1``, ``lm`` if it has ``targets``, else
    ``classification``."""
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"batches must be dicts of tensors (see kernelstudy.tasks), got {type(batch).__name__}"
        )
    if "input_ids_1" in batch:
        return "matching"
    if "targets" in batch:
        return "lm"
    return "classification"


def check_task_type(task_type: str) -> str:
    """``task_type`` if it is ``"auto"`` or one of :data:`TASK_TYPES`, else ValueError."""
    if task_type not in (*TASK_TYPES, "auto"):
        raise ValueError(f"task_type must be 'auto' or one of {TASK_TYPES}, got {task_type!r}")
    return task_type


def check_classes(name: str, values: torch.Tensor, num_classes: int) -> None:
    """TypeError unless ``values`` are integer class indices, ValueError unless all lie in
    ``[0, num_classes)`` (-100, torch's ignore_index, included: mark such positions with
    ``loss_mask`` instead). Checked here, not deep inside ``cross_entropy`` (a device
    assert on CUDA)."""
    if (
        not isinstance(values, torch.Tensor)
        or values.is_floating_point()
        or values.is_complex()
        or values.dtype == torch.bool
    ):
        kind = values.dtype if isinstance(values, torch.Tensor) else type(values).__name__
        raise TypeError(f"{name} must be an integer tensor of class indices, got {kind}")
    if values.numel() and not (0 <= int(values.min()) and int(values.max()) < num_classes):
        raise ValueError(
            f"{name} must be class indices in [0, {num_classes}), got values in "
            f"[{int(values.min())}, {int(values.max())}]"
        )


class Objective:
    """The loss of ``task_type`` on a batch, plus metric sums for :meth:`summarize`.

    ``objective(model, batch) → (loss, stats)``: ``loss`` the mean cross-entropy (a
    scalar with grad); ``stats`` detached sums ``loss_sum``, ``count`` (examples, or
    scored tokens for LM), ``correct``, and for LM ``seq_correct``/``seq_count``
    (sequences with every scored token right).
    """

    def __init__(self, task_type: str) -> None:
        if task_type not in TASK_TYPES:
            raise ValueError(f"task_type must be one of {TASK_TYPES}, got {task_type!r}")
        self.task_type = task_type

    def __call__(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict]:
        if not isinstance(batch, Mapping):
            raise TypeError(f"batch must be a dict of tensors, got {type(batch).__name__}")
        missing = [k for k in REQUIRED_KEYS[self.task_type] if k not in batch]
        if missing:
            raise ValueError(
                f"a {self.task_type} batch needs key(s) {missing}; got {sorted(batch)}"
            )
        for key in (*REQUIRED_KEYS[self.task_type], *MASK_KEYS[self.task_type]):
            value = batch.get(key)
            if value is not None and not isinstance(value, torch.Tensor):
                raise TypeError(f"batch[{key!r}] must be a tensor, got {type(value).__name__}")
        if self.task_type == "lm":
            return self._lm(model, batch)
        label = batch["label"]
        if label.dim() != 1:  # checked before the model runs
            raise ValueError(f"label must have shape (batch,), got {tuple(label.shape)}")
        if self.task_type == "matching":
            logits = model(
                batch["input_ids_1"], batch.get("mask_1"), batch["input_ids_2"], batch.get("mask_2")
            )
        else:
            logits = model(batch["input_ids"], batch.get("mask"))
        if logits.dim() != 2 or logits.shape[0] != label.shape[0]:
            raise ValueError(
                f"the model must return (batch, classes) logits, got {tuple(logits.shape)}"
            )
        check_classes("label", label, logits.shape[1])
        label = label.long()  # cross_entropy takes int64 (int32 labels come from NumPy)
        loss = F.cross_entropy(logits.float(), label)
        n = torch.tensor(float(label.shape[0]), device=loss.device)
        stats = {
            "loss_sum": loss.detach() * n,
            "count": n,
            # a row with NaN or +inf logits is no prediction (argmax gives its first NaN's
            # class; its loss is NaN); one with -inf logits (classes a model masks) is
            "correct": ((logits.argmax(-1) == label) & _predicts(logits)).sum(),
        }
        return loss, stats

    def _lm(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict]:
        ids, targets = batch["input_ids"], batch["targets"]
        logits = model(ids, batch.get("mask"))
        if logits.shape[:2] != targets.shape:
            raise ValueError(
                f"the model must return (batch, seq, vocab) logits for targets "
                f"{tuple(targets.shape)}, got {tuple(logits.shape)}"
            )
        key = "loss_mask" if "loss_mask" in batch else "mask"
        scored = batch.get(key)
        if scored is None:
            scored = torch.ones_like(targets, dtype=torch.bool)
        elif scored.shape != targets.shape:
            raise ValueError(
                f"{key} must have the targets' shape {tuple(targets.shape)}, "
                f"got {tuple(scored.shape)}"
            )
        scored = scored.bool()
        check_classes("targets", targets[scored], logits.shape[-1])  # unscored: anything
        targets = targets.long().masked_fill(~scored, 0)
        token_loss = F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")
        count = scored.sum()
        loss = (token_loss * scored).sum() / count.clamp_min(1)
        hit = (logits.argmax(-1) == targets) & _predicts(logits)
        right = hit | ~scored
        has_scored = scored.any(1)
        stats = {
            "loss_sum": (token_loss.detach() * scored).sum(),
            "count": count,
            "correct": (hit & scored).sum(),
            "seq_correct": (right.all(1) & has_scored).sum(),
            "seq_count": has_scored.sum(),
        }
        return loss, stats

    @staticmethod
    def summarize(sums: Mapping[str, float]) -> dict[str, float]:
        """Means from the summed stats: ``loss``, ``accuracy`` and (LM) ``sequence_accuracy``."""
        n = max(sums.get("count", 0.0), 1.0)
        out = {"loss": sums.get("loss_sum", 0.0) / n, "accuracy": sums.get("correct", 0.0) / n}
        if "seq_count" in sums:
            out["sequence_accuracy"] = sums["seq_correct"] / max(sums["seq_count"], 1.0)
        return out


def _predicts(logits: torch.Tensor) -> torch.Tensor:
    """``(..., C) → (...)`` bool: rows that make a prediction, without NaN or +inf (-inf,
    a class a model masks, is allowed)."""
    return ~(logits.isnan() | logits.isposinf()).any(-1)
