"""kernelstudy: a toolkit for studying kernelized (linear) attention.

>>> import kernelstudy as ks
>>> fm = ks.create_feature_map("elu", head_dim=64)
>>> out = ks.kernel_attention(q, k, v, feature_map=fm, causal=True)  # doctest: +SKIP
"""

__version__ = "0.1.0"

from . import analysis, core, feature_maps, nn
from .core import (
    RecurrentState,
    backends,
    causal_dot_product,
    linear_attention,
    softmax_attention,
)
from .feature_maps import (
    FeatureMap,
    create_feature_map,
    list_feature_maps,
    register_feature_map,
)
from .nn.functional import kernel_attention

__all__ = [
    "FeatureMap",
    "RecurrentState",
    "__version__",
    "analysis",
    "backends",
    "causal_dot_product",
    "core",
    "create_feature_map",
    "feature_maps",
    "kernel_attention",
    "linear_attention",
    "list_feature_maps",
    "nn",
    "register_feature_map",
    "softmax_attention",
]
