"""Search configs: a TOML file naming the task, the model, training, and the attention variants.

::

    name = "lra_listops"
    task = "listops"
    data = "data/listops"            # the LRA files (relative to the config file)
    [task_options]  max_length = 2000
    [model]   d_model = 512  n_heads = 8  n_layers = 6  d_ff = 2048  pooling = "mean"
    [train]   steps = 5000  batch_size = 32  eval_every = 500
    [search]  trials = 20  pruner = "median"  seed = 0  budget = 0.10
    [[variants]]  label = "Transformer"  attention = "softmax"
    [[variants]]  label = "1xGLU"  feature_map = "glu"  fixed = { depth = 1 }
    [quick]   ...                    # tables merged over the above by --quick

Everything is checked when the file is loaded (unknown task, map, option,
malformed TOML), before any training starts.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..feature_maps.registry import get_feature_map_class
from .space import TRAINING_SPACE

PRUNERS = ("median", "hyperband", "none")
MODEL_KEYS = {"d_model", "n_heads", "n_layers", "d_ff", "pooling", "positional", "dropout"}


@dataclass(frozen=True)
class Variant:
    """One row of the results table: softmax, or a feature map with fixed hyperparameters."""

    label: str
    attention: str = "kernel"
    feature_map: str | None = None
    fixed: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SearchConfig:
    """A parsed, validated search config (see the module docstring for the file format)."""

    name: str
    task: str
    data: Path | None
    task_options: dict[str, Any]
    model: dict[str, Any]
    train: dict[str, Any]
    search: dict[str, Any]
    training_space: dict[str, Any]
    variants: tuple[Variant, ...]
    path: Path

    @property
    def trials(self) -> int:
        return int(self.search.get("trials", 10))

    @property
    def budget(self) -> float:
        """Largest allowed feature-map share of the model's parameters."""
        return float(self.search.get("budget", 0.10))

    def variant(self, label: str) -> Variant:
        for v in self.variants:
            if v.label == label:
                return v
        raise ValueError(f"no variant {label!r} in {self.path}; it has {self.labels()}")

    def labels(self) -> list[str]:
        return [v.label for v in self.variants]

    def study_name(self, variant: Variant) -> str:
        """The Optuna study that holds the trials of ``variant``."""
        return f"{self.name}/{variant.label}"


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path, quick: bool = False) -> SearchConfig:
    """Read and validate a search config; ``quick`` merges its ``[quick]`` table on top."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"search config {path} does not exist")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"search config {path} is not valid TOML: {err}") from err
    quick_table = raw.pop("quick", {})
    if quick:
        raw = _merge(raw, quick_table)
    return parse_config(raw, path)


def parse_config(raw: dict[str, Any], path: Path) -> SearchConfig:
    """Validate the dict of a config file (``path`` is for messages and relative data paths)."""
    from ..tasks.registry import task_class, task_options

    known = {"name", "task", "data", "task_options", "model", "train", "search", "space"}
    known |= {"variants"}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"{path}: unknown top-level key(s) {sorted(unknown)}")
    for key in ("name", "task", "variants"):
        if key not in raw:
            raise ValueError(f"{path}: missing required key {key!r}")
    task_class(raw["task"])  # ValueError with suggestions for an unknown task
    options = dict(raw.get("task_options", {}))
    bad = set(options) - set(task_options(raw["task"]))
    if bad:
        raise ValueError(f"{path}: task {raw['task']!r} takes no option(s) {sorted(bad)}")
    model = dict(raw.get("model", {}))
    if set(model) - MODEL_KEYS:
        raise ValueError(f"{path}: unknown [model] key(s) {sorted(set(model) - MODEL_KEYS)}")
    search = dict(raw.get("search", {}))
    if search.get("pruner", "median") not in PRUNERS:
        raise ValueError(f"{path}: [search] pruner must be one of {PRUNERS}")
    space = dict(raw.get("space", {}))
    if set(space) - set(TRAINING_SPACE):
        raise ValueError(
            f"{path}: [space] may fix {sorted(TRAINING_SPACE)}, got {sorted(set(space))}"
        )
    variants = []
    for i, entry in enumerate(raw["variants"]):
        if not isinstance(entry, dict) or "label" not in entry:
            raise ValueError(f"{path}: variants[{i}] needs a 'label'")
        attention = entry.get("attention", "kernel")
        if attention not in ("kernel", "softmax"):
            raise ValueError(f"{path}: variants[{i}].attention must be 'kernel' or 'softmax'")
        fm = entry.get("feature_map")
        fixed = dict(entry.get("fixed", {}))
        if attention == "kernel":
            if fm is None:
                raise ValueError(f"{path}: variants[{i}] ({entry['label']}) needs a feature_map")
            cls = get_feature_map_class(fm)  # ValueError with close matches
            bad = set(fixed) - set(cls.hyperparameters)
            if bad:
                raise ValueError(
                    f"{path}: variants[{i}]: feature map {fm!r} has no hyperparameter(s) "
                    f"{sorted(bad)}"
                )
        variants.append(Variant(entry["label"], attention, fm, fixed))
    labels = [v.label for v in variants]
    if len(set(labels)) != len(labels):
        raise ValueError(f"{path}: variant labels must be unique, got {labels}")
    data = raw.get("data")
    data_path = None if data is None else (path.parent / data).resolve()
    return SearchConfig(
        name=str(raw["name"]),
        task=raw["task"],
        data=data_path,
        task_options=options,
        model=model,
        train=dict(raw.get("train", {})),
        search=search,
        training_space=space,
        variants=tuple(variants),
        path=path,
    )
