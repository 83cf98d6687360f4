"""Atomic writes: all or nothing, with the permissions a plain ``open`` would give."""

from __future__ import annotations

import os
import stat
import time

import pytest

from kernelstudy.files import (
    FolderBusy,
    atomic_write,
    atomic_write_text,
    exclusive_folder,
    output_file_problem,
    remove_abandoned_files,
)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_new_files_get_the_umask_permissions_not_the_temp_files(tmp_path):
    """Results were written 0o600 (mkstemp's mode), unreadable to the rest of a group
    sharing a results folder."""
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "shared.md", "x")
        os.umask(0o077)
        atomic_write_text(tmp_path / "private.md", "x")
    finally:
        os.umask(old)
    assert mode(tmp_path / "shared.md") == 0o644
    assert mode(tmp_path / "private.md") == 0o600


def test_a_rewritten_file_keeps_its_permissions(tmp_path):
    path = tmp_path / "table.csv"
    atomic_write_text(path, "a\n")
    os.chmod(path, 0o640)
    atomic_write_text(path, "b\n")
    assert mode(path) == 0o640 and path.read_text() == "b\n"


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path):
    path = tmp_path / "table.csv"
    atomic_write_text(path, "old\n")

    def fail(f) -> None:
        f.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, fail)
    assert path.read_text() == "old\n" and sorted(os.listdir(tmp_path)) == ["table.csv"]


def test_a_locked_folder_loses_the_temporary_files_of_killed_writers(tmp_path):
    """A SIGKILL mid-write left `.checkpoint.pt.<hex>.tmp` (127 MB) or a figure's temp file
    for good: nothing removed them, and they are hidden."""
    stale = tmp_path / ".checkpoint.pt.89d33ad718475313.tmp"
    stale.write_bytes(b"half a checkpoint")
    other = [tmp_path / ".notes.tmp", tmp_path / "run.89d33ad718475313.tmp"]  # not ours
    for path in other:
        path.write_text("keep")
    with exclusive_folder(tmp_path, "a test"):  # clean=False: another writer's may be live
        assert stale.exists()
    with exclusive_folder(tmp_path, "a test", clean=True):
        assert not stale.exists()
    assert all(path.exists() for path in other)


def test_atomic_writes_temp_file_is_locked_while_written(tmp_path):
    """A live write's temp file is spared by remove_abandoned_files; a killed one's (not
    locked) goes: the trainer, which holds no folder lock, cleans up with it."""
    seen = []

    def write(f) -> None:
        f.write(b"data")
        f.flush()
        seen.extend(remove_abandoned_files(tmp_path, ".*.tmp", min_age_s=0))
        seen.extend(tmp_path.glob(".*.tmp"))

    atomic_write(tmp_path / "checkpoint.pt", write)
    assert [p.name.startswith(".checkpoint.pt.") for p in seen] == [True]  # listed, not removed
    killed = tmp_path / ".checkpoint.pt.89d33ad718475313.tmp"
    killed.write_bytes(b"half")
    assert remove_abandoned_files(tmp_path, ".*.tmp") == [killed]


def test_a_table_replaced_while_it_is_read_keeps_its_ids_with_its_rows(tmp_path, monkeypatch):
    """The table was parsed twice from the file (its text columns again, verbatim): a study
    replacing results.csv in between (``--force`` moves a config's rows to the end) paired
    one version's config ids with the other's rows."""
    import pandas as pd

    from kernelstudy.files import read_csv_table

    path = tmp_path / "results.csv"
    path.write_text("config_id,x\n0a,1\n0b,2\n")
    real = pd.read_csv

    def read_then_replace(*args, **kwargs):
        frame = real(*args, **kwargs)
        path.write_text("config_id,x\n0b,2\n0a,1\n")  # as a concurrent writer does
        return frame

    monkeypatch.setattr(pd, "read_csv", read_then_replace)
    table = read_csv_table(path, text_columns=["config_id"])
    assert table[["config_id", "x"]].values.tolist() == [["0a", 1], ["0b", 2]]
    assert read_csv_table(tmp_path / "missing" / "x.csv") is None


def test_a_results_row_cut_short_is_named_not_read_as_nan(tmp_path):
    """pandas reads a row with fewer fields than the header as a whole row with NaN cells:
    a resumed study took that configuration for done. Quoted commas and line breaks, blank
    lines and a byte-order mark are still whole rows."""
    import pandas as pd

    from kernelstudy.files import read_csv_table

    path = tmp_path / "results.csv"
    frame = pd.DataFrame({"config_id": ["0a", "0b"], "note": ["a, b", "two\nlines"], "x": [1, 2]})
    path.write_bytes(b"\xef\xbb\xbf" + frame.to_csv(index=False).encode() + b"\n")
    assert read_csv_table(path, ["config_id"]).values.tolist() == frame.values.tolist()
    path.write_text("config_id,note,x\n0a,a,1\n0b,b")
    with pytest.raises(ValueError, match=r"results\.csv .*line 3 has 2 fields, the header 3"):
        read_csv_table(path)
    # a field beyond the csv module's size limit (131072), which pandas reads: as before
    path.write_text(f"config_id,note,x\n0a,{'y' * 140_000},1\n")
    assert read_csv_table(path)["note"].str.len().tolist() == [140_000]


@pytest.mark.parametrize("version", ["2.0.3", "3.1.1"])
def test_results_tables_read_their_floats_back_exactly(tmp_path, monkeypatch, version):
    """pandas 2's default float parser stops near 17 digits: a third of the values read
    back changed (0.00010431555301711822 -> 0.0001043155530171), and a resumed study
    rewrote them. Under pandas 2 the exact parser is asked for (pandas 3's default is
    exact, and it deprecates the option)."""
    import pandas as pd

    from kernelstudy.files import read_csv_table

    values = [0.00010431555301711822, 0.001136927804120275, 1 / 3, 2.0**-1074]
    path = tmp_path / "results.csv"
    pd.DataFrame({"value": values}).to_csv(path, index=False)
    real, seen = pd.read_csv, []
    real_pandas_2 = pd.__version__.startswith("2.")
    if real_pandas_2 and not version.startswith("2."):
        pytest.skip("pandas 2's parser, not asked for round_trip, rounds: pandas 3's case")

    def read_csv(*args, **kwargs):
        seen.append(kwargs.get("float_precision"))
        if not real_pandas_2:  # pandas 3 deprecates the option (its default parser is exact)
            kwargs.pop("float_precision", None)
        return real(*args, **kwargs)

    monkeypatch.setattr(pd, "__version__", version)
    monkeypatch.setattr(pd, "read_csv", read_csv)
    assert seen == [] and read_csv_table(path)["value"].tolist() == values
    assert seen == (["round_trip"] if version.startswith("2.") else [None])


def test_an_output_file_is_checked_before_a_run_and_the_check_leaves_nothing(tmp_path):
    """For the benchmarks' --out, before minutes of measuring rather than after them."""
    (tmp_path / "file").write_text("")
    assert output_file_problem(tmp_path) == "is a folder; give a file path"
    assert (
        output_file_problem(tmp_path / "file" / "x.csv") == f"{tmp_path / 'file'} is not a folder"
    )
    assert output_file_problem(tmp_path / "new" / "deeper" / "x.csv") is None  # made on write
    assert output_file_problem(tmp_path / "file") is None  # replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # no probe, no folder
    if os.path.isdir("/proc/self"):  # a folder that takes no new file, even for root
        assert output_file_problem("/proc/x.csv").startswith("cannot write in /proc")


def test_a_name_near_the_length_limit_is_written(tmp_path):
    """The temp file's name (the name, a dot, 16 hex digits, .tmp) passed 255 characters for
    names of 234 or more: OSError 'File name too long' for a name the folder takes."""
    path = tmp_path / ("x" * 250 + ".csv")
    atomic_write_text(path, "a\n")
    assert path.read_text() == "a\n" and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_symlink_is_written_through_and_stays_a_link(tmp_path):
    """The rename replaced the link itself with a file, so a results file linked from
    elsewhere (a shared folder) stopped being shared."""
    (tmp_path / "shared").mkdir()
    target = tmp_path / "shared" / "table.csv"
    target.write_text("old\n")
    link = tmp_path / "table.csv"
    link.symlink_to(target)
    atomic_write_text(link, "new\n")
    assert link.is_symlink() and target.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared", "table.csv"]


def test_the_folder_is_synced_after_the_rename(tmp_path, monkeypatch):
    """Without the folder's fsync, a crash soon after a write could leave the old name."""
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    atomic_write_text(tmp_path / "a.txt", "a\n")
    assert synced == [False, True]  # the file's data, then its folder


def test_remove_abandoned_files_spares_empty_files_younger_than_min_age(tmp_path):
    """An empty unlocked file changed less than min_age_s ago may be one whose writer has not
    locked it yet: it stays. The same file, older, is removed. A non-empty unlocked one was
    written, so locked, by a writer now gone: removed at once (a rerun within the minute
    after a kill left the killed run's 138 MB .partial file)."""
    fresh = tmp_path / "a.partial"
    fresh.write_bytes(b"")
    assert remove_abandoned_files(tmp_path, "*.partial", min_age_s=60.0) == []
    assert fresh.exists()
    old = time.time() - 120
    os.utime(fresh, (old, old))
    assert remove_abandoned_files(tmp_path, "*.partial", min_age_s=60.0) == [fresh]
    assert not fresh.exists()
    written = tmp_path / "b.partial"
    written.write_bytes(b"x")
    assert remove_abandoned_files(tmp_path, "*.partial", min_age_s=60.0) == [written]


def test_a_lock_file_of_another_user_is_locked_read_only(tmp_path, monkeypatch):
    """A shared folder where another user made .lock (0644 under their umask): opening it to
    append failed with 'Permission denied', though flock needs no write access."""
    import kernelstudy.files as files

    (tmp_path / ".lock").write_bytes(b"")
    real_open = open

    def no_append(path, mode="r", *args, **kwargs):
        if "a" in mode:  # as for a user without write permission (root has it regardless)
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(files, "open", no_append, raising=False)
    with exclusive_folder(tmp_path, "a test"):
        with pytest.raises(FolderBusy), exclusive_folder(tmp_path, "another"):
            pass  # the read-only handle holds the lock


def test_the_write_probe_is_no_temporary_file_another_runs_clean_up_deletes(tmp_path, monkeypatch):
    """A run that had just taken a folder's lock removed the temporary files of killed
    writers, the second run's write probe among them: "cannot write in DIR (No such file
    or directory)" instead of naming the run that holds the folder."""
    import kernelstudy.files as files

    real_close = os.close
    removed = []

    def close_then_clean(fd):
        real_close(fd)
        removed.extend(files.remove_stale_temporary_files(tmp_path))

    monkeypatch.setattr(files.os, "close", close_then_clean)
    assert output_file_problem(tmp_path / "results.csv") is None
    assert removed == [] and list(tmp_path.iterdir()) == []


def test_a_write_that_fails_without_a_file_name_names_the_file(tmp_path):
    """A full disk during the write said only "[Errno 28] No space left on device"."""
    import errno

    def full(f):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match=r"No space left on device: '.*results\.csv'") as caught:
        atomic_write(tmp_path / "results.csv", full)
    assert caught.value.errno == errno.ENOSPC and list(tmp_path.iterdir()) == []


def test_a_checkpoint_that_fails_on_a_full_disk_names_the_file(tmp_path, monkeypatch):
    """torch.save turns the disk's OSError into a RuntimeError ("unexpected pos ...") that
    names neither the file nor the cause."""
    import errno

    def full(f):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos") from None

    with pytest.raises(OSError, match=r"No space left on device: '.*checkpoint\.pt'"):
        atomic_write(tmp_path / "checkpoint.pt", full)

    class DeviceError(OSError):  # another constructor: the original is raised, with its name
        def __init__(self, message):
            super().__init__(errno.EIO, message)

    def broken(f):
        raise DeviceError("sector 7")

    with pytest.raises(DeviceError, match=r"sector 7: '.*x\.bin'"):
        atomic_write(tmp_path / "x.bin", broken)


def test_atomic_write_text_takes_a_str(tmp_path):
    """bytes failed as "'bytes' object has no attribute 'encode'", after the temp file."""
    with pytest.raises(TypeError, match="text must be a str, got bytes"):
        atomic_write_text(tmp_path / "a.txt", b"x")
    assert list(tmp_path.iterdir()) == []


def test_folder_in_use_probes_without_turning_a_run_away(tmp_path):
    """load_results asks whether a run holds a results folder (its note said "interrupted"
    and gave a command the lock refused); the probe holds the lock for an instant, and a
    run starting then waits that instant instead of being refused as a second run."""
    import fcntl
    import threading

    from kernelstudy.files import FolderBusy, exclusive_folder, folder_in_use

    assert not folder_in_use(tmp_path)  # no lock file
    with exclusive_folder(tmp_path, "a study"):
        assert folder_in_use(tmp_path)
    assert not folder_in_use(tmp_path)
    with open(tmp_path / ".lock", "rb") as probe:
        fcntl.flock(probe.fileno(), fcntl.LOCK_SH)  # a probe at the moment the run starts
        threading.Timer(0.05, fcntl.flock, (probe.fileno(), fcntl.LOCK_UN)).start()
        with exclusive_folder(tmp_path, "a study"):
            pass
        fcntl.flock(probe.fileno(), fcntl.LOCK_SH)  # held on: a real holder
        with pytest.raises(FolderBusy), exclusive_folder(tmp_path, "a study"):
            pass


def test_writes_and_locks_work_without_fchmod_and_fcntl_as_on_windows(tmp_path, monkeypatch):
    """Windows (Python < 3.13) has no ``os.fchmod`` and no ``fcntl``: every rewrite of a file
    raised AttributeError, a lock's duplicate descriptor stayed open over the rename (which
    Windows refuses), and the folder lock did nothing without a word."""
    import kernelstudy.files as files

    path = tmp_path / "table.csv"
    atomic_write_text(path, "a\n")
    path.chmod(0o640)
    monkeypatch.delattr(os, "fchmod")
    monkeypatch.setattr(files, "fcntl", None)
    with open(os.devnull, "rb") as f:
        assert files.lock_while_written(f.fileno()) is None
    atomic_write_text(path, "b\n")
    assert path.read_text() == "b\n" and stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["table.csv"]
    with pytest.warns(RuntimeWarning, match="no file locks on this system"):
        with files.exclusive_folder(tmp_path, "a test"):
            pass


def test_the_package_and_its_command_line_load_without_the_resource_module():
    """``import resource`` (none on Windows) at the top of the training metrics stopped
    every ``kernelstudy`` command, also ``--help``; the CPU peak memory is now unavailable
    there instead."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['resource'] = None\n"
        "import torch\n"
        "from kernelstudy.cli import build_parser\n"
        "from kernelstudy.train.metrics import peak_memory\n"
        "build_parser()\n"
        "print(peak_memory(torch.device('cpu')))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "'peak_memory_bytes': None, 'peak_memory_source': 'unavailable'" in run.stdout
