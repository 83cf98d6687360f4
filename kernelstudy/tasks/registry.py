"""Tasks by name: ``load_task("listops", "data/listops", "train", max_length=2000)``.

Options apply to every split unless a split has its own table of them:
``load_task("copy", split="val", num_samples=20_000, val={"num_samples": 256})`` builds a
validation split of 256 sequences (``[task_options.val]`` in a TOML config).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any

from .base import SPLITS, SequenceTask, check_split
from .files import PathArg
from .image import ImageTask
from .listops import ListOpsTask
from .pathfinder import PathfinderTask
from .retrieval import RetrievalTask
from .synthetic import CopyTask, MQARTask
from .text import TextTask

TASKS: dict[str, type[SequenceTask]] = {
    "listops": ListOpsTask,
    "text": TextTask,
    "retrieval": RetrievalTask,
    "image": ImageTask,
    "pathfinder": PathfinderTask,
    "copy": CopyTask,
    "mqar": MQARTask,
}
#: Tasks generated in memory; the others read a user's files.
SYNTHETIC_TASKS = ("copy", "mqar")


def list_tasks() -> list[str]:
    """Names accepted by ``load_task``."""
    return list(TASKS)


def task_class(name: str) -> type[SequenceTask]:
    """The class of task ``name``; ValueError (with suggestions) for an unknown name."""
    if not isinstance(name, str):
        raise TypeError(f"task name must be a str such as 'listops', got {name!r}")
    if name not in TASKS:
        close = difflib.get_close_matches(str(name), TASKS, n=2, cutoff=0.5)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"unknown task {name!r}{hint} (known: {', '.join(TASKS)})")
    return TASKS[name]


def task_options(name: str) -> dict[str, Any]:
    """The keyword options of task ``name`` and their defaults (path and split excluded)."""
    params = inspect.signature(task_class(name).__init__).parameters
    return {
        key: p.default
        for key, p in params.items()
        if key not in ("self", "path", "split")
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }


def needs_path(name: str) -> bool:
    """Whether task ``name`` reads files (every task but the synthetic ones)."""
    task_class(name)
    return name not in SYNTHETIC_TASKS


def split_options(name: str, options: Mapping[str, Any], split: str) -> dict[str, Any]:
    """The options of task ``name`` for ``split``: ``options`` with ``options[split]`` over them.

    ``options`` holds task options shared by all splits and, under the keys ``train``,
    ``val`` and ``test``, tables of options for one split. Every table is checked, not only
    ``split``'s: an unknown option, a table that is not a mapping, or a per-split value of
    an option that divides the samples into the splits (``partition_options``, e.g.
    Pathfinder's ``split_seed``: the splits would overlap) or says what tokens or labels
    mean (``vocabulary_options``, e.g. MQAR's ``vocab_size``) raises ValueError.
    """
    check_split(split)
    if not isinstance(options, Mapping):
        raise TypeError(f"options must be a mapping of task options, got {options!r}")
    allowed = task_options(name)
    shared = {key: value for key, value in options.items() if key not in SPLITS}
    tables = {key: value for key, value in options.items() if key in SPLITS}
    for split_name, table in tables.items():
        if not isinstance(table, Mapping):
            raise ValueError(
                f"task option {split_name!r} must be a table of options for the {split_name} "
                f"split (e.g. {{'num_samples': 256}}), got {table!r}"
            )
    for where, table in [("", shared), *((f"{s}.", t) for s, t in tables.items())]:
        unknown = sorted(f"{where}{key}" for key in set(table) - set(allowed))
        if unknown:
            raise ValueError(
                f"unknown option(s) {', '.join(unknown)} for task {name!r} "
                f"(accepted: {', '.join(allowed)}; per split under {', '.join(SPLITS)})"
            )
    for split_name, table in tables.items():
        cls = task_class(name)
        shared_only = sorted(set(table) & set(cls.partition_options))
        if shared_only:
            key = shared_only[0]
            raise ValueError(
                f"task option {split_name}.{key}: {key} divides the samples into "
                f"{', '.join(SPLITS)}, so a per-split value would make the splits overlap; "
                "give it once, for all splits"
            )
        vocabulary = sorted(set(table) & set(cls.vocabulary_options))
        if vocabulary:
            key = vocabulary[0]
            raise ValueError(
                f"task option {split_name}.{key}: {key} says what the tokens or labels mean, "
                "so a per-split value would score that split on other tokens than the model "
                "learned; give it once, for all splits"
            )
    return {**shared, **tables.get(split, {})}


def load_task(
    name: str, path: PathArg | None = None, split: str = "train", **options: Any
) -> SequenceTask:
    """Build task ``name`` for ``split`` (train/val/test) from ``path`` with ``options``.

    File tasks need ``path``; synthetic ones take none. ``options`` may hold per-split
    tables (see ``split_options``). Unknown names, options or splits raise ValueError
    before any file is read; a missing path raises FileNotFoundError.
    """
    cls = task_class(name)
    options = split_options(name, options, split)
    if not needs_path(name):
        if path is not None:
            raise ValueError(f"task {name!r} is synthetic and reads no data path (got {path!r})")
        return cls(split=split, **options)
    if path is None:
        raise ValueError(f"task {name!r} needs a data path")
    return cls(path, split=split, **options)
