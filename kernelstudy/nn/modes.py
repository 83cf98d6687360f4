"""Training or eval mode for a block of code, with every submodule's own mode back after it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


@contextlib.contextmanager
def module_mode(module: nn.Module, training: bool) -> Iterator[nn.Module]:
    """``module`` and its submodules in training (True) or eval (False) mode for the block;
    afterwards each has its own mode back, also after an error. (``module.train(old)`` set
    every submodule alike: a feature map the caller had put in eval mode, to stop its
    redraws while the rest trains, came back training.)"""
    modes = {m: m.training for m in module.modules()}
    module.train(training)
    try:
        yield module
    finally:
        for m, mode in modes.items():
            m.training = mode
