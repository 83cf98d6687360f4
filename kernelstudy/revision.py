"""Which code produced a result: the package version and, run from a git checkout, its commit
(the version alone names every commit of the project alike)."""

from __future__ import annotations

import subprocess
from pathlib import Path

#: The code of a checkout, as git pathspecs from its root: a result's commit is "dirty" when
#: these differ from it. Results, documentation, notebooks and tests do not count: a second
#: run into ``studies/results`` (a tracked folder) was labelled dirty by the first one's rows.
CODE_PATHS = (
    "kernelstudy",
    "csrc",
    "studies",
    "benchmarks",
    "pyproject.toml",
    ":(exclude)studies/results",
    ":(exclude)benchmarks/results",
)


def _git(root: Path, *args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None


def checkout_commit(root: str | Path | None = None) -> str | None:
    """The commit of the git checkout at ``root`` (default: the one this package runs from),
    a 12-digit hash, with ``-dirty`` when tracked files of its code (:data:`CODE_PATHS`)
    differ from it; read at each call (a notebook's later study after a commit). None for an
    installed package, without git, or when git fails (within 10 s)."""
    root = Path(__file__).resolve().parents[1] if root is None else Path(root)
    if not (root / ".git").exists():
        return None
    head = _git(root, "rev-parse", "--short=12", "HEAD")
    if head is None or head.returncode != 0 or not head.stdout.strip():
        return None
    changed = _git(root, "diff", "--quiet", "HEAD", "--", *CODE_PATHS)
    if changed is None or changed.returncode not in (0, 1):
        return None
    return head.stdout.strip() + ("-dirty" if changed.returncode == 1 else "")


def with_commit(version: str) -> str:
    """``version`` (kernelstudy's), with ``+git.<commit>`` when :func:`checkout_commit` knows
    it (``0.1.0+git.45b4db8c1234.dirty``: a PEP 440 local version)."""
    commit = checkout_commit()
    return version if commit is None else f"{version}+git.{commit.replace('-', '.')}"
