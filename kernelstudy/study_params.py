"""What a study's script checks of its config, and the labels of its feature maps.

A study's config entries are checked by kind (:func:`check_params`: counts, positive
numbers, lists of them, flags) and by what they name (:func:`check_names`,
:func:`check_lengths`, the feature maps: :func:`check_map_names`, :func:`check_map_spec`,
:func:`check_map_list`, :func:`check_map_builds`). A feature map in a study's rows is a
label (:func:`map_label`: ``"favor"``, ``"favor(num_features=64)"``), which
:func:`parse_map_label` and :func:`map_name_and_hparams` turn back into the map and
:func:`matched_map` builds at a feature dimension. The studies take these from
:mod:`kernelstudy.study`, which re-exports them.
"""

from __future__ import annotations

import ast
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

#: What :func:`check_params` takes of each kind of config entry.
PARAM_KINDS = {
    "count": "an int >= 1",
    "count0": "an int >= 0",
    "positive": "a finite number > 0",
    "counts": "a non-empty list of ints >= 1",
    "positives": "a non-empty list of finite numbers > 0",
    "flags": "a non-empty list of true and false, each at most once",
}


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_positive(value: Any) -> bool:
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def _fits(kind: str, value: Any) -> bool:
    if kind == "count":
        return _is_int(value) and value >= 1
    if kind == "count0":
        return _is_int(value) and value >= 0
    if kind == "positive":
        return _is_positive(value)
    if not isinstance(value, list) or not value:
        return False
    if kind == "counts":
        return all(_is_int(v) and v >= 1 for v in value)
    if kind == "positives":
        return all(_is_positive(v) for v in value)
    return all(isinstance(v, bool) for v in value) and len(set(value)) == len(value)


def check_params(params: Mapping[str, Any], kinds: Mapping[str, str | Sequence[str]]) -> None:
    """ValueError naming the first entry of ``params`` that is not of its kind in ``kinds``:
    a dotted key (``"copy.steps"`` is ``steps`` of table ``copy``) to a kind of
    :data:`PARAM_KINDS`, or to the names a non-empty list of them may hold (each at most
    once). A study's ``configs`` calls it first, so a mistyped value fails before any run (it
    failed in the first run that used it, after others had run; a string was looped over as
    its characters). Values are left as they are (they make the configs' ids)."""
    for key, kind in kinds.items():
        value: Any = params
        for part in key.split("."):
            if not isinstance(value, Mapping) or part not in value:
                raise ValueError(f"config entry {key} is missing")
            value = value[part]
        if isinstance(kind, str):
            if kind not in PARAM_KINDS:
                raise ValueError(f"kind {kind!r} of {key} is not one of {sorted(PARAM_KINDS)}")
            if not _fits(kind, value):
                raise ValueError(f"{key} must be {PARAM_KINDS[kind]}, got {value!r}")
        elif (
            not isinstance(value, list)
            or not value
            or not all(isinstance(v, str) and v in kind for v in value)
            or len(set(value)) != len(value)
        ):
            choices = ", ".join(map(repr, kind))
            raise ValueError(
                f"{key} must be a non-empty list of {choices} (each at most once), got {value!r}"
            )


def check_names(key: str, names: Sequence[str], known: Sequence[str]) -> list[str]:
    """The names of config entry ``key`` as a list, else ValueError naming ``key`` and each
    unknown one (a mistyped map used to drop out of a study without a word)."""
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{key}: unknown name(s) {unknown}; known: {', '.join(map(str, known))}")
    return list(names)


def check_lengths(key: str, values: Any) -> list[int]:
    """The sequence lengths of config entry ``key`` (a list of positive ints in strictly
    ascending order, unchanged), else ValueError naming ``key`` and what was expected. The
    time-limit skip of the speed and generation studies assumes the order: once a length
    runs past the limit the longer ones are skipped, so in another order lengths shorter than
    a slow one were skipped (a duplicate ran twice, or was skipped as if too slow)."""
    expected = f"{key} must be a non-empty list of positive ints in strictly ascending order"
    if isinstance(values, str | bytes) or not isinstance(values, Sequence) or not values:
        raise ValueError(f"{expected}, got {values!r}")
    bad = [v for v in values if not (_is_int(v) and v > 0)]
    if bad:
        raise ValueError(f"{expected}, got {values!r} (not a positive int: {bad})")
    for before, after in zip(values, values[1:], strict=False):
        if after <= before:
            how = "repeats" if after == before else f"comes after the larger {before}"
            raise ValueError(f"{expected}, got {values!r} ({after} {how})")
    return list(values)


def check_map_names(key: str, names: Sequence[str]) -> list[str]:
    """:func:`check_names` over the registered feature maps, also taking ``"module:Class"``
    names of FeatureMap classes (a map of the user's own, as ``create_feature_map`` does)."""
    from .feature_maps import get_feature_map_class, list_feature_maps

    dotted = [n for n in names if isinstance(n, str) and ":" in n]
    for name in dotted:
        try:
            get_feature_map_class(name)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{key}: {err}") from err
    return check_names(key, names, [*list_feature_maps(), *dotted])


#: Entries a study's feature-map table may not set: the study sets them (its model's or
#: setting's head dimension and number of heads).
STUDY_SET_MAP_ENTRIES = ("head_dim", "num_heads")
_MAP_TABLE_EXAMPLE = '{ name = "favor", num_features = 64 }'


def check_map_spec(key: str, spec: Any) -> str | dict[str, Any]:
    """The feature map of config entry ``key``: a name (registered, or ``"module:Class"``; as
    :func:`check_map_names`), returned unchanged, or a table of a name and hyperparameters
    (TOML ``{ name = "favor", num_features = 64, orthogonal = false }``, the config dict
    ``ks.create_feature_map`` takes), returned as a dict: ``name`` first, then the
    hyperparameters sorted by name, each checked against the map's declaration (an int for a
    float one becomes a float). ``head_dim`` and ``num_heads`` are refused (the study sets
    them). Else ValueError or TypeError naming ``key`` (``key.HYPERPARAMETER`` for a bad
    value) and what was expected, before anything runs."""
    from .feature_maps import get_feature_map_class

    if isinstance(spec, str):
        return check_map_names(key, [spec])[0]
    if not isinstance(spec, Mapping):
        raise TypeError(
            f"{key} must be a feature-map name or a table such as {_MAP_TABLE_EXAMPLE}, "
            f"got {spec!r}"
        )
    if "name" not in spec:
        raise ValueError(
            f"{key}: a feature-map table needs a 'name' entry, e.g. {_MAP_TABLE_EXAMPLE}; "
            f"got {dict(spec)!r}"
        )
    name = spec["name"]
    if not isinstance(name, str):
        raise TypeError(f"{key}.name must be a feature-map name (a str), got {name!r}")
    check_map_names(f"{key}.name", [name])
    declared = get_feature_map_class(name).hyperparameters
    hparams = {k: v for k, v in spec.items() if k != "name"}
    fixed = [k for k in STUDY_SET_MAP_ENTRIES if k in hparams]
    if fixed:
        raise ValueError(
            f"{key}: the table may not set {' or '.join(fixed)}: the study sets "
            f"{'it' if len(fixed) == 1 else 'them'} (the head dimension and heads of its "
            "model or setting)"
        )
    unknown = [k for k in hparams if k not in declared]
    if unknown:
        raise ValueError(
            f"{key}: feature map {name!r} has no hyperparameter(s) {unknown}; it takes: "
            f"{', '.join(sorted(declared)) or 'none'}"
        )
    out: dict[str, Any] = {"name": name}
    for k in sorted(hparams):
        out[k] = declared[k].validate(f"{key}.{k}", hparams[k])
    return out


def map_label(spec: Any, key: str = "feature_map") -> str:
    """The text that stands for a study's feature map (:func:`check_map_spec` checks ``spec``,
    naming ``key``) in its configurations, so in ``results.csv``'s column, ``--only`` and the
    config id, and in summaries and figures: a name as it is (``"favor"``), a table as
    ``NAME(KEY=VALUE, ...)`` with the hyperparameters sorted and Python literals for values
    (``"favor(num_features=64, orthogonal=False)"``); a table of a name alone is the name.
    One map has one label, however the table was ordered or its numbers typed;
    :func:`parse_map_label` turns it back into the name or dict."""
    spec = check_map_spec(key, spec)
    if isinstance(spec, str) or len(spec) == 1:
        return spec if isinstance(spec, str) else spec["name"]
    args = ", ".join(f"{k}={v!r}" for k, v in spec.items() if k != "name")
    return f"{spec['name']}({args})"


def parse_map_label(label: str) -> str | dict[str, Any]:
    """The feature map a :func:`map_label` stands for: the name, or the config dict
    (``{"name": ..., hyperparameters}``) that ``ks.create_feature_map`` takes. ValueError
    for text that is no such label."""
    from .feature_maps import list_feature_maps

    if not isinstance(label, str):
        raise TypeError(f"a feature-map label must be a str, got {type(label).__name__}")
    name, paren, args = label.partition("(")
    if not paren or label in list_feature_maps():
        return label
    expected = "a feature-map label such as 'favor' or 'favor(num_features=64)'"
    try:
        call = ast.parse(f"f({args}", mode="eval").body
        if not name or not isinstance(call, ast.Call) or call.args:
            raise ValueError
        hparams = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    except (SyntaxError, ValueError, TypeError):
        raise ValueError(f"expected {expected}, got {label!r}") from None
    if None in hparams or "name" in hparams:  # **mapping, or a second name
        raise ValueError(f"expected {expected}, got {label!r}")
    return {"name": name, **hparams}


def check_map_builds(key: str, make: Callable[[], Any]) -> Any:
    """``make()``, which builds the feature map of config entry ``key`` as a study's run
    will (so hyperparameters that are each valid but not together, such as a rank above the
    head dimension, are refused before any run), leaving torch's global random state as it
    was (a map without a ``seed`` draws one from it). Its ValueError or TypeError is raised
    again with ``key`` in front."""
    import torch

    try:
        with torch.random.fork_rng(devices=[]):
            return make()
    except ValueError as err:
        raise ValueError(f"{key}: {err}") from None
    except TypeError as err:
        raise TypeError(f"{key}: {err}") from None


def check_map_list(
    key: str,
    specs: Any,
    study_sets: Mapping[str, str] | None = None,
    size: str | None = None,
    plain: Sequence[str] = (),
    registered: str | None = None,
) -> list[str]:
    """The labels (:func:`map_label`) of config entry ``key``, a list of feature maps, each a
    name or a table (:func:`check_map_spec`; a bad entry is named ``key[i]``), in their order.

    Names in ``plain`` (e.g. ``"softmax"``) pass as they are. A table may not set the
    hyperparameters ``study_sets`` maps to why the study sets them, nor, where ``size`` is
    given (why), the map's size hyperparameter (the study matches F through it, as
    ``matched_feature_map`` does). Where ``registered`` is given (why), a registered map by
    its name alone (or a table of the name alone) is refused: a list that adds maps to every
    registered one. One map given twice (one label) is refused. Unknown names are named all
    at once, as :func:`check_map_names` does. Else ValueError or TypeError naming ``key``."""
    from .analysis.matching import size_knob
    from .feature_maps import get_feature_map_class, list_feature_maps

    if isinstance(specs, str | bytes | Mapping) or not isinstance(specs, Sequence):
        raise TypeError(
            f"{key} must be a list of feature maps, names or tables, such as "
            f'["favor", {{ name = "glu", depth = 2 }}]; got {specs!r}'
        )
    check_map_names(key, [s for s in specs if isinstance(s, str) and s not in plain])
    labels: list[str] = []
    for i, spec in enumerate(specs):
        where = f"{key}[{i}]"
        if isinstance(spec, str) and spec in plain:
            label = spec
        else:
            checked = check_map_spec(where, spec)
            if isinstance(checked, dict):
                knob = size_knob(get_feature_map_class(checked["name"]))
                refused = dict(study_sets or {})
                if size is not None and knob is not None:
                    refused[knob] = f"it is {checked['name']}'s size hyperparameter, and {size}"
                for k, why in refused.items():
                    if k in checked:
                        raise ValueError(f"{where}: the table may not set {k}: {why}")
            label = map_label(checked, where)
            if registered is not None and label in list_feature_maps():
                raise ValueError(f"{where}: {label!r} is a registered map, which {registered}")
        if label in labels:
            raise ValueError(
                f"{where}: {label!r} is given twice (also {key}[{labels.index(label)}])"
            )
        labels.append(label)
    return labels


def matched_map(label: str, head_dim: int, feature_dim: int, seed: int = 0) -> Any:
    """The FeatureMap a :func:`map_label` stands for, for ``head_dim``, at the feature
    dimension ``feature_dim`` as ``ks.analysis.matched_feature_map`` sets it through the map's
    size hyperparameter (a map without one keeps its own F), with the label's other
    hyperparameters and ``seed`` (for a map that takes one; a label's own seed first).

    The map is built (on the CPU) with torch's global CPU generator seeded with ``seed`` and
    left as it was afterwards, the CUDA generators untouched: a user's map without a ``seed``
    hyperparameter that draws its initial weights from it gave other numbers in every run,
    and depended on which configs ran before it in the process (the registered maps draw
    nothing from it)."""
    import torch

    from .analysis.matching import matched_feature_map

    name, hparams = map_name_and_hparams(label)
    seed = hparams.pop("seed", seed)  # a table's own seed (speed's tables may set one)
    with torch.random.fork_rng(devices=[]):  # restores the CPU generator only
        torch.default_generator.manual_seed(seed)  # torch.manual_seed would seed CUDA's too
        return matched_feature_map(name, head_dim, feature_dim, seed=seed, **hparams)


def map_name_and_hparams(label: str) -> tuple[str, dict[str, Any]]:
    """The map name and hyperparameters (a new dict) a :func:`map_label` stands for."""
    spec = parse_map_label(label)
    if isinstance(spec, str):
        return spec, {}
    return spec["name"], {k: v for k, v in spec.items() if k != "name"}
