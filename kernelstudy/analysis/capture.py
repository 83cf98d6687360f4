"""Capture the queries and keys a model's attention layers actually see."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..nn.attention import KernelAttention
from ..nn.modes import module_mode


def capture_qk(model: nn.Module, batch: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Run ``model`` on ``batch`` and return every attention layer's queries and keys.

    Forward pre-hooks on each :class:`kernelstudy.nn.KernelAttention` module
    recompute that layer's projections from its input, so nothing in the model
    changes. The model runs in eval mode (no dropout; a redrawing map neither counts the
    call nor redraws), and every module's mode is restored afterwards. ``batch`` is passed as
    ``model(batch)`` for a tensor, ``model(*batch)`` for a tuple/list and
    ``model(**batch)`` for a dict, keeping only the keys that
    ``model.forward`` takes (so a task batch with ``targets`` or ``label`` works). A
    ``torch.compile`` model runs its original module, eagerly: hooks do not run inside a
    compiled graph (an evaluated compiled model gave ``{}``).

    Returns:
        ``{module name: (q, k)}`` in forward order, each ``(B,H,N,D)`` (detached,
        before any feature map). If a layer runs more than once, the last call wins.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: the module inside
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, KernelAttention)]
    if not layers:
        raise ValueError("model has no kernelstudy.nn.KernelAttention layers to capture")
    captured: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook_for(name: str):
        def hook(module: KernelAttention, args: tuple, kwargs: dict | None = None) -> None:
            x = args[0] if args else kwargs["x"]
            module.check_input(x)  # before forward would: a bad x failed inside nn.Linear
            with torch.no_grad():
                q, k, _ = module._heads(x)
            captured.pop(name, None)
            captured[name] = (q.detach(), k.detach())

        return hook

    handles = [m.register_forward_pre_hook(hook_for(n), with_kwargs=True) for n, m in layers]
    try:
        with torch.no_grad(), module_mode(model, False):  # each module's mode back after it
            if isinstance(batch, torch.Tensor):
                model(batch)
            elif isinstance(batch, Mapping):
                model(**_accepted(model, batch))
            elif isinstance(batch, Sequence) and not isinstance(batch, str):
                model(*batch)
            else:
                raise TypeError(
                    f"batch must be a tensor, a tuple/list or a dict, got {type(batch).__name__}"
                )
    finally:
        for handle in handles:
            handle.remove()
    if not captured:
        raise ValueError(
            "no KernelAttention layer of model ran in its forward on batch (a wrapper that "
            "bypasses module hooks?); pass the model itself"
        )
    return captured


def _accepted(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``batch`` that ``model.forward`` accepts as keywords."""
    params = inspect.signature(model.forward).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(batch)
    names = {p.name for p in params}
    return {k: v for k, v in batch.items() if k in names}
