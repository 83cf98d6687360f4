"""The feature-map registry and every built-in map.

Each family lives in its own module here and registers itself with
``@register_feature_map``; every module of this package is imported below, so a
new map is one new file.
"""

import importlib
import pkgutil

from .base import (
    SEED,
    SHARED,
    FeatureMap,
    HeadwiseFeatureMap,
    Hyperparameter,
    RandomFeatureMap,
    compute_dtype,
)
from .registry import (
    create_feature_map,
    get_feature_map_class,
    list_feature_maps,
    register_feature_map,
)

for _module in pkgutil.iter_modules(__path__):
    if _module.name not in {"base", "registry"}:
        importlib.import_module(f"{__name__}.{_module.name}")

from .table import feature_map_table  # noqa: E402

__all__ = [
    "SEED",
    "SHARED",
    "FeatureMap",
    "HeadwiseFeatureMap",
    "Hyperparameter",
    "RandomFeatureMap",
    "compute_dtype",
    "create_feature_map",
    "feature_map_table",
    "get_feature_map_class",
    "list_feature_maps",
    "register_feature_map",
]
