"""The linear-attention core, on features φ(Q), φ(K): reference, chunked PyTorch,
compiled backends, recurrent state, and the softmax baseline."""

from . import cuda_backend  # noqa: F401  (registers the "cuda" backend)
from .attention import causal_dot_product, linear_attention, linear_attention_reference
from .backends import (
    Backend,
    backends,
    register_backend,
    registered_backends,
    resolve_backend,
    runs_own_noncausal_attention,
    unregister_backend,
)
from .chunked import DEFAULT_CHUNK_SIZE, causal_dot_product_chunked
from .cpu_backend import causal_dot_product_cpu  # registers the compiled 'cpu' backend
from .exp_range import SAFE_EXPONENTS, exp_shift
from .recurrent import RecurrentState
from .reference import causal_dot_product_reference
from .softmax import softmax_attention, softmax_attention_reference

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "SAFE_EXPONENTS",
    "Backend",
    "RecurrentState",
    "backends",
    "causal_dot_product",
    "causal_dot_product_chunked",
    "causal_dot_product_cpu",
    "causal_dot_product_reference",
    "exp_shift",
    "linear_attention",
    "linear_attention_reference",
    "register_backend",
    "registered_backends",
    "runs_own_noncausal_attention",
    "resolve_backend",
    "softmax_attention",
    "softmax_attention_reference",
    "unregister_backend",
]
