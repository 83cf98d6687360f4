"""Metric accumulation, the metrics history (DataFrame/CSV) and peak-memory readings."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ..files import atomic_write_text


class MetricSums:
    """Running sums of per-batch statistics (kept as tensors, so adding never syncs a GPU)."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, stats: Mapping[str, torch.Tensor]) -> None:
        """Add one batch's ``{name: scalar tensor}`` (a sum over the batch's items, as
        :meth:`Objective.summarize` divides it later), in float64."""
        for key, value in stats.items():
            value = value.detach().to(torch.float64)
            self.sums[key] = self.sums[key] + value if key in self.sums else value

    def values(self) -> dict[str, float]:
        """The sums as Python floats."""
        return {key: float(value) for key, value in self.sums.items()}

    def state_dict(self) -> dict[str, float]:
        """The sums as floats (:meth:`values`), for a checkpoint."""
        return self.values()

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        """Take the sums of :meth:`state_dict` back (replacing the current ones)."""
        self.sums = {k: torch.tensor(v, dtype=torch.float64) for k, v in state.items()}

    def __bool__(self) -> bool:
        return bool(self.sums)


class MetricsHistory:
    """One row (a dict of scalars) per evaluation; a DataFrame view and an atomic CSV."""

    def __init__(self, rows: list[dict[str, Any]] | None = None) -> None:
        self.rows: list[dict[str, Any]] = list(rows or [])

    def append(self, row: Mapping[str, Any]) -> None:
        """Add one evaluation's row (copied)."""
        self.rows.append(dict(row))

    def frame(self) -> pd.DataFrame:
        """The history as a DataFrame, one row per evaluation."""
        return pd.DataFrame(self.rows)

    def write_csv(self, path: str | os.PathLike) -> Path:
        """Write the history to ``path`` (temp file + ``os.replace``)."""
        return atomic_write_text(path, self.frame().to_csv(index=False))

    def __len__(self) -> int:
        return len(self.rows)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new CUDA peak-memory window (no-op on CPU, where the peak is per process)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, Any]:
    """``{"peak_memory_bytes", "peak_memory_source"}``: CUDA max allocated since the last
    :func:`reset_peak_memory` on a GPU; on CPU the process's peak resident set size
    (``getrusage`` ru_maxrss, which covers the whole process lifetime); None with source
    ``"unavailable"`` where there is no ``resource`` module (Windows)."""
    if device.type == "cuda":
        return {
            "peak_memory_bytes": int(torch.cuda.max_memory_allocated(device)),
            "peak_memory_source": "cuda_max_allocated",
        }
    try:
        import resource
    except ImportError:  # Windows
        return {"peak_memory_bytes": None, "peak_memory_source": "unavailable"}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return {"peak_memory_bytes": int(rss * scale), "peak_memory_source": "cpu_max_rss"}
