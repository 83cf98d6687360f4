"""Data: the Long Range Arena tasks read from a user's files, ListOps generation, synthetic tasks.

Every task is a ``SequenceTask`` (a torch Dataset) with ``vocab_size``,
``num_classes`` (None for LM tasks), ``max_length``, ``pad_id`` and ``pairs``;
``load_task(name, path, split, **options)`` builds one by name.
"""

from .base import SPLITS, PackedSequences, SequenceTask
from .image import ImageTask, read_cifar_batch, rgb_to_gray
from .listops import (
    ListOpsTask,
    evaluate_listops,
    generate_listops,
    read_listops_tsv,
    tokenize_listops,
    write_listops,
)
from .pathfinder import PathfinderTask
from .png import decode_png, read_png
from .registry import (
    SYNTHETIC_TASKS,
    list_tasks,
    load_task,
    needs_path,
    split_options,
    task_class,
    task_options,
)
from .retrieval import RetrievalTask, read_aan_tsv
from .synthetic import CopyTask, MQARTask
from .text import TextTask

__all__ = [
    "SPLITS",
    "SYNTHETIC_TASKS",
    "CopyTask",
    "ImageTask",
    "ListOpsTask",
    "MQARTask",
    "PackedSequences",
    "PathfinderTask",
    "RetrievalTask",
    "SequenceTask",
    "TextTask",
    "decode_png",
    "evaluate_listops",
    "generate_listops",
    "list_tasks",
    "load_task",
    "needs_path",
    "read_aan_tsv",
    "read_cifar_batch",
    "read_listops_tsv",
    "read_png",
    "rgb_to_gray",
    "split_options",
    "task_class",
    "task_options",
    "tokenize_listops",
    "write_listops",
]
