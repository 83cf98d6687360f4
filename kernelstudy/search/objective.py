"""The Optuna objective: one trial trains one configuration of one variant.

A trial's configuration comes from the define-by-run suggestions of
:mod:`.space` (the feature map's declared hyperparameters, lr, warm-up fraction,
weight decay, dropout). The model is built first; when its feature maps hold
more than ``config.budget`` of its parameters the trial is pruned before any
training (user attr ``pruned_reason``). A suggested combination the model refuses
(a ``ValueError``, such as too many polynomial features) is pruned too (user attr
``refused_reason``; every variant's defaults were built before the search).
Otherwise the :class:`~kernelstudy.train.Trainer` trains it, reporting validation
accuracy after each evaluation so the study's pruner can stop it early. The value is
the best validation accuracy; the user attrs record the costs (parameters, feature
dimension, time, memory) and the test accuracy of the restored best weights.

The same settings, rebuilt from a finished trial's parameters with
``optuna.trial.FixedTrial``, are what :mod:`.evaluate` re-trains.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from torch import nn

from ..files import atomic_write_text
from ..nn.models import feature_dim_of, feature_map_parameter_count, parameter_count
from ..tasks import load_task, write_listops
from ..tasks.base import SequenceTask
from ..train import (
    OptunaPruningCallback,
    TrainConfig,
    Trainer,
    longest_split,
    model_for_task,
    seed_everything,
)
from .config import SearchConfig, Variant
from .space import suggest_feature_map, suggest_training

#: TrainConfig defaults of a search (a config's [train] table overrides them).
TRAIN_DEFAULTS: dict[str, Any] = {"reg_weight": 1.0, "progress": False}
_LISTOPS_FILES = ("basic_train.tsv", "basic_val.tsv", "basic_test.tsv")
#: Beside generated data: the ``[generate]`` table they were written with.
GENERATED_WITH = "generate.json"


class OverBudget(ValueError):
    """A model whose feature maps exceed the parameter budget."""


@dataclass(frozen=True)
class TrialSettings:
    """Everything one training run of a variant needs besides the data and the seed."""

    feature_map_kwargs: dict[str, Any]
    training: dict[str, Any]  # lr, warmup_fraction, weight_decay, dropout

    def model_kwargs(self, config: SearchConfig, variant: Variant) -> dict[str, Any]:
        kwargs = {k: v for k, v in config.model.items() if k not in ("dropout", "positional")}
        if "positional" in config.model:
            kwargs.setdefault("positions", config.model["positional"])
        kwargs["dropout"] = self.training["dropout"]
        if variant.attention == "softmax":
            kwargs["attention"] = "softmax"
        else:
            kwargs.update(
                attention="kernel",
                feature_map=variant.feature_map,
                feature_map_kwargs=dict(self.feature_map_kwargs),
            )
        return kwargs

    def train_config(self, config: SearchConfig, seed: int, device: str | None) -> TrainConfig:
        values = {**TRAIN_DEFAULTS, **config.train}
        steps = int(values.get("steps", TrainConfig.steps))
        values.update(
            lr=float(self.training["lr"]),
            weight_decay=float(self.training["weight_decay"]),
            warmup_steps=int(round(self.training["warmup_fraction"] * steps)),
            seed=int(seed),
        )
        if device is not None:
            values["device"] = device
        return TrainConfig.from_dict(values)


def suggest_settings(trial: optuna.Trial, config: SearchConfig, variant: Variant) -> TrialSettings:
    """The trial's settings (a ``FixedTrial(params)`` rebuilds those of a finished trial)."""
    fixed = dict(config.training_space)
    if "dropout" in config.model:
        fixed.setdefault("dropout", config.model["dropout"])
    fm_kwargs: dict[str, Any] = {}
    if variant.attention == "kernel":
        assert variant.feature_map is not None
        fm_kwargs = suggest_feature_map(trial, variant.feature_map, variant.fixed)
    return TrialSettings(fm_kwargs, suggest_training(trial, fixed))


# ------------------------------------------------------------------------------------ data


def data_dir(config: SearchConfig, out: str | Path) -> Path | None:
    """Where the task's files are: ``<out>/<name>/data-<hash>`` when generated (a folder
    per ``[generate]`` table, so that two configs of one name never share or rewrite one
    another's data, also when run at once), else ``config.data``."""
    if config.generate:
        digest = hashlib.sha256(_generated_with(config).encode()).hexdigest()[:12]
        return Path(out) / config.name / f"data-{digest}"
    return config.data


def _generated_with(config: SearchConfig) -> str:
    """The ``[generate]`` table as ``generate.json`` records it (and its folder is named)."""
    return json.dumps(config.generate, sort_keys=True)


def prepare_data(config: SearchConfig, out: str | Path) -> Path | None:
    """Generate the ListOps files of a ``[generate]`` config, or check ``config.data``.

    Generated files are reused while ``generate.json`` beside them records the config's
    ``[generate]`` table (written last: an interrupted generation is done again; two
    searches of one config at once write the same bytes). Raises FileNotFoundError (with
    what to do) when a config's data are missing.
    """
    from ..tasks import needs_path

    path = data_dir(config, out)
    if config.generate:
        assert path is not None
        record = _generated_with(config)
        stamp = path / GENERATED_WITH
        current = stamp.is_file() and stamp.read_text(encoding="utf-8") == record
        if not current or not all((path / name).is_file() for name in _LISTOPS_FILES):
            stamp.unlink(missing_ok=True)  # an interrupted write is not taken for current
            write_listops(path, **config.generate, overwrite=True)  # its own directory
            atomic_write_text(stamp, record)
            _load.cache_clear()  # splits read from the old files
        return path
    if not needs_path(config.task):
        return None
    if path is None:
        raise ValueError(f"{config.path}: task {config.task!r} needs `data = DIR` in the config")
    if not path.exists():
        if config.task == "listops":  # the ListOps files can be made here
            how = (
                "run with --quick where the config's [quick] table generates small data "
                "(`generate = {...}` there, as in studies/lra_listops.toml), or write full-size "
                "data there with `kernelstudy data listops --out "
                f"{shlex.quote(str(path))}`, or unpack the Long Range Arena release there"
            )
        else:
            how = (
                "download the Long Range Arena release (see the comment at the top of the "
                "config) or use the ListOps config, whose --quick variant generates its data"
            )
        raise FileNotFoundError(
            f"{config.path}: data for task {config.task!r} not found at {path}; {how}"
        )
    return path


@functools.lru_cache(maxsize=6)
def _load(
    task: str, path: str | None, split: str, options: str, files: tuple | None = None
) -> SequenceTask:
    return load_task(task, path, split, **json.loads(options))


def files_signature(path: Path, depth: int = 2) -> tuple:
    """``(relative name, size, modification time in ns)`` of ``path`` and of what lies in
    it up to ``depth`` levels down, sorted: data rewritten there (``kernelstudy data`` in
    another process, a release unpacked over generated files) changes it. Deeper levels
    (Pathfinder's image folders) are left out: their folders' times stand for them."""
    entries = []

    def add(p: Path, level: int) -> None:
        try:
            st = p.stat()
        except OSError:
            return
        entries.append((str(p.relative_to(path)), st.st_size, st.st_mtime_ns))
        if level < depth and p.is_dir():
            try:  # a folder one may not read (another user's, lost+found): its time only
                children = list(p.iterdir())
            except OSError:
                return
            for child in children:
                add(child, level + 1)

    add(path, 0)
    return tuple(sorted(entries))


def load_split(config: SearchConfig, path: Path | None, split: str) -> SequenceTask:
    """Split ``split`` of the config's task (cached per process: trials share it, while the
    data's files stay as they are: :func:`files_signature`)."""
    options = json.dumps(config.task_options, sort_keys=True)  # hashable, tables included
    if path is None:
        return _load(config.task, None, split, options)
    return _load(config.task, str(path), split, options, files_signature(path))


def val_reads_test(config: SearchConfig, path: Path | None) -> bool:
    """Whether the config's ``val`` split reads the test data (``SequenceTask.val_reads_test``:
    IMDB's, a single text file, a directory of text tables without a val table), so that a
    search on it chooses on the test set."""
    return bool(load_split(config, path, "val").val_reads_test)


# ----------------------------------------------------------------------------- one run


def build_model(
    config: SearchConfig,
    variant: Variant,
    settings: TrialSettings,
    task: SequenceTask,
    longest: int | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """The model and its sizes (parameters of model and feature maps, feature dimension);
    ``longest``: as in :func:`kernelstudy.train.model_for_task`."""
    model = model_for_task(task, longest, **settings.model_kwargs(config, variant))
    total, fm = parameter_count(model), feature_map_parameter_count(model)
    sizes = {
        "params_model": total,
        "params_feature_map": fm,
        "feature_map_fraction": fm / total if total else 0.0,
        # the paper's "additional parametrization": over the model without the maps
        "feature_map_extra": fm / (total - fm) if total > fm else (math.inf if fm else 0.0),
        "feature_dim": feature_dim_of(model),
    }
    return model, sizes


def over_budget(sizes: dict[str, Any], budget: float) -> str | None:
    """Why a model with ``sizes`` exceeds the feature-map ``budget`` (a fraction of the
    parameters of the model without its maps), or None when it fits."""
    if sizes["feature_map_extra"] <= budget:
        return None
    base = sizes["params_model"] - sizes["params_feature_map"]
    return (
        f"feature-map parameters {sizes['params_feature_map']} are "
        f"{sizes['feature_map_extra']:.1%} extra over the model's {base} without them, "
        f"over the budget of {budget:.0%}"
    )


def train_run(
    config: SearchConfig,
    variant: Variant,
    settings: TrialSettings,
    data: Path | None,
    seed: int,
    device: str | None = None,
    trial: optuna.Trial | None = None,
) -> dict[str, Any]:
    """Train one configuration with ``seed``; returns sizes, accuracies, time and memory.

    With ``trial``, the sizes go to its user attrs first, an over-budget model prunes
    it, and validation accuracy is reported after each evaluation.
    """
    train = load_split(config, data, "train")
    val, test = load_split(config, data, "val"), load_split(config, data, "test")
    seed_everything(seed)  # the model's initialization too
    try:
        longest = longest_split((train, val, test))
        model, sizes = build_model(config, variant, settings, train, longest)
    except ValueError as err:  # the defaults built (check_variants): a suggested combination
        if trial is None:  # the model refuses, such as too many polynomial features
            raise
        trial.set_user_attr("refused_reason", f"refused by the model: {err}")
        raise optuna.TrialPruned(str(err)) from err
    if trial is not None:
        for key, value in sizes.items():
            trial.set_user_attr(key, value)
    reason = over_budget(sizes, config.budget)
    if reason is not None:
        if trial is None:
            raise OverBudget(reason)
        trial.set_user_attr("pruned_reason", reason)
        raise optuna.TrialPruned(reason)
    cfg = settings.train_config(config, seed, device)
    callbacks = [] if trial is None else [OptunaPruningCallback(trial, "val_accuracy")]
    trainer = Trainer(model, train, cfg, val_data=val, test_data=test, on_eval=callbacks)
    record = trainer.fit()
    if record["best"]["value"] is None:  # every validation score NaN: as a diverged run
        raise FloatingPointError(
            f"no finite validation accuracy in {record['steps_completed']} steps"
        )
    # the validation accuracy of the weights scored on test (restore_best = false: the last
    # step's; the best seen then ranked trials by weights that were not scored)
    scored = record["model_metrics"] or {}
    val_accuracy = scored.get("val_accuracy", record["best"]["value"])
    if not math.isfinite(val_accuracy):  # diverged after its best evaluation
        raise FloatingPointError(
            f"validation accuracy {val_accuracy} at step {record['model_step']}, the scored weights"
        )
    return {
        **sizes,
        "val_accuracy": val_accuracy,
        "test_accuracy": (record["test"] or {}).get("accuracy"),
        "train_time_s": record["train_time_s"],  # training steps only, not evaluation
        "wall_time_s": record["wall_time_s"],
        "peak_memory_bytes": record["peak_memory_bytes"],
        "steps": record["steps_completed"],
        "device": record["device"],
        "amp": record["amp"],  # the autocast dtype, or None
    }


def objective(
    trial: optuna.Trial,
    config: SearchConfig,
    label: str,
    data: Path | None,
    device: str | None = None,
) -> float:
    """Train the trial's configuration of variant ``label``; return the validation accuracy of
    the weights it scores on test (the best evaluation's; with ``restore_best = false``, the
    last step's).

    Picklable as ``functools.partial(objective, config=..., label=..., data=...)``.
    """
    variant = config.variant(label)
    settings = suggest_settings(trial, config, variant)
    seed = int(config.train.get("seed", 0))
    result = train_run(config, variant, settings, data, seed, device, trial=trial)
    for key, value in result.items():
        trial.set_user_attr(key, value)
    return float(result["val_accuracy"])


def default_settings(config: SearchConfig, variant: Variant) -> TrialSettings:
    """The settings at every searched hyperparameter's declared default, or where the
    config narrows it to leave the default out, at a value inside (:func:`default_value`)."""
    from ..feature_maps.registry import get_feature_map_class
    from .space import TRAINING_SPACE, default_value

    space = config.training_space
    params: dict[str, Any] = {
        k: default_value(spec, space.get(k)) for k, spec in TRAINING_SPACE.items()
    }
    if variant.feature_map is not None:
        hparams = get_feature_map_class(variant.feature_map).hyperparameters
        params.update(
            {f"fm.{k}": default_value(spec, variant.fixed.get(k)) for k, spec in hparams.items()}
        )
    return suggest_settings(optuna.trial.FixedTrial(params), config, variant)


def check_variants(config: SearchConfig, data: Path | None) -> dict[str, str]:
    """Build every variant's model once at its defaults (no training): bad model settings
    fail here, before any worker starts. Returns ``{label: reason}`` of over-budget ones."""
    splits = [load_split(config, data, split) for split in ("train", "val", "test")]
    task, longest = splits[0], longest_split(splits)
    over = {}
    for variant in config.variants:
        try:
            settings = default_settings(config, variant)
            _, sizes = build_model(config, variant, settings, task, longest)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{config.path}: variant {variant.label!r}: {err}") from err
        reason = over_budget(sizes, config.budget)
        if reason is not None:
            over[variant.label] = reason
    return over
