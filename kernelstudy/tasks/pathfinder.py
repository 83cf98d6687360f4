"""LRA Pathfinder: are the two dots joined by a path? From the pathfinder32 images and metadata.

Layout (one directory per difficulty: ``curv_baseline`` the easy one,
``curv_contour_length_9``, and ``curv_contour_length_14`` the hard one that LRA's
published Pathfinder results use, its ``pathfinder32_hard`` task; the default)::

    pathfinder32/curv_contour_length_14/metadata/0.npy, 1.npy, ...  # text, despite the name
    pathfinder32/curv_contour_length_14/imgs/0/sample_0.png, ...

Each metadata line is space-separated: image subdirectory (``imgs/0``), file name
(``sample_0.png``), an index, the label (0/1), then generation parameters. Images
are 8-bit PNGs (gray; RGB is converted to gray), flattened row-major into
``resolution²`` pixel tokens 0–255. Splits are a seeded 80/10/10 partition of
all samples (LRA takes 80/10/10 too).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..arguments import check_count, check_flag
from .base import SequenceTask, check_split
from .files import PathArg, check_path, data_error, decode_error, parse_label, release_candidates
from .image import PIXEL_PAD_ID, PIXEL_VOCAB_SIZE, pixel_mask, rgb_to_gray
from .png import read_png

DIFFICULTIES = ("curv_baseline", "curv_contour_length_9", "curv_contour_length_14")
SPLIT_FRACTIONS = {"train": (0.0, 0.8), "val": (0.8, 0.9), "test": (0.9, 1.0)}


def find_pathfinder_root(path: PathArg, difficulty: str, resolution: int = 32) -> Path:
    """The directory holding ``metadata/``: ``path/<difficulty>``,
    ``path/pathfinder<resolution>/<difficulty>``, the same under ``path/lra_release/`` or
    ``path/lra_release/lra_release/`` (where the published archive unpacks it), or ``path``
    itself.

    A ``path`` that is another difficulty's directory (``curv_baseline`` when
    ``difficulty`` asks for ``curv_contour_length_14``), or that lies in another
    resolution's ``pathfinder<R>/``, is a ValueError rather than the wrong data.
    """
    base = check_path("path", path)
    nested = release_candidates(f"pathfinder{resolution}", difficulty)
    candidates = [base / difficulty, *(base / c for c in nested), base]
    for candidate in candidates:
        if (candidate / "metadata").is_dir():
            break
    else:
        tried = ", ".join(str(c / "metadata") for c in candidates)
        raise FileNotFoundError(f"Pathfinder metadata directory not found; looked for {tried}")
    resolved = candidate.resolve()  # "." has no name
    if resolved.name in DIFFICULTIES and resolved.name != difficulty:
        raise ValueError(
            f"{candidate} is the {resolved.name!r} directory, but difficulty is "
            f"{difficulty!r}: pass difficulty={resolved.name!r}, or its parent directory"
        )
    parent = resolved.parent.name
    digits = parent.removeprefix("pathfinder")
    if digits != parent and digits.isdigit() and int(digits) != resolution:
        raise ValueError(
            f"{candidate} lies in {parent}/, but resolution is {resolution}: pass "
            f"resolution={int(digits)}, or the directory that holds pathfinder{resolution}/"
        )
    return candidate


def _metadata_order(path: Path) -> tuple[int, str]:
    return (int(path.stem), "") if path.stem.isdigit() else (1 << 62, path.name)


def read_metadata(root: Path) -> tuple[list[Path], np.ndarray, list[str]]:
    """Image paths, labels and ``"<metadata file>, line <n>"`` origins of every sample.

    Samples whose image file is empty (0 bytes) are left out with one warning, as LRA's
    input pipeline does: the published ``pathfinder32/curv_baseline`` lists one such
    image (``imgs/0/sample_172.png``)."""
    files = sorted((root / "metadata").glob("*.npy"), key=_metadata_order)
    if not files:
        raise FileNotFoundError(f"no *.npy metadata files in {root / 'metadata'}")
    images: list[Path] = []
    labels: list[int] = []
    origins: list[str] = []
    empty: list[str] = []
    listed: dict[Path, str] = {}  # image -> where it was first listed
    repeated: list[str] = []  # the first three repeats, described
    repeats = 0
    for meta in files:
        try:
            lines = meta.read_text(encoding="utf-8-sig").split("\n")  # a BOM is no text
        except UnicodeDecodeError as err:
            hint = "; Pathfinder metadata files are text, despite the .npy name"
            raise decode_error(meta, err, hint) from None
        for line_no, line in enumerate(lines, start=1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) < 4:
                raise data_error(
                    meta,
                    f"expected at least 4 space-separated fields (dir, file, index, label), "
                    f"got {len(fields)}",
                    line_no,
                )
            merged = next((f for f in fields[4:] if f.lower().endswith(".png")), None)
            if merged is not None:
                raise data_error(
                    meta,
                    f"a second image name ({merged!r}) among the fields after the label: two "
                    "records on one line (a lost line break?)",
                    line_no,
                )
            image = root / fields[0] / fields[1]
            if image not in listed:
                listed[image] = f"{meta}, line {line_no}"
            else:
                repeats += 1
                if len(repeated) < 3:
                    repeated.append(f"{image} ({listed[image]}, and line {line_no} of {meta})")
            if not image.is_file():
                raise data_error(meta, f"image {image} does not exist", line_no)
            label = parse_label(fields[3], meta, line_no, 2)
            if image.stat().st_size == 0:
                empty.append(f"{image} ({meta}, line {line_no})")
                continue
            labels.append(label)
            images.append(image)
            origins.append(f"{meta}, line {line_no}")
    if empty:
        warnings.warn(
            f"Pathfinder: left out {len(empty)} sample(s) whose image file is empty, as LRA "
            f"does: {', '.join(empty[:3])}{' ...' if len(empty) > 3 else ''}",
            stacklevel=3,
        )
    if repeats:
        warnings.warn(
            f"Pathfinder: {repeats} repeated listing(s) of an image (a copy of a metadata "
            f"file, a repeated line?), each kept as listed, so the split can put one image "
            f"in train and test: {'; '.join(repeated)}{' ...' if repeats > 3 else ''}",
            stacklevel=3,
        )
    if not images:
        raise data_error(files[0], "no samples in the metadata files")
    return images, np.asarray(labels, dtype=np.int64), origins


class StoredStrings(Sequence):
    """Strings (``root / s`` paths with ``root``) kept in one numpy bytes array, read back one
    at a time. A DataLoader worker reading a list of 160,000 Path objects touched (so copied)
    about 1 KB of its parent's memory per sample each epoch (183 MB a worker); one array has
    no object per sample."""

    def __init__(self, values: Sequence[str], root: Path | None = None) -> None:
        self.root = root
        self._bytes = np.array([os.fsencode(v) for v in values], dtype=np.bytes_)

    def __len__(self) -> int:
        return len(self._bytes)

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        text = os.fsdecode(self._bytes[index])
        return text if self.root is None else self.root / text

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]


class PathfinderTask(SequenceTask):
    """Pathfinder, 2 classes: ``input_ids`` (resolution²,) pixels 0–255, ``mask``, ``label``.

    ``path`` is the ``pathfinder<resolution>`` directory, a difficulty directory, or a
    directory holding ``pathfinder<resolution>/`` one or two ``lra_release/`` levels down
    (the published archive unpacks to ``lra_release/lra_release/pathfinder32``). Images are
    decoded when an item is read; a malformed one raises a ValueError naming the image and
    its metadata line. ``zero_is_padding``: the mask marks pixels of value 0 (the black
    background) as padding, as LRA's encoders take them; by default every pixel is real.
    """

    name = "pathfinder"
    partition_options = ("split_seed",)
    vocabulary_options = ("zero_is_padding",)  # pixel 0 a token or padding
    vocab_size = PIXEL_VOCAB_SIZE
    num_classes = 2
    pad_id = PIXEL_PAD_ID
    pairs = False

    def __init__(
        self,
        path: PathArg,
        split: str = "train",
        difficulty: str = "curv_contour_length_14",
        resolution: int = 32,
        split_seed: int = 0,
        zero_is_padding: bool = False,
    ) -> None:
        check_split(split)
        self.zero_is_padding = check_flag("zero_is_padding", zero_is_padding)
        if difficulty not in DIFFICULTIES:
            raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")
        self.resolution = check_count("resolution", resolution, 1)
        check_count("split_seed", split_seed, 0)
        self.max_length = resolution * resolution
        self.root = find_pathfinder_root(path, difficulty, self.resolution)
        images, labels, origins = read_metadata(self.root)
        order = np.random.default_rng(split_seed).permutation(len(images))
        lo, hi = SPLIT_FRACTIONS[split]
        chosen = order[int(round(lo * len(order))) : int(round(hi * len(order)))]
        if len(chosen) == 0:
            raise ValueError(
                f"split {split!r} of {self.root} is empty: {len(images)} images are too few "
                f"for the split fractions {SPLIT_FRACTIONS}"
            )
        # relpath, not relative_to: metadata may name an image folder elsewhere (absolute)
        names = [os.path.relpath(images[i], self.root) for i in chosen]
        self.images = StoredStrings(names, self.root)
        self.origins = StoredStrings([origins[i] for i in chosen])
        self.labels = labels[chosen]

    def __len__(self) -> int:
        return len(self.labels)

    def pixels(self, index: int) -> np.ndarray:
        """(resolution, resolution) uint8 gray image of sample ``index``."""
        try:
            # the size checked before the pixels are inflated
            image = read_png(self.images[index], (self.resolution, self.resolution))
        except ValueError as err:
            raise ValueError(f"{err} (listed in {self.origins[index]})") from None
        return rgb_to_gray(image[..., :3]) if image.shape[-1] >= 3 else image[..., 0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.from_numpy(self.pixels(index).reshape(-1).astype(np.int64))
        return {
            "input_ids": ids,
            "mask": pixel_mask(ids, self.zero_is_padding),
            "label": torch.tensor(self.labels[index]),
        }
