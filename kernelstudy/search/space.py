"""Search spaces: define-by-run Optuna suggestions built from the registry's declarations.

A feature map's tunable hyperparameters come from its class's ``hyperparameters``
(type, range, log scale, choices); model and optimizer ones (lr, warm-up,
weight decay, dropout) from :data:`TRAINING_SPACE`. A search config may fix any
of them or narrow their ranges.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optuna

from ..feature_maps.base import Hyperparameter
from ..feature_maps.registry import get_feature_map_class

#: Model/optimizer hyperparameters every search tunes unless the config fixes them.
TRAINING_SPACE: dict[str, Hyperparameter] = {
    "lr": Hyperparameter(float, 1e-3, low=1e-5, high=1e-2, log=True, doc="AdamW learning rate"),
    "warmup_fraction": Hyperparameter(
        float, 0.1, low=0.0, high=0.3, doc="warm-up steps as a fraction of all steps"
    ),
    "weight_decay": Hyperparameter(float, 0.01, low=1e-4, high=0.3, log=True, doc="AdamW decay"),
    "dropout": Hyperparameter(float, 0.1, low=0.0, high=0.3, doc="dropout in the encoder"),
}
#: Keys of a range dict that narrows a search (any other override fixes the value).
RANGE_KEYS = ("low", "high", "choices", "log")


def check_override(name: str, spec: Hyperparameter, override: Any) -> None:
    """Raise ValueError/TypeError naming ``name`` unless ``override`` fits ``spec``.

    A fixed value must pass ``spec.validate``; a range dict may use only
    :data:`RANGE_KEYS`, with ``choices`` a non-empty list of valid values (and then no
    ``low``/``high``/``log``), ``low`` and ``high`` within the declared bounds, and ``log``
    a bool (numeric ranges only).
    """
    if not isinstance(override, Mapping):
        spec.validate(name, override)
        return
    unknown = set(override) - set(RANGE_KEYS)
    if unknown:
        raise ValueError(
            f"search range for {name!r} has unknown keys {sorted(unknown)}; "
            f"allowed: {list(RANGE_KEYS)}"
        )
    log = override.get("log", spec.log)
    if not isinstance(log, bool):
        raise TypeError(f"{name}.log must be true or false, got {log!r}")
    if "choices" in override:
        mixed = sorted(set(override) & {"low", "high", "log"})
        if mixed:
            raise ValueError(
                f"search range for {name!r} gives choices with {mixed}: choices are searched "
                "as a list (categorical), give either choices or low/high/log"
            )
        choices = override["choices"]
        if not isinstance(choices, list | tuple) or not choices:
            raise TypeError(f"{name}.choices must be a non-empty list, got {choices!r}")
        for choice in choices:
            spec.validate(f"{name}.choices", choice)
        return
    if spec.choices is not None or spec.type is bool:
        if set(override) & {"low", "high", "log"}:
            raise ValueError(
                f"{name} is searched over its choices (no range or log scale); "
                "narrow it with choices = [..]"
            )
        return
    if spec.type not in (int, float):
        raise ValueError(f"{name} ({spec.type.__name__}) has no range to search; fix its value")
    low = spec.validate(f"{name}.low", override["low"]) if "low" in override else spec.low
    high = spec.validate(f"{name}.high", override["high"]) if "high" in override else spec.high
    if low is None or high is None:
        raise ValueError(f"{name} has no declared range to search; give low and high")
    if low > high:
        raise ValueError(f"{name}: low {low!r} is above high {high!r}")
    if log and low <= 0:
        raise ValueError(f"{name}: a log-scale range needs low > 0, got {low!r}")


def suggest(trial: optuna.Trial, name: str, spec: Hyperparameter, override: Any = None) -> Any:
    """One define-by-run suggestion for ``spec``.

    ``override`` fixes the value (any non-dict) or narrows the range with a dict
    ``{"low": .., "high": .., "choices": [..], "log": bool}``.
    """
    if override is not None and not isinstance(override, Mapping):
        return spec.validate(name, override)
    narrow = dict(override or {})
    check_override(name, spec, narrow)
    choices = narrow.get("choices", spec.choices)
    if choices is not None or spec.type is bool:
        options = list(choices) if choices is not None else [False, True]
        return trial.suggest_categorical(name, options)
    low, high = narrow.get("low", spec.low), narrow.get("high", spec.high)
    if low is None or high is None:
        raise ValueError(
            f"hyperparameter {name!r} has no finite range to search; fix it or give low/high"
        )
    log = bool(narrow.get("log", spec.log))
    if spec.type is int:
        return trial.suggest_int(name, int(low), int(high), log=log)
    if spec.type is float:
        return trial.suggest_float(name, float(low), float(high), log=log)
    raise ValueError(f"hyperparameter {name!r} of type {spec.type.__name__} cannot be searched")


def default_value(spec: Hyperparameter, override: Any = None) -> Any:
    """The value a trial at the defaults takes for ``spec``: its declared default, or where
    a narrowing (``override``) leaves the default out, the first of its ``choices`` or the
    default clamped into ``low``/``high`` (``low`` for a default of None)."""
    narrow = override if isinstance(override, Mapping) else {}
    choices = narrow.get("choices", spec.choices)
    if choices is not None:
        return spec.default if spec.default in choices else list(choices)[0]
    if spec.type is bool:
        return spec.default if isinstance(spec.default, bool) else False
    low, high = narrow.get("low", spec.low), narrow.get("high", spec.high)
    value = spec.default
    if value is None:
        return low
    if low is not None and value < low:
        return low
    if high is not None and value > high:
        return high
    return value


def suggest_feature_map(
    trial: optuna.Trial, feature_map: str, fixed: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Hyperparameters of ``feature_map`` for this trial, as ``create_feature_map`` kwargs.

    Declared hyperparameters with ``search=True`` are suggested (prefixed
    ``fm.`` in the trial); ``fixed`` entries (values or range dicts) override.
    Others keep their defaults.
    """
    cls = get_feature_map_class(feature_map)
    fixed = dict(fixed or {})
    unknown = set(fixed) - set(cls.hyperparameters)
    if unknown:
        raise ValueError(
            f"feature map {feature_map!r} has no hyperparameter(s) {sorted(unknown)}; "
            f"it takes: {', '.join(sorted(cls.hyperparameters)) or 'none'}"
        )
    params: dict[str, Any] = {}
    for key, spec in cls.hyperparameters.items():
        override = fixed.get(key)
        if override is None and not spec.search:
            continue
        if override is not None and not isinstance(override, Mapping):
            params[key] = spec.validate(key, override)
        else:
            params[key] = suggest(trial, f"fm.{key}", spec, override)
    return params


def suggest_training(trial: optuna.Trial, fixed: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """lr, warm-up fraction, weight decay and dropout for this trial (``fixed`` overrides)."""
    fixed = dict(fixed or {})
    unknown = set(fixed) - set(TRAINING_SPACE)
    if unknown:
        raise ValueError(
            f"unknown training hyperparameter(s) {sorted(unknown)}; "
            f"searchable: {', '.join(TRAINING_SPACE)}"
        )
    return {key: suggest(trial, key, spec, fixed.get(key)) for key, spec in TRAINING_SPACE.items()}
