"""The ``kernelstudy train`` command: a task, a model with any attention, one Trainer run.

``kernelstudy train --task listops --data DIR --attention favor --map-arg num_features=256
--out runs/NAME`` loads the train/val/test splits, builds the model for the task and
trains it. A TOML file (``--config``) can hold the same settings; flags override it::

    task = "listops"            # a name from kernelstudy.tasks.list_tasks()
    data = "data/listops"       # file tasks only
    attention = "favor"         # "softmax", "kernel" (elu) or a feature-map name
    out = "runs/favor"          # data and out: relative to this file's directory
    [task_options]              # the task's options, e.g. max_length = 2000
    [task_options.val]          # options of one split (train/val/test), e.g. num_samples = 256
    [feature_map]               # the map's hyperparameters, e.g. num_features = 256
    [model]                     # model options, e.g. d_model = 128, n_heads = 4, pooling = "cls"
    [train]                     # TrainConfig fields, e.g. steps = 5000, lr = 5e-4

Everything is checked (task, data directory, map, model shape, train options) before
anything is written. Outputs in ``--out``: ``config.json`` (the resolved settings),
``checkpoint.pt``, ``metrics.csv`` (one row per evaluation), ``run.json`` (the
Trainer's record), ``model.pt`` and ``summary.json`` (accuracies, parameter counts,
feature dimension, peak memory, wall and training time). Re-running the same command with the
same ``--out`` resumes from the checkpoint; a different configuration is refused, and so is a
folder that keeps a run's results without its checkpoint (``--overwrite`` starts over).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import re
import sys
import tomllib
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..arguments import user_path
from ..core.backends import env_backend_name
from ..files import exclusive_folder, write_json
from ..nn.models import CausalLM, MatchingClassifier, SequenceClassifier
from ..tasks import SPLITS, load_task, needs_path, task_class, task_options
from ..tasks.base import SequenceTask
from .checkpoint import seed_everything
from .factory import longest_split, model_for_task, task_type_of
from .trainer import (
    CHECKPOINT,
    METRICS,
    MODEL,
    RECORD,
    RESUME_FREE,
    TrainConfig,
    Trainer,
    check_stop_after,
    eval_size,
    field_defaults,
    resolve_device,
)

CONFIG = "config.json"
SUMMARY = "summary.json"
#: what a run writes besides its config (an --overwrite removes them first)
RUN_FILES = (CHECKPOINT, METRICS, RECORD, MODEL, SUMMARY)
#: top-level keys of a ``--config`` TOML file
CONFIG_KEYS = ("task", "data", "attention", "out", "task_options", "feature_map", "model", "train")
_TABLES = ("task_options", "feature_map", "model", "train")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: a task option, optionally for one split only: ``max_length`` or ``val.num_samples``
_TASK_KEY = re.compile(rf"(?:(?:{'|'.join(SPLITS)})\.)?{_KEY.pattern}")
#: model options set by other settings, never in the [model] table
_MODEL_RESERVED = {"self", "vocab_size", "num_classes", "attention", "feature_map_kwargs"}


def parse_value(text: str) -> Any:
    """``"256"`` → 256, ``"0.5"``/``"1e-3"`` → float, ``"true"``/``"false"`` → bool,
    ``"none"`` → None, anything else → the string itself."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


_EXAMPLES = {
    "--map-arg": "num_features=256",
    "--model-arg": "pooling=cls",
    "--task-arg": "val.num_samples=256",
}


def parse_key_values(
    items: Iterable[str] | None, flag: str, key_pattern: re.Pattern = _KEY
) -> dict[str, Any]:
    """``["k=v", ...]`` → ``{k: parse_value(v)}``; ValueError naming ``flag`` when malformed."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key_pattern.fullmatch(key) or not value.strip():
            example = _EXAMPLES.get(flag, "key=value")
            raise ValueError(
                f"{flag} expects KEY=VALUE with a name as KEY (e.g. {flag} {example}), got {item!r}"
            )
        if key in out:
            raise ValueError(f"{flag} {key} is given twice")
        out[key] = parse_value(value)
    return out


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The settings of a TOML ``--config`` file (keys: ``CONFIG_KEYS``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a valid TOML file ({err})") from err
    unknown = sorted(set(data) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown}; known: {list(CONFIG_KEYS)}")
    for key in _TABLES:
        if key in data and not isinstance(data[key], dict):
            raise ValueError(f"{path}: {key!r} must be a table ([{key}]), got {data[key]!r}")
    for key in ("task", "data", "attention", "out"):
        if key in data and not isinstance(data[key], str):
            raise ValueError(f"{path}: {key!r} must be a string, got {data[key]!r}")
    return data


def _model_class(task: SequenceTask) -> type:
    kind = task_type_of(task)
    return {"lm": CausalLM, "matching": MatchingClassifier}.get(kind, SequenceClassifier)


def _model_options(cls: type) -> set[str]:
    """Keyword options of model class ``cls`` (its own and its parents' for ``**kwargs``)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass.__module__.startswith("torch"):
            continue
        for name, p in inspect.signature(klass.__init__).parameters.items():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                names.add(name)
        params = inspect.signature(klass.__init__).parameters.values()
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return names - _MODEL_RESERVED


def resolve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings from ``--config`` and the flags (flags win), checked for form.

    Returns ``{"task", "data" (absolute path or None), "attention", "out", "task_options",
    "feature_map", "model", "train"}``; the tables are dicts.
    """
    file = read_config_file(args.config) if args.config else {}
    for key in ("data", "out"):  # paths in the file are relative to the file, as in searches
        if key in file:
            file[key] = str(Path(args.config).parent / Path(file[key]).expanduser())
    s: dict[str, Any] = {key: copy.deepcopy(file.get(key)) for key in CONFIG_KEYS}
    for key in _TABLES:
        s[key] = dict(s[key] or {})
    for key in ("task", "data", "attention", "out"):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    for key in ("data", "out", "attention"):  # Path("") is the current directory
        if s[key] is not None and not str(s[key]):
            raise ValueError(f"--{key} must not be empty (an unset variable?)")
    if s["task"] is None:
        raise ValueError("no task: give --task NAME (or task = ... in the --config file)")
    if s["out"] is None:
        raise ValueError("no output directory: give --out DIR (or out = ... in --config)")
    s["attention"] = "kernel" if s["attention"] is None else s["attention"]
    task_class(s["task"])  # unknown task: ValueError with suggestions

    s["feature_map"].update(parse_key_values(args.map_arg, "--map-arg"))
    task_args = parse_key_values(args.task_arg, "--task-arg", _TASK_KEY)
    for key, value in task_args.items():
        split, _, name = key.rpartition(".")
        table = s["task_options"].setdefault(split, {}) if split else s["task_options"]
        if not isinstance(table, dict):
            raise ValueError(f"--task-arg {key}: task_options.{split} is not a table")
        table[name] = value
    model_args = parse_key_values(args.model_arg, "--model-arg")
    s["model"].update(model_args)
    if s["attention"] == "softmax" and s["feature_map"]:
        raise ValueError(
            f"--map-arg {sorted(s['feature_map'])} given with --attention softmax, "
            "which has no feature map"
        )
    for flag, key in (("d_model", "d_model"), ("heads", "n_heads"), ("layers", "n_layers")):
        value = getattr(args, flag)
        if value is None:
            continue
        if key in model_args and model_args[key] != value:
            raise ValueError(
                f"--{flag.replace('_', '-')} {value} and --model-arg {key}={model_args[key]} "
                "disagree; give one"
            )
        s["model"][key] = value
    if args.max_length is not None:
        options = task_options(s["task"])
        key = next((k for k in ("max_length", "seq_len") if k in options), None)
        if key is None:
            raise ValueError(
                f"task {s['task']!r} has a fixed sequence length; --max-length does not apply"
            )
        if key in task_args and task_args[key] != args.max_length:
            raise ValueError(
                f"--max-length {args.max_length} and --task-arg {key}={task_args[key]} "
                "disagree; give one"
            )
        s["task_options"][key] = args.max_length
    flags = ("steps", "batch_size", "lr", "seed", "eval_every", "device", "reg_weight", "compile")
    for key in flags:
        if getattr(args, key) is not None:
            s["train"][key] = getattr(args, key)
    if "out_dir" in s["train"]:
        raise ValueError("[train] out_dir is not used: give the run directory as out or --out")

    if needs_path(s["task"]):
        if s["data"] is None:
            raise ValueError(f"task {s['task']!r} reads files: give --data DIR")
        data = Path(s["data"]).expanduser()
        if not data.exists():
            raise FileNotFoundError(f"data directory not found: {data} (--data for {s['task']!r})")
        s["data"] = str(data.resolve())
    elif s["data"] is not None:
        raise ValueError(f"task {s['task']!r} is synthetic and takes no --data (got {s['data']})")
    s["out"] = str(Path(s["out"]).expanduser().resolve())
    return s


def train_config_of(settings: Mapping[str, Any], progress: bool | None) -> TrainConfig:
    """The :class:`TrainConfig` of the settings, writing into ``settings["out"]``.

    ``progress`` (``--progress``/``--no-progress``) wins over ``[train] progress``; with
    neither, the bar shows when stderr is a terminal."""
    fields = {**settings["train"], "out_dir": settings["out"]}
    if progress is not None or "progress" not in fields:
        fields["progress"] = sys.stderr.isatty() if progress is None else progress
    try:
        config = TrainConfig.from_dict(fields)
    except TypeError as err:
        raise ValueError(f"bad [train] option: {err}") from err
    except ValueError as err:  # "steps must be an int >= 1": named as the user set it
        name = str(err).split(" ", 1)[0]
        flag = f"--{name.replace('_', '-')}"
        if name in _TRAIN_FLAGS:
            raise ValueError(f"{flag}: {err} (or [train] {name} in --config)") from None
        raise
    resolve_device(config.device)  # a missing or malformed device fails here
    return config


#: TrainConfig fields that `kernelstudy train` sets by a flag of the same name (--batch-size)
_TRAIN_FLAGS = ("steps", "batch_size", "lr", "seed", "eval_every", "reg_weight")


def _comparable(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings that must match for a resume (JSON-normalized).

    With ``eval_batches`` set, the evaluation batch size picks the scored examples, so
    it must match too (see :func:`~.trainer.resume_changes`).
    """
    s = json.loads(json.dumps(settings, default=str))
    # a run saved before a field existed had its default (else its settings read as changed)
    train = s["train"] = {**json.loads(json.dumps(field_defaults(), default=str)), **s["train"]}
    scored_size = eval_size(train) if train.get("eval_batches") is not None else None
    for key in RESUME_FREE:
        train.pop(key, None)
    if scored_size is not None:
        train["eval_batch_size"] = scored_size
    s.pop("out", None)
    return s


def _flatten(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``{"model": {"d_model": 8}}`` → ``{"model.d_model": 8}`` (one level of tables)."""
    flat: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


def check_resume(settings: Mapping[str, Any], resume: str) -> bool:
    """Whether to resume from ``out/checkpoint.pt``; ValueError when that run differs, or
    when ``out`` keeps a run's results without the checkpoint to continue them from.

    ``resume``: ``auto`` (when a checkpoint exists), ``require`` or ``never``.
    """
    out = Path(settings["out"])
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    has_checkpoint = (out / CHECKPOINT).is_file()
    if resume == "never":
        return False
    if not has_checkpoint and resume == "require":
        raise FileNotFoundError(f"--resume: no checkpoint at {out / CHECKPOINT}")
    saved_path = out / CONFIG
    # read first: another program's config.json (a project folder) is refused, not replaced
    saved_config = _read_saved_config(saved_path) if saved_path.is_file() else None
    results = [n for n in RUN_FILES if n != RECORD and (out / n).is_file()]
    if not results:  # nothing to keep (at most the record of a run that failed early)
        return False
    if saved_config is None:
        raise ValueError(
            f"{out} holds {', '.join(results)} but no {CONFIG} (not a `kernelstudy train` "
            "run); use another --out, or --overwrite to start over"
        )
    # A run's results without its checkpoint (deleted to save space) are not overwritten
    # by other settings either (the same check as for a resume), nor by the same ones.
    saved = _flatten(_comparable(saved_config))
    now = _flatten(_comparable(settings))
    changed = sorted(key for key in set(saved) | set(now) if saved.get(key) != now.get(key))
    if changed:
        raise ValueError(
            f"{out} holds a run with other settings (changed: {', '.join(changed)}); "
            "use another --out, or --overwrite to start over"
        )
    if not has_checkpoint:  # a fresh run would delete and overwrite them
        raise ValueError(
            f"{out} holds {', '.join(results)} of a run but no {CHECKPOINT} to resume it "
            "from; use another --out, or --overwrite to start over"
        )
    return True


def _read_saved_config(path: Path) -> dict[str, Any]:
    """The settings a run saved in ``config.json``; ValueError naming the file if damaged or
    not a run's."""
    remedy = "use another --out (--overwrite replaces it)"
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not readable JSON ({err}); {remedy}") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("train"), dict):
        raise ValueError(f"{path} holds no run settings (no [train] table); {remedy}")
    return saved


def load_splits(settings: Mapping[str, Any]) -> dict[str, SequenceTask]:
    """The train, val and test splits of the task."""
    return {
        split: load_task(settings["task"], settings["data"], split, **settings["task_options"])
        for split in ("train", "val", "test")
    }


def build_model(
    settings: Mapping[str, Any], task: SequenceTask, seed: int, longest: int | None = None
) -> torch.nn.Module:
    """The model for ``task`` with the settings' attention, map and model options.

    ``longest``: the length the longest split pads to (a val or test split may be longer than
    train's); ``max_len`` defaults to it, and a learned encoding's ``max_len`` must reach it
    (else the run would fail at its first evaluation, after training had started)."""
    allowed = _model_options(_model_class(task))
    unknown = sorted(set(settings["model"]) - allowed)
    if unknown:
        raise ValueError(
            f"unknown model option(s) {unknown} for a {task_type_of(task)} task; "
            f"known: {sorted(allowed)}"
        )
    kwargs = dict(settings["model"])
    kwargs["attention"] = settings["attention"]
    if settings["feature_map"]:
        kwargs["feature_map_kwargs"] = dict(settings["feature_map"])
    seed_everything(seed)
    try:
        return model_for_task(task, longest, **kwargs)
    except (ValueError, TypeError) as err:
        flags = [flag for name, flag in _MODEL_FLAGS.items() if re.search(rf"\b{name}\b", str(err))]
        where = f" (set by {', '.join(flags)} or [model] in --config)" if flags else ""
        raise type(err)(f"bad model configuration: {err}{where}") from err


# The model options that `kernelstudy train` sets by flag: an error names the field, the hint
# the flag a user typed.
_MODEL_FLAGS = {"d_model": "--d-model", "n_heads": "--heads", "n_layers": "--layers"}


def majority_accuracy(task: SequenceTask) -> float | None:
    """Accuracy of always predicting the most common label (None for LM tasks)."""
    labels = getattr(task, "labels", None)
    if task.num_classes is None or labels is None or len(labels) == 0:
        return None
    counts = Counter(int(v) for v in labels)
    return max(counts.values()) / len(labels)


def summarize(
    record: Mapping[str, Any], settings: Mapping[str, Any], splits: Mapping[str, SequenceTask]
) -> dict[str, Any]:
    """The run's summary: accuracies, sizes, memory and time (written as ``summary.json``).

    ``val_accuracy`` is the last evaluation's; ``model_step`` the step whose weights
    ``model.pt`` holds and the test scored (the best evaluation's with ``restore_best``),
    ``model_val_accuracy`` their validation accuracy; ``val_reads_test`` whether the val
    split read the test data (IMDB, as in LRA: what was chosen on it was chosen on test)."""
    final = record.get("final") or {}
    test = record.get("test") or {}
    params = record["parameters"]
    summary = {
        "status": record["status"],
        "task": settings["task"],
        "attention": settings["attention"],
        "feature_map": settings["feature_map"],
        "steps_completed": record["steps_completed"],
        "steps": record["steps"],
        "val_accuracy": final.get("val_accuracy"),
        "best": record["best"],
        "model_step": record["model_step"],
        "model_val_accuracy": (record["model_metrics"] or {}).get("val_accuracy"),
        "test_accuracy": test.get("accuracy"),
        "test_loss": test.get("loss"),
        "test_majority_accuracy": majority_accuracy(splits["test"]),
        "val_reads_test": bool(splits["val"].val_reads_test),
        "parameters": {
            "model": params["total"],
            "feature_map": params["feature_map"],
            "feature_map_fraction": params["feature_map_fraction"],
        },
        "feature_dim": record["feature_dim"],
        "peak_memory_bytes": record["peak_memory_bytes"],
        "peak_memory_source": record["peak_memory_source"],
        "wall_time_s": record["wall_time_s"],
        "train_time_s": record["train_time_s"],
        "device": record["device"],
        "task_info": {k: v for k, v in splits["train"].info().items() if k != "task"},
    }
    for key in ("val_sequence_accuracy",):
        if key in final:
            summary[key] = final[key]
    if "sequence_accuracy" in test:
        summary["test_sequence_accuracy"] = test["sequence_accuracy"]
    return summary


def evaluation_lines(steps: int) -> Callable[[int, dict[str, Any]], None]:
    """A Trainer ``on_eval`` callback that prints one line per evaluation to stderr (step,
    losses, validation accuracy, training seconds): a run without a progress bar (stderr no
    terminal: a batch job's log) said nothing until it ended."""

    def line(step: int, row: dict[str, Any]) -> None:
        names = ("train_loss", "val_loss", "val_accuracy")
        metrics = ", ".join(f"{name} {row[name]:.4f}" for name in names if name in row)
        print(f"step {step}/{steps}: {metrics} ({row['elapsed_s']:.1f} s)", file=sys.stderr)

    return line


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def cmd_train(args: argparse.Namespace) -> int:
    """Run ``kernelstudy train``; every check happens before anything is written."""
    if args.resume and args.overwrite:
        raise ValueError("--resume and --overwrite exclude each other")
    check_stop_after(args.stop_after, "--stop-after")
    settings = resolve_settings(args)
    # the bar left to whether stderr is a terminal (neither --progress nor [train] progress)
    auto_progress = args.progress is None and "progress" not in settings["train"]
    config = train_config_of(settings, args.progress)
    resolved = config.to_dict()
    settings["train"] = {k: v for k, v in resolved.items() if k not in ("out_dir", "progress")}
    resume_mode = "require" if args.resume else "never" if args.overwrite else "auto"
    check_resume(settings, resume_mode)  # before the folder is made
    splits = load_splits(settings)
    kind = task_type_of(splits["train"])  # else the first step's batch fails, files written
    if config.task_type not in ("auto", kind):
        raise ValueError(
            f"[train] task_type {config.task_type!r} does not fit task {settings['task']!r} "
            f"(a {kind} task); leave it 'auto'"
        )
    model = build_model(settings, splits["train"], config.seed, longest_split(splits.values()))
    # without a bar as stderr is no terminal (a batch job's log): a line per evaluation
    lines = [evaluation_lines(config.steps)] if auto_progress and not config.progress else []
    trainer = Trainer(
        model,
        splits["train"],
        config,
        val_data=splits["val"],
        test_data=splits["test"],
        on_eval=lines,
    )

    env_backend_name()  # read at the first step: failed after config.json and run.json
    out = Path(settings["out"])
    out.mkdir(parents=True, exist_ok=True)
    # FolderBusy (a ValueError): exit 1
    with exclusive_folder(out, "kernelstudy train", clean=True):
        # check again under the lock: a run that ended meanwhile may have written
        resume = check_resume(settings, resume_mode)
        # the old run's files go before the new settings are recorded; a continuation
        # drops the old summary too: one is left only by a fit that returned
        for name in RUN_FILES if args.overwrite else (SUMMARY,):
            (out / name).unlink(missing_ok=True)
        write_json(out / CONFIG, settings)
        if resume:
            print(f"resuming {out} from {out / CHECKPOINT}", file=sys.stderr)
        try:
            record = trainer.fit(stop_after=args.stop_after, resume=resume)
        except FloatingPointError as err:
            print(
                f"kernelstudy train: run failed: {err} (record in {out / RECORD})",
                file=sys.stderr,
            )
            return 1
        summary = summarize(record, settings, splits)
        write_json(out / SUMMARY, summary)
    best = record["best"]
    at = f" at step {best['step']}" if best.get("step") is not None else ""  # none evaluated yet
    print(
        f"{summary['status']} after {record['steps_completed']}/{record['steps']} steps: "
        f"val accuracy {_fmt(summary['val_accuracy'])} "
        f"(best {_fmt(best.get('value'))}{at}), "
        f"test accuracy {_fmt(summary['test_accuracy'])} (weights of step {summary['model_step']})"
    )
    if summary["val_reads_test"] and config.restore_best:
        print(
            "note: the val split read the test data (no validation split in these files, as "
            "IMDB in LRA), so the weights the test scored were chosen on the test set; "
            "[train] restore_best = false in --config scores the last weights",
            file=sys.stderr,
        )
    print(f"wrote {out}: " + ", ".join(n for n in RUN_FILES if (out / n).exists()))
    return 0


_TRAIN_DEFAULTS = TrainConfig()  # what --help says a flag's default is
_MODEL_DEFAULTS = {
    name: param.default
    for name, param in inspect.signature(SequenceClassifier).parameters.items()
    if name in ("d_model", "n_heads", "n_layers")
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kernelstudy train``."""
    g = p.add_argument_group("what to train")
    g.add_argument(
        "--config", type=user_path, metavar="FILE.toml", help="settings file; flags override it"
    )
    g.add_argument(
        "--task",
        help="listops, text, retrieval, image, pathfinder, copy or mqar (required: here or in "
        "--config)",
    )
    g.add_argument("--data", metavar="DIR", help="the task's data (file tasks only)")
    g.add_argument(
        "--attention", help="softmax, kernel (elu) or a feature-map name (default: kernel)"
    )
    g.add_argument(
        "--map-arg",
        action="append",
        metavar="KEY=VALUE",
        help="feature-map hyperparameter, e.g. num_features=256 (repeatable)",
    )
    g.add_argument(
        "--task-arg",
        action="append",
        metavar="KEY=VALUE",
        help="task option (repeatable); SPLIT.KEY=VALUE sets it for one split, "
        "e.g. val.num_samples=256",
    )
    g.add_argument(
        "--model-arg",
        action="append",
        metavar="KEY=VALUE",
        help="model option, e.g. pooling=cls, dropout=0.1 (repeatable)",
    )
    g.add_argument(
        "--d-model", type=int, help=f"model width (default {_MODEL_DEFAULTS['d_model']})"
    )
    g.add_argument(
        "--heads",
        type=int,
        help=f"attention heads, dividing --d-model (default {_MODEL_DEFAULTS['n_heads']})",
    )
    g.add_argument(
        "--layers", type=int, help=f"encoder layers (default {_MODEL_DEFAULTS['n_layers']})"
    )
    g.add_argument(
        "--max-length", type=int, help="sequence length, tokens (task option; default the task's)"
    )
    g = p.add_argument_group("how to train")
    g.add_argument(
        "--out",
        metavar="DIR",
        help="run directory: checkpoint, metrics, summary (required: here or in --config)",
    )
    g.add_argument(
        "--device", help="auto (CUDA when available), cpu, cuda, cuda:1, ... (default auto)"
    )
    g.add_argument("--steps", type=int, help=f"optimizer steps (default {_TRAIN_DEFAULTS.steps})")
    g.add_argument("--batch-size", type=int, help=f"(default {_TRAIN_DEFAULTS.batch_size})")
    g.add_argument("--lr", type=float, help=f"peak learning rate (default {_TRAIN_DEFAULTS.lr:g})")
    g.add_argument("--seed", type=int, help=f"(default {_TRAIN_DEFAULTS.seed})")
    g.add_argument(
        "--eval-every",
        type=int,
        help=f"evaluate every N steps (0: at the end; default {_TRAIN_DEFAULTS.eval_every})",
    )
    g.add_argument(
        "--reg-weight",
        type=float,
        help="weight of the feature maps' penalties in the loss (default 1: each at its own "
        "reg_weight; 0: off)",
    )
    g.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the model compiled whole by torch.compile (default: [train] compile, off)",
    )
    g.add_argument(
        "--resume", action="store_true", help="require a checkpoint in --out to resume from"
    )
    g.add_argument(
        "--overwrite", action="store_true", help="start over even if --out holds a checkpoint"
    )
    g.add_argument(
        "--stop-after", type=int, metavar="N", help="pause after N steps in total; re-run to go on"
    )
    g.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: when stderr is a terminal; else a line per evaluation); "
        "--no-progress: neither",
    )


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``train`` on the ``kernelstudy`` subcommand parsers ``sub``."""
    p = sub.add_parser(
        "train",
        help="train a model on a task (LRA or synthetic) with any attention",
        description="Train a model on a task and write checkpoint, metrics and summary to "
        "--out. Settings come from --config (TOML: task, data, attention, out and the tables "
        "[task_options], [feature_map], [model], [train]) and the flags, which override it.",
        epilog="Re-running the same command with the same --out resumes from its checkpoint.",
    )
    add_arguments(p)
    p.set_defaults(func=cmd_train)
