"""ListOps (Long Range Arena): generator, evaluator, the release's TSV files and their loader.

An expression is a tree: an operator node ``[MIN``, ``[MAX``, ``[MED`` (median,
floored) or ``[SM`` (sum mod 10) over 2–10 arguments, each a digit 0–9 or another
operator node. Following LRA's generator, a node below the maximum depth (10, the
root at depth 1) is an operator with probability 0.25, else a digit; trees are
kept when their token count (operators, digits and ``]``; parentheses do not
count) lies strictly between ``min_length`` and ``max_length``; kept trees are
distinct. The Source column is written as LRA writes it, e.g. ``[MAX 2 9 ]`` is
``( ( ( [MAX 2 ) 9 ) ] )``; the Target column is the value.

Generation is vectorized: a batch of trees grows level by level in NumPy, trees
that already exceed the length bound stop growing, and the kept ones are laid
out in preorder and evaluated without Python-level recursion.
"""

from __future__ import annotations

import csv
import hashlib
import inspect
import itertools
import os
from collections.abc import Generator
from pathlib import Path

import numpy as np
import torch

from ..arguments import check_count, check_flag
from ..files import (
    lock_while_written,
    naming_the_file,
    new_temporary_file,
    release_lock,
    remove_abandoned_files,
)
from .base import PackedSequences, SequenceTask, check_split, pad_tokens
from .files import PathArg, check_path, data_error, decode_error, locate, release_candidates

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
VALUE_P = 0.25
MAX_DEPTH = 10
MAX_ARGS = 10

#: Token vocabulary of the loader: id 0 is padding.
VOCAB = ("<pad>", *(str(d) for d in range(10)), *OPERATORS, END)
PAD_ID = 0
_TOKEN_ID = {token: i for i, token in enumerate(VOCAB)}
_DROP_PARENS = str.maketrans("", "", "()")

#: Trees grown per vectorized batch (fixed, so files depend only on the seed).
_BATCH = 4096
#: Give up after this many batches without a new distinct tree (the bounds admit too few).
_MAX_IDLE_BATCHES = 200


def tokenize_listops(source: str) -> list[str]:
    """ListOps tokens as the PyTorch re-implementations of LRA take them: parentheses removed,
    split on whitespace, ``[MAX`` and ``]`` tokens (the tree stays readable). LRA's released
    pipeline (a TFDS ``Tokenizer`` keeping alphanumerics only) drops ``[``, ``]`` and the
    parentheses: ``MAX 2 MIN 4 1 9`` for ``[MAX 2 [MIN 4 1 ] 9 ]``, which two trees of
    different values share."""
    if not isinstance(source, str):
        raise TypeError(f"source must be a str (a ListOps Source), got {source!r}")
    return source.translate(_DROP_PARENS).split()


def evaluate_listops(source: str | list[str]) -> int:
    """The value of an expression in LRA format (a Source string or its tokens).

    Raises ValueError on an unknown token or an unbalanced expression.
    """
    if not isinstance(source, str | list | tuple):
        raise TypeError(f"source must be a str or a list or tuple of tokens, got {source!r}")
    if not isinstance(source, str) and not all(isinstance(t, str) for t in source):
        raise TypeError(f"source's tokens must be str, got {source!r}")
    tokens = tokenize_listops(source) if isinstance(source, str) else source
    stack: list[tuple[str, list[int]]] = []
    result: int | None = None
    for token in tokens:
        if result is not None:
            raise ValueError(f"tokens after the end of the expression: {token!r}")
        if token in OPERATORS:
            stack.append((token, []))
        elif token == END:
            if not stack:
                raise ValueError("']' without an operator")
            op, args = stack.pop()
            if not args:
                raise ValueError(f"{op} without arguments")
            value = apply_operator(op, args)
            if stack:
                stack[-1][1].append(value)
            else:
                result = value
        elif len(token) == 1 and token in "0123456789":
            if not stack:
                if len(tokens) != 1:
                    raise ValueError("a digit outside any operator")
                return int(token)
            stack[-1][1].append(int(token))
        else:
            raise ValueError(f"unknown token {token!r}")
    if stack or result is None:
        raise ValueError("unbalanced expression: missing ']'")
    return result


def apply_operator(op: str, args: list[int]) -> int:
    """The value of operator ``op`` (one of ``OPERATORS``) over digit arguments."""
    if op == "[MIN":
        return min(args)
    if op == "[MAX":
        return max(args)
    if op == "[MED":
        s = sorted(args)
        n = len(s)
        return (s[(n - 1) // 2] + s[n // 2]) // 2
    if op == "[SM":
        return sum(args) % 10
    raise ValueError(f"unknown operator {op!r}")


# ---------------------------------------------------------------------------- generation


def _piece_table(max_args: int) -> tuple[list[str], int, int, int]:
    """Text pieces of the Source: one per token with its parentheses.

    Ids: 0–9 digit argument (``"d )"``), 10–19 digit root, then per operator and
    arity the opening (``"( " * (arity + 1) + op``), then ``"] ) )"`` (argument)
    and ``"] )"`` (root).
    """
    pieces = [f"{d} )" for d in range(10)] + [str(d) for d in range(10)]
    open_base = len(pieces)
    for op in OPERATORS:
        pieces += ["( " * (arity + 1) + op for arity in range(2, max_args + 1)]
    close_arg = len(pieces)
    pieces += ["] ) )", "] )"]
    return pieces, open_base, close_arg, close_arg + 1


Levels = list[dict[str, np.ndarray]]


def _grow(
    rng: np.random.Generator, max_length: int, max_depth: int, max_args: int
) -> tuple[Levels, np.ndarray, np.ndarray]:
    """Grow ``_BATCH`` random trees level by level.

    Returns the levels (dicts of per-node arrays: ``tree``, ``parent`` index into
    the level above, ``op`` (-1 for a digit), ``arity``, ``digit``), the token count
    of every tree and whether it was grown completely (not stopped for length).
    """
    tree = np.arange(_BATCH)
    parent = np.full(_BATCH, -1)
    count = np.zeros(_BATCH, dtype=np.int64)
    complete = np.ones(_BATCH, dtype=bool)
    levels = []
    for depth in range(1, max_depth + 1):
        n = len(tree)
        if depth < max_depth:
            is_op = rng.random(n) < VALUE_P
        else:
            is_op = np.zeros(n, dtype=bool)
        arity = np.where(is_op, rng.integers(2, max_args + 1, n), 0)
        op = np.where(is_op, rng.integers(0, len(OPERATORS), n), -1)
        digit = rng.integers(0, 10, n)
        levels.append({"tree": tree, "parent": parent, "op": op, "arity": arity, "digit": digit})
        count += np.bincount(tree, weights=np.where(is_op, 2, 1), minlength=_BATCH).astype(np.int64)
        pending = np.bincount(tree, weights=arity, minlength=_BATCH).astype(np.int64)
        # Every pending child adds at least one token: stop trees that cannot fit.
        complete &= count + pending < max_length
        grow = np.flatnonzero(is_op & complete[tree])
        if grow.size == 0:
            break
        parent = np.repeat(grow, arity[grow])
        tree = tree[parent]
    return levels, count, complete


def _keep_trees(levels: Levels, keep_tree: np.ndarray) -> Levels:
    """The levels restricted to the trees in ``keep_tree`` (bool per tree), renumbered."""
    new_tree = np.cumsum(keep_tree) - 1
    kept = []
    remap = None
    for level in levels:
        keep = keep_tree[level["tree"]]
        if not keep.any():
            break
        new = {key: value[keep] for key, value in level.items()}
        new["tree"] = new_tree[new["tree"]]
        if remap is not None:
            new["parent"] = remap[new["parent"]]
        remap = np.cumsum(keep) - 1
        kept.append(new)
    return kept


def _layout(levels: Levels, max_args: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Preorder piece ids of complete trees: ``(pieces, offsets (T+1,), labels (T,))``."""
    _, open_base, close_arg, close_root = _piece_table(max_args)
    depth = len(levels)
    sizes: list[np.ndarray] = [np.empty(0, np.int64)] * depth
    values: list[np.ndarray] = [np.empty(0, np.int64)] * depth
    first_child: list[np.ndarray] = [np.empty(0, np.int64)] * depth
    for d in reversed(range(depth)):
        level = levels[d]
        n = len(level["op"])
        first_child[d] = np.cumsum(level["arity"]) - level["arity"]
        is_op = level["op"] >= 0
        value = level["digit"].copy()
        size = np.ones(n, dtype=np.int64)
        ops = np.flatnonzero(is_op)
        if ops.size:
            child = levels[d + 1]
            child_tokens = np.bincount(child["parent"], weights=sizes[d + 1], minlength=n)
            size[ops] = 2 + child_tokens[ops].astype(np.int64)
            cv = values[d + 1]
            starts = first_child[d][ops]
            arity = level["arity"][ops]
            # Children are contiguous per parent, so sorting (parent, value) sorts each group.
            ordered = np.sort(child["parent"] * 16 + cv) % 16
            results = np.stack(
                [
                    np.minimum.reduceat(cv, starts),
                    np.maximum.reduceat(cv, starts),
                    (ordered[starts + (arity - 1) // 2] + ordered[starts + arity // 2]) // 2,
                    np.add.reduceat(cv, starts) % 10,
                ]
            )
            value[ops] = results[level["op"][ops], np.arange(ops.size)]
        sizes[d], values[d] = size, value

    offsets = np.zeros(len(sizes[0]) + 1, dtype=np.int64)
    np.cumsum(sizes[0], out=offsets[1:])
    pieces = np.empty(offsets[-1], dtype=np.int16)
    start = offsets[:-1]  # position of each node's first token; roots start their tree
    for d in range(depth):
        level = levels[d]
        if d > 0:
            # A child starts after its parent's operator and its earlier siblings.
            parent = level["parent"]
            before = np.cumsum(sizes[d]) - sizes[d]  # tokens of earlier nodes at this level
            start = start[parent] + 1 + before - before[first_child[d - 1][parent]]
        is_op = level["op"] >= 0
        root = d == 0
        digits = ~is_op
        pieces[start[digits]] = level["digit"][digits] + (10 if root else 0)
        ops = np.flatnonzero(is_op)
        op_ids = level["op"][ops] * (max_args - 1) + level["arity"][ops] - 2
        pieces[start[ops]] = open_base + op_ids
        pieces[start[ops] + sizes[d][ops] - 1] = close_root if root else close_arg
    return pieces, offsets, values[0]


def generate_listops(
    n: int,
    min_length: int = 500,
    max_length: int = 2000,
    seed: int = 0,
    max_depth: int = MAX_DEPTH,
    max_args: int = MAX_ARGS,
    progress: bool = False,
) -> Generator[tuple[str, int], None, None]:
    """Yield ``n`` distinct random expressions as ``(Source, value)`` pairs, reproducibly.

    Token counts are strictly between ``min_length`` and ``max_length`` (as in LRA).
    Raises ValueError for impossible bounds, and when no new distinct tree turns up
    for a long while (the bounds admit too few trees for ``n``).
    """
    check_count("n", n, 0)
    check_count("min_length", min_length, 0)
    check_count("max_length", max_length, 0)
    check_count("max_depth", max_depth, 1)
    check_count("max_args", max_args, 2)
    check_count("seed", seed, 0)
    if max_length <= min_length + 1:
        raise ValueError(
            f"need max_length >= min_length + 2, got min_length={min_length}, "
            f"max_length={max_length}"
        )
    return _generate(n, min_length, max_length, seed, max_depth, max_args, progress)


def _generate(
    n: int,
    min_length: int,
    max_length: int,
    seed: int,
    max_depth: int,
    max_args: int,
    progress: bool,
) -> Generator[tuple[str, int], None, None]:
    """The generator behind ``generate_listops`` (arguments already checked)."""
    pieces_text, *_ = _piece_table(max_args)
    rng = np.random.default_rng(seed)
    seen: set[bytes] = set()
    bar = None
    if progress:
        from ..progress import tqdm  # the notebook bar where it can be drawn, as elsewhere

        bar = tqdm(total=n, desc="listops", unit="seq")
    produced, idle_batches = 0, 0
    try:
        while produced < n:
            levels, count, complete = _grow(rng, max_length, max_depth, max_args)
            keep = complete & (count > min_length) & (count < max_length)
            new = 0
            if keep.any():
                pieces, offsets, labels = _layout(_keep_trees(levels, keep), max_args)
                as_list = pieces.tolist()
                for i in range(len(labels)):
                    a, b = offsets[i], offsets[i + 1]
                    digest = hashlib.blake2b(pieces[a:b].tobytes(), digest_size=16).digest()
                    if digest in seen:
                        continue
                    seen.add(digest)
                    new += 1
                    produced += 1
                    if bar is not None:
                        bar.update()
                    yield " ".join(map(pieces_text.__getitem__, as_list[a:b])), int(labels[i])
                    if produced == n:
                        break
            idle_batches = 0 if new else idle_batches + 1
            if idle_batches >= _MAX_IDLE_BATCHES:
                raise ValueError(
                    f"found only {produced} distinct ListOps trees with length in "
                    f"({min_length}, {max_length}); widen the bounds or ask for fewer"
                )
    finally:
        if bar is not None:
            bar.close()


def write_listops(
    out_dir: PathArg,
    n_train: int = 96_000,
    n_val: int = 2_000,
    n_test: int = 2_000,
    min_length: int = 500,
    max_length: int = 2000,
    seed: int = 0,
    progress: bool = False,
    max_depth: int = MAX_DEPTH,
    overwrite: bool = False,
) -> dict[str, Path]:
    """Write LRA's ``basic_train.tsv``, ``basic_val.tsv``, ``basic_test.tsv`` into ``out_dir``.

    Each file has the header ``Source<TAB>Target`` and one expression per row,
    written by ``csv.writer`` with a tab delimiter as LRA's script does. All rows
    across the three files are distinct. Files appear only once all are written.
    ``max_depth`` (default LRA's 10) bounds the nesting, for easier subsets.
    Existing files (e.g. the LRA release's, which have the same names) are a
    FileExistsError unless ``overwrite``. Returns ``{"train": path, ...}``.
    """
    out = check_path("out_dir", out_dir)
    counts = {"train": n_train, "val": n_val, "test": n_test}
    for split, count in counts.items():
        check_count(f"n_{split}", count, 1)  # an empty split could not be read back
    paths = {split: out / f"basic_{split}.tsv" for split in counts}
    existing = [str(p) for p in paths.values() if p.exists()]
    if existing and not check_flag("overwrite", overwrite):
        raise FileExistsError(
            f"{', '.join(existing)} exist(s): pass overwrite=True (--overwrite) to replace them"
        )
    generated = generate_listops(
        sum(counts.values()), min_length, max_length, seed, max_depth, progress=progress
    )
    try:
        first = next(generated)  # bad lengths fail here, before a directory is made
    except BaseException:
        generated.close()
        raise
    rows = itertools.chain([first], generated)
    out.mkdir(parents=True, exist_ok=True)
    # temporary files of this call's own: two writers to one folder (two searches started
    # together) deleted each other's fixed-name .partial files, and one crashed. Each is
    # locked while written, so those of writers killed mid-write (SIGKILL skips the clean-up
    # below) are told apart from a live writer's and deleted here.
    remove_abandoned_files(out, ".basic_*.partial")
    partial, locks = {}, []
    try:
        for split, count in counts.items():
            fd, partial[split] = new_temporary_file(out, f".basic_{split}.", ".partial")
            locks.append(lock_while_written(fd))
            with naming_the_file(paths[split]), open(fd, "w", encoding="utf-8", newline="") as f:
                writer = csv.writer(f, delimiter="\t")
                writer.writerow(["Source", "Target"])
                for _ in range(count):
                    writer.writerow(next(rows))
        _put_in_place(partial, paths, overwrite)
    finally:
        generated.close()
        for path in partial.values():
            path.unlink(missing_ok=True)
        for held in locks:
            release_lock(held)
    return paths


def _put_in_place(partial: dict[str, Path], paths: dict[str, Path], overwrite: bool) -> None:
    """Move the written files to their names. Without ``overwrite``, each is linked to its
    name, which fails where a file has appeared since the check (another writer, started
    at the same time, finished first: both calls succeeded and one replaced the other's
    files); this call's files already placed are then taken away again."""
    if overwrite:
        for split, path in paths.items():
            partial[split].replace(path)
        return
    placed: list[Path] = []
    link = getattr(os, "link", None)
    for split, path in paths.items():
        try:
            if link is None:  # no hard links on this platform: as a file system without them
                raise OSError("no os.link")
            link(partial[split], path)
        except FileExistsError:
            for done in placed:
                done.unlink(missing_ok=True)
            raise FileExistsError(
                f"{path} appeared while this call wrote its files (another writer?): pass "
                "overwrite=True (--overwrite) to replace it"
            ) from None
        except OSError:  # a file system without hard links: the check made before writing
            if path.exists():
                raise FileExistsError(f"{path} appeared while this call wrote its files") from None
            partial[split].replace(path)
        placed.append(path)


def check_listops_settings(**settings: object) -> None:
    """TypeError/ValueError naming the first bad one unless :func:`write_listops` takes these
    keyword settings (its defaults for the rest), checked without generating anything."""
    params = inspect.signature(write_listops).parameters
    unknown = sorted(set(settings) - set(params) - {"out_dir"})
    if unknown:
        raise TypeError(f"unknown ListOps setting(s) {unknown}")
    s = {name: p.default for name, p in params.items() if name != "out_dir"} | settings
    for split in ("train", "val", "test"):
        check_count(f"n_{split}", s[f"n_{split}"], 1)
    generate_listops(0, s["min_length"], s["max_length"], s["seed"], s["max_depth"]).close()


# ---------------------------------------------------------------------------- loading


def encode_listops(tokens: list[str]) -> np.ndarray:
    """Token ids (uint8) of ListOps tokens; KeyError on an unknown token."""
    return np.fromiter(map(_TOKEN_ID.__getitem__, tokens), dtype=np.uint8, count=len(tokens))


def read_listops_tsv(path: PathArg) -> tuple[PackedSequences, np.ndarray]:
    """Token ids and labels of an LRA ListOps TSV file; ValueError naming file and line."""
    check_path("path", path)
    try:
        return _read_listops_tsv(path)
    except UnicodeDecodeError as err:
        raise decode_error(path, err) from None


def _read_listops_tsv(path: PathArg) -> tuple[PackedSequences, np.ndarray]:
    sequences: list[np.ndarray] = []
    labels: list[int] = []
    # utf-8-sig: a byte-order mark (a file saved by an editor) is not part of the header
    with open(path, encoding="utf-8-sig", newline="") as f:
        header = f.readline().rstrip("\r\n")
        if header.split("\t") != ["Source", "Target"]:
            raise data_error(path, f"expected the header 'Source<TAB>Target', got {header!r}", 1)
        for line_no, line in enumerate(f, start=2):
            line = line.rstrip("\r\n")
            if not line:
                continue
            fields = line.split("\t")
            if len(fields) != 2:
                raise data_error(
                    path, f"expected 2 tab-separated columns, got {len(fields)}", line_no
                )
            source, target = fields
            tokens = tokenize_listops(source)
            try:
                ids = encode_listops(tokens)
            except KeyError as err:
                raise data_error(path, f"unknown ListOps token {err.args[0]!r}", line_no) from None
            if len(ids) == 0:
                raise data_error(path, "empty Source", line_no)
            target = target.strip()
            if not (len(target) == 1 and target in "0123456789"):  # ASCII: not "²" or "٣"
                raise data_error(path, f"bad label {target!r} (expected a digit 0-9)", line_no)
            sequences.append(ids)
            labels.append(int(target))
    if not labels:
        raise data_error(path, "no rows after the header", 2)
    return PackedSequences(sequences), np.asarray(labels, dtype=np.int64)


class ListOpsTask(SequenceTask):
    """LRA ListOps from ``basic_{train,val,test}.tsv``: 10-way classification.

    Vocabulary: ``VOCAB`` (16 tokens, pad 0). Sequences longer than
    ``max_length`` are truncated (as LRA does), shorter ones padded.
    ``path`` is the directory holding the files (the release's ``listops-1000``), or a
    directory holding ``listops-1000/`` one or two ``lra_release/`` levels down (the
    published archive unpacks to ``lra_release/lra_release/listops-1000``).
    ``closing_brackets=False`` drops the ``]`` tokens, as LRA's released tokenizer does
    (:func:`tokenize_listops`), before truncation, as there.
    """

    name = "listops"
    vocabulary_options = ("closing_brackets",)  # the token stream the model learns
    vocab_size = len(VOCAB)
    num_classes = 10
    pad_id = PAD_ID
    pairs = False

    def __init__(
        self,
        path: PathArg,
        split: str = "train",
        max_length: int = 2000,
        closing_brackets: bool = True,
    ) -> None:
        check_split(split)
        check_path("path", path)
        self.max_length = check_count("max_length", max_length, 1)
        self.closing_brackets = check_flag("closing_brackets", closing_brackets)
        name = f"basic_{split}.tsv"
        candidates = [name, *release_candidates("listops-1000", name)]
        self.file = locate(path, candidates, f"ListOps {split} file")
        self.sequences, self.labels = read_listops_tsv(self.file)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.sequences[index]
        if not self.closing_brackets:
            ids = ids[ids != _TOKEN_ID[END]]
        input_ids, mask = pad_tokens(ids, self.max_length, self.pad_id)
        return {"input_ids": input_ids, "mask": mask, "label": torch.tensor(self.labels[index])}
