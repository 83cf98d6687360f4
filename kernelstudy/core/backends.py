"""Backends of the causal product and how one is chosen.

A backend computes the unnormalized causal product ``Σ_{j≤i} (q_i·k_j) v_j``
with its gradients; everything else in the core (normalization, masking,
non-causal attention) is shared. Choose one with the ``backend=`` argument or
the ``KERNELSTUDY_BACKEND`` environment variable; ``"auto"`` (the default)
takes the fastest backend that is available and supports the input.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .chunked import causal_dot_product_chunked
from .reference import causal_dot_product_reference
from .validation import accumulation_dtype

ENV_VAR = "KERNELSTUDY_BACKEND"


@dataclass
class Backend:
    """One implementation of the causal product.

    ``product(q, k, v)`` returns ``(B,H,N,M)`` in the accumulation dtype (a
    backend with a fused ``attention`` may return the input dtype instead,
    rounded once from its float32 sums: the core composes the normalizer from
    ``product`` only for backends without ``attention``);
    ``available()`` says whether it runs on this machine (it may build code on
    first call); ``supports(x)`` whether it takes tensors like ``x``
    (device, dtype); ``priority`` orders backends for ``"auto"`` (highest
    first; 0 means never chosen automatically). ``attention``, where given,
    is a fused normalized ``linear_attention(phi_q, phi_k, v, causal,
    key_padding_mask, eps)`` that the core calls instead of composing the
    product with its own normalizer, on arguments it has checked (shapes, a
    bool ``causal``, ``eps``); the mask, and whether it takes the tensors, are
    the backend's to check.
    """

    name: str
    product: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    available: Callable[[], bool] = field(default=lambda: True)
    supports: Callable[[torch.Tensor], bool] = field(default=lambda x: True)
    priority: int = 0
    description: str = ""
    attention: Callable[..., torch.Tensor] | None = None


_BACKENDS: dict[str, Backend] = {}
_WARNED: set[str] = set()


def register_backend(backend: Backend) -> Backend:
    """Add a backend (replacing one of the same name)."""
    _BACKENDS[backend.name] = backend
    return backend


def _reference_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # in the accumulation dtype from the start: the sums rounded to float16 overflowed
    acc = accumulation_dtype(q.dtype)
    return causal_dot_product_reference(q.to(acc), k.to(acc), v.to(acc))


register_backend(
    Backend(
        "reference",
        _reference_product,
        priority=0,
        description="materializes the N×N kernel matrix (ground truth, O(N²) memory)",
    )
)
register_backend(
    Backend(
        "torch",
        causal_dot_product_chunked,
        priority=10,
        description="chunked PyTorch with a recomputing backward (any device, any float dtype)",
    )
)


def unregister_backend(name: str) -> None:
    """Remove a backend added with :func:`register_backend` (``reference``/``torch`` stay)."""
    if name in ("reference", "torch"):
        raise ValueError(f"the built-in backend {name!r} cannot be removed")
    _BACKENDS.pop(name, None)
    _WARNED.discard(name)


def registered_backends() -> dict[str, Backend]:
    """Every registered backend by name, available or not."""
    return dict(_BACKENDS)


def runs_own_noncausal_attention(name: str) -> bool:
    """Whether non-causal ``linear_attention`` with backend ``name`` runs code of its own:
    ``reference``, ``torch`` and every backend with a fused ``attention``. The others compute
    it with the torch path (it takes no causal product), so timing them there times torch.
    ValueError unless ``name`` is a registered backend."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if name not in _BACKENDS:  # "auto" too: it names no one backend's code
        raise ValueError(
            f"name must be a registered backend ({', '.join(_BACKENDS)}); got {name!r}"
        )
    return name in ("reference", "torch") or _BACKENDS[name].attention is not None


def backends() -> list[str]:
    """Names of the backends that run on this machine, e.g. ``['reference', 'torch', 'cpu']``."""
    return [name for name, b in _BACKENDS.items() if b.available()]


def check_backend_name(name: object, source: str = "backend") -> None:
    """TypeError/ValueError naming ``source`` unless ``name`` is None, ``"auto"`` or a
    registered backend (available here or not)."""
    if name is None:
        return
    if not isinstance(name, str):
        raise TypeError(f"{source} must be a str or None, got {type(name).__name__}")
    if name != "auto" and name not in _BACKENDS:
        known = ", ".join(["auto", *_BACKENDS])
        raise ValueError(f"{source} must be one of {known}; got {name!r}")


def env_backend_name() -> str:
    """The backend ``KERNELSTUDY_BACKEND`` names (``"auto"`` where unset or empty), checked:
    ValueError naming the variable otherwise."""
    name = os.environ.get(ENV_VAR, "auto") or "auto"
    check_backend_name(name, ENV_VAR)
    return name


def resolve_backend(
    name: str | None, example: torch.Tensor, for_attention: bool = False
) -> Backend:
    """The backend to run ``example``-like inputs on.

    ``name`` None reads ``KERNELSTUDY_BACKEND`` (default ``"auto"``). A named
    backend that cannot run here (no compiler, no device: ``cuda`` on a machine without a
    GPU of compute capability 8.0 or more, whatever the inputs) falls back to ``torch`` with
    a one-time warning; a named backend that runs here but does not take this input (CUDA
    tensors to ``cpu``, CPU tensors to ``cuda`` on a GPU machine) raises ``ValueError``.
    ``for_attention``: the
    caller uses only a fused ``attention``, so backends without one are not built
    (``auto`` passes them over; a named one comes back unbuilt): a non-causal call
    compiled the CPU extension, which it never runs.
    """
    source = "backend"
    if name is None:
        name, source = env_backend_name(), ENV_VAR
    else:
        check_backend_name(name, source)
    if name == "auto":
        candidates = [
            b
            for b in _BACKENDS.values()
            if b.priority > 0
            and b.supports(example)
            and (b.attention is not None or not for_attention)
        ]
        for b in sorted(candidates, key=lambda b: -b.priority):
            if b.available():
                return b
        return _BACKENDS["torch"]
    backend = _BACKENDS[name]
    if not backend.supports(example):
        if not backend.available():  # a device (or build) missing: not the input's fault
            return _fall_back(name)
        raise ValueError(
            f"{source}={name!r} does not take {example.dtype} tensors on {example.device}"
        )
    if for_attention and backend.attention is None:
        return backend
    if not backend.available():
        return _fall_back(name)
    return backend


def _fall_back(name: str) -> Backend:
    """``torch``, for backend ``name`` that cannot run here, saying so once a process (the
    warning points at resolve_backend's caller)."""
    if name not in _WARNED:
        _WARNED.add(name)
        message = f"kernelstudy: backend {name!r} is not available here; using 'torch'"
        warnings.warn(message, RuntimeWarning, stacklevel=4)
    return _BACKENDS["torch"]
