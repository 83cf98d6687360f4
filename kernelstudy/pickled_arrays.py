"""NumPy arrays rebuilt from a pickle without letting the file choose an allocation.

A pickled array is ``_reconstruct(ndarray, (0,), typecode)`` followed by ``__setstate__``
with its shape, dtype and bytes, which checks that the bytes fill the shape. A crafted
file could instead call ``ndarray((10**9, 3072), uint8)`` itself, or ``_reconstruct``
with a large shape: gigabytes of uninitialised memory, with no data behind them in the
file, taken as an array. The unpicklers of CIFAR batches and of checkpoints' NumPy RNG
state therefore map ``numpy.ndarray`` to :class:`ArrayType` and ``_reconstruct`` to
:func:`reconstruct`, which build only the empty array that ``__setstate__`` then fills.
"""

from __future__ import annotations

import numbers
import pickle
from typing import Any

import numpy as np

#: NumPy's own ``_reconstruct``, wherever this NumPy keeps it.
_NUMPY_RECONSTRUCT = np.empty(0).__reduce__()[0]


class ArrayType:
    """Stands for ``numpy.ndarray`` in a pickle: only as :func:`reconstruct`'s first
    argument; calling it (an array of a size the file need not hold) is refused."""

    def __new__(cls, *args: Any, **kwargs: Any) -> ArrayType:
        raise pickle.UnpicklingError(
            "refusing to call numpy.ndarray from a pickle (an array of any declared size, "
            "with no data in the file behind it)"
        )


def reconstruct(subtype: Any, shape: Any, typecode: Any) -> np.ndarray:
    """NumPy's ``_reconstruct`` for a plain array of no elements (as NumPy pickles one,
    before ``__setstate__`` gives it its shape and bytes); UnpicklingError otherwise."""
    empty = (
        isinstance(shape, tuple)
        and all(isinstance(n, numbers.Integral) and n >= 0 for n in shape)
        and 0 in shape
    )
    if subtype is not ArrayType or not empty:
        raise pickle.UnpicklingError(
            f"refusing numpy _reconstruct({getattr(subtype, '__name__', subtype)!r}, "
            f"{shape!r}): a pickled array starts empty, its data follow"
        )
    return _NUMPY_RECONSTRUCT(np.ndarray, shape, typecode)
