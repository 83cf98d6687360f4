"""Checks of plain arguments (counts, flags, non-negative reals) shared by every layer.

Each returns the value in its plain Python type or raises a ``ValueError``/``TypeError``
naming the argument. Tensor checks of the core are in :mod:`kernelstudy.core.validation`.
"""

from __future__ import annotations

import argparse
import math
import numbers
import os
from pathlib import Path


def is_real(value: object) -> bool:
    """Whether ``value`` is a real number (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_real(name: str, value: object, strict: bool = False) -> float:
    """``value`` as a float, finite and >= 0 (> 0 with ``strict``), else TypeError/ValueError
    naming ``name``."""
    if not is_real(value):
        raise TypeError(f"{name} must be a float, got {value!r}")
    if not (math.isfinite(value) and (value > 0 if strict else value >= 0)):
        raise ValueError(
            f"{name} must be a finite float {'>' if strict else '>='} 0, got {value!r}"
        )
    return float(value)


def check_count(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    """``value`` as an int if it is one (numpy's too, not a bool) >= ``minimum`` (and <=
    ``maximum`` when given), else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be an int <= {maximum}, got {value!r}")
    return int(value)


def check_flag(name: str, value: object) -> bool:
    """``value`` as a bool: True or False (also numpy's bool, and the ints 0 and 1), else
    TypeError naming ``name``, so that a string such as ``"no"`` is not read as True."""
    if isinstance(value, bool) or type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be a bool (True or False), got {value!r}")


def user_path(text: str) -> str:
    """A path flag's value with ``~`` expanded (an argparse ``type``): a shell expands
    ``--out ~/x`` but leaves ``--out=~/x`` as it is, which made a folder named ``~``."""
    return os.path.expanduser(text)


def expanded_path(text: str) -> Path:
    """:func:`user_path` as a ``Path`` (an argparse ``type`` for the benchmarks' ``--out``)."""
    return Path(user_path(text))


def nonempty_user_path(text: str) -> str:
    """:func:`user_path`, refusing an empty value (argparse's usage error): ``--out ""``,
    an unset variable, wrote into the current directory."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty (an unset variable?)")
    return user_path(text)
