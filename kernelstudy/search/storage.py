"""Optuna storage by URL: an SQLite file by default, any RDB URL (PostgreSQL) to share a study.

Trials send a heartbeat; a trial whose worker dies (crash, kill, lost machine)
stops beating, is marked FAILED after the grace period by the next worker that
looks, and is re-queued with the same parameters, so no trial is lost.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from urllib.parse import parse_qs, quote

import optuna
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from sqlalchemy.engine import make_url

#: Seconds between heartbeats of a running trial, and after which a silent one is failed.
HEARTBEAT_INTERVAL = 10
GRACE_PERIOD = 30
MAX_RETRY = 2


def _default_path(results_dir: str | Path, study: str) -> Path:
    return Path(results_dir) / study / "optuna.db"


def sqlite_url(path: str | Path) -> str:
    """The ``sqlite:///`` URL of the file ``path`` (absolute), percent-encoded: SQLAlchemy
    reads ``?`` in a URL as the start of its query and decodes ``%XX``, so a results folder
    ``runs?2`` had its study written to a file ``runs`` beside it."""
    return "sqlite:///" + quote(str(Path(path).resolve()), safe="/")


def default_storage_url(results_dir: str | Path, study: str) -> str:
    """``sqlite:///results_dir/study/optuna.db`` (the directory is created)."""
    path = _default_path(results_dir, study)
    path.parent.mkdir(parents=True, exist_ok=True)
    return sqlite_url(path)


def existing_storage_url(results_dir: str | Path, study: str, hint: str) -> str:
    """The :func:`default_storage_url` of a study a search wrote, for commands that only read
    it: FileNotFoundError (``no study database PATH: hint``) when the file does not exist,
    so that none is created empty."""
    path = _default_path(results_dir, study)
    if not path.is_file():
        raise FileNotFoundError(f"no study database {path}: {hint}")
    return sqlite_url(path)


def sqlite_file(url: str) -> Path | None:
    """The file an ``sqlite://`` URL names, as SQLAlchemy reads it (without the query, %XX
    decoded); None for other databases, an in-memory one or a malformed URL."""
    if not (isinstance(url, str) and url.startswith("sqlite") and "://" in url):
        return None
    try:
        path = make_url(url).database or ""
    except Exception:  # malformed: open_storage says so
        return None
    return None if path in ("", ":memory:") else Path(path)


def existing_database(url: str, hint: str) -> str:
    """``url`` for commands that only read a study: FileNotFoundError (``no study database
    PATH: hint``) when it names an SQLite file that does not exist, which opening it would
    create empty (other databases are checked when opened)."""
    path = sqlite_file(url)
    if path is not None and not path.is_file():
        raise FileNotFoundError(f"no study database {path}: {hint}")
    return url


#: The connect-timeout argument of the database drivers that take one (seconds), by
#: SQLAlchemy driver name; other drivers get none (an unknown argument fails their connect).
CONNECT_TIMEOUT_ARGUMENT = {
    "psycopg2": "connect_timeout",
    "psycopg": "connect_timeout",
    "pg8000": "timeout",
    "mysqldb": "connect_timeout",
    "pymysql": "connect_timeout",
    "mysqlconnector": "connection_timeout",
}


def engine_options(url: str) -> dict:
    """SQLAlchemy engine keyword arguments for the storage at ``url``: SQLite waits 60 s for
    a lock (several worker processes write to one file); a server database is pinged before
    a pooled connection is reused, and its driver, where it takes one, gives up connecting
    after 10 s (PostgreSQL's and MySQL's drivers name that argument differently)."""
    if url.startswith("sqlite"):
        return {"connect_args": {"timeout": 60}}
    options: dict = {"pool_pre_ping": True}
    try:
        driver = make_url(url).get_driver_name()
    except Exception:  # a malformed URL: open_storage names it when the engine is made
        return options
    argument = CONNECT_TIMEOUT_ARGUMENT.get(driver)
    if argument is not None:
        options["connect_args"] = {argument: 10}
    return options


def _in_memory(url: str) -> bool:
    """Whether SQLite URL ``url`` names an in-memory database: no path, ``:memory:``, or a
    URI filename with ``mode=memory`` or ``:memory:`` (``sqlite:///file::memory:?uri=true``)."""
    rest = url.partition("://")[2].lstrip("/")
    path, _, query = rest.partition("?")
    options = parse_qs(query)
    uri = options.get("uri", ["false"])[-1].lower() in ("true", "1")
    if path in ("", ":memory:"):
        return True
    if not uri:
        return False
    name, _, file_query = path.removeprefix("file:").partition("?")
    mode = {**options, **parse_qs(file_query)}.get("mode", [""])[-1]
    return name in ("", ":memory:") or mode == "memory"


def open_storage(
    url: str,
    heartbeat_interval: int = HEARTBEAT_INTERVAL,
    grace_period: int = GRACE_PERIOD,
    max_retry: int = MAX_RETRY,
    writable: bool = False,
) -> RDBStorage:
    """An Optuna RDB storage for ``url``, checked now (not at the first trial).

    Raises ``ValueError`` naming the URL when it is malformed, its driver is
    missing or the database cannot be reached; with ``writable`` (a search), also when a
    SQLite file takes no writes (a read-only one serves reports and evaluations).
    """
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"storage must be a database URL such as sqlite:///study.db, got {url!r}")
    if url.startswith("sqlite") and _in_memory(url):
        raise ValueError(
            f"storage {url!r} is an in-memory database, which every worker and command opens "
            "afresh (the trials would be lost): give a file, e.g. sqlite:///results/study.db"
        )
    engine_kwargs = engine_options(url)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            storage = RDBStorage(
                url,
                engine_kwargs=engine_kwargs,
                heartbeat_interval=heartbeat_interval,
                grace_period=grace_period,
                heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(
                    max_retry=max_retry
                ),
            )
    except ImportError as err:
        raise ValueError(f"storage {redact(url)}: database driver missing ({err})") from err
    except Exception as err:  # sqlalchemy's OperationalError, ArgumentError, ...
        raise ValueError(f"storage {redact(url)} cannot be opened: {_first_line(err)}") from err
    if writable and url.startswith("sqlite"):
        _check_sqlite_writable(storage, url)
    return storage


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _check_sqlite_writable(storage: RDBStorage, url: str) -> None:
    """ValueError naming the URL unless the SQLite file takes writes (its folder, for the
    journal, too): a read-only one failed at the first trial's commit, in Optuna's traceback.
    A table made and rolled back: the file is left as it was."""
    raw = storage.engine.raw_connection()
    try:
        cursor = raw.cursor()
        cursor.execute("BEGIN IMMEDIATE")
        try:
            cursor.execute("CREATE TABLE kernelstudy_write_probe (x INTEGER)")
        finally:
            raw.rollback()
    except Exception as err:  # sqlite3.OperationalError: readonly, disk full, ...
        if "locked" in str(err):  # another worker writing past the busy timeout: writable
            return
        raise ValueError(
            f"storage {redact(url)} takes no writes: {_first_line(err)} (is its folder "
            "read-only or full?)"
        ) from err
    finally:
        raw.close()


def redact(url: str) -> str:
    """The URL without its password (in the credentials, which may hold ``?``, or a
    ``password=`` query parameter), for messages."""
    url = re.sub(r"^([\w+.-]+://[^:/@?#]*:)[^@]*@", r"\1***@", url)
    return re.sub(r"(?i)([?&]password=)[^&]*", r"\1***", url)


def load_study(url: str, name: str) -> optuna.Study:
    """An existing study ``name`` from ``url`` (``ValueError`` listing the studies there)."""
    storage = open_storage(existing_database(url, "run `kernelstudy search CONFIG` first"))
    names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
    if name not in names:
        held = ", ".join(names) or "no studies"
        raise ValueError(
            f"no study {name!r} in {redact(url)} (it holds: {held}); run "
            "`kernelstudy search CONFIG` first"
        )
    return optuna.load_study(study_name=name, storage=storage)
