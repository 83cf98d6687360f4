"""The training loop: AdamW, warm-up/decay, clipping, CUDA mixed precision, evaluation,
early stopping, exact checkpoint/resume, metrics history and a per-run record."""

from __future__ import annotations

import contextlib
import copy
import difflib
import json
import math
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..arguments import check_count, is_real
from ..feature_maps.base import RandomFeatureMap
from ..files import remove_abandoned_files, write_json
from ..nn.models import feature_map_parameter_count, feature_maps_of, parameter_count
from ..nn.modes import module_mode
from ..progress import tqdm
from ..tasks.files import check_path
from .checkpoint import (
    get_rng_state,
    load_checkpoint,
    save_checkpoint,
    seed_everything,
    set_rng_state,
)
from .data import BatchStream, make_loader
from .interrupt import DeferredInterrupt
from .metrics import MetricsHistory, MetricSums, peak_memory, reset_peak_memory
from .objectives import TASK_TYPES, Objective, check_task_type, infer_task_type
from .schedule import SCHEDULES, make_scheduler

EvalCallback = Callable[[int, dict[str, float]], None]

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.csv"
RECORD = "run.json"
MODEL = "model.pt"
#: the largest lr, weight_decay, ... a config takes: torch's optimizers keep them as float32
FLOAT32_MAX = torch.finfo(torch.float32).max


#: config fields that may change between a run and its resume without changing results
#: (``eval_batch_size`` only while ``eval_batches`` is None: see :func:`resume_changes`)
RESUME_FREE = {"out_dir", "progress", "device", "num_workers", "eval_batch_size"}
#: The seed of the validation sample that ``eval_batches`` scores: one for every run.
EVAL_SAMPLE_SEED = 0

#: Metrics columns that improve as they fall: ``monitor`` them with ``mode="min"``.
LOWER_IS_BETTER = ("train_loss", "val_loss", "train_reg")
#: config fields a resume refuses to change: the optimizer and schedule state saved in
#: the checkpoint hold their values, which would silently stay in force
RESUME_FIXED = ("betas", "lr", "weight_decay")


def eval_size(fields: Mapping[str, Any]) -> int:
    """The evaluation batch size of :class:`TrainConfig` fields (or a ``[train]`` table,
    where missing fields take their defaults): ``eval_batch_size``, else ``batch_size``."""
    return fields.get("eval_batch_size") or fields.get("batch_size", TrainConfig.batch_size)


def field_defaults() -> dict[str, Any]:
    """:class:`TrainConfig`'s fields and their defaults: what a run saved before a field
    existed had."""
    return {f.name: f.default for f in fields(TrainConfig)}


def resume_changes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """Names of the :class:`TrainConfig` fields (as dicts) whose change makes a resumed
    run differ from an uninterrupted one, sorted.

    The evaluation batch size is free unless ``eval_batches`` caps the evaluation: then
    it picks which examples are scored, so its value (None read as ``batch_size``) counts.
    A field that ``saved`` lacks (a checkpoint from before the field existed) had its default.
    """
    defaults = field_defaults()
    saved = {k: saved.get(k, defaults.get(k)) for k in now}
    changed = {k for k in now if k not in RESUME_FREE and saved[k] != now[k]}
    if now.get("eval_batches") is not None and eval_size(saved) != eval_size(now):
        changed.add("eval_batch_size")
    return sorted(changed)


def _model_change(saved: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    """What differs between two model identities (class and config), for an error."""
    if saved.get("class") != now.get("class"):
        return f"the checkpoint's is a {saved.get('class')}, this one a {now.get('class')}"
    old, new = saved.get("config") or {}, now.get("config") or {}
    if not isinstance(old, dict) or not isinstance(new, dict):  # a user's model's config()
        return f"its {now.get('class')} config differs (saved {old!r}, now {new!r})"
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    return f"its {now.get('class')} config differs in " + ", ".join(
        f"{k} (saved {old.get(k)!r}, now {new.get(k)!r})" for k in keys
    )


@dataclass
class TrainConfig:
    """Everything that defines a training run.

    Attributes:
        steps: optimizer steps in total.
        batch_size: training batch size; ``eval_batch_size`` (default: the same) for evaluation.
        lr, weight_decay, betas: AdamW (no decay on biases and norms: 1-d parameters,
            parameters named ``bias`` whatever their shape, and norm layers').
        warmup_steps, schedule, min_lr_ratio: linear warm-up then ``constant``, ``linear``,
            ``cosine`` or ``inverse_sqrt`` decay (see :class:`~.schedule.WarmupDecay`).
        clip_norm: max global gradient norm; None, 0 or ``"none"`` (for TOML, which has
            no null): no clipping.
        eval_every: evaluate every k steps (and at the last step); 0: only at the end.
        eval_batches: evaluate on at most this many batches (None: all), the same sample
            of a validation Dataset at every evaluation and in every run, whatever its
            ``seed`` (a fixed random order: runs of several seeds are compared on it).
        patience: stop after this many evaluations without improvement of ``monitor``
            (None: never); ``monitor`` is a metrics-row column, ``mode`` ``max`` or ``min``.
        seed: seeds the global generators at the start and the data order.
        device: ``auto`` (CUDA when available), ``cpu``, ``cuda``, ``cuda:1``...
        amp, amp_dtype: autocast (``bfloat16`` or ``float16`` with a GradScaler), CUDA only.
        compile: run the model's training and evaluation steps compiled whole
            (``torch.compile(model, fullgraph=True)``, inductor; the core's kernels stay
            custom ops in the graph): faster steps once the first of each kind has compiled
            (seconds); the same training up to float rounding, and resumes exactly. Not for
            random maps that redraw in training (``redraw_every > 0``: refused). Each such
            Trainer clears the process's ``torch.compile`` caches (``torch.compiler.reset``):
            models compiled one after another exhausted torch's recompile limit.
        reg_weight: weight of ``model.regularization()`` in the loss (1: each map's penalty
            at its own ``reg_weight`` hyperparameter, as searches and ``fit_to_softmax`` use;
            0 switches penalties off).
        task_type: ``auto`` (from the data), ``classification``, ``matching`` or ``lm``.
        out_dir: where checkpoint, metrics CSV and run record go (None: nothing written).
        num_workers: DataLoader workers for Datasets (results do not depend on it, as long
            as a Dataset's items draw no random numbers: see :class:`~.data.BatchStream`).
        progress: show a tqdm bar.
        restore_best: at the end, load the weights of the best evaluation (of equal
            ones the first; a NaN is never the best).
    """

    steps: int = 1000
    batch_size: int = 32
    eval_batch_size: int | None = None
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    schedule: str = "cosine"
    min_lr_ratio: float = 0.0
    clip_norm: float | None = 1.0
    eval_every: int = 100
    eval_batches: int | None = None
    patience: int | None = None
    monitor: str = "val_accuracy"
    mode: str = "max"
    seed: int = 0
    device: str = "auto"
    amp: bool = True
    amp_dtype: str = "bfloat16"
    compile: bool = False
    reg_weight: float = 1.0
    task_type: str = "auto"
    out_dir: str | None = None
    num_workers: int = 0
    progress: bool = True
    restore_best: bool = True

    def __post_init__(self) -> None:
        def positive(name: str, allow_zero: bool = False, optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            # numpy ints too, kept as Python ints (the config is written as JSON)
            setattr(self, name, check_count(name, value, 0 if allow_zero else 1))

        positive("steps")
        positive("batch_size")
        positive("eval_batch_size", optional=True)
        positive("warmup_steps", allow_zero=True)
        positive("eval_every", allow_zero=True)
        positive("eval_batches", optional=True)
        positive("patience", optional=True)
        positive("seed", allow_zero=True)
        if self.seed >= 2**63:
            raise ValueError(f"seed must be < 2**63 (torch's generators), got {self.seed}")
        for name in ("amp", "compile", "progress", "restore_best"):
            if not isinstance(getattr(self, name), bool):  # "false" would read as True
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        positive("num_workers", allow_zero=True)
        for name in ("lr", "weight_decay", "reg_weight", "min_lr_ratio"):
            value = getattr(self, name)
            if not is_real(value) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
            if not isinstance(value, int | float):  # numpy's: plain for the JSON config
                value = float(value)
                setattr(self, name, value)
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value!r}")
            if value > FLOAT32_MAX:  # the optimizer keeps them as float32: a crash inside it
                raise ValueError(f"{name} must be at most {FLOAT32_MAX:.4g}, got {value!r}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        clip = self.clip_norm
        number = is_real(clip)
        if (number and clip == 0) or (isinstance(clip, str) and clip.lower() == "none"):
            self.clip_norm = None  # clipping off
        elif clip is not None and not (number and clip > 0):
            raise ValueError(
                f"clip_norm must be > 0, or None, 0 or 'none' for no clipping, got {clip!r}"
            )
        elif number and not isinstance(clip, int | float):
            self.clip_norm = float(clip)
        betas = self.betas
        if (
            not isinstance(betas, list | tuple)
            or len(betas) != 2
            or not all(is_real(b) for b in betas)
            or not all(0.0 <= b < 1.0 for b in betas)
        ):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        self.betas = tuple(b if isinstance(b, int | float) else float(b) for b in betas)
        possible = metric_columns("lm", validation=True, regularized=True, clipped=True)
        if self.monitor not in possible:
            raise ValueError(
                f"monitor must be a metrics column, one of {possible}, got {self.monitor!r}"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {self.mode!r}")
        if self.monitor in LOWER_IS_BETTER and self.mode == "max":  # (mode defaults to max)
            raise ValueError(
                f"monitor {self.monitor!r} improves as it falls: give mode='min' (with "
                "'max', early stopping and restore_best keep the worst)"
            )
        if self.amp_dtype not in ("bfloat16", "float16"):
            raise ValueError(f"amp_dtype must be 'bfloat16' or 'float16', got {self.amp_dtype!r}")
        check_task_type(self.task_type)
        if self.out_dir is not None:  # "" would be the current directory
            self.out_dir = str(check_path("out_dir", self.out_dir))
        if not isinstance(self.device, str):
            raise ValueError(
                f"device must be a str such as 'auto' or 'cuda:0', got {self.device!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain JSON values (``betas`` a list), as :meth:`from_dict` takes."""
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        """A config from a dict (e.g. a TOML/JSON table); unknown keys raise ValueError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TrainConfig field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


def metric_columns(task_type: str, validation: bool, regularized: bool, clipped: bool) -> list[str]:
    """The metric columns of an evaluation's metrics row (what ``monitor`` may name):
    ``lr``, ``train_``/``val_`` loss and accuracy (and ``sequence_accuracy`` for ``lm``),
    ``train_reg`` when a penalty is added, ``grad_norm`` when gradients are clipped."""
    per = ["loss", "accuracy"] + (["sequence_accuracy"] if task_type == "lm" else [])
    columns = ["lr", *(f"train_{m}" for m in per)]
    columns += ["train_reg"] if regularized else []
    columns += ["grad_norm"] if clipped else []
    return columns + ([f"val_{m}" for m in per] if validation else [])


def check_stop_after(stop_after: object, name: str = "stop_after") -> None:
    """ValueError naming ``name`` unless ``stop_after`` (the steps after which ``fit``
    pauses) is None or an int >= 0."""
    if stop_after is not None and (
        isinstance(stop_after, bool) or not isinstance(stop_after, int) or stop_after < 0
    ):
        raise ValueError(f"{name} must be >= 0 (an int), got {stop_after!r}")


def parse_device(device: str) -> torch.device:
    """``device`` as a torch.device, without asking whether this machine has it; a name
    torch does not know raises ValueError naming the usual choices and the nearest one
    (torch's own message lists its 20 device types: ipu, xla, fpga, ...)."""
    try:
        return torch.device(device)
    except RuntimeError:
        kind = str(device).split(":")[0]
        close = difflib.get_close_matches(kind, ["auto", "cpu", "cuda", "mps"], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"device {device!r}: expected auto, cpu, cuda or cuda:N (or another torch device "
            f"type){hint}"
        ) from None


def resolve_device(device: str) -> torch.device:
    """``auto`` → CUDA if available else CPU; a device this machine lacks (CUDA, ``mps``, a
    CUDA index past the last GPU...) raises ValueError."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = parse_device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} asked for, but CUDA is not available")
    if dev.type not in ("cpu", "meta"):
        try:
            torch.empty(0, device=dev)
        except (RuntimeError, AssertionError) as err:  # e.g. "not linked with support for mps"
            text = str(err).strip() or type(err).__name__
            first = text.splitlines()[0].split(". ")[0]  # torch's messages run on
            raise ValueError(f"device={device!r} is not usable here: {first}") from None
    return dev


def _task_type_of(data: Dataset | DataLoader) -> str:
    dataset = data.dataset if isinstance(data, DataLoader) else data
    if getattr(dataset, "pairs", False):
        return "matching"
    if hasattr(dataset, "num_classes"):
        return "lm" if dataset.num_classes is None else "classification"
    try:
        item = dataset[0]
    except Exception as err:  # iterable datasets, etc.
        raise ValueError(
            "cannot infer task_type from the training data; set TrainConfig.task_type"
        ) from err
    return infer_task_type(item)


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    raise TypeError(f"batches must be dicts of tensors, got {type(batch).__name__}")


def _feature_dim(model: nn.Module) -> int | list[int] | None:
    """F of the model's feature maps: an int, None without maps (softmax), or the sorted
    dims when the maps differ (e.g. two towers with other maps)."""
    dims = sorted({fm.feature_dim for fm in feature_maps_of(model)})
    if not dims:
        return None
    return dims[0] if len(dims) == 1 else dims


def common_float_dtype(tensors: Iterable[Any]) -> torch.dtype | None:
    """The dtype all floating tensors among ``tensors`` have, or None when they have several
    or there are none (other values are passed over)."""
    dtypes = {t.dtype for t in tensors if torch.is_tensor(t) and t.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else None


def _parameter_dtype(model: nn.Module) -> str | None:
    """The name of the dtype all of ``model``'s floating parameters have (``"float32"``), or
    None (:func:`common_float_dtype`)."""
    dtype = common_float_dtype(model.parameters())
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _state_copy(model: nn.Module) -> dict[str, Any]:
    """A CPU copy of ``model.state_dict()``: tensors, and extra state (a random map's seed)."""
    return {
        k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else copy.deepcopy(v)
        for k, v in model.state_dict().items()
    }


#: modules whose parameters are never decayed, whatever their shape
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)


def _no_decay(module: nn.Module, name: str, param: nn.Parameter) -> bool:
    """Whether ``param`` (called ``name`` in ``module``) is a bias, a norm's or 1-d: the
    AdamW convention of :class:`TrainConfig`. A bias is named by name, not shape: a map's
    per-head bias, e.g. Hedgehog's ``(H, 1, D)``, is as much a bias as a 1-d one."""
    bias = name == "bias" or name.startswith("bias_") or name.endswith("_bias")
    return param.dim() < 2 or bias or isinstance(module, _NORMS)


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    seen: set[int] = set()  # a shared (tied) parameter goes into one group, once
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (rest if _no_decay(module, name, p) else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _check_compilable(model: nn.Module) -> None:
    """Raise a ValueError where ``model`` has a random map that redraws in training
    (``redraw_every > 0``): a redraw makes new CPU generators, which a graph compiled whole
    cannot hold (dynamo stopped the run at the first redraw)."""
    redrawing = sorted(
        {
            type(fm).__name__
            for fm in feature_maps_of(model)
            if isinstance(fm, RandomFeatureMap)
            and fm.hparams.get("redraw_every")
            # a map the caller keeps in eval mode never redraws (fit sets the whole model
            # training only where it is all in eval mode)
            and (fm.training or not model.training)
        }
    )
    if redrawing:
        raise ValueError(
            f"compile (--compile) cannot run a model whose maps redraw in training "
            f"({', '.join(redrawing)} with redraw_every > 0: a redraw makes new random "
            "generators, which a graph compiled whole cannot hold); set redraw_every=0 or "
            "train without compile"
        )


class Trainer:
    """Train ``model`` on ``train_data`` (a Dataset of dict items or a DataLoader of dict batches).

    Args:
        model: a classifier / matching model / LM whose call signature fits the task
            type (see :mod:`.objectives`); ``model.regularization()`` is added to the loss
            times ``config.reg_weight`` when the model has it.
        train_data, val_data, test_data: Datasets or DataLoaders; ``val_data`` is
            evaluated every ``eval_every`` steps, ``test_data`` once at the end.
        config: a :class:`TrainConfig`.
        on_eval: callback(s) ``f(step, metrics)`` called after every evaluation, with the
            metrics row plus ``final`` (True at the run's last evaluation: its last step, or
            an early stop); exceptions (e.g. ``optuna.TrialPruned``) propagate out of
            :meth:`fit` after the run record is written.

    Outputs in ``config.out_dir``: ``checkpoint.pt`` (after every evaluation and at the
    end, with the last step's weights), ``metrics.csv`` (one row per evaluation),
    ``run.json`` (the run record) and ``model.pt`` (the final state dict: the best
    evaluation's with ``restore_best``).
    """

    def __init__(
        self,
        model: nn.Module,
        train_data: Dataset | DataLoader,
        config: TrainConfig | None = None,
        val_data: Dataset | DataLoader | None = None,
        test_data: Dataset | DataLoader | None = None,
        on_eval: EvalCallback | Iterable[EvalCallback] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.config = config = config if config is not None else TrainConfig()
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
        if config.patience is not None and val_data is None and config.monitor.startswith("val_"):
            raise ValueError(
                f"patience (early stopping) on monitor {config.monitor!r} needs val_data"
            )
        self.device = resolve_device(config.device)
        # a model the caller compiled is trained through its wrapper, and saved and recorded
        # as the module inside (the wrapper's state dict prefixes every key with _orig_mod.)
        inner = getattr(model, "_orig_mod", None)
        compiled = isinstance(inner, nn.Module)
        self.model = (inner if compiled else model).to(self.device)
        # what the steps call: compiled whole (its weights are the model's), the caller's
        # compiled wrapper, or the model
        if config.compile:
            _check_compilable(self.model)
            # the graphs of every model of a class (train and eval, per hyperparameter value)
            # count toward one recompile limit of its forward: the fifth compiled fit of a
            # process (a search's trials) failed on it. Each Trainer starts afresh.
            torch.compiler.reset()
            self.run_model = torch.compile(self.model, fullgraph=True)
        else:
            self.run_model = model if compiled else self.model
        self.train_loader = make_loader(
            train_data, config.batch_size, config.seed, True, config.num_workers
        )
        self.val_loader = None
        if val_data is not None:
            self.val_loader = self._eval_loader(val_data, config.eval_batches, "val_data")
        if test_data is not None:  # checked now, not once training has ended
            self._eval_loader(test_data, None, "test_data")
        self.test_data = test_data
        task_type = config.task_type
        self.task_type = _task_type_of(train_data) if task_type == "auto" else task_type
        if self.task_type not in TASK_TYPES:
            raise ValueError(f"task_type must be one of {TASK_TYPES}, got {self.task_type!r}")
        self.objective = Objective(self.task_type)
        regularized = bool(config.reg_weight) and hasattr(model, "regularization")
        columns = metric_columns(self.task_type, True, regularized, config.clip_norm is not None)
        if config.monitor not in columns:  # (val_ columns without val_data: nothing monitored)
            raise ValueError(
                f"monitor {config.monitor!r} is not a metric of this run (task_type "
                f"{self.task_type!r}, reg_weight {config.reg_weight}, clip_norm "
                f"{config.clip_norm}); it has {columns}"
            )
        if callable(on_eval):
            on_eval = [on_eval]
        if not isinstance(on_eval, Iterable | None) or not all(map(callable, on_eval or [])):
            raise TypeError("on_eval must be a callable f(step, metrics) or a list of them")
        self.callbacks: list[EvalCallback] = list(on_eval or [])

        self.optimizer = torch.optim.AdamW(
            _param_groups(self.model, config.weight_decay), lr=config.lr, betas=config.betas
        )
        self.scheduler = make_scheduler(
            self.optimizer, config.schedule, config.warmup_steps, config.steps, config.min_lr_ratio
        )
        self.use_amp = config.amp and self.device.type == "cuda"
        self.amp_dtype = getattr(torch, config.amp_dtype)
        fp16 = self.use_amp and self.amp_dtype == torch.float16
        self.scaler = torch.amp.GradScaler("cuda", enabled=fp16)

        self.step = 0
        self.stream = BatchStream(self.train_loader)
        self.history = MetricsHistory()
        self.sums = MetricSums()
        self.best: dict[str, Any] = {"monitor": config.monitor, "value": None, "step": None}
        self.bad_evals = 0
        self.stopped_early = False
        self.best_state: dict[str, torch.Tensor] | None = None
        self.elapsed = 0.0  # seconds in fit: training, evaluations, test scoring, checkpoints
        self.train_time = 0.0  # seconds in training steps only (see _count_training)
        self.test_metrics: dict[str, float] | None = None
        self.test_step: int | None = None  # the step test_metrics were taken at
        # the last step's weights while the model holds the restored best ones (_finish)
        self._last_weights: dict[str, Any] | None = None
        self.status = "new"
        self._last_lr = config.lr
        self.out_dir = Path(config.out_dir) if config.out_dir is not None else None

    # ----------------------------------------------------------------- public
    @property
    def metrics(self) -> pd.DataFrame:
        """The metrics history, one row per evaluation."""
        return self.history.frame()

    @torch.inference_mode(False)
    @torch.enable_grad()
    def fit(self, stop_after: int | None = None, resume: bool = False) -> dict[str, Any]:
        """Train until ``config.steps`` (or early stopping); return the run record. Gradients
        are on whatever the caller's mode (under ``no_grad`` or ``inference_mode`` the first
        step failed with "element 0 of tensors does not require grad").

        ``stop_after``: pause after this many steps in total (checkpoint written, status
        ``paused``); ``resume``: continue from ``out_dir/checkpoint.pt`` when it exists.
        A Ctrl-C (in the main thread) takes effect at the end of the current step: the
        checkpoint is saved there, then KeyboardInterrupt is raised (status ``interrupted``);
        a second Ctrl-C interrupts at once.
        """
        cfg = self.config
        check_stop_after(stop_after)
        if self.out_dir is not None:  # a killed save's temp file, as large as the checkpoint
            for name in (CHECKPOINT, METRICS, RECORD, MODEL):
                remove_abandoned_files(self.out_dir, f".{name}.*.tmp")
        if resume:
            if self.out_dir is None:
                raise ValueError("resume=True needs config.out_dir (where the checkpoint is)")
            if (self.out_dir / CHECKPOINT).is_file():
                self.load_checkpoint(self.out_dir / CHECKPOINT)
        if self.step == 0:
            seed_everything(cfg.seed)
        if not self.model.training:  # a model handed over in eval mode trains; submodules the
            self.model.train()  # caller set apart (a map kept from redrawing) keep their modes
        reset_peak_memory(self.device)
        start = time.perf_counter()
        bar = tqdm(
            total=cfg.steps, initial=self.step, disable=not cfg.progress, desc="train", leave=False
        )
        if self._last_weights is not None and self.step < cfg.steps and not self.stopped_early:
            self.model.load_state_dict(self._last_weights)  # train on from the last step's
            self._last_weights = None
        interrupt = DeferredInterrupt()
        stretch = time.perf_counter()  # the start of the current stretch of training steps
        try:
            self.status = "running"
            with interrupt:
                while self.step < cfg.steps and not self.stopped_early:
                    if stop_after is not None and self.step >= stop_after:
                        break
                    loss = self._train_step()
                    self.step += 1
                    bar.update(1)
                    if self.step % 10 == 0 or self.step == cfg.steps:
                        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{self._last_lr:.2e}")
                    if self.step == cfg.steps or (
                        cfg.eval_every and self.step % cfg.eval_every == 0
                    ):
                        self._count_training(stretch)
                        self.elapsed += time.perf_counter() - start
                        start = time.perf_counter()
                        self._evaluate_and_log()
                        stretch = time.perf_counter()
                    if interrupt.requested:  # between steps: the state is consistent
                        break
            self._count_training(stretch)
            # a Ctrl-C in a step, or after the last step's check as the loop was left
            if interrupt.requested:
                self.elapsed += time.perf_counter() - start
                start = time.perf_counter()
                if self.out_dir is not None:
                    self.save_checkpoint()
                raise KeyboardInterrupt
            finished = self.step >= cfg.steps or self.stopped_early
            if finished:
                self.status = "early_stopped" if self.stopped_early else "completed"
                self._finish()
            else:
                self.status = "paused"
            self.elapsed += time.perf_counter() - start
            if self.out_dir is not None:  # the last step's weights, to extend the run from
                self.save_checkpoint()
            return self._write_record()
        except BaseException as err:
            self.elapsed += time.perf_counter() - start
            self.status = {"TrialPruned": "pruned", "KeyboardInterrupt": "interrupted"}.get(
                type(err).__name__, "failed"
            )
            with contextlib.suppress(Exception):  # never mask the original error
                self._write_record(error=f"{type(err).__name__}: {err}")
            if isinstance(err, KeyboardInterrupt):  # a deferred SIGTERM ends the process now
                interrupt.end_if_terminated()
            raise
        finally:
            bar.close()
            self.stream.release()  # no idle DataLoader workers held by a finished fit

    @torch.no_grad()
    def evaluate(
        self, data: Dataset | DataLoader, max_batches: int | None = None
    ) -> dict[str, float]:
        """Mean loss and accuracy (``sequence_accuracy`` too for LM) of the model on ``data``
        (``max_batches``, an int >= 1, when given: that many batches of a Dataset in a fixed
        random order seeded by ``config.seed``, the same at every call; of a DataLoader, its
        first batches).

        The global random generators are left as they were: a DataLoader without its own
        generator (one passed in, or over an IterableDataset) draws its seed from torch's
        global one, which then gave training other dropout masks, so that ``eval_every``
        changed the trained model."""
        if max_batches is not None:  # 0 or -1 read as "no batches", 2.5 as 3
            max_batches = check_count("max_batches", max_batches, 1)
        loader = self._eval_loader(data, max_batches, "data")
        sums = MetricSums()
        rng = get_rng_state(self.device)
        try:
            with module_mode(self.model, False):  # each submodule's mode back after it
                for i, batch in enumerate(loader):
                    if max_batches is not None and i >= max_batches:
                        break
                    with torch.autocast(self.device.type, self.amp_dtype, enabled=self.use_amp):
                        _, stats = self.objective(self.run_model, _to_device(batch, self.device))
                    sums.add(stats)
        finally:
            set_rng_state(rng, self.device)
        if not sums:
            raise ValueError("evaluation data yields no batches")
        return Objective.summarize(sums.values())

    def _eval_loader(
        self, data: Dataset | DataLoader, max_batches: int | None, name: str
    ) -> DataLoader:
        """An evaluation DataLoader over ``data``: in order, or where only ``max_batches``
        batches are scored, in a fixed random order (a sample of the whole: files sorted by
        label, as IMDB's ``neg/`` then ``pos/``, gave first batches of one class, and a model
        always answering it scored 1.0). The order is the same for every run, not drawn from
        its training seed: runs of other seeds (an evaluation's, then the best of them by
        validation accuracy) were scored on other samples, which share a few examples."""
        cfg = self.config
        size = cfg.eval_batch_size or cfg.batch_size
        sample = max_batches is not None
        return make_loader(
            data, size, EVAL_SAMPLE_SEED, sample, cfg.num_workers, name, drop_last=False
        )

    def save_checkpoint(self, path: str | Path | None = None) -> Path:
        """Save all an exact resume needs, atomically (default ``out_dir/checkpoint.pt``)."""
        path = self._path(CHECKPOINT) if path is None else Path(path)
        weights = self._last_weights  # the last step's, while the model holds the best ones
        state = {
            "format": 1,
            "config": self.config.to_dict(),
            "step": self.step,
            "model": self.model.state_dict() if weights is None else weights,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "data": self.stream.state_dict(),
            "rng": get_rng_state(self.device),
            "history": self.history.rows,
            "sums": self.sums.state_dict(),
            "best": self.best,
            "bad_evals": self.bad_evals,
            "stopped_early": self.stopped_early,
            "best_state": self.best_state,
            "elapsed": self.elapsed,
            "train_time": self.train_time,
            "last_lr": self._last_lr,
            "test_metrics": self.test_metrics,
            "test_step": self.test_step,
            "status": self.status,
            "model_identity": self._model_identity(),
        }
        return save_checkpoint(path, state)

    def _model_identity(self) -> dict[str, Any]:
        """The model's class and constructor config as JSON values (objects as their str),
        so that a resume into another model is caught and the checkpoint holds no object."""
        config_fn = getattr(self.model, "config", None)
        config = config_fn() if callable(config_fn) else None
        return {
            "class": type(self.model).__name__,
            "config": json.loads(json.dumps(config, default=str)),
        }

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore a :meth:`save_checkpoint` state: weights, optimizer, schedule, data
        position and random states (training then continues bit-for-bit on CPU)."""
        state = load_checkpoint(path)
        needed = ("config", "model", "optimizer", "scheduler", "step", "data", "rng")
        missing = [key for key in needed if key not in state]
        if missing:
            hint = " (model.pt holds only the weights)" if "format" not in state else ""
            raise ValueError(
                f"{path} is not a Trainer checkpoint: it lacks {', '.join(missing)}{hint}"
            )
        saved_model, model = state.get("model_identity"), self._model_identity()
        if saved_model is not None and saved_model != model:  # older checkpoints: unchecked
            raise ValueError(
                f"cannot resume {path} into another model: " + _model_change(saved_model, model)
            )
        saved = dict(state["config"])
        now = self.config.to_dict()
        changed = resume_changes(saved, now)
        fixed = [name for name in RESUME_FIXED if name in changed]
        if fixed:
            raise ValueError(
                f"cannot resume {path} with changed {', '.join(fixed)} (saved: "
                + ", ".join(f"{name}={saved[name]!r}" for name in fixed)
                + "): the optimizer state holds the saved values; start a new run instead"
            )
        if changed:
            warnings.warn(
                f"resuming {path} with changed config field(s) {changed}; "
                "the run will not match an uninterrupted one",
                stacklevel=2,
            )
        try:
            self.model.load_state_dict(state["model"])
        except RuntimeError as err:  # another model's shapes or names
            first = str(err).strip().splitlines()[0]
            raise ValueError(f"{path} holds the weights of another model ({first})") from None
        self._last_weights = None  # the model holds the checkpoint's (last step's) weights
        self.optimizer.load_state_dict(state["optimizer"])
        sched = dict(state["scheduler"])
        sched["lr_lambdas"] = [None] * len(self.scheduler.lr_lambdas)  # keep this config's
        self.scheduler.load_state_dict(sched)
        if state["scaler"]:  # empty when saved without float16 AMP (e.g. on the CPU): an
            self.scaler.load_state_dict(state["scaler"])  # enabled scaler refuses it
        self.step = int(state["step"])
        self.history = MetricsHistory(state["history"])
        sums = dict(state["sums"])
        if "grad_norm_sum" in sums and "grad_norm_count" not in sums:  # saved before the
            sums["grad_norm_count"] = sums.get("steps", 0.0)  # count: every step counted
        self.sums.load_state_dict(sums)
        self.best = dict(state["best"])
        self.bad_evals = int(state["bad_evals"])
        self.stopped_early = bool(state["stopped_early"])
        self.best_state = state["best_state"]
        self.elapsed = float(state["elapsed"])
        # (older checkpoints lack it: their wall time, evaluations included, bounds it)
        self.train_time = float(state.get("train_time", self.elapsed))
        self._last_lr = float(state["last_lr"])
        self.test_metrics = state["test_metrics"]
        # (older checkpoints lack test_step: their test metrics were taken at their step)
        had_test = self.test_metrics is not None
        self.test_step = state.get("test_step", self.step if had_test else None)
        self.stream.load_state_dict(state["data"])
        set_rng_state(
            state["rng"], self.device
        )  # after the data stream, which may use the generators

    def record(self, error: str | None = None) -> dict[str, Any]:
        """The run record: status, sizes (parameters, feature dimension), peak memory, metrics.

        Times, summed over the fits of the run: ``wall_time_s`` everything in ``fit``
        (evaluations, test scoring and checkpoints included); ``train_time_s`` the training
        steps alone (data, forward, backward, optimizer), the model's training cost.

        ``final`` is the last evaluation's metrics row; ``model_step`` the step whose weights
        the model holds (``model.pt``, and the ``test`` metrics): the best evaluation's with
        ``restore_best`` once the run has finished, else the last step; ``model_metrics``
        the evaluation row of that step (None if it was not evaluated)."""
        total = parameter_count(self.model)
        fm = feature_map_parameter_count(self.model)
        config_fn = getattr(self.model, "config", None)
        rows = self.history.rows
        # the model holds the best evaluation's weights while the last step's are kept aside
        model_step = self.best["step"] if self._last_weights is not None else self.step
        return {
            "status": self.status,
            "error": error,
            "steps_completed": self.step,
            "steps": self.config.steps,
            "stopped_early": self.stopped_early,
            "task_type": self.task_type,
            "best": self.best,
            "final": rows[-1] if rows else None,
            "model_step": model_step,
            "model_metrics": next((r for r in rows if r["step"] == model_step), None),
            "test": self.test_metrics if self.test_step == self.step else None,
            "parameters": {
                "total": total,
                "trainable": parameter_count(self.model, trainable_only=True),
                "feature_map": fm,
                "feature_map_fraction": fm / total if total else 0.0,
            },
            "feature_dim": _feature_dim(self.model),
            **peak_memory(self.device),
            "device": str(self.device),
            "amp": self.config.amp_dtype if self.use_amp else None,
            "wall_time_s": self.elapsed,
            "train_time_s": self.train_time,
            "model": {
                "class": type(self.model).__name__,
                "config": config_fn() if callable(config_fn) else None,
                "dtype": _parameter_dtype(self.model),
            },
            "config": self.config.to_dict(),
            "torch": torch.__version__,
        }

    # ---------------------------------------------------------------- private
    def _path(self, name: str) -> Path:
        if self.out_dir is None:
            raise ValueError("config.out_dir is not set")
        return self.out_dir / name

    def _train_step(self) -> float:
        cfg = self.config
        batch = _to_device(next(self.stream), self.device)
        with torch.autocast(self.device.type, self.amp_dtype, enabled=self.use_amp):
            loss, stats = self.objective(self.run_model, batch)
            total = loss
            if cfg.reg_weight and hasattr(self.model, "regularization"):
                reg = self.model.regularization()
                total = loss + cfg.reg_weight * reg
                stats["reg_sum"] = reg.detach().float()
        value = float(total.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"non-finite training loss {value} at step {self.step + 1}")
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(total).backward()
        norm = None
        if cfg.clip_norm is not None:
            self.scaler.unscale_(self.optimizer)
            norm = nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_norm)
            # float16's scaler skips a step whose gradients overflowed (inf norm, on purpose
            # now and then): the window's mean is over the steps applied
            applied = torch.isfinite(norm.detach())
            stats["grad_norm_sum"] = torch.where(applied, norm.detach(), 0.0).float()
            stats["grad_norm_count"] = applied.float()
        if not self.scaler.is_enabled():  # (float16's scaler skips such steps itself)
            # a finite loss can still have an inf/NaN gradient: stop before it reaches the
            # weights (and the next checkpoint), not a step later
            if norm is None:
                grads = [p.grad for p in self.model.parameters() if p.grad is not None]
                norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
            if not math.isfinite(float(norm)):
                raise FloatingPointError(
                    f"non-finite gradient (norm {float(norm)}) at step {self.step + 1}"
                )
        self._last_lr = self.optimizer.param_groups[0]["lr"]
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        stats["steps"] = torch.ones((), device=self.device)
        self.sums.add(stats)
        return value

    def _count_training(self, since: float) -> None:
        """Add the time from ``since`` to now to ``train_time``: the training steps (data,
        forward, backward, optimizer) of a stretch between evaluations, after waiting for
        the GPU's queued work (a step's backward would count as the next evaluation's)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.train_time += time.perf_counter() - since

    def _evaluate_and_log(self) -> None:
        cfg = self.config
        sums = self.sums.values()
        steps = max(sums.get("steps", 0.0), 1.0)
        row: dict[str, Any] = {
            "step": self.step,
            "epoch": self._epoch(),
            "lr": self._last_lr,
        }
        row.update({f"train_{k}": v for k, v in Objective.summarize(sums).items()})
        if "reg_sum" in sums:
            row["train_reg"] = sums["reg_sum"] / steps
        if "grad_norm_sum" in sums:  # NaN when the scaler skipped every step of the window
            count = sums.get("grad_norm_count", 0.0)
            row["grad_norm"] = sums["grad_norm_sum"] / count if count else math.nan
        self.sums = MetricSums()
        if self.val_loader is not None:
            val = self.evaluate(self.val_loader, cfg.eval_batches)
            row.update({f"val_{k}": v for k, v in val.items()})
        row["elapsed_s"] = self.elapsed
        self._update_best(row)
        self.history.append(row)
        if self.out_dir is not None:  # the checkpoint first: metrics.csv without one is a
            self.save_checkpoint()  # run's results the same command would refuse to replace
            self.history.write_csv(self._path(METRICS))
        final = self.stopped_early or self.step >= cfg.steps  # no evaluation follows
        for callback in self.callbacks:
            callback(self.step, {**row, "final": final})

    def _epoch(self) -> float:
        """Epochs done, fractional (whole epochs only for loaders without a length)."""
        try:
            per_epoch = len(self.train_loader)
        except TypeError:
            return float(self.stream.epoch)
        return self.stream.epoch + self.stream.batch / max(per_epoch, 1)

    def _update_best(self, row: dict[str, Any]) -> None:
        cfg = self.config
        if cfg.monitor not in row:
            if self.val_loader is None and cfg.monitor.startswith("val_"):
                return  # nothing to monitor without validation data
            raise ValueError(f"monitor {cfg.monitor!r} is not a metric; have {sorted(row)}")
        value = float(row[cfg.monitor])
        best = self.best["value"]
        # NaN is never an improvement: a NaN best compared False with every later value
        # (early stopping fired, restore_best loaded the NaN step's weights); rows of NaN
        # outputs count as wrong in an accuracy (Objective)
        better = not math.isnan(value) and (
            best is None or (value > best if cfg.mode == "max" else value < best)
        )
        if better:
            self.best = {"monitor": cfg.monitor, "value": value, "step": self.step}
            self.bad_evals = 0
            if cfg.restore_best:
                self.best_state = _state_copy(self.model)
        else:
            self.bad_evals += 1
            # at the last step nothing is cut short: the run completed
            if cfg.patience is not None and self.bad_evals >= cfg.patience:
                self.stopped_early = self.step < cfg.steps

    def _finish(self) -> None:
        """Load the best weights (with ``restore_best``), save them as ``model.pt`` and
        score the test data (again if steps ran since it was scored). The checkpoint keeps
        the last step's weights (see :meth:`fit`): an extended run goes on from them."""
        if self.config.restore_best and self.best_state is not None:
            if self._last_weights is None:  # kept for the checkpoint (a second fit too)
                self._last_weights = _state_copy(self.model)
            self.model.load_state_dict(self.best_state)
        if self.out_dir is not None:
            save_checkpoint(self._path(MODEL), self.model.state_dict())
        if self.test_data is not None and self.test_step != self.step:
            self.test_metrics = self.evaluate(self.test_data)
            self.test_step = self.step

    def _write_record(self, error: str | None = None) -> dict[str, Any]:
        record = self.record(error)
        if self.out_dir is not None:
            write_json(self._path(RECORD), record)
            # not where the first checkpoint failed: metrics without one are a finished
            # run's results to the same command, which would refuse to run again
            if len(self.history) and self._path(CHECKPOINT).is_file():
                self.history.write_csv(self._path(METRICS))
        return record


def train(
    model: nn.Module,
    train_data: Dataset | DataLoader,
    config: TrainConfig | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """``Trainer(model, train_data, config, **kwargs).fit()``: train and return the run record."""
    return Trainer(model, train_data, config, **kwargs).fit()
