"""ListOps: generated files follow the LRA spec; the loader reads them and rejects bad ones.

The checks parse each written Source independently, by its parentheses, into
LRA's nested-tuple trees, and evaluate/render those trees the way LRA's
generator does.
"""

from __future__ import annotations

import csv
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from kernelstudy.tasks import (
    ListOpsTask,
    evaluate_listops,
    generate_listops,
    load_task,
    tokenize_listops,
    write_listops,
)
from kernelstudy.tasks.listops import VOCAB

OPS = ("[MIN", "[MAX", "[MED", "[SM")


# --------------------------------------------------------------------- independent reference


def parse_tree(source: str):
    """LRA's tree from its string: ``( a b )`` is the tuple ``(a, b)``; atoms are str or int."""
    tokens = source.split()
    pos = 0

    def node():
        nonlocal pos
        token = tokens[pos]
        pos += 1
        if token == "(":
            left = node()
            right = node()
            assert tokens[pos] == ")", f"expected ')' at token {pos}"
            pos += 1
            return (left, right)
        assert token != ")", f"unexpected ')' at token {pos - 1}"
        return int(token) if token.isdigit() else token

    tree = node()
    assert pos == len(tokens), "trailing tokens"
    return tree


def to_string(t) -> str:
    """LRA's rendering of a tree."""
    if isinstance(t, str):
        return t
    if isinstance(t, int):
        return str(t)
    return "( " + to_string(t[0]) + " " + to_string(t[1]) + " )"


def to_value(t):
    """LRA's evaluation of a tree (operators build unsaturated functions until ``]``)."""
    if not isinstance(t, tuple):
        return t
    left, right = to_value(t[0]), to_value(t[1])
    if left in OPS:
        return (left, [right])
    if right == "]":
        op, args = left
        if op == "[MIN":
            return min(args)
        if op == "[MAX":
            return max(args)
        if op == "[MED":
            return int(np.median(args))
        return int(np.sum(args) % 10)
    return (left[0], left[1] + [right])


def structure(t):
    """``(op, [children])`` for operator nodes, the int for digits."""
    if isinstance(t, int):
        return t
    args = []
    while True:
        t, last = t
        if isinstance(t, str):  # reached (op, first argument)
            args.append(last)
            return (t, [structure(a) for a in reversed(args)])
        if last != "]":
            args.append(last)


def stats(node, depth=1):
    """(token count, max depth with the root at 1, list of arities) of a structured tree."""
    if isinstance(node, int):
        return 1, depth, []
    _, children = node
    tokens, deepest, arities = 2, depth, [len(children)]
    for child in children:
        n, d, a = stats(child, depth + 1)
        tokens, deepest, arities = tokens + n, max(deepest, d), arities + a
    return tokens, deepest, arities


def read_rows(path: Path) -> list[tuple[str, int]]:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    assert rows[0] == ["Source", "Target"]
    return [(src, int(tgt)) for src, tgt in rows[1:]]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("listops")
    write_listops(out, n_train=60, n_val=20, n_test=20, seed=3)
    return out


# --------------------------------------------------------------------- generated files


def test_files_follow_the_lra_release_format(written: Path) -> None:
    for split, n in (("train", 60), ("val", 20), ("test", 20)):
        path = written / f"basic_{split}.tsv"
        raw = path.read_bytes()
        assert raw.startswith(b"Source\tTarget\r\n")
        lines = raw.decode().split("\r\n")
        assert lines[-1] == "" and len(lines) == n + 2
        for line in lines[1:-1]:
            source, target = line.split("\t")
            assert source.startswith("( ") and source.endswith(" )")
            assert set(source.split()) <= {"(", ")", "]", *OPS, *map(str, range(10))}
            assert target in tuple(map(str, range(10)))


def test_labels_agree_with_an_independent_evaluator(written: Path) -> None:
    for split in ("train", "val", "test"):
        for source, label in read_rows(written / f"basic_{split}.tsv"):
            tree = parse_tree(source)
            assert to_string(tree) == source  # exactly LRA's rendering of that tree
            assert to_value(tree) == label
            assert evaluate_listops(source) == label


def test_lengths_depths_and_arities_respect_the_spec(written: Path) -> None:
    all_arities = []
    for split in ("train", "val", "test"):
        for source, _ in read_rows(written / f"basic_{split}.tsv"):
            tokens, depth, arities = stats(structure(parse_tree(source)))
            assert tokens == len(tokenize_listops(source))
            assert 500 < tokens < 2000
            assert depth <= 10
            assert all(2 <= a <= 10 for a in arities)
            all_arities += arities
    assert min(all_arities) == 2 and max(all_arities) == 10


def test_rows_are_distinct_across_all_files(written: Path) -> None:
    sources = [
        s
        for split in ("train", "val", "test")
        for s, _ in read_rows(written / f"basic_{split}.tsv")
    ]
    assert len(sources) == 100 == len(set(sources))


def test_duplicates_are_dropped_when_the_bounds_allow_few_trees() -> None:
    # Lengths 3..4 admit only the 4 * 10 * 10 two-argument flat expressions.
    rows = list(generate_listops(400, min_length=2, max_length=5, seed=0))
    assert len({s for s, _ in rows}) == 400
    with pytest.raises(ValueError, match="distinct"):
        list(generate_listops(401, min_length=2, max_length=5, seed=0))


def test_same_seed_same_files_other_seed_other_files(tmp_path: Path) -> None:
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        write_listops(tmp_path / name, 5, 2, 2, min_length=20, max_length=200, seed=seed)
    for split in ("train", "val", "test"):
        a, b, c = ((tmp_path / d / f"basic_{split}.tsv").read_bytes() for d in "abc")
        assert a == b
        assert a != c


def test_failed_writes_leave_no_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_length"):
        write_listops(tmp_path / "bad", 1, 1, 1, min_length=10, max_length=11)
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ValueError, match="distinct"):
        write_listops(tmp_path / "few", 300, 100, 1, min_length=2, max_length=5)
    assert list((tmp_path / "few").iterdir()) == []


def test_bounds_are_configurable_and_validated() -> None:
    rows = list(generate_listops(50, min_length=10, max_length=40, seed=1))
    lengths = [len(tokenize_listops(s)) for s, _ in rows]
    assert all(10 < n < 40 for n in lengths)
    with pytest.raises(ValueError, match="max_length"):
        list(generate_listops(1, min_length=10, max_length=11))
    with pytest.raises(ValueError, match="max_length must be an int >= 0, got '30'"):
        generate_listops(1, max_length="30")


def _lra_generate(rng: random.Random, max_length: int, depth: int = 1):
    """LRA's generate_tree (plain recursion), abandoned once it cannot fit ``max_length``."""
    if depth < 10 and rng.random() <= 0.25:
        length, values = 2, []
        for _ in range(rng.randint(2, 10)):
            sub, n = _lra_generate(rng, max_length, depth + 1)
            values.append(sub)
            length += n
            if length >= max_length:
                raise OverflowError
        t = (rng.choice(OPS), values[0])
        for v in values[1:]:
            t = (t, v)
        return (t, "]"), length
    return rng.choice(range(10)), 1


def test_distribution_matches_lras_generator() -> None:
    """Length, depth, arity and label statistics agree with LRA's recursive generator."""
    lo, hi, n = 20, 120, 1500

    def summary(tree) -> list[float]:
        tokens, depth, arities = stats(structure(tree))
        return [tokens, depth, np.mean(arities), to_value(tree)]

    rng = random.Random(0)
    reference = []
    while len(reference) < n:
        try:
            tree, length = _lra_generate(rng, hi)
        except OverflowError:
            continue
        if lo < length < hi:
            reference.append(summary(tree))
    ours = [summary(parse_tree(s)) for s, _ in generate_listops(n, lo, hi, seed=0)]
    ref, our = np.array(reference), np.array(ours)
    z = (ref[:, :3].mean(0) - our[:, :3].mean(0)) / np.sqrt(
        (ref[:, :3].var(0) + our[:, :3].var(0)) / n
    )
    assert np.all(np.abs(z) < 4), z
    ref_labels = np.bincount(ref[:, 3].astype(int), minlength=10) / n
    our_labels = np.bincount(our[:, 3].astype(int), minlength=10) / n
    assert np.abs(ref_labels - our_labels).max() < 0.05


# --------------------------------------------------------------------- evaluator


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("[MIN 4 2 7 ]", 2),
        ("[MAX 4 2 7 ]", 7),
        ("[MED 1 2 ]", 1),
        ("[MED 3 4 5 6 ]", 4),
        ("[MED 9 0 5 ]", 5),
        ("[SM 9 9 9 ]", 7),
        ("[MAX 2 [MIN 8 [SM 5 6 ] ] 0 ]", 2),
        ("7", 7),
    ],
)
def test_evaluator_on_known_expressions(expr: str, value: int) -> None:
    assert evaluate_listops(expr) == value


@pytest.mark.parametrize("expr", ["[MAX 2 3", "[MAX 2 ] ]", "[FOO 1 2 ]", "[MIN ]", "1 2"])
def test_evaluator_rejects_malformed_expressions(expr: str) -> None:
    with pytest.raises(ValueError):
        evaluate_listops(expr)


# --------------------------------------------------------------------- loader


def test_loader_tokenizes_like_lra(written: Path) -> None:
    ds = load_task("listops", written, "val")
    assert isinstance(ds, ListOpsTask)
    assert (ds.vocab_size, ds.num_classes, ds.max_length, ds.pad_id, ds.pairs) == (
        16,
        10,
        2000,
        0,
        False,
    )
    rows = read_rows(written / "basic_val.tsv")
    assert len(ds) == len(rows)
    for i in (0, len(ds) - 1):
        item = ds[i]
        tokens = rows[i][0].replace("(", "").replace(")", "").split()
        n = len(tokens)
        assert item["input_ids"].shape == (2000,) and item["input_ids"].dtype == torch.long
        assert [VOCAB[t] for t in item["input_ids"][:n].tolist()] == tokens
        assert item["mask"][:n].all() and not item["mask"][n:].any()
        assert (item["input_ids"][n:] == 0).all()
        assert item["label"].item() == rows[i][1]


def test_loader_drops_closing_brackets_as_lras_released_tokenizer(written: Path) -> None:
    """LRA's released pipeline keeps alphanumerics only: no ``]`` (nor ``[``, kept here on the
    operators' tokens, whose ids are the same), dropped before truncation."""
    plain = ListOpsTask(written, "val")
    lra = ListOpsTask(written, "val", closing_brackets=False)
    short = ListOpsTask(written, "val", max_length=7, closing_brackets=False)
    end = VOCAB.index("]")
    for i in range(len(plain)):
        ids = plain[i]["input_ids"][plain[i]["mask"]]
        kept = ids[ids != end]
        n = len(kept)
        assert torch.equal(lra[i]["input_ids"][:n], kept) and lra[i]["mask"].sum() == n
        assert torch.equal(short[i]["input_ids"], kept[:7]) and lra[i]["label"] == plain[i]["label"]
    with pytest.raises(TypeError, match="closing_brackets"):
        ListOpsTask(written, "val", closing_brackets="no")


def test_loader_truncates_to_max_length(written: Path) -> None:
    ds = ListOpsTask(written, "test", max_length=100)
    item = ds[0]
    assert item["input_ids"].shape == (100,) and item["mask"].all()


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("content", "line", "match"),
    [
        ("Source\tLabel\n( [MIN 1 ) 2 ) ] )\t1\n", 1, "header"),
        (
            "Source\tTarget\n( ( ( [MIN 1 ) 2 ) ] )\t1\n( ( ( [MIN 1 ) 2 ) ] )\t1\textra\n",
            3,
            "columns",
        ),
        ("Source\tTarget\n( ( ( [MIN 1 ) 2 ) ] )\tx\n", 2, "label"),
        ("Source\tTarget\n( ( ( [MIN 1 ) 2 ) ] )\t12\n", 2, "label"),
        ("Source\tTarget\n( ( ( [MIN 1 ) 2 ) ] )\t\u00b2\n", 2, "bad label"),  # superscript 2
        ("Source\tTarget\n( ( ( [MIN 1 ) 2 ) ] )\t\u0663\n", 2, "bad label"),  # Arabic-Indic 3
        ("Source\tTarget\n( ( ( [MIN 1 ) 2 ) ] )\t1\n( ( ( [ABS 1 ) 2 ) ] )\t1\n", 3, "token"),
        ("Source\tTarget\n( ( ( [MIN 1 ) 2 ) ] )\n", 2, "columns"),
    ],
)
def test_loader_rejects_malformed_files(
    tmp_path: Path, content: str, line: int, match: str
) -> None:
    path = _write(tmp_path / "basic_train.tsv", content)
    with pytest.raises(ValueError, match=match) as err:
        ListOpsTask(tmp_path, "train")
    assert str(path) in str(err.value) and f"line {line}" in str(err.value)


def test_loader_reports_missing_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="basic_val.tsv"):
        ListOpsTask(tmp_path, "val")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ListOpsTask(tmp_path / "nowhere", "val")


def test_loader_rejects_non_utf8_and_header_only_files(tmp_path: Path) -> None:
    path = tmp_path / "basic_train.tsv"
    path.write_bytes(b"Source\tTarget\n( ( [MIN 1 ) 2 ] )\t1\n( ( [MAX 1 ) \xff ] )\t2\n")
    with pytest.raises(ValueError, match="not UTF-8") as err:
        ListOpsTask(tmp_path, "train")
    assert f"{path}, line 3" in str(err.value) and "0xff" in str(err.value)
    path.write_text("Source\tTarget\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no rows") as err:
        ListOpsTask(tmp_path, "train")
    assert f"{path}, line 2" in str(err.value)


def test_max_depth_bounds_the_written_trees(tmp_path: Path) -> None:
    write_listops(tmp_path, 60, 5, 5, min_length=5, max_length=60, seed=1, max_depth=3)
    depths = []
    for source, value in read_rows(tmp_path / "basic_train.tsv"):
        tokens, depth, _ = stats(structure(parse_tree(source)))
        assert 5 < tokens < 60 and evaluate_listops(source) == value
        depths.append(depth)
    assert max(depths) == 3  # digits at depth 3 under operators at depths 1 and 2


def test_two_writers_to_one_folder_both_finish(tmp_path: Path) -> None:
    """Both wrote fixed-name .partial files and the first to finish deleted the other's:
    two searches preparing the same data crashed one of them (FileNotFoundError)."""
    import os
    import threading

    out = tmp_path / "data"
    out.mkdir()
    other = out / "basic_train.tsv.partial"  # e.g. another writer's file in progress
    other.write_text("not mine")
    start, errors = threading.Barrier(2), []

    def write() -> None:
        start.wait()
        try:
            write_listops(out, 1500, 200, 200, min_length=5, max_length=60, overwrite=True)
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    threads = [threading.Thread(target=write) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert other.read_text() == "not mine"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["basic_train.tsv", "basic_val.tsv", "basic_test.tsv", other.name]
    )
    assert len(ListOpsTask(out, "train", max_length=100)) == 1500
    mask = os.umask(0)
    os.umask(mask)
    assert (out / "basic_val.tsv").stat().st_mode & 0o777 == 0o666 & ~mask


def test_loader_finds_the_files_under_the_release_directory(written: Path, tmp_path: Path) -> None:
    """The release unpacks to lra_release/listops-1000/: the directory holding it worked for
    retrieval (lra_release/tsv_data) but not for ListOps."""
    folder = tmp_path / "lra_release" / "listops-1000"
    folder.mkdir(parents=True)
    (folder / "basic_val.tsv").write_bytes((written / "basic_val.tsv").read_bytes())
    for path in (tmp_path, tmp_path / "lra_release", folder):
        assert (
            ListOpsTask(path, "val").labels.tolist() == ListOpsTask(written, "val").labels.tolist()
        )


def test_evaluator_and_tokenizer_refuse_other_types() -> None:
    """``evaluate_listops(5)`` failed as "'int' object is not iterable" and
    ``tokenize_listops(None)`` with an AttributeError."""
    with pytest.raises(TypeError, match="source must be a str or a list or tuple of tokens"):
        evaluate_listops(5)
    with pytest.raises(TypeError, match=r"source must be a str \(a ListOps Source\), got None"):
        tokenize_listops(None)
    assert evaluate_listops(("[SM", "7", "5", "]")) == 2 == evaluate_listops("[SM 7 5 ]")
    with pytest.raises(TypeError, match="source's tokens must be str"):  # failed on len(1)
        evaluate_listops(["[MAX", 1, 2, "]"])


def test_files_of_a_killed_writer_are_removed_and_a_live_writers_kept(tmp_path: Path) -> None:
    """A writer killed mid-write (SIGKILL: no clean-up) left its .partial files for good;
    they are told from a live writer's by its lock and removed by the next writer."""
    import fcntl
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "data"
    child = subprocess.Popen(  # writes for a minute or more: killed mid-write
        [
            sys.executable,
            "-c",
            f"from kernelstudy.tasks import write_listops; "
            f"write_listops({str(out)!r}, 10**6, 1, 1, min_length=5, max_length=60)",
        ]
    )
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob(".basic_*.partial")) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    killed = list(out.glob(".basic_*.partial"))
    assert killed, "the writer made no .partial file in two minutes"
    live = out / ".basic_train.0123456789abcdef.partial"  # another writer's, in progress
    fresh = out / ".basic_val.fedcba9876543210.partial"  # just made, not locked yet
    live.write_text("")
    fresh.write_text("")
    for path in [*killed, live]:
        os.utime(path, (time.time() - 600, time.time() - 600))
    with open(live, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        write_listops(out, 20, 5, 5, min_length=5, max_length=60, overwrite=True)
        left = sorted(p.name for p in out.iterdir())
    assert left == sorted(
        ["basic_train.tsv", "basic_val.tsv", "basic_test.tsv", live.name, fresh.name]
    )


def test_a_writer_without_overwrite_does_not_replace_files_that_appear_meanwhile(
    tmp_path, monkeypatch
):
    """Existing files were checked for once, before generating (minutes at full size): two
    `kernelstudy data listops` runs started together both succeeded, and the later one
    silently replaced the other's files. Now a file that appeared meanwhile is refused and
    this call's own files already in place are taken away again."""
    from kernelstudy.tasks import listops

    out = tmp_path / "data"
    real = listops.generate_listops

    def other_writer_finishes_first(*args, **kwargs):
        out.mkdir(parents=True, exist_ok=True)
        (out / "basic_val.tsv").write_text("the other writer's\n")
        yield from real(*args, **kwargs)

    monkeypatch.setattr(listops, "generate_listops", other_writer_finishes_first)
    with pytest.raises(FileExistsError, match=r"basic_val\.tsv appeared while this call wrote"):
        write_listops(out, 20, 5, 5, min_length=5, max_length=60)
    assert sorted(p.name for p in out.iterdir()) == ["basic_val.tsv"]
    assert (out / "basic_val.tsv").read_text() == "the other writer's\n"
    monkeypatch.undo()
    (out / "basic_val.tsv").unlink()
    paths = write_listops(out, 20, 5, 5, min_length=5, max_length=60)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in paths.values())


def test_a_full_disk_while_writing_names_the_file(tmp_path, monkeypatch):
    """The .partial files were written by csv.writer on a plain file: a full disk or a file
    size limit said only "[Errno 27] File too large", naming no file."""
    import errno

    from kernelstudy.tasks import listops

    class Full:
        def writerow(self, row):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(listops.csv, "writer", lambda f, **kw: Full())
    with pytest.raises(OSError, match=r"No space left on device: '.*basic_train\.tsv'"):
        write_listops(tmp_path / "data", 20, 5, 5, min_length=5, max_length=60)
    assert list((tmp_path / "data").iterdir()) == []  # nothing left behind


def test_write_listops_without_hard_links(tmp_path, monkeypatch):
    """A platform without ``os.link`` (the except caught OSError, not the AttributeError)
    places the files as on a file system without hard links, refusing to replace any."""
    monkeypatch.delattr(os, "link")
    small = {"n_train": 4, "n_val": 2, "n_test": 2, "min_length": 5, "max_length": 30}
    paths = write_listops(tmp_path, **small)
    assert sorted(p.name for p in paths.values()) == sorted(
        ["basic_train.tsv", "basic_val.tsv", "basic_test.tsv"]
    )
    with pytest.raises(FileExistsError):
        write_listops(tmp_path, **small)
