"""LRA loaders on tiny files written in the release formats, and their errors on malformed ones."""

from __future__ import annotations

import os
import pickle
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from kernelstudy.tasks import (
    ImageTask,
    PackedSequences,
    PathfinderTask,
    RetrievalTask,
    TextTask,
    load_task,
    rgb_to_gray,
)
from kernelstudy.tasks.pathfinder import read_metadata

from .test_tasks_png import encode_png


def assert_error(err: pytest.ExceptionInfo, path: Path, line: int | None = None) -> None:
    message = str(err.value)
    assert str(path) in message, message
    if line is not None:
        assert f"line {line}" in message, message


# --------------------------------------------------------------------- text


REVIEWS = {
    ("train", "pos"): [b"A fine film.", "Tr\u00e8s bien \u2014 loved it".encode()],
    ("train", "neg"): [b"Dull.<br /><br />Skip it.", b"No."],
    ("test", "pos"): [b"Great"],
    ("test", "neg"): [b"Bad"],
}


@pytest.fixture
def imdb(tmp_path: Path) -> Path:
    for (split, polarity), texts in REVIEWS.items():
        folder = tmp_path / "aclImdb" / split / polarity
        folder.mkdir(parents=True)
        for i, text in enumerate(texts):
            (folder / f"{i}_{7 + i}.txt").write_bytes(text)
    (tmp_path / "aclImdb" / "train" / "urls_pos.txt").write_text("not a review")
    return tmp_path


def decode_bytes(item: dict[str, torch.Tensor]) -> bytes:
    ids = item["input_ids"][item["mask"]]
    return bytes((ids - 1).tolist())


def test_imdb_directory(imdb: Path) -> None:
    ds = load_task("text", imdb, "train")
    assert (ds.vocab_size, ds.num_classes, ds.max_length, ds.pad_id, ds.pairs) == (
        257,
        2,
        4000,
        0,
        False,
    )
    got = sorted((decode_bytes(ds[i]), ds[i]["label"].item()) for i in range(len(ds)))
    want = sorted(
        [(t, 1) for t in REVIEWS["train", "pos"]] + [(t, 0) for t in REVIEWS["train", "neg"]]
    )
    assert got == want
    item = ds[0]
    n = int(item["mask"].sum())
    assert item["input_ids"].shape == (4000,) and (item["input_ids"][n:] == 0).all()
    # IMDB has no validation split: LRA validates on the test set.
    val = TextTask(imdb / "aclImdb", "val", max_length=3)
    assert sorted(decode_bytes(val[i]) for i in range(len(val))) == [b"Bad", b"Gre"]


def test_imdb_reviews_are_stripped_as_tfds_does(imdb: Path) -> None:
    """TFDS's imdb_reviews (LRA's source) strips each review before the byte cut."""
    (imdb / "aclImdb" / "test" / "pos" / "0_7.txt").write_bytes(b" \n Great\r\n\n")
    ds = TextTask(imdb, "test", max_length=4)
    assert sorted(decode_bytes(ds[i]) for i in range(len(ds))) == [b"Bad", b"Grea"]


def test_imdb_reads_only_review_files(imdb: Path) -> None:
    """glob("*.txt") took macOS's hidden '._' copies (written on FAT, exFAT and SMB) as
    reviews of the folder's label: half the items were resource-fork bytes."""
    pos = imdb / "aclImdb" / "test" / "pos"
    (pos / "._0_7.txt").write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X")
    with pytest.warns(UserWarning, match=r"skipped 1 file.*'\._0_7\.txt'"):
        ds = TextTask(imdb, "test")
    assert sorted(decode_bytes(ds[i]) for i in range(len(ds))) == [b"Bad", b"Great"]
    (pos / "0_7.txt").unlink()
    with pytest.raises(FileNotFoundError, match="no <id>_<rating>.txt reviews"):
        TextTask(imdb, "test")


def test_imdb_missing_directories(imdb: Path, tmp_path: Path) -> None:
    for f in (imdb / "aclImdb" / "test" / "neg").iterdir():
        f.unlink()
    (imdb / "aclImdb" / "test" / "neg").rmdir()
    with pytest.raises(FileNotFoundError, match="neg"):
        TextTask(imdb, "test")
    with pytest.raises(FileNotFoundError):
        TextTask(tmp_path / "missing", "train")
    with pytest.raises(FileNotFoundError, match="no text data"):
        TextTask(tmp_path / "aclImdb" / "train" / "pos", "train")


def test_text_tables(tmp_path: Path) -> None:
    (tmp_path / "train.csv").write_text('text,label\n"Hello, world",1\nplain,0\n', encoding="utf-8")
    (tmp_path / "test.tsv").write_text("label\ttext\n0\tsome\ttext?\n", encoding="utf-8")
    ds = TextTask(tmp_path, "train")
    assert [decode_bytes(ds[i]) for i in range(2)] == [b"Hello, world", b"plain"]
    assert ds.labels.tolist() == [1, 0]
    with pytest.raises(ValueError, match="columns") as err:
        TextTask(tmp_path, "test")
    assert_error(err, tmp_path / "test.tsv", 2)
    (tmp_path / "test.tsv").write_text("Source\tTarget\nsome text\t1\n", encoding="utf-8")
    with pytest.warns(UserWarning, match=r"no val\.tsv or val\.csv"):  # val falls back to test
        assert decode_bytes(TextTask(tmp_path, "val")[0]) == b"some text"
    with pytest.warns(UserWarning, match="'test' holds the same rows as 'train'"):
        single = TextTask(tmp_path / "train.csv", "test")  # a file is used for any split
    assert len(single) == 2
    # a byte-order mark (a spreadsheet's UTF-8 export) is not part of the header
    (tmp_path / "bom.csv").write_text("\ufefftext,label\nplain,0\n", encoding="utf-8")
    assert decode_bytes(TextTask(tmp_path / "bom.csv", "train")[0]) == b"plain"


def test_a_tsv_text_is_one_row_per_line_with_quotes_as_text(tmp_path: Path) -> None:
    """A TSV row whose text opened with a quote swallowed the rows after it up to the next
    quote (csv quoting), with the wrong label and no error. TSVs are read as LRA writes
    them: one row per line, split at tabs, quotes kept."""
    rows = ['"Best film ever\t1', "Awful.\t0", 'Boring, "meh" he said\t0', "Loved it\t1"]
    (tmp_path / "train.tsv").write_text("text\tlabel\n" + "\n".join(rows) + "\n")
    ds = TextTask(tmp_path, "train")
    assert [decode_bytes(ds[i]) for i in range(len(ds))] == [
        b'"Best film ever',
        b"Awful.",
        b'Boring, "meh" he said',
        b"Loved it",
    ]
    assert ds.labels.tolist() == [1, 0, 0, 1]
    (tmp_path / "train.tsv").write_text("text\tlabel\na\ttab\t1\n")  # says what to do
    with pytest.raises(ValueError, match="got 3 .*write texts that hold tabs or newlines to a CSV"):
        TextTask(tmp_path, "train")
    # a CSV keeps csv quoting: a quoted field may hold the delimiter and doubled quotes
    (tmp_path / "train.tsv").unlink()
    (tmp_path / "train.csv").write_text('text,label\n"say ""hi"", then go",1\n')
    assert decode_bytes(TextTask(tmp_path, "train")[0]) == b'say "hi", then go'


@pytest.mark.parametrize(
    ("content", "line", "match"),
    [
        ("words,label\nx,1\n", 1, "header"),
        ("text,label\nx,1\ny,2\n", 3, "label"),
        ("text,label\nx,1\ny,one\n", 3, "label"),
        ("text,label\nx,1\ny,\u0661\n", 3, "label"),  # an Arabic-Indic 1, which int() takes
        ("text,label\nx,1\ny,0_1\n", 3, "label"),  # int() reads "0_1" as 1
        ('text,label\n"multi\nline",1\nz,1,extra\n', 4, "columns"),
        ("text,label\n", 2, "no rows"),
    ],
)
def test_text_table_errors(tmp_path: Path, content: str, line: int, match: str) -> None:
    path = tmp_path / "train.csv"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=match) as err:
        TextTask(path)
    assert_error(err, path, line)


# --------------------------------------------------------------------- retrieval


def write_aan(folder: Path, rows: list[str], split: str = "train") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"new_aan_pairs.{split}.tsv"
    path.write_bytes("".join(row + "\n" for row in rows).encode())
    return path


def test_retrieval_pairs(tmp_path: Path) -> None:
    rows = ['1.0\tP01-1\tP02-2\tFirst "doc" text\tSecond doc', "0\tA\tB\tx\tLong document " * 1]
    write_aan(tmp_path / "tsv_data", rows, "eval")
    ds = load_task("retrieval", tmp_path, "val", max_length=12)
    assert ds.pairs and (ds.vocab_size, ds.num_classes, ds.max_length) == (257, 2, 12)
    item = ds[0]
    assert set(item) == {"input_ids_1", "mask_1", "input_ids_2", "mask_2", "label"}
    assert bytes((item["input_ids_1"][item["mask_1"]] - 1).tolist()) == b'First "doc" '
    assert bytes((item["input_ids_2"][item["mask_2"]] - 1).tolist()) == b"Second doc"
    assert item["mask_2"].sum() == 10 and (item["input_ids_2"][10:] == 0).all()
    assert ds.labels.tolist() == [1, 0]


def test_negative_indices_give_the_sequence_of_their_label(imdb: Path, tmp_path: Path) -> None:
    """Packed sequences used to read ``ds[-1]`` as an empty sequence and ``ds[-k]``
    as the sequence after the one its label belongs to."""
    text = TextTask(imdb, "train")
    rows = ["1\ta\tb\tfirst\tuno", "0\tc\td\tsecond\tdos", "1\te\tf\tthird\ttres"]
    write_aan(tmp_path / "tsv_data", rows)
    pairs = RetrievalTask(tmp_path, "train")
    for ds in (text, pairs):
        n = len(ds)
        for k in range(1, n + 1):
            a, b = ds[-k], ds[n - k]
            assert all(torch.equal(a[key], b[key]) for key in a), (type(ds).__name__, k)
        for bad in (n, -n - 1):
            with pytest.raises(IndexError, match=f"index {bad} is out of range for {n}"):
                ds[bad]
    packed = PackedSequences([b"ab", b"", b"c"])
    assert [packed[i].tobytes() for i in (-1, -2, -3)] == [b"c", b"", b"ab"]
    assert packed[np.int64(0)].tobytes() == b"ab"


@pytest.mark.parametrize(
    ("rows", "line", "match"),
    [
        (["1\ta\tb\tx\ty", "0\ta\tb\tx"], 2, "5 tab-separated columns"),
        (["1\ta\tb\tx\ty", "0\ta\tb\tx\ty\tz"], 2, "5 tab-separated columns"),
        (["2\ta\tb\tx\ty"], 1, "label"),
        (["yes\ta\tb\tx\ty"], 1, "label"),
    ],
)
def test_retrieval_errors(tmp_path: Path, rows: list[str], line: int, match: str) -> None:
    path = write_aan(tmp_path, rows)
    with pytest.raises(ValueError, match=match) as err:
        RetrievalTask(tmp_path, "train")
    assert_error(err, path, line)


def test_retrieval_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="new_aan_pairs.test.tsv"):
        RetrievalTask(tmp_path, "test")


# --------------------------------------------------------------------- image


def write_cifar(folder: Path, n: int = 4, protocol: int = 2) -> dict[str, tuple[np.ndarray, list]]:
    """Batches like the release: dicts with bytes keys, data (n, 3072) uint8, labels list."""
    rng = np.random.default_rng(1)
    folder.mkdir(parents=True)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, n).tolist()
        batch = {b"batch_label": name.encode(), b"labels": labels, b"data": data, b"filenames": []}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=protocol)
        batches[name] = (data, labels)
    return batches


def reference_gray(data: np.ndarray) -> np.ndarray:
    rgb = data.reshape(-1, 3, 1024).astype(np.float64) / 255
    gray = 0.2989 * rgb[:, 0] + 0.5870 * rgb[:, 1] + 0.1140 * rgb[:, 2]
    return np.floor(gray * 255.5)


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_cifar_batches(tmp_path: Path, protocol: int) -> None:
    batches = write_cifar(tmp_path / "cifar-10-batches-py", protocol=protocol)
    train = load_task("image", tmp_path, "train")
    val = ImageTask(tmp_path / "cifar-10-batches-py", "val")
    test = ImageTask(tmp_path, "test")
    assert (len(train), len(val), len(test)) == (18, 2, 4)
    assert (train.vocab_size, train.num_classes, train.max_length, train.pad_id) == (
        257,
        10,
        1024,
        256,
    )
    all_data = np.concatenate([batches[f"data_batch_{i}"][0] for i in range(1, 6)])
    all_labels = sum((batches[f"data_batch_{i}"][1] for i in range(1, 6)), [])
    item = val[1]
    assert item["input_ids"].shape == (1024,) and item["mask"].all()
    assert item["label"].item() == all_labels[19]
    diff = item["input_ids"].numpy() - reference_gray(all_data[19:20])[0]
    assert np.abs(diff).max() <= 1  # float32 vs float64 rounding at most
    assert 0 <= train[0]["input_ids"].min() and train[0]["input_ids"].max() <= 255
    np.testing.assert_array_equal(
        test[3]["input_ids"].numpy(), rgb_to_gray(batches["test_batch"][0][3].reshape(3, 1024), 0)
    )


def test_pixels_of_value_zero_may_be_padding_as_in_lra(tmp_path: Path) -> None:
    """LRA's encoders mask pixels of value 0 (``inputs > 0``): on Pathfinder's black background
    most of the image. ``zero_is_padding`` does so; by default every pixel is real."""
    write_cifar(tmp_path / "cifar-10-batches-py")
    write_pathfinder(tmp_path / "pf")
    for task, path in (("image", tmp_path), ("pathfinder", tmp_path / "pf")):
        plain = load_task(task, path, "test")
        lra = load_task(task, path, "test", zero_is_padding=True)
        for i in range(len(plain)):
            ids = plain[i]["input_ids"]
            assert plain[i]["mask"].all()
            assert torch.equal(lra[i]["mask"], ids > 0) and torch.equal(lra[i]["input_ids"], ids)
        with pytest.raises(TypeError, match="zero_is_padding"):
            load_task(task, path, "test", zero_is_padding="yes")
    assert (load_task("pathfinder", tmp_path / "pf", "test", zero_is_padding=True)[0]["mask"]
            .logical_not().any())  # fmt: skip


def test_gray_conversion_known_values() -> None:
    rgb = np.array(
        [[255, 255, 255], [0, 0, 0], [255, 0, 0], [0, 255, 0], [0, 0, 255]], dtype=np.uint8
    )
    assert rgb_to_gray(rgb).tolist() == [255, 0, 76, 149, 29]


def test_gray_of_a_pixel_does_not_depend_on_the_array_shape() -> None:
    """TF's formula in float32 (times 1/255, r, g, b summed in order, floor of ×255.5):
    (5, 171, 227) is 128 alone and used to be 127 inside a batch of 64."""
    rng = np.random.default_rng(0)
    pixels = np.concatenate([[[5, 171, 227], [13, 219, 204]], rng.integers(0, 256, (998, 3))])
    pixels = pixels.astype(np.uint8)
    s = pixels.astype(np.float32) * np.float32(1 / 255)
    w = np.array([0.2989, 0.5870, 0.1140], np.float32)
    want = np.floor((s[:, 0] * w[0] + s[:, 1] * w[1] + s[:, 2] * w[2]) * np.float32(255.5))
    batched = rgb_to_gray(pixels)
    np.testing.assert_array_equal(batched, want.astype(np.uint8))
    assert batched[:2].tolist() == [128, 156]
    for size in (1, 7, 64):
        alone = [rgb_to_gray(np.tile(p, (size, 1)))[0] for p in pixels]
        np.testing.assert_array_equal(alone, batched)


def test_cifar_errors(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar(folder)
    good = (folder / "data_batch_3").read_bytes()
    (folder / "data_batch_3").write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match="pickle") as err:
        ImageTask(folder, "train")
    assert_error(err, folder / "data_batch_3")
    assert len(ImageTask(folder, "test")) == 4  # the test batch is fine

    with open(folder / "data_batch_3", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, f, protocol=2)
    with pytest.raises(ValueError, match="3072"):
        ImageTask(folder, "train")

    with open(folder / "data_batch_3", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, f, protocol=2)
    with pytest.raises(ValueError, match="label 10"):
        ImageTask(folder, "train")

    class Evil:
        def __reduce__(self):
            return (print, ("should never run",))

    with open(folder / "data_batch_3", "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": []}, f)
    with pytest.raises(ValueError, match="refusing"):
        ImageTask(folder, "train")

    (folder / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_3"):
        ImageTask(folder, "train")
    with pytest.raises(FileNotFoundError):
        ImageTask(tmp_path / "nothing", "train")


# --------------------------------------------------------------------- pathfinder


def write_pathfinder(
    root: Path, n_files: int = 2, per_file: int = 10, resolution: int = 32
) -> dict[str, np.ndarray]:
    """pathfinder<resolution>/curv_contour_length_14 with metadata/<i>.npy text files and
    imgs/<i>/sample_<k>.png."""
    rng = np.random.default_rng(2)
    base = root / f"pathfinder{resolution}" / "curv_contour_length_14"
    (base / "metadata").mkdir(parents=True)
    images = {}
    for i in range(n_files):
        (base / "imgs" / str(i)).mkdir(parents=True)
        lines = []
        for k in range(per_file):
            pixels = rng.integers(0, 256, (resolution, resolution), dtype=np.uint8)
            name = f"sample_{k}.png"
            (base / "imgs" / str(i) / name).write_bytes(encode_png(pixels, filters=(k % 5, 4, 1)))
            label = int(rng.integers(0, 2))
            lines.append(f"imgs/{i} {name} {k} {label} 1.8 6 2.0 5 2\n")
            images[f"imgs/{i}/{name}"] = (pixels, label)
        (base / "metadata" / f"{i}.npy").write_text("".join(lines))
    return images


def test_pathfinder(tmp_path: Path) -> None:
    """The default difficulty is LRA's (its pathfinder32_hard task): curv_contour_length_14."""
    images = write_pathfinder(tmp_path)
    splits = {s: load_task("pathfinder", tmp_path, s) for s in ("train", "val", "test")}
    assert [len(splits[s]) for s in ("train", "val", "test")] == [16, 2, 2]
    seen = []
    for ds in splits.values():
        assert (ds.vocab_size, ds.num_classes, ds.max_length, ds.pad_id) == (257, 2, 1024, 256)
        for i in range(len(ds)):
            key = ds.images[i].relative_to(ds.root).as_posix()
            pixels, label = images[key]
            item = ds[i]
            np.testing.assert_array_equal(item["input_ids"].numpy(), pixels.reshape(-1))
            assert item["label"].item() == label and item["mask"].all()
            seen.append(key)
    assert sorted(seen) == sorted(images)  # the splits partition the samples
    # the difficulty directory itself works too, with the same split
    same = PathfinderTask(tmp_path / "pathfinder32" / "curv_contour_length_14", "val")
    assert same.images == splits["val"].images


def test_pathfinder_keeps_its_paths_in_one_array(tmp_path: Path) -> None:
    """A list of 160,000 Path objects (and origin strings) was copied page by page into every
    DataLoader worker that read it: 105-183 MB a worker each epoch. The paths and origins are
    one bytes array each, read back as Path and str, also after pickling (spawned workers)."""
    import pickle

    write_pathfinder(tmp_path)
    ds = PathfinderTask(tmp_path, "train")
    for column in (ds.images, ds.origins):
        assert not isinstance(column, list) and column._bytes.dtype.kind == "S"
    listed = [ds.images[i] for i in range(len(ds))]
    assert all(isinstance(p, Path) and p.is_file() for p in listed)
    assert list(ds.images) == listed and ds.images[1:3] == listed[1:3]
    assert all(isinstance(o, str) and ", line " in o for o in ds.origins)
    again = pickle.loads(pickle.dumps(ds))
    assert again.images == ds.images and torch.equal(again[0]["input_ids"], ds[0]["input_ids"])


def test_pathfinder_reads_metadata_naming_an_image_folder_elsewhere(tmp_path: Path) -> None:
    """A metadata line whose folder is absolute (images kept on another disk) was read; storing
    the paths relative to the root refused it ('is not in the subpath')."""
    images = write_pathfinder(tmp_path / "a")
    base = tmp_path / "a" / "pathfinder32" / "curv_contour_length_14"
    elsewhere = tmp_path / "elsewhere"
    (base / "imgs").rename(elsewhere)
    for meta in (base / "metadata").glob("*.npy"):
        lines = meta.read_text().splitlines()
        moved = [f"{elsewhere}/{line.split(' ', 1)[0][len('imgs/'):]} {line.split(' ', 1)[1]}"
                 for line in lines]  # fmt: skip
        meta.write_text("\n".join(moved) + "\n")
    splits = [PathfinderTask(tmp_path / "a", s) for s in ("train", "val", "test")]
    assert sum(len(ds) for ds in splits) == len(images)
    first = splits[0].images[0]
    assert first.is_file() and first.resolve().is_relative_to(elsewhere.resolve())
    splits[0][0]  # decodes


def test_pathfinder_leaves_out_empty_images_as_lra_does(tmp_path: Path) -> None:
    """The published curv_baseline lists an empty imgs/0/sample_172.png; LRA filters it."""
    images = write_pathfinder(tmp_path, n_files=1, per_file=20)
    base = tmp_path / "pathfinder32" / "curv_contour_length_14"
    (base / "imgs" / "0" / "sample_7.png").write_bytes(b"")
    with pytest.warns(UserWarning, match="left out 1 sample.*sample_7.png"):
        splits = [PathfinderTask(tmp_path, s) for s in ("train", "val", "test")]
    assert sum(len(ds) for ds in splits) == len(images) - 1
    for ds in splits:
        assert all(ds.images[i].name != "sample_7.png" for i in range(len(ds)))
        for i in range(len(ds)):
            ds[i]  # every sample left in decodes


def test_pathfinder_warns_of_an_image_listed_twice(tmp_path: Path) -> None:
    """A copy of a metadata file left in metadata/ listed every sample twice, silently: the
    seeded split then put the same images in train and test."""
    images = write_pathfinder(tmp_path, n_files=1, per_file=20)
    meta = tmp_path / "pathfinder32" / "curv_contour_length_14" / "metadata"
    (meta / "0 - copy.npy").write_bytes((meta / "0.npy").read_bytes())
    with pytest.warns(UserWarning, match=r"20 repeated listing\(s\).*sample_0\.png \(.*0\.npy, "
                      r"line 1, and line 1 of .*0 - copy\.npy\);.* \.\.\.$"):  # fmt: skip
        splits = [PathfinderTask(tmp_path, s) for s in ("train", "val", "test")]
    assert sum(len(ds) for ds in splits) == 2 * len(images)  # kept as listed


def test_pathfinder_finds_the_resolution_directory(tmp_path: Path) -> None:
    """lra_release/ holds pathfinder32/, pathfinder64/, ...: the resolution picks one."""
    write_pathfinder(tmp_path, n_files=1, per_file=10)
    write_pathfinder(tmp_path, n_files=1, per_file=10, resolution=64)
    ds = PathfinderTask(tmp_path, "train", resolution=64)
    assert ds.root == tmp_path / "pathfinder64" / "curv_contour_length_14"
    assert ds[0]["input_ids"].shape == (64 * 64,)
    assert (
        PathfinderTask(tmp_path, "train").root
        == tmp_path / "pathfinder32" / "curv_contour_length_14"
    )
    assert PathfinderTask(tmp_path / "pathfinder64", resolution=64).root == ds.root


def test_pathfinder_refuses_a_directory_of_another_difficulty_or_resolution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A difficulty or resolution directory given as the path must match the options:
    it used to be taken whatever ``difficulty`` asked for."""
    write_pathfinder(tmp_path, n_files=1, per_file=10)
    base = tmp_path / "pathfinder32" / "curv_contour_length_14"
    with pytest.raises(ValueError, match="'curv_contour_length_14' directory, but difficulty is"):
        PathfinderTask(base, difficulty="curv_baseline")
    with pytest.raises(ValueError, match="lies in pathfinder32/, but resolution is 64"):
        PathfinderTask(base, resolution=64)
    with pytest.raises(ValueError, match="resolution is 64"):
        PathfinderTask(tmp_path / "pathfinder32", resolution=64)
    monkeypatch.chdir(base)  # "." has no name of its own
    with pytest.raises(ValueError, match="'curv_contour_length_14' directory, but difficulty is"):
        PathfinderTask(".", difficulty="curv_baseline")
    assert PathfinderTask(".").root == Path(".")
    monkeypatch.chdir(tmp_path)
    own = tmp_path / "mine"  # a directory of the user's own naming is taken as it is
    base.rename(own)
    assert PathfinderTask(own, difficulty="curv_contour_length_9").root == own


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("imgs/0 sample_0.png 0\n", "4 space-separated fields"),
        ("imgs/0 sample_0.png 0 2 1.8\n", "label"),
        ("imgs/0 sample_99.png 0 1 1.8\n", "does not exist"),
        # a lost line break: the second record was read as the first's parameters
        ("imgs/0 sample_1.png 1 0 1.8 6 imgs/0 sample_2.png 2 1 1.8\n", "two records on one"),
    ],
)
def test_pathfinder_metadata_errors(tmp_path: Path, line: str, match: str) -> None:
    write_pathfinder(tmp_path, n_files=1, per_file=3)
    meta = tmp_path / "pathfinder32" / "curv_contour_length_14" / "metadata" / "0.npy"
    meta.write_text(meta.read_text() + line)
    with pytest.raises(ValueError, match=match) as err:
        PathfinderTask(tmp_path)
    assert_error(err, meta, 4)


def test_pathfinder_bad_images_and_missing_dirs(tmp_path: Path) -> None:
    write_pathfinder(tmp_path, n_files=1, per_file=10)
    base = tmp_path / "pathfinder32" / "curv_contour_length_14"
    ds = PathfinderTask(tmp_path, "train")
    bad = ds.images[0]
    bad.write_bytes(bad.read_bytes()[:50])
    with pytest.raises(ValueError, match="0.npy") as err:
        ds[0]
    assert_error(err, bad)
    ds.images[1].write_bytes(encode_png(np.zeros((16, 16), np.uint8)))
    with pytest.raises(ValueError, match="expected 32x32"):
        ds[1]
    with pytest.raises(FileNotFoundError, match="metadata"):
        PathfinderTask(tmp_path, difficulty="curv_baseline")
    for f in (base / "metadata").iterdir():
        f.unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.npy"):
        PathfinderTask(tmp_path)


def test_pathfinder_splits_round_to_a_partition(tmp_path: Path) -> None:
    """12 samples split 80/10/10 rounded: 10/1/1, every sample in exactly one split. The
    split ends floored (int(9.6) = 9, int(10.8) = 10) left val empty and a sample in none."""
    images = write_pathfinder(tmp_path, n_files=1, per_file=12)
    splits = {s: PathfinderTask(tmp_path, s) for s in ("train", "val", "test")}
    assert [len(splits[s]) for s in ("train", "val", "test")] == [10, 1, 1]
    keys = [p.relative_to(ds.root).as_posix() for ds in splits.values() for p in ds.images]
    assert sorted(keys) == sorted(images)  # each once: no sample in two splits or in none


def test_pathfinder_rgb_images_are_read_as_gray(tmp_path: Path) -> None:
    """An RGB image is converted to gray, as the module docstring says: a 3-channel image was
    read as its red channel."""
    write_pathfinder(tmp_path, n_files=1, per_file=10)
    ds = PathfinderTask(tmp_path, "train")
    rgb = np.random.default_rng(5).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    ds.images[0].write_bytes(encode_png(rgb, 2))
    got = ds[0]["input_ids"].numpy()
    np.testing.assert_array_equal(got, rgb_to_gray(rgb).reshape(-1))
    assert not np.array_equal(got, rgb[..., 0].reshape(-1))


def test_pathfinder_metadata_files_are_read_in_numeric_order(tmp_path: Path) -> None:
    """metadata/0.npy ... 10.npy are read 0, 1, ..., 10 (the split's permutation indexes this
    order): sorted by name, 10.npy came before 2.npy."""
    write_pathfinder(tmp_path, n_files=11, per_file=1)
    root = tmp_path / "pathfinder32" / "curv_contour_length_14"
    images, _, origins = read_metadata(root)
    assert [p.relative_to(root).parent.as_posix() for p in images] == [
        f"imgs/{i}" for i in range(11)
    ]
    assert [o.split(", line")[0] for o in origins] == [
        str(root / "metadata" / f"{i}.npy") for i in range(11)
    ]


# --------------------------------------------------------------------- malformed files, more


def test_text_table_not_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    path.write_bytes(b"text,label\nfine,1\nbad \xe9 byte,0\n")
    with pytest.raises(ValueError, match="not UTF-8") as err:
        TextTask(path)
    assert_error(err, path, 3)


def test_retrieval_empty_file_and_missing_directory(tmp_path: Path) -> None:
    path = write_aan(tmp_path, [])
    with pytest.raises(ValueError, match="no rows") as err:
        RetrievalTask(tmp_path, "train")
    assert_error(err, path)
    with pytest.raises(FileNotFoundError, match="does not exist") as err:
        RetrievalTask(tmp_path / "missing", "train")
    assert_error(err, tmp_path / "missing")


def test_cifar_empty_and_wrong_pickles(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar(folder)
    batch = folder / "test_batch"
    batch.write_bytes(b"")
    with pytest.raises(ValueError, match="pickle") as err:
        ImageTask(folder, "test")
    assert_error(err, batch)
    batch.write_bytes(pickle.dumps([1, 2, 3], protocol=2))
    with pytest.raises(ValueError, match="dict") as err:
        ImageTask(folder, "test")
    assert_error(err, batch)
    batch.write_bytes(pickle.dumps({b"data": np.zeros((1, 3072), np.uint8)}, protocol=2))
    with pytest.raises(ValueError, match="'labels'") as err:
        ImageTask(folder, "test")
    assert_error(err, batch)
    batch.write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [1]}))
    with pytest.raises(ValueError, match=r"'labels' must have shape \(2,\).*got \(1,\)") as err:
        ImageTask(folder, "test")
    assert_error(err, batch)
    # a scalar (IndexError while the message was built) and a column ("2 labels for 2 images")
    for labels, shape in ((np.int64(1), r"\(\)"), (np.array([[1], [2]]), r"\(2, 1\)")):
        batch.write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": labels}))
        with pytest.raises(
            ValueError, match=rf"must have shape \(2,\), one per image, got {shape}"
        ):
            ImageTask(folder, "test")
    floats = {b"data": np.zeros((2, 3072), np.uint8), b"labels": np.array([1.7, 2.2])}
    batch.write_bytes(pickle.dumps(floats))  # int64 would truncate them to 1, 2
    with pytest.raises(ValueError, match="'labels' must be ints, got dtype float64") as err:
        ImageTask(folder, "test")
    assert_error(err, batch)
    batch.write_bytes(pickle.dumps({b"data": np.zeros((0, 3072), np.uint8), b"labels": []}))
    with pytest.raises(ValueError, match="no images") as err:
        ImageTask(folder, "test")
    assert_error(err, batch)
    # 5 batches of 4 training images: val_fraction 0.01 leaves val none, 0.99 train none
    for split, fraction in (("val", 0.01), ("train", 0.99)):
        with pytest.raises(ValueError, match=f"split '{split}' is empty"):
            ImageTask(folder, split, val_fraction=fraction)
    with pytest.raises(TypeError, match="val_fraction must be a float"):
        ImageTask(folder, "train", val_fraction="0.1")


def test_pathfinder_too_few_samples_for_a_split(tmp_path: Path) -> None:
    write_pathfinder(tmp_path, n_files=1, per_file=3)
    assert len(PathfinderTask(tmp_path, "train")) == 2
    with pytest.raises(ValueError, match=r"split 'test' of .* is empty: 3 images are too few"):
        PathfinderTask(tmp_path, "test")
    with pytest.raises(ValueError, match="split_seed must be an int >= 0"):
        PathfinderTask(tmp_path, "train", split_seed=-1)


def test_pathfinder_binary_metadata_names_the_file(tmp_path: Path) -> None:
    write_pathfinder(tmp_path, n_files=1, per_file=3)
    meta = tmp_path / "pathfinder32" / "curv_contour_length_14" / "metadata" / "0.npy"
    lines = meta.read_bytes().split(b"\n")
    lines[1] = b"\x93NUMPY\x01\x00 not text"
    meta.write_bytes(b"\n".join(lines))
    with pytest.raises(ValueError, match="not UTF-8 text.*despite the .npy name") as err:
        PathfinderTask(tmp_path)
    assert_error(err, meta, 2)


def test_a_byte_order_mark_is_not_data_in_any_text_file(tmp_path: Path) -> None:
    """Text tables took a UTF-8 byte-order mark (an editor's or a spreadsheet's export), the
    other loaders refused it with confusing messages: ListOps a header of '\\ufeffSource',
    AAN a bad label, Pathfinder an image path starting with an invisible character."""
    bom = "\ufeff"
    (tmp_path / "basic_train.tsv").write_text(
        bom + "Source\tTarget\n( ( ( [MIN 1 ) 2 ) ] )\t1\n", encoding="utf-8"
    )
    assert load_task("listops", tmp_path, "train").labels.tolist() == [1]
    path = write_aan(tmp_path / "tsv_data", ["1\tA\tB\tx\ty", "0\tC\tD\tz\tw"])
    path.write_bytes(bom.encode() + path.read_bytes())
    assert load_task("retrieval", tmp_path, "train").labels.tolist() == [1, 0]
    write_pathfinder(tmp_path, n_files=1, per_file=10)
    meta = tmp_path / "pathfinder32" / "curv_contour_length_14" / "metadata" / "0.npy"
    meta.write_text(bom + meta.read_text(), encoding="utf-8")
    splits = [load_task("pathfinder", tmp_path, s) for s in ("train", "val", "test")]
    assert sum(len(ds) for ds in splits) == 10


def test_packed_sequences_refuse_ids_their_dtype_cannot_hold() -> None:
    """Ids were cast to uint8 unchecked: 300 came back as 44, -1 as 255, 1.7 as 1."""
    with pytest.raises(ValueError, match=r"token ids in \[5, 300\] do not fit dtype uint8"):
        PackedSequences([np.array([300, 5])])
    with pytest.raises(ValueError, match="do not fit dtype uint8"):
        PackedSequences([[3], np.array([-1])])
    with pytest.raises(TypeError, match="integer token ids, got dtype float64"):
        PackedSequences([np.array([1.7, 2.0])])
    wide = PackedSequences([np.array([300, 5]), []], dtype=np.int16)
    assert wide[0].tolist() == [300, 5] and wide[1].dtype == np.int16 and len(wide[1]) == 0
    mixed = PackedSequences([[], b"ab", np.array([], dtype=np.int64), [7]])  # [] is float64
    assert [mixed[i].tolist() for i in range(4)] == [[], [97, 98], [], [7]]
    assert mixed.lengths().tolist() == [0, 2, 0, 1] and mixed.data.dtype == np.uint8


def test_a_path_of_the_wrong_type_is_a_type_error_naming_it(tmp_path: Path) -> None:
    """An int path failed inside pathlib ('expected str, bytes or os.PathLike object, not
    int'), and the public readers took it for a file descriptor: they read that descriptor's
    file and closed it, under the caller."""
    from kernelstudy.tasks import read_aan_tsv, read_cifar_batch, read_listops_tsv, read_png

    for name in ("listops", "text", "retrieval", "image", "pathfinder"):
        with pytest.raises(TypeError, match=r"path must be a path \(str or os.PathLike\), got 3"):
            load_task(name, 3)
        with pytest.raises(ValueError, match="path must not be empty"):
            load_task(name, "")  # was the current directory
    table = tmp_path / "basic_train.tsv"
    table.write_text("Source\tTarget\n( ( [MIN 1 ) 2 ] )\t1\n", encoding="utf-8")
    fd = os.open(table, os.O_RDONLY)
    try:
        for read in (read_listops_tsv, lambda p: read_aan_tsv(p, 10), read_cifar_batch, read_png):
            with pytest.raises(TypeError, match="path must be a path"):
                read(fd)
        os.fstat(fd)  # still open
    finally:
        os.close(fd)
    # a negative max_length sliced the last byte off every document, silently
    path = write_aan(tmp_path, ["1\ta\tb\txyz\tuvw"])
    with pytest.raises(ValueError, match="max_length must be an int >= 1, got -1"):
        read_aan_tsv(path, -1)


def test_a_file_where_a_directory_is_expected_is_named_as_such(tmp_path: Path) -> None:
    """A file passed as the data directory was reported 'not found' (it exists), or as
    missing '<file>/basic_train.tsv'."""
    path = write_aan(tmp_path, ["1\ta\tb\tx\ty"])
    for name in ("listops", "retrieval", "image"):  # (a text table is a file by design)
        with pytest.raises(NotADirectoryError, match="is a file") as err:
            load_task(name, path)
        assert_error(err, path)


def test_val_fraction_takes_numpy_floats(tmp_path: Path) -> None:
    """np.float32(0.5) (e.g. from a NumPy grid of fractions) was refused as not a float."""
    write_cifar(tmp_path / "cifar-10-batches-py")
    assert len(ImageTask(tmp_path, "val", val_fraction=np.float32(0.5))) == 10
    with pytest.raises(TypeError, match="val_fraction must be a float"):
        ImageTask(tmp_path, "val", val_fraction=True)


def test_pathfinder_under_the_release_directory(tmp_path: Path) -> None:
    """A flat lra_release/pathfinder32/...: the directory holding it worked for retrieval
    (lra_release/tsv_data) but not for Pathfinder."""
    write_pathfinder(tmp_path / "lra_release", n_files=1, per_file=10)
    direct = PathfinderTask(tmp_path / "lra_release", "val")
    assert PathfinderTask(tmp_path, "val").images == direct.images


def test_shipped_configs_read_the_published_archive_layout(tmp_path: Path) -> None:
    """lra_release.gz unpacks to lra_release/lra_release/{listops-1000,tsv_data,pathfinder32}
    (LRA's own dataset_setup.sh moves them from there), with another listops-1000 and
    pathfinder128 in the outer lra_release/. Unpacked under data/ as the README says, the
    shipped Retrieval and Pathfinder configs pointed at data/lra_release/tsv_data and
    .../pathfinder32, which do not exist there: FileNotFoundError. Every task is found from
    data/, from the outer and from the inner lra_release/."""
    from kernelstudy.search.config import load_config

    outer = tmp_path / "data" / "lra_release"
    inner = outer / "lra_release"
    write_aan(inner / "tsv_data", ["1\tA\tB\tx\ty", "0\tC\tD\tz\tw"])
    write_pathfinder(inner, n_files=1, per_file=10)
    (outer / "pathfinder128").mkdir()
    listops = "Source\tTarget\r\n( ( [MAX 2 ) 9 ) ]\t9\r\n"
    for folder in (outer / "listops-1000", inner / "listops-1000"):
        folder.mkdir(parents=True)
        (folder / "basic_train.tsv").write_text(listops, newline="")
    studies = tmp_path / "studies"
    studies.mkdir()
    repo_studies = Path(__file__).resolve().parents[1] / "studies"
    sizes = {"lra_listops": 1, "lra_retrieval": 2, "lra_pathfinder": 8}
    for name, size in sizes.items():
        (studies / f"{name}.toml").write_bytes((repo_studies / f"{name}.toml").read_bytes())
        config = load_config(studies / f"{name}.toml")
        assert len(load_task(config.task, config.data, "train", **config.task_options)) == size
    for root in (tmp_path / "data", outer, inner):
        assert len(load_task("retrieval", root, "train")) == 2
        assert len(load_task("pathfinder", root, "train")) == 8
        assert len(load_task("listops", root, "train")) == 1
    shutil.rmtree(outer / "listops-1000")  # the inner copy alone: ListOps' config finds it too
    config = load_config(studies / "lra_listops.toml")
    assert len(load_task(config.task, config.data, "train", **config.task_options)) == 1


def test_retrieval_holds_its_documents_once_while_reading(tmp_path: Path) -> None:
    """The reader packs the documents as it reads them: its peak traced memory stays under
    1.5× the packed size (a list of bytes then a concatenation peaked at 2×), and the
    items are those of the list-based reader."""
    import tracemalloc

    from kernelstudy.tasks import read_aan_tsv

    rng = np.random.default_rng(0)
    rows = [
        "\t".join([str(i % 2), f"a{i}", f"b{i}", "x" * int(rng.integers(1500, 2500)), "y" * 2000])
        for i in range(1500)
    ]
    write_aan(tmp_path, rows)
    tracemalloc.start()
    try:
        task = RetrievalTask(tmp_path, "train", max_length=2200)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    packed = task.docs1.data.nbytes + task.docs2.data.nbytes
    assert packed > 5e6
    assert peak < 1.5 * packed, (peak, packed)
    docs1, docs2, labels = read_aan_tsv(task.file, 2200)
    assert len(task) == len(docs1) == 1500
    for i in (0, 1, 777, 1499):
        assert task.docs1[i].tobytes() == docs1[i] and task.docs2[i].tobytes() == docs2[i]
        assert int(task[i]["label"]) == labels[i]
    assert task.docs1.lengths().max() == 2200  # truncated


def test_packed_sequences_from_flat_checks_its_offsets() -> None:
    from kernelstudy.tasks.base import PackedSequences

    packed = PackedSequences.from_flat(np.arange(5, dtype=np.uint8), np.array([0, 2, 2, 5]))
    assert [packed[i].tolist() for i in range(3)] == [[0, 1], [], [2, 3, 4]]
    with pytest.raises(ValueError, match="offsets must run from 0"):
        PackedSequences.from_flat(np.arange(5, dtype=np.uint8), np.array([0, 2]))
    with pytest.raises(ValueError, match="must not decrease"):
        PackedSequences.from_flat(np.arange(5, dtype=np.uint8), np.array([0, 3, 2, 5]))
    with pytest.raises(TypeError, match="1-D integer array"):
        PackedSequences.from_flat(np.zeros(5), np.array([0, 5]))


# --------------------------------------------------------------------- text: does val read test?


def test_a_text_split_says_whether_its_val_reads_the_test_data(imdb: Path, tmp_path: Path) -> None:
    """The report said of every text search that its val split read the test data, though a
    directory of train/val/test tables has a validation split; and a directory without a val
    table fell back to test.* silently. The split now says which, from the source it read."""
    from kernelstudy.tasks.base import SequenceTask

    assert SequenceTask.val_reads_test is False  # other tasks' val splits are their own
    tables = tmp_path / "tables"
    tables.mkdir()
    for split in ("train", "val", "test"):
        (tables / f"{split}.tsv").write_text(f"text\tlabel\n{split} row\t1\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a real validation split: nothing to warn of
        splits = {split: TextTask(tables, split) for split in ("train", "val", "test")}
    assert decode_bytes(splits["val"][0]) == b"val row"
    assert [ds.val_reads_test for ds in splits.values()] == [False, False, False]
    # IMDB has none: val reads aclImdb/test, as in LRA
    assert [TextTask(imdb, s).val_reads_test for s in ("train", "val", "test")] == [
        False,
        True,
        False,
    ]
    # without val.*, val falls back to test.*: it says so, and warns
    (tables / "val.tsv").unlink()
    match = r"has no val\.tsv or val\.csv: split 'val' reads test\.tsv, the test data"
    with pytest.warns(UserWarning, match=match):
        val = TextTask(tables, "val")
    assert val.val_reads_test and decode_bytes(val[0]) == b"test row"
    (tables / "val.csv").write_text("text,label\nheld out,0\n")  # a CSV is a val table too
    assert not TextTask(tables, "val").val_reads_test
    # one file is read for every split, the test split's too
    with pytest.warns(UserWarning, match="one file"):
        assert TextTask(tables / "train.tsv", "val").val_reads_test


def test_rgb_to_gray_needs_three_channels() -> None:
    """Other channel counts were read as r, g, b (4 or 5: silently, the rest dropped) or
    failed indexing (IndexError for 1 or 2)."""
    for shape, axis in (((2, 5), -1), ((2, 2), -1), ((4, 2, 2), 0)):
        with pytest.raises(ValueError, match="rgb must have 3 channels"):
            rgb_to_gray(np.zeros(shape, dtype=np.uint8), channel_axis=axis)
    with pytest.raises(ValueError, match="channel_axis=3 is not an axis"):
        rgb_to_gray(np.zeros((2, 3), dtype=np.uint8), channel_axis=3)
    assert rgb_to_gray(np.zeros((3, 2), dtype=np.uint8), channel_axis=0).shape == (2,)


def test_rgb_to_gray_takes_uint8_and_an_int_axis() -> None:
    """Floats in [0, 1] came out black and 16-bit values clipped to 255; a float or None axis
    failed with an indexing or comparison error, True was read as axis 1."""
    for rgb in (np.full((2, 3), 0.8), np.full((1, 3), 4000, dtype=np.uint16)):
        with pytest.raises(
            TypeError, match=f"rgb must be uint8 \\(0-255\\), got dtype {rgb.dtype}"
        ):
            rgb_to_gray(rgb)
    for axis in (1.0, None, True):
        with pytest.raises(TypeError, match=f"channel_axis must be an int, got {axis}"):
            rgb_to_gray(np.zeros((2, 3, 4), dtype=np.uint8), channel_axis=axis)
    gray = rgb_to_gray(np.zeros((2, 3, 4), dtype=np.uint8), channel_axis=np.int64(1))
    assert gray.shape == (2, 4)


class DeclaredArray:
    """Pickles as an array (or scalar) of a size the file does not hold: ``how`` is
    ``"ndarray"`` (a call ``numpy.ndarray((n, 3072), dtype)``), ``"_reconstruct"`` (NumPy's
    rebuilding function given that shape), ``"object"`` (an object array of n elements set
    from an empty list: a segfault in NumPy) or ``"scalar"`` (a void scalar of n bytes,
    made and zeroed without data)."""

    def __init__(self, n: int, how: str = "ndarray", dtype: type = np.uint8) -> None:
        self.n, self.how, self.dtype = n, how, dtype

    def __reduce__(self):
        rebuild = np.empty(0).__reduce__()[0]
        if self.how == "_reconstruct":
            return (rebuild, (np.ndarray, (self.n, 3072), b"B"))
        if self.how == "object":
            return (rebuild, (np.ndarray, (0,), b"b"), (1, (self.n,), np.dtype("O"), False, []))
        if self.how == "scalar":
            return (np.float64(0).__reduce__()[0], (np.dtype(f"V{self.n}"),))
        return (np.ndarray, ((self.n, 3072), np.dtype(self.dtype)))


@pytest.mark.parametrize("how", ["ndarray", "_reconstruct", "object", "scalar"])
def test_a_cifar_pickle_cannot_declare_an_array_it_does_not_hold(tmp_path: Path, how) -> None:
    """A 150 KB batch calling numpy.ndarray((150000, 3072)) passed the restricted unpickler
    and took 460 MB of uninitialised memory as images (4 GB resident once converted to gray;
    a 1 MB file, 26 GB); a scalar of a 300 MB void dtype took its memory before it was
    refused, and an object array set from too short a list crashed the process. An array is
    now built only empty, then filled from bytes in the file of a plain numeric dtype."""
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar(folder)
    batch = folder / "test_batch"
    n = 300_000_000 if how == "scalar" else 10**7 if how == "object" else 150_000
    crafted = {b"data": DeclaredArray(n, how), b"labels": list(range(10)) * 15_000}
    batch.write_bytes(pickle.dumps(crafted, protocol=2))
    assert batch.stat().st_size < 400_000  # the labels, 2 bytes each
    with pytest.raises(ValueError, match="refusing") as err:
        ImageTask(folder, "test")
    assert_error(err, batch)
