"""LRA Text: byte-level IMDB sentiment from the ``aclImdb`` directory or a text,label table.

Bytes are tokens: byte ``b`` is id ``b + 1`` and 0 pads (vocabulary 257), as
LRA's byte encoder does. Reviews are truncated to ``max_length`` (4000 in the LRA paper;
1000 in its released config).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import torch

from ..arguments import check_count
from .base import PackedSequences, SequenceTask, check_split, pad_tokens
from .files import PathArg, check_path, data_error, parse_label, read_table, require_dir

BYTE_VOCAB_SIZE = 257
BYTE_PAD_ID = 0

_TEXT_COLUMNS = ("text", "source")
_LABEL_COLUMNS = ("label", "target")
#: aclImdb's review files: ``<id>_<rating>.txt``.
_REVIEW_NAME = re.compile(r"\d+_\d+\.txt")


def read_imdb_dir(root: Path, split: str, max_length: int) -> tuple[list[bytes], list[int]]:
    """Reviews of ``root/<split>/{neg,pos}/<id>_<rating>.txt`` (label 0 = neg, 1 = pos),
    sorted by name, with surrounding whitespace stripped as TFDS's ``imdb_reviews`` (LRA's
    source) does; other ``*.txt`` files there are skipped with a warning."""
    check_count("max_length", max_length, 1)  # a slice [:-1] would drop a byte silently
    texts: list[bytes] = []
    labels: list[int] = []
    for label, polarity in enumerate(("neg", "pos")):
        folder = require_dir(root / split / polarity, "IMDB review directory")
        found = sorted(folder.glob("*.txt"))
        files = [f for f in found if _REVIEW_NAME.fullmatch(f.name)]
        if not files:
            raise FileNotFoundError(f"no <id>_<rating>.txt reviews in {folder}")
        if len(files) < len(found):
            other = [f.name for f in found if not _REVIEW_NAME.fullmatch(f.name)]
            warnings.warn(
                f"{folder}: skipped {len(other)} file(s) not named as IMDB's reviews "
                f"(<id>_<rating>.txt), e.g. {other[0]!r} (macOS writes '._' copies "
                "on other file systems)",
                stacklevel=3,
            )
        for file in files:
            texts.append(file.read_bytes().strip()[:max_length])  # TFDS strips reviews
            labels.append(label)
    return texts, labels


def read_text_table(
    path: PathArg, max_length: int, num_classes: int
) -> tuple[list[bytes], list[int]]:
    """Texts and labels of a CSV (``,``, csv quoting) or TSV (tab; one row per line, quotes
    are text, as in LRA's TSV files) file with a header naming a ``text`` (or ``Source``)
    column and a ``label`` (or ``Target``) column."""
    check_count("max_length", max_length, 1)
    check_count("num_classes", num_classes, 1)
    tsv = str(check_path("path", path)).lower().endswith(".tsv")
    rows = read_table(path, "\t" if tsv else ",", quoted=not tsv)
    first = next(rows, None)
    if first is None:
        raise data_error(path, "empty file (expected a header with text and label columns)", 1)
    _, header = first
    names = [h.strip().lower() for h in header]
    text_col = next((names.index(c) for c in _TEXT_COLUMNS if c in names), None)
    label_col = next((names.index(c) for c in _LABEL_COLUMNS if c in names), None)
    if text_col is None or label_col is None:
        raise data_error(path, f"expected a header with text and label columns, got {header}", 1)
    texts: list[bytes] = []
    labels: list[int] = []
    for line, row in rows:
        if len(row) != len(header):
            hint = (
                " (a TSV row is one line split at tabs, quotes are text: write texts that hold "
                "tabs or newlines to a CSV, which csv quoting reads)"
                if tsv
                else ""
            )
            raise data_error(path, f"expected {len(header)} columns, got {len(row)}{hint}", line)
        labels.append(parse_label(row[label_col], path, line, num_classes))
        texts.append(row[text_col].encode("utf-8")[:max_length])
    if not texts:
        raise data_error(path, "no rows after the header", 2)
    return texts, labels


def find_text_source(path: PathArg, split: str) -> tuple[str, Path]:
    """Where a split lives: ``("imdb", aclImdb root)`` or ``("table", file)``.

    ``path`` may be a CSV/TSV file (used for any split), the ``aclImdb`` directory
    or its parent, or a directory of ``{split}.tsv``/``{split}.csv`` files. IMDB has
    no validation split: as in LRA, ``val`` reads the test data; so does ``val`` of a
    directory without ``val.tsv``/``val.csv`` (it reads ``test.tsv``/``test.csv``).
    :class:`TextTask` records either as ``val_reads_test``.
    """
    p = check_path("path", path)
    if p.is_file():
        return "table", p
    require_dir(p, "text data directory")
    root = p / "aclImdb" if (p / "aclImdb").is_dir() else p
    imdb_split = "test" if split == "val" else split
    if (root / "train").is_dir() or (root / "test").is_dir():
        return "imdb", require_dir(root / imdb_split, "IMDB split directory").parent
    names = [split] if split != "val" else ["val", "test"]
    for name in names:
        for ext in (".tsv", ".csv"):
            if (p / f"{name}{ext}").is_file():
                return "table", p / f"{name}{ext}"
    raise FileNotFoundError(
        f"no text data for split {split!r} in {p}: expected aclImdb/{imdb_split}/{{pos,neg}} "
        f"or {split}.tsv / {split}.csv"
    )


class TextTask(SequenceTask):
    """Byte-level text classification (LRA Text): ``input_ids`` (L,), ``mask`` (L,), ``label``."""

    name = "text"
    vocabulary_options = ("num_classes",)
    vocab_size = BYTE_VOCAB_SIZE
    pad_id = BYTE_PAD_ID
    pairs = False

    def __init__(
        self, path: PathArg, split: str = "train", max_length: int = 4000, num_classes: int = 2
    ) -> None:
        check_split(split)
        self.max_length = check_count("max_length", max_length, 1)
        self.num_classes = check_count("num_classes", num_classes, 2)
        kind, self.source = find_text_source(path, split)
        one_file = Path(path).is_file()
        if one_file and split != "train":
            warnings.warn(
                f"text data {self.source} is one file, read for every split: split "
                f"{split!r} holds the same rows as 'train', so its scores are on training "
                "data (give a directory of train/val/test .tsv or .csv files to hold data out)",
                UserWarning,
                stacklevel=2,
            )
        # a directory of tables without val.*: val read test.* (find_text_source)
        fell_back = kind == "table" and not one_file and self.source.stem != split
        if fell_back:
            warnings.warn(
                f"text data directory {self.source.parent} has no val.tsv or val.csv: split "
                f"'val' reads {self.source.name}, the test data, so what is chosen on it (a "
                "search's trials, the best checkpoint) is chosen on the test set (add a val.tsv "
                "or val.csv to hold validation data out)",
                UserWarning,
                stacklevel=2,
            )
        # IMDB's val is its test split (as in LRA); one file is every split
        self.val_reads_test = split == "val" and (kind == "imdb" or one_file or fell_back)
        if kind == "imdb":
            split_dir = "test" if split == "val" else split
            texts, labels = read_imdb_dir(self.source, split_dir, self.max_length)
        else:
            texts, labels = read_text_table(self.source, self.max_length, self.num_classes)
        self.sequences = PackedSequences(texts)
        self.labels = np.asarray(labels, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        input_ids, mask = pad_tokens(self.sequences[index], self.max_length, self.pad_id, 1)
        return {"input_ids": input_ids, "mask": mask, "label": torch.tensor(self.labels[index])}
