"""Learning-rate schedules: linear warm-up, then constant, linear, cosine or inverse-sqrt decay."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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
        if not isinstance(self.total_steps, int) or self.total_steps < 1:
            raise ValueError(f"total_steps must be a positive int, got {self.total_steps!r}")
        if not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps:
            raise ValueError(f"warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_ratio!r}")

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
