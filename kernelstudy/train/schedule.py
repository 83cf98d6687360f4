"""Learning-rate schedules: linear warm-up, then constant, linear, cosine or inverse-sqrt decay."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..arguments import check_count, check_real

SCHEDULES = ("constant", "linear", "cosine", "inverse_sqrt")


@dataclass(frozen=True)
class WarmupDecay:
    """The LR multiplier at optimizer step ``s`` (0-based), a pure function of ``s``.

    Warm-up: ``(s+1)/warmup_steps`` for ``s < warmup_steps``. Then, with progress
    ``p = (s - warmup) / (total_steps - warmup)`` in [0, 1]: ``constant`` 1,
    ``linear`` 1 - p, ``cosine`` (1 + cos πp)/2, each rescaled to ``[min_ratio, 1]``
    as ``min_ratio + (1 - min_ratio)·decay`` (so they reach ``min_ratio`` at
    ``total_steps``); ``inverse_sqrt``
    ``sqrt(max(warmup, 1) / (s + 1))``, floored at ``min_ratio``.
    """

    schedule: str
    warmup_steps: int
    total_steps: int
    min_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        check_count("total_steps", self.total_steps, 1)
        check_count("warmup_steps", self.warmup_steps, 0)
        if check_real("min_ratio", self.min_ratio) > 1.0:
            raise ValueError(f"min_ratio must be in [0, 1], got {self.min_ratio!r}")

    def __call__(self, step: int) -> float:
        w = self.warmup_steps
        if step < w:
            return (step + 1) / w
        if self.schedule == "inverse_sqrt":
            return max(self.min_ratio, math.sqrt(max(w, 1) / (step + 1)))
        p = min(1.0, (step - w) / max(1, self.total_steps - w))
        if self.schedule == "constant":
            decay = 1.0
        elif self.schedule == "linear":
            decay = 1.0 - p
        else:
            decay = 0.5 * (1.0 + math.cos(math.pi * p))
        return self.min_ratio + (1.0 - self.min_ratio) * decay


def make_scheduler(
    optimizer: torch.optim.Optimizer,
    schedule: str,
    warmup_steps: int,
    total_steps: int,
    min_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR driven by :class:`WarmupDecay`; call ``.step()`` after every optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupDecay(schedule, warmup_steps, total_steps, min_ratio)
    )
