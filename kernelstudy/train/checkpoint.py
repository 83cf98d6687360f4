"""Checkpoints (written atomically) and the RNG states an exact resume needs."""

from __future__ import annotations

import os
import pickle
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..arguments import check_count
from ..files import atomic_write
from ..pickled_arrays import ArrayType, CheckedArray, plain, reconstruct

#: The largest seed of a run (its generators', its data order's).
MAX_SEED = 2**63 - 1


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> Path:
    """``torch.save(state)`` to ``path`` atomically."""
    return atomic_write(path, lambda f: torch.save(state, f))


def read_torch_file(
    path: Path, what: str, map_location: Any = "cpu", weights_only: bool = True
) -> Any:
    """``torch.load(path)``; a damaged file (cut short, empty, not torch's) is a ValueError
    naming ``path`` as not a readable ``what``."""
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    # a file cut short raises any of these, OSError (errno 22) from the zip reader too, and
    # a file of other bytes a KeyError or IndexError from the unpickler; a RuntimeError of
    # the device or the allocator is not the file's: raised as it is
    except RuntimeError as err:
        text = str(err).lower()
        if any(w in text for w in ("cuda", "device", "out of memory", "allocate")):
            raise
        damaged: Exception = err
    except pickle.UnpicklingError as err:
        refused = re.search(r"GLOBAL ([\w.]+)", str(err))
        if "Weights only load failed" in str(err) and refused:  # sound, but not weights only
            raise ValueError(
                f"{path} is not read: it refers to {refused.group(1)}, which a weights-only "
                f"load refuses (a {what} of another version, or a file that would run code "
                "as it loads)"
            ) from None
        # pickled_arrays' refusal, or an object of a type the weights-only load refuses
        reason = re.search(r"^refusing .*", str(err), re.MULTILINE) or re.search(
            r"WeightsUnpickler error:\s*(Can only build .*)", str(err)
        )
        if "Weights only load failed" in str(err) and reason:
            raise ValueError(f"{path} is not read: {reason.group(reason.lastindex or 0)}") from None
        damaged = err
    except (EOFError, ValueError, OSError, KeyError, IndexError) as err:
        damaged = err
    first = str(damaged).strip().splitlines()[0] if str(damaged).strip() else type(damaged).__name__
    raise ValueError(f"{path} is not a readable {what} ({first})") from None


def _numpy_rng_globals() -> list[Any]:
    """What unpickling NumPy's RNG state (an uint32 array) takes: an array rebuilt from its
    bytes, nothing that runs code. NumPy 1 pickles its rebuilding function as
    ``numpy.core.multiarray._reconstruct``, NumPy 2 as ``numpy._core...``: both names are
    allowed, for the function this NumPy has (a checkpoint outlives an upgrade)."""
    return [  # ndarray and _reconstruct as stand-ins that build no array the file sizes
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        (reconstruct, "numpy._core.multiarray._reconstruct"),
        (ArrayType, "numpy.ndarray"),
        # torch builds (__setstate__) only objects of allowed types: the array reconstruct
        # makes, under a name no pickle can spell (a GLOBAL's name ends at a newline)
        (CheckedArray, "kernelstudy.pickled_arrays\nCheckedArray"),
        np.dtype,
        type(np.dtype(np.uint32)),
    ]


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint`, with ``weights_only=True`` (and
    NumPy's RNG array allowed): a file that would run code as it loads (a shared run folder
    resumed by its command) is a ValueError, never unpickled."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    with torch.serialization.safe_globals(_numpy_rng_globals()):
        state = plain(read_torch_file(path, "checkpoint", map_location))
    if not isinstance(state, dict):
        raise ValueError(f"{path} is not a checkpoint (a {type(state).__name__}, not a dict)")
    return state


def get_rng_state(device: torch.device | str | None = None) -> dict[str, Any]:
    """The states of Python's, NumPy's, torch's CPU and (when present) CUDA generators;
    with a CUDA ``device`` (the one training runs on), its generator's apart too."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
        if device is not None and torch.device(device).type == "cuda":
            state["cuda_device"] = torch.cuda.get_rng_state(torch.device(device))
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | str | None = None) -> None:
    """Restore the generators saved by :func:`get_rng_state`. With a CUDA ``device``, the
    saved training device's generator goes to it (a run resumed on ``cuda:0`` after
    ``cuda:1`` draws on), else each saved GPU's to the GPU of its index that exists here
    (restoring all of them raised IndexError on a machine with fewer GPUs)."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict of get_rng_state(), got {type(state).__name__}")
    missing = [key for key in ("python", "numpy", "torch") if key not in state]
    if missing:
        raise ValueError(f"state must be a dict of get_rng_state(), missing keys {missing}")
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if not torch.cuda.is_available():
        return
    if device is not None and torch.device(device).type == "cuda" and "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"], torch.device(device))
    elif "cuda" in state:
        for index, gpu_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(gpu_state, index)


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (CPU and CUDA) global generators. Process-wide:
    two trainings in threads of one process share them (dropout draws from torch's), so a
    run is reproducible one per process; run parallel ones in processes, as the search
    does. ``seed``: an int in [0, :data:`MAX_SEED`]."""
    seed = check_count("seed", seed, 0, MAX_SEED)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
