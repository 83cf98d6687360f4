"""Rebuild the model a training run saved: ``run.json``'s model class and config, plus
``model.pt``'s weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from .. import nn as ks_nn
from ..feature_maps.registry import names_from_saved_file
from .checkpoint import read_torch_file
from .trainer import MODEL, RECORD, common_float_dtype

#: The model classes :func:`load_model` rebuilds, by the name ``run.json`` records.
MODEL_CLASSES = ("SequenceClassifier", "MatchingClassifier", "CausalLM")
#: The statuses of a run whose ``model.pt`` holds the weights of ``run.json``'s ``model_step``.
FINISHED = ("completed", "early_stopped")


def load_model(run_dir: str | os.PathLike, device: str | torch.device = "cpu") -> nn.Module:
    """The model of the run in ``run_dir`` (a ``Trainer`` ``out_dir`` or a ``kernelstudy
    train --out`` folder), in eval mode on ``device``.

    Built from ``run.json`` (its model class, one of :data:`MODEL_CLASSES`, and the
    constructor config) and loaded with ``model.pt``: the weights of the run's step
    ``model_step`` in ``run.json`` (the best evaluation's with ``restore_best``), read with
    ``weights_only=True``, in the dtype the run trained in (``run.json``'s ``model.dtype``;
    for an older record, ``model.pt``'s). A run of a user's own model class has no config
    to rebuild it from: build the model yourself and load ``model.pt`` into it. A map of
    one's own must be registered (imported, or listed in ``KERNELSTUDY_FEATURE_MAPS``)
    first, also one the record names as ``"module:Class"``: the file's names import no
    module (a shared run folder's ``run.json`` would run code of its choosing). Raises
    FileNotFoundError for a missing file, ValueError for a damaged file, a record this
    function cannot rebuild or a run that has not finished (paused, failed or interrupted
    after an earlier finish: its ``model.pt`` is that finish's, not ``model_step``'s).
    """
    run_dir = Path(run_dir)
    record_path, weights_path = run_dir / RECORD, run_dir / MODEL
    for path in (record_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(
                f"no {path.name} in {run_dir}: load_model needs a finished run's folder "
                f"({RECORD} and {MODEL}, written when a run ends)"
            )
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{record_path} is not readable JSON ({err})") from None
    saved = record.get("model") if isinstance(record, dict) else None
    name = saved.get("class") if isinstance(saved, dict) else None
    config = saved.get("config") if isinstance(saved, dict) else None
    if name not in MODEL_CLASSES or not isinstance(config, dict):
        raise ValueError(
            f"{record_path} records model class {name!r} with "
            f"{'a config' if isinstance(config, dict) else 'no config'}: load_model rebuilds "
            f"{', '.join(MODEL_CLASSES)} from their config; build other models yourself and "
            f"load {weights_path} into them"
        )
    if record.get("status") not in FINISHED:  # model.pt is written when a run ends
        raise ValueError(
            f"{record_path} records status {record.get('status')!r}, not a finished run: "
            f"{weights_path} holds an earlier finish's weights, not step "
            f"{record.get('model_step')!r}'s (continue the run to its end first)"
        )
    state = read_torch_file(weights_path, "model file", device)
    if not isinstance(state, dict):
        raise ValueError(f"{weights_path} is not a state dict (a {type(state).__name__})")
    dtype = _saved_dtype(saved.get("dtype"), state, record_path)
    try:
        with names_from_saved_file(str(record_path)):
            model = getattr(ks_nn, name)(**config)
    except TypeError as err:  # a config key or value this version's class does not take
        raise ValueError(f"{record_path}: cannot rebuild its {name} ({err})") from None
    if dtype is not None:  # a model trained in float64 or bfloat16 comes back so
        model = model.to(dtype)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:  # another model's weights in the folder
        first = str(err).strip().splitlines()[0]
        raise ValueError(
            f"{weights_path} does not fit the {name} that {record_path} records ({first})"
        ) from None
    return model.to(device).eval()


def _saved_dtype(
    recorded: object, state: dict[str, torch.Tensor], record_path: Path
) -> torch.dtype | None:
    """The dtype of the run's parameters: ``run.json``'s ``model.dtype``, or for a run
    recorded without one the floating tensors' of ``model.pt`` when they share one."""
    if recorded is not None:
        dtype = getattr(torch, recorded, None) if isinstance(recorded, str) else None
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(
                f"{record_path} records model dtype {recorded!r}, not a torch floating dtype"
            )
        return dtype
    return common_float_dtype(state.values())
