"""The registry as a table: one row per registered feature map."""

from __future__ import annotations

import pandas as pd

from .registry import get_feature_map_class, list_feature_maps

COLUMNS = ("name", "trainable", "random", "positive", "feature_dim", "parameters", "paper")


def feature_map_table() -> pd.DataFrame:
    """Every registered map, sorted by name: columns ``name``, ``trainable``, ``random``,
    ``positive``, ``feature_dim`` (its formula), ``parameters`` (``"key: type in [lo, hi] =
    default; ..."``) and ``paper``."""
    rows = []
    for name in list_feature_maps():
        cls = get_feature_map_class(name)
        params = "; ".join(f"{key}: {spec.describe()}" for key, spec in cls.hyperparameters.items())
        rows.append(
            (
                name,
                cls.trainable,
                cls.random,
                cls.positive,
                cls.feature_dim_formula,
                params,
                cls.paper,
            )
        )
    return pd.DataFrame(rows, columns=list(COLUMNS))
