"""NumPy arrays rebuilt from a pickle without letting the file choose an allocation.

A pickled array is ``_reconstruct(ndarray, (0,), typecode)`` followed by ``__setstate__``
with its shape, dtype and bytes, which NumPy checks fill the shape. A crafted file could
instead call ``ndarray((10**9, 3072), uint8)`` itself, ``_reconstruct`` with a large shape,
or ``scalar`` of a huge void dtype: gigabytes of memory with no data behind them in the
file; and an object array's ``__setstate__`` with too short a list crashes the process.
The unpicklers of CIFAR batches and of checkpoints' NumPy RNG state therefore map
``numpy.ndarray`` to :class:`ArrayType`, ``_reconstruct`` to :func:`reconstruct` (an empty
:class:`CheckedArray`, filled only from bytes of a plain numeric dtype) and ``scalar`` to
:func:`scalar`; :func:`plain` turns the arrays loaded back into ordinary ones.
"""

from __future__ import annotations

import numbers
import pickle
from typing import Any

import numpy as np

#: NumPy's own ``_reconstruct`` and ``scalar``, wherever this NumPy keeps them.
_NUMPY_RECONSTRUCT = np.empty(0).__reduce__()[0]
_NUMPY_SCALAR = np.float64(0).__reduce__()[0]
#: The dtype kinds an array or scalar may have: bool, ints, floats, complex, bytes, str.
NUMERIC_KINDS = "biufcSU"


class ArrayType:
    """Stands for ``numpy.ndarray`` in a pickle: only as :func:`reconstruct`'s first
    argument; calling it (an array of a size the file need not hold) is refused."""

    def __new__(cls, *args: Any, **kwargs: Any) -> ArrayType:
        raise pickle.UnpicklingError(
            "refusing to call numpy.ndarray from a pickle (an array of any declared size, "
            "with no data in the file behind it)"
        )


def _check_dtype(dtype: Any, what: str) -> np.dtype:
    if not isinstance(dtype, np.dtype) or dtype.kind not in NUMERIC_KINDS or dtype.fields:
        raise pickle.UnpicklingError(
            f"refusing a pickled {what} of dtype {dtype!r}: only plain numeric dtypes"
        )
    return dtype


class CheckedArray(np.ndarray):
    """The array :func:`reconstruct` gives: its ``__setstate__`` takes only bytes of a plain
    numeric dtype (NumPy checks that they fill the shape)."""

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) in (4, 5)):
            raise pickle.UnpicklingError(f"refusing a pickled array state {type(state).__name__}")
        _check_dtype(state[-3], "array")
        if not isinstance(state[-1], bytes | bytearray):
            raise pickle.UnpicklingError("refusing a pickled array whose data are not bytes")
        super().__setstate__(state)


def reconstruct(subtype: Any, shape: Any, typecode: Any) -> CheckedArray:
    """NumPy's ``_reconstruct`` of an array of no elements (as NumPy pickles one, before
    ``__setstate__`` gives it its shape and bytes); UnpicklingError otherwise."""
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
    return _NUMPY_RECONSTRUCT(CheckedArray, shape, typecode)


def scalar(dtype: Any, data: Any = None) -> Any:
    """NumPy's ``scalar`` of a plain numeric dtype from its bytes in the file (without them
    NumPy makes ``dtype.itemsize`` zero bytes, any size the file declares)."""
    _check_dtype(dtype, "scalar")
    if not isinstance(data, bytes) or len(data) != dtype.itemsize:
        raise pickle.UnpicklingError("refusing a pickled numpy scalar without its bytes")
    return _NUMPY_SCALAR(dtype, data)


#: The stand-ins by the name NumPy pickles them under (in ``numpy`` or its ``multiarray``).
STAND_INS = {"ndarray": ArrayType, "_reconstruct": reconstruct, "scalar": scalar}


def plain(obj: Any) -> Any:
    """``obj`` with every :class:`CheckedArray` in it (in dicts, lists and tuples) an
    ordinary ``numpy.ndarray`` (a view of the same data)."""
    if isinstance(obj, CheckedArray):
        return obj.view(np.ndarray)
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(plain(v) for v in obj)
    return obj
