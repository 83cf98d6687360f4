"""LRA Image: CIFAR-10 as sequences of 1024 grayscale pixels, from the python pickle batches.

``cifar-10-batches-py/`` holds ``data_batch_1`` … ``data_batch_5`` (train) and
``test_batch``; each is a pickled dict with ``data`` (N, 3072) uint8 (the red,
green, blue planes of a 32×32 image, row-major) and ``labels`` (N ints 0–9).
Pixels are converted to gray as ``tf.image.rgb_to_grayscale`` does in LRA and
used directly as tokens 0–255. ``val`` is 10% of the training images, as in LRA:
here the last 10% of the training batches and ``train`` the first 90% (LRA's
TFDS split takes its 10% in TFDS's own record order, so not these same images).
"""

from __future__ import annotations

import numbers
import pickle
from typing import Any

import numpy as np
import torch

from ..arguments import check_flag, is_real
from ..pickled_arrays import STAND_INS, plain
from .base import SequenceTask, check_split
from .files import PathArg, check_path, data_error, locate, require_dir

PIXEL_VOCAB_SIZE = 257
PIXEL_PAD_ID = 256  # never present: pixel sequences have a fixed length
GRAY_WEIGHTS = np.array([0.2989, 0.5870, 0.1140], dtype=np.float32)
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCHES = ("test_batch",)

# The globals a CIFAR batch (or a numpy array pickled by Python 2 or 3) may reference.
_PICKLE_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
}


class _SafeUnpickler(pickle.Unpickler):
    """An unpickler that builds only plain containers and numpy arrays."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _PICKLE_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        if name in STAND_INS:  # no array of a size the file chooses: see pickled_arrays
            return STAND_INS[name]
        if module.startswith("numpy.core") and hasattr(np, "_core"):
            module = "numpy._core" + module[len("numpy.core") :]
        return super().find_class(module, name)


def rgb_to_gray(rgb: np.ndarray, channel_axis: int = -1) -> np.ndarray:
    """uint8 RGB → uint8 gray, dropping ``channel_axis`` (size 3), as ``tf.image.rgb_to_grayscale``.

    In float32, as TF: each channel times 1/255, then gray = (0.2989 r + 0.5870 g)
    + 0.1140 b summed in that order (so a pixel's value does not depend on the array's
    shape), then floor(gray · 255.5). TF sums with a matmul whose rounding order may
    differ, which can move a few colours in 2^24 by one level.
    """
    rgb = np.asarray(rgb)
    if rgb.dtype != np.uint8:  # floats in [0, 1] came out black, 16-bit values clipped
        raise TypeError(f"rgb must be uint8 (0-255), got dtype {rgb.dtype}")
    if not isinstance(channel_axis, numbers.Integral) or isinstance(channel_axis, bool):
        raise TypeError(f"channel_axis must be an int, got {channel_axis!r}")
    if rgb.ndim == 0 or not -rgb.ndim <= channel_axis < rgb.ndim:
        raise ValueError(f"channel_axis={channel_axis!r} is not an axis of rgb {rgb.shape}")
    if rgb.shape[channel_axis] != 3:  # other sizes were read as r, g, b or failed indexing
        raise ValueError(
            f"rgb must have 3 channels (r, g, b) along channel_axis={channel_axis}, got shape "
            f"{rgb.shape}"
        )
    scaled = np.moveaxis(rgb, channel_axis, -1).astype(np.float32) * np.float32(1 / 255)
    w = GRAY_WEIGHTS
    gray = scaled[..., 0] * w[0] + scaled[..., 1] * w[1] + scaled[..., 2] * w[2]
    return np.clip(np.floor(gray * np.float32(255.5)), 0, 255).astype(np.uint8)


def read_cifar_batch(path: PathArg) -> tuple[np.ndarray, np.ndarray]:
    """Gray pixels (N, 1024) uint8 and labels (N,) int64 of one pickle batch."""
    check_path("path", path)
    try:
        with open(path, "rb") as f:
            batch = plain(_SafeUnpickler(f, encoding="bytes").load())
    except OSError:
        raise
    except Exception as err:  # truncated or corrupt pickles fail in many ways
        raise data_error(path, f"not a readable CIFAR-10 pickle batch ({err})") from err
    if not isinstance(batch, dict):
        raise data_error(path, f"expected a pickled dict, got {type(batch).__name__}")
    batch = {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}
    if "data" not in batch or "labels" not in batch:
        raise data_error(path, f"expected keys 'data' and 'labels', got {sorted(batch)}")
    data = np.asarray(batch["data"])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 1024:
        raise data_error(path, f"'data' must be (N, 3072) uint8, got {data.shape} {data.dtype}")
    if data.shape[0] == 0:
        raise data_error(path, "no images")
    raw = np.asarray(batch["labels"])
    if raw.dtype.kind not in "iu":  # not floats such as 1.7, which int64 would truncate
        raise data_error(path, f"'labels' must be ints, got dtype {raw.dtype}")
    labels = raw.astype(np.int64)
    if labels.shape != (data.shape[0],):
        raise data_error(
            path, f"'labels' must have shape ({data.shape[0]},), one per image, got {labels.shape}"
        )
    bad = np.flatnonzero((labels < 0) | (labels > 9))
    if bad.size:
        raise data_error(path, f"label {labels[bad[0]]} of image {bad[0]} is not in 0-9")
    return rgb_to_gray(data.reshape(-1, 3, 1024), channel_axis=1), labels


class ImageTask(SequenceTask):
    """Grayscale CIFAR-10, 10 classes: ``input_ids`` (1024,) pixels 0–255, ``mask``, ``label``.

    ``path`` is ``cifar-10-batches-py`` or its parent. The pad id (256) never occurs.
    ``zero_is_padding``: the mask marks pixels of value 0 as padding, as LRA's encoders take
    them (``inputs > 0``); by default every pixel is real.
    """

    name = "image"
    partition_options = ("val_fraction",)
    vocabulary_options = ("zero_is_padding",)  # pixel 0 a token or padding
    vocab_size = PIXEL_VOCAB_SIZE
    num_classes = 10
    max_length = 1024
    pad_id = PIXEL_PAD_ID
    pairs = False

    def __init__(
        self,
        path: PathArg,
        split: str = "train",
        val_fraction: float = 0.1,
        zero_is_padding: bool = False,
    ) -> None:
        check_split(split)
        self.zero_is_padding = check_flag("zero_is_padding", zero_is_padding)
        if not is_real(val_fraction):
            raise TypeError(f"val_fraction must be a float in (0, 1), got {val_fraction!r}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
        root = check_path("path", path)
        require_dir(root, "CIFAR-10 directory")
        if (root / "cifar-10-batches-py").is_dir():
            root = root / "cifar-10-batches-py"
        names = TEST_BATCHES if split == "test" else TRAIN_BATCHES
        parts = [read_cifar_batch(locate(root, [n], "CIFAR-10 batch")) for n in names]
        pixels = np.concatenate([p for p, _ in parts])
        labels = np.concatenate([lab for _, lab in parts])
        if split != "test":
            total = len(labels)
            n_train = total - int(round(val_fraction * total))
            part = slice(0, n_train) if split == "train" else slice(n_train, None)
            pixels, labels = pixels[part], labels[part]
            if len(labels) == 0:
                raise ValueError(
                    f"split {split!r} is empty: val_fraction={val_fraction} of the {total} "
                    "training images leaves it none"
                )
        self.pixels, self.labels = pixels, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.from_numpy(self.pixels[index].astype(np.int64))
        return {
            "input_ids": ids,
            "mask": pixel_mask(ids, self.zero_is_padding),
            "label": torch.tensor(self.labels[index]),
        }


def pixel_mask(ids: torch.Tensor, zero_is_padding: bool) -> torch.Tensor:
    """The real tokens of pixel ids: all, or with ``zero_is_padding`` those above 0 (LRA)."""
    return ids > 0 if zero_is_padding else torch.ones(ids.shape, dtype=torch.bool)
