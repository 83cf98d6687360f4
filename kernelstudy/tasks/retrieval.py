"""LRA Retrieval: byte-level document matching on the ACL Anthology Network (AAN) pairs.

The release's ``new_aan_pairs.{train,eval,test}.tsv`` have no header and five
tab-separated columns: label, id1, id2, text1, text2. As in LRA's reader, quotes
are not special. Each document is byte-level (byte ``b`` is id ``b + 1``, pad 0)
and truncated to ``max_length`` (4000 in LRA).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..arguments import check_count
from .base import PackedBytesBuilder, SequenceTask, check_split, pad_tokens
from .files import PathArg, check_path, data_error, locate, parse_label, release_candidates
from .text import BYTE_PAD_ID, BYTE_VOCAB_SIZE

_FILE_SPLIT = {"train": "train", "val": "eval", "test": "test"}
_COLUMNS = 5


def _aan_rows(path: PathArg, max_length: int) -> Iterator[tuple[int, memoryview, memoryview]]:
    """(label, document 1, document 2) of each row of an AAN pairs file, the documents
    truncated to ``max_length`` bytes (views into the line: no copy)."""
    check_path("path", path)
    check_count("max_length", max_length, 1)  # a slice [:-1] would drop a byte silently
    rows = 0
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            line = raw.rstrip(b"\r\n")
            if line_no == 1 and line.startswith(codecs.BOM_UTF8):  # a BOM is not the label
                line = line[len(codecs.BOM_UTF8) :]
            if not line:
                continue
            fields = line.split(b"\t")
            if len(fields) != _COLUMNS:
                raise data_error(
                    path,
                    f"expected {_COLUMNS} tab-separated columns (label, id1, id2, text1, text2), "
                    f"got {len(fields)}",
                    line_no,
                )
            label = fields[0].decode("utf-8", errors="replace")
            rows += 1
            yield (
                parse_label(label, path, line_no, 2, allow_float=True),
                memoryview(fields[3])[:max_length],
                memoryview(fields[4])[:max_length],
            )
    if not rows:
        raise data_error(path, "no rows")


def read_aan_tsv(path: PathArg, max_length: int) -> tuple[list[bytes], list[bytes], list[int]]:
    """Documents 1, documents 2 (bytes, truncated) and labels of an AAN pairs file."""
    docs1: list[bytes] = []
    docs2: list[bytes] = []
    labels: list[int] = []
    for label, doc1, doc2 in _aan_rows(path, max_length):
        labels.append(label)
        docs1.append(bytes(doc1))
        docs2.append(bytes(doc2))
    return docs1, docs2, labels


class RetrievalTask(SequenceTask):
    """Pairs of byte-level documents, 2 classes (related or not).

    Items: ``input_ids_1``, ``mask_1``, ``input_ids_2``, ``mask_2`` (L,) each and
    ``label``. ``path`` is the directory of the TSV files, or a directory holding
    ``tsv_data/`` one or two ``lra_release/`` levels down (the published archive unpacks to
    ``lra_release/lra_release/tsv_data``); split ``val`` reads the ``eval`` file.
    """

    name = "retrieval"
    vocab_size = BYTE_VOCAB_SIZE
    num_classes = 2
    pad_id = BYTE_PAD_ID
    pairs = True

    def __init__(self, path: PathArg, split: str = "train", max_length: int = 4000) -> None:
        check_split(split)
        check_path("path", path)
        self.max_length = check_count("max_length", max_length, 1)
        name = f"new_aan_pairs.{_FILE_SPLIT[split]}.tsv"
        candidates = [name, *release_candidates("tsv_data", name)]
        self.file: Path = locate(path, candidates, f"AAN {split} file")
        # packed as read: the documents are held once, not as a list and then a copy
        docs1, docs2, labels = PackedBytesBuilder(), PackedBytesBuilder(), []
        for label, doc1, doc2 in _aan_rows(self.file, self.max_length):
            labels.append(label)
            docs1.append(doc1)
            docs2.append(doc2)
        self.docs1 = docs1.build()
        self.docs2 = docs2.build()
        self.labels = np.asarray(labels, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids1, mask1 = pad_tokens(self.docs1[index], self.max_length, self.pad_id, 1)
        ids2, mask2 = pad_tokens(self.docs2[index], self.max_length, self.pad_id, 1)
        return {
            "input_ids_1": ids1,
            "mask_1": mask1,
            "input_ids_2": ids2,
            "mask_2": mask2,
            "label": torch.tensor(self.labels[index]),
        }
