"""Training: the :class:`Trainer` loop, its :class:`TrainConfig`, objectives, schedules,
checkpoints and metrics."""

from ..files import atomic_write, atomic_write_text, read_csv_table, write_json
from .checkpoint import (
    get_rng_state,
    load_checkpoint,
    save_checkpoint,
    seed_everything,
    set_rng_state,
)
from .data import BatchStream, EpochBatchSampler, make_loader
from .factory import longest_split, model_for_task, task_type_of
from .metrics import MetricsHistory, MetricSums, peak_memory, reset_peak_memory
from .objectives import TASK_TYPES, Objective, infer_task_type
from .pruning import OptunaPruningCallback
from .saved_model import load_model
from .schedule import SCHEDULES, WarmupDecay, make_scheduler
from .trainer import TrainConfig, Trainer, resolve_device, train

__all__ = [
    "SCHEDULES",
    "TASK_TYPES",
    "BatchStream",
    "EpochBatchSampler",
    "MetricSums",
    "MetricsHistory",
    "Objective",
    "OptunaPruningCallback",
    "TrainConfig",
    "Trainer",
    "WarmupDecay",
    "atomic_write",
    "atomic_write_text",
    "get_rng_state",
    "infer_task_type",
    "load_checkpoint",
    "load_model",
    "make_loader",
    "make_scheduler",
    "read_csv_table",
    "longest_split",
    "model_for_task",
    "peak_memory",
    "reset_peak_memory",
    "resolve_device",
    "save_checkpoint",
    "seed_everything",
    "set_rng_state",
    "task_type_of",
    "train",
    "write_json",
]
