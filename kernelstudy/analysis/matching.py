"""Create registered maps at a matched feature dimension F, for fair comparisons."""

from __future__ import annotations

import math
from typing import Any

from ..arguments import check_count
from ..feature_maps import FeatureMap, create_feature_map, get_feature_map_class

# Integer hyperparameters that set a map's size, tried in this order.
SIZE_KNOBS = ("num_features", "feature_dim", "n_features", "hidden_dim", "num_hidden")


def size_knob(cls: type[FeatureMap]) -> str | None:
    """The hyperparameter that sets a map's F: its ``size_hyperparameter``, else the first of
    ``SIZE_KNOBS`` it has, else None (F is fixed by the head dimension, e.g. ``elu``)."""
    if cls.size_hyperparameter is not None:
        if cls.size_hyperparameter not in cls.hyperparameters:
            raise ValueError(
                f"{cls.__name__}.size_hyperparameter {cls.size_hyperparameter!r} is not one "
                f"of its hyperparameters ({', '.join(cls.hyperparameters)})"
            )
        return cls.size_hyperparameter
    return next((k for k in SIZE_KNOBS if k in cls.hyperparameters), None)


def map_kind(feature_map: FeatureMap | type[FeatureMap]) -> str:
    """``"learned"`` (trainable), ``"random"`` (random features) or ``"fixed"``."""
    is_class = isinstance(feature_map, type) and issubclass(feature_map, FeatureMap)
    if not (is_class or isinstance(feature_map, FeatureMap)):
        raise TypeError(
            f"feature_map must be a FeatureMap or a FeatureMap class, got {feature_map!r}"
        )
    if feature_map.trainable:
        return "learned"
    return "random" if feature_map.random else "fixed"


def matched_feature_map(
    name: str, head_dim: int, feature_dim: int, seed: int = 0, **kwargs: Any
) -> FeatureMap:
    """Registered map ``name`` for ``head_dim`` whose F is as close to ``feature_dim`` as it allows.

    The map's size hyperparameter (:func:`size_knob`) is set so that
    ``F == feature_dim`` (trying ``feature_dim`` divided by 2, 3 and 4, rounded down and
    up, for maps with several blocks per feature, each within the hyperparameter's range:
    FAVOR+ at F = 9000 gets R = 8192, its most); maps without one keep their own F (e.g.
    ``elu``: F = D). ``seed`` is passed to maps that take one; other ``kwargs``
    are hyperparameters. Unknown names raise ValueError.
    """
    feature_dim = check_count("feature_dim", feature_dim, 1)  # numpy's ints too
    cls = get_feature_map_class(name)
    hp = cls.hyperparameters
    if "seed" in hp:
        kwargs.setdefault("seed", seed)
    knob = size_knob(cls)
    if knob is None or knob in kwargs:
        return create_feature_map(name, head_dim=head_dim, **kwargs)
    best: FeatureMap | None = None
    first_error: Exception | None = None
    # F = size × blocks for a map with several blocks per feature: where the divisor does
    # not divide F, the sizes on either side come closest (F = 7 with 2 blocks: 6 or 8).
    # Beyond the range a size is refused, and F = 8193 fell back to R = 4097 (F / 2).
    low, high = hp[knob].low, hp[knob].high
    sizes = dict.fromkeys(
        min(max(size, math.ceil(low) if low is not None else 1), math.floor(high or size))
        for divisor in (1, 2, 3, 4)
        for size in (feature_dim // divisor, -(-feature_dim // divisor))
        if size >= 1
    )
    for size in sizes:
        try:
            fm = create_feature_map(name, head_dim=head_dim, **{**kwargs, knob: size})
        except (ValueError, TypeError) as err:
            first_error = first_error or err
            continue
        if fm.feature_dim == feature_dim:
            return fm
        if best is None or abs(fm.feature_dim - feature_dim) < abs(best.feature_dim - feature_dim):
            best = fm
    if best is None:  # the map's own error, e.g. a misspelled hyperparameter, comes along
        raise ValueError(
            f"cannot create feature map {name!r} with F={feature_dim} (via {knob}): {first_error}"
        ) from first_error
    return best


def random_feature_map(
    name: str,
    head_dim: int,
    num_features: int,
    orthogonal: bool = False,
    seed: int = 0,
    **kwargs: Any,
) -> FeatureMap:
    """A random-feature map with R = ``num_features`` draws, iid or orthogonal.

    A stabilizer is switched off where the map has one (``stabilize=False``), so that
    φ(q)·φ(k) is the plain kernel estimate. Raises ValueError for maps that are not random.
    """
    cls = get_feature_map_class(name)
    if not cls.random:
        raise ValueError(f"feature map {name!r} is not a random-feature map")
    hp = cls.hyperparameters
    knob = size_knob(cls)
    if knob is None:
        raise ValueError(
            f"feature map {name!r} has no size hyperparameter (size_hyperparameter, or one "
            f"of {SIZE_KNOBS})"
        )
    kwargs[knob] = num_features
    if "orthogonal" in hp:
        kwargs["orthogonal"] = orthogonal
    elif orthogonal:
        raise ValueError(f"feature map {name!r} has no 'orthogonal' option")
    if "seed" in hp:
        kwargs["seed"] = seed
    if "stabilize" in hp:
        kwargs.setdefault("stabilize", False)
    return create_feature_map(name, head_dim=head_dim, **kwargs)
